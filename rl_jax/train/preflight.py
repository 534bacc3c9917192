"""Checks of every file a run reads, before JAX starts and before any weight is loaded.

The trainer reads the model, tokenizer and data only after it has started JAX and
built its mesh; a damaged or missing file found there costs a device start and
surfaces as a traceback. These checks read headers and small JSON files only, so
the CLI runs them first and a bad input is one ConfigError line (exit 2).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import TYPE_CHECKING, Any

from rl_jax.config import DataConfig, ModelConfig, RewardConfig, RunConfig
from rl_jax.knobs import ConfigError
from rl_jax.runs.storage import check_out_dir

if TYPE_CHECKING:
    from rl_jax.data import Task


def check_run_inputs(cfg: RunConfig, *, out=None) -> None:
    """Data files, model files, the verifier, the prompt lengths and the schedule of `cfg`,
    as the trainer will read them. Prints (to `out`, default stderr) the verifier chosen
    and any warning, one line each."""
    out = sys.stderr if out is None else out
    check_out_dir(cfg.out_dir)  # where the run writes, before anything is read
    task_reward = check_data_files(cfg.data)  # it needs no model
    check_model_files(cfg.model)
    check_lora_targets(cfg)
    check_router_losses(cfg)
    check_reward(cfg.rewards, task_reward=task_reward)
    check_eval_size(cfg)
    task = None
    reads = cfg.data.source in ("file", "hf") or cfg.data.split_file or cfg.data.mixture
    if reads or cfg.sampling.max_prompt_len:
        task = run_task(cfg, run_tokenizer(cfg))
    if task is not None:
        check_mixture_rewards(cfg.rewards, task)
    if task is not None and reads:
        if not cfg.data.split_file and len(task.val) < cfg.eval.num_prompts:
            print(
                f"warning: eval.num_prompts={cfg.eval.num_prompts} but the validation split "
                f"holds {len(task.val)} problems (data.val_size={cfg.data.val_size:g}): each "
                f"evaluation uses {len(task.val)}",
                file=out,
                flush=True,
            )
    # Printed once every check has passed (a bad input stays one line): what reading the
    # data kept and dropped. A generated task's verifier is its own name: said only when
    # rewards.name picks another.
    if task is not None and task.report is not None:
        print(task.report.line(), file=out, flush=True)
    if task_reward and (reads or cfg.rewards.name not in ("auto", task_reward)):
        print(verifier_line(cfg, task_reward), file=out, flush=True)
    for line in schedule_warnings(cfg):
        print(line, file=out, flush=True)


def check_eval_size(cfg: RunConfig) -> None:
    """A generated task makes its validation problems: an explicit data.val_size below
    eval.num_prompts would evaluate on fewer prompts than asked (a noisier curve than the
    config says), so it is an error; data.val_size=0 (auto) makes enough."""
    from rl_jax.config import resolved
    from rl_jax.config.data import GENERATED

    data = resolved(cfg).data
    if data.source in GENERATED and not data.split_file and not data.mixture:
        have = data.generated_val_size
        if have < cfg.eval.num_prompts:
            raise ConfigError(
                f"eval.num_prompts={cfg.eval.num_prompts} exceeds the {have} validation "
                f"problems of data.val_size={cfg.data.val_size:g}; set data.val_size to at "
                f"least {cfg.eval.num_prompts}, 0 (auto), or lower eval.num_prompts"
            )


def run_tokenizer(cfg: RunConfig) -> Any:
    """The tokenizer a run of `cfg` uses: the model's, or the character tokenizer."""
    if cfg.model.path:
        from rl_jax.models.tokenizer import load_tokenizer

        return load_tokenizer(cfg.model.path)
    from rl_jax.data.tokenizer import CharTokenizer

    return CharTokenizer()


def verifier_line(cfg: RunConfig, task_reward: str) -> str:
    """One line: the verifier a run scores with, and why."""
    name = cfg.rewards.name
    if name == "auto":
        return f"verifier: {task_reward} (rewards.name=auto, the data's own)"
    if name != task_reward:
        return (
            f"verifier: {name} (rewards.name); warning: the data's own verifier is "
            f"{task_reward} (rewards.name=auto)"
        )
    return f"verifier: {name} (rewards.name)"


def run_task(cfg: RunConfig, tokenizer: Any) -> Task:
    """The task a run trains on, rendered for `tokenizer` (its chat template, the answer
    instruction of the chosen verifier), with every prompt within the prompt-length limit:
    an explicit sampling.max_prompt_len below the longest prompt is an error naming it."""
    return task_and_prompt_len(cfg, tokenizer)[0]


def task_and_prompt_len(cfg: RunConfig, tokenizer: Any) -> tuple[Task, int]:
    """`run_task` and its `prompt_len_limit` (what the engine's prompts are padded to).
    Under an explicit sampling.max_prompt_len, longer prompts are dropped (counted in
    `task.report`); none of a split's left is an error naming the longest."""
    from rl_jax.data import build_task

    task = build_task(cfg.data, tokenizer=tokenizer, verifier=cfg.rewards.name)
    limit = cfg.sampling.max_prompt_len
    if limit and isinstance(task.train, list):
        task = _without_long_prompts(cfg, task, tokenizer)
    return task, prompt_len_limit(cfg, task, tokenizer)


def _without_long_prompts(cfg: RunConfig, task: Task, tokenizer: Any) -> Task:
    from rl_jax.data import LoadReport

    limit, bucket = cfg.sampling.max_prompt_len, cfg.sampling.length_bucket
    kept: dict[str, list] = {"training": [], "validation": []}
    longest, where = 0, ""
    for split, p, n in _prompt_lengths(task, tokenizer):
        if n <= limit:
            kept[split].append(p)
        elif n > longest:
            longest, where = n, f"{split} problem {p.id}"
    train, val = kept["training"], kept["validation"]
    if len(train) + len(val) == len(task.train) + len(task.val):
        return task
    if not train or (len(task.val) and not val):
        every = f", and every {'training' if not train else 'validation'} prompt is longer"
        raise _below_longest(limit, bucket, longest, where, every)
    report = task.report or LoadReport(
        where=[f"data.source={cfg.data.source}"],
        layout=f"{task.name} problems generated",
        rows=len(task.train) + len(task.val),
    )
    dropped = {
        **report.dropped,
        "too long": len(task.train) + len(task.val) - len(train) - len(val),
    }
    report = dataclasses.replace(report, dropped=dropped, train=len(train), val=len(val))
    return dataclasses.replace(task, train=train, val=val, report=report)


def prompt_len_limit(cfg: RunConfig, task: Task, tokenizer: Any) -> int:
    """The width the engine pads prompts to: the longest prompt of the task in tokens
    rounded up to sampling.length_bucket, at most an explicit sampling.max_prompt_len.
    Lazily read datasets (tfds) are measured only for auto (0); under an explicit limit
    they take the limit, checked as prompts are sampled."""
    limit, bucket = cfg.sampling.max_prompt_len, cfg.sampling.length_bucket
    lazy = not isinstance(task.train, list)
    if limit and lazy:
        return limit
    longest, where = 0, ""
    for split, p, n in _prompt_lengths(task, tokenizer):
        if n > longest:
            longest, where = n, f"{split} problem {p.id}"
    if limit and longest > limit:
        raise _below_longest(limit, bucket, longest, where)
    # The engine pads every prompt to this width: the data's longest prompt, not a cap
    # above it that no prompt reaches (those columns would be computed and masked).
    width = max(bucket, -(-longest // bucket) * bucket)
    return min(limit, width) if limit else width


def _prompt_lengths(task: Task, tokenizer: Any):
    """(split, problem, prompt tokens) of every problem, training then validation."""
    for split, problems in (("training", task.train), ("validation", task.val)):
        for i in range(len(problems)):
            yield split, problems[i], len(tokenizer.encode(problems[i].prompt))


def _below_longest(limit: int, bucket: int, longest: int, where: str, more: str = ""):
    return ConfigError(
        f"sampling.max_prompt_len={limit} is below the longest prompt, {longest} tokens "
        f"({where}, as rendered for the model){more}; set "
        f"sampling.max_prompt_len={-(-longest // bucket) * bucket} or 0 (auto)"
    )


def schedule_warnings(cfg: RunConfig) -> list[str]:
    """Warnings about a learning-rate schedule that does not do what its knobs suggest."""
    t = cfg.train
    warm, updates = t.warmup_count, t.optimizer_steps
    if warm and warm >= updates:
        # Plain arithmetic, not the optax schedule: no JAX computation before the trainer
        # starts JAX (update s < W gets peak * (s + 1) / W).
        from rl_jax.train.optim import peak_lr

        peak = peak_lr(
            t,
            prompts_per_batch=cfg.data.prompts_per_batch,
            samples_per_prompt=cfg.sampling.n,
            lr_scale=cfg.lora.lr_factor,
        )
        last = peak * updates / warm
        return [
            f"warning: train.warmup_steps={t.warmup_steps:g} is {warm} updates, at least the "
            f"run's {updates} optimizer steps (train.steps={t.steps}): the learning rate never "
            "leaves warm-up "
            f"(it reaches {last:.3g} of {peak:.3g}); set train.warmup_steps to a fraction of "
            "the steps, e.g. 0.05"
        ]
    return []


def check_model_files(cfg: ModelConfig, *, tokenizer: bool = True) -> None:
    """`model.path` (a local path or a URL) exists and is a model: its spec resolves,
    every tensor the spec needs lies inside its safetensors file(s) with the right shape,
    and (if `tokenizer`) its tokenizer loads."""
    if not cfg.path:
        return
    from rl_jax.config import paths
    from rl_jax.models.load import local_model_path, resolve_spec

    if paths.kind(cfg.path, "model.path") is None:
        raise ConfigError(
            f"model.path={cfg.path!r} does not exist (an HF directory, a GGUF file or an "
            "rl_jax model directory)"
        )
    # A URL's files are copied here once (the trainer loads the same copy): the checks
    # below read them as they read a local directory.
    path = local_model_path(cfg.path)
    if not path.is_dir() and path.suffix != ".gguf":
        raise ConfigError(
            f"model.path={cfg.path!r} is neither a directory (HF or rl_jax model) nor a .gguf file"
        )
    spec = resolve_spec(cfg)  # reads config.json / rl_jax_model.json / the GGUF header
    if path.is_dir():
        from rl_jax.models.hf import check_hf_shapes, hf_weight_files
        from rl_jax.models.native import PARAMS_FILE, is_native_dir
        from rl_jax.models.safetensors_io import check_safetensors

        if is_native_dir(path):
            check_safetensors(path / PARAMS_FILE)
        else:
            shapes = {}
            for f in hf_weight_files(path):
                shapes.update({n: s for n, (_, s) in check_safetensors(f).items()})
            check_hf_shapes(spec, shapes, where=str(path))
    else:  # a GGUF file
        from rl_jax.models.gguf_io import gguf_hf_shapes
        from rl_jax.models.hf import check_hf_shapes

        check_hf_shapes(spec, gguf_hf_shapes(path), where=str(path))
    if tokenizer:
        from rl_jax.models.tokenizer import load_tokenizer

        load_tokenizer(path)


def check_lora_targets(cfg: RunConfig) -> None:
    """LoRA's targets are weights of the model and its rank fits them (reads no weight)."""
    if not cfg.lora.enabled:
        return
    from rl_jax.models.load import resolve_spec
    from rl_jax.train.params import check_lora

    check_lora(resolve_spec(cfg.model), cfg.lora.target_names, cfg.lora.rank)


def check_router_losses(cfg: RunConfig) -> None:
    """The router's loss terms and routing replay need a router: a mixture-of-experts
    model."""
    knobs = {f"loss.{k}": getattr(cfg.loss, k) for k in ("router_aux_coef", "router_z_coef")}
    knobs["model.routing_replay"] = cfg.model.routing_replay
    on = [k for k, v in knobs.items() if v]
    if not on:
        return
    from rl_jax.models.load import resolve_spec

    if not resolve_spec(cfg.model).is_moe:
        raise ConfigError(
            f"{on[0]}={knobs[on[0]]} needs a mixture-of-experts model (model.num_experts "
            "> 0); this model's MLP is dense"
        )


def check_data_files(data: DataConfig) -> str:
    """Reads the data files a DataConfig names (data.path, data.val_path, data.split_file),
    every row checked; returns the task's verifier name ('' when not known without
    opening a dataset)."""
    if data.source not in ("file", "hf") and not data.split_file and not data.mixture:
        return data.source if data.source in ("arith", "countdown") else ""
    from rl_jax.data import build_task

    task = build_task(data)
    if not len(task.val):
        raise ConfigError(
            f"data.source={data.source!r} leaves no validation problems (data.val_path, "
            "data.val_size, data.split_name)"
        )
    return task.reward_name


def check_reward(rewards: RewardConfig, *, task_reward: str) -> None:
    """The verifier can be built (its optional dependency is installed)."""
    from rl_jax.rewards import from_config

    if rewards.name == "auto" and not task_reward:
        return
    try:
        # Building it starts nothing: a sandboxed verifier's pool starts at its first call.
        from_config(rewards, task_reward=task_reward)
    except ImportError as e:
        raise ConfigError(f"rewards.name={rewards.name!r}: {e}") from None
    except KeyError as e:  # rewards.name=auto picked a name the registry lacks
        raise ConfigError(f"rewards.name={rewards.name!r}: {e.args[0]}") from None


def check_mixture_rewards(rewards: RewardConfig, task: Task) -> None:
    """Each verifier a task mixture's problems name can be built: by the run's mixture
    verifier itself (`verifier(name)`), which otherwise builds them at their first
    answers, in the training loop."""
    from rl_jax.rewards import from_config

    routed = rewards.name == "mixture" or (rewards.name == "auto" and task.reward_name == "mixture")
    if not routed:
        return
    mixture = from_config(rewards, task_reward=task.reward_name)
    for name, info in task.info.get("tasks", {}).items():
        try:
            mixture.verifier(info["verifier"])
        except ImportError as e:
            raise ConfigError(f"data.mixture task {name!r}: {e}") from None
