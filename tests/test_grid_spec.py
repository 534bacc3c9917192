"""Grid specs: expansion, stable run ids, budgets, constraints, and the errors that exit 2."""

import textwrap

import pytest

from rl_jax.cli import main as rl_jax_main
from rl_jax.config import ConfigError, apply_overrides, flatten, load_recipe, run_id
from rl_jax.grid import Axis, Budget, Constraint, GridSpec, expand, format_override, load_spec
from rl_jax.grid.spec import EarlyStop, ReportSpec, known_specs


def _spec(**kw):
    base = dict(
        name="t",
        recipe="scalerl",
        axes=(
            Axis.of("sampling.n", [2, 4, 8], short="n"),
            Axis.of("data.prompts_per_batch", [2, 4], short="bp"),
        ),
        budget=Budget(amount=64),
    )
    base.update(kw)
    return GridSpec(**base)


def test_product_budget_and_constraint():
    plans = expand(_spec(constraints=("B_p * n <= 16",)))
    got = {(p.config.sampling.n, p.config.data.prompts_per_batch): p.steps for p in plans}
    # n=8, B_p=4 is 32 > 16: dropped; M = 64 // (B_p * n).
    assert got == {(2, 2): 16, (2, 4): 8, (4, 2): 8, (4, 4): 4, (8, 2): 4}
    for p in plans:
        assert p.compute["rollouts"] == 64
        assert p.name == f"{p.group}_s0-{p.run_id}"


def test_run_ids_are_stable_and_match_the_trainer():
    a = expand(_spec(seeds=(0, 1)))
    b = expand(_spec(seeds=(0, 1)))
    assert [p.run_id for p in a] == [p.run_id for p in b]
    assert len({p.run_id for p in a}) == len(a) == 12
    # The trainer resolves `RECIPE overrides...`: it must land on the same config and id.
    for p in a[:3]:
        args = p.train_args("scalerl", out_dir="x")
        cfg = load_recipe(args[0], args[1:])
        assert run_id(cfg) == p.run_id
        assert cfg.train.seed == p.seed


def test_zipped_variants_vars_and_derived_cadence():
    spec = GridSpec(
        name="v",
        recipe="scalerl",
        axes=(
            Axis.variants(
                "split",
                {"easy": {"data.difficulty": 1}, "hard": {"data.difficulty": 3}},
                vars={"easy": {"B_max": 32}, "hard": {"B_max": 8}},
            ),
            Axis.zipped("nb", {"sampling.n": [2, 4], "data.prompts_per_batch": [4, 8]}),
        ),
        constraints=("B <= B_max",),
        budget=Budget(amount=320),
        evals_per_run=4,
        checkpoints_per_run=2,
    )
    plans = expand(spec)
    got = sorted((dict(p.labels)["split"], p.config.sampling.n) for p in plans)
    assert got == [("easy", 2), ("easy", 4), ("hard", 2)]
    easy2 = next(p for p in plans if p.group == "easy_2-4")
    assert easy2.steps == 40 and easy2.config.eval.every == 10
    assert easy2.config.checkpoint.every == 20


def test_flops_budget_uses_model_flops_per_token():
    pytest.importorskip("rl_jax.models.spec")
    from rl_jax.models.load import resolve_spec

    cfg = load_recipe("scalerl")
    from rl_jax.config import apply_overrides
    from rl_jax.train.accounting import step_flops

    ms = resolve_spec(cfg.model)
    # sampling.max_prompt_len=0 (auto): the grid assumes the former default cap, 64.
    P, tp, tg = cfg.data.prompts_per_batch, 64, cfg.sampling.max_new_tokens
    # The count a run makes of its own steps, on the lengths the grid expects.
    f = step_flops(ms, apply_overrides(cfg, ["sampling.n=2"]), [tp] * P, [tg] * (P * 2))
    per_step = f["sampler_flops"] + f["trainer_flops"]
    plans = expand(
        _spec(
            axes=(Axis.of("sampling.n", [2], short="n"),),
            budget=Budget(amount=per_step * 10.5, unit="flops"),
        )
    )
    assert plans[0].steps == 10  # B_p from the recipe, n = 2; floor(10.5)
    assert plans[0].step_compute["flops"] == pytest.approx(per_step, rel=1e-12)


@pytest.mark.parametrize(
    "value",
    [0.001, 1e-7, True, False, 3, "01", "it's: a </think> b", (1, 2), "x y"],
)
def test_format_override_round_trips(value):
    key = {
        float: "train.lr",
        bool: "model.fp32_lm_head",
        int: "train.steps",
        str: "sampling.interrupt_text",
        tuple: "sampling.stop_token_ids",
    }[type(value)]
    cfg = apply_overrides(load_recipe("scalerl"), [format_override(key, value)])
    got = flatten(cfg)[key]
    assert (list(got) if isinstance(value, tuple) else got) == (
        list(value) if isinstance(value, tuple) else value
    )


@pytest.mark.parametrize(
    "value", ["Okay.\n</think>", "a\r\nb", "a\n\n b ", "tab\there", "\x1b[0m", "a\u2028b"]
)
def test_format_override_keeps_line_breaks(value):
    """A string with a line break (a multi-line interrupt text or prompt template): the
    trainer parses the override back to the same text, so it runs the config (and run id)
    the grid planned; YAML's single quotes folded 'a\\nb' into 'a b'."""
    key = "sampling.interrupt_text"
    cfg = apply_overrides(load_recipe("scalerl"), [format_override(key, value)])
    assert flatten(cfg)[key] == value
    axes = (Axis.variants("t", {"multi": {key: value}}),)
    plan = expand(_spec(axes=axes, budget=Budget(amount=1280)))[0]
    args = plan.train_args("scalerl", out_dir="x")
    assert run_id(load_recipe(args[0], args[1:])) == plan.run_id


def test_constraint_evaluator_is_not_eval():
    c = Constraint("B_p * n <= 16 and not (n == 8) or M > 1000")
    assert c({"B_p": 2, "n": 4, "M": 1}) is True
    assert c({"B_p": 2, "n": 8, "M": 1}) is False
    with pytest.raises(ConfigError, match="not allowed"):
        Constraint("__import__('os').system('true')")({})


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"axes": (Axis.of("sampling.nn", [2]),)}, r"unknown config key 'sampling.nn'.*sampling.n"),
        ({"base": {"train.lrr": 0.1}}, r"unknown config key 'train.lrr'"),
        ({"constraints": ("B_p * n <= 1",)}, r"no run satisfies the constraints"),
        ({"budget": Budget(amount=5)}, r"budget 5 rollouts is smaller than one step"),
        ({"constraints": ("B_q <= 4",)}, r"unknown name\(s\) \['B_q'\]"),
        ({"axes": (Axis.of("train.steps", [5]),)}, r"'train.steps' is set by 'steps' and derived"),
        ({"axes": (Axis.of("loss.name", ["nope"]),)}, r"loss.name='nope' is not one of"),
    ],
)
def test_spec_errors(kw, match):
    with pytest.raises(ConfigError, match=match):
        expand(_spec(**kw))


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"constraints": ("B / (n - n) > 1",)}, r"run n2_bp2: constraint .*ZeroDivisionError"),
        ({"constraints": ("n > 'a'",)}, r"run n2_bp2: constraint .*TypeError"),
        (
            {
                "axes": (
                    Axis.variants("v", {"a": {}, "b": {"sampling.n": 4}}, vars={"a": {"x": 1}}),
                ),
                "constraints": ("x > 0",),
            },
            r"run b: constraint 'x > 0': 'x' has no value here",
        ),
    ],
)
def test_constraint_that_cannot_be_evaluated_is_a_config_error(kw, match):
    """A constraint that divides by zero, compares a number with a string or reads a var
    that its run's axis point lacks: a ConfigError naming the run and the constraint."""
    with pytest.raises(ConfigError, match=match):
        expand(_spec(**kw))


def test_dataclass_validation():
    with pytest.raises(ConfigError, match="budget unit 'gpu_hours'"):
        Budget(amount=1, unit="gpu_hours")
    with pytest.raises(ConfigError, match="repeats labels"):
        Axis.of("sampling.n", [2, 2])
    with pytest.raises(ConfigError, match="columns differ in length"):
        Axis.zipped("z", {"sampling.n": [1, 2], "train.lr": [0.1]})


@pytest.mark.parametrize("name", [".", "..", "a/b", ""])
def test_grid_name_that_is_not_one_directory_is_refused(name):
    """The grid's name is its directory under --out: '..' would put its runs and report
    beside --out."""
    with pytest.raises(ConfigError, match="grid name"):
        _spec(name=name)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: Budget(amount=10, prompt_tokens="a"), r"budget.prompt_tokens='a': expected float"),
        (lambda: Budget(amount=True), r"budget.amount=True: expected float, got bool"),
        (lambda: EarlyStop(threshold="0.1"), r"early_stop.threshold='0.1': expected float"),
        (lambda: EarlyStop(min_points=3.5), r"early_stop.min_points=3.5: expected int"),
        (lambda: ReportSpec(fit_fraction="0.5"), r"report.fit_fraction='0.5': expected float"),
        (lambda: ReportSpec(n_boot=20.5), r"report.n_boot=20.5: expected int"),
        (lambda: _spec(evals_per_run="3"), r"grid.evals_per_run='3': expected int"),
        (lambda: _spec(max_attempts=1.5), r"grid.max_attempts=1.5: expected int"),
        (lambda: _spec(warm_start="0.3"), r"grid.warm_start='0.3': expected float"),
    ],
)
def test_spec_field_of_the_wrong_type_names_it(make, match):
    """A spec field of the wrong type: a ConfigError naming the field, not a TypeError
    from comparing it ('<' between str and float) and not a fraction of a count taken."""
    with pytest.raises(ConfigError, match=match):
        make()


def test_names_too_long_for_a_file_name_are_refused():
    """Run names past a file name's length (long labels on two axes): refused at expansion,
    not an OSError (File name too long) when the driver opens the run's log mid-grid."""
    long = "x" * 130
    axes = (
        Axis.variants("a", {long + "a": {"train.lr": 1e-3}, long + "b": {"train.lr": 2e-3}}),
        Axis.of("sampling.n", [2, 4], short="n"),
    )
    assert len(expand(_spec(axes=axes))[0].name) < 240
    axes = (axes[0], Axis.variants("b", {long + "c": {"sampling.n": 2}}))
    with pytest.raises(ConfigError, match=r"run name 'x+'\.\.\. is 281 characters"):
        expand(_spec(axes=axes))
    with pytest.raises(ConfigError, match="is 241 characters; at most 240"):
        _spec(name="g" * 241)


@pytest.mark.parametrize(
    "kw", [{"constraints": "B <= 64"}, {"seed_keys": "train.seed"}, {"seeds": 3}, {"axes": None}]
)
def test_one_value_where_a_tuple_is_meant_is_named(kw):
    """constraints='B <= 64' made each character a constraint ("constraint ' ' is not an
    expression"), seed_keys='train.seed' each a seed key ("seed key 't'"), an Axis or an
    int a TypeError: now a ConfigError naming the field."""
    if "axes" in kw:
        kw = {"axes": Axis.of("sampling.n", [2, 4])}
    with pytest.raises(ConfigError, match=rf"{next(iter(kw))}=.* must be a tuple of them"):
        _spec(**kw)


def test_cli_spec_errors_exit_2(tmp_path, capsys):
    """Through the `rl-jax` entry point: a bad spec exits 2 with the message on stderr."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        textwrap.dedent(
            """
            from rl_jax.grid import Axis, Budget, GridSpec
            def grid():
                return GridSpec(name="bad", recipe="scalerl", budget=Budget(amount=1),
                                axes=(Axis.of("sampling.n", [4]),))
            """
        )
    )
    unknown_field = tmp_path / "unknown_field.py"
    unknown_field.write_text(
        "from rl_jax.grid import GridSpec\n"
        "def grid():\n    return GridSpec(name='u', recipe='scalerl', budgett=1)\n"
    )
    for argv, msg in [
        ([str(bad)], "smaller than one step"),
        ([str(unknown_field)], "unexpected keyword argument 'budgett'"),
        ([str(tmp_path / "missing.py")], "does not exist"),
        (["scalerl"], "defines no grid() function (it looks like a recipe"),
        ([str(bad), "--set", "sampling.n=2"], "fights grid 'bad' 'n'"),
        ([str(bad), "--set", "train.steps=2"], "fights grid 'bad' 'budget'"),
    ]:
        assert rl_jax_main(["grid", *argv, "--dry-run"]) == 2
        assert msg in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(known_specs()))
def test_shipped_specs_expand(name):
    spec = load_spec(name)
    plans = expand(spec)
    assert plans and len({p.run_id for p in plans}) == len(plans)
    if name.endswith("_cpu"):
        assert load_spec(name.removesuffix("_cpu")).axes, "each _cpu spec has a full version"
