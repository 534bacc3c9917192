"""Input paths as URLs (rl_jax.config.paths): data, split and model files read through
fsspec's memory file system as a TPU host reads them from gs://, the error for gs://
without gcsfs, and the TPU grid backend's command lines."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import fsspec
import numpy as np
import pytest

from rl_jax.cli import main
from rl_jax.config import DataConfig, ModelConfig, paths
from rl_jax.knobs import ConfigError

ROWS = [{"question": f"What is {i} + {i}?", "answer": f"... #### {2 * i}"} for i in range(12)]


def _jsonl(rows) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


@pytest.fixture
def mem(monkeypatch, tmp_path):
    """(memory file system, a URL prefix of this test's own) and an empty input cache."""
    fs = fsspec.filesystem("memory")
    root = f"/{tmp_path.name}"
    monkeypatch.setenv("RL_JAX_INPUT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(paths, "_STAGED", {})
    yield fs, f"memory://{tmp_path.name}"
    if fs.exists(root):
        fs.rm(root, recursive=True)


@pytest.fixture
def no_trainer(monkeypatch):
    import rl_jax.train.loop as loop

    def tripwire(*a, **k):
        raise AssertionError("bad input reached the trainer")

    monkeypatch.setattr(loop, "train", tripwire)


@pytest.fixture
def no_gcsfs(monkeypatch):
    """gs:// as on a machine without gcsfs, whether or not this one has it."""
    import importlib

    registry = importlib.import_module("fsspec.registry")  # the module, not fsspec.registry
    monkeypatch.setitem(sys.modules, "gcsfs", None)
    # In place: fsspec looks protocols up in `registry`, a read-only view of this dict,
    # which holds gcsfs's class once an earlier test in the process has used gs://.
    for proto in ("gs", "gcs"):
        monkeypatch.delitem(registry._registry, proto, raising=False)


def _train(capsys, tmp_path, *overrides) -> tuple[int, str]:
    argv = ["train", "grpo", *overrides, "--run-dir", str(tmp_path / "run"), "--quiet"]
    rc = main(argv)
    return rc, capsys.readouterr().err.strip()


def _refused(rc: int, err: str, *names: str) -> None:
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for n in names:
        assert n in err, err


# ---- the module ---------------------------------------------------------------------------


def test_local_paths_are_used_as_given(tmp_path, mem):
    f = tmp_path / "a.jsonl"
    f.write_bytes(_jsonl(ROWS[:2]))
    assert paths.stage(str(f), "data.path") == f
    assert paths.stage(f"file://{f}", "data.path") == f  # file:// is local too: no copy
    assert not (tmp_path / "cache").exists()
    assert (paths.kind(str(f), "k"), paths.kind(str(tmp_path), "k")) == ("file", "dir")
    assert paths.kind(str(tmp_path / "nope"), "k") is None
    assert not paths.is_url("C:/x") and not paths.is_url(f) and paths.is_url("gs://b/x")


def test_listing_reading_and_suffix(mem):
    fs, url = mem
    fs.pipe(f"{url}/d/a.jsonl", b"x")
    fs.pipe(f"{url}/d/sub/b.json", b"{}")
    assert paths.list_files(f"{url}/d", "k") == ["a.jsonl", "sub/b.json"]
    assert paths.read_text(f"{url}/d/sub/b.json", "k") == "{}"
    assert paths.kind(f"{url}/d", "k") == "dir" and paths.kind(f"{url}/nope", "k") is None
    assert paths.suffix(f"{url}/d/a.jsonl") == ".jsonl" and paths.suffix(f"{url}/d/") == ""


def test_gs_without_gcsfs_names_the_key_and_the_extra(no_gcsfs):
    with pytest.raises(ConfigError) as e:
        paths.kind("gs://bucket/data/train.jsonl", "data.path")
    msg = str(e.value)
    assert "data.path='gs://bucket/data/train.jsonl'" in msg
    assert "gcsfs" in msg and "pip install 'rl-jax[gcs]'" in msg
    with pytest.raises(ConfigError, match="Protocol not known"):
        paths.kind("nosuchproto://x", "data.path")


# ---- data files and split files ----------------------------------------------------------


def test_data_val_and_split_files_from_urls_match_local_ones(tmp_path, mem):
    from rl_jax.data import build_task
    from rl_jax.data.splits import write_splits

    fs, url = mem
    (tmp_path / "train.jsonl").write_bytes(_jsonl(ROWS[:9]))
    (tmp_path / "val.jsonl").write_bytes(_jsonl(ROWS[9:]))
    local = DataConfig(
        source="file", path=str(tmp_path / "train.jsonl"), val_path=str(tmp_path / "val.jsonl")
    )
    task = build_task(local)
    avg = {p.id: (0.5 if i % 2 else 0.0) for i, p in enumerate([*task.train, *task.val])}
    write_splits(tmp_path / "splits.json", avg, k=4)
    for name in ("train.jsonl", "val.jsonl", "splits.json"):
        fs.put_file(str(tmp_path / name), f"{url}/data/{name}")

    remote = DataConfig(
        source="file", path=f"{url}/data/train.jsonl", val_path=f"{url}/data/val.jsonl"
    )
    got = build_task(remote)
    assert [p.id for p in got.train] == [p.id for p in task.train]
    assert [p.prompt for p in got.val] == [p.prompt for p in task.val]

    split = dict(split_file=f"{url}/data/splits.json", split_name="easy")
    local_split = dict(split_file=str(tmp_path / "splits.json"), split_name="easy")
    easy = build_task(DataConfig(**{**remote.__dict__, **split}))
    easy_local = build_task(DataConfig(**{**local.__dict__, **local_split}))
    assert [p.id for p in easy.train] == [p.id for p in easy_local.train]
    assert 0 < len(easy.train) < len(task.train)
    assert easy.info["split_file"] == f"{url}/data/splits.json"  # the URL as given


def test_parquet_from_a_url(mem):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rl_jax.data._files import read_records

    fs, url = mem
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(ROWS[:3]), buf)
    fs.pipe(f"{url}/t.parquet", buf.getvalue())
    assert read_records(f"{url}/t.parquet") == ROWS[:3]


def test_hf_dataset_saved_to_a_url(mem):
    datasets = pytest.importorskip("datasets")
    from rl_jax.data import build_task

    _, url = mem
    rows = [{"question": r["question"], "answer": r["answer"]} for r in ROWS]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(f"{url}/gsm")
    task = build_task(DataConfig(source="hf", path=f"{url}/gsm", val_size=2))
    assert (len(task.train), len(task.val), task.reward_name) == (10, 2, "numeric")
    with pytest.raises(ConfigError, match=f"data.path='{url}/nope' does not exist"):
        build_task(DataConfig(source="hf", path=f"{url}/nope", val_size=2))


@pytest.mark.parametrize(
    "key, overrides",
    [
        ("data.path", ["data.source=file", "data.path={nope}"]),
        ("data.val_path", ["data.source=file", "data.path={train}", "data.val_path={nope}"]),
        ("data.split_file", ["data.split_file={nope}", "data.split_name=easy"]),
    ],
)
def test_missing_remote_data_file_exits_2(capsys, tmp_path, mem, no_trainer, key, overrides):
    fs, url = mem
    fs.pipe(f"{url}/train.jsonl", _jsonl(ROWS))
    where = dict(train=f"{url}/train.jsonl", nope=f"{url}/nope.json")
    rc, err = _train(capsys, tmp_path, *(o.format(**where) for o in overrides))
    _refused(rc, err, f"{key}='{url}/nope.json'")


@pytest.mark.parametrize(
    "overrides",
    [
        ["model.path=gs://bucket/models/tiny"],
        ["data.source=file", "data.path=gs://bucket/data/train.jsonl"],
        ["data.split_file=gs://bucket/data/splits.json", "data.split_name=easy"],
    ],
)
def test_gs_without_gcsfs_exits_2_before_the_trainer(
    capsys, tmp_path, no_gcsfs, no_trainer, overrides
):
    key, url = overrides[-1 if "data.source=file" in overrides else 0].split("=", 1)
    rc, err = _train(capsys, tmp_path, *overrides)
    _refused(rc, err, f"{key}='{url}'", "pip install 'rl-jax[gcs]'")


# ---- model directories ---------------------------------------------------------------------


@pytest.fixture
def tiny_model(tmp_path, mem):
    """A tiny HF directory on local disk and the same directory at a memory:// URL."""
    from rl_jax.data.tokenizer import CharTokenizer
    from rl_jax.models.hf import export_hf
    from rl_jax.models.load import load_model

    fs, url = mem
    local = tmp_path / "tiny_hf"
    export_hf(load_model(ModelConfig(preset="tiny")), local)
    CharTokenizer().save(local)
    fs.put(str(local), f"{url}/models/", recursive=True)
    assert fs.isfile(f"{url}/models/tiny_hf/model.safetensors")
    return local, f"{url}/models/tiny_hf"


def _cached_files(tmp_path) -> list[str]:
    cache = tmp_path / "cache"
    return sorted(p.name for p in cache.rglob("*") if p.is_file()) if cache.exists() else []


def test_model_spec_and_tokenizer_from_a_url_copy_no_weights(tmp_path, tiny_model):
    from rl_jax.models.load import resolve_spec
    from rl_jax.models.tokenizer import load_tokenizer

    local, url = tiny_model
    assert resolve_spec(ModelConfig(path=url)) == resolve_spec(ModelConfig(path=str(local)))
    text = "12+30=42"
    assert load_tokenizer(url).encode(text) == load_tokenizer(local).encode(text)
    files = _cached_files(tmp_path)
    assert "config.json" in files and "tokenizer.json" in files
    assert not any(f.endswith(".safetensors") for f in files), files


def test_model_weights_from_a_url_staged_once(tmp_path, tiny_model, monkeypatch):
    from rl_jax.models.load import load_model, local_model_path
    from rl_jax.models.transformer import host_params

    local, url = tiny_model
    want = host_params(load_model(str(local)))
    got = host_params(load_model(url))
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])
    staged = local_model_path(url)
    assert sorted(p.name for p in staged.iterdir()) == sorted(p.name for p in local.iterdir())
    assert local_model_path(url, weights=False) == staged  # the whole copy serves the spec
    assert not [p for p in staged.parent.parent.iterdir() if p.name.startswith(".staging")]

    # A new process (no memo) finds the copy on disk and downloads nothing.
    monkeypatch.setattr(paths, "_STAGED", {})
    fs = fsspec.filesystem("memory")
    monkeypatch.setattr(type(fs), "get_file", lambda *a, **k: pytest.fail("downloaded again"))
    assert local_model_path(url) == staged
    monkeypatch.undo()

    # A changed object is copied anew, beside the old copy.
    monkeypatch.setenv("RL_JAX_INPUT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(paths, "_STAGED", {})
    cfg = json.loads(fs.cat(f"{url}/config.json"))
    fs.pipe(f"{url}/config.json", json.dumps({**cfg, "rms_norm_eps": 1e-5}).encode())
    again = local_model_path(url)
    assert again != staged and json.loads((again / "config.json").read_text())["rms_norm_eps"]


def test_train_cli_reads_a_model_at_a_url(capsys, tmp_path, tiny_model, no_trainer):
    _, url = tiny_model
    with pytest.raises(AssertionError, match="reached the trainer"):
        _train(capsys, tmp_path, f"model.path={url}")


def test_missing_remote_model_exits_2(capsys, tmp_path, mem, no_trainer):
    _, url = mem
    rc, err = _train(capsys, tmp_path, f"model.path={url}/models/nope")
    _refused(rc, err, "model.path", f"{url}/models/nope", "does not exist")


# ---- the TPU grid backend ------------------------------------------------------------------

SPEC = """
from rl_jax.grid import Axis, Budget, GridSpec

def grid():
    return GridSpec(
        name="inputs",
        recipe={recipe!r},
        base={base!r},
        axes=(Axis.of("sampling.n", [2, 4], short="n"),),
        budget=Budget(amount=64),
    )
"""

# A recipe naming its model and data itself: nothing on the grid's command line says them.
RECIPE = """
import dataclasses

from rl_jax.config import load_recipe

def recipe():
    cfg = load_recipe("grpo")
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, path={model!r}),
        data=dataclasses.replace(cfg.data, source="file", path={data!r}),
    )
"""


def _tpu_plans(tmp_path, base: dict, *sets: str, recipe: str = "grpo"):
    from rl_jax.cli.grid import build_parser, make_backend
    from rl_jax.grid import load_spec
    from rl_jax.grid.expand import expand

    f = tmp_path / "inputs_grid.py"
    f.write_text(SPEC.format(base=base, recipe=recipe))
    args = build_parser().parse_args([str(f), "--backend", "tpu", "--tpu-zone", "z", "--dry-run"])
    spec = load_spec(str(f))
    backend = make_backend(args, spec)
    plans = expand(spec, extra=[*backend.extra_overrides(), *sets])
    return backend, plans


def _remote_args(backend, plan, tmp_path) -> list[str]:
    argv = backend.command(plan, recipe="grpo", grid_dir=tmp_path / "grids" / "inputs")
    return argv[argv.index("--") + 1 :]


def test_tpu_commands_carry_every_input_path(tmp_path, tiny_model):
    _, model_url = tiny_model
    want = {
        "model.path": model_url,
        "data.path": "gs://bucket/data/math/train.jsonl",
        "data.val_path": "/mnt/shared/val.jsonl",  # absolute: the same on every host
        "data.split_file": "gs://bucket/data/math/splits.json",
    }
    recipe = tmp_path / "remote_recipe.py"
    recipe.write_text(RECIPE.format(model=want["model.path"], data=want["data.path"]))
    base = {"data.val_path": want["data.val_path"]}
    split = f"data.split_file={want['data.split_file']}"
    backend, plans = _tpu_plans(tmp_path, base, split, "data.split_name=easy", recipe=str(recipe))
    backend.check(plans)
    for plan in plans:
        args = _remote_args(backend, plan, tmp_path)
        assert args[:3] == ["rl-jax", "train", "grpo"]
        for key, value in want.items():
            (said,) = [a for a in args if a.startswith(f"{key}=")]
            assert said.split("=", 1)[1].strip("'") == value
        assert args[-2] == f"name={plan.name}"


def test_tpu_backend_refuses_relative_input_paths(capsys, tmp_path):
    base = {"data.source": "file", "data.path": "data/math/train.jsonl"}
    backend, plans = _tpu_plans(tmp_path, base)
    with pytest.raises(ConfigError, match=r"data.path='data/math/train.jsonl' is a relative"):
        backend.check(plans)
    # The local backend reads it from this machine's disk as before.
    from rl_jax.grid.backends import LocalBackend

    LocalBackend().check(plans)
    # A hub dataset name is not a path.
    backend, plans = _tpu_plans(tmp_path, {"data.source": "hf", "data.path": "openai/gsm8k"})
    backend.check(plans)
    assert _remote_args(backend, plans[0], tmp_path).count("data.path='openai/gsm8k'") == 1


def test_isocompute_on_tpu_needs_the_split_file_as_a_url(capsys):
    base = ["grid", "isocompute", "--backend", "tpu", "--tpu-zone", "z", "--dry-run", "--json"]
    rc = main(base)
    _refused(rc, capsys.readouterr().err.strip(), "data.split_file='splits.json'", "gs://")
    from rl_jax.cli.grid import build_parser, make_backend
    from rl_jax.grid import load_spec
    from rl_jax.grid.expand import expand

    spec = load_spec("isocompute")
    backend = make_backend(build_parser().parse_args(base[1:]), spec)
    url = "gs://bucket/data/math/splits.json"
    plans = expand(spec, extra=[*backend.extra_overrides(), f"data.split_file={url}"])
    backend.check(plans)
    assert {p.config.data.split_name for p in plans} == {"easy", "hard"}
    args = backend.command(plans[0], recipe="isocompute", grid_dir=Path("grids/isocompute"))
    assert f"data.split_file={url}" in args  # as given to --set
