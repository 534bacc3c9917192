"""The composed run config, recipe loading and dotted overrides (OmegaConf)."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import hashlib
import importlib.util
import json
import re
import sys
import traceback
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf, read_write
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from rl_jax.config.data import DataConfig
from rl_jax.config.logging import LoggingConfig
from rl_jax.config.lora import LoraConfig
from rl_jax.config.loss import LossConfig
from rl_jax.config.mesh import MeshConfig
from rl_jax.config.model import ModelConfig
from rl_jax.config.rewards import RewardConfig, check_overlong_window
from rl_jax.config.sampling import SamplingConfig
from rl_jax.config.train import CheckpointConfig, EvalConfig, TrainConfig
from rl_jax.knobs import ConfigError, DependentKnobError, knob, sub


def experiments_dir(package_dir: Path | None = None) -> Path:
    """The folder of shipped recipes and grid specs: `experiments/` beside the package in a
    source checkout (the repository, an editable install), else the copy an installed
    package holds as `rl_jax/recipes` (pyproject.toml maps experiments/ there)."""
    package_dir = Path(__file__).resolve().parents[1] if package_dir is None else package_dir
    checkout = package_dir.parent
    if (checkout / "pyproject.toml").is_file() and (checkout / "experiments").is_dir():
        return checkout / "experiments"
    return package_dir / "recipes"


EXPERIMENTS_DIR = experiments_dir()


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    name: str = knob("run", help="run name; the run directory is <out_dir>/<name>")
    out_dir: str = knob("runs", help="parent directory of run directories")
    recipe: str = knob("", help="recipe this config came from (informational)")
    model: ModelConfig = sub(ModelConfig, "policy model")
    sampling: SamplingConfig = sub(SamplingConfig, "rollout sampler")
    loss: LossConfig = sub(LossConfig, "policy loss")
    data: DataConfig = sub(DataConfig, "prompt data and curriculum")
    rewards: RewardConfig = sub(RewardConfig, "verifiers")
    train: TrainConfig = sub(TrainConfig, "RL loop and optimizer")
    lora: LoraConfig = sub(LoraConfig, "low-rank adapters on a frozen base")
    eval: EvalConfig = sub(EvalConfig, "validation")
    mesh: MeshConfig = sub(MeshConfig, "device mesh")
    checkpoint: CheckpointConfig = sub(CheckpointConfig, "checkpoints")
    logging: LoggingConfig = sub(LoggingConfig, "metrics and progress")

    def __post_init__(self):
        # The run directory is <out_dir>/<name>: a name with a separator, `..` or a
        # leading dot would put it (or hide it) somewhere else.
        if not _NAME_OK.fullmatch(self.name):
            raise ConfigError(
                f"name={self.name!r} must be a single path component of letters, digits and "
                "_ . , + = @ - (not starting with '.', at most 255 characters); "
                "set out_dir for where runs go"
            )
        if self.mesh.sampler_devices > 0 and self.train.off_policy != "pipeline":
            raise DependentKnobError(
                f"mesh.sampler_devices={self.mesh.sampler_devices} (split mode) needs "
                f"train.off_policy='pipeline', got {self.train.off_policy!r}: only PipelineRL-k "
                "bounds how stale the weights of a sampler running alongside the trainer may be",
                knob="mesh.sampler_devices",
                on=("train.off_policy",),
            )
        loss = self.loss.resolved()
        if loss.advantage == "gae" and self.model.value_head is False:
            raise DependentKnobError(
                f"loss.advantage='gae'{'' if self.loss.advantage else f' (loss {loss.name!r})'} "
                "trains a critic: it needs model.value_head=true (or null: a head whenever the "
                "advantage is 'gae'), got false",
                knob="model.value_head",
                on=("loss.advantage", "loss.name"),
            )
        if self.rewards.name == "mixture" and not self.data.mixture:
            raise DependentKnobError(
                "rewards.name='mixture' scores each answer with the verifier its task names: "
                "it needs data.mixture (the answers of one source name none)",
                knob="rewards.name",
                on=("data.mixture",),
            )
        if self.rewards.overlong_penalty:
            l_max, l_cache = self.rewards.overlong_window(self.sampling.max_new_tokens)
            filled = (
                ""
                if self.rewards.overlong_max and self.rewards.overlong_cache
                else " (0 = L_max the sampling.max_new_tokens budget, L_cache a fifth of it)"
            )
            check_overlong_window(l_max, l_cache, filled=filled)


# RunConfig's sub-configs by field name.
_SECTIONS: dict[str, type] = {
    name: t for name, t in typing.get_type_hints(RunConfig).items() if dataclasses.is_dataclass(t)
}
_NAME_OK = re.compile(r"[A-Za-z0-9_+=@,-][A-Za-z0-9._+=@,-]{0,254}")


class OverrideError(ConfigError):
    """A bad `key=value` override (exit status 2 at the CLI)."""


def all_keys(cls: type = RunConfig, prefix: str = "") -> dict[str, dataclasses.Field]:
    """Every leaf knob as a dotted key -> dataclass field."""
    return dict(_all_keys(cls, prefix))


@functools.cache
def _all_keys(cls: type, prefix: str) -> dict[str, dataclasses.Field]:
    # Cached: the type hints are strings (postponed annotations), evaluated on each call.
    out: dict[str, dataclasses.Field] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        key = prefix + f.name
        if dataclasses.is_dataclass(t):
            out.update(_all_keys(t, key + "."))
        else:
            out[key] = f
    return out


def _type_name(cls: type, dotted: str) -> str:
    parts = dotted.split(".")
    for p in parts[:-1]:
        cls = typing.get_type_hints(cls)[p]
    t = typing.get_type_hints(cls)[parts[-1]]
    return getattr(t, "__name__", str(t))


def _suggest(key: str) -> str:
    keys = list(all_keys())
    close = difflib.get_close_matches(key, keys, n=3, cutoff=0.5)
    if not close:
        # Match on the last component too: `lr=...` -> `train.lr`.
        leaf = key.split(".")[-1]
        close = [k for k in keys if k.split(".")[-1] == leaf][:3]
    return f"; did you mean {', '.join(close)}?" if close else ""


def apply_overrides(cfg: RunConfig, overrides: list[str]) -> RunConfig:
    """Apply dotted `key=value` overrides with type checks, then re-validate."""
    known = all_keys()
    pairs = []  # (key, value), both stripped
    for item in [o for o in overrides if not _retired_override(o)]:
        if "=" not in item:
            raise OverrideError(f"override {item!r} is not of the form key=value")
        key, value = item.split("=", 1)
        key = key.strip()
        if key not in known:
            raise OverrideError(f"unknown config key {key!r}{_suggest(key)}")
        if key == "name" and "${" in value:
            raise OverrideError(
                f"name={value!r}: interpolation is not allowed in the run name (it names a "
                "directory under out_dir); give the name itself"
            )
        pairs.append((key, value.strip()))
    base = OmegaConf.structured(cfg)
    OmegaConf.set_readonly(base, False)
    for key, value in pairs:
        try:
            merged = OmegaConf.merge(base, _override_conf(key, value))
        except (ConfigKeyError, ConfigAttributeError) as e:
            raise OverrideError(f"unknown config key {key!r}{_suggest(key)}") from e
        except OmegaConfBaseException as e:
            raise OverrideError(
                f"{key}={value!r}: expected {_type_name(RunConfig, key)} ({_first_line(e)})"
            ) from e
        base = merged

    def release(knob: str) -> Any:
        section, _, name = knob.rpartition(".")
        node = OmegaConf.select(base, section)
        old = node[name]
        with read_write(node):  # frozen dataclasses are read-only sections
            node[name] = knob_default(knob)
        return old

    return _releasing_dependents(lambda: to_object(base), {k for k, _ in pairs}, release)


def replace_knobs(cfg: RunConfig, changes: dict[str, Any]) -> RunConfig:
    """`cfg` with dotted knobs set to typed values (`{"train.off_policy": "on_policy"}`),
    re-validated, knobs that depend on them released as `apply_overrides` does. Values are
    not parsed or coerced: for text from a command line use `apply_overrides`."""
    known = _all_keys(RunConfig, "")
    unknown = [k for k in changes if k not in known]
    if unknown:
        raise OverrideError(f"unknown config key {unknown[0]!r}{_suggest(unknown[0])}")
    # One level deep: each section's knobs by name (values are not mutated, only replaced).
    tree = {
        f.name: dict(vars(getattr(cfg, f.name))) if f.name in _SECTIONS else getattr(cfg, f.name)
        for f in dataclasses.fields(RunConfig)
    }
    for key, value in changes.items():
        section, _, name = key.rpartition(".")
        (tree[section] if section else tree)[name] = value

    def release(knob: str) -> Any:
        section, _, name = knob.rpartition(".")
        old, tree[section][name] = tree[section][name], knob_default(knob)
        return old

    return _releasing_dependents(lambda: _from_tree(tree), set(changes), release)


def _from_tree(tree: dict[str, Any]) -> RunConfig:
    return RunConfig(**{k: _SECTIONS[k](**v) if k in _SECTIONS else v for k, v in tree.items()})


def knob_default(key: str) -> Any:
    """The default of a dotted knob (its dataclass field's)."""
    f = _all_keys(RunConfig, "")[key]
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _releasing_dependents(
    build: Callable[[], RunConfig], keys: set[str], release: Callable[[str], Any]
) -> RunConfig:
    """build(), where a knob refused for the value of another (DependentKnobError) that
    `keys` (the knobs a command set) switched, and that `keys` left as the recipe had it,
    takes its default instead (`release(knob)` -> its old value): one flag is one ablation.
    Each release is said on stderr, one line each."""
    notes: list[str] = []
    released: set[str] = set()
    while True:
        try:
            cfg = build()
        except DependentKnobError as e:
            switched = [k for k in e.on if k in keys]
            # Two knobs that exclude each other: the one the command set wins.
            if e.mutual and e.knob in keys and not switched and e.knob not in released:
                give_way, switched = [k for k in e.on if k not in released], [e.knob]
            elif switched and e.knob not in keys and e.knob not in released:
                give_way = [e.knob]
            else:
                raise
            if not give_way:
                raise
            for k in give_way:
                released.add(k)
                old = release(k)
                default = knob_default(k)
                notes.append(
                    f"note: {k} takes its default, {'null' if default is None else repr(default)}"
                    f": the {old!r} it had does not go with the {' and '.join(switched)} set "
                    f"here ({e})"
                )
            continue
        for line in notes:
            print(line, file=sys.stderr, flush=True)
        return cfg


def _override_conf(key: str, value: str):
    """The one-knob config that `key=value` merges in: the value read as YAML, except that
    a str knob takes verbatim text YAML would read as a mapping or list, or cannot read
    (`data.prompt_template={question}`, `data.prompt_template={question}{x}`), and an
    empty value as the empty string (`model.path=`; YAML reads it as null)."""
    expected = _type_name(RunConfig, key)
    try:
        conf = OmegaConf.from_dotlist([f"{key}={value}"])
        parsed = OmegaConf.select(conf, key, throw_on_resolution_failure=False)
    except Exception as e:  # noqa: BLE001 - YAML's errors are not OmegaConf's
        if expected != "str":
            raise OverrideError(
                f"{key}={value!r}: expected {expected} (not a YAML value: {_first_line(e)})"
            ) from None
        parsed = conf = None
    # An empty value is YAML's null, which a str knob cannot hold: `key=` sets it to ''.
    if expected == "str" and (
        conf is None or value == "" or isinstance(parsed, DictConfig | ListConfig)
    ):
        nested: Any = value
        for part in reversed(key.split(".")):
            nested = {part: nested}
        return OmegaConf.create(nested)
    return conf


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def to_object(conf) -> RunConfig:
    try:
        return OmegaConf.to_object(conf)
    except ConfigError:
        raise
    except OmegaConfBaseException as e:
        # __post_init__ errors arrive wrapped; surface the original message.
        cause = e.__cause__ or e.__context__
        if isinstance(cause, ConfigError):
            raise cause from None
        raise ConfigError(_first_line(e)) from e


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def from_dict(d: dict[str, Any]) -> RunConfig:
    """Rebuild a RunConfig from `to_dict` output (a resolved config.json)."""
    if not isinstance(d, dict):
        # OmegaConf reads [] and "" as an empty config: the defaults, not the run's.
        raise ConfigError(f"bad config dict: a {type(d).__name__}, not a mapping of knobs")
    d = _drop_retired(d)
    base = OmegaConf.structured(RunConfig())
    OmegaConf.set_readonly(base, False)
    try:
        merged = OmegaConf.merge(base, OmegaConf.create(d))
    except OmegaConfBaseException as e:
        raise ConfigError(f"bad config dict: {_first_line(e)}") from e
    return to_object(merged)


# Knobs that were removed: a config.json written while they existed still loads. Each
# says whether today's code runs a config with its stored value as it ran (`rerun_id`).
_RETIRED: dict[tuple[str, str], Callable[[Any, RunConfig], bool]] = {
    ("logging", "every"): lambda value, cfg: True,
    # PipelineRL sampled in waves without sampling.stream, under other policy versions than
    # the stream every PipelineRL run samples in now.
    ("sampling", "stream"): lambda value, cfg: value is True or cfg.train.off_policy != "pipeline",
    # The batch Sampler drew the engine's tokens.
    ("sampling", "engine"): lambda value, cfg: True,
}
# Removed knobs an override may still name: key -> (the value it is accepted with and
# ignored, since it is now how every run behaves; the error for any other value).
_RETIRED_OVERRIDES = {
    "sampling.stream": (
        True,
        "sampling.stream was removed: PipelineRL and split mode always run as a "
        "continuous stream on the engine (the waves on the batch Sampler are gone); "
        "drop the key (sampling.stream=true is accepted and ignored)",
    ),
    "sampling.engine": (
        True,
        "sampling.engine was removed: every batch and evaluation samples on the "
        "continuous-batching engine (the batch Sampler is gone; it drew the same tokens); "
        "drop the key (sampling.engine=true is accepted and ignored)",
    ),
}


def _retired_override(item: str) -> bool:
    """Whether `item` sets a removed knob to the value every run now has (dropped);
    OverrideError if it sets one to any other value."""
    key, _, value = item.partition("=")
    key = key.strip()
    if key not in _RETIRED_OVERRIDES:
        return False
    keep, message = _RETIRED_OVERRIDES[key]
    try:
        parsed = OmegaConf.from_dotlist([f"v={value.strip()}"]).v
    except Exception:  # noqa: BLE001 - YAML's errors are not OmegaConf's
        parsed = None
    if parsed is not keep:
        raise OverrideError(f"{key}={value.strip()!r}: {message}")
    return True


def _drop_retired(d: dict[str, Any]) -> dict[str, Any]:
    d = dict(d)
    for section, name in _RETIRED:
        if isinstance(d.get(section), dict) and name in d[section]:
            d[section] = {k: v for k, v in d[section].items() if k != name}
    return d


def to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def flatten(cfg: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> value for every leaf (the recipe knobs of a curve row)."""
    d = cfg if isinstance(cfg, dict) else to_dict(cfg)
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# Keys that name where a run writes, or how many rows it works on at a time, not what
# it computes: excluded from run ids. (checkpoint.every stays in: PipelineRL drains
# in-flight batches at checkpoints.)
_NON_SEMANTIC = (
    "name",
    "out_dir",
    "recipe",
    "logging.",
    "checkpoint.keep",
    "checkpoint.async_save",
    "checkpoint.compress",
    "checkpoint.resume",
    # How rows are scheduled onto the engine's decode slots, not what they compute
    # (tests/test_engine.py: the same rollouts whatever the slot count).
    "sampling.engine_slots",
    "eval.batch_rows",
    # The LM head's logits a chunk of time steps at a time: memory, not the numbers
    # (tests/test_model.py: the same log-probs and gradients to float32 rounding).
    "model.logprob_chunk",
    # Differ between the processes of one multi-process run (or between launches of it):
    # every process must compute the id of the run directory they share.
    "mesh.process_id",
    "mesh.coordinator_address",
)

# The run-id scheme, hashed into every id and written at its head ("v2" and 12 hex digits):
# ids of two versions are never equal. Version 1 ids are 12 hex digits alone; run
# directories named or marked with an earlier version's id are taken up through `rerun_id`.
ID_VERSION = 2
_ID = re.compile(r"v([1-9][0-9]*)[0-9a-f]{12}")
_V1_ID = re.compile(r"[0-9a-f]{12}")


def id_version(rid: Any) -> int | None:
    """The scheme version of a run id: 1 for 12 hex digits, n for `v<n>` and 12 hex digits,
    None for anything else."""
    if not isinstance(rid, str):
        return None
    if _V1_ID.fullmatch(rid):
        return 1
    m = _ID.fullmatch(rid)
    return int(m.group(1)) if m else None


def resolved(cfg: RunConfig) -> RunConfig:
    """cfg with every knob left to a default that depends on other knobs filled in
    (the loss's own defaults: `LossConfig.resolved`; a critic's value head for GAE; LoRA's
    learning-rate scale; the forced interruption's window and DAPO's overlong window from
    the generation budget; a generated task's verifier and validation count, at least
    eval.num_prompts when auto; warm-up as a count of steps); idempotent.

    What only the data can tell (a file's verifier, its validation count, the longest
    prompt) stays as set ('auto', a fraction, 0): `rl_jax.train.preflight` reports it."""
    from rl_jax.config.data import GENERATED

    changes: dict[str, Any] = {}
    for name in ("loss", "sampling", "lora"):  # the sections that resolve themselves
        section = getattr(cfg, name).resolved()
        if section is not getattr(cfg, name):
            changes[name] = section
    if cfg.model.value_head is None:
        advantage = changes.get("loss", cfg.loss).advantage
        changes["model"] = dataclasses.replace(cfg.model, value_head=advantage == "gae")
    if cfg.rewards.overlong_penalty and not (
        cfg.rewards.overlong_max and cfg.rewards.overlong_cache
    ):
        l_max, l_cache = cfg.rewards.overlong_window(cfg.sampling.max_new_tokens)
        changes["rewards"] = dataclasses.replace(
            cfg.rewards, overlong_max=l_max, overlong_cache=l_cache
        )
    mixture = cfg.data.mixture
    if cfg.rewards.name == "auto" and cfg.data.source in ("arith", "countdown") and not mixture:
        changes["rewards"] = dataclasses.replace(
            changes.get("rewards", cfg.rewards), name=cfg.data.source
        )
    if mixture:
        # One spelling per mixture; each task resolves its own validation count.
        canonical = cfg.data.canonical_mixture()
        if canonical != mixture:
            changes["data"] = dataclasses.replace(cfg.data, mixture=canonical)
    elif cfg.data.source in GENERATED and cfg.data.val_size < 1:
        val = cfg.data.generated_val_size
        if cfg.data.val_size == 0:  # auto: enough problems for every evaluation prompt
            val = max(val, cfg.eval.num_prompts)
        changes["data"] = dataclasses.replace(cfg.data, val_size=val)
    if 0 < cfg.train.warmup_steps < 1:
        changes["train"] = dataclasses.replace(cfg.train, warmup_steps=cfg.train.warmup_count)
    return dataclasses.replace(cfg, **changes) if changes else cfg


def run_id(cfg: RunConfig) -> str:
    """Stable hash of what the run computes (seeds included), independent of paths and names.

    The hash is of the id version and of the semantic knobs of `resolved(cfg)` whose values
    differ from that knob's default (the default config of the same dataclasses, resolved):
    a knob left unset and the same knob set to the value it resolves to give one id (and
    one run directory), and a knob added with a default changes no id.
    """
    ref = _default_knobs(type(cfg), tuple(type(getattr(cfg, s)) for s in _SECTIONS))
    changed = {k: v for k, v in _semantic(resolved(cfg)).items() if ref.get(k) != _canon(v)}
    blob = json.dumps({"id_version": ID_VERSION, "knobs": changed}, **_JSON)
    return f"v{ID_VERSION}{hashlib.sha256(blob.encode()).hexdigest()[:12]}"


_JSON: dict[str, Any] = {"sort_keys": True, "separators": (",", ":"), "default": str}


def _canon(v: Any) -> str:
    # Compared as JSON text: 1 and 1.0 and True are equal in Python, not as knob values.
    return json.dumps(v, **_JSON)


def _semantic(cfg: RunConfig) -> dict[str, Any]:
    return {k: v for k, v in flatten(cfg).items() if not k.startswith(_NON_SEMANTIC)}


@functools.cache
def _default_knobs(cls: type, sections: tuple[type, ...]) -> dict[str, str]:
    """The semantic knobs of the default config built of these dataclasses, resolved."""
    default = cls(**{name: t() for name, t in zip(_SECTIONS, sections, strict=True)})
    return {k: _canon(v) for k, v in _semantic(resolved(default)).items()}


def rerun_id(config: Any) -> str | None:
    """The run id today's code gives the run a config.json's `config` (`to_dict` output)
    describes, where today's code runs it as it was run; else None.

    Not where the config does not load, sets a removed knob to a behaviour that is gone,
    or lacks a knob (it predates it) that does not resolve to the default's value for it:
    the run ran without the knob, and only a knob at that value is known to change nothing.
    For run directories written under an earlier id version (`id_version`)."""
    if not isinstance(config, dict):
        return None
    try:
        cfg = from_dict(config)
    except ConfigError:
        return None
    for (section, name), kept in _RETIRED.items():
        stored = config.get(section)
        if isinstance(stored, dict) and name in stored and not kept(stored[name], cfg):
            return None
    given = flatten(config)
    ref = _default_knobs(type(cfg), tuple(type(getattr(cfg, s)) for s in _SECTIONS))
    for k, v in _semantic(resolved(cfg)).items():
        if k not in given and ref.get(k) != _canon(v):
            return None
    return run_id(cfg)


def resolve_recipe_path(recipe: str, *, experiments: Path | None = None) -> Path:
    """A recipe file's path, or a shipped recipe's name (a file in `experiments`, default
    EXPERIMENTS_DIR) without the `.py`."""
    experiments = EXPERIMENTS_DIR if experiments is None else experiments
    p = Path(recipe)
    if p.suffix == ".py" and p.exists():
        return p
    cand = experiments / f"{recipe}.py"
    if not p.suffix and cand.exists():
        return cand
    names = sorted(q.stem for q in experiments.glob("*.py") if not q.stem.startswith("_"))
    raise ConfigError(f"recipe {recipe!r} not found; known recipes in {experiments}: {names}")


def load_recipe(
    recipe: str, overrides: list[str] | None = None, *, experiments: Path | None = None
) -> RunConfig:
    """Load a recipe file (a Python file with `recipe() -> RunConfig`) or a shipped recipe
    by name (`resolve_recipe_path`) and apply overrides."""
    path = resolve_recipe_path(recipe, experiments=experiments)
    spec = importlib.util.spec_from_file_location(f"rl_jax_recipe_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    # Recipes may share helpers that sit beside them (experiments/_cpu.py).
    sys.path.insert(0, str(path.parent.resolve()))
    try:
        with user_file_errors(path, "recipe file"):
            spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent.resolve()))
    if not hasattr(module, "recipe"):
        raise ConfigError(f"recipe file {path} defines no recipe() function")
    with user_file_errors(path, "recipe file"):
        cfg = module.recipe()
    if not isinstance(cfg, RunConfig):
        raise ConfigError(f"{path}: recipe() returned {type(cfg).__name__}, not RunConfig")
    if not cfg.recipe:
        cfg = dataclasses.replace(cfg, recipe=path.stem)
    return apply_overrides(cfg, list(overrides or []))


@contextlib.contextmanager
def user_file_errors(path: Path, what: str):
    """Errors raised by a user's Python file (a recipe, a grid spec) as one ConfigError line
    naming the file and line; ConfigErrors (a bad knob inside it) pass through as they are."""
    try:
        yield
    except ConfigError:
        raise
    except SyntaxError as e:
        raise ConfigError(f"{what} {path}:{e.lineno}: syntax error: {e.msg}") from e
    except Exception as e:  # noqa: BLE001 - any error in user code is a bad input file
        where = Path(path).resolve()
        tb = traceback.extract_tb(e.__traceback__)
        lines = [f.lineno for f in tb if Path(f.filename).resolve() == where]
        at = f":{lines[-1]}" if lines else ""
        raise ConfigError(f"{what} {path}{at}: {type(e).__name__}: {_first_line(e)}") from e


def describe_knobs() -> str:
    """One line per knob: key, type, default, meaning (for --help)."""
    defaults = flatten(RunConfig())
    lines = []
    for key, f in all_keys().items():
        t = _type_name(RunConfig, key)
        lines.append(f"  {key} ({t}, default {defaults[key]!r}): {f.metadata.get('help', '')}")
    return "\n".join(lines)
