"""``write_tensorboard(traceset, *, logdir)``: the per-step attribution as stock TensorBoard views, plus the data
of shardline's own TensorBoard plugin. Torch-free: events are written with TensorBoard's ``EventFileWriter`` and
its summary protos (no TensorFlow, no ``torch.utils.tensorboard``).

What lands where (``R`` a global rank, ``s`` = ``step_offset`` + the trace's ``ProfilerStep`` number)::

    <logdir>/rank{R}/events.*     scalars, step s, one run per rank so TensorBoard overlays the ranks:
        step_time_ms/total            the step time
        step_time_ms/<label>          each exclusive part of ``breakdown`` (labels non-zero somewhere)
        exposed_ms/<comm>             exposed time of a communication category (= its exclusive column)
        overlapped_ms/<comm>          the same category's time under compute (``overlapped_<comm>``)
        overlap_ratio                 time(compute ∩ comm) / time(comm) (steps with communication only)
    <logdir>/events.*             the run "." (as ``SummaryWriter.add_hparams(..., run_name=".")`` writes it):
        custom_scalars__config__      a custom-scalars layout (Multiline and Margin charts) over the tags above
        step_time_over_ranks_ms/{mean,min,max}   the spread over ranks of each step (the Margin chart)
        breakdown/stacked             PNG, the stacked breakdown of every rank and step (``plots``)
        breakdown/pipeline_timeline   PNG, the pipeline as executed, when the trace has pipeline annotations
        breakdown/table               markdown table of the window (text plugin)
        bandwidth/summary             the collective-bandwidth section (``report_sections.bandwidth_table``:
                                      busbw per category, dtype, size bucket, group, link; "latency-bound"
                                      under 1 MiB), when the window has collectives
        _hparams_/*  + hparams/step_time_ms   the layout as hparams, the mean step time as its metric
    <logdir>/plugins/shardline/   the plugin's files: ``manifest.json`` listing every window's
        ``window_<s>.json`` (breakdown, per-dimension communication, collective wait/transfer, bubbles, the
        bandwidth summary ``bandwidth.bandwidth_summary``) and
        the traces the plugin may serve (the merged trace of the window, the raw per-rank traces).

Scalar values are float32 in the event file (TensorBoard's ``simple_value``): ms = ns / 1e6 rounded to float32.
Nothing here recomputes the attribution: every number is a column of the frames ``report_sections`` keeps on the
trace set's ``Attribution`` (``breakdown``, ``comm_by_dim``, the matched collectives, ``pipeline_bubbles``),
converted to ms or summed over ranks for display; the markdown table is ``tables.breakdown_table``.
"""

from __future__ import annotations

import enum
import json
import math
import shutil
import time
import warnings
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pandas as pd

from ..analyses.coverage import coverage_note
from ..attribution.core import EXCLUSIVE_COLUMNS, OVERLAP_COLUMNS, attribute
from ..attribution.tables import breakdown_table, pipe_table, shown_parts, tensorboard_style
from ..base.errors import ProfilingError, TraceWarning
from ..base.schema import COMM_CATEGORIES
from ..matching.pipelines import MEASURED_METHODS
from ..readers import Format, sniff
from . import plots
from .display import bandwidth_table, display_tables
from .merge import merged_trace
from .report_sections import Section, report_sections

PLUGIN_NAME = "shardline"
MANIFEST = "manifest.json"
#: Layout keys carried as hparams, in this order (others in a given layout are kept after them).
LAYOUT_KEYS = ("tp", "pp", "dp", "cp", "sp", "zero_stage", "micro_batches", "schedule", "world_size")


class TensorBoardError(ProfilingError, ValueError):
    """Bad input to the TensorBoard writer; the message names the offending value."""


class Family(str, enum.Enum):
    """Scalar tag families (a tag is ``<family>/<name>``, or the family alone)."""

    STEP_TIME = "step_time_ms"
    EXPOSED = "exposed_ms"
    OVERLAPPED = "overlapped_ms"
    OVERLAP_RATIO = "overlap_ratio"
    OVER_RANKS = "step_time_over_ranks_ms"
    HPARAM_METRIC = "hparams/step_time_ms"


class ImageTag(str, enum.Enum):
    STACKED = "breakdown/stacked"
    PIPELINE = "breakdown/pipeline_timeline"


TEXT_TAG = "breakdown/table"
BANDWIDTH_TAG = "bandwidth/summary"
COVERAGE_TAG = "diagnostics/comm_coverage"
WHY_TAG = "diagnostics/findings_critical_path_idle"


def write_tensorboard(traceset, *, logdir: str | Path, step_offset: int = 0, layout: Mapping | None = None,
                      table: pd.DataFrame | None = None) -> Path:
    """Write one profiled window (a ``TraceSet``) as TensorBoard event files and plugin data under ``logdir``.

    ``step_offset`` is added to every step number (windows of one run keep distinct steps). ``layout`` is the
    parallel layout (e.g. ``HybridParallelStrategy.describe()``): written as hparams, and its tp/cp/dp/pp
    degrees are the layout of the attribution shown (the trace set's own when it was loaded with them).
    ``table``: a breakdown to show instead of the attribution's (by default the attribution's own). Returns
    ``logdir``. Raises :class:`TensorBoardError` for a bad ``step_offset``/``layout`` and when there is nothing
    to attribute.
    """

    if isinstance(step_offset, bool) or not isinstance(step_offset, (int, np.integer)):
        raise TensorBoardError(f"step_offset={step_offset!r} must be an integer")
    if layout is not None and not isinstance(layout, Mapping):
        raise TensorBoardError(f"layout={layout!r} must be a mapping such as strategy.describe()")
    if not hasattr(traceset, "events"):
        raise TensorBoardError(f"write_tensorboard expects a TraceSet, got {type(traceset).__name__}")
    logdir = Path(logdir)
    attribution = attribute(traceset, layout=_degrees(layout), caller="write_tensorboard")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TraceWarning)
        sections = report_sections(attribution, traceset=traceset)
    table = sections.breakdown if table is None else table
    if table.empty:
        raise TensorBoardError(f"nothing to write to {logdir}: the traces hold no work events to attribute")
    table = table.assign(tb_step=table["step"].clip(lower=0).astype(np.int64) + int(step_offset))
    extras = {key: _shift_steps(frame, int(step_offset)) for key, frame in _analyses(sections).items()}
    for rank, rows in table.groupby("rank", sort=True):
        _write_events(logdir / f"rank{int(rank)}", _rank_events(rows, labels=shown_parts(table)))
    _write_events(logdir, _root_events(table, attribution, extras=extras,
                                       layout=_hparams(layout, traceset, extras), coverage=sections.comm_coverage,
                                       bandwidth=bandwidth_markdown(sections), why=_why_markdown(sections)))
    _write_plugin_data(logdir, traceset, table=table, extras=extras, layout=layout,
                       first_step=int(table["tb_step"].min()))
    return logdir


# --- inputs ---------------------------------------------------------------------------------------------------

def _degrees(layout: Mapping | None) -> dict[str, int] | None:
    """The tp/cp/dp/pp degrees of a layout, for the classifier (None when no layout names any)."""
    if layout is None:
        return None
    out = {}
    for key in ("tp", "cp", "dp", "pp"):
        value = layout.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise TensorBoardError(f"layout[{key!r}]={value!r} must be a positive integer")
        out[key] = int(value)
    return out or None


def _analyses(sections) -> dict[str, pd.DataFrame]:
    """The other analyses the views show, from the report's sections: per-dimension comm, collective
    wait/transfer per (rank, step, category), the pipeline bubbles measured (from annotations or matched p2p)."""

    matched = sections.matched
    if matched.empty:  # no collectives in this window
        waits = pd.DataFrame(columns=["rank", "step", "category", "calls", "wait_ns", "transfer_ns"])
    else:
        waits = matched.groupby(["rank", "step", "category"], as_index=False).agg(
            calls=("instance", "size"), wait_ns=("wait_ns", "sum"), transfer_ns=("transfer_ns", "sum"))
    bubbles = sections.bubbles
    if "method" in bubbles:
        bubbles = bubbles[bubbles["method"].isin(MEASURED_METHODS)].reset_index(drop=True)
    return {"comm_by_dim": sections.comm_by_dim, "wait_transfer": waits, "bubbles": bubbles,
            "bandwidth": sections.bandwidth, "critical_path": sections.critical_path, "launch": sections.launch,
            "findings": sections.findings}


def _shift_steps(frame: pd.DataFrame, offset: int) -> pd.DataFrame:
    if "step" not in frame or frame.empty:
        return frame
    step = frame["step"].astype(np.int64)
    return frame.assign(step=step.where(step < 0, step + offset))


def _shown_comms(table: pd.DataFrame) -> list[str]:
    return [c for c in COMM_CATEGORIES if (table[c] != 0).any() or (table[f"overlapped_{c}"] != 0).any()]


# --- events ---------------------------------------------------------------------------------------------------

def _scalar(tag: str, value: float):
    from tensorboard.compat.proto import summary_pb2

    return summary_pb2.Summary.Value(tag=tag, simple_value=float(value))


def _rank_events(rows: pd.DataFrame, *, labels: list[str]) -> list[tuple[int, list]]:
    """(step, summary values) for one rank's rows: the step-time parts and the exposed/overlapped split."""
    comms = _shown_comms(rows)
    out = []
    for row in rows.itertuples(index=False):  # one iteration per (rank, step): a handful of rows
        values = [_scalar(f"{Family.STEP_TIME.value}/total", row.step_ns / 1e6)]
        values += [_scalar(f"{Family.STEP_TIME.value}/{label}", getattr(row, label) / 1e6) for label in labels]
        values += [_scalar(f"{Family.EXPOSED.value}/{c}", getattr(row, c) / 1e6) for c in comms]
        values += [_scalar(f"{Family.OVERLAPPED.value}/{c}", getattr(row, f"overlapped_{c}") / 1e6) for c in comms]
        if not math.isnan(row.overlap_ratio):
            values.append(_scalar(Family.OVERLAP_RATIO.value, row.overlap_ratio))
        out.append((int(row.tb_step), values))
    return out


def bandwidth_markdown(sections) -> str:
    """The bandwidth section as markdown (its note and ``report_sections.bandwidth_table``); "" without
    collectives."""

    if sections.bandwidth.empty:
        return ""
    note = sections.notes.get(Section.BANDWIDTH, "")
    return (note + "\n\n" if note else "") + pipe_table(bandwidth_table(sections.bandwidth)) + "\n"


def _why_markdown(sections) -> str:
    """The critical path (its lines and table) and the idle by cause, as the report sections show them."""

    tables = display_tables(sections)
    parts = []
    for section, heading in ((Section.FINDINGS, "Findings"), (Section.CRITICAL_PATH, "Critical path"),
                             (Section.IDLE, "Idle by cause")):
        note = sections.notes.get(section, "")
        shown = tables.get(section, [])
        if note or shown:
            parts.append(f"### {heading}\n\n" + "\n\n".join(
                ([note.replace("; ", "\n\n")] if note else []) + [pipe_table(t) for _, t in shown]))
    return "\n\n".join(parts) + ("\n" if parts else "")


def _root_events(table: pd.DataFrame, attribution, *, extras: dict, layout: dict,
                 coverage: pd.DataFrame | None = None, bandwidth: str = "", why: str = "") -> list[tuple[int, list]]:
    """The run "." : layout, spread over ranks, images, the markdown table, hparams, the communication-
    coverage findings (``report_sections.comm_coverage``) as text when there are any, the bandwidth
    section's markdown (``bandwidth_markdown``) and the critical path with idle by cause when given."""
    first = int(table["tb_step"].min())
    events = [(first, [_custom_scalars_layout(table)])]
    spread = table.groupby("tb_step")["step_ns"].agg(["mean", "min", "max"])
    for step, row in spread.iterrows():
        events.append((int(step), [_scalar(f"{Family.OVER_RANKS.value}/{k}", row[k] / 1e6)
                                   for k in ("mean", "min", "max")]))
    events.append((first, [_text(TEXT_TAG, markdown_table(table))]))
    if coverage is not None and len(coverage):

        events.append((first, [_text(COVERAGE_TAG, coverage_note(coverage) + "\n\n" + pipe_table(
            coverage.astype(str), right_aligned=False) + "\n")]))
    if bandwidth:
        events.append((first, [_text(BANDWIDTH_TAG, bandwidth)]))
    if why:
        events.append((first, [_text(WHY_TAG, why)]))
    events.append((first, _images(table, attribution, has_pipeline=not extras["bubbles"].empty)))
    events += [(first, [value]) for value in _hparams_values(layout)]
    events.append((first, [_scalar(Family.HPARAM_METRIC.value, table["step_ns"].mean() / 1e6)]))
    return [(step, values) for step, values in events if values]


def _write_events(folder: Path, events: list[tuple[int, list]]) -> None:
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    folder.mkdir(parents=True, exist_ok=True)
    writer = EventFileWriter(str(folder), flush_secs=3600)
    try:
        now = time.time()
        for step, values in events:
            writer.add_event(event_pb2.Event(wall_time=now, step=step, summary=summary_pb2.Summary(value=values)))
        writer.flush()
    finally:
        writer.close()


def _string_tensor(payload: bytes | str):
    from tensorboard.compat.proto import tensor_pb2, tensor_shape_pb2, types_pb2

    data = payload.encode() if isinstance(payload, str) else payload
    return tensor_pb2.TensorProto(dtype=types_pb2.DT_STRING, string_val=[data],
                                  tensor_shape=tensor_shape_pb2.TensorShapeProto())


def _text(tag: str, markdown: str):
    from tensorboard.compat.proto import summary_pb2
    from tensorboard.plugins.text import metadata

    return summary_pb2.Summary.Value(tag=tag, metadata=metadata.create_summary_metadata(display_name=tag,
                                                                                        description=""),
                                     tensor=_string_tensor(markdown))


#: The event helpers for other writers of shardline's TensorBoard views (``shardline plan --compare``).
scalar_value, text_value, write_events = _scalar, _text, _write_events


def markdown_table(table: pd.DataFrame) -> str:
    """The window as a markdown table (``tables.breakdown_table``): step time and each non-zero part in ms
    (three decimals, six when a step is shorter than 1 ms), overlap in %."""
    digits = 3 if table["step_ns"].min() >= 1_000_000 else 6  # sub-ms steps keep their ns
    rows = table.sort_values(["rank", "tb_step"])
    shown = breakdown_table(rows.assign(step=rows["tb_step"]), style=tensorboard_style(digits))
    return ("Exclusive parts (exposed communication) sum to the step time.\n\n"
            + pipe_table(shown, right_aligned=True) + "\n")


def _custom_scalars_layout(table: pd.DataFrame):
    from tensorboard.compat.proto import summary_pb2
    from tensorboard.plugins.custom_scalar import layout_pb2, metadata

    def multiline(title: str, regex: str):
        return layout_pb2.Chart(title=title, multiline=layout_pb2.MultilineChartContent(tag=[regex]))

    over = Family.OVER_RANKS.value
    margin = layout_pb2.Chart(title="step time over ranks (mean, min..max) [ms]", margin=layout_pb2.MarginChartContent(
        series=[layout_pb2.MarginChartContent.Series(value=f"{over}/mean", lower=f"{over}/min",
                                                     upper=f"{over}/max")]))
    step = [multiline("step time parts [ms]", rf"^{Family.STEP_TIME.value}/"), margin]
    comm = [multiline("exposed communication [ms]", rf"^{Family.EXPOSED.value}/"),
            multiline("overlapped communication [ms]", rf"^{Family.OVERLAPPED.value}/"),
            multiline("overlap ratio", rf"^{Family.OVERLAP_RATIO.value}$")]
    layout = layout_pb2.Layout(category=[layout_pb2.Category(title="shardline: step time", chart=step),
                                         layout_pb2.Category(title="shardline: communication", chart=comm)])
    return summary_pb2.Summary.Value(tag=metadata.CONFIG_SUMMARY_TAG, metadata=metadata.create_summary_metadata(),
                                     tensor=_string_tensor(layout.SerializeToString()))


def _images(table: pd.DataFrame, attribution, *, has_pipeline: bool) -> list:
    """PNG images from ``plots``: the stacked breakdown, and the pipeline timeline when there is one."""
    from tensorboard.compat.proto import summary_pb2


    pngs = [(ImageTag.STACKED, plots.breakdown_figure(table.drop(columns="tb_step"), title="step-time breakdown"))]
    if has_pipeline:
        pngs.append((ImageTag.PIPELINE, plots.pipeline_timeline_figure(attribution, title="pipeline")))
    values = []
    for tag, png in pngs:
        width, height = _png_size(png)
        values.append(summary_pb2.Summary.Value(tag=tag.value, image=summary_pb2.Summary.Image(
            height=height, width=width, colorspace=4, encoded_image_string=png)))
    return values


def _png_size(png: bytes) -> tuple[int, int]:
    if png[:8] != b"\x89PNG\r\n\x1a\n":
        raise TensorBoardError(f"plots returned {len(png)} bytes that are not a PNG")
    return int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")


# --- hparams --------------------------------------------------------------------------------------------------

def _hparams(layout: Mapping | None, traceset, extras: dict) -> dict:
    """The layout to record: the given one, else what the traces tell (world size, pipeline p and m)."""
    values: dict = {}
    if layout is not None:
        values.update({k: v for k, v in layout.items() if v is not None})
    values.setdefault("world_size", len(traceset.ranks))
    bubbles = extras["bubbles"]
    if not bubbles.empty:
        values.setdefault("pp", int(bubbles["p"].max()))
        values.setdefault("micro_batches", int(bubbles["m"].max()))
        values.setdefault("schedule", str(bubbles["schedule"].iloc[0]))
    order = [k for k in LAYOUT_KEYS if k in values] + sorted(k for k in values if k not in LAYOUT_KEYS)
    return {k: values[k] for k in order}


def _hparams_values(hparams: dict) -> list:
    """The three hparams summaries ``SummaryWriter.add_hparams`` writes (experiment, session start, end)."""
    from tensorboard.compat.proto import summary_pb2
    from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2

    start = plugin_data_pb2.SessionStartInfo()
    infos = []
    for key, value in hparams.items():
        if isinstance(value, bool):
            start.hparams[key].bool_value = value
            kind = api_pb2.DATA_TYPE_BOOL
        elif isinstance(value, (int, float, np.integer, np.floating)):
            start.hparams[key].number_value = float(value)
            kind = api_pb2.DATA_TYPE_FLOAT64
        elif isinstance(value, (str, enum.Enum)):
            start.hparams[key].string_value = value.value if isinstance(value, enum.Enum) else value
            kind = api_pb2.DATA_TYPE_STRING
        else:
            raise TensorBoardError(f"layout[{key!r}]={value!r}: hparams take numbers, strings or booleans")
        infos.append(api_pb2.HParamInfo(name=key, type=kind))
    experiment = api_pb2.Experiment(hparam_infos=infos, metric_infos=[
        api_pb2.MetricInfo(name=api_pb2.MetricName(tag=Family.HPARAM_METRIC.value))])
    end = plugin_data_pb2.SessionEndInfo(status=api_pb2.STATUS_SUCCESS)

    def value(tag: str, **content):
        data = plugin_data_pb2.HParamsPluginData(version=metadata.PLUGIN_DATA_VERSION, **content)
        meta = summary_pb2.SummaryMetadata(plugin_data=summary_pb2.SummaryMetadata.PluginData(
            plugin_name=metadata.PLUGIN_NAME, content=data.SerializeToString()))
        return summary_pb2.Summary.Value(tag=tag, metadata=meta)

    return [value(metadata.EXPERIMENT_TAG, experiment=experiment),
            value(metadata.SESSION_START_INFO_TAG, session_start_info=start),
            value(metadata.SESSION_END_INFO_TAG, session_end_info=end)]


# --- plugin data ----------------------------------------------------------------------------------------------

def records(frame: pd.DataFrame) -> list[dict]:
    """JSON-ready rows: numpy scalars as Python numbers, NaN as null."""
    out = []
    for row in frame.to_dict(orient="records"):
        clean = {}
        for key, value in row.items():
            if isinstance(value, np.generic):
                value = value.item()
            if isinstance(value, float) and math.isnan(value):
                value = None
            clean[str(key)] = value
        out.append(clean)
    return out


def _write_plugin_data(logdir: Path, traceset, *, table: pd.DataFrame, extras: dict, layout, first_step: int):
    """``window_<s>.json`` and the traces of this window under ``plugins/shardline``, listed in the manifest."""

    folder = logdir / "plugins" / PLUGIN_NAME
    folder.mkdir(parents=True, exist_ok=True)
    name = f"window_{first_step}"
    traces = _window_traces(logdir, folder, traceset, name=name)
    window = {"version": 1, "name": name, "first_step": first_step,
              "layout": {k: (v.value if isinstance(v, enum.Enum) else v) for k, v in (layout or {}).items()},
              "exclusive_columns": list(EXCLUSIVE_COLUMNS), "overlap_columns": list(OVERLAP_COLUMNS),
              "breakdown": records(table.drop(columns="step").rename(columns={"tb_step": "step"})),
              **{key: records(frame) for key, frame in extras.items()}}
    (folder / f"{name}.json").write_text(json.dumps(window))
    manifest_path = folder / MANIFEST
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {"version": 1, "windows": []}
    manifest["windows"] = [w for w in manifest["windows"] if w["name"] != name]
    manifest["windows"].append({"name": name, "first_step": first_step, "data": f"{name}.json",
                                "traces": traces})
    manifest["windows"].sort(key=lambda w: w["first_step"])
    manifest_path.write_text(json.dumps(manifest, indent=1))


def _window_traces(logdir: Path, folder: Path, traceset, *, name: str) -> list[dict]:
    """The traces the plugin may serve, as paths relative to ``logdir``: the merged trace of the window and
    every raw Kineto trace (kept in place inside ``logdir``, else copied in)."""

    merged = merged_trace(traceset, path=folder / f"{name}.merged.trace.json.gz")
    out = [{"label": "all ranks (merged)", "kind": "merged",
            "path": Path(merged).resolve().relative_to(logdir.resolve()).as_posix()}]
    root = logdir.resolve()
    for file, ranks in sorted(traceset.files.items()):
        file = Path(file).resolve()
        if sniff(file) is not Format.KINETO:
            continue
        if not file.is_relative_to(root):
            copy = folder / "traces" / name / file.name
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(file, copy)
            file = copy.resolve()
        label = "rank " + ",".join(str(r) for r in ranks) if ranks else file.name
        out.append({"label": label, "kind": "raw", "path": file.relative_to(root).as_posix()})
    return out
