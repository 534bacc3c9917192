"""Kill a training run at random moments, rerun it each time, compare with a run never killed.

For each off-policy mode and checkpoint interval: one uninterrupted reference
run (timed after a first run filled the compilation cache), then one run killed
with SIGKILL --kills times (each kill at a random
moment of a run's wall time, every other one as soon as a checkpoint save is
under way: orbax's temporary directory exists) and rerun after every kill with
the same command until it finishes. Its metrics.jsonl and curve.jsonl are
compared with the reference's, less wall-clock timings and the run name.
One JSON line per (mode, interval), then a summary line:

    {"mode": "pipeline", "every": 3, "kills": 10, "kills_in_save": 5,
     "identical": true, "rows_lost": 0, "rows_duplicated": 0, ...}

The run is the tests' tiny ScaleRL run (tests/_workers/train_even_first.py: a
verifier that gives a random policy a learning signal), 8 steps, evaluated
every 2 steps.

    python benchmarks/resume_check.py [--kills 10]
        [--modes on_policy,ppo_off_policy,pipeline]
                                      [--every 2,3] [--seed 0]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tests" / "_workers"))

from _common import worker_env  # noqa: E402
from train_even_first import TINY_RUN  # noqa: E402

from rl_jax.runs import read_jsonl  # noqa: E402

WORKER = ROOT / "tests" / "_workers" / "train_even_first.py"
MODES = {
    "on_policy": ["train.off_policy=on_policy", "train.off_policy_k=1"],
    "ppo_off_policy": ["train.off_policy=ppo_off_policy", "train.off_policy_k=2"],
    # PipelineRL: a continuous stream on the engine (it drains at every checkpoint).
    "pipeline": ["train.off_policy=pipeline", "train.off_policy_k=2", "sampling.decode_chunk=2"],
}
DROP = ("time/", "device_seconds", "eval_device_seconds")


def command(out: Path, name: str, mode: str, every: int) -> list[str]:
    args = [
        *TINY_RUN,
        *MODES[mode],
        "train.steps=8",
        "eval.every=2",
        f"checkpoint.every={every}",
        f"out_dir={out}",
        f"name={name}",
    ]
    return [sys.executable, str(WORKER), "train", "scalerl", *args, "--quiet"]


def rows(run: Path) -> dict[str, list[dict]]:
    out = {}
    for name in ("metrics.jsonl", "curve.jsonl"):
        out[name] = [
            {
                k: v
                for k, v in r.items()
                if not k.startswith(DROP) and k not in (*DROP, "name", "out_dir")
            }
            for r in read_jsonl(run / name)
        ]
    return out


def saving(run: Path) -> bool:
    ck = run / "checkpoints"
    return ck.exists() and any("tmp" in p.name for p in ck.iterdir())


def kill_once(cmd, env, run: Path, at_s: float, in_save: bool) -> str:
    """Start the command; SIGKILL it after at_s seconds, or at the first save seen after
    at_s / 2 when in_save. Returns how it ended: 'killed', 'killed_in_save' or 'finished'."""
    p = subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    t0 = time.monotonic()
    how = "killed"
    while p.poll() is None:
        t = time.monotonic() - t0
        if in_save and t > at_s / 2 and saving(run):
            how = "killed_in_save"
            break
        if not in_save and t >= at_s:
            break
        time.sleep(0.002 if in_save else 0.01)
    if p.poll() is not None:
        return "finished"
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    return how


def check(out: Path, mode: str, every: int, kills: int, rng: random.Random) -> dict:
    env = worker_env(devices=None)
    # The first run fills the compilation cache; the second, timed, is the reference.
    for name in ("warm", "ref"):
        t0 = time.monotonic()
        ref = subprocess.run(
            command(out, name, mode, every), env=env, capture_output=True, text=True
        )
        if ref.returncode != 0:
            raise RuntimeError(f"reference run failed: {ref.stderr[-2000:]}")
        ref_s = time.monotonic() - t0
    cmd = command(out, "kill", mode, every)
    run = out / "kill"
    ends = collections.Counter()
    for i in range(kills):
        if (run / "DONE").exists():
            break
        ends[kill_once(cmd, env, run, rng.uniform(0.1, 0.9) * ref_s, in_save=i % 2 == 1)] += 1
    last = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if last.returncode != 0:
        raise RuntimeError(f"rerun failed: {last.stderr[-2000:]}")
    a, b = rows(out / "ref"), rows(run)
    lost = dup = 0
    for name in a:
        ca = collections.Counter(r["step"] for r in a[name])
        cb = collections.Counter(r["step"] for r in b[name])
        lost += sum((ca - cb).values())
        dup += sum((cb - ca).values())
    return {
        "mode": mode,
        "every": every,
        "kills": ends["killed"] + ends["killed_in_save"],
        "kills_in_save": ends["killed_in_save"],
        "finished_before_kill": ends["finished"],
        "identical": a == b,
        "rows_lost": lost,
        "rows_duplicated": dup,
        "reference_s": round(ref_s, 1),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=10)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--every", default="2,3")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    rng = random.Random(a.seed)
    results = []
    with tempfile.TemporaryDirectory(prefix="resume_check_") as tmp:
        for mode in a.modes.split(","):
            for every in (int(e) for e in a.every.split(",")):
                out = Path(tmp) / f"{mode}-{every}"
                r = check(out, mode, every, a.kills, rng)
                results.append(r)
                print(json.dumps(r), flush=True)
    summary = {
        "configs": len(results),
        "all_identical": all(r["identical"] for r in results),
        "kills": sum(r["kills"] for r in results),
        "kills_in_save": sum(r["kills_in_save"] for r in results),
        "rows_lost": sum(r["rows_lost"] for r in results),
        "rows_duplicated": sum(r["rows_duplicated"] for r in results),
    }
    print(json.dumps(summary), flush=True)
    return 0 if summary["all_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
