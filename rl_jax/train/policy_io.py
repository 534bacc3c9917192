"""A trained policy out of a run directory: its config, tokenizer and checkpointed weights.

`rl-jax sample`, `rl-jax convert` and `rl-jax eval` accept a run where they accept
a model, on a local disk or in a bucket (gs://...), as any of:
  RUN                          a run directory (config.json + checkpoints/): newest step
  RUN/checkpoints              the same
  RUN/checkpoints/STEP         that step
Only the policy's parameters are read from the checkpoint (orbax partial restore):
the optimizer state, a frozen reference policy and the data state stay on disk. They
are read as stored and checked against the checksums the trainer saved with them
(rl_jax.train.checkpoint): a damaged step that was asked for is an error naming the
array; the newest step, unasked, falls back to the newest that verifies. A LoRA
run's adapters are merged into the base weights as the trainer's view does
(rl_jax.train.params), so a run loads, samples and exports as a plain model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import jax
import orbax.checkpoint as ocp
from jax.sharding import Mesh

from rl_jax.config import RunConfig, from_dict
from rl_jax.knobs import ConfigError
from rl_jax.models import ModelSpec, Transformer, build_model, param_layout, param_shardings
from rl_jax.models.hf import CheckpointError
from rl_jax.models.transformer import dtype_of
from rl_jax.runs.storage import is_remote, join, open_store
from rl_jax.sharding import get_rules
from rl_jax.train.checkpoint import CHECKSUMS, META_DIGEST, _short, seal_meta, state_checksums
from rl_jax.train.params import LORA_KEY, ParamFormat, adapter_shapes, replicated_on


@dataclass(frozen=True)
class RunCheckpoint:
    run_dir: str  # an absolute path or a URL
    step: int
    cfg: RunConfig
    # Whether the step was asked for (RUN/checkpoints/STEP, step=): a damaged one is then
    # an error; the newest step, unasked, falls back to the newest that verifies.
    named: bool = False
    saved: tuple[int, ...] = ()  # every step the run has, oldest first

    @property
    def step_dir(self) -> str:
        return join(self.run_dir, "checkpoints", str(self.step))

    @property
    def state_dir(self) -> str:
        return join(self.step_dir, "state")

    @property
    def name(self) -> str:
        return _name(self.run_dir)


def _name(loc: str) -> str:
    return loc.rstrip("/").rsplit("/", 1)[-1]


def _parent(loc: str) -> str:
    head = loc.rstrip("/").rsplit("/", 1)[0]
    return head if head and not head.endswith(":/") else loc


def _run_config(loc: str) -> dict | None:
    """The run's config.json, if `loc` is a run directory (an HF model directory also has
    a config.json, without a run id)."""
    try:
        cfg = json.loads(open_store(loc, key="run directory").read_bytes("config.json"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) and "run_id" in cfg and "config" in cfg else None


def _run_root(loc: str) -> tuple[str, int | None] | None:
    """(run directory, step named by the path or None) if `loc` is in a run's layout."""
    if _run_config(loc) is not None:
        return loc, None
    parent = _parent(loc)
    if _name(loc) == "checkpoints" and _run_config(parent) is not None:
        return parent, None
    if _name(parent) == "checkpoints" and _run_config(_parent(parent)) is not None:
        if not _name(loc).isdigit():
            raise ConfigError(f"{loc}: a checkpoint folder is named by its step number")
        return _parent(parent), int(_name(loc))
    return None


def _location(path: str | Path) -> str:
    """An absolute local path (orbax wants one) or the URL as given."""
    return str(path).rstrip("/") if is_remote(path) else str(Path(path).resolve())


def is_run_path(path: str | Path) -> bool:
    """Whether `path` names a run directory or one of its checkpoints (see the module doc)."""
    try:
        return _run_root(_location(path)) is not None
    except ConfigError:
        return True  # a run's layout with a malformed step: find_run_checkpoint says why


def saved_steps(run: str) -> list[int]:
    """The run's complete checkpoints: step folders holding their state (and, in a bucket,
    their commit marker: a save killed before it is no checkpoint)."""
    store = open_store(run, key="run directory")
    out = []
    for name in store.list("checkpoints"):
        if not name.isdigit() or "state" not in store.list(f"checkpoints/{name}"):
            continue
        if store.remote and not store.exists(f"checkpoints/{name}/commit_success.txt"):
            continue
        out.append(int(name))
    return sorted(out)


def find_run_checkpoint(path: str | Path, step: int | None = None) -> RunCheckpoint:
    """The run checkpoint `path` names (its newest step unless the path or `step` names
    one); a ConfigError that lists the saved steps when there is no such checkpoint."""
    found = _run_root(_location(path))
    if found is None:
        raise ConfigError(
            f"{path} is not a run directory (config.json and checkpoints/) nor one of its "
            "checkpoints (RUN/checkpoints/STEP)"
        )
    run, named = found
    if step is not None and named is not None and step != named:
        raise ConfigError(f"{path} names step {named} but step={step} was asked for")
    step = named if named is not None else step
    try:
        cfg = from_dict(_run_config(run)["config"])
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{join(run, 'config.json')} is not a run config ({e})") from None
    saved = saved_steps(run)
    if not saved:
        raise ConfigError(f"run {run} has no checkpoint yet")
    named = step is not None
    if step is None:
        step = saved[-1]
    elif step not in saved:
        raise ConfigError(f"run {run} has no checkpoint at step {step}; saved steps: {saved}")
    return RunCheckpoint(run_dir=run, step=step, cfg=cfg, named=named, saved=tuple(saved))


def run_spec(ck: RunCheckpoint) -> ModelSpec:
    from rl_jax.models import resolve_spec

    return resolve_spec(ck.cfg.model)


class DamagedCheckpoint(CheckpointError):
    """A checkpoint whose files do not restore or do not match their checksums."""


def load_run_params(
    ck: RunCheckpoint,
    spec: ModelSpec,
    *,
    mesh: Mesh | None = None,
    rules_preset: str = "fsdp_tp",
    purpose: str = "train",
) -> dict[str, jax.Array]:
    """The policy's parameters of checkpoint `ck`, placed by `rules_preset` on `mesh`
    (one device without a mesh), each checked against the checksum the trainer saved
    with it. A tensor missing or of another shape is named (CheckpointError); so is one
    that does not restore or does not match its checksum (DamagedCheckpoint)."""
    shardings = param_shardings(spec, mesh, get_rules(rules_preset, purpose=purpose))
    layout = param_layout(spec)
    plan = ParamFormat.from_config(ck.cfg, spec)
    meta = verified_meta(ck)
    ckptr = ocp.PyTreeCheckpointer()
    stored_params = _stored_params(ck, ckptr, layout)
    # Read as stored (a checksum is of the stored bits), cast once verified.
    target = {
        name: jax.ShapeDtypeStruct(info.shape, stored_params[name].dtype, sharding=shardings[name])
        for name, info in layout.items()
    }
    if plan.lora:
        target[LORA_KEY] = _adapter_target(ck, plan, layout, stored_params, mesh)
    args = ocp.args.PyTreeRestore(
        item={"params": target},
        restore_args={"params": ocp.checkpoint_utils.construct_restore_args(target)},
        partial_restore=True,
    )
    try:
        with _quiet_absl():
            params = dict(ckptr.restore(ck.state_dir, args=args)["params"])
    except Exception as e:  # noqa: BLE001
        raise DamagedCheckpoint(
            f"{ck.state_dir}: the parameters do not restore ({_short(e)})"
        ) from None
    _check_sums(ck, params, meta)
    # Adapters merge in float32 (rl_jax.train.params), so the base is cast to float32 too.
    dtype = dtype_of("float32" if plan.lora else spec.param_dtype)
    for name in layout:
        if params[name].dtype != dtype:
            params[name] = params[name].astype(dtype)
    if not plan.lora:
        return params
    params[LORA_KEY] = jax.tree.map(lambda a: a.astype(jax.numpy.float32), params[LORA_KEY])
    return dict(jax.jit(plan.view, out_shardings=shardings)(params))


def _stored_params(ck: RunCheckpoint, ckptr, layout) -> dict:
    """The checkpoint's metadata of params/*, each tensor the model needs there with its
    shape (a CheckpointError naming the first that is not)."""
    try:
        with _quiet_absl():  # orbax warns that the step-level metadata file is not here
            stored = ckptr.metadata(ck.state_dir)
        stored = stored.item_metadata if hasattr(stored, "item_metadata") else stored
        stored_params = dict(stored["params"])
    except Exception as e:  # noqa: BLE001 - orbax raises many types for a damaged folder
        raise DamagedCheckpoint(
            f"{ck.state_dir}: cannot read the checkpoint ({_short(e)})"
        ) from None
    for name, info in layout.items():
        if name not in stored_params:
            raise CheckpointError(f"{ck.state_dir}: missing tensor params/{name}")
        shape = tuple(stored_params[name].shape)
        if shape != info.shape:
            raise CheckpointError(
                f"{ck.state_dir}: tensor params/{name} has shape {shape} but the run's "
                f"model needs {info.shape}"
            )
    return stored_params


def verified_meta(ck: RunCheckpoint) -> dict:
    """The checkpoint's JSON metadata, checked against its own checksum (a checkpoint
    saved before checksums existed has none and is taken as it is)."""
    try:
        meta = _read_meta(ck)
    except Exception as e:  # noqa: BLE001 - orbax raises many types for a damaged file
        raise DamagedCheckpoint(
            f"{join(ck.step_dir, 'meta')}: cannot read it ({_short(e)})"
        ) from None
    if not isinstance(meta, dict):
        raise DamagedCheckpoint(f"{join(ck.step_dir, 'meta')}: not a JSON object")
    if META_DIGEST in meta and seal_meta(meta)[META_DIGEST] != meta[META_DIGEST]:
        raise DamagedCheckpoint(f"{join(ck.step_dir, 'meta')}: does not match its checksum")
    return dict(meta)


def _read_meta(ck: RunCheckpoint):
    with _quiet_absl():
        return ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(join(ck.step_dir, "meta"))


def _check_sums(ck: RunCheckpoint, params: dict, meta: dict) -> None:
    saved = meta.get(CHECKSUMS)
    if saved is None:  # saved before checkpoints carried checksums
        return
    got, _ = state_checksums({"params": params})
    for key in sorted(got):
        name = "/".join(re.findall(r"\['([^']*)'\]", key)) or key
        if key not in saved:
            raise DamagedCheckpoint(f"{ck.state_dir}: array {name} has no checksum in its meta")
        if saved[key] != got[key]:
            raise DamagedCheckpoint(
                f"{ck.state_dir}: array {name} does not match its checksum (the file is damaged)"
            )


def _adapter_target(ck, plan, layout, stored_params, mesh) -> dict:
    """Abstract adapters (as stored, every device whole) of a LoRA run's checkpoint."""
    rep = replicated_on(mesh)
    stored = stored_params.get(LORA_KEY)
    out = {}
    for t in plan.lora_targets:
        shapes = adapter_shapes(t, layout[t].shape, plan.lora_rank)
        out[t] = {}
        for part, shape in shapes.items():
            try:
                info = stored[t][part]
                got = tuple(info.shape)
            except (KeyError, TypeError):
                raise CheckpointError(
                    f"{ck.state_dir}: missing tensor params/{LORA_KEY}/{t}/{part} of the "
                    "run's LoRA adapters"
                ) from None
            if got != shape:
                raise CheckpointError(
                    f"{ck.state_dir}: tensor params/{LORA_KEY}/{t}/{part} has shape {got} "
                    f"but the run's adapters need {shape}"
                )
            out[t][part] = jax.ShapeDtypeStruct(shape, info.dtype, sharding=rep)
    return out


def load_verified_params(
    ck: RunCheckpoint, spec: ModelSpec, *, warn=None, **kw
) -> tuple[dict[str, jax.Array], RunCheckpoint]:
    """`load_run_params` of `ck`; when its step was not asked for (`ck.named`) and it is
    damaged, of the newest older step that verifies, said in one line to `warn` (default:
    stderr). Returns the parameters and the checkpoint they are from. Nothing is moved:
    the run directory is only read (the trainer sets damaged checkpoints aside)."""
    steps = [ck.step] if ck.named else [s for s in reversed(ck.saved or (ck.step,)) if s <= ck.step]
    first: DamagedCheckpoint | None = None
    for step in steps:
        at = dataclasses.replace(ck, step=step)
        try:
            params = load_run_params(at, spec, **kw)
        except DamagedCheckpoint as e:
            if ck.named:
                raise
            first = first or e
            continue
        if first is not None:
            (warn or _warn)(
                f"warning: {first}; using step {step}, the newest checkpoint that verifies"
            )
        return params, at
    raise DamagedCheckpoint(f"no checkpoint of run {ck.run_dir} verifies; the newest: {first}")


def _warn(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def load_run_model(
    source: str | Path | RunCheckpoint,
    *,
    step: int | None = None,
    mesh: Mesh | None = None,
    rules_preset: str = "fsdp_tp",
    purpose: str = "train",
    param_dtype: str | None = None,
) -> tuple[Transformer, RunCheckpoint]:
    """The policy of a run's checkpoint (a path, see `find_run_checkpoint`, or one
    already found) as a Transformer (its parameters cast to `param_dtype` if given),
    and which checkpoint it is: the one asked for, or (none asked for) the newest that
    verifies (`load_verified_params`)."""
    ck = source if isinstance(source, RunCheckpoint) else find_run_checkpoint(source, step)
    spec = run_spec(ck)
    if param_dtype is not None:
        spec = dataclasses.replace(spec, param_dtype=param_dtype)
    params, ck = load_verified_params(
        ck, spec, mesh=mesh, rules_preset=rules_preset, purpose=purpose
    )
    model = build_model(spec, mesh=mesh, rules_preset=rules_preset, purpose=purpose, params=params)
    return model, ck


def run_tokenizer(ck: RunCheckpoint):
    """The tokenizer the run trained with."""
    from rl_jax.train.preflight import run_tokenizer

    return run_tokenizer(ck.cfg)


@contextlib.contextmanager
def _quiet_absl():
    log = logging.getLogger("absl")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)
