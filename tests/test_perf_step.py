"""The fast train step (issue 8): prompt once per group, host-side batch assembly, benchmark.

The prefix-shared forward must equal one forward over each whole row (values
and gradients, 1e-4 whole-model float32 policy); the benchmark must run end to
end on the tiny preset and compile nothing after its first step.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax import kernels
from rl_jax.config import ModelConfig
from rl_jax.models import (
    Transformer,
    build_model,
    logprobs_from_hidden,
    model_params,
    positions_from_valid,
    resolve_spec,
)
from rl_jax.train import step as st

ROOT = Path(__file__).resolve().parents[1]


def _whole_rows(spec, params, batch, temperature):
    """The reference: one model forward over each whole row (prompt + completion)."""
    model = Transformer(spec, params)
    hidden, _ = model(batch.tokens, batch.positions, kv_valid_bs=batch.valid)
    tp, tg = batch.prompt_len, batch.mask.shape[1]
    h = hidden[:, tp - 1 : tp - 1 + tg]
    return logprobs_from_hidden(model, h, batch.tokens[:, tp:], temperature=temperature)


def _batch(P=3, G=4, Tp=6, Tg=7, seed=0):
    """Left-padded prompts of different lengths, shared per group; ragged completions."""
    rng = np.random.default_rng(seed)
    pt, pm = np.zeros((P, Tp), np.int32), np.zeros((P, Tp), bool)
    for i, n in enumerate(rng.integers(1, Tp + 1, P)):
        pt[i, Tp - n :], pm[i, Tp - n :] = rng.integers(4, 60, n), True
    lens = rng.integers(1, Tg + 1, P * G)
    mask = np.arange(Tg)[None] < lens[:, None]
    ct = np.where(mask, rng.integers(4, 60, (P * G, Tg)), 0).astype(np.int32)
    host = st.assemble_batch(
        np.repeat(pt, G, 0),
        np.repeat(pm, G, 0),
        ct,
        lens,
        mask,
        np.zeros((P * G, Tg), np.float32),
        rng.normal(size=P * G).astype(np.float32),
        np.repeat(np.arange(P), G),
    )
    return st.put_batch(host, None), host, G


@pytest.mark.parametrize(
    "arch,biases,tg,tile",
    [
        ("qwen2", False, 7, 1),
        ("llama", True, 7, 1),
        ("qwen3", False, 7, 1),
        ("qwen2", False, 1, 1),
        # TPU's sequence tile: prompts (6 columns) and completions (7) padded to 16.
        ("qwen3", False, 7, 16),
    ],
)
def test_prefix_shared_forward_equals_whole_rows(arch, biases, tg, tile, monkeypatch):
    monkeypatch.setitem(kernels.SEQUENCE_TILE, jax.default_backend(), tile)
    spec = resolve_spec(ModelConfig(preset="tiny", architecture=arch))
    if biases:  # Llama with attention_bias: q/k/v and o biases
        spec = spec.replace(qkv_bias=True, o_bias=True)
    params = model_params(build_model(spec, seed=1))
    keys = jax.random.split(jax.random.key(2), len(params))
    # Perturb every parameter so that zero biases and unit norms are exercised too.
    params = {
        k: v + 0.05 * jax.random.normal(kk, v.shape)
        for kk, (k, v) in zip(keys, sorted(params.items()), strict=True)
    }
    batch, host, G = _batch(Tg=tg)
    mask = jnp.asarray(host["mask"])

    @jax.jit
    def ref(p):
        logp, ent = _whole_rows(spec, p, batch, 0.7)
        return logp, ent, jax.grad(lambda p: (_whole_rows(spec, p, batch, 0.7)[0] * mask).sum())(p)

    def ours(g):
        def f(p):
            return st.completion_forward(spec, (), None, p, batch, 0.7, group_size=g)[:2]

        def loss(p):
            return (f(p)[0] * mask).sum()

        return jax.jit(lambda p: (*f(p), jax.grad(loss)(p)))

    want = ref(params)
    for g in (1, G):
        logp, ent, grads = ours(g)(params)
        np.testing.assert_allclose(logp * mask, want[0] * mask, atol=1e-4)
        np.testing.assert_allclose(ent * mask, want[1] * mask, atol=1e-4)
        for k, w in want[2].items():
            scale = float(jnp.abs(w).max()) + 1e-12
            np.testing.assert_allclose(grads[k] / scale, w / scale, atol=1e-4, err_msg=k)


def test_host_positions_and_shared_prompt_detection():
    batch, host, G = _batch()
    want = np.asarray(positions_from_valid(jnp.asarray(host["valid"])))
    np.testing.assert_array_equal(host["positions"], want)
    assert host["positions"].dtype == np.int32
    assert batch.group_size == G == st.shared_prompt_rows(host)
    tp = host["tokens"].shape[1] - host["mask"].shape[1]
    other = {k: v.copy() for k, v in host.items()}
    other["tokens"][1, tp - 1] += 1  # row 1 no longer shares its group's prompt
    assert st.shared_prompt_rows(other) == 1
    assert st.put_batch(other, None).group_size == 1
    other = {k: v.copy() for k, v in host.items()}
    other["group_ids"] = np.arange(len(other["group_ids"])) % 2  # interleaved groups
    assert st.shared_prompt_rows(other) == 1
    rows = np.arange(2 * G)  # a minibatch of two whole groups keeps the layout
    assert st.shared_prompt_rows({k: v[rows] for k, v in host.items()}) == G
    # The step's rotary table covers the batch's columns: other positions are refused.
    T = host["tokens"].shape[1]
    for bad in (T, -1):
        other = {k: v.copy() for k, v in host.items()}
        other["positions"][0, -1] = bad
        with pytest.raises(ValueError, match=rf"positions must lie in \[0, {T}\)"):
            st.put_batch(other, None)


def _benchmark(script: str, *args: str, timeout: int) -> dict:
    """Run benchmarks/<script> in --smoke mode; its JSON line."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--smoke", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_rl_step_benchmark_smoke(tmp_path):
    cache = os.environ.get("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax"))
    r = _benchmark("rl_step.py", "--no-restart", "--cache-dir", cache, timeout=300)
    for key in ("median_step_s", "sample_s", "score_s", "train_s", "first_step_s", "peak_rss_mb"):
        assert isinstance(r[key], float) and r[key] > 0, (key, r)
    assert r["recompiled"] is False, r["compile_counts"]
    assert r["response_len"] == 8.0  # forced length: no early stop
    assert 0 < r["flops_fraction"] < 1.5


def test_layer_loop_benchmark_smoke():
    r = _benchmark("layer_loop.py", timeout=300)
    assert r["preset"] == "tiny" and set(r["cpu"]) == {"rolled", "unrolled"}
    for loop in r["cpu"].values():
        assert loop["min_s"] > 0 and loop["compile_s"] > 0 and loop["temp_mb"] > 0, r
    assert r["rolled_over_unrolled"] == pytest.approx(
        r["cpu"]["rolled"]["min_s"] / r["cpu"]["unrolled"]["min_s"], rel=1e-2
    )


@pytest.mark.slow
def test_split_mode_benchmark_smoke():
    # Two placements: colocated_1 is the plain one-device run that rl_step's smoke times.
    args = ("--placements", "colocated,split", "--steps", "1", "--warmup", "1")
    r = _benchmark("split_mode.py", *args, timeout=600)
    places = r["placements"]
    assert set(places) == {"colocated", "split"}
    assert places["split"]["sampler_devices"] == 1 and places["split"]["trainer_devices"] == 1
    assert places["colocated"]["sampler_devices"] == 2
    for p in places.values():
        assert p["mean_step_s"] > 0 and p["median_step_s"] > 0, p
    assert places["split"]["sampler_busy_s"] > 0
    speedup = r["colocated_mean_step_s"] / r["split_mean_step_s"]
    assert r["split_speedup"] == pytest.approx(speedup, rel=1e-2)
