"""A run's programs built on abstract arrays, compiled ahead of time for a TPU topology.

Nothing is allocated: parameters, optimizer state and batches are
`jax.ShapeDtypeStruct`s carrying the run's shardings on a mesh of the
topology's devices, and each program is traced, lowered and compiled by XLA
for that target. Per chip, the compiled program's memory (arguments, outputs,
temporaries) and cost (FLOPs, bytes accessed) are facts about the program the
run would execute, not estimates.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from rl_jax.config import RunConfig, resolved
from rl_jax.kernels import loops
from rl_jax.knobs import ConfigError
from rl_jax.models.load import resolve_spec
from rl_jax.models.spec import ModelSpec
from rl_jax.models.transformer import dtype_of
from rl_jax.plan._advice import advice
from rl_jax.plan._assumed import (
    SCALERL_BUDGET_ROLLOUTS,
    budget_note,
    model_facts,
    planned_model,
)
from rl_jax.plan._collectives import collective_bytes
from rl_jax.plan._estimate import per_hour
from rl_jax.plan._flops import train_flops
from rl_jax.plan.chips import Chip, canonical_topology, num_chips, parse_topology
from rl_jax.runtime import mesh_platform
from rl_jax.sampling._decoder import round_up
from rl_jax.sharding import (
    get_rules,
    resolve_axis_sizes,
)
from rl_jax.sharding.rules import Rules
from rl_jax.train.accounting import (
    TRAIN_PASSES,
    batches_in_flight,
    extra_forwards,
    forward_flops,
)
from rl_jax.train.parts import Programs, build_programs, check_sizes, check_split, make_meshes

HEADROOM = 0.10  # a program fits when it leaves this fraction of the chip's HBM free


def topology_devices(topology: str) -> list:
    """The devices of a TPU topology, compiled for from this host (libtpu, no TPU).

    libtpu takes a machine-wide lock file when it loads, for the TPU it would drive;
    a plan drives none, so several planning processes (a test run's workers, a
    search) may load it side by side."""
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        from jax.experimental import topologies

        desc = topologies.get_topology_desc(
            platform="tpu", topology_name=canonical_topology(topology)
        )
    except Exception as e:  # noqa: BLE001 - libtpu missing or the name unknown to it
        raise ConfigError(f"--topology={topology!r}: cannot describe it here ({_first(e)})") from e
    return list(desc.devices)


@dataclasses.dataclass(frozen=True)
class Target:
    """A run placed on a topology's devices, as every planned program sees it."""

    cfg: RunConfig  # resolved, its model the planned one (`planned_model`)
    source: str  # where the model's shapes come from (`planned_model`)
    topology: str
    chip: Chip
    devices: list
    mesh: Mesh
    spec: ModelSpec
    rules: Rules  # the trainer's
    tp: int  # prompt columns: sampling.max_prompt_len in whole length buckets
    tg: int  # generated columns: sampling.max_new_tokens in whole length buckets
    sample_mesh: Mesh  # the sampler's: `mesh` itself unless split (mesh.sampler_devices)

    def programs(self, spec: ModelSpec | None = None) -> Programs:
        """The run's programs for `spec` (default the run's), as the trainer builds them
        (`build_programs`), its engine at the `tp`-column prompts the plan assumes and
        prefilling every prompt in one block: a call counted whole, the bound the calls
        are counted against (the run's engine prefills in blocks and skips those a
        refill leaves empty, which a count of the compiled program cannot know)."""
        return build_programs(
            self.cfg,
            self.spec if spec is None else spec,
            self.mesh,
            self.rules,
            sample_mesh=self.sample_mesh,
            tokenizer=_StandInTokens,
            prompt_len=self.tp,
            prefill_block=None,
        )


def check_prompt_len(cfg: RunConfig) -> None:
    """A plan compiles the engine's programs at the longest prompt: the recipe states it
    (a run reads it from its data; a plan reads no data)."""
    if cfg.sampling.max_prompt_len <= 0:
        raise ConfigError(
            "sampling.max_prompt_len=0 leaves the longest prompt to the data, which a plan "
            "does not read: set it (e.g. sampling.max_prompt_len=1024)"
        )


def plan_target(cfg: RunConfig, topology: str) -> Target:
    """`cfg` resolved, its model the planned one (`planned_model`), on meshes of
    `topology`'s devices (its mesh.* shape, not a count of this host's devices; in split
    mode the first mesh.sampler_devices chips the sampler's, as a run lays them out:
    `make_meshes`), with its model spec, train rules and bucketed lengths. The batch's
    sizes are checked against the mesh as the trainer checks them, before libtpu loads:
    a ConfigError, not a compile that cannot shard the minibatch."""
    cfg, source = planned_model(cfg)
    cfg = resolved(cfg)
    check_prompt_len(cfg)
    chip, dims = parse_topology(topology)
    chips = num_chips(dims)
    if cfg.mesh.sampler_devices:
        check_split(cfg.mesh.sampler_devices, chips)
    data, fsdp, _ = resolve_axis_sizes(cfg.mesh, chips - cfg.mesh.sampler_devices)
    check_sizes(cfg, data * fsdp)
    devices = topology_devices(topology)
    mesh, sample_mesh = make_meshes(cfg, devices)
    sc = cfg.sampling
    return Target(
        cfg,
        source,
        topology,
        chip,
        devices,
        mesh,
        resolve_spec(cfg.model),
        get_rules(cfg.mesh.rules, purpose="train"),
        round_up(sc.max_prompt_len, sc.length_bucket),
        round_up(sc.max_new_tokens, sc.length_bucket),
        sample_mesh,
    )


def plan_run(
    cfg: RunConfig,
    topology: str,
    *,
    headroom: float = HEADROOM,
    budget_rollouts: float = SCALERL_BUDGET_ROLLOUTS,
    count_flops: bool = True,
    flops_if_fits: bool = False,
) -> dict[str, Any]:
    """Compile the run's programs for `topology`: the train step, the log-prob pass where
    the recipe needs one, and the engine's prefill_insert and generate. The plan as a
    JSON-able dict: per program and chip HBM, FLOPs, bytes and a roofline time; per RL step a
    roofline time, rollouts per hour and the hours `budget_rollouts` rollouts take.
    `count_flops=False` compiles the run's programs only, not the counting programs of
    `_layer_costs` (most of a plan's compiles): memory and `fits`, with FLOPs, bytes and
    every time derived from them null; `flops_if_fits`: only where every program fits.
    A `model.path` this host lacks is planned with the preset's shapes (`planned_model`;
    "model" says where the shapes come from)."""
    t = plan_target(cfg, topology)
    progs = t.programs()
    # Every program is traced here and compiled where `compile_jobs` says: with a pool,
    # the run's programs and the counting programs below compile at once.
    run = progs.step_programs(t.tp, t.tg)
    real = {name: _submit(fn, *args, **kw) for name, (fn, args, kw) in run.items()}
    decode = run["generate"][1][0]  # the engine's DecodeWeights (abstract)
    step = _Step(t, progs, real, headroom, decode)
    # XLA's cost analysis counts a while loop's body once. The programs scan over the
    # layers (and the update over its minibatches), so their counts come from the same
    # programs built with 1 and 2 layers, one minibatch, every scan unrolled: costs are
    # linear in depth, c(L) = c(1) + (L - 1) (c(2) - c(1)), and M updates cost M times one.
    # Attention's block pairs and the LM head's chunks are counted peeled (`_depth_costs`).
    # `flops_if_fits`: a program that does not fit gets no roofline, so its counting
    # programs are not compiled (a search's candidate that does not fit costs its memory).
    nan_costs = collections.defaultdict(lambda: (float("nan"), float("nan")))
    if count_flops and flops_if_fits:
        count_flops = all(p["fits"] for p in step.reports(nan_costs))
    t0 = time.perf_counter()
    costs = nan_costs  # XLA's own counts of the scanned programs miss all but one iteration
    if count_flops:
        costs = _layer_costs(t)
    plan = step.summary(
        step.reports(costs),
        budget_rollouts=budget_rollouts,
        cost_s=time.perf_counter() - t0,
        flops_counted=count_flops,
    )
    plan["advice"] = advice(t.cfg, plan)
    return plan


@dataclasses.dataclass(frozen=True)
class _Step:
    """A planned RL step: the target, the run's programs, their compiles (futures), and
    the per-chip bytes of what stays resident while each runs."""

    t: Target
    progs: Programs
    real: dict  # program -> future of its `_compile`
    headroom: float
    decode: Any  # the engine's DecodeWeights, abstract and laid out

    @property
    def split(self) -> bool:
        return self.progs.split

    def _report(self, name: str, analytic: float, **kw) -> dict[str, Any]:
        mesh = self.t.sample_mesh if name in ENGINE_PROGRAMS else self.t.mesh
        done, chips = self.real[name].result(), mesh.devices.size  # the program's own chips
        return _report(name, done, analytic, self.t.chip, chips, self.headroom, **kw)

    @functools.cached_property
    def bytes(self) -> dict[str, int]:
        """Per chip: the state's params ("param"), the optimizer state ("opt"), the frozen
        reference ("ref", resident when the recipe has one), the engine's whole state
        ("sampler": laid out by its own constraints, known before compiling), its KV
        cache ("kv"), the weights the engine runs ("view", as its programs take them;
        "weights", in the engine's layout and the compute dtype), their decode layout
        ("decode", a version's `DecodeWeights`) and, in split mode, what a sampler chip
        receives of each version ("push": the view in the engine's layout)."""
        params, opt = self.progs.state_shapes
        engine, spec = self.progs.engine, self.t.spec
        state, shardings = engine.abstract_state(), engine.param_shardings()
        view = self.progs.param_format.abstract_view(params)
        weights = {  # the view in the engine's layout and the compute dtype
            n: jax.ShapeDtypeStruct(a.shape, spec.compute_dtype, sharding=shardings[n])
            for n, a in view.items()
        }
        param = _chip_bytes(params)
        taken = _chip_bytes(self.progs.sampler_view())  # split: the view in the engine's layout
        return {
            "view": taken,
            "decode": _chip_bytes(self.decode),
            "push": taken if self.split else 0,
            "param": param,
            "opt": _chip_bytes(opt),
            "ref": param if self.progs.passes.ref else 0,
            "sampler": _chip_bytes(state),
            "kv": _chip_bytes(state.slots.cache),
            "weights": _chip_bytes(weights),
        }

    @functools.cached_property
    def forward_flops(self) -> float:
        """Model FLOPs of one forward over the RL step's batch (every prompt and row)."""
        cfg, tp, tg = self.t.cfg, self.t.tp, self.t.tg
        P, G = cfg.data.prompts_per_batch, cfg.sampling.n
        return forward_flops(self.t.spec, [tp] * P, [tg] * (P * G), G)

    def reports(self, costs) -> list[dict[str, Any]]:
        """Every program's report, its FLOPs and bytes from `costs`."""
        return [*self._trainer_reports(costs), *self._engine_reports(costs)]

    def _trainer_reports(self, costs) -> list[dict[str, Any]]:
        cfg, spec, tp, tg = self.t.cfg, self.t.spec, self.t.tp, self.t.tg
        P, G, b = cfg.data.prompts_per_batch, cfg.sampling.n, self.bytes
        # While the trainer updates, PipelineRL's stream keeps its engine state with the
        # rows in flight in HBM; on_policy's and ppo_off_policy's sampler state is gone once
        # their batches are sampled (`Engine.run`).
        # In split mode that state is on the sampler's chips.
        pipeline = cfg.train.off_policy == "pipeline" and not self.split
        in_flight = b["sampler"] if pipeline else 0
        tf = train_flops(spec, P, G, tp, tg)  # model FLOPs and what the knobs recompute
        # One call of the trainer's update program: the RL step's M minibatch updates.
        out = [
            self._report(
                "train_step",
                tf["model"],
                expected=tf["expected"],
                resident=in_flight + b["ref"],
                calls=1,
                cost=costs["train_step"],
            )
        ]
        fwd = self.forward_flops
        for name, calls in self.progs.passes.calls.items():  # a forward over the batch each
            resident = b["opt"] + in_flight + b["ref"]
            out.append(self._report(name, fwd, resident=resident, calls=calls, cost=costs[name]))
        return out

    def _engine_reports(self, costs) -> list[dict[str, Any]]:
        cfg, spec, tp, tg = self.t.cfg, self.t.spec, self.t.tp, self.t.tg
        engine, P, G, b = self.progs.engine, cfg.data.prompts_per_batch, cfg.sampling.n, self.bytes
        # The engine's programs run while the optimizer state (and the reference) stay resident
        # (the sampler's state is the programs' argument). The state the view is made from
        # stays too, unless the view is the state itself. The sampler's own chips (split
        # mode) hold nothing of the trainer's. Of the weights, prefill_insert takes the
        # view and generate the version's decode layout (`Engine.prepared`), each
        # resident while the other runs (counted at every refill: an upper bound where a
        # batch enters before its first chunk).
        view_of = 0 if self.progs.param_format.identity else b["param"]
        beside = 0 if self.split else b["opt"] + b["ref"] + view_of
        # Every RL step's P x n rows, each up to gen_len tokens, decode S at a time in
        # the engine's slots (full occupancy: the least it takes). A generate call runs
        # `chunk` of those steps; its cost is one step's (the step loop's body once) plus
        # what runs once per call.
        slots, steps = engine.slots, P * G * tg / engine.slots
        # A whole batch's prompts enter at once (on_policy, ppo_off_policy's k batches):
        # P / prefill_prompts calls per step. The stream admits groups as slots free up,
        # a call per generate call with new groups: at most one per group. Each call is
        # counted whole, every prompt prefilled (an upper bound: the run's engine skips
        # the prefill blocks a refill leaves empty).
        calls = P / engine.prefill_prompts
        if cfg.train.off_policy == "pipeline":
            calls = min(P, max(calls, steps / engine.chunk))
        prefill = self._report(
            "prefill_insert",
            engine.prefill_prompts * _prefill_flops(spec, tp - 1),
            resident=beside + b["decode"],
            calls=calls,
            cost=costs["prefill_insert"],
        )
        kv_read = b["kv"] * _mean_pages_read(engine, tp, tg) / engine.row_pages
        cache_positions = engine.row_pages * engine.page_size  # a row's table's pages
        generate = self._report(
            "generate",
            slots * spec.flops_per_token(tp + (tg + 1) / 2),  # the prompt, half the generation
            resident=beside + b["view"],
            calls=steps,
            bytes_analytic=b["weights"] + kv_read,
            bytes_floor=b["weights"] + b["kv"] * _mean_filled(tp, tg) / cache_positions,
            cost=costs["generate"],
            steps_per_call=engine.chunk,
        )
        return [prefill, generate]

    def summary(self, programs, *, budget_rollouts, cost_s, flops_counted) -> dict[str, Any]:
        """The plan's dict: the target, sizes, every program's report and the RL step's
        roofline time, rollouts per hour and budget."""
        cfg, mesh, chip, tp, tg = self.t.cfg, self.t.mesh, self.t.chip, self.t.tp, self.t.tg
        P, G, M = cfg.data.prompts_per_batch, cfg.sampling.n, cfg.train.updates_per_batch
        engine, chips, b = self.progs.engine, len(self.t.devices), self.bytes
        # PPO-off-policy-k samples the prompts of its k steps at once; PipelineRL's stream
        # keeps W batches untrained (W x B_p groups in flight), by default a slot for each
        # of their rows.
        off = cfg.train.off_policy
        step = self._step(programs)
        hours = budget_rollouts / step["rollouts_per_hour"]
        return {
            "topology": self.t.topology,
            "chip": chip.name,
            "chips": chips,
            "mesh": _axes(mesh),
            **({"sampler_mesh": _axes(self.t.sample_mesh)} if self.split else {}),
            "hbm_capacity_gb": chip.hbm_bytes / 1e9,
            "headroom": self.headroom,
            "fit_limit_gb": (1 - self.headroom) * chip.hbm_bytes / 1e9,
            "model": model_facts(cfg, self.t.source),
            "batch": {
                "prompts": P,
                "samples": G,
                "updates": M,
                "grad_accum": cfg.train.grad_accum,
                "prompt_len": tp,
                "gen_len": tg,
                "batch_prompts": P * cfg.train.off_policy_k if off == "ppo_off_policy" else P,
                "batches_in_flight": batches_in_flight(cfg) if off == "pipeline" else 1,
            },
            "engine": {
                "slots": engine.slots,
                "chunk": engine.chunk,
                "prefill_prompts": engine.prefill_prompts,
            },
            "kv_cache_gb": b["kv"] / 1e9,
            "weights_gb": b["view"] / 1e9,
            "decode_weights_gb": b["decode"] / 1e9,
            "sampler_state_gb": b["sampler"] / 1e9,
            "optimizer_gb": b["opt"] / 1e9,
            "programs": programs,
            "fits": all(p["fits"] for p in programs),
            "step": step,
            "cost_compile_s": cost_s,  # the counting programs' compiles (`_depth_costs`)
            "flops_counted": flops_counted,
            "budget": {
                "rollouts": budget_rollouts,
                "hours": hours,
                "chip_hours": hours * chips,
                "note": budget_note(cfg, budget_rollouts),
            },
        }

    def _step(self, programs) -> dict[str, float]:
        """The RL step's roofline time, its useful FLOPs, MFU and rollouts per hour; with
        collectives added, none overlapped with compute (the other bound). Colocated,
        every program's calls one after another; split, the trainer's and the sampler's
        chips work at once: the slower side plus the weight push (`Chip.push_s`)."""
        cfg = self.t.cfg
        step_s, step_c = _seconds(programs)
        if self.split:
            trainer = _seconds([p for p in programs if p["name"] not in ENGINE_PROGRAMS])
            sampler = _seconds([p for p in programs if p["name"] in ENGINE_PROGRAMS])
            n_sampler, n_trainer = self.t.sample_mesh.devices.size, self.t.mesh.devices.size
            push_s = self.t.chip.push_s(self.bytes["push"], n_sampler, n_trainer)
            step_s, step_c = (max(trainer[i], sampler[i]) + push_s for i in (0, 1))
        fwd = self.forward_flops
        useful = (TRAIN_PASSES + extra_forwards(cfg)) * fwd + fwd  # trainer + sampler
        rollouts = cfg.data.prompts_per_batch * cfg.sampling.n
        out = {
            "roofline_s": step_s,
            "flops": useful,
            "mfu_estimate": self.t.chip.mfu(useful / len(self.t.devices), step_s),
            "rollouts": rollouts,
            "rollouts_per_hour": per_hour(rollouts, step_s),
            "roofline_s_with_collectives": step_c,
            "rollouts_per_hour_with_collectives": per_hour(rollouts, step_c),
        }
        if self.split:
            out["split"] = {
                "trainer_s": trainer[0],
                "sampler_s": sampler[0],
                "push_s": push_s,
                "push_gb": self.bytes["push"] / 1e9,
            }
        return out


def _seconds(programs) -> tuple[float, float]:
    """Seconds of every call of `programs`, one after another: their roofline times, and
    those with their collectives added."""
    s = sum(p["roofline_s"] * p["calls"] for p in programs)
    return s, s + sum(p["collective_s"] * p["calls"] for p in programs)


class _StandInTokens:
    """The token ids the engine's programs take from a tokenizer: their values change
    no shape (one token stands in for the interruption text)."""

    eos_id = pad_id = 0

    @staticmethod
    def encode(text: str) -> list[int]:
        return [0]


@contextlib.contextmanager
def _unrolled_scans():
    """Every `jax.lax.scan` traced inside unrolls whole: its program has no while loop,
    so XLA's cost analysis counts each iteration (it counts a loop's body once). The
    loops of `rl_jax.kernels.loops` run as its mode says."""
    scan = jax.lax.scan

    @functools.wraps(scan)
    def unrolled(*args, **kw):
        kw["unroll"] = True
        return scan(*args, **kw)

    jax.lax.scan = unrolled
    try:
        yield
    finally:
        jax.lax.scan = scan


_SPARSECORE_OPS = ("gather", "scatter", "copy", "reduce", "reshape", "sort")

# Per platform, the compiler options of the counting programs. TPU: XLA's SPMD
# partitioner turns a matmul whose operand is all-gathered (or whose output is
# reduce-scattered) over a large shard axis into a windowed einsum, a while loop of
# per-shard matmuls overlapping the collective, and cost analysis counts its body once:
# the 8B log-prob pass on v5p-128 (fsdp 16 x tensor 4) counted 0.72 of the model's
# FLOPs. Without windowing each such matmul is one dot after the collective, counted
# whole (1.00). And nothing is offloaded to the SparseCores (v5p, v6e): compiling the
# counting programs (scans unrolled) of qwen3-8b at 14,336 tokens on v5p-128 (fsdp 8 x
# tensor 8, full remat) overflowed a libtpu thread's stack in SparseCore code generation
# (DialectTranslationInterface::convertOperation, on a thread of libtpu's own: a
# larger stack for the compiling thread did not help); with these options the train
# step's counting programs compile. The memory programs keep XLA's defaults.
COUNTING_OPTIONS = {
    "tpu": {
        "xla_tpu_enable_windowed_einsum_for_all_gather": False,
        "xla_tpu_enable_windowed_einsum_for_reduce_scatter": False,
        **{f"xla_tpu_enable_offloading_{op}_to_sparsecore": False for op in _SPARSECORE_OPS},
        "xla_tpu_enable_sparse_core_compute_offload": False,
    }
}

PROGRAMS = ("train_step", "logprob", "values", "prefill_insert", "generate")
ENGINE_PROGRAMS = ("prefill_insert", "generate")  # on the sampler's chips in split mode


def _layer_costs(t: Target, programs=PROGRAMS) -> dict[str, tuple]:
    """Per program of `programs`, (FLOPs, bytes accessed) per chip of the run's
    `spec.num_layers`-layer program with every iteration of its loops counted: the
    1- and 2-layer counts of `_depth_costs` extrapolated linearly in depth,
    c(L) = c(1) + (L - 1) (c(2) - c(1)); the update's M minibatch updates cost M times
    one. The engine's step loop stays a loop: its count is one step plus what runs once
    per call."""
    spec = t.spec
    L, Ls = spec.num_layers, len(spec.sparse_layers) or spec.num_layers
    # A mixed model's layers cost by kind: a sparse one the 2-layer sparse program's
    # increment, a dense one that of the 2-layer program whose first layer is dense; a
    # dense last layer (a prefill's last layer is dead code but its keys and values) the
    # 2-layer program ending in it less the one starting with it. Unrolled, each layer's
    # kind is known: no conditional for XLA to count.
    flat = spec.replace(dense_layers=(), scan_layers=False) if spec.mixed else spec
    c1, c2 = _depth_costs(t, flat, programs)
    total = {n: c1[n] + (Ls - 1) * _increment(c2[n], c1[n]) for n in c1}
    if L > Ls:
        _, first = _depth_costs(t, flat.replace(dense_layers=(0,)), programs)
        total = {n: total[n] + (L - Ls) * _increment(first[n], c1[n]) for n in c1}
    if L - 1 in spec.dense_layers:
        _, last = _depth_costs(t, flat.replace(dense_layers=(1,)), programs)
        total = {n: total[n] + last[n] - first[n] for n in c1}
    scale = {"train_step": t.cfg.train.updates_per_batch}
    return {n: tuple(scale.get(n, 1) * float(x) for x in c) for n, c in total.items()}


def _increment(more, fewer) -> np.ndarray:
    """(FLOPs, bytes) of `more` (a program with one more layer or loop iteration) less
    `fewer`'s. XLA's bytes are not additive over programs it fuses differently: the
    2-layer engine prefill of qwen3-8b on v5p-128 (fsdp 8 x tensor 8) moved 4.97 GB per
    chip, its 1-layer program 5.49, and 35 such increments made the whole negative. A
    negative byte increment counts as none: the bytes are then the smaller program's."""
    d = np.asarray(more, dtype=float) - np.asarray(fewer, dtype=float)
    return np.array([d[0], max(d[1], 0.0)])


def _depth_costs(t: Target, spec: ModelSpec, programs=PROGRAMS, *, bodies=None):
    """({program: (FLOPs, bytes) per chip} of the 1-layer and of the 2-layer program of
    `t`'s run for `spec`, one minibatch, every iteration of its scans and loops counted.

    The layer and minibatch scans: unrolled. Blocks and chunks (`rl_jax.kernels.loops`):
    peeled, one iteration; a loop key's body costs the difference with the 1-layer
    program that runs that key's loops twice (one more compile per key), and counts
    (trip count - 1) more times, per layer for loops inside a layer. A key that runs
    as a fused kernel (`Count.fused`) counts all its iterations at the kernel's bytes
    per FLOP instead of its stand-in's bytes. `bodies`: a dict to fill with
    {(program, loop key): (one iteration's (FLOPs, bytes), the kernel's bytes per FLOP)}
    (benchmarks/train_step_flops.py)."""
    one, counts = _peeled_costs(t, spec, 1, (), programs)
    two, _ = _peeled_costs(t, spec, 2, (), programs)
    # Every counting program is submitted before any is waited for (`compile_jobs`).
    keys = sorted({k for c in counts.values() for k, n in c.trips.items() if n > 1})
    twice = {}
    for key in keys:
        names = tuple(p for p in one if key in counts[p].trips)
        twice[key], _ = _peeled_costs(t, spec, 1, (key,), names)
    one, c2 = _results(one), _results(two)
    c1 = dict(one)
    for key in keys:
        _, n, in_layer = key
        for p, c in _results(twice[key]).items():
            body, ratio = _increment(c, one[p]), counts[p].fused.get(key)
            if bodies is not None:
                bodies[p, key] = body, ratio
            more = _iterations(body, n, ratio)
            c1[p], c2[p] = c1[p] + more, c2[p] + (2 if in_layer else 1) * more
    return c1, c2


def _iterations(body: np.ndarray, n: int, bytes_per_flop: float | None) -> np.ndarray:
    """(FLOPs, bytes) that a loop's n iterations add to a program holding one of them
    peeled, whose cost is `body`: n - 1 more bodies; for a fused kernel's stand-in, n
    bodies at the kernel's `bytes_per_flop` in place of the stand-in's one."""
    run = body if bytes_per_flop is None else np.array([body[0], bytes_per_flop * body[0]])
    return n * run - body


def _results(futures: dict) -> dict:
    return {n: np.asarray(f.result()) for n, f in futures.items()}


def _peeled_costs(t: Target, spec: ModelSpec, layers: int, twice, programs):
    """({program: future of (FLOPs, bytes)}, {program: its `loops.Count`}) of `programs`
    of `t`'s run for `spec` built with `layers` layers and one minibatch, scans
    unrolled, loops peeled (the keys in `twice` run two iterations). The counts (trip
    counts, fused kernels' bytes per FLOP) are known once the programs are traced,
    before they compile."""
    dense = tuple(i for i in spec.dense_layers if i < layers)  # a sparse layer kept
    s = dataclasses.replace(spec, num_layers=layers, dense_layers=dense[: layers - 1])
    costs, counts = {}, {}
    options = COUNTING_OPTIONS.get(mesh_platform(t.mesh), {})

    def compile_(name, fn, *args, **kw):
        with loops.counting(twice) as count:
            costs[name] = _submit(fn, *args, then=_cost, options=options, **kw)
        counts[name] = count

    with _unrolled_scans():
        run = t.programs(s).step_programs(t.tp, t.tg, minibatches=1)
        for name, (fn, args, kw) in run.items():
            if name in programs:
                compile_(name, fn, *args, **kw)
    return costs, counts


def _cost(done, times: int = 1) -> tuple[float, float]:
    """(FLOPs, bytes accessed) per chip of a `_compile` result, times `times`."""
    if isinstance(done, OutOfMemory):
        return float("nan"), float("nan")
    cost = done[0].cost_analysis() or {}
    cost = cost[0] if isinstance(cost, list) else cost
    flops, moved = cost.get("flops", np.nan), cost.get("bytes accessed", np.nan)
    return times * float(flops), times * float(moved)


def _mean_filled(tp: int, tg: int) -> float:
    """Cache positions a decode step attends on average over a row's generation: its
    prompt and half its tokens (each step reads the positions written so far)."""
    return tp + (tg + 1) / 2


def _mean_pages_read(engine, tp: int, tg: int) -> float:
    """Pages of its table the engine's decode step reads for a row, averaged over the
    row's `tg` steps: the filled ones as the platform's kernel rounds them
    (`Decode.pages_read`: blocks of pages on TPU; the whole table for XLA's reference)."""
    ops, page, width = engine.decode_ops, engine.page_size, engine.row_pages
    pos = np.arange(tp, tp + tg) + 1  # positions the step attends (its own written first)
    filled = -(-pos // page)
    spec = engine.spec
    dtype = jnp.int8 if engine.kv_quant == "int8" else dtype_of(spec.compute_dtype)
    read = [
        ops.pages_read(int(f), width, dtype=dtype, head_dim=spec.head_dim)
        for f in np.unique(filled)
    ]
    counts = np.unique(filled, return_counts=True)[1]
    return float(np.dot(read, counts) / tg)


def _prefill_flops(spec, T: int) -> float:
    """Model FLOPs of filling a KV cache with T prompt tokens: every layer but the last
    whole, the last one's K and V projections only, no LM head (nothing reads them)."""
    D, K, hd, L = spec.hidden_size, spec.num_kv_heads, spec.head_dim, spec.num_layers
    per_key = spec.flops_per_token(1) - spec.flops_per_token(0)  # attention, all layers
    attn = per_key / L * (L - 1) * T * (T + 1) / 2
    layers = spec.matmul_params() - spec.layer_matmul_params(L - 1)
    return 2 * T * (layers + 2 * D * K * hd) + attn


def _axes(mesh: Mesh) -> dict[str, int]:
    return dict(zip(mesh.axis_names, (int(s) for s in mesh.devices.shape), strict=True))


def _chip_bytes(tree) -> int:
    """Bytes one chip holds of a tree of sharded abstract arrays (its largest shard)."""
    total = 0
    for a in jax.tree.leaves(tree):
        shape = a.sharding.shard_shape(a.shape) if a.sharding is not None else a.shape
        total += int(np.prod(shape, dtype=np.int64)) * a.dtype.itemsize
    return total


@dataclasses.dataclass(frozen=True)
class OutOfMemory:
    """A program XLA refused to compile: its buffers exceed the chip's HBM."""

    message: str
    required_bytes: float  # what XLA said it needs, NaN when it did not say


_jobs = threading.local()  # .pool: the ThreadPoolExecutor of `compile_jobs`, if any


@contextlib.contextmanager
def compile_jobs(jobs: int):
    """Within: `_submit` compiles on `jobs` threads, so that a plan's programs (the run's
    and the counting programs of `_depth_costs`: a dozen for a sampler and a train step)
    compile at once. XLA compiles with the GIL released. Each compile holds its own
    compiler memory (GBs for a large model at long lengths), so `jobs` is bounded by
    host RAM as well as cores. 1 (or outside): one at a time, each when its result is
    first needed, in the calling thread."""
    if jobs < 1:
        raise ValueError(f"compile jobs must be >= 1, got {jobs}")
    prev = getattr(_jobs, "pool", None)
    pool = ThreadPoolExecutor(jobs, thread_name_prefix="plan-compile") if jobs > 1 else None
    with pool or contextlib.nullcontext():
        _jobs.pool = pool
        try:
            yield
        finally:
            _jobs.pool = prev


class _Later:
    """A compile run when its result is first asked for (no pool: `compile_jobs(1)`); the
    lowered program goes once it has run."""

    def __init__(self, run):
        self._run, self._value = run, None

    def result(self):
        if self._run is not None:
            self._value, self._run = self._run(), None
        return self._value


def _submit(fn, *args, then=None, options=None, **static):
    """A future of `_compile(fn, *args, **static)` (of `then` of it, if given: the
    executable can go as soon as its numbers are read; `options`: compiler options added
    to `fn`'s own). `fn` is traced and lowered here, so contexts that change how it
    traces (`_unrolled_scans`, `loops.counting`) apply; the compile runs on
    `compile_jobs`' pool, or lazily in this thread."""
    lowered = fn.trace(*args, **static).lower()

    def run():
        done = _compile_lowered(lowered, options)
        return done if then is None else then(done)

    pool = getattr(_jobs, "pool", None)
    return _Later(run) if pool is None else pool.submit(run)


def _compile(fn, *args, **static):
    """(the executable for the target, seconds it took), or OutOfMemory."""
    return _submit(fn, *args, **static).result()


def _compile_lowered(lowered, options=None):
    """`_compile` of a lowered program: XLA's compile alone is timed."""
    t0 = time.perf_counter()
    try:
        compiled = lowered.compile(compiler_options=options or None)
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        return OutOfMemory(_first(e), _required_bytes(str(e)))
    return compiled, time.perf_counter() - t0


def _required_bytes(message: str) -> float:
    """'... HLO temporaries (21.59G) exceeds available HBM (15.75G)' -> 21.59 GiB in bytes."""
    m = re.search(r"\(([0-9.]+)([KMGT])\) exceeds", message)
    if not m:
        return float("nan")
    return float(m.group(1)) * 1024 ** (" KMGT".index(m.group(2)))


def _report(
    name,
    done,
    analytic_total: float,
    chip: Chip,
    chips: int,
    headroom: float,
    *,
    expected: float | None = None,
    resident: int = 0,
    calls: float = 1,
    bytes_analytic: float | None = None,
    bytes_floor: float | None = None,
    cost: tuple[float, float] | None = None,
    steps_per_call: int = 1,
):
    """One compiled program's per-chip facts. `analytic_total`: its model FLOPs over all
    chips; `expected`: what the compiled count should be (rematerialization included);
    `resident`: bytes other live buffers hold on each chip while it runs; `calls`: times
    it runs per RL step; `bytes_analytic`: HBM bytes it must read (decode's roofline);
    `bytes_floor`: the least any decode step could read (weights and filled positions);
    `steps_per_call`: the token steps one call of a decode program runs (its collectives
    are reported per step, as its roofline is).
    `cost`: its (FLOPs, bytes accessed) per chip with every loop iteration counted
    (`_layer_costs`), else XLA's count of the program. `done`: `_compile`'s result for
    the program, (compiled, seconds) or OutOfMemory."""
    if isinstance(done, OutOfMemory):
        return _out_of_memory(name, done, chip, headroom, calls)
    compiled, compile_s = done
    flops, moved = _cost(done) if cost is None else cost
    analytic = analytic_total / chips  # an SPMD program's costs are per chip
    expected = analytic if expected is None else expected / chips
    roofline = chip.roofline_s(flops, moved)
    sent = sum(collective_bytes(compiled.as_text()).values()) / steps_per_call
    out = {
        "name": name,
        **_memory(compiled, resident, chip, headroom),
        "flops": flops,
        "flops_analytic": analytic,
        "flops_ratio": flops / analytic if analytic else float("nan"),
        "flops_expected": expected,
        "flops_expected_ratio": flops / expected if expected else float("nan"),
        "bytes_accessed": moved,
        # What one call sends over the interconnect (its HLO's collectives, every loop
        # iteration counted), priced at one torus axis's links: time the roofline omits.
        "collective_bytes": sent,
        "collective_s": sent / chip.collective_bandwidth,
        "roofline_s": roofline,
        "mfu_estimate": chip.mfu(analytic, roofline),
        "calls": calls,
        "compile_s": compile_s,
    }
    if bytes_analytic is not None:
        out.update(_decode_bytes(chip, analytic, flops, roofline, bytes_analytic, bytes_floor))
    return out


def _memory(compiled, resident: int, chip: Chip, headroom: float) -> dict[str, Any]:
    """A compiled program's HBM per chip (XLA's memory analysis, with `resident` bytes of
    other live buffers beside it) and whether it fits with `headroom` left free."""
    mem = compiled.memory_analysis()
    parts = {
        "arguments": mem.argument_size_in_bytes,
        "outputs": mem.output_size_in_bytes,
        "aliased": mem.alias_size_in_bytes,
        "temporaries": mem.temp_size_in_bytes,
        "code": mem.generated_code_size_in_bytes,
        "resident": resident,
    }
    total = parts["arguments"] + parts["outputs"] - parts["aliased"] + parts["temporaries"]
    return _hbm(total + parts["code"] + resident, parts, chip, headroom)


def _hbm(total: float, parts: dict[str, int], chip: Chip, headroom: float) -> dict[str, Any]:
    """A program's `total` HBM bytes per chip (`parts` of it by kind) and whether they fit
    with `headroom` left free: "over_gb" is the GB above that (0 where they fit; NaN where
    XLA did not say what it needs)."""
    limit = (1 - headroom) * chip.hbm_bytes
    return {
        "hbm_total_gb": total / 1e9,
        "hbm_gb": {k: v / 1e9 for k, v in parts.items()},
        "fits": total <= limit,
        "headroom": 1 - total / chip.hbm_bytes,
        "over_gb": max(0.0, total - limit) / 1e9 if total == total else total,
    }


def _decode_bytes(chip, analytic, flops, roofline, bytes_analytic, bytes_floor) -> dict:
    """A decode program's roofline from the bytes a step must read.

    XLA's bytes of a decode call count the loop body once plus what runs once per call
    (the draws of every column, the chunk's columns out), and see nothing of a Pallas
    kernel's reads: per token, the bytes the step must read (the weights and the cache
    the platform's attention reads: on TPU a row's filled pages) are the bound."""
    out = {"bytes_analytic": float(bytes_analytic)}
    if bytes_floor:
        out["bytes_floor"] = float(bytes_floor)
        out["bytes_floor_ratio"] = float(bytes_analytic) / float(bytes_floor)
    out["roofline_analytic_s"] = chip.roofline_s(analytic, bytes_analytic)
    out["roofline_compiled_s"] = roofline
    out["roofline_s"] = roofline = chip.roofline_s(flops, bytes_analytic)
    out["mfu_estimate"] = chip.mfu(analytic, roofline)
    return out


# A program XLA refused to compile has no counts or times: NaN (its memory is what XLA said).
_UNCOMPILED = (
    "flops flops_analytic flops_ratio flops_expected flops_expected_ratio bytes_accessed"
    " roofline_s mfu_estimate compile_s collective_bytes collective_s"
).split()


def _out_of_memory(
    name: str, oom: OutOfMemory, chip: Chip, headroom: float, calls: float
) -> dict[str, Any]:
    hbm = {**_hbm(oom.required_bytes, {}, chip, headroom), "fits": False}
    nan = dict.fromkeys(_UNCOMPILED, float("nan"))
    return {**nan, "name": name, **hbm, "calls": calls, "error": oom.message}


def _first(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
