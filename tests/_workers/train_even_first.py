"""`rl-jax ...` with the tests' `test_even_first` verifier registered (see test_train_loop)."""

import sys

from rl_jax.cli import main
from rl_jax.rewards._registry import _REGISTRY, _LocalRewardFn, register

if "test_even_first" not in _REGISTRY:

    @register("test_even_first")
    def _even_first(scale, timeout_s, workers):
        return _LocalRewardFn(
            "test_even_first",
            scale,
            score=lambda c, a: float(c[:1] in "02468"),
            well_formed=lambda c: True,
        )


if __name__ == "__main__":
    sys.exit(main())
