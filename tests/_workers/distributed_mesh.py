"""Worker for test_distributed: one of two processes under jax.distributed (gloo)."""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from rl_jax.config import MeshConfig  # noqa: E402
from rl_jax.sharding import make_mesh, maybe_initialize_distributed  # noqa: E402


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


if __name__ == "__main__":
    main()
