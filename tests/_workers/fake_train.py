"""A stand-in for `rl-jax train` that honours its file contract, without JAX.

    python fake_train.py RECIPE key=value ...

Writes <out_dir>/<name>/{config.json, curve.jsonl, metrics.jsonl, DONE} and
checkpoints/<step>.json; resumes from the newest checkpoint (rewinding the
curve to it); exits 0 at once if DONE exists. Curve values depend only on the
config and the step, so a resumed run writes the same rows as an uninterrupted
one. Test hooks (environment):
  FAKE_SLEEP=s         seconds per step
  FAKE_FAIL_ONCE_AT=k  exit 1 (a crash) at step k the first time each run gets there
  FAKE_FAIL_ALWAYS=rc  exit rc before the first step
  FAKE_LEDGER=path     append "<run_id> start <step>" / "<run_id> done" lines
  FAKE_BAD_N=n         runs with sampling.n == n saturate far lower (early-stop tests)
  FAKE_HOLD=path       before finishing (DONE), wait until this file exists
  FAKE_LEGACY_IDS=1    run under ids of the first id version (tests/_workers/legacy_ids.py)
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time

if os.environ.get("FAKE_FAIL_ALWAYS"):  # before the imports: failing fast keeps tests fast
    print("fake trainer: told to fail", file=sys.stderr)
    sys.exit(int(os.environ["FAKE_FAIL_ALWAYS"]))

from rl_jax.config import flatten, load_recipe, run_id  # noqa: E402
from rl_jax.runs import create_run_dir  # noqa: E402


def ledger(line: str) -> None:
    path = os.environ.get("FAKE_LEDGER")
    if path:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.write(fd, (line + "\n").encode())
        os.close(fd)


def metric(cfg, rollouts: float) -> float:
    """A sigmoid in log rollouts; larger n saturates higher, larger B_p starts faster."""
    n, bp = cfg.sampling.n, cfg.data.prompts_per_batch
    a = 0.5 + 0.1 * math.log2(n) / 4 + (0.02 if cfg.loss.name == "cispo" else 0.0)
    if str(n) == os.environ.get("FAKE_BAD_N"):
        a = 0.3
    c_mid = 40.0 * math.sqrt(n) * (1 + 2.0 / bp)
    r0 = 0.1
    r = r0 + (a - r0) / (1 + (c_mid / rollouts) ** 1.5) if rollouts > 0 else r0
    # The noise of the run's config (today's id of it), whatever id its directory carries:
    # a run taken up from an earlier id version continues the same curve.
    key = f"{run_id(cfg)}:{rollouts}"
    noise = int(hashlib.sha256(key.encode()).hexdigest()[:6], 16) / 16**6
    return round(min(1.0, r + 0.01 * (noise - 0.5)), 6)


def main(argv: list[str]) -> int:
    if os.environ.get("FAKE_LEGACY_IDS"):
        from legacy_ids import use_legacy_ids

        use_legacy_ids(modules=("rl_jax.runs.run_dir",))  # without JAX, as the fake runs
    cfg = load_recipe(argv[0], argv[1:])
    rd = create_run_dir(cfg)
    if rd.is_done():
        rd.close()
        return 0
    rid = rd.run_id
    steps_done = sorted(
        int(n.split(".")[0]) for n in rd.store.list("checkpoints") if n.endswith(".json")
    )
    start = steps_done[-1] if steps_done else 0
    rd.rewind(start if steps_done else -1)
    ledger(f"{rid} start {start}")
    knobs = flatten(cfg)
    per_step = cfg.data.prompts_per_batch * cfg.sampling.n
    steps, every = cfg.train.steps, cfg.eval.every
    fail_at = int(os.environ.get("FAKE_FAIL_ONCE_AT", "-1"))
    sleep = float(os.environ.get("FAKE_SLEEP", "0"))
    ck_every = cfg.checkpoint.every or steps
    for step in range(start, steps + 1):
        if step > start:
            time.sleep(sleep)
        marker = ".fake_failed_once"
        if step == fail_at and not rd.store.exists(marker):
            rd.store.write(marker, b"x")
            print(f"fake trainer: failing at step {step}", file=sys.stderr)
            return 1
        evaluate = (step == 0 and cfg.eval.at_start) or step == steps
        evaluate |= every > 0 and step > 0 and step % every == 0
        rollouts = step * per_step
        if evaluate and step > (start if steps_done else -1):
            row = {
                "run_id": rid,
                "step": step,
                **knobs,
                "rollouts": rollouts,
                "prompt_tokens": rollouts * 8,
                "generated_tokens": rollouts * cfg.sampling.max_new_tokens,
                "sampler_flops": rollouts * 1e6,
                "trainer_flops": rollouts * 3e6,
                "flops": rollouts * 4e6,
                "device_seconds": step * 0.01,
                "val/pass@1": metric(cfg, rollouts),
                "val/best@k": min(1.0, metric(cfg, rollouts) * 1.5),
                "val/worst@k": metric(cfg, rollouts) * 0.5,
                "train/reward": metric(cfg, rollouts),
            }
            rd.append_curve(row)
            rd.append_metrics({"step": step, "train/reward": row["train/reward"]})
        if step > start and (step % ck_every == 0 or step == steps):
            rd.flush()  # rows before the checkpoint, as the trainer does
            rd.store.write(f"checkpoints/{step}.json", json.dumps({"step": step}).encode())
    hold = os.environ.get("FAKE_HOLD")
    while hold and not os.path.exists(hold):  # released by the test, whatever the machine's speed
        time.sleep(0.02)
    rd.mark_done({"run_id": rid, "steps": steps, "curve_rows": len(rd.curve())})
    rd.close()
    ledger(f"{rid} done")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
