"""The grid driver end to end with a fake trainer: local pool, SIGKILL + rerun, retries, Ray."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rl_jax.cli.grid import main as grid_main
from rl_jax.grid import load_spec
from rl_jax.grid._guard import BUSY
from rl_jax.grid._guard import main as guard_main
from rl_jax.grid.state import GridState
from rl_jax.knobs import ConfigError
from rl_jax.runs import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
FAKE = f"{sys.executable} {ROOT / 'tests' / '_workers' / 'fake_train.py'}"

SPEC = """
from rl_jax.grid import Axis, Budget, GridSpec, ReportSpec

def grid():
    return GridSpec(
        name="tiny",
        recipe="scalerl",
        axes=(
            Axis.of("sampling.n", [2, 4], short="n"),
            Axis.of("data.prompts_per_batch", [2, 4], short="bp"),
        ),
        constraints=("B <= 16",),
        budget=Budget(amount=256),
        evals_per_run=8,
        checkpoints_per_run=4,
        max_attempts={max_attempts},
        report=ReportSpec(kind="{kind}", x="rollouts", n_boot=40),
        early_stop={early_stop},
    )
"""


def write_spec(tmp_path: Path, *, max_attempts=3, kind="isocompute", early_stop=None) -> Path:
    p = tmp_path / "tiny_grid.py"
    text = SPEC.format(max_attempts=max_attempts, kind=kind, early_stop=early_stop)
    p.write_text("from rl_jax.grid import EarlyStop\n" + textwrap.dedent(text))
    return p


def curves(out: Path) -> dict[str, list[dict]]:
    """Curve rows per run, less out_dir (the one knob that differs between test dirs)."""
    runs = sorted((out / "tiny" / "runs").iterdir())
    return {
        d.name: [
            {k: v for k, v in r.items() if k != "out_dir"} for r in read_jsonl(d / "curve.jsonl")
        ]
        for d in runs
    }


def ledger_counts(path: Path) -> dict[str, dict[str, int]]:
    counts: dict[str, dict[str, int]] = {}
    for line in path.read_text().splitlines():
        rid, what = line.split()[:2]
        c = counts.setdefault(rid, {"start": 0, "done": 0})
        c[what] += 1
    return counts


def run_grid(spec: Path, out: Path, *extra: str) -> int:
    return grid_main([str(spec), "--out", str(out), "--train-cmd", FAKE, "--poll", "0.05", *extra])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The tiny grid run once, uninterrupted: the curves every other test must reproduce."""
    base = tmp_path_factory.mktemp("reference")
    spec = write_spec(base)
    assert run_grid(spec, base / "out", "--jobs", "2", "--no-report") == 0
    return curves(base / "out")


def test_local_grid_end_to_end_with_report(tmp_path, monkeypatch, capsys, reference):
    monkeypatch.setenv("FAKE_LEDGER", str(tmp_path / "ledger"))
    spec = write_spec(tmp_path)
    out = tmp_path / "out"
    assert run_grid(spec, out, "--jobs", "2") == 0
    # The trainer resolved every run to the grid's run id (no mismatch warning).
    assert "WARNING" not in capsys.readouterr().out
    got = curves(out)
    assert got == reference and len(got) == 4
    for rows in got.values():
        assert [r["step"] for r in rows] == sorted({r["step"] for r in rows})
        assert rows[-1]["rollouts"] == 256
    counts = ledger_counts(tmp_path / "ledger")
    assert all(c == {"start": 1, "done": 1} for c in counts.values()) and len(counts) == 4
    report = (out / "tiny" / "report.md").read_text()
    assert "# Grid tiny" in report and "### Iso-compute frontier" in report
    for name in got:
        assert f"| {name} | done |" in report
    plots = out / "tiny" / "fits" / "all" / "plots"
    for png in ("frontier_heatmap.png", "n_star.png", "curves.png"):
        assert (plots / png).stat().st_size > 0 and f"(fits/all/plots/{png})" in report
    assert "Fitted n*(C)" in report or "n*(C): no fit" in report
    # A rerun finds everything finished: nothing starts.
    assert run_grid(spec, out, "--no-report") == 0
    assert ledger_counts(tmp_path / "ledger") == counts


def test_sigkill_driver_mid_grid_then_rerun(tmp_path, reference):
    """Kill -9 the driver while runs are going: they finish on their own (own session), the
    rerun adopts what is still running, starts the rest, and no run starts twice.

    No run may finish before the test releases it (FAKE_HOLD), so the orphans are still
    running when the rerun looks, however slow or busy the machine is."""
    spec = write_spec(tmp_path)
    out = tmp_path / "out"
    release = tmp_path / "release"
    env = {
        **os.environ,
        "FAKE_LEDGER": str(tmp_path / "ledger"),
        "FAKE_HOLD": str(release),
        "PYTHONUNBUFFERED": "1",
    }
    cmd = [sys.executable, "-m", "rl_jax.cli", "grid", str(spec), "--out", str(out)]
    cmd += ["--train-cmd", FAKE, "--jobs", "2", "--poll", "0.05", "--no-report"]
    driver = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, text=True)
    ledger = tmp_path / "ledger"
    # Wait until two runs are under way, then kill the driver outright.
    while not (ledger.exists() and ledger.read_text().count(" start ") >= 2):
        assert driver.poll() is None, "the driver ended before two runs started"
        time.sleep(0.05)
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    rerun = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    seen = []
    try:
        # The orphans of the killed driver are followed, not rerun.
        for line in rerun.stdout:
            seen.append(line)
            if " runs: " in line:  # the summary after adopting
                break
        assert sum("adopted" in ln for ln in seen) == 2, seen
    finally:
        release.write_text("go")
    rest, _ = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, "".join(seen) + rest
    counts = ledger_counts(ledger)
    assert len(counts) == 4
    assert all(c == {"start": 1, "done": 1} for c in counts.values()), counts
    assert curves(out) == reference
    st = GridState.load(out / "tiny", "tiny")
    assert all(r.status == "done" for r in st.runs.values())


def test_failed_runs_retry_and_resume_from_checkpoint(tmp_path, monkeypatch, reference):
    monkeypatch.setenv("FAKE_FAIL_ONCE_AT", "40")  # after the step-32 checkpoint of M=64 runs
    monkeypatch.setenv("FAKE_LEDGER", str(tmp_path / "ledger"))
    spec = write_spec(tmp_path)
    out = tmp_path / "out"
    assert run_grid(spec, out, "--jobs", "2", "--no-report") == 0
    assert curves(out) == reference
    st = GridState.load(out / "tiny", "tiny")
    failed_once = [r for r in st.runs.values() if r.failures == 1]
    assert failed_once and all(r.launches == 2 and r.status == "done" for r in failed_once)
    starts = [ln for ln in (tmp_path / "ledger").read_text().splitlines() if " start " in ln]
    assert any(ln.endswith(" start 32") for ln in starts)  # resumed, not restarted


def test_a_grid_run_under_first_version_ids_resumes_in_its_directories(
    tmp_path, monkeypatch, capfd, reference
):
    """A grid made before run ids had versions (its run directories named for 12-hex-digit
    ids, its state file keyed by them): the same command finds every run where it is, keeps
    each run's record (a failed run stays failed), and resumes from the checkpoints."""
    sys.path.insert(0, str(ROOT / "tests" / "_workers"))
    from legacy_ids import use_legacy_ids

    from rl_jax.config import id_version

    spec = write_spec(tmp_path, max_attempts=1)
    out = tmp_path / "out"
    ledger = tmp_path / "ledger"
    monkeypatch.setenv("FAKE_LEDGER", str(ledger))
    with monkeypatch.context() as m:
        use_legacy_ids(m, modules=("rl_jax.grid.expand",))
        m.setenv("FAKE_LEGACY_IDS", "1")
        m.setenv("FAKE_FAIL_ONCE_AT", "40")  # after the step-32 checkpoint of the M=64 run
        assert run_grid(spec, out, "--jobs", "2", "--no-report") == 1
    old = sorted(d.name for d in (out / "tiny" / "runs").iterdir())
    assert len(old) == 4 and all(id_version(n.rsplit("-", 1)[1]) == 1 for n in old)
    failed = [r.name for r in GridState.load(out / "tiny", "tiny").runs.values() if r.failures]
    assert len(failed) == 1
    capfd.readouterr()
    # The failed run stays failed (its record is found under its new id): nothing starts.
    before = ledger.read_text()
    assert run_grid(spec, out, "--no-report") == 1 and ledger.read_text() == before
    assert "4 run(s) found in directories named for their run ids of an earlier" in (
        capfd.readouterr().err
    )
    assert run_grid(spec, out, "--dry-run", "--json") == 0
    plan = json.loads(capfd.readouterr().out)
    assert sorted(r["name"] for r in plan["runs"]) == old
    assert all(id_version(r["run_id"]) == 2 for r in plan["runs"])
    assert run_grid(spec, out, "--no-report", "--retry-failed") == 0
    started = ledger.read_text()[len(before) :].splitlines()
    assert len(started) == 2 and started[0].endswith(" start 32"), started
    assert sorted(d.name for d in (out / "tiny" / "runs").iterdir()) == old
    st = GridState.load(out / "tiny", "tiny")
    assert {r.name for r in st.runs.values()} == set(old) and len(st.runs) == 4
    assert all(r.status == "done" and id_version(k) == 2 for k, r in st.runs.items())

    # The runs' rows are the uninterrupted grid's (but for where they are and their ids:
    # the resumed run's rows carry its new id, the runs done before it their old ones).
    def by_cell(got):
        strip = ("name", "run_id")
        return {
            n.rsplit("-", 1)[0]: [{k: v for k, v in r.items() if k not in strip} for r in rows]
            for n, rows in got.items()
        }

    got = curves(out)
    assert by_cell(got) == by_cell(reference)
    resumed = got[failed[0]]
    assert {r["run_id"] for r in resumed} == {started[0].split()[0]}


def test_runs_that_always_fail_stop_at_max_attempts(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_FAIL_ALWAYS", "4")
    spec = write_spec(tmp_path, max_attempts=2)
    out = tmp_path / "out"
    assert run_grid(spec, out, "--jobs", "2", "--no-report") == 1
    st = GridState.load(out / "tiny", "tiny")
    assert all(r.status == "failed" and r.launches == 2 for r in st.runs.values())
    # A rerun does not try again (the limit holds across drivers) unless asked to.
    assert run_grid(spec, out, "--no-report") == 1
    assert all(r.launches == 2 for r in GridState.load(out / "tiny", "tiny").runs.values())
    monkeypatch.delenv("FAKE_FAIL_ALWAYS")
    assert run_grid(spec, out, "--jobs", "2", "--no-report", "--retry-failed") == 0


# rl-jax train's exit statuses for a config error (2) and for a run that fails again where
# it resumes (3: NaN/Inf updates, data retired by No-Positive-Resampling).
@pytest.mark.parametrize("rc", ["2", "3"])
def test_errors_a_rerun_repeats_are_not_retried(tmp_path, monkeypatch, rc):
    monkeypatch.setenv("FAKE_FAIL_ALWAYS", rc)
    out = tmp_path / "out"
    assert run_grid(write_spec(tmp_path, max_attempts=3), out, "--jobs", "2", "--no-report") == 1
    st = GridState.load(out / "tiny", "tiny")
    assert all(r.status == "failed" and r.launches == 1 for r in st.runs.values())


def test_guard_never_starts_a_finished_or_busy_run(tmp_path):
    rd = tmp_path / "run"
    rd.mkdir()
    marker = tmp_path / "ran"
    cmd = [sys.executable, "-c", f"open({str(marker)!r}, 'w').write('x')"]
    (rd / "DONE").write_text("{}")
    assert guard_main(["--run-dir", str(rd), "--attempt", "1", "--", *cmd]) == 0
    assert not marker.exists()
    (rd / "DONE").unlink()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rl_jax.grid._guard",
            "--run-dir",
            str(rd),
            "--attempt",
            "2",
            "--",
            sys.executable,
            "-c",
            "import time; time.sleep(30)",
        ]
    )
    try:
        deadline = time.time() + 20
        while not (rd / ".grid" / "lock").exists() or not (
            (rd / ".grid" / "lock").read_text().strip()
        ):
            assert time.time() < deadline
            time.sleep(0.05)
        assert guard_main(["--run-dir", str(rd), "--attempt", "3", "--", *cmd]) == BUSY
        assert not marker.exists()
    finally:
        holder.terminate()
        holder.wait()
    # A guard terminated before it started its child (a loaded machine) records nothing;
    # one that did records the child's SIGTERM.
    record = rd / ".grid" / "attempt-2.json"
    if record.exists():
        assert json.loads(record.read_text())["rc"] == 128 + 15
    assert guard_main(["--run-dir", str(rd), "--attempt", "4", "--", *cmd]) == 0
    assert marker.exists()


# compare grids stop by the leader's asymptote; iso-compute grids (here with the threshold
# from --stop-early) by the probability of reaching the frontier in the compute left.
@pytest.mark.parametrize("kind, extra", [("compare", ()), ("isocompute", ("--stop-early", "0.04"))])
def test_early_stop_stops_runs_that_cannot_catch_the_leader(tmp_path, monkeypatch, kind, extra):
    monkeypatch.setenv("FAKE_BAD_N", "2")  # n=2 saturates at 0.3, n=4 near 0.55
    monkeypatch.setenv("FAKE_SLEEP", "0.08")
    es = "EarlyStop(threshold=0.05, min_fraction=0.3, min_points=4, every_s=0.3)"
    spec = write_spec(tmp_path, kind=kind, early_stop=es)
    out = tmp_path / "out"
    assert run_grid(spec, out, "--jobs", "4", *extra) == 0
    st = GridState.load(out / "tiny", "tiny")
    by_n = {r.name: r for r in st.runs.values()}
    # Every n=2 run is stopped unless it finished before it could be judged; n=4 runs finish.
    stopped = [r for name, r in by_n.items() if name.startswith("n2_") and r.status == "stopped"]
    assert stopped, by_n
    assert all(r.status in ("stopped", "done") for r in by_n.values())
    # The frontier at the budget is n4_bp4's (B_p = 4 starts faster); in an iso-compute grid
    # n4_bp2, below it all the way, may be stopped too.
    keep = "n4_bp4" if kind == "isocompute" else "n4_"
    assert all(r.status == "done" for name, r in by_n.items() if name.startswith(keep))
    report = (out / "tiny" / "report.md").read_text()
    # The report's asymptote comparison is the compare grids' rule only.
    assert ("Early decision: leader" in report) == (kind == "compare")
    for r in (r for r in by_n.values() if r.status == "stopped"):
        assert r.stopped["leader"].startswith(keep) and r.stopped["p"] < 0.05
        assert ("frontier" in r.stopped["reason"]) == (kind == "isocompute")
        assert f"- {r.name}: stopped at step" in report
    # Stopped runs are decisions: a rerun leaves them alone.
    launches = {r.name: r.launches for r in st.runs.values()}
    assert run_grid(spec, out, "--no-report") == 0
    assert {r.name: r.launches for r in GridState.load(out / "tiny", "tiny").runs.values()} == (
        launches
    )


def test_early_stop_check_survives_a_damaged_curve(tmp_path):
    """A run's curve.jsonl with a bad line before its last: the early-stop check is skipped
    with a line saying why, the driver goes on (it died with a ValueError)."""
    from rl_jax.grid import expand
    from rl_jax.grid.backends import LocalBackend
    from rl_jax.grid.driver import Driver

    spec = load_spec(str(write_spec(tmp_path)))
    plans = expand(spec)
    said = []
    driver = Driver(
        spec,
        plans,
        LocalBackend(jobs=1),
        root=str(tmp_path / "g"),
        recipe="scalerl",
        early_stop=lambda curves, running: {},
        log=said.append,
    )
    bad = tmp_path / "g" / "runs" / plans[0].name / "curve.jsonl"
    bad.parent.mkdir(parents=True)
    bad.write_text('{"step": 1}\n{oops\n{"step": 2}\n')
    driver._check_early_stop(GridState.load(str(tmp_path / "g"), spec.name, plans), [])
    assert len(said) == 1 and "early-stop check skipped" in said[0] and str(bad) in said[0]


@pytest.mark.parametrize(
    "text, why",
    [
        (b"", "Expecting value"),
        (b'{"grid": "tiny", "runs": {"a', "Unterminated string"),
        (b"\xff\xfe", "utf-8"),
        (b"[1, 2]", "a JSON list without a 'runs' object"),
        (b'{"runs": {"r": {"nme": "x"}}}', "unexpected keyword argument 'nme'"),
        (b'{"runs": {"r": {"name": "x", "launches": "3"}}}', "run r:"),
    ],
)
def test_damaged_state_file_is_a_config_error(tmp_path, text, why):
    """A damaged state.json: a ConfigError naming it (exit 2), not a JSONDecodeError /
    AttributeError / TypeError traceback."""
    (tmp_path / "state.json").write_bytes(text)
    with pytest.raises(ConfigError, match="state.json is damaged") as e:
        GridState.load(str(tmp_path), "tiny")
    assert why in str(e.value) and str(tmp_path / "state.json") in str(e.value)


def test_ray_backend_runs_the_tiny_grid(tmp_path, reference):
    pytest.importorskip("ray")
    spec = write_spec(tmp_path)
    out = tmp_path / "out"
    assert run_grid(spec, out, "--backend", "ray", "--ray-cpus", "2", "--no-report") == 0
    assert curves(out) == reference


def test_tpu_dry_run_prints_the_gcloud_commands(tmp_path, capsys):
    spec = write_spec(tmp_path)
    args = [str(spec), "--out", str(tmp_path / "out"), "--backend", "tpu", "--dry-run"]
    args += ["--tpu-zone", "us-east5-a", "--tpu-type", "v6e-8", "--tpu-slices", "2"]
    args += ["--tpu-project", "my-proj", "--tpu-teardown"]
    assert grid_main(args) == 0
    text = capsys.readouterr().out
    assert not (tmp_path / "out").exists()  # a dry run writes nothing
    loc = "--zone=us-east5-a --project=my-proj"
    assert text.count(f"gcloud compute tpus tpu-vm create rl-jax-tiny-0 {loc}") == 2
    assert f"gcloud compute tpus tpu-vm create rl-jax-tiny-1 {loc}" in text
    assert "--accelerator-type=v6e-8 --version=v2-alpha-tpuv6e" in text
    assert f"gcloud compute tpus tpu-vm scp {tmp_path}" not in text
    assert f"rl-jax-tiny-0:rl_jax_src.tgz {loc} --worker=all" in text
    assert f"gcloud compute tpus tpu-vm ssh rl-jax-tiny-1 {loc} --worker=all" in text
    assert "rl-jax train rl_jax/experiments/scalerl.py mesh.distributed=true sampling.n=2" in text
    assert "--worker=0" in text
    assert f"gcloud compute tpus tpu-vm delete rl-jax-tiny-1 {loc} --quiet" in text
    # The printed ssh line is exact: a shell reads back the command the hosts run.
    line = next(ln for ln in text.splitlines() if "rl-jax train" in ln)
    probe = subprocess.run(
        ["bash", "-c", f"gcloud() {{ printf '%s\\n' \"$@\"; }}; {line}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    remote = next(a for a in probe if a.startswith("--command=")).removeprefix("--command=")
    host = subprocess.run(
        [
            "bash",
            "-c",
            f"rl-jax() {{ printf '%s\\n' \"$@\"; }}; tee() {{ cat; }}; HOME={tmp_path}; {remote}",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    ).stdout.splitlines()
    assert host[:2] == ["train", "rl_jax/experiments/scalerl.py"]
    assert "mesh.distributed=true" in host and any(a.startswith("name=n2_bp2_s0-") for a in host)


def test_tpu_runs_in_a_bucket_resume_on_any_slice_and_are_read_there(tmp_path, capsys, gcs):
    spec = write_spec(tmp_path)
    args = [str(spec), "--out", str(tmp_path / "out"), "--backend", "tpu", "--dry-run"]
    args += ["--tpu-zone", "us-east5-a", "--tpu-type", "v5p-16", "--tpu-spot"]
    args += ["--tpu-remote-out", f"{gcs.base}/rl_jax"]
    assert grid_main(args) == 0
    text = capsys.readouterr().out
    # Every run writes its whole directory, checkpoints included, to the bucket...
    assert f"out_dir={gcs.base}/rl_jax/tiny/runs" in text
    # ...so nothing copies it back from a host (only the hosts' logs come back).
    assert "tar -C" not in text and "--exclude=checkpoints" not in text
    assert "rl_jax_logs/n2_bp2_s0-" in text
    from rl_jax.cli.grid import build_parser, make_backend

    backend = make_backend(build_parser().parse_args(args), load_spec(str(spec)))
    assert backend.runs_root(str(tmp_path / "out" / "tiny")) == f"{gcs.base}/rl_jax/tiny/runs"
    # A remote out the trainer could not lock is refused before anything runs.
    bad = [*args[:-1], "s3://bkt/rl_jax"]
    with pytest.raises(ConfigError, match="--tpu-remote-out"):
        grid_main(bad)


def test_warm_start_specs_train_through_warm_train():
    from rl_jax.cli.grid import build_parser, make_backend

    spec = load_spec("isocompute_cpu")
    local = make_backend(build_parser().parse_args(["isocompute_cpu"]), spec)
    target = repr(spec.warm_start)
    assert local.train_cmd[1:] == ["-m", "rl_jax.cli.warm_train", "--target", target]
    tpu = make_backend(
        build_parser().parse_args(["isocompute_cpu", "--backend", "tpu", "--tpu-zone", "z"]), spec
    )
    assert tpu.remote_train_cmd == ["python", "-m", "rl_jax.cli.warm_train", "--target", target]
    plain = make_backend(build_parser().parse_args(["isocompute"]), load_spec("isocompute"))
    assert plain.train_cmd[1:] == ["-m", "rl_jax.cli", "train"]


def test_tpu_scripts_are_shellcheck_clean():
    import shutil

    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed")
    scripts = sorted(str(p) for p in (ROOT / "tpu_setup").glob("*.sh"))
    r = subprocess.run(["shellcheck", "-x", *scripts], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout


def test_shipped_isocompute_cpu_spec_shape():
    spec = load_spec("isocompute_cpu")
    assert spec.report.kind == "isocompute" and spec.report.split_by == "split"


def test_rl_jax_train_exits_3_when_npr_retires_every_problem(monkeypatch, capsys):
    # The grid's contract: a failure that a resume replays exits 3 with one line.
    import rl_jax.train.loop as loop
    from rl_jax.cli import main
    from rl_jax.data import DataExhausted

    def exhausted(*a, **k):
        raise DataExhausted("all 16 problems are retired by No-Positive-Resampling")

    monkeypatch.setattr(loop, "train", exhausted)
    assert main(["train", "grpo", "--quiet"]) == 3
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "retired by No-Positive-Resampling" in err
