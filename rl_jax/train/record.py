"""What a run leaves behind and what it says: its directory's rows, events, plots and
DONE, its checkpoints, and its console lines.

The trainer hands the `Recorder` what happened (a step's metrics, an evaluation, a
state to save); the recorder decides where it goes. Its rules keep a resumed run's
rows equal to those of a run that never stopped:
- a checkpoint of step s is saved only after the rows up to s are durable (a bucket
  uploads them first), and records how many rows each log holds (`LOG_ROWS`);
- a resumed run cuts the logs back to the restored step and checks those counts, so
  a log that lost rows stops the run with its name instead of leaving a gap;
- `checkpoint.resume=false` moves the earlier trajectory (checkpoints, rows, DONE)
  aside, so a later plain rerun resumes this run's own checkpoints, never another's.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import jax

from rl_jax.config import RunConfig
from rl_jax.knobs import ConfigError
from rl_jax.runs import MetricsLogger, RunDir, RunDirError, StorageError, sample_rows
from rl_jax.runs.plots import CURVE_PNG, draw_curve
from rl_jax.runs.run_dir import CHECKPOINTS, METRICS
from rl_jax.runs.samples import format_row, samples_due
from rl_jax.train.checkpoint import Checkpointer

LOG_ROWS = "log_rows"  # checkpoint meta: rows in each log at the checkpoint's step


def say(text: str) -> None:
    """A line for the person watching the run (stderr: stdout ends with the summary)."""
    print(text, file=sys.stderr, flush=True)


class Recorder:
    def __init__(self, cfg: RunConfig, run: RunDir, *, run_id: str, is_main: bool):
        self.cfg = cfg
        self.run = run
        self.run_id = run_id
        self.is_main = is_main
        if is_main:
            try:
                run.store.check_writable(CHECKPOINTS)
            except StorageError as e:
                raise RunDirError(f"{e}; checkpoints could not be saved") from None
        self.ckpt = Checkpointer(
            run.checkpoints_dir,
            keep=cfg.checkpoint.keep,
            async_save=cfg.checkpoint.async_save,
            compress=cfg.checkpoint.compress,
        )
        self.logger: MetricsLogger | None = None
        self.first_eval: float | None = None  # val/pass@1 of the run's first evaluation
        self._closed = False

    # ---- start ------------------------------------------------------------------------

    def restore(self, abstract_state: Any) -> tuple[int, Any, dict] | None:
        """The newest usable checkpoint (or None, starting over), with the logs rewound
        to its step and checked against the rows it recorded."""
        if not self.cfg.checkpoint.resume:
            self._start_over()
            return None
        got = self.ckpt.restore_latest(abstract_state)
        ours = {self.run_id, *self.run.continued_from()}
        if got is not None and got[2].get("run_id", self.run_id) not in ours:
            raise ConfigError(
                f"checkpoint {self.ckpt.step_url(got[0])} belongs to run "
                f"{got[2]['run_id']}, not to this config's {self.run_id}; use another run name"
            )
        last = -1 if got is None else int(got[2]["step"])
        if self.is_main:
            self.run.rewind(last, None if got is None else got[2].get(LOG_ROWS))
            if got is None:
                say(f"no checkpoint in {self.run.checkpoints_dir}: starting at step 0")
            else:
                say(f"resuming from step {last} (checkpoint {self.ckpt.step_url(got[0])})")
                self.first_eval = _pass_at(self.run, 0)
        return got

    def _start_over(self) -> None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        if self.is_main:
            had = bool(self.ckpt.steps()) or self.run.store.exists(METRICS)
            dest = self.run.discard(stamp)
            self.ckpt.discard(f"{dest}/{CHECKPOINTS}")
            self.run.rewind(-1)
            what = f"moved the earlier checkpoints and rows to {dest}; " if had else ""
            say(f"checkpoint.resume=false: {what}starting at step 0")
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("rl_jax: start over")
        self.ckpt.reload()

    def open_logs(self, *, knobs: dict[str, Any], purge_step: int) -> None:
        """TensorBoard hides events at steps >= purge_step, as the rows were cut."""
        if self.is_main:
            self.logger = MetricsLogger(
                self.run, self.cfg.logging, config=knobs, purge_step=purge_step
            )

    # ---- rows -------------------------------------------------------------------------

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self.logger is not None:
            self.logger.log(step, metrics)

    def log_samples(self, step: int, problems, scores, *, well_formed) -> None:
        """A few readable rows of a scored batch (`phases.Scores`) logged under `step`, to
        samples.jsonl and TensorBoard, when logging.samples_every makes them due."""
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
            completions=scores.texts,
            raw=scores.raw,
            shaped=scores.shaped,
            group_size=cfg.sampling.n,
            rows=cfg.logging.samples_rows,
            well_formed=well_formed,
        )
        self.run.append_samples(rows)
        if self.logger is not None:
            text = "\n".join("```\n" + format_row(r) + "```" for r in rows)
            self.logger.log_text(step, "samples", text)

    def evaluated(self, step: int, row: dict[str, Any], metrics: dict[str, float]) -> None:
        """An evaluation's curve row, metrics and picture, made durable at once: watchers
        (fits, a grid's early stop) see each evaluation."""
        if self.is_main:
            self.run.append_curve(row)
            self._draw_curve()
            if self.first_eval is None:
                self.first_eval = metrics.get("val/pass@1")
        self.log(step, metrics)
        self.flush()

    def _draw_curve(self) -> None:
        try:
            draw_curve(self.run, self.run.curve())
        except (StorageError, RunDirError):
            raise
        except Exception as e:  # noqa: BLE001 - a picture must not stop the run
            say(f"warning: could not draw {self.run.url(CURVE_PNG)}: {e}")

    def flush(self) -> None:
        """Rows and events made durable (uploaded whole, for a bucket run)."""
        if self.logger is not None:
            self.logger.flush()
        elif self.is_main:
            self.run.flush()

    def stepped(self) -> None:
        """After every step: stop if the run's lock or a background save failed, and
        upload a bucket run's rows now and then."""
        self.run.check()
        self.ckpt.poll()
        if self.is_main:
            self.run.maybe_flush()

    # ---- checkpoints ------------------------------------------------------------------

    def save(self, step: int, arrays: Any, meta: dict[str, Any], *, force: bool = False) -> None:
        if step in self.ckpt.steps():
            return  # already saved at this step (periodic save coincides with the last one)
        self.flush()  # the rows up to `step` are durable before its checkpoint can commit
        meta = {**meta, "run_id": self.run_id, LOG_ROWS: self.run.row_counts()}
        self.ckpt.save(step, arrays, meta, force=force)

    def already_done(self, done: dict[str, Any]) -> None:
        if self.is_main:
            say(
                f"run {self.run.url()} is finished ({done.get('steps', '?')} steps, DONE): "
                "nothing to train. To train it further, rerun with a larger train.steps "
                "and --continue (docs/runs.md)"
            )

    def finish(self, summary: dict[str, Any]) -> None:
        self.ckpt.wait()
        if self.is_main:
            self.run.mark_done(summary)
            last = _pass_at(self.run, -1)
            gain = ""
            if self.first_eval is not None and last is not None:
                gain = f"; val pass@1 {self.first_eval:.3f} -> {last:.3f}"
            say(f"finished {summary['steps']} steps{gain}; run directory {self.run.url()}")

    def close(self) -> None:
        """Finish pending saves, upload what is pending and release the directory."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.logger is not None:
                self.logger.close()
                self.logger = None
        finally:
            try:
                self.ckpt.close()
            finally:
                self.run.close()


def _pass_at(run: RunDir, i: int) -> float | None:
    """val/pass@1 of the run's i-th evaluation (0: the first, -1: the last), if any."""
    try:
        vals = [r["val/pass@1"] for r in run.curve() if "val/pass@1" in r]
    except (OSError, ValueError):
        return None
    return vals[i] if vals else None


def curve_row(
    *,
    run_id: str,
    recipe: str,
    knobs: dict[str, Any],
    state,
    curriculum,
    metrics: dict[str, float],
) -> dict[str, Any]:
    """One row of curve.jsonl: the run's knobs, counters and the evaluation's metrics,
    with the curriculum's histogram of per-prompt training pass rates."""
    row = {"run_id": run_id, "step": state.step, "version": state.version, "recipe": recipe}
    row.update(knobs)
    row.update(state.counters.as_dict())
    row.update({k: v for k, v in metrics.items() if k.startswith(("val/", "train/"))})
    hist = getattr(curriculum, "pass_rate_histogram", None)
    if hist is not None:
        counts, _ = hist(10)
        row["train/pass_rate_hist"] = [int(c) for c in counts]
    return row
