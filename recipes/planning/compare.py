"""``shardline plan --compare PROFILE_DIR``: the step-time model's prediction next to a measured profile, per rank
and per category, in the profiler's own categories and report formats.

``compare(profile_dir, model, layout, cluster, seq_len=...)`` loads the profile with the profiler's loader
(``shardline.profiling.load``, classified with the layout's degrees) and reads its one ``Attribution``'s
breakdown: one row per (rank, step), the exclusive parts (``partition.LABELS``) summing exactly to the step in
integer ns, plus the ``overlapped_<comm>`` columns (``partition.OVERLAP_COLUMNS``). The prediction is
``steptime.predict_stages`` (one ``StepPrediction`` per pipeline rank, keyed by the same labels).

Measured steps. Each rank is averaged over the steps its breakdown holds (its ``ProfilerStep#N`` windows, or
the one whole-trace window ``step == -1`` of a trace without step markers), in step order, less the first
``warmup`` of them. The default ``warmup=0`` keeps every step, as the profiler's own summaries do
(``shardline profile diff``, the ``StepProfiler`` summary): ``torch.profiler.schedule``'s wait and warm-up steps
are never recorded, so the first recorded step is already past them. ``Comparison.steps`` names the steps each
rank was averaged over. Means are the profiler's (``diff.apportioned_mean``): each exclusive part is within
1 ns of its exact mean and the parts of a mean step still sum to the mean step exactly; an overlapped column is
its mean rounded to the ns.

Ranks. Global rank ``r`` is mapped to its pipeline rank by the one rank-order rule both halves share
(``shardline.job.placement``: tp fastest, then cp, dp, pp, so ``pp_rank = r // (tp * cp * dp)``), and is set
next to ``predict_stages(...)[pp_rank]``; its TP, CP and DP peers are priced alike. The row ``rank ==
ALL_RANKS`` (-1, ``pp_rank`` -1) compares the mean over every measured (rank, step) with the mean of those
ranks' predictions.

The table (``Comparison.table``), one row per (rank, category): ``rank, pp_rank, category, kind, predicted_s,
measured_s, measured_ns, error, steps`` (``steps``: how many (rank, step) rows the measured mean is over).
``kind`` (:class:`Kind`) is ``exclusive`` for the labels of the
partition (they sum to the step on both sides), ``overlapped`` for the ``overlapped_<comm>`` columns (hidden
communication, outside the partition) and ``step`` for the whole-step row (``category == "step"``). Formats:
``to_text`` (terminal), ``to_markdown``, ``to_html`` (the profiler's ``html_table``), ``to_json``, ``to_csv``,
``to_parquet``, ``to_tensorboard``; ``summary()`` gives the lines they lead with::

    error = (predicted_s - measured_s) / measured_s        (NaN where nothing was measured)

the sign convention of ``bench/bench_plan.py``: negative when the model is optimistic. Summary lines read
``bubble: predicted 1.20 s, measured 2.05 s (error -41%)``: the step, then the ``TOP_GAPS`` exclusive categories
of the all-ranks rows with the largest absolute gap.

Checks: the profile's world size (its ``distributedInfo.world_size``, else one more than its highest rank) must
equal ``layout.world``, and every rank must keep at least one step; otherwise :class:`PlanError` names the
numbers. A profile the loader cannot read (no such folder, no trace in it) raises :class:`PlanError` carrying
the profiler's message (its ``ProfilingError`` as the cause), so a plan command catches one type.
"""

from __future__ import annotations

import enum
import html
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from shardline.job.placement import coords_of
from shardline.profiling.analyses.diff import ALL_RANKS, apportioned_mean
from shardline.profiling.attribution.tables import fixed, ms_text, pipe_table
from shardline.profiling.base.errors import ProfilingError
from shardline.profiling.table.partition import EXCLUSIVE_COLUMNS, OVERLAP_COLUMNS
from shardline.recipes.planning.catalog import Cluster, PlanError
from shardline.recipes.planning.layout import PlanLayout
from shardline.recipes.planning.models import ModelSpec
from shardline.recipes.planning.steptime import StepPrediction, predict_stages

STEP = "step"
TOP_GAPS = 3
COLUMNS = ("rank", "pp_rank", "category", "kind", "predicted_s", "measured_s", "measured_ns", "error", "steps")


class Kind(str, enum.Enum):
    """What a row of the comparison is: a part of the step, hidden communication, or the step itself."""

    EXCLUSIVE = "exclusive"
    OVERLAPPED = "overlapped"
    STEP = "step"


@dataclass(frozen=True, eq=False)  # eq: a DataFrame field has no truth value; compare .table explicitly
class Comparison:
    """Predicted vs measured per rank and category (see the module docstring for the table and the steps).

    ``steps``: rank -> the step numbers its measured mean is over. ``predictions``: ``predict_stages``' result,
    element ``r`` for pipeline rank ``r``. ``notes``: what was left out or assumed (ranks without work, step
    sets that differ between ranks, the loader's warnings)."""

    table: pd.DataFrame
    steps: dict[int, tuple[int, ...]]
    predictions: tuple[StepPrediction, ...]
    profile: str
    model: str
    cluster: str
    layout: PlanLayout
    seq_len: int
    warmup: int = 0
    notes: tuple[str, ...] = ()

    def rows(self, rank: int = ALL_RANKS) -> pd.DataFrame:
        """The rows of ``rank`` (default: the all-ranks mean), indexed by category."""
        return self.table[self.table["rank"] == rank].set_index("category")

    def summary(self, *, top: int = TOP_GAPS) -> list[str]:
        """Lines: the mean step predicted vs measured, then the ``top`` exclusive categories with the largest
        absolute gap, e.g. ``bubble: predicted 1.20 s, measured 2.05 s (error -41%)``."""
        rows = self.rows(ALL_RANKS)
        # a gap under a nanosecond is rounding (a prediction's idle left by a subtraction), not a gap
        parts = rows[(rows["kind"] == Kind.EXCLUSIVE.value)
                     & ((rows["predicted_s"] - rows["measured_s"]).abs() >= 1e-9)]
        gap = (parts["predicted_s"] - parts["measured_s"]).abs().sort_values(ascending=False, kind="stable")
        return [_line(name, rows.loc[name]) for name in [STEP, *gap.index[:top]]]

    def to_markdown(self, *, title: str = "shardline plan --compare") -> str:
        """The header, the summary and notes as a list, then the all-ranks table and the per-rank table."""
        out = [f"# {title}", "", *[f"{line}  " for line in self._header()], ""]
        out += [f"- {line}" for line in self.summary()] + [f"- note: {n}" for n in self.notes] + [""]
        for heading, table in self._display_tables():
            out += [f"## {heading}", "", pipe_table(table), ""]
        return "\n".join(out)

    def to_text(self) -> str:
        """For a terminal: the header, the summary and notes, then both tables (``DataFrame.to_string``)."""
        out = [*self._header(), "", *self.summary(), *[f"note: {n}" for n in self.notes]]
        for heading, table in self._display_tables():
            out += ["", heading, table.to_string(index=False)]
        return "\n".join(out) + "\n"

    def to_html(self, *, title: str = "shardline plan --compare") -> str:
        """One self-contained HTML document (no script, no external URL); the tables are the profiler's
        ``report_html.html_table`` of the same display strings as the markdown."""
        from shardline.profiling.present.report_html import html_table

        body = [f"<h1>{html.escape(title)}</h1>", "<p>" + "<br>".join(map(html.escape, self._header())) + "</p>",
                "<ul>" + "".join(f"<li>{html.escape(line)}</li>" for line in self.summary()) + "</ul>"]
        if self.notes:
            body.append("".join(f'<p class="note">{html.escape(n)}</p>' for n in self.notes))
        for k, (heading, table) in enumerate(self._display_tables()):
            body += [f"<h2>{html.escape(heading)}</h2>", html_table(table, table_id=f"compare-table-{k}")]
        return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
                f"<title>{html.escape(title)}</title><style>{_CSS}</style></head>\n<body>\n"
                + "\n".join(body) + "\n</body></html>\n")

    def to_json(self) -> str:
        """The inputs, the steps, the summary, the notes and every row (seconds as floats, ``measured_ns``
        integer, a NaN error as null)."""
        doc = {"profile": self.profile, "model": self.model, "cluster": self.cluster, "seq_len": self.seq_len,
               "layout": asdict(self.layout), "warmup": self.warmup,
               "steps": {str(r): list(s) for r, s in self.steps.items()}, "summary": self.summary(),
               "notes": list(self.notes),
               "rows": json.loads(self.table.to_json(orient="records", double_precision=15))}
        return json.dumps(doc, indent=1) + "\n"

    def to_csv(self, path: str | Path | None = None) -> str | None:
        """The table as CSV, written to ``path`` (or returned as text without one), as ``DataFrame.to_csv``."""
        return self.table.to_csv(path, index=False)

    def to_parquet(self, path: str | Path) -> None:
        """The table as Parquet (pyarrow, a dependency of shardline), as ``shardline profile report`` writes."""
        self.table.to_parquet(path, index=False, engine="pyarrow")

    def to_tensorboard(self, logdir: str | Path) -> None:
        """TensorBoard views of the comparison, written as the profiler writes its own (torch-free event files):
        two runs, ``predicted`` and ``measured``, with the same scalar tags ``compare_ms/<category>`` (the step
        and each category non-zero on either side, ms) at TensorBoard step = global rank, so the two overlay
        rank by rank; the ``all ranks`` means under ``compare_ms_all_ranks/<category>`` at step 0; and in the
        root run the markdown report (``compare/report``, the text plugin)."""
        from shardline.profiling.present.tensorboard import scalar_value, text_value, write_events

        logdir = Path(logdir)
        rows = self._shown()
        for side, column in (("predicted", "predicted_s"), ("measured", "measured_s")):
            events = []
            for rank, part in rows.groupby("rank", sort=True):
                family = "compare_ms_all_ranks" if rank == ALL_RANKS else "compare_ms"
                values = [scalar_value(f"{family}/{c}", 1e3 * v) for c, v in zip(part["category"], part[column],
                                                                                   strict=True)]
                events.append((0 if rank == ALL_RANKS else int(rank), values))
            write_events(logdir / side, events)
        write_events(logdir, [(0, [text_value("compare/report", self.to_markdown())])])

    def _header(self) -> list[str]:
        lay = self.layout
        degrees = " ".join(f"{k}={getattr(lay, k)}" for k in ("tp", "cp", "dp", "pp", "chunks"))
        which = f"the first {self.warmup} per rank left out as warm-up" if self.warmup else "every recorded step"
        return [f"profile: {self.profile}", f"model: {self.model}, seq {self.seq_len}, cluster: {self.cluster}",
                f"layout: {degrees}, sp={lay.sp}, schedule={lay.schedule}, zero={lay.zero_stage}, "
                f"micro_batches={lay.micro_batches}, micro_batch_size={lay.micro_batch_size}",
                f"measured steps ({which}): {_steps_text(self.steps)}",
                "error = (predicted - measured) / measured"]

    def _shown(self) -> pd.DataFrame:
        """The table's rows of the step and of every category non-zero on either side somewhere."""
        t = self.table
        return t[(t["kind"] == Kind.STEP.value) | t["category"].isin(
            t.loc[(t["predicted_s"] != 0) | (t["measured_ns"] != 0), "category"].unique())]

    def _display_tables(self) -> list[tuple[str, pd.DataFrame]]:
        """The all-ranks and the per-rank table, as display strings: the categories non-zero on either side
        somewhere (plus the step), ms (measured exactly, ``ms_text``) and the error in %."""
        shown = self._shown()
        out = []
        for heading, rows in (("All ranks (mean over ranks and steps)", shown[shown["rank"] == ALL_RANKS]),
                              ("Per rank (mean over its steps)", shown[shown["rank"] != ALL_RANKS])):
            out.append((heading, pd.DataFrame({
                "rank": ["all" if r == ALL_RANKS else str(r) for r in rows["rank"]],
                "pp_rank": ["all" if r == ALL_RANKS else str(r) for r in rows["pp_rank"]],
                "category": rows["category"].to_numpy(),
                "predicted_ms": fixed(1e3 * rows["predicted_s"].to_numpy(), 6),
                "measured_ms": ms_text(rows["measured_ns"].to_numpy()),
                "error_%": fixed(100 * rows["error"].to_numpy(), 1)})))
        return out


_CSS = ("body { font-family: system-ui, sans-serif; margin: 2em; } table { border-collapse: collapse; } "
        "th, td { border: 1px solid #ccc; padding: 2px 6px; text-align: right; } .note { color: #666; }")


def compare(profile_dir: str | Path, model: ModelSpec, layout: PlanLayout, cluster: Cluster, *, seq_len: int,
            warmup: int = 0, **predict_kwargs) -> Comparison:
    """Predicted (``predict_stages(model, layout, cluster, seq_len=seq_len, **predict_kwargs)``) vs measured
    (the profile under ``profile_dir``) per rank and category; see the module docstring. ``warmup``: leading
    measured steps per rank to leave out (default none, as the profiler's summaries)."""
    if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0:
        raise PlanError(f"warmup={warmup!r} must be an integer >= 0 (steps per rank to leave out)")
    predictions = predict_stages(model, layout, cluster, seq_len=seq_len, **predict_kwargs)
    degrees = {k: getattr(layout, k) for k in ("tp", "cp", "dp", "pp")}
    traceset, attribution = _load(profile_dir, degrees)
    world, notes = _world(traceset)
    if world != layout.world:
        raise PlanError(f"profile {profile_dir}: world size {world} but the layout has world {layout.world} "
                        f"(tp={layout.tp} cp={layout.cp} dp={layout.dp} pp={layout.pp})")
    bd = attribution.breakdown
    steps = _chosen_steps(bd, warmup=warmup, profile_dir=profile_dir)
    absent = sorted(set(range(world)) - set(steps))
    if absent:
        notes.append(f"ranks {absent} of the world have no attributed work in the profile: left out")
    if len(set(steps.values())) > 1:
        notes.append("the ranks' measured steps differ (see the steps per rank)")
    notes += list(traceset.warnings)
    pp_of = {rank: coords_of(rank, degrees)["pp"] for rank in steps}
    chosen = _selected(bd, steps)
    frames = [_rows(rows, int(rank), pp_of[int(rank)], [predictions[pp_of[int(rank)]]])
              for rank, rows in chosen.groupby("rank", sort=True)]
    frames.append(_rows(chosen, ALL_RANKS, ALL_RANKS, [predictions[pp_of[rank]] for rank in steps]))
    table = pd.concat(frames, ignore_index=True)
    table["error"] = _relative_error(table["predicted_s"].to_numpy(), table["measured_s"].to_numpy())
    return Comparison(table=table[list(COLUMNS)], steps=steps, predictions=tuple(predictions),
                      profile=str(profile_dir), model=model.name, cluster=cluster.name, layout=layout,
                      seq_len=seq_len, warmup=warmup, notes=tuple(notes))


def _load(profile_dir, degrees: dict[str, int]):
    """The trace set and its attribution; the profiler's errors become a ``PlanError`` (cause kept)."""
    from shardline.profiling.attribution.core import attribute
    from shardline.profiling.table.load import load

    try:
        traceset = load(profile_dir, layout=degrees)
        attribution = attribute(traceset, caller="plan --compare")
    except ProfilingError as exc:
        raise PlanError(f"cannot read the profile {profile_dir}: {exc}") from exc
    if not attribution.working:
        raise PlanError(f"profile {profile_dir}: no rank has work to attribute, so there are no steps to compare "
                        f"(ranks {list(traceset.ranks)})")
    return traceset, attribution


def _world(traceset) -> tuple[int, list[str]]:
    """The world size the traces record (``load`` refuses files that disagree), else one more than the highest
    rank present (with a note)."""
    recorded = {info.get("world_size") for meta in traceset.metadata.values()
                if isinstance(info := meta.get("distributedInfo"), dict)} - {None}
    recorded = {int(w) for w in recorded if str(w).isdigit()}
    if len(recorded) == 1:
        return recorded.pop(), []
    world = max(traceset.ranks) + 1
    return world, [f"the traces record no single world size ({sorted(recorded)}); taken as {world}, one more than "
                   "the highest rank"]


def _chosen_steps(bd: pd.DataFrame, *, warmup: int, profile_dir) -> dict[int, tuple[int, ...]]:
    """rank -> its breakdown's steps in step order, less the first ``warmup``; every rank must keep one."""
    out, empty = {}, {}
    for rank, rows in bd.groupby("rank", sort=True):
        steps = sorted(int(s) for s in rows["step"])
        out[int(rank)] = tuple(steps[warmup:])
        if not out[int(rank)]:
            empty[int(rank)] = len(steps)
    if empty:
        raise PlanError(f"profile {profile_dir}: with warmup={warmup}, ranks {sorted(empty)} keep no measured step "
                        f"(they have {sorted(set(empty.values()))} step(s))")
    return out


def _selected(bd: pd.DataFrame, steps: dict[int, tuple[int, ...]]) -> pd.DataFrame:
    """The breakdown rows of the chosen (rank, step) pairs."""
    pairs = [(rank, step) for rank, chosen in steps.items() for step in chosen]
    return bd[pd.MultiIndex.from_frame(bd[["rank", "step"]].astype(np.int64)).isin(pairs)]


def _rows(rows: pd.DataFrame, rank: int, pp_rank: int, predicted: list[StepPrediction]) -> pd.DataFrame:
    """The comparison rows of ``rank`` from its measured breakdown ``rows`` and ``predicted`` (one prediction
    per rank the rows cover; their mean is the predicted column)."""
    n = len(rows)
    parts = apportioned_mean(rows[list(EXCLUSIVE_COLUMNS)].sum().to_numpy(dtype=np.int64),
                             step_total=int(rows["step_ns"].sum()), n=n)
    overlapped = [(2 * int(rows[c].sum()) + n) // (2 * n) for c in OVERLAP_COLUMNS]  # round half up, in ints
    measured = np.array([*parts, *overlapped, int(parts.sum())], dtype=np.int64)
    prediction = ([_mean([p.time_s[c] for p in predicted]) for c in EXCLUSIVE_COLUMNS]
                  + [_mean([p.overlapped_s[c] for p in predicted]) for c in OVERLAP_COLUMNS]
                  + [_mean([p.step_s for p in predicted])])
    kinds = ([Kind.EXCLUSIVE.value] * len(EXCLUSIVE_COLUMNS) + [Kind.OVERLAPPED.value] * len(OVERLAP_COLUMNS)
             + [Kind.STEP.value])
    return pd.DataFrame({"rank": rank, "pp_rank": pp_rank, "category": [*EXCLUSIVE_COLUMNS, *OVERLAP_COLUMNS, STEP],
                         "kind": kinds, "predicted_s": prediction, "measured_s": measured / 1e9,
                         "measured_ns": measured, "steps": n})


def _mean(values: list[float]) -> float:
    """Mean over the ranks' predictions (one value: that value, exactly)."""
    return values[0] if len(values) == 1 else float(np.mean(values))


def _relative_error(predicted: np.ndarray, measured: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(measured != 0, (predicted - measured) / np.where(measured != 0, measured, 1), np.nan)


def _seconds_text(seconds: float) -> str:
    """Three significant digits in the largest unit that keeps the number >= 1 (s, ms, µs, ns); zero (or under a
    thousandth of a nanosecond: a subtraction's rounding, not time): ``0 s``."""
    if abs(seconds) < 1e-12:
        return "0 s"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(seconds) >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds * 1e9:.3g} ns"


def _line(name: str, row: pd.Series) -> str:
    error = "nothing measured" if pd.isna(row["error"]) else f"error {100 * row['error']:+.0f}%"
    return (f"{name}: predicted {_seconds_text(row['predicted_s'])}, measured {_seconds_text(row['measured_s'])} "
            f"({error})")


def _steps_text(steps: dict[int, tuple[int, ...]]) -> str:
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank, chosen in steps.items():
        groups.setdefault(chosen, []).append(rank)
    return "; ".join(f"rank{'s' * (len(ranks) > 1)} {_span(ranks)}: step{'s' * (len(chosen) > 1)} "
                     f"{', '.join(map(str, chosen))}" for chosen, ranks in groups.items())


def _span(ranks: list[int]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)) else \
        ", ".join(map(str, ranks))


__all__ = ["ALL_RANKS", "COLUMNS", "Comparison", "Kind", "STEP", "compare"]
