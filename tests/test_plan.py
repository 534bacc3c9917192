"""`rl-jax plan`: a run's programs compiled for a TPU topology from this CPU host (libtpu)."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rl_jax.knobs import ConfigError
from rl_jax.plan.chips import CHIPS, parse_topology

ROOT = Path(__file__).resolve().parents[1]
# A tiny model planned as the real ones are: its layers one rolled loop (a model of 8
# layers or more rolls them unless told not to: model.scan_layers).
TINY = [
    "model.preset=tiny",
    "model.num_layers=2",
    "model.scan_layers=true",
    "model.hidden_size=64",
    "model.intermediate_size=128",
    "data.prompts_per_batch=4",
    "sampling.n=2",
    "sampling.max_prompt_len=16",
    "sampling.max_new_tokens=16",
    "mesh.data=2",
    "mesh.fsdp=2",
    "mesh.tensor=1",
]


def _libtpu():
    try:
        from rl_jax.plan import topology_devices

        topology_devices("v5e:2x2")
    except ConfigError as e:
        pytest.skip(f"libtpu cannot describe a TPU topology here: {e}")


def test_topology_names_are_checked():
    chip, dims = parse_topology("v5p:4x4x4")
    assert chip is CHIPS["v5p"] and dims == (4, 4, 4)
    for bad in ("v9:2x2", "v5e", "v5e:2xq", "v5e:0x2", "v5p-100", "v5p-7", "v7x-8", "v5p-x"):
        with pytest.raises(ConfigError, match="--topology"):
            parse_topology(bad)


def test_accelerator_types_name_their_default_slice():
    """Cloud TPU's names count TensorCores: two per v4 and v5p chip, one per v5e and v6e."""
    from rl_jax.plan.chips import canonical_topology

    assert canonical_topology("v5p-128") == "v5p:4x4x4"  # 64 chips
    assert canonical_topology("v5p-256") == "v5p:4x4x8"
    assert canonical_topology("v4-32") == "v4:2x2x4"
    assert canonical_topology("v6e-64") == "v6e:8x8"
    assert canonical_topology("v5litepod-16") == "v5e:4x4"
    assert canonical_topology("v5e:2x2") == "v5e:2x2"
    chip, dims = parse_topology("v5p-128")
    assert chip is CHIPS["v5p"] and dims == (4, 4, 4)
    with pytest.raises(ConfigError, match="v5p-8, v5p-16"):
        parse_topology("v5p-100")


def _plan_cli(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rl_jax.cli", "plan", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=timeout,
    )


def test_plan_compiles_train_and_sampler_programs_for_v5e(tmp_path):
    _libtpu()
    # Two compiles at a time: the numbers are the same (benchmarks/plan_jobs.py).
    r = _plan_cli(
        "scalerl", *TINY, "--topology", "v5e:2x2", "--json", "--jobs", "2", "--out", str(tmp_path)
    )
    assert r.returncode == 0, r.stderr[-3000:]
    plan = json.loads(r.stdout.strip().splitlines()[-1])
    assert plan == json.loads((tmp_path / "plan.json").read_text())
    assert plan["chips"] == 4 and plan["chip"] == "v5e"
    assert plan["mesh"] == {"data": 2, "fsdp": 2, "tensor": 1}
    progs = {p["name"]: p for p in plan["programs"]}
    # scalerl: one update per batch, truncated IS against the sampler, no KL: no
    # log-prob pass; PipelineRL's stream samples on the engine: its two programs.
    assert set(progs) == {"train_step", "prefill_insert", "generate"}
    step = progs["train_step"]
    assert step["fits"] and 0 < step["hbm_total_gb"] < 1
    # XLA's count of the compiled program against the model's: the tiny model's step has
    # no remat, so the compiled FLOPs are the model's and little else (on TPU the
    # completion stream runs 16 columns for its 15: `Kernels.seq_tile`); every layer of
    # the scanned forward and backward counts (not one loop body).
    assert 0.9 < step["flops_ratio"] < 1.15, step
    assert step["calls"] == 1  # one program runs the step's minibatch updates
    assert step["roofline_s"] > 0 and 0 < step["mfu_estimate"] <= 1
    for p in progs.values():
        assert p["fits"] and p["flops"] > 0 and p["bytes_accessed"] > 0 and p["roofline_s"] > 0
        assert 0 <= p["hbm_total_gb"] < plan["hbm_capacity_gb"] and p["calls"] > 0

    # PipelineRL-8, one update per batch: 9 batches untrained at once, a slot for each
    # of their 9 x 4 x 2 rows; chunks of a quarter of the 16 new tokens.
    b = plan["batch"]
    assert b["batch_prompts"] == 4 and b["batches_in_flight"] == 9
    assert plan["engine"] == {"slots": 72, "chunk": 4, "prefill_prompts": 36}
    # KV cache per chip: K and V, every layer, the 72 slots over 4 batch shards, a
    # page of 64 positions each (the TPU engine's page; a row writes 16 + 16 - 1),
    # float32 (the tiny preset's compute dtype).
    spec_kv_heads, head_dim = _tiny_attention()
    kv = 2 * 2 * (72 // 4) * spec_kv_heads * 64 * head_dim * 4
    assert plan["kv_cache_gb"] * 1e9 == pytest.approx(kv)
    # The stream's engine state (its rows in flight) stays beside the train step; the
    # engine's programs take it as an argument, with the optimizer state beside them.
    assert step["hbm_gb"]["resident"] == pytest.approx(plan["sampler_state_gb"])
    # Of the weights, each engine program has beside it what the other takes: generate
    # the view (prefill_insert's argument), prefill_insert the version's decode layout.
    gen = progs["generate"]
    assert 0 < plan["decode_weights_gb"] and 0 < plan["weights_gb"]
    assert gen["hbm_gb"]["resident"] == pytest.approx(plan["optimizer_gb"] + plan["weights_gb"])
    pre = progs["prefill_insert"]["hbm_gb"]["resident"]
    assert pre == pytest.approx(plan["optimizer_gb"] + plan["decode_weights_gb"])
    # A step's 8 rows of 16 tokens: 128 / 72 steps of every slot; a prefill at most
    # once per generate call with new groups (here: fewer calls than one a chunk).
    assert gen["calls"] == pytest.approx(4 * 2 * 16 / 72)
    assert progs["prefill_insert"]["calls"] == pytest.approx(4 * 2 * 16 / 72 / 4)
    # A call counted whole: all 36 prompts prefilled (the run's engine skips blocks).
    assert 0.9 < progs["prefill_insert"]["flops_ratio"] < 1.5, progs["prefill_insert"]
    assert 0.9 < gen["flops_ratio"] < 3, gen
    # Bandwidth-bound: per step, the sampler's weights and the slots' cache are read: a
    # row's one page of 64 positions, of which it attends 16 + 8.5 on average (the floor).
    assert gen["bytes_analytic"] > plan["kv_cache_gb"] * 1e9
    assert gen["bytes_floor"] < gen["bytes_analytic"] and gen["bytes_floor_ratio"] > 1
    v5e = CHIPS["v5e"]
    bound = max(gen["flops"] / v5e.bf16_flops, gen["bytes_analytic"] / v5e.hbm_bandwidth)
    assert gen["roofline_s"] == pytest.approx(bound)
    st = plan["step"]
    assert st["roofline_s"] == pytest.approx(
        sum(p["roofline_s"] * p["calls"] for p in plan["programs"])
    )
    assert st["rollouts_per_hour"] == pytest.approx(4 * 2 * 3600 / st["roofline_s"])
    # fsdp 2: the train step gathers weights and reduces gradients over the interconnect,
    # priced at one torus axis's links; the step adds them, none overlapped.
    assert step["collective_bytes"] > 0
    assert step["collective_s"] == pytest.approx(step["collective_bytes"] / (400e9 * 2 / 4))
    assert st["roofline_s_with_collectives"] == pytest.approx(
        st["roofline_s"] + sum(p["collective_s"] * p["calls"] for p in plan["programs"])
    )
    assert st["rollouts_per_hour_with_collectives"] < st["rollouts_per_hour"]
    bud = plan["budget"]
    assert bud["rollouts"] == 7400 * 48 * 16
    # (--memory-only: test_search_compiles_the_best_candidate_of_a_tiny_run.)
    assert bud["hours"] == pytest.approx(bud["rollouts"] / st["rollouts_per_hour"])
    assert bud["chip_hours"] == pytest.approx(4 * bud["hours"])


def test_json_is_strict():
    from rl_jax.cli.plan import to_json

    out = to_json({"a": [float("nan"), 1.5], "b": {"c": float("inf")}, "d": 2})

    def strict(name):
        raise ValueError(name)

    assert json.loads(out, parse_constant=strict) == {"a": [None, 1.5], "b": {"c": None}, "d": 2}


def test_scanned_programs_count_every_layer_and_minibatch(monkeypatch, no_compilation_cache):
    """XLA counts a while loop's body once; the plan's counts of the scanned programs
    equal those of the same programs with every scan unrolled, and grow with depth as
    the model's FLOPs do."""
    _libtpu()
    import dataclasses

    from rl_jax.config import load_recipe
    from rl_jax.kernels import loops
    from rl_jax.plan import _programs as pp
    from rl_jax.train.accounting import TRAIN_PASSES, forward_flops

    # The 2- and 3-layer plans both compile the same 1- and 2-layer programs: compile
    # each distinct program once (keyed by its lowered module).
    compiled, compile_fn = {}, pp._compile_lowered

    def compile_once(lowered, options):
        key = lowered.as_text(), str(options)
        if key not in compiled:
            compiled[key] = compile_fn(lowered, options)
        return compiled[key]

    monkeypatch.setattr(pp, "_compile_lowered", compile_once)
    # The engine's prefill of on_policy's batch.
    knobs = [*TINY, *ON_POLICY, "train.updates_per_batch=2"]
    cfg = load_recipe("scalerl", knobs)
    t2 = pp.plan_target(cfg, "v5e:2x2")
    spec2, tp, tg = t2.spec, t2.tp, t2.tg
    spec3 = dataclasses.replace(spec2, num_layers=3)
    t3 = dataclasses.replace(t2, spec=spec3)
    # generate's step loop is counted peeled (test_plan_compiles_the_engines_programs_...).
    counted = ("train_step", "logprob", "prefill_insert")
    c2 = pp._layer_costs(t2, programs=counted)
    with pp.compile_jobs(2):  # the counting programs compiled on two threads
        c3 = pp._layer_costs(t3, programs=counted)
    run = t3.programs().step_programs(tp, tg, minibatches=2)
    fn, args, _ = run["train_step"]
    scanned = pp._cost(pp._compile(fn, *args))
    with pp._unrolled_scans(), loops.unrolled():
        run = t3.programs().step_programs(tp, tg, minibatches=2)
        truth = {
            name: pp._cost(pp._compile(fn, *args, **kw))
            for name, (fn, args, kw) in run.items()
            if name in counted
        }
    for name, (flops, moved) in truth.items():
        assert c3[name][0] == pytest.approx(flops, rel=0.02), name
        # Bytes depend on fusion, which differs between a loop's body run M x L times
        # and the unrolled program (it fuses across layers and updates).
        assert c3[name][1] == pytest.approx(moved, rel=0.25), name
    # The scanned program's own count misses 2 of 3 layers and 1 of 2 minibatches.
    assert scanned[0] < 0.6 * truth["train_step"][0]
    # One more layer: the model's FLOPs of one more layer, forward and backward (per
    # chip: 4 chips), for both minibatches; XLA also counts the tiny layers' norms,
    # rotary and activations, and attention's masked half (dense over the causal mask).
    fwd = forward_flops(spec3, [tp] * 4, [tg] * 8, 2) - forward_flops(spec2, [tp] * 4, [tg] * 8, 2)
    layers = c3["train_step"][0] - c2["train_step"][0]
    assert layers == pytest.approx(TRAIN_PASSES * fwd / 4, rel=0.25)


def test_peeled_loop_counts_each_iteration():
    """A `loops.scan` counted peeled (one iteration, then two: a body's cost times the trip
    count, as `rl-jax plan` counts it) matches XLA's count of the loop unrolled, forward
    and backward; run as a loop, XLA counts its body once."""
    _libtpu()
    import contextlib

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from rl_jax.kernels import loops
    from rl_jax.plan import topology_devices

    one_chip = NamedSharding(
        Mesh(np.array(topology_devices("v5e:2x2")[:1]), ("x",)), PartitionSpec()
    )
    w = jax.ShapeDtypeStruct((256, 256), jnp.float32, sharding=one_chip)
    xs = jax.ShapeDtypeStruct((8, 128, 256), jnp.float32, sharding=one_chip)

    def fn(w, xs):
        def body(c, x):
            y = jnp.tanh(x @ w + c)
            return y, jnp.sum(y @ w)

        c, ys = loops.scan(body, jnp.zeros((128, 256)), xs, name="chunks")
        return jnp.sum(c) + jnp.sum(ys)

    def flops(ctx):
        with ctx as count:
            done = jax.jit(jax.grad(lambda *a: fn(*a))).trace(w, xs).lower().compile()
        return done.cost_analysis()["flops"], count

    unrolled, _ = flops(loops.unrolled())
    one, count = flops(loops.counting())
    assert count.trips == {("chunks", 8, False): 8}
    two, _ = flops(loops.counting([("chunks", 8, False)]))
    assert one + 7 * (two - one) == pytest.approx(unrolled, rel=0.01)
    rolled, _ = flops(contextlib.nullcontext())
    assert rolled < 0.5 * unrolled


def test_counting_programs_count_every_shard_of_a_collective_matmul():
    """On a large TPU mesh, XLA runs a matmul whose weights it all-gathers as a windowed
    einsum (a loop of per-shard matmuls) and counts one shard's; the plan's counting
    programs compile without it and count the whole matmul."""
    _libtpu()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from rl_jax.plan import _programs as pp

    mesh = Mesh(np.array(pp.topology_devices("v5p-128")).reshape(16, 4), ("fsdp", "tensor"))
    B, D, F = 16384, 1024, 3072  # tokens x hidden @ hidden x MLP: XLA windows this one

    def arg(shape, spec):
        return jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, spec))

    x, w = arg((B, D), PartitionSpec("fsdp", None)), arg((D, F), PartitionSpec("fsdp", "tensor"))
    out = NamedSharding(mesh, PartitionSpec("fsdp", "tensor"))
    matmul = jax.jit(lambda x, w: x @ w, out_shardings=out)
    per_chip = 2 * B * D * F / mesh.size

    default, _ = pp._compile(matmul, x, w)
    assert " while(" in default.as_text(), "libtpu no longer windows this matmul"
    assert default.cost_analysis()["flops"] < 0.5 * per_chip
    options = pp.COUNTING_OPTIONS[pp.mesh_platform(mesh)]
    flops, _ = pp._submit(matmul, x, w, then=pp._cost, options=options).result()
    assert flops == pytest.approx(per_chip, rel=0.01)


def test_engine_prefill_compiles_with_one_prompt_per_batch_shard(no_compilation_cache):
    """96 slots of 16 samples on v6e-64's 16 x 4 mesh: the engine prefills 16 prompts,
    one per batch shard, where libtpu aborted compiling the gather of their KV starts."""
    _libtpu()

    from rl_jax.config import load_recipe
    from rl_jax.plan import _programs as pp

    knobs = [
        *TINY,
        "model.num_layers=1",
        "data.prompts_per_batch=48",
        "sampling.n=16",
        "train.updates_per_batch=8",
        "mesh.data=1",
        "mesh.fsdp=16",
        "mesh.tensor=4",
        "sampling.engine_slots=96",
    ]
    t = pp.plan_target(load_recipe("scalerl", knobs), "v6e-64")
    progs = t.programs()
    assert (progs.engine.slots, progs.engine.prefill_prompts) == (96, 16)
    fn, args, kw = progs.step_programs(t.tp, t.tg)["prefill_insert"]
    compiled, _ = pp._compile(fn, *args, **kw)
    assert compiled.memory_analysis().temp_size_in_bytes > 0


@pytest.mark.slow  # six compiles for a v5e: 100 s on the loaded 2-core box
def test_peeled_loops_count_as_the_unrolled_program(monkeypatch, no_compilation_cache):
    """Attention's block pairs and the LM head's chunks stay loops in the plan's cost
    programs, counted peeled (one body's cost times the trip count, one more compile per
    loop): within 1% of the program with every loop unrolled."""
    _libtpu()

    from rl_jax.config import load_recipe
    from rl_jax.kernels import loops
    from rl_jax.plan import _programs as pp

    peeled, peel = [], pp._peeled_costs

    def recording(*args, **kw):
        peeled.append(args[3])  # the keys run twice
        return peel(*args, **kw)

    monkeypatch.setattr(pp, "_peeled_costs", recording)
    # Heads 64 wide, so that attention's matmuls outweigh its masks and softmax as at
    # real sizes (those elementwise ops differ between a loop's body and the unrolled
    # program, where XLA folds and shares them).
    knobs = ["model.attention=blockwise", "model.attention_block=16", "model.logprob_chunk=4"]
    knobs.append("model.head_dim=64")
    t = pp.plan_target(load_recipe("scalerl", [*TINY, *knobs]), "v5e:2x2")
    got = pp._layer_costs(t, programs=("train_step",))
    with pp._unrolled_scans(), loops.unrolled():
        run = t.programs().step_programs(t.tp, t.tg, minibatches=1)
        fn, args, _ = run["train_step"]
        truth = pp._cost(pp._compile(fn, *args))
    # 16 prompt keys in one block: no loop; 16 completions after them over 32 keys in
    # blocks of 16: 2 causal block pairs; 16 completions' LM head in chunks of 4. Each
    # loop once more.
    assert sorted(peeled) == [
        (),
        (),
        (("flash_attention", 2, True),),
        (("lm_head_chunks", 4, False),),
    ]
    assert got["train_step"][0] == pytest.approx(truth[0], rel=0.01)


def test_a_loop_counts_its_iterations_and_a_fused_kernels_at_its_bytes():
    """n iterations of a loop whose peeled body costs (10 FLOPs, 100 bytes): n - 1 more
    bodies; as a fused kernel's stand-in at 0.5 bytes a FLOP, n x (10, 5) in place of the
    stand-in's (10, 100)."""
    from rl_jax.plan import _programs as pp

    body = np.array([10.0, 100.0])
    np.testing.assert_array_equal(pp._iterations(body, 5, None), [40.0, 400.0])
    np.testing.assert_array_equal(pp._iterations(body, 5, 0.5), [40.0, 25.0 - 100.0])
    np.testing.assert_array_equal(pp._iterations(body, 1, 0.5), [0.0, 5.0 - 100.0])


def _tiny_attention() -> tuple[int, int]:
    from rl_jax.config import load_recipe, resolved
    from rl_jax.models.load import resolve_spec

    spec = resolve_spec(resolved(load_recipe("scalerl", TINY)).model)
    return spec.num_kv_heads, spec.head_dim


# Wide enough that parameters, gradients and AdamW replicated on every chip (data=4)
# overflow a v5e's 16 GiB, while FSDP or tensor splits fit: 3 layers of 4096 x 32768.
WIDE = [
    *(o for o in TINY if not o.startswith(("model.hidden_size", "model.intermediate", "mesh."))),
    "model.num_layers=3",
    "model.hidden_size=4096",
    "model.intermediate_size=32768",
    "model.num_heads=4",
    "model.num_kv_heads=4",
]


def test_search_compiles_the_best_candidate_of_a_tiny_run():
    _libtpu()
    r = _plan_cli("scalerl", *TINY, "--topology", "v5e:2x2", "--search", "--top", "1", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["compiled"] == 1
    assert res["dimensions"] == ["mesh", "remat", "micro", "waves", "slots", "sampler"]
    (best,) = res["ranked"]
    plan = best["plan"]
    assert plan["fits"] and plan["mesh"] == best["mesh"]
    assert plan["model"]["remat"] == best["remat"]
    assert best["rollouts_per_hour"] == plan["step"]["rollouts_per_hour"] > 0
    # Every other candidate was only estimated: the first compiled one fit.
    assert res["candidates"] > 1 and not res["excluded"]
    # The row's command is the plan: the recipe, the overrides given less those the row
    # sets, the row's. Run, it compiles the same programs to the same bytes.
    import shlex

    argv = shlex.split(best["command"])
    assert argv[:3] == ["rl-jax", "plan", "scalerl"] and argv[-2:] == ["--topology", "v5e:2x2"]
    assert argv[3:-2] == [o for o in TINY if not o.startswith("mesh.")] + best["overrides"]
    # --memory-only compiles the same programs, without the ones that count FLOPs.
    again = _plan_cli(*argv[2:], "--memory-only", "--json")
    assert again.returncode == 0, again.stderr[-3000:]
    again = json.loads(again.stdout.strip().splitlines()[-1])
    assert again["mesh"] == plan["mesh"] and again["engine"] == plan["engine"]
    assert not again["flops_counted"] and plan["flops_counted"]
    for p, q in zip(plan["programs"], again["programs"], strict=True):
        assert (q["name"], q["hbm_gb"], q["fits"]) == (p["name"], p["hbm_gb"], p["fits"])
        assert q["flops"] is None and q["roofline_s"] is None and q["mfu_estimate"] is None
        assert p["flops"] > 0 and p["roofline_s"] > 0
    assert again["step"]["rollouts_per_hour"] is None and again["budget"]["hours"] is None
    assert plan["budget"]["hours"] > 0


def test_search_estimate_only_ranks_the_estimates_that_fit_and_compiles_nothing():
    """--estimate-only: the --top best candidates by estimated rollouts per hour among
    those whose estimate fits with the default headroom, nothing compiled (no hbm_gb,
    no plan); every other candidate is excluded by the estimate."""
    from rl_jax.plan._programs import HEADROOM, SCALERL_BUDGET_ROLLOUTS

    r = _plan_cli(
        "scalerl", *WIDE, "--topology", "v5e-4", "--search", "--estimate-only", "--top", "4",
        "--json", timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["topology"] == "v5e:2x2" and res["compiled"] == 0
    assert all(
        r["command"].endswith(" ".join(r["overrides"]) + " --topology v5e-4") for r in res["ranked"]
    )
    assert res["shapes"]["prompts"] == 4 and res["shapes"]["new_tokens"] == 16
    ranked, limit = res["ranked"], (1 - HEADROOM) * res["hbm_capacity_gb"]
    assert len(ranked) == 4 and all(r["hbm_gb"] is None and "plan" not in r for r in ranked)
    assert all(r["hbm_estimate_gb"] <= limit for r in ranked)
    parts = ranked[0]["estimate_parts_gb"]
    assert parts["activations"] > 0 and parts["sampler_kv"] > 0
    assert max(parts.values()) <= ranked[0]["hbm_estimate_gb"]
    rates = [r["rollouts_per_hour"] for r in ranked]
    assert rates == sorted(rates, reverse=True) and rates[0] > 0
    assert ranked[0]["budget_hours"] == pytest.approx(SCALERL_BUDGET_ROLLOUTS / rates[0])
    assert all(e["hbm_estimate_gb"] > limit for e in res["excluded"])
    assert len(res["excluded"]) < res["candidates"]


def test_search_ranks_compiled_plans_and_drops_those_that_do_not_fit():
    """The search's bookkeeping alone: a stand-in plan for each compiled candidate
    (fits only with remat; faster the more tensor-parallel), no compiler."""
    from rl_jax.config import load_recipe
    from rl_jax.plan import search

    seen = []

    def fake_plan(cfg, topology, *, headroom, budget_rollouts, flops_if_fits):
        assert flops_if_fits  # a candidate that does not fit costs only its memory
        seen.append(cfg)
        rate = 1000.0 * cfg.mesh.tensor
        return {
            "fits": cfg.model.remat != "none",
            "programs": [{"hbm_total_gb": 1.0 if cfg.model.remat != "none" else 99.0}],
            "step": {"rollouts_per_hour": rate, "mfu_estimate": 0.5},
            "budget": {"hours": budget_rollouts / rate},
        }

    cfg = load_recipe("scalerl", WIDE)
    res = search(cfg, "v5e:2x2", top=6, plan_fn=fake_plan, budget_rollouts=1e6)
    assert len(seen) == res["compiled"]
    ranked = res["ranked"]
    assert len(ranked) == 6 and all(r["remat"] != "none" for r in ranked)
    rates = [r["rollouts_per_hour"] for r in ranked]
    assert rates == sorted(rates, reverse=True)
    assert ranked[0]["budget_hours"] == pytest.approx(1e6 / rates[0])
    compiled_out = [e for e in res["excluded"] if e["reason"] == "compiled"]
    assert compiled_out and all(e["remat"] == "none" for e in compiled_out)
    assert len(compiled_out) + len(ranked) == res["compiled"]
    # Parameters, gradients and AdamW of 1.4B float32 parameters on every chip: over
    # 16 GiB, dropped by the estimate before any compile.
    replicated = {"data": 4, "fsdp": 1, "tensor": 1}
    assert all(c.mesh.data * c.mesh.fsdp * c.mesh.tensor == 4 for c in seen)
    assert replicated not in [{"data": c.mesh.data, "fsdp": c.mesh.fsdp, "tensor": 1} for c in seen]
    assert any(e["mesh"] == replicated and e["reason"] == "estimate" for e in res["excluded"])


def test_search_keeps_compiling_down_the_ranking_until_a_candidate_fits():
    """--top 1 whose best estimates do not fit when compiled: the search compiles the next
    ones, in the estimate's order, until one fits, and says so; where none fits, it has
    tried every candidate the estimate let through and says that."""
    from rl_jax.cli.plan import format_search
    from rl_jax.config import load_recipe
    from rl_jax.plan import search

    seen, told = [], []

    def plan_fn(fits_from):
        def fake_plan(cfg, topology, *, headroom, budget_rollouts, flops_if_fits):
            seen.append(cfg)
            fits = len(seen) > fits_from
            return {
                "fits": fits,
                "programs": [{"hbm_total_gb": 1.0 if fits else 15.0}],
                "step": {"rollouts_per_hour": 1e3, "mfu_estimate": 0.5},
                "budget": {"hours": budget_rollouts / 1e3},
            }

        return fake_plan

    # On-policy, the engine's slots set: no waves or slots to try, few candidates.
    cfg = load_recipe("scalerl", [*WIDE, *ON_POLICY, "sampling.engine_slots=8"])
    res = search(cfg, "v5e:2x2", top=1, plan_fn=plan_fn(3), progress=told.append)
    assert res["compiled"] == len(seen) == len(told) == 4 and len(res["ranked"]) == 1
    out = [e for e in res["excluded"] if e["reason"] == "compiled"]
    assert [e["overrides"] for e in out] == [t.split(": ", 1)[1].split() for t in told[:3]]
    assert told[0].startswith(f"compiling candidate 1 (of {res['passed_estimate']}")
    text = format_search(res)
    assert "compiled 4 in the estimate's order until 1 fit (--top): 1 fit, 3 did not" in text
    assert text.count("15.00 GB (est ") == 3

    seen.clear()
    res = search(cfg, "v5e:2x2", top=1, plan_fn=plan_fn(10**9))
    assert res["compiled"] == res["passed_estimate"] == len(seen) > 1 and res["ranked"] == []
    text = format_search(res)
    assert "every candidate was tried" in text and "no candidate fits" in text


def test_search_rows_carry_the_overrides_that_make_their_candidate():
    """Each candidate's `overrides`, given to the recipe after the search's own, make the
    config the search estimated and compiled for it (micro-batches set two knobs)."""
    from rl_jax.config import load_recipe, resolved
    from rl_jax.plan import search
    from rl_jax.plan._search import DIMENSIONS, apply, candidates, overrides

    given = [*TINY, "data.prompts_per_batch=8"]
    cfg = resolved(load_recipe("scalerl", given))
    cands = candidates(cfg, 4, num_heads=4)
    # Every value of every dimension at least once (each candidate costs a recipe load).
    values = {(d, str(c[d])) for c in cands for d in DIMENSIONS}
    some = [c for i, c in enumerate(cands) if i % 37 == 0]
    for c in cands:
        if {(d, str(c[d])) for d in DIMENSIONS} - {
            (d, str(x[d])) for x in some for d in DIMENSIONS
        }:
            some.append(c)
    assert {(d, str(c[d])) for c in some for d in DIMENSIONS} == values and len(some) < 50
    assert {c["micro"] for c in some} > {1} and {c["slots"] for c in some} > {0}
    for c in some:
        ov = overrides(cfg, c)
        assert resolved(load_recipe("scalerl", [*given, *ov])) == resolved(apply(cfg, c)), ov
    m4 = next(c for c in cands if c["micro"] == 4)
    assert {"train.updates_per_batch=4", "train.grad_accum=4"} <= set(overrides(cfg, m4))
    seen = []

    def fake_plan(c, topology, **_):
        seen.append(c)
        return {
            "fits": True,
            "programs": [{"hbm_total_gb": 1.0}],
            "step": {"rollouts_per_hour": 1e3, "mfu_estimate": 0.5},
            "budget": {"hours": 1.0},
        }

    res = search(load_recipe("scalerl", given), "v5e:2x2", top=2, plan_fn=fake_plan)
    for row, c in zip(res["ranked"], seen, strict=True):
        assert c == load_recipe("scalerl", [*given, *row["overrides"]])


def test_search_states_the_shapes_its_numbers_are_for():
    """A search states the model, dtypes, batch and lengths it assumed before any row, and
    that its budget hours are ScaleRL's budget at these shapes: not that paper's cost
    unless they are the paper's (scalerl_8b's)."""
    from rl_jax.config import load_recipe
    from rl_jax.plan._assumed import SCALERL_BUDGET_ROLLOUTS, budget_note, planned_model

    r = _plan_cli(
        "scalerl", "--topology", "v5p-128", "--search", "--estimate-only", "--top", "2",
        timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    first, budget = r.stdout.strip().splitlines()[:2]
    assert first.startswith("shapes of every row: model: preset 'tiny';")
    assert "params float32 / compute float32; batch 16 prompts x 8 samples" in first
    assert "+ 10 new tokens" in first
    assert "NOT ScaleRL's shapes" in budget and "rl-jax plan scalerl_8b" in budget
    scalerl_8b, _ = planned_model(load_recipe("scalerl_8b"))
    paper = budget_note(scalerl_8b, SCALERL_BUDGET_ROLLOUTS)
    assert "NOT" not in paper and "ScaleRL's own" in paper
    assert "--budget-rollouts" in budget_note(scalerl_8b, 1e6)


def test_compile_jobs_compile_programs_at_once(monkeypatch):
    """Under `compile_jobs(2)` two submitted programs compile at the same time (each
    waits for the other at a barrier: one at a time, the first would wait in vain), and
    their results come back in order; outside, a program compiles when its result is
    first asked for."""
    import threading

    import jax
    import jax.numpy as jnp

    from rl_jax.plan import _programs as pp

    barrier, compiled = threading.Barrier(2, timeout=120), []

    def meet(lowered, options):
        barrier.wait()
        return lowered.as_text(), 0.0

    monkeypatch.setattr(pp, "_compile_lowered", meet)
    x = jax.ShapeDtypeStruct((4,), jnp.float32)
    f, g = jax.jit(lambda x: x + 1), jax.jit(lambda x: x * 3)
    with pp.compile_jobs(2):
        a, b = pp._submit(f, x), pp._submit(g, x, then=lambda done: done[0])
        assert "add" in a.result()[0] and "mul" in b.result()
    monkeypatch.setattr(pp, "_compile_lowered", lambda *_: compiled.append(1) or (1, 0.0))
    later = pp._submit(f, x)
    assert compiled == []
    assert later.result() == (1, 0.0) and later.result() == (1, 0.0) and compiled == [1]
    with pytest.raises(ValueError, match="jobs"):
        with pp.compile_jobs(0):
            pass


@pytest.mark.parametrize(
    "flags, named",
    [
        (("--jobs", "0"), "--jobs=0"),
        (("--memory-only", "--search"), "--search"),
        (("--estimate-only",), "--search"),
    ],
)
def test_bad_plan_flags_exit_2_before_compiling(flags, named):
    r = _plan_cli("scalerl", "--topology", "v5e:2x2", *flags, timeout=300)
    assert r.returncode == 2 and named in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_bad_keys_exit_2_before_compiling():
    r = _plan_cli("scalerl", "model.no_such_knob=1", "--topology", "v5e:2x2", timeout=300)
    assert r.returncode == 2 and "no_such_knob" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_a_minibatch_the_mesh_cannot_split_exits_2_before_compiling():
    """8 micro-batches of 96 rows over v6e-64's 64 batch shards: the trainer refuses it,
    and so does the plan, in one line and before libtpu loads."""
    r = _plan_cli(
        "scalerl",
        *TINY,
        "data.prompts_per_batch=48",
        "sampling.n=16",
        "train.updates_per_batch=8",
        "mesh.data=1",
        "mesh.fsdp=64",
        "mesh.tensor=1",
        "--topology",
        "v6e-64",
        timeout=300,
    )
    assert r.returncode == 2 and "96 rows" in r.stderr and "64 batch shards" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_split_plan_runs_the_sides_at_once_and_adds_the_weight_push(monkeypatch):
    """mesh.sampler_devices=4 of v5e:2x4's 8 chips: the engine's programs compile on the
    first 4 chips (a data-parallel sampler mesh, as the trainer lays it out), the
    trainer's on the other 4, and the RL step is the slower side plus the push of a
    version's weights into the sampler's layout over ICI."""
    _libtpu()
    from rl_jax.cli.plan import format_plan
    from rl_jax.config import load_recipe
    from rl_jax.plan import _programs as pp

    # Every program's (FLOPs, bytes) per chip set here: the counting compiles skipped.
    fixed = {"train_step": (4e9, 1e8), "prefill_insert": (1e9, 2e8), "generate": (5e8, 3e8)}
    monkeypatch.setattr(pp, "_layer_costs", lambda *a, **k: fixed)
    cfg = load_recipe("scalerl", [*TINY, "mesh.sampler_devices=4"])
    plan = pp.plan_run(cfg, "v5e:2x4")
    assert plan["chips"] == 8 and plan["mesh"] == {"data": 2, "fsdp": 2, "tensor": 1}
    assert plan["sampler_mesh"] == {"data": 4, "fsdp": 1, "tensor": 1}
    progs = {p["name"]: p for p in plan["programs"]}
    assert set(progs) == {"train_step", "prefill_insert", "generate"} and plan["fits"]
    # Nothing of the other side lives beside a program: the stream's engine state is on
    # the sampler's chips, the optimizer state on the trainer's. The sampler's chips hold
    # the pushed view beside generate and its decode layout beside prefill_insert.
    assert progs["train_step"]["hbm_gb"]["resident"] == 0
    assert progs["generate"]["hbm_gb"]["resident"] == pytest.approx(plan["weights_gb"])
    pre = progs["prefill_insert"]["hbm_gb"]["resident"]
    assert pre == pytest.approx(plan["decode_weights_gb"])
    # A version's view (float32, the tiny model's every weight) whole on each sampler
    # chip (tensor 1), sent by 4 trainer chips to 4: each side moves one copy a chip.
    from rl_jax.models.load import resolve_spec
    from rl_jax.models.transformer import param_layout

    weights = sum(int(np.prod(i.shape)) for i in param_layout(resolve_spec(cfg.model)).values())
    st, split = plan["step"], plan["step"]["split"]
    assert split["push_gb"] * 1e9 == weights * 4 == plan["weights_gb"] * 1e9
    assert split["push_s"] == pytest.approx(weights * 4 / (CHIPS["v5e"].ici_bandwidth / 2))
    train = progs["train_step"]["roofline_s"] * progs["train_step"]["calls"]
    sample = sum(progs[n]["roofline_s"] * progs[n]["calls"] for n in ("prefill_insert", "generate"))
    assert (split["trainer_s"], split["sampler_s"]) == pytest.approx((train, sample))
    assert st["roofline_s"] == pytest.approx(max(train, sample) + split["push_s"])
    assert st["roofline_s"] < train + sample + split["push_s"]  # the sides overlap
    assert "split:" in format_plan(plan) and "sampler data=4" in format_plan(plan)


def test_a_split_sampler_that_does_not_fit_is_told_of_its_own_chips():
    """Advice for split mode's engine programs: fewer slots in whole shards of the
    sampler's own mesh, or twice the sampler chips; not the trainer's tensor axis."""
    from rl_jax.config import load_recipe, resolved
    from rl_jax.plan._advice import advice

    cfg = resolved(load_recipe("scalerl", [*TINY, "mesh.sampler_devices=2"]))
    over = {"name": "generate", "fits": False, "over_gb": 1.5, "hbm_total_gb": 17.0}
    plan = {
        "fit_limit_gb": 15.5,
        "hbm_capacity_gb": 17.2,
        "headroom": 0.1,
        "chips": 8,
        "mesh": {"data": 2, "fsdp": 2, "tensor": 1},
        "sampler_mesh": {"data": 2, "fsdp": 1, "tensor": 1},
        "engine": {"slots": 72},
        "programs": [{**over, "hbm_gb": {"resident": 0.0}}],
    }
    (line,) = advice(cfg, plan)
    assert line.startswith("generate: 1.50 GB per chip over")
    assert "sampling.engine_slots=36" in line and "mesh.sampler_devices=4" in line
    assert "mesh.tensor" not in line
    plan["chips"] = 4  # twice the sampler's 2 chips would leave the trainer none
    assert "mesh.sampler_devices" not in advice(cfg, plan)[0]


def test_a_split_that_leaves_the_trainer_no_chip_exits_2_before_compiling():
    r = _plan_cli("scalerl", *TINY, "mesh.sampler_devices=4", "--topology", "v5e:2x2")
    assert r.returncode == 2 and "mesh.sampler_devices=4" in r.stderr, r.stderr[-2000:]
    assert len(r.stderr.strip().splitlines()) == 1


def test_bad_topology_exits_2_before_compiling():
    r = subprocess.run(
        [sys.executable, "-m", "rl_jax.cli", "plan", "scalerl", "--topology", "v9:2x2"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert r.returncode == 2 and "v9:2x2" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_estimate_counts_the_trainers_state_as_train_precision_and_lora_hold_it():
    """The search's first pass sizes float32 masters of a bfloat16 model, their float32
    moments and gradients and the sampler's bfloat16 view (rl_jax.train.params): 8 bytes
    per parameter more than pure bfloat16, whichever program is the larger; LoRA trains
    and keeps moments for the adapters only."""
    from rl_jax.config import load_recipe, resolved
    from rl_jax.models.load import resolve_spec
    from rl_jax.plan._estimate import estimate

    mesh, chip = {"data": 2, "fsdp": 2, "tensor": 1}, CHIPS["v5e"]

    def hbm(*knobs):
        cfg = resolved(load_recipe("scalerl", [*TINY, "model.param_dtype=bfloat16", *knobs]))
        spec = resolve_spec(cfg.model)
        return estimate(spec, cfg, mesh, chip)["hbm_bytes"], spec.num_params()

    pure, n = hbm("train.precision=pure", "loss.kl_coef=0")
    master, _ = hbm("train.precision=fp32_master", "loss.kl_coef=0")
    lora, _ = hbm("train.precision=fp32_master", "loss.kl_coef=0", "lora.enabled=true")
    assert master - pure == pytest.approx(8 * n / 2)
    assert lora < pure < master


def test_search_tries_every_remat_policy_and_only_the_waves_the_trainer_keeps():
    """Candidates span none / save_dots / full, micro-batches dividing the minibatch,
    and a candidate's "waves" (W, the batches PipelineRL keeps untrained:
    train.pipeline_waves) are what the trainer would keep with its optimizer steps per
    batch (micro-batches split a step, so they keep as many), each once."""
    from rl_jax.config import load_recipe, resolved
    from rl_jax.plan._search import apply, candidates
    from rl_jax.train.accounting import batches_in_flight

    cfg = resolved(load_recipe("scalerl", [*TINY, "data.prompts_per_batch=8"]))
    cands = candidates(cfg, 4, num_heads=4)
    assert {c["remat"] for c in cands} == {"none", "save_dots", "full"}
    assert {c["micro"] for c in cands} == {1, 2, 4, 8}
    assert all(batches_in_flight(resolved(apply(cfg, c))) == c["waves"] for c in cands)
    # PipelineRL-8: W = 9 with one optimizer step per batch, then halvings; the same
    # with 8 micro-batches of it (train.grad_accum=8).
    assert sorted({c["waves"] for c in cands if c["micro"] == 1}) == [1, 2, 4, 9]
    assert sorted({c["waves"] for c in cands if c["micro"] == 8}) == [1, 2, 4, 9]
    overrides = [*TINY, "data.prompts_per_batch=8", "train.updates_per_batch=2"]
    two_steps = resolved(load_recipe("scalerl", overrides))
    assert {c["waves"] for c in candidates(two_steps, 4, num_heads=4)} == {1, 2, 4}
    # Only batches the trainer takes: a micro-batch's rows split over the batch shards
    # (8 prompts x 2 samples in 8 micro-batches: 2 rows, not over fsdp 4).
    for c in cands:
        rows = 8 // (cfg.train.updates_per_batch * c["micro"]) * cfg.sampling.n
        assert rows % (c["mesh"]["data"] * c["mesh"]["fsdp"]) == 0
    meshes = {(tuple(c["mesh"].values()), c["micro"]) for c in cands}
    assert ((1, 2, 2), 8) in meshes and ((1, 4, 1), 8) not in meshes and ((1, 4, 1), 4) in meshes
    keys = [
        (tuple(c["mesh"].values()), c["remat"], c["micro"], c["waves"], c["slots"]) for c in cands
    ]
    assert len(keys) == len(set(keys))


def test_search_micro_batches_are_per_optimizer_step_coarser_than_the_recipes_too():
    """A recipe already in 8 micro-batches of one optimizer step (train.updates_per_batch
    = train.grad_accum = 8, as scalerl_8b's 48): the search tries every count of
    micro-batches per step dividing its prompts, fewer than the recipe's too, each with
    the one optimizer step per batch (steps x m minibatches, m accumulated)."""
    from rl_jax.config import load_recipe, resolved
    from rl_jax.plan._search import apply, candidates, overrides

    knobs = [*TINY, "data.prompts_per_batch=8", "train.updates_per_batch=8"]
    cfg = resolved(load_recipe("scalerl", [*knobs, "train.grad_accum=8"]))
    cands = candidates(cfg, 4, num_heads=4)
    assert {c["micro"] for c in cands} == {1, 2, 4, 8}
    for c in cands:
        t = apply(cfg, c).train
        assert (t.updates_per_batch, t.grad_accum) == (c["micro"], c["micro"])
    two = next(c for c in cands if c["micro"] == 2)
    assert "train.updates_per_batch=2" in overrides(cfg, two)
    assert "train.grad_accum=2" in overrides(cfg, two)
    # Two optimizer steps per batch: 2 x m minibatches, m accumulated into each step.
    steps = resolved(load_recipe("scalerl", [*knobs, "train.grad_accum=4"]))
    for c in candidates(steps, 4, num_heads=4):
        t = apply(steps, c).train
        assert (t.updates_per_batch, t.grad_accum) == (2 * c["micro"], c["micro"])
    # An accumulation that spans batches (grad_accum not dividing the minibatches) stays.
    spans = resolved(load_recipe("scalerl", [*TINY, "train.grad_accum=3"]))
    assert {c["micro"] for c in candidates(spans, 4, num_heads=4)} == {3}


def test_search_tries_fewer_engine_slots_than_rows_in_flight():
    """The engine's slots (sampling.engine_slots): a slot for every row in flight (0)
    and that many split 2, 4 or 8 ways, in whole slots per batch shard; the estimate of
    a split has a smaller cache and more decode steps. A recipe that sets the slots
    keeps its own."""
    from rl_jax.config import load_recipe, resolved
    from rl_jax.models.load import resolve_spec
    from rl_jax.plan._estimate import estimate, sampler_axes
    from rl_jax.plan._search import apply, candidates
    from rl_jax.train.accounting import sampler_rows

    cfg = resolved(load_recipe("scalerl", [*TINY, "data.prompts_per_batch=8"]))
    cands = candidates(cfg, 4, num_heads=4)
    # PipelineRL-8, one update per batch, W = 9: 9 x 8 x 2 = 144 rows in flight.
    one = {"data": 1, "fsdp": 4, "tensor": 1}
    w9 = [c for c in cands if c["mesh"] == one and c["micro"] == 1 and c["waves"] == 9]
    # 144 / 8 = 18 is no whole number of slots on each of 4 shards.
    assert sorted(c["slots"] for c in w9 if c["remat"] == "full") == [0, 36, 72]
    for c in cands:
        rows = sampler_rows(resolved(apply(cfg, {**c, "slots": 0})))
        shards = c["mesh"]["data"] * c["mesh"]["fsdp"]
        if c["sampler"]:  # split mode: the sampler's own batch shards
            shards = sampler_axes(c["mesh"], c["sampler"])[0]
        assert c["slots"] == 0 or (rows % c["slots"] == 0 and c["slots"] % shards == 0)
        assert c["slots"] == 0 or resolved(apply(cfg, c)).sampling.engine_slots == c["slots"]
    chip = CHIPS["v5e"]

    def est(c):
        cc = resolved(apply(cfg, c))
        return estimate(resolve_spec(cc.model), cc, c["mesh"], chip)

    full = {c["slots"]: est(c) for c in w9 if c["remat"] == "full"}
    assert full[36]["sampler_kv_bytes"] < full[72]["sampler_kv_bytes"] < full[0]["sampler_kv_bytes"]
    assert full[0]["step_s"] < full[72]["step_s"] < full[36]["step_s"]
    # MFU: the step's model FLOPs (forward, backward and the sampler's forward; no extra
    # log-prob pass with one update per batch) over 4 chips' peak for the step's time.
    from rl_jax.train.accounting import forward_flops

    spec = resolve_spec(cfg.model)
    fwd = forward_flops(spec, [16] * 8, [16] * 16, 2)
    for e in full.values():
        assert e["mfu_estimate"] == pytest.approx(4 * fwd / 4 / chip.bf16_flops / e["step_s"])
    knobs = [*TINY, "data.prompts_per_batch=8", "sampling.engine_slots=16"]
    own = resolved(load_recipe("scalerl", knobs))
    assert {c["slots"] for c in candidates(own, 4, num_heads=4)} == {0}


def test_expected_train_flops_add_what_each_knob_recomputes():
    """The model's 3 passes, plus: full remat's layers (not the LM head), save_dots'
    attention, blockwise attention's scores (half its forward) and the chunked LM head."""
    import dataclasses

    from rl_jax.config import load_recipe, resolved
    from rl_jax.models.load import resolve_spec
    from rl_jax.plan._flops import train_flops
    from rl_jax.train.accounting import forward_flops

    cfg = resolved(load_recipe("scalerl", TINY))
    base = dataclasses.replace(
        resolve_spec(cfg.model), remat="none", attention="dense", logprob_chunk=0
    )
    P, G, tp, tg = 2, 3, 5, 7
    fwd = forward_flops(base, [tp] * P, [tg] * (P * G), G)
    # Each prompt token t (1-based) attends to t keys, completion token j to tp + j.
    per_key = 4 * base.num_layers * base.num_heads * base.head_dim
    keys = P * sum(range(1, tp + 1)) + P * G * sum(range(tp + 1, tp + tg + 1))
    attn = per_key * keys
    head = 2 * base.vocab_size * base.hidden_size

    def extra(**knobs):
        f = train_flops(dataclasses.replace(base, **knobs), P, G, tp, tg)
        assert f["model"] == pytest.approx(3 * fwd)
        return f["expected"] - f["model"]

    assert extra() == 0
    assert extra(remat="full") == pytest.approx(fwd - head * (P * tp + P * G * tg))
    assert extra(remat="save_dots") == pytest.approx(attn)
    assert extra(attention="blockwise") == pytest.approx(attn / 2)
    assert extra(logprob_chunk=2) == pytest.approx(head * P * G * tg)


# on_policy (scalerl's off_policy_k=8 is PipelineRL's): it samples on the engine.
ON_POLICY = ["train.off_policy=on_policy", "train.off_policy_k=1"]


def test_plan_compiles_the_engines_programs_where_the_trainer_samples_on_it(
    monkeypatch, no_compilation_cache
):
    """on_policy samples on the engine: the plan compiles its prefill_insert and
    generate at the trainer's slot count, chunk and prefill size, and counts its slots'
    KV cache."""
    _libtpu()
    import collections

    import jax

    from rl_jax.config import load_recipe
    from rl_jax.plan import _programs as pp

    # The train step is the v5e test's: a stand-in program here, and only generate's
    # costs counted layer by layer (XLA's own count for the others), to compile little.
    from rl_jax.train import parts

    # (The plan builds the trainer's programs with the trainer's own `build_programs`.)
    monkeypatch.setattr(parts, "make_update", lambda *a, **k: jax.jit(lambda p, o, b: (p, o)))
    layer_costs = pp._layer_costs

    def generate_costs(*args, **kw):
        return collections.defaultdict(
            lambda: None, layer_costs(*args, **kw, programs=("generate",))
        )

    monkeypatch.setattr(pp, "_layer_costs", generate_costs)
    cfg = load_recipe("scalerl", [*TINY, *ON_POLICY, "sampling.engine_slots=4"])
    plan = pp.plan_run(cfg, "v5e:2x2")
    progs = {p["name"]: p for p in plan["programs"]}
    assert set(progs) == {"train_step", "prefill_insert", "generate"}
    # 4 slots (one per batch shard) for the step's 4 x 2 rows; a chunk decodes to the
    # end (no sampling.decode_chunk); a prefill holds a refill's 4 / 2 prompts, in
    # whole batch shards.
    assert plan["engine"] == {"slots": 4, "chunk": 16, "prefill_prompts": 4}
    for name in ("prefill_insert", "generate"):
        p = progs[name]
        assert p["fits"] and p["flops"] > 0 and p["bytes_accessed"] > 0 and p["roofline_s"] > 0
        assert 0 < p["hbm_gb"]["arguments"] and 0 < p["hbm_total_gb"] < plan["hbm_capacity_gb"]
    # KV cache per chip: the slots', one per chip: K and V, 2 layers, a page of 64
    # positions each (the TPU engine's page; a row writes 16 + 16 - 1), f32.
    kv_heads, head_dim = _tiny_attention()
    kv = 2 * 2 * (4 // 4) * kv_heads * 64 * head_dim * 4
    assert plan["kv_cache_gb"] * 1e9 == pytest.approx(kv)
    assert plan["sampler_state_gb"] > plan["kv_cache_gb"]  # rows and the prompts' pool
    gen, pre = progs["generate"], progs["prefill_insert"]
    # The 8 rows of 16 tokens take 32 steps of the 4 slots; the 4 prompts one prefill.
    assert gen["calls"] == 32 and pre["calls"] == 1
    # The optimizer state beside the engine's programs (their state is an argument), with
    # the weights the other program takes; nothing beside the train step (on_policy
    # frees the engine's state).
    assert gen["hbm_gb"]["resident"] == pytest.approx(plan["optimizer_gb"] + plan["weights_gb"])
    assert pre["hbm_gb"]["resident"] == pytest.approx(
        plan["optimizer_gb"] + plan["decode_weights_gb"]
    )
    assert progs["train_step"]["hbm_gb"]["resident"] == 0
    # One step of every slot, each attending on average to the prompt and half the
    # generation; bandwidth-bound on the weights and the slots' cache.
    assert 0.9 < gen["flops_ratio"] < 3, gen
    assert gen["bytes_analytic"] > kv
    v5e = CHIPS["v5e"]
    bound = max(gen["flops"] / v5e.bf16_flops, gen["bytes_analytic"] / v5e.hbm_bandwidth)
    assert gen["roofline_s"] == pytest.approx(bound)


def test_a_critics_recipe_plans_its_values_pass(monkeypatch, no_compilation_cache):
    """PPO's GAE takes the critic's values over the whole batch once per step before its
    updates (`phases.advantages`): the plan compiles that program as the trainer builds it
    (`build_programs`) and counts its FLOPs, a call per step."""
    _libtpu()
    import collections

    import jax

    from rl_jax.config import load_recipe
    from rl_jax.plan import _programs as pp
    from rl_jax.train import parts

    # A stand-in train step, and only the values pass counted layer by layer.
    monkeypatch.setattr(parts, "make_update", lambda *a, **k: jax.jit(lambda p, o, b: (p, o)))
    layer_costs = pp._layer_costs

    def values_costs(*args, **kw):
        return collections.defaultdict(lambda: None, layer_costs(*args, **kw, programs=("values",)))

    monkeypatch.setattr(pp, "_layer_costs", values_costs)
    plan = pp.plan_run(load_recipe("ppo", TINY), "v5e:2x2")
    progs = {p["name"]: p for p in plan["programs"]}
    # Two minibatch updates a batch: the old policy's log-probs too.
    assert set(progs) == {"train_step", "logprob", "values", "prefill_insert", "generate"}
    values = progs["values"]
    assert values["calls"] == 1 and values["fits"] and values["roofline_s"] > 0
    # The policy's forward over the batch's prompts and completions, with a scalar head
    # in place of the LM head.
    assert 0.5 < values["flops_ratio"] < 1.5, values
    # (The step's roofline sums every program's: test_plan_compiles_train_and_sampler_...;
    # here the stand-in train step has no count.)


def test_the_estimate_counts_the_engines_slots_and_pool():
    """The trainer's engine in every mode (pipeline's stream too): the estimate counts
    its slots and pool."""
    from rl_jax.config import load_recipe, resolved
    from rl_jax.models.load import resolve_spec
    from rl_jax.plan._estimate import estimate

    def cfg(*knobs):
        return resolved(load_recipe("scalerl", [*TINY, *knobs]))

    mesh, chip = {"data": 2, "fsdp": 2, "tensor": 1}, CHIPS["v5e"]

    def est(*knobs):
        c = cfg(*knobs)
        return estimate(resolve_spec(c.model), c, mesh, chip)

    kv_heads, head_dim = _tiny_attention()
    kv_row = 2 * 2 * kv_heads * head_dim * 4  # K and V, 2 layers, f32: per cache slot
    # on_policy: 4 x 2 rows over 4 batch shards, 16 + 16 cache slots; the engine's pool
    # holds 4 prompts (one per shard) of 16 tokens.
    engine = est(*ON_POLICY)
    assert engine["sampler_kv_bytes"] == kv_row * 2 * 32 + kv_row * 1 * 16
    # Half the slots: half the cache, twice the decode steps, each reading the weights.
    half = est(*ON_POLICY, "sampling.engine_slots=4")
    assert half["sampler_kv_bytes"] == kv_row * 1 * 32 + kv_row * 1 * 16
    assert half["step_s"] > engine["step_s"]
    # PipelineRL-8's stream: a slot for each row of its 9 untrained batches
    # (sampling.engine_slots=0), a pool of 9 x 4 prompts over the 4 shards.
    stream = est()
    assert stream["sampler_kv_bytes"] == 9 * kv_row * 2 * 32 + kv_row * 9 * 16
    # Fewer slots than rows in flight: a smaller cache, more steps of the slots.
    few = est("sampling.engine_slots=8")
    assert few["sampler_kv_bytes"] == kv_row * 2 * 32 + kv_row * 1 * 16
    assert few["step_s"] > stream["step_s"] and few["hbm_bytes"] < stream["hbm_bytes"]


def test_the_estimate_of_a_split_run_puts_each_side_on_its_chips():
    """Split mode (2 sampler chips beside a data=2 trainer): the sampler's chips hold the
    pushed view, the weights it runs and the stream's caches over their own 2 batch
    shards; the trainer's hold no stream state; the step is the slower side plus the
    push, at half a chip's bidirectional ICI bandwidth."""
    from rl_jax.config import load_recipe, resolved
    from rl_jax.models.load import resolve_spec
    from rl_jax.plan import _estimate as pe
    from rl_jax.plan._search import candidates

    cfg = resolved(load_recipe("scalerl", [*TINY, "mesh.data=2", "mesh.fsdp=1"]))
    spec, chip = resolve_spec(cfg.model), CHIPS["v5e"]
    mesh = {"data": 2, "fsdp": 1, "tensor": 1}
    split = pe.estimate(spec, cfg, mesh, chip, sampler=2)
    kv_heads, head_dim = _tiny_attention()
    kv_row = 2 * 2 * kv_heads * head_dim * 4
    # PipelineRL-8's 9 x 4 x 2 rows in flight and a pool of 9 x 4 prompts, over 2 shards.
    kv = kv_row * 36 * 32 + kv_row * 18 * 16
    weights = spec.num_params() * 4  # float32, whole on each sampler chip (tensor 1)
    parts = split["parts"]
    assert split["sampler_kv_bytes"] == kv and parts["in_flight"] == 0
    assert split["sampler_bytes"] == weights + weights + kv  # pushed view + weights + caches
    train = ("params", "optimizer", "gradients", "activations", "logits", "reference")
    assert split["train_bytes"] == pytest.approx(sum(parts[k] for k in train))
    tp = tg = 16
    decode = (weights + kv_row * 36 * 32) * (4 * 2 * tg / 72)
    train_s, sample_s, _ = pe._roofline(spec, cfg, chip, (2, 2), tp, tg, decode)
    push_s = weights / (chip.ici_bandwidth / 2)
    assert split["step_s"] == pytest.approx(max(train_s, sample_s) + push_s)
    # Colocated on the same 2 trainer chips: the stream's caches beside the update.
    together = pe.estimate(spec, cfg, mesh, chip)
    assert together["parts"]["in_flight"] > 0
    assert together["train_bytes"] > split["train_bytes"]
    # The search splits PipelineRL runs only, a quarter or a half of the chips the
    # sampler's where the rest split the minibatch (2 of 8 leave 6: 8 rows do not split).
    assert {c["sampler"] for c in candidates(cfg, 8, num_heads=4)} == {0, 4}
    on_policy = resolved(load_recipe("scalerl", [*TINY, *ON_POLICY]))
    assert {c["sampler"] for c in candidates(on_policy, 8, num_heads=4)} == {0}
    for c in candidates(cfg, 8, num_heads=4):
        m = c["mesh"]
        assert m["data"] * m["fsdp"] * m["tensor"] + c["sampler"] == 8


def test_estimate_keeps_what_each_remat_policy_saves_per_layer_and_one_layers_backward():
    """The estimate's activations per chip: each more layer adds what the remat policy
    keeps for the backward (full: the layer's input; save_dots: its input and weight
    matmuls' outputs; none: all its activations), and the backward of one layer holds,
    besides, its activations' gradients and, with remat, the activations it recomputes
    (twice what none keeps of a layer). The parts add up to the update's bytes."""
    from rl_jax.config import load_recipe, resolved
    from rl_jax.models.load import resolve_spec
    from rl_jax.plan._estimate import estimate

    mesh, chip = {"data": 2, "fsdp": 2, "tensor": 1}, CHIPS["v5e"]

    def est(layers, remat):
        c = resolved(
            load_recipe("scalerl", [*TINY, f"model.num_layers={layers}", f"model.remat={remat}"])
        )
        return estimate(resolve_spec(c.model), c, mesh, chip)

    D = resolve_spec(resolved(load_recipe("scalerl", TINY)).model).hidden_size
    tokens = 2 * 32  # per chip: 4 prompts x 2 samples over 4 batch shards, 16 + 16 tokens
    acts = {
        r: [est(L, r)["parts"]["activations"] for L in (1, 2, 3)]
        for r in ("none", "save_dots", "full")
    }
    kept = {r: a[1] - a[0] for r, a in acts.items()}
    assert all(a[2] - a[1] == pytest.approx(kept[r]) for r, a in acts.items())
    assert kept["full"] == pytest.approx(tokens * 4 * D)  # float32: one input per token
    assert kept["full"] < kept["save_dots"] < kept["none"]
    # One layer: none keeps its activations (kept["none"]) and holds their gradients.
    assert acts["none"][0] == pytest.approx(2 * kept["none"])
    assert acts["full"][0] == pytest.approx(kept["full"] + 2 * kept["none"])
    e = est(2, "full")
    train = sum(
        e["parts"][k]
        for k in (
            "params",
            "optimizer",
            "gradients",
            "activations",
            "logits",
            "in_flight",
            "reference",
        )
    )
    assert e["train_bytes"] == pytest.approx(train)
    assert e["hbm_bytes"] == max(e["train_bytes"], e["sampler_bytes"])


def test_a_layers_bytes_are_never_negative():
    """XLA's bytes accessed are not additive over programs fused differently: a 2-layer
    program may move fewer bytes than its 1-layer one (qwen3-8b's engine prefill on
    v5p-128: 4.97 against 5.49 GB per chip). The increment of a layer or loop iteration
    keeps its FLOPs and counts negative bytes as none, so extrapolating to 36 layers
    gives the 1-layer bytes, not -12.7 GB."""
    import numpy as np

    from rl_jax.plan._programs import _increment

    np.testing.assert_array_equal(
        _increment((3.632e11, 4.967e9), (1.575e10, 5.487e9)), [3.4745e11, 0]
    )
    np.testing.assert_array_equal(_increment((5.0, 7.0), (2.0, 3.0)), [3.0, 4.0])
    np.testing.assert_array_equal(_increment((1.0, 7.0), (2.0, 3.0)), [-1.0, 4.0])
