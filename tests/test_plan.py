"""`rl-jax plan`: a run's programs compiled for a TPU topology from this CPU host (libtpu)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rl_jax.knobs import ConfigError
from rl_jax.plan.chips import CHIPS, parse_topology

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "model.preset=tiny",
    "model.num_layers=2",
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
    for bad in ("v9:2x2", "v5e", "v5e:2xq", "v5e:0x2"):
        with pytest.raises(ConfigError, match="--topology"):
            parse_topology(bad)


def test_train_step_compiles_for_v5e_and_reports_per_chip_costs(tmp_path):
    _libtpu()
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "rl_jax.cli",
            "plan",
            "scalerl",
            *TINY,
            "--topology",
            "v5e:2x2",
            "--json",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    plan = json.loads(r.stdout.strip().splitlines()[-1])
    assert plan == json.loads((tmp_path / "plan.json").read_text())
    assert plan["chips"] == 4 and plan["chip"] == "v5e"
    assert plan["mesh"] == {"data": 2, "fsdp": 2, "tensor": 1}
    (step,) = [p for p in plan["programs"] if p["name"] == "train_step"]
    assert step["fits"] and 0 < step["hbm_total_gb"] < 1
    # XLA's count of the compiled program against the model's: the tiny model's step has
    # no remat, so the compiled FLOPs are the model's and little else.
    assert 0.9 < step["flops_ratio"] < 1.5, step
    assert step["roofline_s"] > 0 and 0 < step["mfu_estimate"] <= 1


def test_bad_topology_exits_2_before_compiling():
    r = subprocess.run(
        [sys.executable, "-m", "rl_jax.cli", "plan", "scalerl", "--topology", "v9:2x2"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert r.returncode == 2 and "v9:2x2" in r.stderr and len(r.stderr.strip().splitlines()) == 1
