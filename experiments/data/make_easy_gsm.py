"""Writes easy_gsm.jsonl: one-step grade-school word problems in GSM8K's layout.

    {"question": "Mia has 3 apples. She buys 2 more. How many apples does Mia have now?",
     "answer": "Mia has 3 + 2 = 5 apples.\\n#### 5"}

Sized for SmolLM2-135M-Instruct on a CPU: one addition or subtraction of numbers up to
--max-number (3: sums up to 6), so the model solves some at the recipe's 16 new tokens
(docs/results/real_model.md has the measured pass rates: 12.6% over this file's 1,000 problems;
7.0% with numbers up to 10) and RL has signal from the first batch.
Deterministic in --seed:

    python experiments/data/make_easy_gsm.py            # rewrites experiments/data/easy_gsm.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NAMES = ["Mia", "Tom", "Ava", "Leo", "Sara", "Ben", "Lily", "Max", "Emma", "Sam", "Nora", "Jack"]
# Things a person can have, buy and give away (plural: every question counts several).
THINGS = ["apples", "pencils", "books", "stickers", "marbles", "cookies", "cards", "balloons"]
SHE = {"Mia": "She", "Ava": "She", "Sara": "She", "Lily": "She", "Emma": "She", "Nora": "She"}

# Each template: (question, worked answer, op) with {n} name, {p} pronoun, {t} thing,
# {a} {b} operands; op gives the result from a and b.
TEMPLATES = [
    (
        "{n} has {a} {t}. {p} buys {b} more. How many {t} does {n} have now?",
        "{n} has {a} + {b} = {r} {t}.",
        "+",
    ),
    (
        "{n} has {a} {t}. A friend gives {n} {b} more {t}. How many {t} does {n} have now?",
        "{n} has {a} + {b} = {r} {t}.",
        "+",
    ),
    (
        "There are {a} {t} in a box and {b} {t} on the table. How many {t} are there in all?",
        "There are {a} + {b} = {r} {t}.",
        "+",
    ),
    (
        "{n} has {a} {t}. {p} gives away {b} of them. How many {t} does {n} have left?",
        "{n} has {a} - {b} = {r} {t} left.",
        "-",
    ),
    (
        "{n} had {a} {t} and lost {b}. How many {t} does {n} have now?",
        "{n} has {a} - {b} = {r} {t}.",
        "-",
    ),
]


def problem(rng: random.Random, max_number: int) -> dict[str, str]:
    q, worked, op = rng.choice(TEMPLATES)
    a, b = rng.randint(2, max_number), rng.randint(1, max_number)
    if op == "-":
        a, b = max(a, b) + 1, min(a, b)
    r = a + b if op == "+" else a - b
    name = rng.choice(NAMES)
    fields = dict(n=name, p=SHE.get(name, "He"), t=rng.choice(THINGS), a=a, b=b, r=r)
    return {"question": q.format(**fields), "answer": worked.format(**fields) + f"\n#### {r}"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(Path(__file__).with_name("easy_gsm.jsonl")))
    p.add_argument("--count", type=int, default=1000)
    p.add_argument("--max-number", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    rng = random.Random(a.seed)
    rows, seen = [], set()
    while len(rows) < a.count:
        row = problem(rng, a.max_number)
        if row["question"] not in seen:
            seen.add(row["question"])
            rows.append(row)
    Path(a.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} problems to {a.out}")


if __name__ == "__main__":
    main()
