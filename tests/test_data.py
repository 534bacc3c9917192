"""Built-in tasks, local files, tfds round trip, tokenizer, pipelines, difficulty splits."""

import json

import numpy as np
import pytest

from rl_jax import rewards
from rl_jax.config import ConfigError, DataConfig, apply_overrides, load_recipe
from rl_jax.data import (
    CharTokenizer,
    PromptPipeline,
    arith_answer,
    build_task,
    estimate_avg_at_k,
    read_splits,
    shard_problems,
    write_splits,
)


def _small(**kw):
    return DataConfig(**{"train_size": 200, "val_size": 20, **kw})


# -- built-in tasks -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw",
    [
        dict(source="arith", task="add"),
        dict(source="arith", task="sub", difficulty=3),
        dict(source="arith", task="mul"),
        dict(source="arith", task="chain", num_terms=4),
        dict(source="arith", task="add", difficulty=12),  # rejection-sampled space
        dict(source="countdown", difficulty=3),
    ],
)
def test_builtin_tasks_deterministic_disjoint_and_verifiable(kw):
    a, b = build_task(_small(**kw)), build_task(_small(**kw))
    assert [p.id for p in a.train] == [p.id for p in b.train]
    assert [p.prompt for p in a.val] == [p.prompt for p in b.val]
    assert len(a.train) == 200 and len(a.val) == 20
    ids_t, ids_v = {p.id for p in a.train}, {p.id for p in a.val}
    assert len(ids_t) == 200 and len(ids_v) == 20 and not ids_t & ids_v
    assert not {p.prompt for p in a.train} & {p.prompt for p in a.val}
    # every canonical answer (countdown: the generator's own solution) earns full credit
    fn = rewards.get(a.reward_name, scale="01")
    comps = [p.meta.get("solution", p.answer) for p in a.train + a.val]
    assert rewards.score_batch(fn, comps, [p.answer for p in a.train + a.val]).min() == 1.0
    # another seed gives other problems
    c = build_task(_small(seed=1, **kw))
    assert {p.id for p in c.val} != ids_v


def test_validation_split_does_not_move_with_train_size():
    small = build_task(_small(train_size=50))
    big = build_task(_small(train_size=500))
    assert [p.id for p in small.val] == [p.id for p in big.val]


def test_arith_prompts_and_reversed_answers():
    assert arith_answer(46, reverse_digits=True) == "64"
    assert arith_answer(-22, reverse_digits=True) == "-22"
    assert arith_answer(-120, reverse_digits=True) == "-021"
    assert arith_answer(120, reverse_digits=False) == "120"
    for task, op in [("add", "+"), ("sub", "-"), ("mul", "*"), ("chain", "+")]:
        for reverse in (True, False):
            t = build_task(_small(task=task, reverse_digits=reverse))
            for p in t.train[:50]:
                terms = [int(x) for x in p.prompt.rstrip("=").split(op)]
                assert all(10 <= x < 100 for x in terms)  # difficulty 2: two-digit operands
                value = {"+": sum(terms), "-": terms[0] - terms[-1], "*": terms[0] * terms[-1]}
                assert p.answer == arith_answer(value[op], reverse_digits=reverse)
                assert p.prompt.endswith("=") and p.meta["value"] == value[op]


def test_too_small_problem_space_is_an_actionable_error():
    with pytest.raises(ConfigError, match="only 100 distinct problems"):
        build_task(DataConfig(difficulty=1, train_size=95, val_size=10))
    with pytest.raises(ConfigError, match="data.task"):
        DataConfig(source="arith", task="div")
    with pytest.raises(ConfigError, match="data.difficulty"):
        DataConfig(source="countdown", difficulty=1)
    with pytest.raises(ConfigError, match="split_name"):
        DataConfig(split_file="x.json")


def test_countdown_problems_use_difficulty_numbers():
    t = build_task(_small(source="countdown", difficulty=4))
    for p in t.train[:50]:
        nums, target = rewards.parse_countdown_answer(p.answer)
        assert len(nums) == 4 and str(target) in p.prompt
        assert rewards.evaluate_expression(p.meta["solution"]) == target


def test_recipe_data_overrides():
    cfg = apply_overrides(load_recipe("scalerl"), ["data.source=countdown", "data.difficulty=3"])
    assert cfg.data.source == "countdown"
    with pytest.raises(ConfigError, match="prompt_template"):
        apply_overrides(load_recipe("scalerl"), ["data.prompt_template=no placeholder"])


# -- tokenizer ------------------------------------------------------------------------------


def test_char_tokenizer_covers_builtin_tasks():
    tok = CharTokenizer()
    assert tok.vocab_size <= 64 and (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    problems = []
    for kw in (dict(task="add"), dict(task="mul"), dict(source="countdown", difficulty=4)):
        t = build_task(_small(**kw))
        problems += list(t.train) + list(t.val)
    for p in problems:
        for text in (p.prompt, p.answer, p.meta.get("solution", ""), "<answer>1</answer>;"):
            ids = tok.encode(text)
            assert tok.unk_id not in ids and all(i < tok.vocab_size for i in ids)
            assert tok.decode(ids) == text
    ids = tok.encode("12+3=", add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and tok.decode(ids) == "12+3="
    assert tok.decode([*tok.encode("64"), tok.eos_id, tok.pad_id]) == "64"
    assert tok.decode(tok.encode("Hi")) == "hi"  # capitals fold to lower case
    assert tok.decode([999, 5]) == "\ufffd1"  # an id beyond the vocab never crashes decode


# -- local files ----------------------------------------------------------------------------


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_gsm8k_math_polaris_files(tmp_path):
    gsm = [
        {"question": f"q{i}: 2+{i}?", "answer": f"2+{i}={2 + i}\n#### {2 + i:,}"} for i in range(40)
    ]
    gsm.append(dict(gsm[0]))  # an exact duplicate row is dropped
    path = _write_jsonl(tmp_path / "gsm8k.jsonl", gsm)
    tmpl = "Q: {question}\nPut the answer in \\boxed{}."
    t = build_task(DataConfig(source="file", path=path, val_size=10, prompt_template=tmpl))
    assert t.reward_name == "numeric" and len(t.train) == 30 and len(t.val) == 10
    assert not {p.id for p in t.train} & {p.id for p in t.val}
    p = t.train[0]
    assert p.prompt == tmpl.replace("{question}", p.meta["question"])
    fn = rewards.get("numeric", scale="01")
    assert all(fn(f"so \\boxed{{{q.answer}}}", q.answer) == 1.0 for q in t.train)
    again = build_task(DataConfig(source="file", path=path, val_size=10, prompt_template=tmpl))
    assert [q.id for q in again.val] == [q.id for q in t.val]
    # ids do not depend on the template
    plain = build_task(DataConfig(source="file", path=path, val_size=10))
    assert {q.id for q in plain.train} == {q.id for q in t.train}

    math_rows = [
        {"problem": "Simplify 2/4.", "solution": "It is $\\boxed{\\frac{1}{2}}$."},
        {"problem": "x?", "solution": "...", "answer": "3"},
        {"problem": "y?", "solution": "so \\boxed{\\{1, 2\\}} done"},
    ]
    mt = build_task(
        DataConfig(source="file", path=_write_jsonl(tmp_path / "m.jsonl", math_rows), val_size=1)
    )
    assert mt.reward_name == "math"
    assert sorted(p.answer for p in list(mt.train) + list(mt.val)) == [
        "3",
        "\\frac{1}{2}",
        "\\{1, 2\\}",
    ]

    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pol = [{"problem": f"p{i}", "answer": f"{i}/7", "difficulty": "3/8"} for i in range(12)]
    ppath = tmp_path / "polaris.parquet"
    pq.write_table(pa.Table.from_pylist(pol), ppath)
    val_path = _write_jsonl(tmp_path / "val.jsonl", pol[:3])
    pt = build_task(DataConfig(source="file", path=str(ppath), val_path=val_path))
    assert pt.reward_name == "math" and len(pt.val) == 3 and len(pt.train) == 9
    assert not {p.id for p in pt.train} & {p.id for p in pt.val}


def test_file_errors_are_actionable(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        build_task(DataConfig(source="file", path=str(tmp_path / "nope.jsonl")))
    bad = _write_jsonl(tmp_path / "bad.jsonl", [{"text": "hello"}])
    with pytest.raises(ConfigError, match="data.format"):
        build_task(DataConfig(source="file", path=bad))
    nobox = _write_jsonl(tmp_path / "nobox.jsonl", [{"problem": "a", "solution": "no box"}] * 2)
    with pytest.raises(ConfigError, match="row 0"):
        build_task(DataConfig(source="file", path=nobox, format="math"))


# -- tfds -----------------------------------------------------------------------------------


def test_tfds_builder_round_trips_a_file_into_grain(tmp_path):
    pytest.importorskip("tensorflow_datasets")
    pytest.importorskip("array_record")
    from rl_jax.data import prepare_tfds

    rows = [{"question": f"what is {i}+{i}?", "answer": f"#### {2 * i}"} for i in range(30)]
    src = DataConfig(
        source="file", path=_write_jsonl(tmp_path / "g.jsonl", rows), val_size=6, seed=3
    )
    ref = build_task(src)
    name = prepare_tfds(src, tmp_path / "tfds")
    assert prepare_tfds(src, tmp_path / "tfds") == name  # idempotent
    cfg = DataConfig(
        source="tfds", task=name, path=str(tmp_path / "tfds"), prompt_template="> {question}"
    )
    got = build_task(cfg)
    assert got.reward_name == ref.reward_name == "numeric"
    by_id = {p.id: p for p in ref.train}
    assert sorted(by_id) == sorted(p.id for p in got.train)
    assert {p.id for p in ref.val} == {p.id for p in got.val}
    for p in got.train:
        assert p.answer == by_id[p.id].answer and p.prompt == "> " + by_id[p.id].meta["question"]
    # grain reads the ArrayRecord source lazily; every problem once per epoch
    pipe = PromptPipeline(got.train, batch_size=4, seed=0, process_index=0, process_count=1)
    seen = [p.id for _ in range(pipe.batches_per_epoch) for p in next(pipe)]
    assert len(seen) == len(set(seen)) == 24
    # a built-in task round-trips too
    arith = _small(train_size=30, val_size=5)
    name = prepare_tfds(arith, tmp_path / "tfds")
    got = build_task(DataConfig(source="tfds", task=name, path=str(tmp_path / "tfds")))
    ref = build_task(arith)
    assert got.reward_name == "arith"
    assert sorted((p.id, p.prompt, p.answer) for p in got.train) == sorted(
        (p.id, p.prompt, p.answer) for p in ref.train
    )


def test_reasoning_gym_source():
    pytest.importorskip("reasoning_gym")
    cfg = DataConfig(source="reasoning_gym", task="basic_arithmetic", train_size=30, val_size=5)
    t = build_task(cfg)
    assert t.reward_name == "gym" and len(t.train) == 30 and len(t.val) == 5
    assert not {p.id for p in t.train} & {p.id for p in t.val}
    assert [p.id for p in build_task(cfg).train] == [p.id for p in t.train]
    # the answer string carries what the gym scorer needs (in-process here; the sandboxed
    # path is exercised by tests/test_rewards_hostile.py)
    from rl_jax.rewards._gym import gym_score

    entry = json.loads(t.val[0].answer)["entry"]
    assert gym_score(entry["answer"], t.val[0].answer) == 1.0
    assert gym_score(entry["answer"] + "0", t.val[0].answer) < 1.0
    with pytest.raises(ConfigError, match="reasoning-gym dataset"):
        build_task(DataConfig(source="reasoning_gym", task="no_such_gym_task"))


# -- pipeline -------------------------------------------------------------------------------


def _stream(pipe, n):
    return [[p.id for p in next(pipe)] for _ in range(n)]


def test_pipeline_deterministic_reshuffled_per_epoch_and_complete():
    train = build_task(_small(train_size=50)).train
    mk = lambda seed: PromptPipeline(
        train, batch_size=8, seed=seed, process_index=0, process_count=1
    )
    a, b = mk(0), mk(0)
    assert a.batches_per_epoch == 6  # 50 // 8, the remainder is dropped
    sa = _stream(a, 18)
    assert sa == _stream(b, 18)  # same seed, same batches, across epochs
    epochs = [sum(sa[i : i + 6], []) for i in (0, 6, 12)]
    for e in epochs:
        assert len(e) == len(set(e)) == 48  # no problem twice within an epoch
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]  # reshuffled per epoch
    assert _stream(mk(1), 6) != sa[:6]


def test_pipeline_multi_process_parts_union_to_global_batch():
    train = build_task(_small(train_size=64)).train
    whole = _stream(
        PromptPipeline(train, batch_size=8, seed=5, process_index=0, process_count=1), 20
    )
    parts = [
        _stream(PromptPipeline(train, batch_size=8, seed=5, process_index=i, process_count=4), 20)
        for i in range(4)
    ]
    for step in range(20):
        assert sum((parts[i][step] for i in range(4)), []) == whole[step]
        assert all(len(parts[i][step]) == 2 for i in range(4))
    with pytest.raises(ValueError, match="multiple of process_count"):
        PromptPipeline(train, batch_size=6, seed=0, process_index=0, process_count=4)
    # validation is shared round-robin
    shards = [shard_problems(train, process_index=i, process_count=3) for i in range(3)]
    assert sorted(p.id for s in shards for p in s) == sorted(p.id for p in train)


@pytest.mark.parametrize("stop_after", [3, 6, 7, 13])  # mid-epoch and at epoch boundaries
def test_pipeline_resume_is_exact(stop_after):
    train = build_task(_small(train_size=30)).train
    mk = lambda: PromptPipeline(train, batch_size=5, seed=2, process_index=0, process_count=1)
    ref = _stream(mk(), 20)
    first = mk()
    head = _stream(first, stop_after)
    state = json.loads(json.dumps(first.get_state()))
    resumed = mk()
    resumed.set_state(state)
    assert head + _stream(resumed, 20 - stop_after) == ref
    wrong_seed = PromptPipeline(train, batch_size=5, seed=3, process_index=0, process_count=1)
    with pytest.raises(ValueError, match="seed"):
        wrong_seed.set_state(state)


# -- difficulty splits ----------------------------------------------------------------------


def test_difficulty_splits_with_a_fake_policy(tmp_path):
    cfg = _small(train_size=100)
    task = build_task(cfg)
    problems = list(task.train) + list(task.val)

    def policy(batch, k):  # pass count = id mod (k + 1): every avg@k level appears
        return np.array([[1.0 if j < p.id % (k + 1) else -1.0 for j in range(k)] for p in batch])

    avg = estimate_avg_at_k(problems, policy, k=16, batch_size=7)
    assert avg == {p.id: (p.id % 17) / 16 for p in problems}
    path = tmp_path / "splits.json"
    content = write_splits(path, avg, k=16, info={"policy": "fake"})
    splits = read_splits(path)["splits"]
    assert splits == content["splits"]
    assert set(splits["hard"]) == {i for i, v in avg.items() if v <= 0.0625}
    assert set(splits["easy"]) == {i for i, v in avg.items() if 0.3 <= v <= 0.6}
    bands = ["hard", "medium", "easy", "trivial"]
    assert sorted(sum((splits[b] for b in bands), [])) == sorted(avg)  # a partition
    easy = build_task(DataConfig(**{**cfg.__dict__, "split_file": str(path), "split_name": "easy"}))
    assert {p.id for p in easy.train} == set(splits["easy"]) & {p.id for p in task.train}
    assert {p.id for p in easy.val} == set(splits["easy"]) & {p.id for p in task.val}
    with pytest.raises(ConfigError, match="splits there"):
        build_task(DataConfig(**{**cfg.__dict__, "split_file": str(path), "split_name": "nope"}))
    with pytest.raises(ValueError, match="shape"):
        estimate_avg_at_k(problems, lambda b, k: np.zeros((len(b), k + 1)), k=4)
