"""The CPU demo (`rl-jax demo`): the ScaleRL recipe on the tiny model and the arithmetic task.

1. A short supervised warm-up (cached under .cache/demo) stops at a modest
   greedy pass rate, so that RL has groups with both right and wrong samples.
2. The `scalerl` recipe trains from there, evaluating mean@k on held-out prompts.
3. A report: pass rate before and after RL, the fitted sigmoid (rl_jax.scaling)
   and a PNG of the curve in the run's plots/ directory.
"""

from __future__ import annotations

import hashlib
import io
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np

from rl_jax.config import SamplingConfig, run_id, to_dict
from rl_jax.config.data import BATCH_KNOBS
from rl_jax.runs.atomic import atomic_write_bytes
from rl_jax.runs.plots import draw_curve
from rl_jax.runs.run_dir import find_run_dirs
from rl_jax.runs.storage import join
from rl_jax.train.loop import RLTrainer

CACHE = Path(".cache") / "demo"
# Greedy pass rate checks during the warm-up: often enough to stop near the target
# (the rate climbs steeply once the answer format is learned).
SFT_EVAL_EVERY = 10
# Data knobs that only steer RL batches, not the warm-up: changing them reuses the cache.
_RL_ONLY_DATA = BATCH_KNOBS


def _greedy_eval(trainer, problems):
    from rl_jax.rewards import score_batch
    from rl_jax.sampling import Engine

    tok = trainer.tokenizer
    prompts = [tok.encode(p.prompt) for p in problems]
    answers = [p.answer for p in problems]
    engine = Engine.for_batch(
        trainer.spec,
        SamplingConfig(n=1, temperature=0.0, max_new_tokens=trainer.cfg.sampling.max_new_tokens),
        prompts=len(prompts),
        prompt_len=max(map(len, prompts)),
        mesh=trainer.mesh,
        eos_id=tok.eos_id,
        pad_id=tok.pad_id,
        rules=trainer.cfg.mesh.rules,
    )

    def evaluate(params) -> float:
        rollouts, _ = engine.run(params, prompts, n=1)
        texts = [tok.decode(rollouts.completion(b)) for b in range(rollouts.num_rows)]
        return float(score_batch(trainer.correct_fn, texts, answers).mean())

    return evaluate


def warm_start(trainer, *, target: float, quiet: bool) -> dict:
    """Supervised warm-up of the trainer's initial params (cached by config hash)."""
    from rl_jax.train.sft import supervised_warmup

    cfg = trainer.cfg
    key = json.dumps(
        {
            "model": to_dict(cfg.model),
            "data": {k: v for k, v in to_dict(cfg.data).items() if k not in _RL_ONLY_DATA},
            "seed": cfg.train.seed,
            "target": target,
            "eval_every": SFT_EVAL_EVERY,
        },
        sort_keys=True,
    )
    path = CACHE / f"sft-{hashlib.sha256(key.encode()).hexdigest()[:12]}.npz"
    if path.exists():
        with np.load(path) as z:
            host = {k: z[k] for k in z.files if not k.startswith("__")}
            info = json.loads(str(z["__info"]))
        info["cached"] = True
    else:
        evaluate = _greedy_eval(trainer, list(trainer.task.val)[:64])
        t0 = time.perf_counter()

        def report(step, loss, rate):
            if not quiet:
                print(
                    f"  warm-up step {step:4d}  loss {loss:.3f}  greedy pass {rate:.2f}", flush=True
                )

        params, info = supervised_warmup(
            trainer.spec,
            trainer.policy_weights(),
            trainer.tokenizer,
            trainer.task.train,
            evaluate=evaluate,
            target=target,
            eval_every=SFT_EVAL_EVERY,
            seed=cfg.train.seed,
            on_eval=report,
        )
        info["sft_seconds"] = time.perf_counter() - t0
        host = {k: np.asarray(jax.device_get(v)) for k, v in params.items()}
        # Atomic (a unique temp file, then a rename): concurrent runs (a grid) may warm up
        # the same model at once, and a killed one must not leave a torn cache entry.
        buf = io.BytesIO()
        np.savez(buf, __info=json.dumps(info), **host)
        atomic_write_bytes(path, buf.getvalue())
        info["cached"] = False
    trainer.set_initial_params(host)
    return info


def run_demo(cfg, *, warmup_target: float, quiet: bool):
    """Train `cfg` from the cached supervised warm-up; returns its run.

    One directory per resolved config (`demo_root`): rerunning the same demo reuses its
    finished run, changing a knob starts a new one instead of refusing the old directory.
    """
    root = demo_root(cfg)
    trainer = RLTrainer(cfg, run_root=root, quiet=quiet)
    if trainer.run.read_done() is None:
        if not trainer.try_resume():
            print("supervised warm-up (stops early; RL does the rest) ...", flush=True)
            info = warm_start(trainer, target=warmup_target, quiet=quiet)
            print(
                f"warm-up: {info['sft_steps']} steps, greedy pass {info['sft_greedy_pass']:.2f}"
                + (" (cached)" if info["cached"] else ""),
                flush=True,
            )
        trainer.run_loop()
    return trainer.run


def demo_root(cfg) -> str:
    """<out_dir>/<name>-<run id>, or the directory named for the run's id of an earlier id
    version that holds the run (`rl_jax.runs.run_dir.find_run_dirs`; said on stderr)."""
    rid = run_id(cfg)
    name = f"{cfg.name}-{rid}"
    earlier = find_run_dirs(cfg.out_dir, [(name, rid)]).get(name)
    if earlier is not None:
        print(f"{earlier} holds this run (named for its earlier run id)", file=sys.stderr)
    return join(cfg.out_dir, earlier or name)


def write_report(run, *, x: str, metric: str) -> str:
    """Before/after pass rate, the sigmoid fit and a PNG plot of the curve."""
    rows = run.curve()
    if not rows:
        return "no evaluation rows"
    xs = np.array([r[x] for r in rows], float)
    ys = np.array([r[metric] for r in rows], float)
    lines = [
        f"validation {metric} (mean@{int(rows[0].get('val/k', 0))}): "
        f"before RL {ys[0]:.3f} -> after RL {ys[-1]:.3f} ({100 * (ys[-1] - ys[0]):+.1f} points)",
    ]
    fit = None
    try:
        from rl_jax.scaling import fit_sigmoid

        keep = xs > 0
        fit = fit_sigmoid(xs[keep], ys[keep], r0=float(ys[0]))
        lines.append(
            f"fitted sigmoid over {x}: A={fit.A:.3f}  B={fit.B:.2f}  C_mid={fit.C_mid:.3g}"
        )
        if not fit.reliable:
            lines.append("  flagged unreliable: " + "; ".join(fit.warnings))
    except Exception as e:  # noqa: BLE001 - the report must not lose the run's numbers
        lines.append(f"sigmoid fit unavailable: {type(e).__name__}: {e}")
    png = draw_curve(run, rows, x=x, metric=metric, fit=fit)
    lines.append(f"plot: {png}")
    text = "\n".join(lines)
    run.store.write_text("report.md", "# Demo report\n\n" + "\n\n".join(lines) + "\n")
    return text
