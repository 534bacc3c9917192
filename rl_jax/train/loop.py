"""The RL loop: sample -> score -> advantages -> filters -> M updates -> push weights.

Off-policy modes (ScaleRL section 3.1), all colocated on one mesh:
  on_policy       generate B_p x n rows with the current weights, take M updates.
  ppo_off_policy  generate k batches with the current weights, then train on
                  them one after another (k x M updates on increasingly stale data).
  pipeline        PipelineRL-k: up to W "waves" (sampler states, each B_p x n
                  rows) decode in chunks, round robin. Whenever the oldest wave
                  finishes, the trainer takes its M updates and the new weights
                  are used by every later chunk: sequences in flight continue
                  with the new weights on a stale KV cache, every token records
                  the policy version that sampled it. W = (k + 1) // M keeps
                  every update within k versions of the oldest token it trains on.

Split mode (`mesh.sampler_devices=N`, pipeline only): the sampler decodes on the
first N devices in a background thread while the rest train; weights are pushed
to the sampler by resharding after every batch (`rl_jax.train.split`).

One "step" is one batch of B_p prompts trained with M optimizer updates; the
policy version counts optimizer updates. Random keys derive from (seed, step),
so a resumed run repeats the numbers of one that never stopped.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from rl_jax.config import RunConfig, flatten, resolved, run_id
from rl_jax.data import Curriculum, PromptPipeline
from rl_jax.knobs import ConfigError
from rl_jax.losses import advantages_from_config, gae_from_config, zero_variance_groups
from rl_jax.models import ModelSpec, init_sharded_params, model_params, resolve_spec
from rl_jax.rewards import from_config as reward_from_config
from rl_jax.rewards import score_batch, shape_rewards
from rl_jax.runs import (
    MetricsLogger,
    RunDir,
    append_jsonl,
    create_run_dir,
    progress_bar,
    sample_rows,
    truncate_jsonl_after,
)
from rl_jax.runs.samples import format_row, samples_due
from rl_jax.sampling import Rollouts, Sampler
from rl_jax.sharding import (
    MeshConfig,
    get_rules,
    make_mesh,
    num_batch_shards,
    start_jax,
)
from rl_jax.train.accounting import ComputeCounters, forward_flops, step_flops
from rl_jax.train.checkpoint import Checkpointer
from rl_jax.train.evaluation import (
    correctness_fn,
    eval_key,
    evaluate_policy,
    make_eval_sampler,
)
from rl_jax.train.optim import make_optimizer
from rl_jax.train.params import LORA_KEY, ParamPlan
from rl_jax.train.preflight import run_task
from rl_jax.train.split import SplitSampler
from rl_jax.train.step import (
    assemble_batch,
    make_logprob_fn,
    make_train_step,
    make_value_fn,
    put_batch,
)


class NonFiniteError(RuntimeError):
    """Too many consecutive NaN/Inf updates; the run stopped after a checkpoint."""


@dataclass
class Wave:
    """One batch of rows being sampled (a PipelineRL wave)."""

    state: Any  # SamplerState
    problems: list  # [P] Problem
    step: int  # the RL step whose prompts these are


def load_tokenizer(cfg: RunConfig):
    if cfg.model.path:
        from rl_jax.models import load_tokenizer as _hf

        return _hf(cfg.model.path)
    from rl_jax.data.tokenizer import CharTokenizer

    return CharTokenizer()


class RLTrainer:
    """Builds everything a RunConfig names and runs it into its run directory."""

    def __init__(self, cfg: RunConfig, *, run_root: str | Path | None = None, quiet: bool = False):
        cfg = resolved(cfg)  # knobs left to the loss's defaults, filled in once for every part
        start_jax(cfg.mesh)
        self.cfg = cfg
        self.quiet = quiet
        self.is_main = jax.process_index() == 0
        # The run directory first: a busy or foreign one is refused before any device work.
        self.run: RunDir = create_run_dir(cfg, run_root, lock=self.is_main, write=False)
        self.run_id = run_id(cfg)
        try:
            self._build(cfg)
        except BaseException:
            self.run.close()
            raise

    def _build(self, cfg: RunConfig) -> None:
        # mesh: the trainer's; sample_mesh: the sampler's (the same one unless split).
        self.mesh, self.sample_mesh = _make_meshes(cfg)
        self.split = self.sample_mesh is not self.mesh
        self.shards = num_batch_shards(self.mesh)
        self.train_rules = get_rules(cfg.mesh.rules, purpose="train")
        self.tokenizer = load_tokenizer(cfg)
        self.spec, weights = self._build_params()
        self._check_sizes()
        # [params view] What the trainer holds (float32 masters, LoRA adapters) and the
        # weights the model runs (`self.plan.view`): rl_jax.train.params.
        self.plan = ParamPlan.from_config(cfg, self.spec)
        params = self.plan.init_state(weights, key=self._adapter_key(), mesh=self.mesh)
        self._view = jax.jit(self.plan.view)
        self._viewed: tuple[Any, int] | None = None  # (the view of self.params, version)

        P, G, M = cfg.data.prompts_per_batch, cfg.sampling.n, cfg.train.updates_per_batch
        self.P, self.G, self.M = P, G, M
        self.tx, self.lr_schedule = make_optimizer(
            cfg.train, prompts_per_batch=P, samples_per_prompt=G
        )
        # One compiled program for the logged learning rate (evaluated eagerly, the
        # schedule's dozen jnp ops compile one by one at the first step: ~0.45 s).
        self._lr_at = jax.jit(self.lr_schedule)
        self.params = params
        self.opt_state = self._init_opt_state(params)
        needs_ref = cfg.loss.kl_coef > 0
        # The reference policy is the initial one, frozen (sharded like the policy).
        self.ref_params = jax.tree.map(jnp.copy, params) if needs_ref else None

        interrupt_ids = self.tokenizer.encode(cfg.sampling.interrupt_text)
        eos = self.tokenizer.eos_id
        self.sampler = Sampler(
            self.spec,
            cfg.sampling,
            mesh=self.sample_mesh,
            eos_id=eos,
            pad_id=self.tokenizer.pad_id,
            interrupt_ids=interrupt_ids,
            rules=cfg.mesh.rules,
        )
        self.eval_sampler = make_eval_sampler(self.spec, cfg, self.tokenizer, mesh=self.sample_mesh)
        mb_groups = P // M
        self.max_tokens = cfg.sampling.max_new_tokens
        step_fn = make_train_step(
            self.spec,
            self.train_rules,
            self.mesh,
            self.tx,
            cfg.loss,
            num_groups=mb_groups,
            max_tokens=self.max_tokens,
            temperature=self._train_temperature(),
            state_shardings=(_shardings(self.params), _shardings(self.opt_state)),
            plan=self.plan,
        )
        self.train_step = step_fn
        self.logprob_fn = make_logprob_fn(
            self.spec,
            self.train_rules,
            self.mesh,
            temperature=self._train_temperature(),
            plan=self.plan,
        )
        self.critic = cfg.loss.advantage == "gae"
        if self.critic and not self.spec.value_head:
            raise ConfigError("loss.advantage='gae' trains a critic: set model.value_head=true")
        self.value_fn = (
            make_value_fn(self.spec, self.train_rules, self.mesh, plan=self.plan)
            if self.critic
            else None
        )

        # Rendered for the tokenizer (chat template, answer instruction); prompts checked
        # against sampling.max_prompt_len.
        self.task = run_task(cfg, self.tokenizer)
        self.reward_fn = reward_from_config(cfg.rewards, task_reward=self.task.reward_name)
        self.correct_fn = correctness_fn(cfg.rewards, self.task, self.reward_fn)
        self.curriculum = Curriculum(cfg.data)
        self.pipeline = PromptPipeline(
            self.task.train,
            batch_size=P,
            seed=cfg.data.seed,
            curriculum=self.curriculum,
            # Every process holds the same global batch of prompts (they are tiny): the
            # sampler shards rows over the global mesh and rewards are scored everywhere.
            process_index=0,
            process_count=1,
        )
        self.val_problems = list(self.task.val)[: cfg.eval.num_prompts]

        if self.is_main:
            self.run.write_config(cfg)
        self.knobs = flatten(cfg)
        # Opened by run_loop once it knows the step it resumes from (TensorBoard's purge).
        self.logger: MetricsLogger | None = None
        self.ckpt = Checkpointer(
            self.run.checkpoints_dir, keep=cfg.checkpoint.keep, async_save=cfg.checkpoint.async_save
        )
        self.counters = ComputeCounters()
        self.step = 0
        self.version = 0
        self.nonfinite_streak = 0
        self.waves: list[Wave] = []
        self.staleness_hist: dict[int, int] = {}
        # Held while prompts are drawn and while the curriculum they read is updated
        # (split mode draws in the sampler thread).
        self.data_lock = threading.Lock()
        self._pushed: tuple[Any, int] | None = None  # split mode: (sampler params, version)
        self.split_sampler: SplitSampler | None = None
        self.step_hooks: list = []  # callables(trainer) run after every step (tests, tools)
        self._closed = False
        self._resumed: bool | None = None  # try_resume's answer, once asked
        self._mid_group = False  # inside a PPO-off-policy-k group (no checkpoint here)

    def set_initial_params(self, host_params: dict) -> None:
        """Start from these weights (e.g. a supervised warm-up) instead of the random init."""
        # [params view] The model's weights in the state (all but the adapters).
        weights = {k: v for k, v in self.params.items() if k != LORA_KEY}
        missing = sorted(set(weights) - set(host_params))
        if missing:
            raise ValueError(f"initial params lack tensors {missing}")
        for k, v in weights.items():
            if tuple(np.shape(host_params[k])) != tuple(v.shape):
                raise ValueError(
                    f"initial param {k!r} has shape {np.shape(host_params[k])}, "
                    f"model needs {v.shape}"
                )
        weights = {
            k: jax.device_put(np.asarray(host_params[k], v.dtype), v.sharding)
            for k, v in weights.items()
        }
        self.params = self.plan.init_state(weights, key=self._adapter_key(), mesh=self.mesh)
        self._viewed = None
        self.opt_state = self._init_opt_state(self.params)
        if self.ref_params is not None:
            self.ref_params = jax.tree.map(jnp.copy, self.params)

    # ---- setup helpers --------------------------------------------------------------------

    def _init_opt_state(self, params):
        """Optimizer state on the mesh: moments inherit their params' shardings (zeros_like),
        scalars such as Adam's count are placed replicated instead of on device 0."""
        rep = NamedSharding(self.mesh, PartitionSpec())

        def on_mesh(x):
            sh = x.sharding
            if isinstance(sh, NamedSharding) and sh.mesh == self.mesh:
                return x
            return jax.device_put(x, rep)

        init = functools.partial(self.plan.init_optimizer, self.tx)  # [params view]
        return jax.tree.map(on_mesh, jax.jit(init)(params))

    def _adapter_key(self) -> jax.Array:
        return jax.random.fold_in(jax.random.key(self.cfg.train.seed), 0x10A)

    def policy_weights(self) -> dict[str, jax.Array]:
        """The policy's weights as the model runs them (`plan.view` of the trainer's
        state: model.param_dtype, adapters merged), made once per version."""
        if self.plan.identity:
            return self.params
        if self._viewed is None or self._viewed[1] != self.version:
            self._viewed = None  # the old copy goes before the new one is made
            self._viewed = (self._view(self.params), self.version)
        return self._viewed[0]

    def _train_temperature(self) -> float:
        # The trainer scores tokens under the distribution the sampler drew them from.
        t = self.cfg.sampling.temperature
        return 1.0 if t == 0 else t

    def _build_params(self) -> tuple[ModelSpec, dict]:
        cfg = self.cfg
        if cfg.model.path:
            from rl_jax.models import load_model

            model = load_model(cfg.model, mesh=self.mesh, rules_preset=cfg.mesh.rules)
            return model.spec, model_params(model)
        spec = resolve_spec(cfg.model)
        if spec.vocab_size < self.tokenizer.vocab_size:
            raise ConfigError(
                f"model vocab_size={spec.vocab_size} is smaller than the tokenizer's "
                f"{self.tokenizer.vocab_size}; set model.vocab_size"
            )
        # The stacked params directly: building a Transformer would split them per
        # layer and model_params would stack them again (two compiles, ~1 s).
        with jax.set_mesh(self.mesh):
            params = init_sharded_params(
                spec, mesh=self.mesh, rules=self.train_rules, seed=cfg.train.seed
            )
        return spec, params

    def _check_sizes(self) -> None:
        cfg = self.cfg
        P, M = cfg.data.prompts_per_batch, cfg.train.updates_per_batch
        if P % M:
            raise ConfigError(
                f"data.prompts_per_batch={P} must be divisible by train.updates_per_batch={M} "
                "(each update trains on P / M prompts' groups)"
            )
        rows = P // M * cfg.sampling.n
        if rows % self.shards:
            raise ConfigError(
                f"a minibatch of {rows} rows (data.prompts_per_batch / train.updates_per_batch "
                f"x sampling.n) does not split over {self.shards} batch shards (mesh.data x "
                "mesh.fsdp)"
            )
        if cfg.data.dynamic_sampling and cfg.train.off_policy == "pipeline":
            raise ConfigError(
                "data.dynamic_sampling resamples whole batches before training: it needs "
                "train.off_policy in ('on_policy', 'ppo_off_policy'), got 'pipeline'"
            )
        if cfg.train.off_policy == "pipeline" and (cfg.train.off_policy_k + 1) // M < 1:
            raise ConfigError(
                f"train.off_policy_k={cfg.train.off_policy_k} is below train.updates_per_batch={M}"
                ": PipelineRL-k needs k + 1 >= M"
            )

    # ---- sampling -------------------------------------------------------------------------

    def _prompt_ids(self, problems) -> list[list[int]]:
        return [self.tokenizer.encode(p.prompt) for p in problems]

    @property
    def _needs_old_logp(self) -> bool:
        """Batches carry the old policy's log-probs: several updates per batch, or TIS."""
        return self.M > 1 or self.cfg.loss.tis

    def _row_ids(self, step: int, n_prompts: int) -> np.ndarray:
        # Distinct per (step, row) so every draw of the run is its own stream.
        return (step * 1_000_003 + np.arange(n_prompts * self.G)) % (2**31 - 1)

    def _sample_key(self) -> jax.Array:
        return jax.random.fold_in(jax.random.key(self.cfg.train.seed), 0x5A17)

    def sampler_weights(self) -> tuple[Any, int]:
        """(params, version) for the sampler: the trainer's own arrays when colocated; in
        split mode a copy resharded onto the sampler's devices, made once per version."""
        if not self.split:
            return self.policy_weights(), self.version
        if self._pushed is None or self._pushed[1] != self.version:
            self._pushed = (self.sampler.reshard(self.policy_weights()), self.version)
        return self._pushed

    def _start_wave(self, step: int, problems, weights: tuple[Any, int] | None = None) -> Wave:
        params, _ = weights or self.sampler_weights()
        state = self.sampler.start(
            params,
            self._prompt_ids(problems),
            n=self.G,
            key=self._sample_key(),
            row_ids=self._row_ids(step, len(problems)),
        )
        return Wave(state=state, problems=list(problems), step=step)

    def _generate(self, step: int, problems) -> Rollouts:
        return self.sampler.generate(
            self.sampler_weights()[0],
            self._prompt_ids(problems),
            n=self.G,
            key=self._sample_key(),
            version=self.version,
            row_ids=self._row_ids(step, len(problems)),
        )

    # ---- scoring and training -------------------------------------------------------------

    def _score(self, ro: Rollouts, problems) -> tuple[np.ndarray, np.ndarray, list[str]]:
        texts = [self.tokenizer.decode(ro.completion(b)) for b in range(ro.num_rows)]
        answers = [problems[g].answer for g in ro.group_ids]
        raw = score_batch(self.reward_fn, texts, answers)
        shaped = shape_rewards(
            raw,
            cfg=self.cfg.rewards,
            reward_fn=self.reward_fn,
            completions=texts,
            lengths=ro.lengths,
        )
        return raw, shaped, texts

    def _account_sampling(self, ro: Rollouts) -> None:
        tp = ro.prompt_mask.sum(axis=1)[:: self.G]  # [P] (a group's rows share the prompt)
        self.counters.add(
            prompt_tokens=int(tp.sum()),
            generated_tokens=int(ro.lengths.sum()),
            sampler_flops=forward_flops(self.spec, tp, ro.lengths, self.G),
        )

    def _zero_variance(self, shaped: np.ndarray, group_ids: np.ndarray, n_prompts: int):
        """[P] bool: groups whose shaped rewards are all equal (`zero_variance_groups`, the
        one definition: the rewards the advantages read, so exactly the groups whose
        advantages are all zero)."""
        zv, _ = zero_variance_groups(
            jnp.asarray(shaped, jnp.float32),
            jnp.asarray(group_ids, jnp.int32),
            num_groups=n_prompts,
        )
        return np.asarray(zv)

    def _train_on(self, ro: Rollouts, problems) -> dict[str, float]:
        """M updates on one batch of P prompts x G samples; returns step metrics."""
        t0 = time.perf_counter()
        P, G, M = len(problems), self.G, self.M
        raw, shaped, texts = self._score(ro, problems)
        self._log_samples(problems, texts, raw, shaped)
        score_s = time.perf_counter() - t0
        ids = [p.id for p in problems]
        group_b = ro.group_ids.astype(np.int32)
        zero_var_p = self._zero_variance(shaped, group_b, P)
        with self.data_lock:
            self.curriculum.update(ids, raw.reshape(P, G))
        keep_p = ~zero_var_p if self.cfg.data.zero_variance_filter else np.ones(P, bool)
        keep_b = np.repeat(keep_p, G)
        loss_mask = ro.completion_mask & keep_b[:, None]
        adv_info: dict = {}
        versions = np.where(ro.completion_mask, ro.versions, np.iinfo(np.int32).max)
        oldest = int(versions.min()) if ro.completion_mask.any() else self.version

        metrics: dict[str, float] = {}
        per_update: list[dict] = []
        trained_rows = 0
        if keep_p.any():
            host = assemble_batch(
                ro.prompt_tokens,
                ro.prompt_mask,
                ro.completion_tokens,
                ro.lengths,
                loss_mask,
                ro.logprobs,
                np.zeros(P * G, np.float32),  # the advantages, set below
                group_b,
            )
            need_old = self._needs_old_logp
            kl_reward = self.cfg.loss.kl_in_reward and self.ref_params is not None
            # The whole batch on device once: the old policy's and the reference's
            # log-probs and the critic's values are all taken before this batch's first
            # update (with the KL in the reward, the advantages need the first two).
            on_device = self.critic or need_old or self.ref_params is not None
            full = put_batch(host, self.mesh) if on_device else None
            old_all = ref_all = None
            if need_old or kl_reward:
                old_all = np.asarray(self.logprob_fn(self.params, full))
            if self.ref_params is not None:
                ref_all = np.asarray(self.logprob_fn(self.ref_params, full))
            # KL in the reward: behaviour = the policy before this batch's updates, as
            # the trainer computes it (the same forward as the reference's).
            kl = dict(behaviour_logp_bt=old_all, ref_logp_bt=ref_all) if kl_reward else {}
            mask_f = loss_mask.astype(np.float32)
            if self.critic:
                # GAE from the critic's values before this batch's updates (PPO).
                values = np.asarray(self.value_fn(self.params, full))
                adv_bt, ret_bt = gae_from_config(
                    self.cfg.loss,
                    jnp.asarray(shaped),
                    jnp.asarray(values),
                    jnp.asarray(mask_f),
                    **kl,
                )
                host["advantages"] = np.asarray(adv_bt, np.float32) * loss_mask
                host["old_values"] = values.astype(np.float32)
                host["returns"] = np.asarray(ret_bt, np.float32)
            else:
                adv, adv_info = advantages_from_config(
                    self.cfg.loss,
                    jnp.asarray(shaped),
                    jnp.asarray(group_b),
                    num_groups=P,
                    valid_b=jnp.asarray(keep_b),
                    mask_bt=jnp.asarray(mask_f) if kl_reward else None,
                    **kl,
                )
                host["advantages"] = np.asarray(adv, np.float32) * keep_b
            per_mb = P // M
            for j in range(M):
                # Minibatch j: prompts [j*P/M, (j+1)*P/M), group ids renumbered from 0.
                rows = slice(j * per_mb * G, (j + 1) * per_mb * G)
                mb = {k: v[rows] for k, v in host.items()}
                mb["group_ids"] = mb["group_ids"] - j * per_mb
                batch = put_batch(mb, self.mesh)
                if need_old:
                    batch = dataclasses.replace(
                        batch, old_logp=_put_like(old_all[rows], batch.mask)
                    )
                if ref_all is not None:
                    batch = dataclasses.replace(
                        batch, ref_logp=_put_like(ref_all[rows], batch.mask)
                    )
                stale = self.version - oldest
                if self.cfg.train.off_policy == "pipeline" and stale > self.cfg.train.off_policy_k:
                    raise AssertionError(
                        f"PipelineRL staleness {stale} exceeds k={self.cfg.train.off_policy_k}"
                    )
                self.staleness_hist[stale] = self.staleness_hist.get(stale, 0) + 1
                self.params, self.opt_state, m = self.train_step(self.params, self.opt_state, batch)
                per_update.append(m)
                self.version += 1
                trained_rows += int(mb["mask"].any(axis=1).sum())
            host_m = jax.device_get(per_update)
            for k in host_m[0]:
                metrics[f"train/{k}"] = float(np.mean([float(m[k]) for m in host_m]))
            nonfinite = sum(float(m["nonfinite"]) for m in host_m)
            tp = ro.prompt_mask.sum(axis=1)[::G]
            self.counters.add(
                trainer_flops=step_flops(self.spec, self.cfg, tp, ro.lengths)["trainer_flops"]
            )
        else:
            nonfinite = 0.0
            metrics["train/skipped_all_zero_variance"] = 1.0
        self.nonfinite_streak = self.nonfinite_streak + 1 if nonfinite else 0
        self.counters.add(rollouts=P * G, prompts=P)
        metrics.update(
            {
                "train/reward": float(shaped.mean()),
                "train/pass@1": float((raw > 0).mean()),
                # Zero-variance groups (dropped from the loss with data.zero_variance_filter).
                "train/zero_variance_frac": float(zero_var_p.mean()),
                "train/response_len": float(ro.lengths.mean()),
                "train/truncation_rate": float(ro.truncated.mean()),
                "train/interrupted_frac": float((ro.injected_mask.any(axis=1)).mean()),
                "train/staleness_max": float(self.version - 1 - oldest) if keep_p.any() else 0.0,
                "train/lr": float(self._lr_at(max(self.version - 1, 0))),
                "train/rows_trained": float(trained_rows),
                "train/retired_prompts": float(getattr(self.curriculum, "num_retired", 0)),
                "time/score_s": score_s,
                "time/train_s": time.perf_counter() - t0 - score_s,
            }
        )
        metrics.update(
            {f"adv/{k}": float(np.asarray(v)) for k, v in adv_info.items() if np.ndim(v) == 0}
        )
        return metrics

    def _log_samples(self, problems, texts, raw, shaped) -> None:
        """A few readable rows to samples.jsonl and TensorBoard (logging.samples_every)."""
        step = self.step + 1  # the step this batch is logged under, as in metrics.jsonl
        cfg = self.cfg
        due = samples_due(
            cfg.logging.samples_every,
            step=step,
            eval_every=cfg.eval.every,
            last_step=cfg.train.steps,
        )
        if not self.is_main or not due:
            return
        rows = sample_rows(
            step=step,
            problems=problems,
            completions=texts,
            raw=raw,
            shaped=shaped,
            group_size=self.G,
            rows=cfg.logging.samples_rows,
            well_formed=self.reward_fn.well_formed,
        )
        append_jsonl(self.run.samples_path, rows)
        if self.logger is not None:
            text = "\n".join("```\n" + format_row(r) + "```" for r in rows)
            self.logger.log_text(step, "samples", text)

    # ---- evaluation -----------------------------------------------------------------------

    def evaluate(self) -> dict[str, float]:
        t0 = time.perf_counter()
        m, ro = evaluate_policy(
            self.eval_sampler,
            self.sampler_weights()[0],
            self.val_problems,
            tokenizer=self.tokenizer,
            correct_fn=self.correct_fn,
            k=self.cfg.eval.k,
            key=eval_key(self.cfg.train.seed),
            version=self.version,
        )
        k = self.cfg.eval.k
        self.counters.add(
            eval_flops=forward_flops(self.spec, ro.prompt_mask.sum(axis=1)[::k], ro.lengths, k),
            eval_device_seconds=(time.perf_counter() - t0) * jax.device_count(),
        )
        m["time/eval_s"] = time.perf_counter() - t0
        return m

    def _curve_row(self, metrics: dict[str, float]) -> dict[str, Any]:
        row = {
            "run_id": self.run_id,
            "step": self.step,
            "version": self.version,
            "recipe": self.cfg.recipe or self.cfg.name,
        }
        row.update(self.knobs)
        row.update(self.counters.as_dict())
        row.update({k: v for k, v in metrics.items() if k.startswith(("val/", "train/"))})
        hist = getattr(self.curriculum, "pass_rate_histogram", None)
        if hist is not None:
            counts, _ = hist(10)
            row["train/pass_rate_hist"] = [int(c) for c in counts]
        return row

    # ---- checkpoints ----------------------------------------------------------------------

    def _state(self) -> dict[str, Any]:
        st = {"params": self.params, "opt_state": self.opt_state}
        if self.ref_params is not None:
            st["ref_params"] = self.ref_params
        return st

    def _meta(self) -> dict[str, Any]:
        with self.data_lock:
            return self._meta_unlocked()

    def _meta_unlocked(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "version": self.version,
            "counters": self.counters.as_dict(),
            "pipeline": self.pipeline.get_state(),
            "curriculum": self.curriculum.state_dict(),
            "nonfinite_streak": self.nonfinite_streak,
            "staleness_hist": {str(k): v for k, v in self.staleness_hist.items()},
            "run_id": self.run_id,
        }

    def save(self, *, force: bool = False) -> None:
        if self.step in self.ckpt.steps():
            return  # already saved at this step (periodic save coincides with the last one)
        self.ckpt.save(self.step, self._state(), self._meta(), force=force)

    def try_resume(self) -> bool:
        """Restore the newest usable checkpoint, or start over; either way the logs are
        rewound to the restored step (to nothing when starting over), so a rerun after a
        kill at any moment writes exactly the rows of a run that never stopped.

        Decided once: later calls return the first answer (callers that prepare a fresh
        start, such as a supervised warm-up, ask before `run_loop` does)."""
        if self._resumed is None:
            self._resumed = self._try_resume()
        return self._resumed

    def _try_resume(self) -> bool:
        got = self.ckpt.restore_latest(self._state()) if self.cfg.checkpoint.resume else None
        if got is not None and got[2].get("run_id", self.run_id) != self.run_id:
            raise ConfigError(
                f"checkpoint {self.run.checkpoints_dir / str(got[0])} belongs to run "
                f"{got[2]['run_id']}, not to this config's {self.run_id}; use another run name"
            )
        last = -1 if got is None else int(got[2]["step"])
        if self.is_main:
            for path in (self.run.metrics_path, self.run.curve_path, self.run.samples_path):
                truncate_jsonl_after(path, "step", last)
        if got is None:
            return False
        _, state, meta = got
        self.params, self.opt_state = state["params"], state["opt_state"]
        self._viewed = None  # [params view]
        if "ref_params" in state:
            self.ref_params = state["ref_params"]
        self.step, self.version = int(meta["step"]), int(meta["version"])
        self.counters = ComputeCounters.from_dict(meta["counters"])
        self.pipeline.set_state(meta["pipeline"])
        self.curriculum.load_state_dict(meta["curriculum"])
        self.nonfinite_streak = int(meta["nonfinite_streak"])
        self.staleness_hist = {int(k): v for k, v in meta["staleness_hist"].items()}
        return True

    # ---- the loop -------------------------------------------------------------------------

    def _log(self, metrics: dict[str, float]) -> None:
        if self.logger is not None:
            self.logger.log(self.step, metrics)

    def _maybe_eval(self, force: bool = False) -> dict[str, float] | None:
        every = self.cfg.eval.every
        due = force or (every > 0 and self.step % every == 0)
        if not due:
            return None
        m = self.evaluate()
        if self.is_main:
            self.run.append_curve(self._curve_row(m))
        self._log(m)
        return m

    def _ckpt_due(self) -> bool:
        """Due once a multiple of checkpoint.every has been reached since the newest
        checkpoint. PPO-off-policy-k defers it to the end of its group of k batches
        (sampled together, with one policy): a checkpoint inside a group would resume
        by sampling the group's remaining batches with newer weights."""
        every = self.cfg.checkpoint.every
        if every <= 0 or self._mid_group:
            return False
        return self.step // every > max(self.ckpt.steps(), default=0) // every

    def _after_step(self, metrics: dict[str, float], bar) -> None:
        self.step += 1
        self._log(metrics)
        for hook in self.step_hooks:
            hook(self)
        if self.nonfinite_streak >= self.cfg.train.max_nonfinite:
            self.save(force=True)
            self.ckpt.wait()
            raise NonFiniteError(
                f"{self.nonfinite_streak} consecutive updates had NaN/Inf loss or gradients "
                f"(train.max_nonfinite={self.cfg.train.max_nonfinite}); stopped at step "
                f"{self.step} with a checkpoint in {self.run.checkpoints_dir}"
            )
        ev = self._maybe_eval(force=self.step == self.cfg.train.steps)
        if self._ckpt_due():
            self.save()
        info = f"reward {metrics.get('train/reward', float('nan')):+.3f}"
        if ev is not None:
            info += f"  val pass@1 {ev['val/pass@1']:.3f}"
        bar.advance(info=info)

    def run_loop(self) -> dict[str, Any]:
        try:
            return self._run_loop()
        finally:
            self.close()

    def _run_loop(self) -> dict[str, Any]:
        cfg = self.cfg
        done = self.run.read_done()
        if done is not None:
            return done
        resumed = self.try_resume()
        if self.is_main:
            # Events of steps after the restored one are hidden, as the JSONL rows are cut.
            self.logger = MetricsLogger(
                self.run, cfg.logging, config=self.knobs, purge_step=self.step + 1 if resumed else 0
            )
        if not resumed and cfg.eval.at_start:
            self._maybe_eval(force=True)
        mode = cfg.train.off_policy
        with progress_bar(
            cfg.train.steps,
            f"train {cfg.name}",
            enabled=cfg.logging.progress and not self.quiet and self.is_main,
            completed=self.step,
        ) as bar:
            if self.split:
                self._run_split(bar)
            elif mode == "pipeline":
                self._run_pipeline(bar)
            else:
                self._run_sync(bar)
        self.save(force=True)
        self.ckpt.wait()
        summary = {
            "run_id": self.run_id,
            "steps": self.step,
            "version": self.version,
            "counters": self.counters.as_dict(),
            "staleness_hist": {str(k): v for k, v in sorted(self.staleness_hist.items())},
        }
        if self.is_main:
            self.run.mark_done(summary)
        return summary

    def _dynamic_batch(self) -> tuple[Rollouts, list]:
        """DAPO dynamic sampling: sample rounds of B_p prompts, keep groups whose rewards
        differ, until B_p are kept or data.max_resample_rounds; short batches are filled
        with zero-variance groups (which the zero-variance filter then drops).

        Zero variance is decided as in `_train_on` (`_zero_variance`, shaped rewards).
        Groups scored but not kept still enter the pass-rate history here (the kept
        ones do in `_train_on`), so No-Positive-Resampling and the interference
        histogram see every scored group once."""
        kept: list[tuple[Rollouts, int]] = []
        spare: list[tuple[Rollouts, int]] = []
        problems: list = []
        spare_problems: list = []
        kept_raw: list[np.ndarray] = []  # [G] verifier rewards of each group
        spare_raw: list[np.ndarray] = []
        G = self.G
        for r in range(self.cfg.data.max_resample_rounds):
            batch = next(self.pipeline)
            ro = self._generate(self.step * 64 + r, batch)
            self._account_sampling(ro)
            raw, shaped, _ = self._score(ro, batch)
            zero_var = self._zero_variance(shaped, ro.group_ids, len(batch))
            for g, zv in enumerate(zero_var):
                (spare if zv else kept).append((ro, g))
                (spare_problems if zv else problems).append(batch[g])
                (spare_raw if zv else kept_raw).append(raw[g * G : (g + 1) * G])
            if len(kept) >= self.P:
                break
        fill = max(0, self.P - len(kept))
        groups = (kept + spare[:fill])[: self.P]
        probs = (problems + spare_problems[:fill])[: self.P]
        dropped = problems[self.P :] + spare_problems[fill:]
        if dropped:
            with self.data_lock:
                self.curriculum.update(
                    [p.id for p in dropped], np.stack(kept_raw[self.P :] + spare_raw[fill:])
                )
        generated = (r + 1) * self.P * self.G
        self.counters.add(rollouts=generated - self.P * self.G)
        return _concat_groups(groups, self.G), probs

    def _run_sync(self, bar) -> None:
        cfg = self.cfg
        k = cfg.train.off_policy_k if cfg.train.off_policy == "ppo_off_policy" else 1
        while self.step < cfg.train.steps:
            t0 = time.perf_counter()
            n = min(k, cfg.train.steps - self.step)
            if cfg.data.dynamic_sampling:
                ro, problems = self._dynamic_batch()
                batches = [problems]
            else:
                batches = [next(self.pipeline) for _ in range(n)]
                # PPO-off-policy-k: all k batches are sampled with the current weights first.
                ro = self._generate(self.step, [p for b in batches for p in b])
                self._account_sampling(ro)
            sample_s = time.perf_counter() - t0
            for i, problems in enumerate(batches):
                self._mid_group = i < len(batches) - 1
                part = _rows_of(ro, i * self.P * self.G, (i + 1) * self.P * self.G, i * self.P)
                t1 = time.perf_counter()
                m = self._train_on(part, problems)
                m["time/sample_s"] = sample_s if i == 0 else 0.0
                m["time/step_s"] = time.perf_counter() - t1 + m["time/sample_s"]
                self.counters.add(device_seconds=m["time/step_s"] * jax.device_count())
                self._after_step(m, bar)

    def _num_waves(self) -> int:
        k, M = self.cfg.train.off_policy_k, self.M
        w = max(1, (k + 1) // M)
        return min(w, self.cfg.train.pipeline_waves) if self.cfg.train.pipeline_waves > 0 else w

    def _run_pipeline(self, bar) -> None:
        cfg = self.cfg
        W = self._num_waves()
        chunk = cfg.sampling.decode_chunk or max(1, math.ceil(cfg.sampling.max_new_tokens / 4))
        next_step = self.step  # step index of the next wave to start
        while self.step < cfg.train.steps:
            t0 = time.perf_counter()
            # Drain before a checkpoint: no wave may straddle a checkpointed step, so a
            # checkpoint never needs an in-flight KV cache and resume is exact.
            boundary = self._next_boundary()
            while len(self.waves) < W and next_step < min(cfg.train.steps, boundary):
                self.waves.append(self._start_wave(next_step, next(self.pipeline)))
                next_step += 1
            # Decode round robin until the oldest wave is done; new weights are used at once.
            oldest = self.waves[0]
            while not self.sampler.done(oldest.state):
                for w in self.waves:
                    if not self.sampler.done(w.state):
                        w.state = self.sampler.decode(
                            self.sampler_weights()[0],
                            w.state,
                            max_steps=chunk,
                            version=self.version,
                        )
            self.waves.pop(0)
            ro = self.sampler.result(oldest.state)
            self._account_sampling(ro)
            sample_s = time.perf_counter() - t0
            t1 = time.perf_counter()
            m = self._train_on(ro, oldest.problems)
            m["time/sample_s"] = sample_s
            m["time/step_s"] = time.perf_counter() - t1 + sample_s
            self.counters.add(device_seconds=m["time/step_s"] * jax.device_count())
            self._after_step(m, bar)

    def _run_split(self, bar) -> None:
        """PipelineRL-k with the sampler on its own devices (rl_jax.train.split)."""
        cfg = self.cfg
        chunk = cfg.sampling.decode_chunk or max(1, math.ceil(cfg.sampling.max_new_tokens / 4))
        worker = SplitSampler(
            self.sampler,
            waves=self._num_waves(),
            chunk=chunk,
            first_step=self.step,
            weights=self.sampler_weights(),
            start_wave=self._start_wave,
            draw=lambda: next(self.pipeline),
            lock=self.data_lock,
        )
        self.split_sampler = worker
        try:
            worker.allow(min(cfg.train.steps, self._next_boundary()))
            while self.step < cfg.train.steps:
                t0 = time.perf_counter()
                wave, ro = worker.take()
                assert wave.step == self.step, (wave.step, self.step)
                self._account_sampling(ro)
                wait_s = time.perf_counter() - t0
                t1 = time.perf_counter()
                m = self._train_on(ro, wave.problems)
                # Push before freeing the slot: the next wave starts on these weights
                # (the staleness bound in rl_jax.train.split relies on that order).
                worker.push(self.sampler_weights())
                worker.done()
                worker.train_intervals.append((t1, time.perf_counter()))
                m["time/sample_s"] = wait_s  # time the trainer waited for rollouts
                m["time/step_s"] = time.perf_counter() - t1 + wait_s
                self.counters.add(device_seconds=m["time/step_s"] * jax.device_count())
                self._after_step(m, bar)
                worker.allow(min(cfg.train.steps, self._next_boundary()))
        finally:
            worker.close()

    def _next_boundary(self) -> int:
        every = self.cfg.checkpoint.every
        if every <= 0:
            return self.cfg.train.steps
        return (self.step // every + 1) * every

    def compile_counts(self) -> dict[str, int]:
        """Compiled variants of every jitted function (a recompilation makes one grow)."""
        fns = {
            "train_step": self.train_step,
            "logprob": self.logprob_fn,
            "sampler_start": self.sampler._start,
            "sampler_decode": self.sampler._decode,
            "eval_start": self.eval_sampler._start,
            "eval_decode": self.eval_sampler._decode,
        }
        return {k: int(f._cache_size()) for k, f in fns.items()}

    def close(self) -> None:
        """Finish pending saves and release the run directory (idempotent)."""
        if self.logger is not None:
            self.logger.close()
            self.logger = None
        if not self._closed:
            self._closed = True
            self.ckpt.close()
        self.run.close()


def _make_meshes(cfg: RunConfig):
    """(trainer mesh, sampler mesh): one mesh when colocated; in split mode the first
    mesh.sampler_devices devices form a data-parallel sampler mesh (keeping the
    trainer's tensor axis when it divides them) and the rest the trainer's mesh."""
    m = cfg.mesh
    if not m.sampler_devices:
        mesh = make_mesh(m)
        return mesh, mesh
    if cfg.train.off_policy != "pipeline":
        raise ConfigError(
            f"mesh.sampler_devices={m.sampler_devices} (split mode) needs "
            f"train.off_policy='pipeline', got {cfg.train.off_policy!r}: only PipelineRL-k "
            "bounds how stale the weights of a sampler running alongside the trainer may be"
        )
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
    if not 0 < m.sampler_devices < len(devices):
        raise ConfigError(
            f"mesh.sampler_devices={m.sampler_devices} must leave the trainer at least one of "
            f"the {len(devices)} devices"
        )
    sample_devs, train_devs = devices[: m.sampler_devices], devices[m.sampler_devices :]
    train_mesh = make_mesh(dataclasses.replace(m, num_devices=0), devices=train_devs)
    tensor = train_mesh.shape["tensor"]
    tensor = tensor if len(sample_devs) % tensor == 0 else 1
    sample_mesh = make_mesh(
        MeshConfig(data=-1, fsdp=1, tensor=tensor, rules=m.rules), devices=sample_devs
    )
    return train_mesh, sample_mesh


def _shardings(tree):
    return jax.tree.map(lambda a: a.sharding, tree)


def _put_like(x: np.ndarray, like: jax.Array) -> jax.Array:
    return jax.device_put(x.astype(np.float32), like.sharding)


def _concat_groups(groups: list[tuple[Rollouts, int]], G: int) -> Rollouts:
    """One Rollouts of the groups (rollouts, group index), renumbered 0..len-1.

    Prompt arrays are left-padded and completion arrays right-padded to the widest."""
    tp = max(ro.prompt_tokens.shape[1] for ro, _ in groups)
    tg = max(ro.completion_tokens.shape[1] for ro, _ in groups)
    parts: dict[str, list] = {}
    for new_g, (ro, g) in enumerate(groups):
        rows = slice(g * G, (g + 1) * G)
        for f in dataclasses.fields(ro):
            v = getattr(ro, f.name)[rows]
            if f.name.startswith("prompt_"):
                v = np.pad(v, ((0, 0), (tp - v.shape[1], 0)))
            elif v.ndim == 2:
                fill = -1 if f.name == "versions" else 0
                v = np.pad(v, ((0, 0), (0, tg - v.shape[1])), constant_values=fill)
            if f.name == "group_ids":
                v = np.full_like(v, new_g)
            parts.setdefault(f.name, []).append(v)
    return Rollouts(**{k: np.concatenate(v) for k, v in parts.items()})


def _rows_of(ro: Rollouts, lo: int, hi: int, group_offset: int) -> Rollouts:
    """Rows [lo, hi) of a Rollouts, group ids renumbered from 0."""
    if lo == 0 and hi == ro.num_rows:
        return ro
    fields = {}
    for f in dataclasses.fields(ro):
        v = getattr(ro, f.name)
        fields[f.name] = v[lo:hi] if isinstance(v, np.ndarray) and v.ndim >= 1 else v
    fields["group_ids"] = fields["group_ids"] - group_offset
    return dataclasses.replace(ro, **fields)


def train(cfg: RunConfig, *, run_root: str | Path | None = None, quiet: bool = False) -> dict:
    return RLTrainer(cfg, run_root=run_root, quiet=quiet).run_loop()
