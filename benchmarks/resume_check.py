"""Kill a training run at random moments, rerun it each time, compare with a run never killed.

For each off-policy mode and checkpoint interval: one uninterrupted reference
run (timed after a first run filled the compilation cache), then one run killed
with SIGKILL --kills times (each kill at a random
moment of a run's wall time, every other one as soon as a checkpoint save is
under way) and rerun after every kill with the same command until it finishes.
Its metrics.jsonl and curve.jsonl are compared with the reference's, less
wall-clock timings and the run name. One JSON line per (mode, interval), then a
summary line:

    {"mode": "pipeline", "every": 3, "kills": 10, "kills_in_save": 5,
     "identical": true, "rows_lost": 0, "rows_duplicated": 0, ...}

`--storage gs` puts the runs in a bucket on a GCS server (fake-gcs-server, the
`dev` extra) and reruns each killed run as a machine with nothing local: a new
HOME and cache directory. A killed run's lease (its lock) is left behind, as a
deleted VM leaves it: the rerun is refused until the lease runs out
($RL_JAX_LEASE_S, 3 s here) and then takes the run over. A save is "under way"
while a step's objects exist without its commit_success.txt.
`--processes 2` runs each launch as two processes under jax.distributed (one
device each, data parallel) and kills both.

The run is the tests' tiny ScaleRL run (tests/_workers/train_even_first.py: a
verifier that gives a random policy a learning signal), 8 steps, evaluated
every 2 steps.

    python benchmarks/resume_check.py [--kills 10]
        [--modes on_policy,ppo_off_policy,pipeline] [--every 2,3] [--seed 0]
        [--storage local|gs] [--processes 1|2]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tests" / "_workers"))

from _common import worker_env  # noqa: E402
from gcs_emulator import GcsEmulator  # noqa: E402
from train_even_first import TINY_RUN  # noqa: E402

from rl_jax.runs import open_store, read_jsonl  # noqa: E402

WORKER = ROOT / "tests" / "_workers" / "train_even_first.py"
MODES = {
    "on_policy": ["train.off_policy=on_policy", "train.off_policy_k=1"],
    "ppo_off_policy": ["train.off_policy=ppo_off_policy", "train.off_policy_k=2"],
    # PipelineRL: a continuous stream on the engine (it drains at every checkpoint).
    "pipeline": ["train.off_policy=pipeline", "train.off_policy_k=2", "sampling.decode_chunk=2"],
}
DROP = ("time/", "device_seconds", "eval_device_seconds")
# Knobs that name where a launch runs, not what it computes (a new port each launch).
LAUNCH = ("name", "out_dir", "mesh.coordinator_address", "mesh.process_id")


LEASE_S = 3.0


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def commands(out: str, name: str, mode: str, every: int, processes: int) -> list[list[str]]:
    """The command of each process of one launch."""
    args = [
        *TINY_RUN,
        *MODES[mode],
        "train.steps=8",
        "eval.every=2",
        f"checkpoint.every={every}",
        f"out_dir={out}",
        f"name={name}",
    ]
    base = [sys.executable, str(WORKER), "train", "scalerl", *args, "--quiet"]
    if processes == 1:
        return [base]
    port = _port()
    return [
        [
            *base,
            "mesh.distributed=true",
            f"mesh.coordinator_address=127.0.0.1:{port}",
            f"mesh.num_processes={processes}",
            f"mesh.process_id={i}",
            f"mesh.data={processes}",
            "mesh.fsdp=1",
        ]
        for i in range(processes)
    ]


def rows(run: str) -> dict[str, list[dict]]:
    out = {}
    for name in ("metrics.jsonl", "curve.jsonl"):
        out[name] = [
            {k: v for k, v in r.items() if not k.startswith(DROP) and k not in (*DROP, *LAUNCH)}
            for r in read_jsonl(f"{run}/{name}")
        ]
    return out


def saving(run: str) -> bool:
    """A checkpoint save under way: orbax's temporary directory (a disk), or a step's
    objects without their commit_success.txt (a bucket)."""
    store = open_store(run)
    if not store.remote:
        ck = Path(run) / "checkpoints"
        return ck.exists() and any("tmp" in p.name for p in ck.iterdir())
    names = store.fs.find(f"{store._inner}/checkpoints")
    rel = [n.split("/checkpoints/", 1)[1] for n in names if "/checkpoints/" in n]
    steps = {r.split("/")[0] for r in rel}
    committed = {
        r.split("/")[0] for r in rel if r.count("/") == 1 and r.endswith("commit_success.txt")
    }
    return bool(steps - committed)


class Launch:
    """One launch of a run: its processes, each on a machine of its own when `fresh`."""

    def __init__(self, cmds: list[list[str]], env: dict, fresh: Path | None):
        self.procs, self.logs = [], []
        for i, cmd in enumerate(cmds):
            e = dict(env)
            if fresh is not None:
                home = Path(tempfile.mkdtemp(prefix=f"host{i}-", dir=fresh))
                e.update(HOME=str(home), XDG_CACHE_HOME=str(home / ".cache"))
            log = tempfile.TemporaryFile()
            self.logs.append(log)
            self.procs.append(
                subprocess.Popen(
                    cmd, env=e, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True
                )
            )

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for p in self.procs:
            p.wait()

    def wait(self) -> tuple[int, str]:
        rcs = [p.wait() for p in self.procs]
        errs = []
        for log in self.logs:
            log.seek(0)
            errs.append(log.read().decode(errors="replace"))
            log.close()
        return max(rcs, key=abs), "\n".join(errs)


def busy(rc: int, err: str) -> bool:
    return rc == 2 and "in use by another process" in err


def kill_once(cmds, env, run: str, at_s: float, in_save: bool, fresh) -> str:
    """Launch; SIGKILL every process after at_s seconds, or at the first save seen after
    at_s / 2 when in_save. Returns 'killed', 'killed_in_save', 'finished' or 'busy' (a
    killed run's lease had not run out yet)."""
    launch = Launch(cmds, env, fresh)
    t0 = time.monotonic()
    how = "killed"
    while launch.running():
        t = time.monotonic() - t0
        if in_save and t > at_s / 2 and saving(run):
            how = "killed_in_save"
            break
        if not in_save and t >= at_s:
            break
        time.sleep(0.002 if in_save and not open_store(run).remote else 0.02)
    if not launch.running():
        rc, err = launch.wait()
        if busy(rc, err):
            time.sleep(LEASE_S)
            return "busy"
        if rc != 0:
            raise RuntimeError(f"a launch failed ({rc}): {err[-3000:]}")
        return "finished"
    launch.kill()
    launch.wait()
    return how


def finish(cmds, env, fresh) -> None:
    """Rerun until the run finishes (waiting out a lease left by the last kill)."""
    while True:
        rc, err = Launch(cmds, env, fresh).wait()
        if rc == 0:
            return
        if not busy(rc, err):
            raise RuntimeError(f"rerun failed ({rc}): {err[-3000:]}")
        time.sleep(LEASE_S)


def check(out: str, mode: str, every: int, kills: int, rng, *, processes: int, fresh) -> dict:
    env = worker_env(devices=None if processes == 1 else 1)
    env["RL_JAX_LEASE_S"] = str(LEASE_S)
    # The first run fills the compilation cache; the second, timed, is the reference.
    for name in ("warm", "ref"):
        t0 = time.monotonic()
        rc, err = Launch(commands(out, name, mode, every, processes), env, None).wait()
        if rc != 0:
            raise RuntimeError(f"reference run failed: {err[-2000:]}")
        ref_s = time.monotonic() - t0
    run = f"{out}/kill"
    ends = collections.Counter()
    i = 0
    while ends["killed"] + ends["killed_in_save"] < kills:
        if open_store(run).exists("DONE"):
            break
        cmds = commands(out, "kill", mode, every, processes)
        at = rng.uniform(0.1, 0.9) * ref_s
        ends[kill_once(cmds, env, run, at, in_save=i % 2 == 1, fresh=fresh)] += 1
        i += 1
    finish(commands(out, "kill", mode, every, processes), env, fresh)
    a, b = rows(f"{out}/ref"), rows(run)
    lost = dup = 0
    for name in a:
        ca = collections.Counter(r["step"] for r in a[name])
        cb = collections.Counter(r["step"] for r in b[name])
        lost += sum((ca - cb).values())
        dup += sum((cb - ca).values())
    differs = [
        (name, i, k)
        for name in a
        for i, (ra, rb) in enumerate(zip(a[name], b[name], strict=False))
        for k in sorted(set(ra) | set(rb))
        if ra.get(k) != rb.get(k)
    ]
    return {
        "mode": mode,
        "every": every,
        "processes": processes,
        "first_differences": differs[:5],
        "kills": ends["killed"] + ends["killed_in_save"],
        "kills_in_save": ends["killed_in_save"],
        "finished_before_kill": ends["finished"],
        "refused_while_leased": ends["busy"],
        "identical": a == b,
        "rows_lost": lost,
        "rows_duplicated": dup,
        "reference_s": round(ref_s, 1),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=10)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--every", default="2,3")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--storage", choices=("local", "gs"), default="local")
    p.add_argument("--processes", type=int, choices=(1, 2), default=1)
    a = p.parse_args()
    rng = random.Random(a.seed)
    results = []
    with tempfile.TemporaryDirectory(prefix="resume_check_") as tmp:
        emu = None
        if a.storage == "gs":
            emu = GcsEmulator(Path(tmp) / "gcs")
            emu.start()
            emu.create_bucket("resume-check")
            os.environ.update(emu.env())
        try:
            for mode in a.modes.split(","):
                for every in (int(e) for e in a.every.split(",")):
                    name = f"{mode}-{every}"
                    out = f"gs://resume-check/{name}" if emu else str(Path(tmp) / name)
                    fresh = Path(tmp) / "hosts" if emu else None
                    if fresh is not None:
                        fresh.mkdir(exist_ok=True)
                    r = check(out, mode, every, a.kills, rng, processes=a.processes, fresh=fresh)
                    r["storage"] = a.storage
                    results.append(r)
                    print(json.dumps(r), flush=True)
        finally:
            if emu is not None:
                emu.stop()
    summary = {
        "configs": len(results),
        "storage": a.storage,
        "processes": a.processes,
        "all_identical": all(r["identical"] for r in results),
        "kills": sum(r["kills"] for r in results),
        "kills_in_save": sum(r["kills_in_save"] for r in results),
        "rows_lost": sum(r["rows_lost"] for r in results),
        "rows_duplicated": sum(r["rows_duplicated"] for r in results),
        "load_avg_1m_end": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(summary), flush=True)
    return 0 if summary["all_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
