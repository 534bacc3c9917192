"""What a run is built from: meshes, model spec, optimizer, compiled programs, samplers,
task and verifiers. Built once from a RunConfig (`build_parts`) and never changed;
what changes is the `TrainerState` and the host-side iterators beside it
(`rl_jax.train.state`). The programs are built from the state's shapes alone
(`build_programs`), so `rl-jax plan` compiles the trainer's own programs.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from rl_jax.config import RunConfig, SamplingConfig
from rl_jax.knobs import ConfigError
from rl_jax.models import (
    ModelSpec,
    init_sharded_params,
    model_params,
    param_shardings,
    resolve_spec,
)
from rl_jax.models.moe import route_dtype
from rl_jax.rewards import from_config as reward_from_config
from rl_jax.sampling import Engine
from rl_jax.sharding import MeshConfig, get_rules, make_mesh, num_batch_shards
from rl_jax.train.accounting import Passes, decode_chunk, passes, policy_steps, sampler_rows
from rl_jax.train.evaluation import correctness_fn, make_engine, make_eval_sampler
from rl_jax.train.optim import make_optimizer
from rl_jax.train.params import ParamFormat
from rl_jax.train.preflight import run_tokenizer, task_and_prompt_len
from rl_jax.train.step import abstract_batch, make_logprob_fn, make_update, make_value_fn


@dataclass(frozen=True, kw_only=True)
class Programs:
    """A run's programs on its meshes, built from the config, the model spec and the
    state's shapes (`build_programs`): the trainer runs them on its weights, and
    `rl-jax plan` compiles these same programs for a TPU topology on abstract arrays
    (`step_programs`)."""

    cfg: RunConfig
    mesh: Mesh  # the trainer's
    sample_mesh: Mesh  # the sampler's: the same mesh unless split
    spec: ModelSpec
    param_format: ParamFormat  # what the state's params hold, the weights the model runs (`view`)
    tx: Any  # optax.GradientTransformation
    lr_schedule: Any  # optax schedule: version -> learning rate
    lr_at: Any  # the schedule, jitted (one program for the logged learning rate)
    # (params, optimizer state) as abstract arrays on `mesh`: the programs are jitted for
    # these shardings, and the trainer's state is laid out on them.
    state_shapes: tuple[Any, Any]
    engine: Engine  # every batch (pipeline's as a stream)
    # The programs take the plan's state and run the model on its view.
    update_fn: Any  # make_update: (params, opt_state, minibatches) -> (params, opt_state, m)
    logprob_fn: Any  # the old policy's and the reference's log-probs
    value_fn: Any  # the critic's values (loss.advantage='gae'), else None

    @property
    def split(self) -> bool:
        return self.sample_mesh is not self.mesh

    @property
    def prompts_per_batch(self) -> int:  # P
        return self.cfg.data.prompts_per_batch

    @property
    def samples_per_prompt(self) -> int:  # G, a group's rows
        return self.cfg.sampling.n

    @property
    def updates_per_batch(self) -> int:  # M
        return self.cfg.train.updates_per_batch

    @property
    def passes(self) -> Passes:
        """The forward passes training takes besides its updates (old policy, reference,
        critic)."""
        return passes(self.cfg)

    def step_programs(
        self, tp: int, tg: int, *, minibatches: int | None = None
    ) -> dict[str, tuple[Any, tuple, dict]]:
        """{name: (jitted program, abstract arguments, static arguments)} of what an RL
        step runs at `tp` prompt and `tg` completion columns, in the order it runs them:
        "train_step" (the update: `minibatches` minibatch updates scanned in one program,
        by default the run's M), "logprob" (the old policy's and the reference's, over the
        update's M minibatches one after another: `phases.advantages`) and "values" (the
        critic's, over the whole batch) where the recipe takes them (`passes`), and the
        engine's "prefill_insert" and "generate"."""
        params, opt = self.state_shapes
        runs, M = self.passes, self.updates_per_batch
        P, G = self.prompts_per_batch, self.samples_per_prompt
        batch = functools.partial(
            abstract_batch,
            self.mesh,
            G=G,
            tp=tp,
            tg=tg,
            routes=replayed_routes(self.cfg, self.spec),
        )
        mbs = batch(
            P // M, old=runs.keep_old, ref=runs.ref, critic=runs.critic, stack=minibatches or M
        )
        out = {"train_step": (self.update_fn, (params, opt, mbs), {})}
        none = dict(old=False, ref=False, critic=False)
        if runs.old or runs.ref:
            out["logprob"] = (self.logprob_fn, (params, batch(P // M, **none, stack=M)), {})
        if runs.critic:
            out["values"] = (self.value_fn, (params, batch(P, **none)), {})
        return {**out, **self.engine.programs(self.sampler_view())}

    def sampler_view(self) -> dict[str, jax.ShapeDtypeStruct]:
        """The weights the engine runs, as abstract arrays: the state's view where the
        trainer lays it out, or in split mode pushed into the engine's layout on the
        sampler's devices (`SamplerWeights`)."""
        view = self.param_format.abstract_view(self.state_shapes[0])
        if not self.split:
            return view
        to = self.engine.param_shardings()
        return {n: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=to[n]) for n, a in view.items()}


@dataclass(frozen=True, kw_only=True)
class Parts(Programs):
    """What a run is built from: its `Programs`, and the task, verifiers and evaluation
    sampler."""

    tokenizer: Any
    eval_sampler: Engine
    task: Any
    reward_fn: Any
    correct_fn: Any
    val_problems: list


class SamplerWeights:
    """The policy's weights as the sampler runs them, made once per policy version: the
    trainer's state when the plan's view is the state itself; else `plan.view` of it
    (model.param_dtype, adapters merged); in split mode that view resharded onto the
    sampler's devices."""

    def __init__(self, parts: Parts):
        self.parts = parts
        self._view = jax.jit(parts.param_format.view)
        self._viewed: tuple[Any, int] | None = None  # (view, version)
        self._pushed: tuple[Any, int] | None = None  # split mode: (sampler copy, version)

    def reset(self) -> None:
        """Forget the copies (the state changed without a new version: restore, init)."""
        self._viewed = self._pushed = None

    def drop_view(self) -> None:
        """Free the view before an update: it is of the old version, and the update's
        state and moments need the memory."""
        self._viewed = None

    def policy(self, params, version: int):
        if self.parts.param_format.identity:
            return params
        if self._viewed is None or self._viewed[1] != version:
            self._viewed = None  # the old copy goes before the new one is made
            self._viewed = (self._view(params), version)
        return self._viewed[0]

    def sampler(self, params, version: int) -> tuple[Any, int]:
        """(weights, version) for the sampler."""
        if not self.parts.split:
            return self.policy(params, version), version
        if self._pushed is None or self._pushed[1] != version:
            # Split mode samples on the engine (RunConfig refuses it without one).
            self._pushed = (self.parts.engine.reshard(self.policy(params, version)), version)
            self._viewed = None  # the trainer's devices keep no copy of the view
        return self._pushed


def build_parts(cfg: RunConfig) -> tuple[Parts, dict, Any]:
    """(parts, initial params, initial optimizer state) of a resolved config; ConfigError
    on sizes that cannot work. The params are the plan's state (rl_jax.train.params)."""
    mesh, sample_mesh = make_meshes(cfg)
    rules = get_rules(cfg.mesh.rules, purpose="train")
    tokenizer = run_tokenizer(cfg)
    spec, weights = _build_params(cfg, mesh, rules, tokenizer)
    check_sizes(cfg, num_batch_shards(mesh))
    # Rendered for the tokenizer (chat template, answer instruction); prompts checked
    # against sampling.max_prompt_len.
    task, prompt_len = task_and_prompt_len(cfg, tokenizer)
    programs = build_programs(
        cfg, spec, mesh, rules, sample_mesh=sample_mesh, tokenizer=tokenizer, prompt_len=prompt_len
    )
    # What the trainer holds (float32 masters, LoRA adapters) and the weights the model
    # runs (`plan.view`): rl_jax.train.params. Laid out as the programs take it (a
    # loaded checkpoint's weights already are: then nothing moves).
    plan = programs.param_format
    params = plan.init_state(weights, key=adapter_key(cfg), mesh=mesh)
    del weights  # the weights cast into the state are not kept beside it
    params = jax.device_put(params, _shardings(programs.state_shapes[0]))
    opt_state = init_opt_state(programs.tx, mesh, params, plan)
    reward_fn = reward_from_config(cfg.rewards, task_reward=task.reward_name)
    val_problems = list(task.val)[: cfg.eval.num_prompts]
    parts = Parts(
        **{f.name: getattr(programs, f.name) for f in dataclasses.fields(Programs)},
        tokenizer=tokenizer,
        eval_sampler=make_eval_sampler(
            spec,
            cfg,
            tokenizer,
            mesh=sample_mesh,
            prompt_len=prompt_len,
            problems=len(val_problems),
        ),
        task=task,
        reward_fn=reward_fn,
        correct_fn=correctness_fn(cfg.rewards, task, reward_fn),
        val_problems=val_problems,
    )
    return parts, params, opt_state


def build_programs(
    cfg: RunConfig,
    spec: ModelSpec,
    mesh: Mesh,
    rules,
    *,
    sample_mesh: Mesh | None = None,
    tokenizer,
    prompt_len: int,
    **shape,
) -> Programs:
    """The run's `Programs` for `spec` on `mesh` (the sampler's on `sample_mesh`, by
    default the same), jitted for the state's shapes and shardings: no weights are
    needed, so the trainer and `rl-jax plan` build the same programs. The engine holds a
    slot for every row the schedule has in flight (`run_engine`; `shape` overrides its
    sizes); `tokenizer` gives it its stop and pad ids."""
    if cfg.loss.advantage == "gae" and not spec.value_head:
        raise ConfigError("loss.advantage='gae' trains a critic: set model.value_head=true")
    plan = ParamFormat.from_config(cfg, spec)
    tx, lr_schedule = make_optimizer(
        cfg.train,
        prompts_per_batch=cfg.data.prompts_per_batch,
        samples_per_prompt=cfg.sampling.n,
        lr_scale=cfg.lora.lr_factor,
    )
    params = plan.abstract_state(spec, param_shardings(spec, mesh, rules), mesh)
    state = (params, plan.abstract_optimizer(tx, params, mesh))
    sample_mesh = mesh if sample_mesh is None else sample_mesh
    return Programs(
        cfg=cfg,
        mesh=mesh,
        sample_mesh=sample_mesh,
        spec=spec,
        param_format=plan,
        tx=tx,
        lr_schedule=lr_schedule,
        # Evaluated eagerly, the schedule's dozen jnp ops compile one by one (~0.45 s).
        lr_at=jax.jit(lr_schedule),
        state_shapes=state,
        engine=run_engine(cfg, spec, tokenizer, sample_mesh, prompt_len, **shape),
        **_jitted(cfg, spec, mesh, rules, plan, tx, _shardings(state)),
    )


def _jitted(
    cfg: RunConfig, spec: ModelSpec, mesh: Mesh, rules, plan: ParamFormat, tx, state_shardings
) -> dict[str, Any]:
    """The trainer's programs, jitted for the state of `state_shardings` ((params,
    optimizer state)): the update (`make_update`: a batch's minibatch updates in one
    program), the log-prob pass (old policy, reference) and the critic's values where GAE
    needs them, as `Programs` holds them."""
    # The trainer scores tokens under the distribution the sampler drew them from.
    temperature = cfg.sampling.temperature or 1.0
    num_groups = cfg.data.prompts_per_batch // cfg.train.updates_per_batch
    update_fn = make_update(
        spec,
        rules,
        mesh,
        tx,
        cfg.loss.resolved(),
        num_groups=num_groups,
        max_tokens=cfg.sampling.max_new_tokens,
        temperature=temperature,
        state_shardings=state_shardings,
        plan=plan,
    )
    return {
        "update_fn": update_fn,
        "logprob_fn": make_logprob_fn(spec, rules, mesh, temperature=temperature, plan=plan),
        "value_fn": make_value_fn(spec, rules, mesh, plan=plan) if passes(cfg).critic else None,
    }


def run_engine(
    cfg: RunConfig, spec: ModelSpec, tokenizer, mesh: Mesh, prompt_len: int, **shape
) -> Engine:
    """The engine every batch samples on (pipeline's as a stream): by default a slot for
    every row the schedule has in flight at once (`sampler_rows`: B_p x n, x k for
    ppo_off_policy's k batches, x W for pipeline's W); `shape` overrides `engine_shape`'s
    (the plan prefills every prompt in one block)."""
    return make_engine(
        spec,
        engine_sampling(cfg),
        cfg,
        tokenizer,
        mesh=mesh,
        rows=sampler_rows(cfg),
        prompt_len=prompt_len,
        record_routes=replayed_routes(cfg, spec) is not None,
        **shape,
    )


def replayed_routes(cfg: RunConfig, spec: ModelSpec) -> tuple[int, int, Any] | None:
    """(layers, experts per token, dtype) of the experts the engine records and the
    trainer replays (`model.routing_replay`), or None."""
    if not (cfg.model.routing_replay and spec.is_moe):
        return None
    return spec.num_layers, spec.num_experts_per_tok, route_dtype(spec.num_experts)


def engine_sampling(cfg: RunConfig) -> SamplingConfig:
    """The trainer's engine's sampling settings: the run's, with pipeline's decode chunk
    (the stream swaps weights between chunks of this many steps)."""
    if cfg.train.off_policy == "pipeline":
        return dataclasses.replace(cfg.sampling, decode_chunk=decode_chunk(cfg))
    return cfg.sampling


def adapter_key(cfg: RunConfig) -> jax.Array:
    """The key LoRA's A matrices are drawn from (train.seed)."""
    return jax.random.fold_in(jax.random.key(cfg.train.seed), 0x10A)


def init_opt_state(tx, mesh: Mesh, params, plan: ParamFormat):
    """Optimizer state of the plan's trained part on the mesh: moments sharded as their
    weights, scalars such as Adam's count replicated (`ParamFormat.optimizer_shardings`)."""
    init = functools.partial(plan.init_optimizer, tx)
    return jax.jit(init, out_shardings=plan.optimizer_shardings(tx, params, mesh))(params)


def copy_params(params):
    return jax.tree.map(jnp.copy, params)


def _build_params(cfg: RunConfig, mesh: Mesh, rules, tokenizer) -> tuple[ModelSpec, dict]:
    if cfg.model.path:
        from rl_jax.models import load_model

        model = load_model(cfg.model, mesh=mesh, rules_preset=cfg.mesh.rules)
        return model.spec, model_params(model)
    spec = resolve_spec(cfg.model)
    if spec.vocab_size < tokenizer.vocab_size:
        raise ConfigError(
            f"model vocab_size={spec.vocab_size} is smaller than the tokenizer's "
            f"{tokenizer.vocab_size}; set model.vocab_size"
        )
    # The stacked params directly: building a Transformer would split them per
    # layer and model_params would stack them again (two compiles, ~1 s).
    with jax.set_mesh(mesh):
        params = init_sharded_params(spec, mesh=mesh, rules=rules, seed=cfg.train.seed)
    return spec, params


def check_sizes(cfg: RunConfig, shards: int) -> None:
    P, M = cfg.data.prompts_per_batch, cfg.train.updates_per_batch
    if P % M:
        raise ConfigError(
            f"data.prompts_per_batch={P} must be divisible by train.updates_per_batch={M} "
            "(each update trains on P / M prompts' groups)"
        )
    rows = P // M * cfg.sampling.n
    if rows % shards:
        raise ConfigError(
            f"a minibatch of {rows} rows (data.prompts_per_batch / train.updates_per_batch "
            f"x sampling.n) does not split over {shards} batch shards (mesh.data x "
            "mesh.fsdp)"
        )
    if cfg.data.dynamic_sampling and cfg.train.off_policy == "pipeline":
        raise ConfigError(
            "data.dynamic_sampling resamples whole batches before training: it needs "
            "train.off_policy in ('on_policy', 'ppo_off_policy'), got 'pipeline'"
        )
    U = policy_steps(cfg)
    if cfg.train.off_policy == "pipeline" and (cfg.train.off_policy_k + 1) // U < 1:
        raise ConfigError(
            f"train.off_policy_k={cfg.train.off_policy_k} is below the {U} optimizer steps of "
            f"a batch (train.updates_per_batch={M}, train.grad_accum={cfg.train.grad_accum})"
            ": PipelineRL-k needs k + 1 >= the steps a batch takes"
        )


def make_meshes(cfg: RunConfig, devices: list | None = None) -> tuple[Mesh, Mesh]:
    """(trainer mesh, sampler mesh) over `devices` (default: this process's, the first
    mesh.num_devices of them when set): one mesh when colocated; in split mode the
    first mesh.sampler_devices devices form a data-parallel sampler mesh (keeping the
    trainer's tensor axis when it divides them) and the rest the trainer's mesh.
    `rl-jax plan` passes a TPU topology's devices."""
    m = cfg.mesh
    if not m.sampler_devices:
        if devices is None:
            mesh = make_mesh(m)
        else:
            mesh = make_mesh(dataclasses.replace(m, num_devices=0), devices=devices)
        return mesh, mesh
    # (RunConfig refuses split mode outside train.off_policy='pipeline'.)
    if devices is None:
        if jax.process_count() > 1:
            raise ConfigError(
                "mesh.sampler_devices (split mode) runs in one process only; under "
                "jax.distributed use mesh.sampler_devices=0"
            )
        devices = jax.devices()
        if m.num_devices:
            if m.num_devices > len(devices):
                raise ConfigError(f"mesh.num_devices={m.num_devices} but only {len(devices)} exist")
            devices = devices[: m.num_devices]
    check_split(m.sampler_devices, len(devices))
    sample_devs, train_devs = devices[: m.sampler_devices], devices[m.sampler_devices :]
    train_mesh = make_mesh(dataclasses.replace(m, num_devices=0), devices=train_devs)
    tensor = train_mesh.shape["tensor"]
    tensor = tensor if len(sample_devs) % tensor == 0 else 1
    sample_mesh = make_mesh(
        MeshConfig(data=-1, fsdp=1, tensor=tensor, rules=m.rules), devices=sample_devs
    )
    return train_mesh, sample_mesh


def check_split(sampler_devices: int, devices: int) -> None:
    """Split mode leaves the trainer at least one of the `devices`."""
    if not 0 < sampler_devices < devices:
        raise ConfigError(
            f"mesh.sampler_devices={sampler_devices} must leave the trainer at least one of "
            f"the {devices} devices"
        )


def _shardings(tree):
    return jax.tree.map(lambda a: a.sharding, tree)
