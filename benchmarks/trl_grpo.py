"""TRL's GRPOTrainer on the reference workload, driven step by step (a `rl_step.py` worker).

Runs in its own virtual environment (torch CPU + TRL + transformers, no JAX):

    python benchmarks/trl_grpo.py --model HF_DIR --problems problems.json [--smoke]

The workload mirrors rl_step.py's: 8 prompts x 8 samples (64 rows per step),
max_completion_length 64 with EOS suppressed until then (min_new_tokens), reward
1 if the completion starts with the right answer, loss_type='grpo', beta=0 (no
reference model), one optimizer step per generation (steps_per_generation=1,
num_iterations=1), AdamW, float32. After each optimizer step a callback reports
`@@ {json}` (step wall time, generation and reward time) and waits for the
driver's next command on stdin (see _common.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time

_T0 = time.perf_counter()
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import emit, load_avg, peak_rss_mb, wait_command  # noqa: E402

_LEADING = re.compile(r"\s{0,16}(-?[0-9]{1,64})")


def arith_reward(completions, answer, **_):
    """1 if the completion starts with the answer (rl_jax's `arith` verifier)."""
    out = []
    for c, a in zip(completions, answer, strict=True):
        m = _LEADING.match(c[:96])
        out.append(1.0 if m and m.group(1) == a.strip() else 0.0)
    return out


class _Stop(Exception):
    pass


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="HF model directory with its tokenizer")
    p.add_argument("--problems", required=True, help="JSON {'problems': [{prompt, answer}]}")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    a = p.parse_args()

    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    if a.threads:
        torch.set_num_threads(a.threads)
    P, G, T = (2, 2, 8) if a.smoke else (8, 8, 64)
    with open(a.problems) as f:
        probs = json.load(f)["problems"]
    ds = Dataset.from_list([{"prompt": x["prompt"], "answer": x["answer"]} for x in probs])
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    out = tempfile.mkdtemp(prefix="trl_grpo_")
    cfg = GRPOConfig(
        output_dir=out,
        per_device_train_batch_size=P * G,
        gradient_accumulation_steps=1,
        num_generations=G,
        steps_per_generation=1,
        num_iterations=1,
        max_completion_length=T,
        generation_kwargs={"min_new_tokens": T},  # forced length, as rl_jax's
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        loss_type="grpo",
        learning_rate=1e-6,
        weight_decay=0.01,
        max_grad_norm=1.0,
        max_steps=100000,  # the driver stops it
        use_cpu=a.device == "cpu",
        bf16=False,
        fp16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    st = {"resume": None, "first": True, "sample": 0.0, "score": 0.0}

    class Driver(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            st["resume"] = time.perf_counter()
            st["train_begin"] = st["resume"]

        def on_step_end(self, args, state, control, **kw):
            if a.device == "cuda":
                torch.cuda.synchronize()  # the step's kernels are done
            now = time.perf_counter()
            rec = {
                "step_s": now - st["resume"],
                "sample_s": st["sample"],
                "score_s": st["score"],
                "train_s": now - st["resume"] - st["sample"] - st["score"],
                "load_avg_1m": load_avg(),
            }
            if st["first"]:
                st["first"] = False
                rec.update(first=True, startup_s=now - _T0, init_s=st["init_s"])
                rec["version"] = trl.__version__
            emit(rec)
            if wait_command() == "stop":
                raise _Stop
            st["sample"] = st["score"] = 0.0
            st["resume"] = time.perf_counter()

    t = time.perf_counter()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=arith_reward,
        args=cfg,
        train_dataset=ds,
        processing_class=tok,
        callbacks=[Driver()],
    )
    st["init_s"] = time.perf_counter() - t
    _time_method(trainer, "_generate_single_turn", st, "sample")
    _time_method(trainer, "_calculate_rewards", st, "score")
    try:
        trainer.train()
    except _Stop:
        pass
    emit({"final": True, "peak_rss_mb": peak_rss_mb()})
    return 0


def _time_method(obj, name: str, st: dict, key: str) -> None:
    fn = getattr(obj, name)

    def timed(*args, **kw):
        t = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            st[key] += time.perf_counter() - t

    setattr(obj, name, timed)


if __name__ == "__main__":
    sys.exit(main())
