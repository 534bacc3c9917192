"""Task mixtures (data.mixture): the knob, the problems, the batches' proportions, exact
resume, the verifier each answer names, per-task validation metrics, and a run that
writes per-task curves and resumes exactly."""

import json
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from rl_jax import rewards
from rl_jax.config import DataConfig, RunConfig, apply_overrides, load_recipe, resolved, run_id
from rl_jax.data import Curriculum, PromptPipeline, build_task
from rl_jax.knobs import ConfigError
from rl_jax.rewards import TaskAnswer
from rl_jax.train.evaluation import pass_metrics

MAPPING = "{arith: {weight: 3, difficulty: 1}, cd: {source: countdown, weight: 1}}"


# ---- the knob -----------------------------------------------------------------------------


def test_spellings_parse_to_tasks():
    short = DataConfig(mixture="arith:3, countdown:1").mixture_tasks()
    assert [(t.name, t.weight) for t in short] == [("arith", 0.75), ("countdown", 0.25)]
    tasks = DataConfig(mixture=MAPPING, seed=5).mixture_tasks()
    assert [t.name for t in tasks] == ["arith", "cd"]
    arith = tasks[0].data(DataConfig(mixture=MAPPING, seed=5))
    assert (arith.source, arith.difficulty, arith.seed) == ("arith", 1, 5)  # seed inherited
    listed = '[{"name": "a", "source": "arith"}, {"name": "c", "source": "code", "reward": "code"}]'
    assert [t.reward for t in DataConfig(mixture=listed).mixture_tasks()] == ["", "code"]


@pytest.mark.parametrize(
    "value, why",
    [
        ("arith:0", "weight=0.0 must be > 0"),
        ("{x: {weight: 1}}", "task 'x' names no source"),
        ("{arith: {prompts_per_batch: 3}}", "'prompts_per_batch' is the mixture's"),
        ("{arith: {bogus: 1}}", "'bogus' is not a data knob"),
        ("{arith: {difficulty: two}}", "difficulty='two': expected int"),
        ("{arith: {difficulty: 30}}", "data.difficulty=30 must be in"),
        ("{arith: {reward: nope}}", "reward='nope' is not one of"),
        ("{arith: {reward: mixture}}", "reward='mixture' is not one of"),
        ("arith,arith", "names task 'arith' twice"),
        ("{'1st': {source: arith}}", "task name '1st'"),
        ("[1, 2]", "must be 'name:weight,...'"),
    ],
)
def test_bad_mixtures_are_named(value, why):
    with pytest.raises(ConfigError, match=why.replace("[", r"\[")):
        DataConfig(mixture=value)


@pytest.mark.parametrize("value", ["arith:0.5.5", "arith:e", "arith:.", "code:1,arith:-"])
def test_short_spelling_weight_that_is_no_number_is_named(value):
    """A weight of the characters the short spelling admits that makes no number: a
    ConfigError naming the task, not float()'s ValueError traceback."""
    weight = value.rsplit(":", 1)[1]
    with pytest.raises(ConfigError, match=f"task 'arith': weight '{weight}' is not a number"):
        DataConfig(mixture=value)


@pytest.mark.parametrize("value", ["arith:1e400,code:1", "{a: {source: arith, weight: .inf}}"])
def test_infinite_weight_is_refused(value):
    """An infinite weight (1e400 reads as inf) normalized to nan: refused, naming it."""
    with pytest.raises(ConfigError, match=r"weight=inf must be > 0 and finite"):
        DataConfig(mixture=value)


def test_weights_near_the_float_limit_normalize():
    """Two weights of 1e308 sum to inf: each normalized to 0.0 before; 0.5 each now."""
    tasks = DataConfig(mixture="arith:1e308,code:1e308").mixture_tasks()
    assert [t.weight for t in tasks] == [0.5, 0.5]


def test_a_tasks_knob_at_the_top_goes_back_to_its_default_when_a_mixture_is_set(capsys):
    cfg = RunConfig(data=DataConfig(source="countdown", difficulty=4))
    mixed = apply_overrides(cfg, ["data.mixture=arith:1,code:1"])
    assert mixed.data.source == "arith" and mixed.data.difficulty == 2
    assert "note: data.source takes its default" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="data.source='countdown' is a task's knob"):
        apply_overrides(RunConfig(), ["data.mixture=arith:1", "data.source=countdown"])
    # and the other way: a source set on a mixture's recipe drops the mixture
    one = apply_overrides(load_recipe("code_mix_cpu"), ["data.source=countdown"])
    assert (one.data.mixture, one.data.source) == ("", "countdown")
    assert "note: data.mixture takes its default" in capsys.readouterr().err


def test_run_ids_one_per_mixture_and_unchanged_without():
    base = load_recipe("scalerl", ["checkpoint.every=0"])
    assert run_id(base) == "v26ce9d608e9fa"  # as tests/test_loss_defaults.py pins it
    assert run_id(apply_overrides(base, ["data.mixture="])) == run_id(base)
    a = apply_overrides(base, ["data.mixture=arith:1,code:1"])
    b = apply_overrides(base, ["data.mixture={arith: {weight: 2}, code: {weight: 2.0}}"])
    c = apply_overrides(base, ["data.mixture=arith:1,code:2"])
    assert run_id(a) == run_id(b) != run_id(c) != run_id(base)
    assert resolved(a).data.mixture == DataConfig(mixture="arith:1,code:1").canonical_mixture()
    assert json.loads(resolved(a).data.mixture)[1] == {
        "name": "code",
        "source": "code",
        "weight": 0.5,
    }
    # a mixture's verifier is not the top-level source's (arith by default)
    assert resolved(a).rewards.name == "auto"


# ---- problems and batches -------------------------------------------------------------------


@pytest.fixture(scope="module")
def task():
    return build_task(DataConfig(mixture=MAPPING, train_size=60, val_size=6))


def test_problems_carry_their_task_and_verifier(task):
    assert task.reward_name == "mixture"
    assert Counter(p.meta["mix_task"] for p in task.train) == {"arith": 60, "cd": 60}
    # validation interleaves the tasks, so any prefix holds both
    assert [p.meta["mix_task"] for p in task.val[:4]] == ["arith", "cd", "arith", "cd"]
    verifiers = {p.meta["mix_task"]: p.answer.verifier for p in task.val}
    assert verifiers == {"arith": "arith", "cd": "countdown"}
    single = build_task(DataConfig(mixture="arith:1,countdown:1", train_size=32, val_size=4))
    assert single.reward_name == "mixture"
    same = build_task(
        DataConfig(mixture="{a: {source: arith}, b: {source: arith, seed: 1}}", train_size=8)
    )
    assert same.reward_name == "arith"  # one verifier for all: that one


def _pipe(problems, *, curriculum=None, index=0, count=1, batch=8):
    return PromptPipeline(
        problems,
        batch_size=batch,
        seed=3,
        curriculum=curriculum,
        process_index=index,
        process_count=count,
    )


def test_batches_hold_the_stated_proportions(task):
    pipe = _pipe(task.train)
    seen = Counter()
    for n in range(1, 41):
        seen.update(p.meta["mix_task"] for p in next(pipe))
        # after n batches every task is within one slot of its share
        assert abs(seen["arith"] - 0.75 * 8 * n) <= 1 and sum(seen.values()) == 8 * n
    # and over many epochs of the small task every problem comes back
    assert len({p.id for p in task.train if p.meta["mix_task"] == "cd"}) == 60


def test_mixture_resumes_exactly_with_retirements(task):
    cfg = DataConfig(mixture=MAPPING, npr_threshold=0.5)
    cur = Curriculum(cfg)
    pipe = _pipe(task.train, curriculum=cur)
    for _ in range(12):
        batch = next(pipe)
        solved = [[float(p.id % 2)] * 2 for p in batch]  # half the problems retire
        cur.update([p.id for p in batch], np.asarray(solved))
    state = json.loads(json.dumps(pipe.get_state()))
    cur_state = json.loads(json.dumps(cur.state_dict()))
    ahead = [[p.id for p in next(pipe)] for _ in range(6)]
    cur2 = Curriculum(cfg)
    cur2.load_state_dict(cur_state)
    again = _pipe(task.train, curriculum=cur2)
    again.set_state(state)
    assert [[p.id for p in next(again)] for _ in range(6)] == ahead
    single = _pipe([p for p in build_task(DataConfig(train_size=16)).train])
    with pytest.raises(ValueError, match="with a task mixture"):
        single.set_state(state)
    other = _pipe(build_task(DataConfig(mixture="arith:1,countdown:3", train_size=60)).train)
    with pytest.raises(ValueError, match="restore with the same"):
        other.set_state(state)


def test_processes_split_the_global_batch(task):
    whole = [p.id for p in next(_pipe(task.train))]
    parts = [p.id for i in range(2) for p in next(_pipe(task.train, index=i, count=2))]
    assert parts == whole


# ---- the verifier each answer names ---------------------------------------------------------


def test_mixture_verifier_routes_each_answer(caplog):
    fn = rewards.get("mixture", scale="pm1")
    answers = [TaskAnswer("64", "arith"), TaskAnswer("3,7,25=46", "countdown"), "64"]
    out = fn.batch(["64", "25+3*7", "64"], answers)
    assert out.tolist() == [1.0, 1.0, -1.0]  # a plain answer names no verifier: no credit
    assert "names no verifier" in caplog.text
    assert sorted(fn.verifiers) == ["arith", "countdown"]
    # TaskAnswer is its text everywhere else (templates, samples, warm-up targets)
    a = TaskAnswer("64", "arith")
    assert a == "64" and json.dumps(a) == '"64"' and a.verifier == "arith"
    import pickle

    assert pickle.loads(pickle.dumps(a)).verifier == "arith"


def test_the_mixture_verifier_needs_a_mixture():
    with pytest.raises(ConfigError, match="rewards.name='mixture' .* needs data.mixture"):
        apply_overrides(RunConfig(), ["rewards.name=mixture"])
    cfg = apply_overrides(RunConfig(), ["rewards.name=mixture", "data.mixture=arith:1,code:1"])
    assert cfg.rewards.name == "mixture"
    # a command that drops the mixture puts the config's rewards.name=mixture back to auto
    assert apply_overrides(cfg, ["data.mixture="]).rewards.name == "auto"


def test_a_tasks_verifier_is_checked_before_the_run(monkeypatch, tmp_path):
    from rl_jax.rewards import _gym
    from rl_jax.train.preflight import check_run_inputs

    # The mixture verifier builds a task's verifier at its first answer: one whose extra is
    # not installed is refused before the run, not raised from the training loop.
    monkeypatch.setattr(_gym, "available", lambda: False)
    mix = "{a: {source: arith}, g: {source: arith, reward: gym}}"
    for name in ("auto", "mixture"):
        over = [f"data.mixture={mix}", f"rewards.name={name}", f"out_dir={tmp_path}"]
        with pytest.raises(ConfigError, match="data.mixture task 'g': reward 'gym' needs"):
            check_run_inputs(load_recipe("code_mix_cpu", over))


def test_per_task_metrics():
    c = np.array([[1, 0], [1, 1], [0, 0], [0, 1]])
    m = pass_metrics(c, task_p=["math", "code", "math", "code"])
    assert m["val/pass@1"] == 0.5
    assert (m["val/math/pass@1"], m["val/code/pass@1"]) == (0.25, 0.75)
    assert (m["val/math/best@k"], m["val/code/worst@k"]) == (0.5, 0.5)
    assert not any("/" in k[4:] for k in pass_metrics(c))  # one source: no task keys


# ---- a run ------------------------------------------------------------------------------------

sys.path.insert(0, str(Path(__file__).parent / "_workers"))
import train_even_first  # noqa: E402

MIX_RUN = [
    *train_even_first.TINY_RUN,
    "data.mixture={arith: {weight: 1}, cd: {source: countdown, weight: 1}}",
    "eval.every=2",
    "checkpoint.async_save=false",
    "train.steps=4",
    "checkpoint.every=2",
]


def _run(tmp_path, name, crash_at=None):
    from rl_jax.train.loop import RLTrainer

    tr = RLTrainer(load_recipe("scalerl", [*MIX_RUN, f"out_dir={tmp_path}", f"name={name}"]))
    if crash_at is not None:

        class Crash(Exception):
            pass

        def hook(t):
            if t.step == crash_at:
                raise Crash

        tr.step_hooks.append(hook)
        with pytest.raises(Crash):
            tr.run_loop()
    else:
        tr.run_loop()
    return tr


def _curve(run_dir: Path) -> list[dict]:
    from rl_jax.runs import read_jsonl

    return [
        {
            k: v
            for k, v in r.items()
            if "seconds" not in k and not k.startswith("time/") and k not in ("name", "out_dir")
        }
        for r in read_jsonl(run_dir / "curve.jsonl")
    ]


def test_a_mixture_run_writes_per_task_curves_and_resumes_exactly(tmp_path):
    _run(tmp_path, "ref")
    ref = _curve(tmp_path / "ref")
    assert [r["step"] for r in ref] == [0, 2, 4]
    for r in ref:
        assert {"val/arith/pass@1", "val/cd/pass@1", "val/pass@1"} <= set(r)
        assert r["val/pass@1"] == pytest.approx((r["val/arith/pass@1"] + r["val/cd/pass@1"]) / 2)
    _run(tmp_path, "crash", crash_at=3)
    _run(tmp_path, "crash")
    assert _curve(tmp_path / "crash") == ref


def test_tpu_recipe_reads_its_tasks_files_from_the_bucket(monkeypatch):
    monkeypatch.setenv("RL_JAX_DATA", "gs://b/data/")
    cfg = load_recipe("code_mix_tpu")
    tasks = {t.name: (t.weight, dict(t.settings)["path"]) for t in cfg.data.mixture_tasks()}
    assert tasks == {
        "math": (0.5, "gs://b/data/math/train.jsonl"),
        "code": (0.5, "gs://b/data/code/train.jsonl"),
    }
