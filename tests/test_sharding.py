import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from rl_jax.config import ConfigError, MeshConfig
from rl_jax.sharding import (
    fit_spec,
    get_rules,
    logical_to_spec,
    make_mesh,
    resolve_axis_sizes,
    set_cpu_devices,
    split_devices,
)

pytestmark = pytest.mark.devices(8)


def test_eight_fake_devices():
    assert jax.device_count() == 8


@pytest.mark.parametrize(
    "cfg, sizes",
    [
        (MeshConfig(), (1, 8, 1)),
        (MeshConfig(data=2, fsdp=-1, tensor=2), (2, 2, 2)),
        (MeshConfig(data=-1, fsdp=1, tensor=1), (8, 1, 1)),
        (MeshConfig(data=1, fsdp=4, tensor=2), (1, 4, 2)),
    ],
)
def test_mesh_sizes(cfg, sizes):
    mesh = make_mesh(cfg)
    assert tuple(mesh.shape[a] for a in ("data", "fsdp", "tensor")) == sizes
    assert mesh.devices.size == 8


def test_mesh_errors():
    with pytest.raises(ConfigError, match="not divisible"):
        resolve_axis_sizes(MeshConfig(data=3, fsdp=-1), 8)
    with pytest.raises(ConfigError, match="8 devices"):
        resolve_axis_sizes(MeshConfig(data=2, fsdp=2, tensor=1), 8)
    with pytest.raises(ConfigError, match="at most one axis"):
        MeshConfig(data=-1, fsdp=-1)
    with pytest.raises(ConfigError, match="mesh.rules"):
        MeshConfig(rules="zero3")


def test_cpu_devices_once_jax_runs():
    # This process's backend started with 8 devices: asking for them again is fine,
    # another count is an error that names the knob, and 0 leaves JAX alone.
    set_cpu_devices(MeshConfig(cpu_devices=8))
    set_cpu_devices(MeshConfig(cpu_devices=0))
    with pytest.raises(ConfigError, match=r"mesh.cpu_devices=3 .* already runs with 8"):
        set_cpu_devices(MeshConfig(cpu_devices=3))
    with pytest.raises(ConfigError, match="mesh.cpu_devices=-2"):
        MeshConfig(cpu_devices=-2)
    assert jax.device_count() == 8


_CPU_DEVICES_CHILD = """
import os, sys, jax
from rl_jax.config import MeshConfig
from rl_jax.sharding import make_mesh, start_jax
cfg = MeshConfig(cpu_devices=int(sys.argv[1]), data=-1, fsdp=1)
start_jax(cfg)
mesh = make_mesh(cfg)
print(jax.device_count(), mesh.shape["data"], len(os.sched_getaffinity(0)))
"""


@pytest.mark.parametrize("asked", [3, -1])
def test_cpu_devices_in_a_fresh_process(asked):
    # Before JAX starts, the knob wins over XLA_FLAGS' count (the test session's 8).
    import os
    import subprocess
    import sys

    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run(
        [sys.executable, "-c", _CPU_DEVICES_CHILD, str(asked)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    count, data, cores = map(int, out.stdout.split())
    want = cores if asked == -1 else asked
    assert count == data == want


def test_rules_map_logical_axes():
    rules = get_rules("fsdp_tp")
    assert logical_to_spec(("embed", "mlp"), rules) == P("fsdp", "tensor")
    assert logical_to_spec(("batch", "seq", None), rules) == P(("data", "fsdp"), None, None)
    # a mesh axis is never used twice in one spec
    assert logical_to_spec(("batch", "embed"), rules) == P(("data", "fsdp"), None)
    assert logical_to_spec(("embed", "vocab"), get_rules("fsdp_tp", purpose="sample")) == P(
        None, "tensor"
    )
    with pytest.raises(ValueError, match="mesh.rules"):
        get_rules("nope")


def test_sharded_computation_matches_single_device():
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    x = jnp.arange(8 * 16, dtype=jnp.float32).reshape(8, 16)
    w = jnp.ones((16, 4)) * 0.5
    rules = get_rules("fsdp_tp")
    xs = jax.device_put(x, jax.NamedSharding(mesh, logical_to_spec(("batch", "embed"), rules)))
    ws = jax.device_put(w, jax.NamedSharding(mesh, logical_to_spec(("embed", "mlp"), rules)))
    np.testing.assert_allclose(jax.jit(jnp.dot)(xs, ws), x @ w, rtol=1e-6)


def test_fit_spec_drops_non_dividing_axes():
    mesh = make_mesh(MeshConfig(data=1, fsdp=4, tensor=2))
    assert fit_spec(P("fsdp", "tensor"), (6, 4), mesh) == P(None, "tensor")
    assert fit_spec(P(("data", "fsdp"), None), (8, 3), mesh) == P(("data", "fsdp"), None)


def test_split_devices_disjoint():
    a, b = split_devices()
    assert len(a) == 4 and len(b) == 4 and not set(a) & set(b)


@pytest.mark.parametrize("grad_accum", [1, 4])
def test_optimizer_state_is_sharded_as_its_weights(grad_accum):
    """FSDP and tensor splits shard the optimizer state too: every moment (and
    MultiSteps' accumulated gradients) lies as its weight, counts are replicated. XLA
    alone would put the zeros on one device, and the trainer replicated them: an 8B
    model's AdamW state whole on every chip."""
    from rl_jax.config import ModelConfig, TrainConfig
    from rl_jax.models import init_params, resolve_spec
    from rl_jax.models.transformer import param_shardings
    from rl_jax.train.optim import make_optimizer
    from rl_jax.train.params import ParamFormat
    from rl_jax.train.parts import init_opt_state

    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    spec = resolve_spec(ModelConfig(preset="tiny"))
    shardings = param_shardings(spec, mesh, get_rules("fsdp_tp"))
    weights = jax.jit(init_params, static_argnums=0, out_shardings=shardings)(
        spec, jax.random.key(0)
    )
    plan = ParamFormat(param_dtype="bfloat16", precision="fp32_master")
    state = plan.init_state(weights, key=jax.random.key(1), mesh=mesh)
    tx, _ = make_optimizer(
        TrainConfig(grad_accum=grad_accum), prompts_per_batch=4, samples_per_prompt=2
    )
    opt = init_opt_state(tx, mesh, state, plan)
    split = [k for k, s in shardings.items() if any(a is not None for a in s.spec)]
    assert split  # the tiny model has FSDP- and tensor-split weights
    seen = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(opt):
        name = next((k.key for k in path if isinstance(getattr(k, "key", None), str)), None)
        assert isinstance(leaf.sharding, jax.NamedSharding) and leaf.sharding.mesh == mesh
        if name in shardings and leaf.shape == state[name].shape:
            same = leaf.sharding.is_equivalent_to(state[name].sharding, leaf.ndim)
            assert same, jax.tree_util.keystr(path)
            seen += name in split
        else:
            assert leaf.sharding.spec == P(), jax.tree_util.keystr(path)
    # mu and nu of every split weight (and the accumulated gradients under MultiSteps)
    assert seen == len(split) * (2 + (grad_accum > 1))
