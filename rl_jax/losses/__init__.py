"""The functional loss zoo: pure functions of arrays, picked by name.

    from rl_jax.losses import LossInputs, policy_loss
    loss, metrics = policy_loss("cispo", inputs, aggregation="prompt", eps_max=5.0)

Sign convention: losses are to be MINIMIZED (loss = -objective); advantages are
"higher is better". Shapes: B rows, T tokens, P prompts (groups), G samples per
prompt. See each function's docstring for its formula and paper.
"""

from rl_jax.losses._advantages import (
    ADV_ESTIMATORS,
    ADV_NORMS,
    compute_advantages,
    gae_advantages,
    terminal_rewards,
    zero_variance_groups,
)
from rl_jax.losses._aggregate import AGGREGATIONS, aggregate
from rl_jax.losses._api import (
    advantages_from_config,
    gae_from_config,
    loss_from_config,
    policy_loss,
)
from rl_jax.losses._inputs import LossInputs
from rl_jax.losses._kl import (
    K3_MAX_LOG_RATIO,
    KL_ESTIMATORS,
    entropy_from_logits,
    kl_penalty,
    kl_shaped_rewards,
)
from rl_jax.losses._policy import (
    cispo_surrogate,
    clipped_surrogate,
    clipped_value_loss,
    gspo_surrogate,
)
from rl_jax.losses._registry import LossSpec, get, names, register

__all__ = [
    "ADV_ESTIMATORS",
    "ADV_NORMS",
    "AGGREGATIONS",
    "K3_MAX_LOG_RATIO",
    "KL_ESTIMATORS",
    "LossInputs",
    "LossSpec",
    "advantages_from_config",
    "aggregate",
    "cispo_surrogate",
    "clipped_surrogate",
    "clipped_value_loss",
    "compute_advantages",
    "entropy_from_logits",
    "gae_advantages",
    "gae_from_config",
    "get",
    "gspo_surrogate",
    "kl_penalty",
    "kl_shaped_rewards",
    "loss_from_config",
    "names",
    "policy_loss",
    "register",
    "terminal_rewards",
    "zero_variance_groups",
]
