"""Every matmul of a float32 model asks for full float32 products (Precision.HIGHEST).

CPUs compute float32 products exactly whatever the precision says, so the numbers
of the other tests cannot see this; GPUs and TPUs do not: with JAX's default
precision an H200 multiplied float32 in tf32 and the sampler's and the trainer's
log-probs differed by up to 1.3e-3. These tests read the lowered programs of the
model, the engine and the train step instead, so a new matmul that bypasses
`rl_jax.kernels.xla.precision` fails here, on any machine.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rl_jax.config import LossConfig, ModelConfig, SamplingConfig
from rl_jax.models import Transformer, init_params, resolve_spec
from rl_jax.sampling import Engine
from rl_jax.sharding import get_rules
from rl_jax.train.step import assemble_batch, make_update, put_minibatches

_DOT = re.compile(r"stablehlo\.dot_general.*?precision = \[(\w+), (\w+)\]")


def _spec(dtype: str, fp32_lm_head: bool = False):
    return resolve_spec(
        ModelConfig(
            preset="tiny",
            num_layers=2,
            hidden_size=32,
            intermediate_size=48,
            num_heads=4,
            num_kv_heads=2,
            param_dtype=dtype,
            compute_dtype=dtype,
            fp32_lm_head=fp32_lm_head,
        )
    )


def _precisions(lowered) -> list[tuple[str, str]]:
    text = lowered.as_text()
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    found = [_DOT.search(line) for line in dots]
    assert all(found), [d for d, m in zip(dots, found, strict=True) if m is None][:3]
    return [m.groups() for m in found]


def _lowered_programs(spec):
    """The model's forward, the engine's prefill_insert and generate, and a GRPO train
    step."""
    params = init_params(spec, jax.random.key(0))
    tokens = jnp.ones((2, 8), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(8), (2, 8))

    def forward(p, t, pos):
        model = Transformer(spec, p)
        hidden, _ = model(t, pos)
        return model.logits(hidden)

    out = {"forward": jax.jit(forward).lower(params, tokens, positions)}
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=8, length_bucket=8, max_prompt_len=8)
    engine = Engine(spec, cfg, slots=2, chunk=4, pad_id=0, fixed_shapes=True)
    for name, (fn, args, kw) in engine.programs(params).items():
        out[f"engine_{name}"] = fn.lower(*args, **kw)

    rows, tp, tg = 4, 8, 8
    zeros = np.zeros((rows, tg), np.float32)
    host = assemble_batch(
        np.ones((rows, tp), np.int32),
        np.ones((rows, tp), bool),
        np.ones((rows, tg), np.int32),
        np.full((rows,), tg, np.int32),
        zeros + 1,
        zeros,
        np.array([1.0, -1.0, 0.5, -0.5], np.float32),
        np.repeat(np.arange(2, dtype=np.int32), 2),
    )
    tx = optax.adamw(1e-3)
    step = make_update(
        spec,
        get_rules("fsdp", purpose="train"),
        None,
        tx,
        LossConfig(name="grpo", advantage="grpo", kl_coef=0.0),
        num_groups=2,
        max_tokens=tg,
        temperature=1.0,
    )
    batch = put_minibatches(host, None, num_minibatches=1, groups=2)
    out["train_step"] = step.lower(params, tx.init(params), batch)
    return out


@pytest.mark.parametrize("fp32_lm_head", [False, True])
def test_float32_models_multiply_at_highest_precision(fp32_lm_head):
    for name, lowered in _lowered_programs(_spec("float32", fp32_lm_head)).items():
        precisions = _precisions(lowered)
        assert precisions, name
        assert set(precisions) == {("HIGHEST", "HIGHEST")}, (name, set(precisions))


def test_bfloat16_models_keep_the_default_and_the_fp32_head_is_float32():
    spec = _spec("bfloat16", fp32_lm_head=True)
    for name, lowered in _lowered_programs(spec).items():
        precisions = set(_precisions(lowered))
        assert ("DEFAULT", "DEFAULT") in precisions, name
        # The float32 LM head (ScaleRL's FP32 head) is the one float32 matmul left.
        assert ("HIGHEST", "HIGHEST") in precisions, name
