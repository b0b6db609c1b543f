"""``StepProfiler``: a Lightning callback that profiles chosen training steps on every rank and attributes them.

Per window of the ``torch.profiler.schedule(wait, warmup, active, repeat)`` (steps counted from the first
training batch; ``repeat=0`` repeats until training ends) every rank writes its trace, gzipped and named by
rank, with the job's ``distributedInfo`` (world size, backend, process groups)::

    <dir>/shardline_profile/window{k}/rank{R}.pt.trace.json.gz

``<dir>`` is ``output_dir``, else the trainer's ``log_dir`` (the first logger's directory, agreed by all ranks),
else ``default_root_dir``. When training ends, after a barrier (every rank has written), rank 0 alone runs the
profiling core on each window -- ``shardline.profiling.load`` with the strategy's layout, then the window's one
``Attribution``, whose breakdown and report sections are computed once and read by every output -- and
publishes:

* to every ``TensorBoardLogger``: ``shardline.profiling.tensorboard.write_tensorboard`` into
  ``<its log_dir>/shardline_profile`` (runs ``shardline_profile`` and ``shardline_profile/rank{R}`` next to the
  logger's own scalars; a run of their own, so the layout hparams do not collide with the hparams Lightning
  logs for the module). Steps are the trainer's batch indices; hparams carry ``strategy.describe()`` when the
  strategy has it. With the default ``output_dir`` the traces already lie there and are not copied;
* report files: ``<dir>/shardline_profile/report.md`` (the summary and each window's breakdown table) and a
  self-contained HTML report per window, ``report_window{k}.html`` (``shardline.profiling.report_html``);
* a one-screen summary printed to stdout at the end of ``fit``: per rank, the mean step time and its largest
  parts, and the overhead of profiling (mean wall time of the recorded steps vs the steps run without the
  profiler, the first step excluded as warm-up).

Cheap when inactive: outside its windows the callback only reads a clock per batch, and the profiler is stopped
as soon as its last window is written.
"""

from __future__ import annotations

import enum
import io
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pytorch_lightning as pl
import torch

from shardline.plugins.errors import ContractError

TRACE_DIR = "shardline_profile"
REPORT_NAME = "report.md"


class StepKind(str, enum.Enum):
    """What the profiler did during one training batch."""

    OFF = "off"  # profiler not running, or waiting (NONE)
    WARMUP = "warmup"
    RECORD = "record"


@dataclass
class _Timings:
    kinds: list[StepKind] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)

    def mean_ms(self, kind: StepKind) -> tuple[float, int]:
        # The first batch pays one-time costs (allocations, DeepSpeed buckets): never part of a mean.
        chosen = [s for i, (k, s) in enumerate(zip(self.kinds, self.seconds)) if k is kind and i > 0]
        return (1e3 * sum(chosen) / len(chosen), len(chosen)) if chosen else (float("nan"), 0)


class StepProfiler(pl.Callback):
    """Profile steps ``wait + warmup .. wait + warmup + active - 1`` of each of ``repeat`` cycles on every rank.

    ``record_shapes`` / ``with_stack`` are passed to ``torch.profiler.profile``. After ``fit``,
    ``self.summary`` holds the printed summary text, ``self.tables`` each window's breakdown (rank 0 only)
    and ``self.trace_dirs`` the window folders.
    """

    def __init__(self, wait: int = 1, warmup: int = 1, active: int = 3, repeat: int = 1, *,
                 record_shapes: bool = False, with_stack: bool = False, output_dir: str | Path | None = None):
        for name, value, low in (("wait", wait, 0), ("warmup", warmup, 0), ("active", active, 1),
                                 ("repeat", repeat, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ContractError(f"StepProfiler({name}={value!r}): must be an integer >= {low}")
        self.wait, self.warmup, self.active, self.repeat = wait, warmup, active, repeat
        self.record_shapes, self.with_stack = bool(record_shapes), bool(with_stack)
        self.output_dir = None if output_dir is None else Path(output_dir)
        self.root: Path | None = None
        self.trace_dirs: list[Path] = []
        self.tables: list = []
        self.summary: str = ""
        self.findings: list = []  # per window: the report's findings (``shardline.profiling.findings``)
        self._profiler = None
        self._rank = 0
        self._timings = _Timings()
        self._batch_start: float | None = None
        self._batch_kind = StepKind.OFF

    # --- capture ------------------------------------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        # trainer.log_dir is broadcast from rank 0: every rank must ask, at the same point.
        base = self.output_dir or Path(trainer.log_dir or trainer.default_root_dir)
        self.root = base / TRACE_DIR
        self._rank = trainer.global_rank

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        schedule = torch.profiler.schedule(wait=self.wait, warmup=self.warmup, active=self.active,
                                           repeat=self.repeat)
        self._profiler = torch.profiler.profile(activities=activities, schedule=schedule,
                                                on_trace_ready=self._write_trace, record_shapes=self.record_shapes,
                                                with_stack=self.with_stack)
        self._profiler.start()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._batch_kind = self._current_kind()
        self._batch_start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._batch_start is not None:
            self._timings.kinds.append(self._batch_kind)
            self._timings.seconds.append(time.perf_counter() - self._batch_start)
        if self._profiler is None:
            return
        self._profiler.step()
        if self.repeat and len(self.trace_dirs) >= self.repeat:
            self._stop()  # the last window is written: nothing more to record

    def _current_kind(self) -> StepKind:
        if self._profiler is None:
            return StepKind.OFF
        action = self._profiler.current_action
        if action in (torch.profiler.ProfilerAction.RECORD, torch.profiler.ProfilerAction.RECORD_AND_SAVE):
            return StepKind.RECORD
        return StepKind.WARMUP if action is torch.profiler.ProfilerAction.WARMUP else StepKind.OFF

    def _write_trace(self, profiler) -> None:
        folder = self.root / f"window{len(self.trace_dirs)}"
        folder.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(folder / f"rank{self._rank}.pt.trace.json.gz"))
        self.trace_dirs.append(folder)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Training failed: release the profiler; no barrier (peers may be gone) and no analysis.
        self._stop()

    def _stop(self) -> None:
        profiler, self._profiler = self._profiler, None
        if profiler is not None:
            profiler.stop()  # a window still recording is written (on_trace_ready) by stop()

    # --- analysis and publication (rank 0) ---------------------------------------------------------------------

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop()
        trainer.strategy.barrier("shardline-step-profiler")  # every rank's traces are on disk
        if trainer.global_rank != 0 or not self.trace_dirs:
            return
        from shardline.profiling.attribution.core import attribute
        from shardline.profiling.base.errors import TraceWarning
        from shardline.profiling.present.tensorboard import write_tensorboard
        from shardline.profiling.table.load import load

        describe = getattr(trainer.strategy, "describe", None)
        layout = describe() if callable(describe) else None
        dims = {k: layout[k] for k in ("tp", "cp", "dp", "pp") if layout and isinstance(layout.get(k), int)}
        loggers = [lg for lg in trainer.loggers if isinstance(lg, pl.loggers.TensorBoardLogger)]
        for folder in self.trace_dirs:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", TraceWarning)
                # Classified once, with the layout; the attribution is kept on the trace set, so the HTML
                # report, the table and TensorBoard below all read the same breakdown and sections.
                traceset = load(folder, layout=dims or None)
                attribution = attribute(traceset)
                table = attribution.breakdown
                self._write_html(traceset, attribution, name=folder.name)
                from shardline.profiling.present.report_sections import report_sections

                self.findings.append(report_sections(attribution).findings)
            self.tables.append(table)
            for logger in loggers:
                write_tensorboard(traceset, logdir=Path(logger.log_dir) / TRACE_DIR, layout=layout)
        self.summary = self._summary_text()
        self._write_report()
        print(self.summary, flush=True)

    def _summary_text(self) -> str:
        """Per rank over all profiled steps: mean step ms, its three largest parts; then the overhead line."""
        import pandas as pd

        from shardline.profiling.attribution.core import EXCLUSIVE_COLUMNS

        table = pd.concat(self.tables, ignore_index=True)
        means = table.groupby("rank")[["step_ns", *EXCLUSIVE_COLUMNS]].mean()
        lines = [f"shardline StepProfiler: {len(table)} (rank, step) rows in {len(self.tables)} window(s), "
                 f"traces in {self.root}",
                 f"{'rank':>4} {'steps':>5} {'step ms':>9}  largest parts (share of the step)"]
        steps = table.groupby("rank")["step"].nunique()
        for rank, row in means.iterrows():
            parts = row[list(EXCLUSIVE_COLUMNS)].sort_values(ascending=False)
            shares = ", ".join(f"{name} {100 * value / row['step_ns']:.1f}%" for name, value in parts.head(3).items()
                               if value > 0 and row["step_ns"] > 0)
            lines.append(f"{int(rank):>4} {int(steps[rank]):>5} {row['step_ns'] / 1e6:>9.3f}  {shares}")
        for folder, found in zip(self.trace_dirs, self.findings):  # what to change, largest saving first
            for row in found.head(3).itertuples(index=False):
                lines.append(f"finding ({folder.name}) {int(row.rank)}: {row.text}")
        recorded, n_rec = self._timings.mean_ms(StepKind.RECORD)
        plain, n_plain = self._timings.mean_ms(StepKind.OFF)
        if n_rec and n_plain:
            lines.append(f"profiling overhead (rank 0 wall time): profiled steps {recorded:.3f} ms (n={n_rec}) vs "
                         f"unprofiled steps {plain:.3f} ms (n={n_plain}): {100 * (recorded / plain - 1):+.1f}%")
        else:
            lines.append(f"profiling overhead: not measured (profiled steps n={n_rec}, unprofiled steps "
                         f"n={n_plain}, first step excluded); run more steps than wait+warmup+active+1")
        return "\n".join(lines)

    def _write_html(self, traceset, attribution, *, name: str) -> None:
        from shardline.profiling.present.report_html import render_html
        from shardline.profiling.present.report_sections import report_sections

        text = render_html(report_sections(attribution), events=attribution,
                           title=f"shardline step profile: {name}",
                           sources=tuple(str(f) for f in sorted(traceset.files)))
        (self.root / f"report_{name}.html").write_text(text)

    def _write_report(self) -> None:
        from shardline.profiling.present.cli import render_table

        text = io.StringIO()
        text.write("# shardline step profile\n\n```\n" + self.summary + "\n```\n")
        for folder, table in zip(self.trace_dirs, self.tables):
            text.write(f"\n## {folder.name} ({folder})\n\n```\n{render_table(table)}```\n")
        (self.root / REPORT_NAME).write_text(text.getvalue())
