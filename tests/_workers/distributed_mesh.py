"""Worker for test_distributed: one of two processes under jax.distributed (gloo)."""

import os
import sys

from rl_jax.runtime import xla_flags_with_device_count  # imports no jax

# The session's other XLA flags (its compile settings) carry over; the device count is ours.
os.environ["XLA_FLAGS"] = xla_flags_with_device_count(os.environ.get("XLA_FLAGS", ""), 2)
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from rl_jax.config import MeshConfig, ModelConfig, SamplingConfig  # noqa: E402
from rl_jax.models import load_model, model_params  # noqa: E402
from rl_jax.sampling import Engine  # noqa: E402
from rl_jax.sharding import make_mesh, maybe_initialize_distributed  # noqa: E402


def sample_over_processes() -> str:
    """Rows over all 4 devices of both processes: each device decodes its own rows
    (the CPU attention and matmul kernels where they can be built); the same draws as
    XLA's attention and matmuls on the same mesh."""
    mesh = make_mesh(MeshConfig(data=-1, fsdp=1, tensor=1))
    model = load_model(ModelConfig(preset="tiny"), mesh=mesh, purpose="sample", rules_preset="dp")
    params = model_params(model)
    cfg = SamplingConfig(n=2, temperature=0.7, max_new_tokens=24, length_bucket=8)
    prompts = [[3, 4, 5], [6, 7], list(range(8, 20)), [9]]
    key = jax.random.key(5)
    runs = {}
    for kernel in (True, False):
        if not kernel:
            Engine.platform_attention = Engine.platform_matmul = False
        engine = Engine.for_batch(
            model.spec, cfg, prompts=len(prompts), prompt_len=16, mesh=mesh, pad_id=0, rules="dp"
        )
        used = engine.decode_ops.platform_ops == ("attention", "matmul")
        runs[kernel] = (used, engine.run(params, prompts, key=key)[0])
    (used, a), (_, b) = runs[True], runs[False]
    same = bool((a.completion_tokens == b.completion_tokens).all())
    diff = float(np.abs(a.logprobs - b.logprobs).max())
    return f"SAMPLER {used} {same} {diff <= 1e-5} {int(a.completion_tokens.sum())}"


def main() -> None:
    pid, port = int(sys.argv[1]), sys.argv[2]
    maybe_initialize_distributed(
        MeshConfig(
            distributed=True,
            coordinator_address=f"127.0.0.1:{port}",
            num_processes=2,
            process_id=pid,
        )
    )
    mesh = make_mesh(MeshConfig(data=2, fsdp=-1, tensor=1))
    sh = NamedSharding(mesh, P(("data", "fsdp")))
    local = np.arange(2, dtype=np.float32) + 2 * pid  # global rows 0..3
    x = jax.make_array_from_process_local_data(sh, local)
    total = jax.jit(lambda v: jnp.sum(v * v))(x)
    print(f"RESULT {jax.process_count()} {jax.device_count()} {float(total)}", flush=True)
    print(sample_over_processes(), flush=True)


if __name__ == "__main__":
    main()
