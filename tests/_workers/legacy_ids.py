"""Run ids of the first id version (12 hex digits: every semantic knob hashed), to make run
directories as rl_jax made them before ids had versions (tests of taking those up)."""

from __future__ import annotations

import hashlib
import json

from rl_jax.config import flatten, resolved
from rl_jax.config._run import _NON_SEMANTIC


def legacy_run_id(cfg) -> str:
    flat = {k: v for k, v in flatten(resolved(cfg)).items() if not k.startswith(_NON_SEMANTIC)}
    blob = json.dumps(flat, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


USERS = ("rl_jax.grid.expand", "rl_jax.runs.run_dir", "rl_jax.train.loop")


def use_legacy_ids(monkeypatch=None, modules=USERS) -> None:
    """Make the trainer, its run directories and the grid's expansion hand out first-version
    ids (`modules`: those of them to patch)."""
    import importlib

    # By their names: rl_jax.grid's `expand` is the function, not the module.
    for name in modules:
        module = importlib.import_module(name)
        if monkeypatch is None:
            module.run_id = legacy_run_id
        else:
            monkeypatch.setattr(module, "run_id", legacy_run_id)
