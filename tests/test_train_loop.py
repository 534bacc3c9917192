"""The RL loop end to end on the tiny model: sharding equivalence, resume, NaN, staleness."""

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from rl_jax.config import load_recipe
from rl_jax.runs import read_jsonl
from rl_jax.train.accounting import batches_in_flight
from rl_jax.train.loop import NonFiniteError, RLTrainer

ROOT = Path(__file__).resolve().parents[1]

# A random policy gets every arithmetic answer wrong (no variance, no signal); the
# `test_even_first` verifier (registered by this import) rewards an even first
# character, so random samples disagree within a group.
sys.path.insert(0, str(Path(__file__).parent / "_workers"))
import train_even_first  # noqa: E402

BASE = [*train_even_first.TINY_RUN, "eval.every=2"]


def _cfg(tmp_path, *extra):
    return load_recipe("scalerl", [*BASE, f"out_dir={tmp_path}", *extra])


def _params(trainer):
    return {k: np.asarray(jax.device_get(v)) for k, v in trainer.params.items()}


@pytest.mark.devices(8)
def test_one_step_sharded_equals_single_device(tmp_path):
    # One device samples on its engine, eight on theirs (rows split over data x fsdp):
    # the same rollouts (tests/test_sampler.py), so the updates agree.
    one = RLTrainer(
        _cfg(
            tmp_path,
            "name=one",
            "train.steps=1",
            "mesh.num_devices=1",
            "eval.every=0",
            "eval.at_start=false",
        ),
        quiet=True,
    )
    assert one.mesh.devices.size == 1
    s1 = one.run_loop()
    eight = RLTrainer(
        _cfg(
            tmp_path,
            "name=eight",
            "train.steps=1",
            "mesh.data=2",
            "mesh.fsdp=2",
            "mesh.tensor=2",
            "eval.every=0",
            "eval.at_start=false",
        ),
        quiet=True,
    )
    s8 = eight.run_loop()
    assert s1["version"] == s8["version"] == 1
    p1, p8 = _params(one), _params(eight)
    for k in p1:
        np.testing.assert_allclose(p1[k], p8[k], atol=1e-5, rtol=1e-5, err_msg=k)


@pytest.mark.parametrize(
    "micro", [[], ["train.updates_per_batch=2", "train.grad_accum=2"]], ids=["1", "2-micro"]
)
def test_pipeline_staleness_bound_and_no_recompiles(tmp_path, micro):
    """PipelineRL-k's bound in optimizer steps: 2 micro-batches of one step each batch
    (train.grad_accum) keep as many batches in flight and the same schedule."""
    k = 2
    trainer = RLTrainer(
        _cfg(
            tmp_path,
            "name=pipe",
            *micro,
            "train.steps=5",
            "train.off_policy=pipeline",
            f"train.off_policy_k={k}",
            "sampling.decode_chunk=2",
            "eval.every=0",
            "eval.at_start=false",
        ),
        quiet=True,
    )
    assert batches_in_flight(trainer.cfg) == k + 1  # W batches untrained at once
    seen, compiled = [], []
    trainer.step_hooks.append(lambda t: seen.append(t.compile_counts()))
    trainer.step_hooks.append(lambda t: compiled.append(len(xla.records)))
    xla = _XlaCompiles()
    with jax.log_compiles(True), xla:
        summary = trainer.run_loop()
    # No XLA compile between step 1's end and step 5's (hooks run before the final
    # evaluation, which compiles its own programs).
    assert compiled[0] > 0 and compiled[-1] == compiled[0], "\n".join(xla.records[compiled[0] :])
    hist = {int(s): n for s, n in summary["staleness_hist"].items()}
    assert max(hist) <= k  # never more than k optimizer steps behind the oldest token
    assert max(hist) >= 1  # and batches really were in flight across updates
    rows = read_jsonl(trainer.run.metrics_path)
    assert all(r["train/staleness_max"] <= k for r in rows if "train/staleness_max" in r)
    # The logged learning rate is the schedule's at the update that produced the row.
    lrs = [(r["step"], r["train/lr"]) for r in rows if "train/lr" in r]
    assert len(lrs) == 5
    for step, lr in lrs:
        np.testing.assert_allclose(lr, float(trainer.lr_schedule(step - 1)), rtol=1e-6)
    # nothing compiles after the first step (weights swap in without recompiling)
    final = trainer.compile_counts()
    assert seen[0]["train_step"] == 1
    for name, n in seen[0].items():
        # The engine's state comes back from `generate` with row specs P(None, None)
        # where `insert` gives P(): equal shardings, one XLA program (checked above), but
        # a second entry of jit's dispatch cache, which these counts count.
        if n and not name.startswith("engine_"):  # compiled during step 1: never again
            assert final[name] == n, (name, seen[0], final)
    evals = {k: n for k, n in final.items() if k.startswith("eval_")}
    assert evals and set(evals.values()) == {1}, evals  # the final evaluation, once each
    # The stream: batches of complete groups, slots kept busy, drained at the end.
    assert not trainer.in_flight
    assert all(0 < r["train/slot_occupancy"] <= 1 for r in rows if "train/loss" in r)


def test_nonfinite_updates_stop_the_run_with_a_checkpoint(tmp_path):
    trainer = RLTrainer(
        _cfg(
            tmp_path,
            "name=nan",
            "train.steps=8",
            "train.lr=1e30",
            "train.grad_clip=0",
            "train.max_nonfinite=2",
            "eval.every=0",
            "eval.at_start=false",
            "data.zero_variance_filter=false",
        ),
        quiet=True,
    )
    with pytest.raises(NonFiniteError, match="consecutive updates had NaN/Inf"):
        trainer.run_loop()
    rows = read_jsonl(trainer.run.metrics_path)
    assert [r["train/nonfinite"] for r in rows][-2:] == [1.0, 1.0]
    assert trainer.ckpt.steps() == [trainer.step]
    # skipped updates left the parameters finite
    assert all(np.isfinite(v).all() for v in _params(trainer).values())


class _XlaCompiles(logging.Handler):
    """The XLA compiles of programs jax logs (under jax.log_compiles) while in use:
    jitted functions, not eager ops (a lax primitive or jax's helpers applied to arrays
    outside jit compile once per shape: the engine's `finished` gathers its ended rows)."""

    EAGER = frozenset(dir(jax.lax)) | {"_broadcast_arrays", "_threefry_seed", "stage"}

    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[str] = []
        self.logger = logging.getLogger("jax._src.interpreters.pxla")

    def emit(self, record):
        msg = record.getMessage()
        name = msg.removeprefix("Compiling jit(").split(")")[0]
        if msg.startswith("Compiling jit(") and name not in self.EAGER:
            self.records.append(name)

    def __enter__(self):
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc):
        self.logger.removeHandler(self)


def _strip(rows):
    # Wall-clock timings differ between runs, and so does the run's name (a knob in the rows).
    drop = ("time/", "device_seconds", "eval_device_seconds")
    return [
        {k: v for k, v in r.items() if not k.startswith(drop) and k not in (*drop, "name")}
        for r in rows
    ]


def test_sigkill_resume_repeats_the_uninterrupted_run(tmp_path):
    args = [
        *BASE,
        f"out_dir={tmp_path}",
        "train.steps=6",
        "checkpoint.every=2",
        "checkpoint.async_save=false",
    ]
    env = {**os.environ, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    worker = str(Path(__file__).parent / "_workers" / "train_even_first.py")
    cmd = [sys.executable, worker, "train", "scalerl", *args, "--quiet"]
    ref = subprocess.run([*cmd, "name=ref"], env=env, capture_output=True, text=True, timeout=600)
    assert ref.returncode == 0, ref.stderr[-3000:]
    victim = subprocess.Popen(
        [*cmd, "name=kill"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    metrics = tmp_path / "kill" / "metrics.jsonl"
    deadline = time.time() + 600
    while time.time() < deadline:
        steps = [r["step"] for r in read_jsonl(metrics)]
        if steps and max(steps) >= 3:
            break
        time.sleep(0.2)
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()
    assert not (tmp_path / "kill" / "DONE").exists()
    again = subprocess.run(
        [*cmd, "name=kill"], env=env, capture_output=True, text=True, timeout=600
    )
    assert again.returncode == 0, again.stderr[-3000:]
    for name in ("curve.jsonl", "metrics.jsonl"):
        a = _strip(read_jsonl(tmp_path / "ref" / name))
        b = _strip(read_jsonl(tmp_path / "kill" / name))
        assert a == b, name
    done = json.loads((tmp_path / "kill" / "DONE").read_text())
    assert done["steps"] == 6


@pytest.mark.devices(8)
def test_split_mode_samples_on_its_own_devices_within_the_staleness_bound(tmp_path):
    k = 2
    trainer = RLTrainer(
        _cfg(
            tmp_path,
            "name=split",
            "train.steps=5",
            "train.off_policy=pipeline",
            f"train.off_policy_k={k}",
            "mesh.sampler_devices=4",
            "sampling.decode_chunk=2",
            "eval.every=0",
            "eval.at_start=false",
        ),
        quiet=True,
    )
    assert trainer.split
    # The stream's engine, its cache, lives on the sampler's devices.
    assert set(trainer.parts.engine.mesh.devices.flat) == set(trainer.sample_mesh.devices.flat)
    sample_devs = set(trainer.sample_mesh.devices.flat)
    train_devs = set(trainer.mesh.devices.flat)
    assert len(sample_devs) == 4 and len(train_devs) == 4 and not sample_devs & train_devs
    # The sampler's copy of the weights lives on its own devices, resharded from the trainer's.
    params, version = trainer.sampler_weights()
    assert all(set(a.sharding.device_set) <= sample_devs for a in params.values())
    assert all(set(a.sharding.device_set) <= train_devs for a in trainer.params.values())
    summary = trainer.run_loop()
    assert summary["version"] == 5
    hist = {int(s): n for s, n in summary["staleness_hist"].items()}
    assert max(hist) <= k
    rows = read_jsonl(trainer.run.metrics_path)
    assert len([r for r in rows if "train/loss" in r]) == 5
    assert all(r["train/staleness_max"] <= k for r in rows if "train/staleness_max" in r)
    # The sampler thread kept decoding while the trainer trained.
    worker = trainer.split_sampler
    assert len(worker.train_intervals) == 5
    assert worker.overlap_s() > 0
    # The final evaluation ran on the sampler's devices with the final weights.
    assert trainer.sampler_weights()[1] == trainer.version == 5


@pytest.mark.devices(8)
@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["mesh.sampler_devices=4"], "needs train.off_policy='pipeline'"),
        (
            ["mesh.sampler_devices=8", "train.off_policy=pipeline", "train.off_policy_k=2"],
            "must leave the trainer at least one",
        ),
        (
            ["data.dynamic_sampling=true", "train.off_policy=pipeline", "train.off_policy_k=2"],
            "data.dynamic_sampling",
        ),
    ],
)
def test_split_mode_bad_settings_name_the_knob(tmp_path, overrides, match):
    from rl_jax.knobs import ConfigError

    with pytest.raises(ConfigError, match=match):
        RLTrainer(_cfg(tmp_path, "name=bad", *overrides), quiet=True)


def _split_cfg(tmp_path, *extra):
    return _cfg(
        tmp_path,
        "name=split_ckpt",
        "train.off_policy=pipeline",
        "train.off_policy_k=2",
        "mesh.sampler_devices=4",
        "sampling.decode_chunk=2",
        "eval.every=0",
        "eval.at_start=false",
        "checkpoint.every=2",
        "checkpoint.async_save=false",
        *extra,
    )


def _started(worker, P: int) -> int:
    """Steps whose sampling has started: the stream's groups admitted, P a step."""
    return -(-worker.stream.book.admitted // P)


@pytest.mark.devices(8)
def test_split_mode_drains_at_checkpoints_and_resumes(tmp_path):
    class Crash(Exception):
        pass

    first = RLTrainer(_split_cfg(tmp_path, "train.steps=5"), quiet=True)
    started = []

    def hook(t):
        started.append((t.step, _started(t.split_sampler, t.prompts_per_batch)))
        if t.step == 3:
            raise Crash  # after the checkpoint at step 2

    first.step_hooks.append(hook)
    with pytest.raises(Crash):
        first.run_loop()
    # No group admitted past the next checkpoint step before the trainer reached it:
    # while step s trains, groups may enter below the boundary after step s - 1.
    assert [s for s, _ in started] == [1, 2, 3]
    for s, next_step in started:
        assert s <= next_step <= ((s - 1) // 2 + 1) * 2, started
    assert first.ckpt.steps() == [2]
    first.close()
    # The same command again resumes from the step-2 checkpoint and finishes.
    again = RLTrainer(_split_cfg(tmp_path, "train.steps=5"), quiet=True)
    summary = again.run_loop()
    assert summary["steps"] == 5 and summary["version"] == 5
    rows = read_jsonl(again.run.metrics_path)
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2, 3, 4, 5]  # none twice


@pytest.mark.devices(8)
def test_split_mode_sampler_failure_reaches_the_trainer(tmp_path):
    trainer = RLTrainer(_split_cfg(tmp_path, "train.steps=2", "checkpoint.every=0"), quiet=True)

    def broken(*a, **k):
        raise ValueError("decode exploded")

    trainer.parts.engine.generate = broken
    with pytest.raises(RuntimeError, match="sampler thread failed") as err:
        trainer.run_loop()
    assert "decode exploded" in str(err.value.__cause__)
    assert not trainer.split_sampler._thread.is_alive()
