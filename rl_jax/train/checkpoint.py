"""Orbax checkpoints of everything the next step depends on.

Layout: <run>/checkpoints/<step>/{state (arrays), meta (JSON)}. Orbax writes
into a temporary directory and renames on commit, so a process killed mid-save
leaves no half-checkpoint under a step name. A checkpoint that exists but does
not restore (files damaged later) is reported and the previous one is used.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)


class Checkpointer:
    def __init__(self, directory: str | Path, *, keep: int = 2, async_save: bool = True):
        self.directory = Path(directory).resolve()
        self.directory.mkdir(parents=True, exist_ok=True)
        self._mngr = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep,
                enable_async_checkpointing=async_save,
                create=True,
            ),
        )

    def steps(self) -> list[int]:
        return sorted(self._mngr.all_steps())

    def save(self, step: int, state: Any, meta: dict[str, Any], *, force: bool = False) -> None:
        """state: a pytree of jax/numpy arrays; meta: JSON (iterator state, counters, ...)."""
        self._mngr.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
            ),
            force=force,
        )

    def wait(self) -> None:
        self._mngr.wait_until_finished()

    def restore_latest(self, abstract_state: Any) -> tuple[int, Any, dict] | None:
        """Restore the newest checkpoint that loads, onto the shardings of `abstract_state`.

        `abstract_state` is a pytree of jax.ShapeDtypeStruct (with .sharding) or
        arrays; returns (step, state, meta) or None when there is no usable checkpoint.
        """
        target = jax.tree.map(_abstract, abstract_state)
        for step in reversed(self.steps()):
            try:
                out = self._mngr.restore(
                    step,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()
                    ),
                )
                return step, out["state"], dict(out["meta"])
            except Exception as e:  # noqa: BLE001 - any damage means: try the previous one
                log.warning(
                    "checkpoint step %d in %s is unusable (%s); trying the previous one",
                    step,
                    self.directory,
                    _short(e),
                )
                print(
                    f"warning: checkpoint {self.directory / str(step)} is unusable "
                    f"({_short(e)}); falling back to an older one",
                    flush=True,
                )
        return None

    def close(self) -> None:
        self._mngr.wait_until_finished()
        self._mngr.close()


def _abstract(x):
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    sharding = getattr(x, "sharding", None)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def _short(e: BaseException) -> str:
    """One line naming what failed. Orbax wraps TensorStore's reason, which names the tensor
    and file, in a ~60-line spec dump; the reason is the innermost cause."""
    dump = str(e)
    for _ in range(8):
        inner = e.__cause__ or e.__context__
        if inner is None:
            break
        e = inner
    lines = str(e).strip().splitlines()
    text = lines[0].split(" See full TensorStore details")[0] if lines else type(e).__name__
    # Without a cause the dump's relative kvstore path is the tensor ('params.embed/').
    tensor = re.findall(r"'path': '([^/'][^']*?)/?'", dump)
    if tensor and tensor[-1] not in text:
        text = f"tensor {tensor[-1]!r}: {text}"
    return f"{type(e).__name__}: {text[:300]}"
