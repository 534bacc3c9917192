"""`python -m rl_jax.cli ...`: the same as `rl-jax ...`."""

import sys

from rl_jax.cli import main

sys.exit(main())
