"""``shardline profile report | diff | merge | whatif``: breakdowns, reports, run diffs, merged traces, what-ifs.

``add_commands(subparsers)`` registers ``profile`` on the ``shardline`` console script (each leaf parser sets
``func(args) -> int``); ``main(argv)`` runs the same parser standalone, for tests and ``python -m``.

- ``profile report PATH [-o FILE] [--format F]``: ``table`` (terminal, default), ``csv`` / ``json`` /
  ``parquet`` (the breakdown, integer ns, for machines), ``md`` / ``html`` (every report section; the HTML is one
  self-contained file), ``tensorboard`` (``-o LOGDIR``, written by ``shardline.profiling.present.tensorboard``). Without
  ``--format`` the format follows the suffix of ``-o`` (``.html``, ``.md``, ``.csv``, ``.json``, ``.parquet``).
- ``profile diff BEFORE AFTER``: per rank and category, the mean-step time before, after and the delta; the deltas
  sum to the step-time delta exactly (``diff.diff_breakdowns``). Two single-rank runs compare whatever their rank
  numbers; ``--rank A:B`` pairs ranks explicitly; captures without step markers are flagged as not comparable.
- ``profile merge PATH -o FILE``: all ranks in one Chrome trace (``merge.merged_trace``).
- ``profile whatif PATH --scenario S [--scenario S2 ...]``: the step time per rank and step predicted under each
  scenario (``scenarios.what_if``; ``S`` as ``what_if.Scenario.parse`` reads it, e.g. ``comm_faster:k=2``).
- every command: ``--rules FILE`` (YAML/JSON communication rules before the built-in ones, ``read_rules``) and
  ``--rank N`` (the rank of a single file that records none; without it such a file is an error, status 2).

Every report format shows the communication-coverage diagnostic (``report_sections.comm_coverage``): the
terminal below the table, md/html/tensorboard as a section, csv/json/parquet as one note on stderr.

Presentation only: the numbers come from the analyses unchanged. Our errors become one line on stderr and exit
status 2. A progress bar (tqdm, on stderr) shows when stderr is a terminal or with ``--progress``.

One file: it is the whole ``shardline profile`` command tree (one parser, its four runners and the loading,
progress and error handling they share), presentation only.
"""

from __future__ import annotations

import argparse
import enum
import html
import sys
import time
import warnings
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

import pandas as pd

from ..base.errors import ProfilingError, TraceWarning

# Lazy entry points: this command tree is built with every ``shardline`` command (``recipes.cli`` makes one
# parser of all of them), so the loaders, analyses and renderers a runner needs are imported inside it, on first
# use, and ``shardline fit --help`` never loads them (matplotlib, through the HTML report, above all).


class ReportFormat(str, enum.Enum):
    TABLE = "table"
    CSV = "csv"
    JSON = "json"
    MD = "md"
    PARQUET = "parquet"
    HTML = "html"
    TENSORBOARD = "tensorboard"


class DiffFormat(str, enum.Enum):
    TABLE = "table"
    CSV = "csv"
    JSON = "json"
    MD = "md"


_SUFFIX_FORMATS = {".html": ReportFormat.HTML, ".htm": ReportFormat.HTML, ".md": ReportFormat.MD,
                   ".csv": ReportFormat.CSV, ".json": ReportFormat.JSON, ".parquet": ReportFormat.PARQUET}
#: Formats rendered from every report section rather than the breakdown alone.
_SECTION_FORMATS = (ReportFormat.MD, ReportFormat.HTML)
#: Formats that show the collective bandwidth (the others carry the breakdown only).
_BANDWIDTH_FORMATS = (*_SECTION_FORMATS, ReportFormat.TABLE, ReportFormat.TENSORBOARD)


class UsageError(ProfilingError):
    """A combination of options that cannot work (e.g. ``--format parquet`` without ``-o``)."""


def add_commands(subparsers) -> None:
    """Add ``profile report``, ``diff``, ``merge`` and ``whatif`` to an ``argparse`` subparsers object."""
    profile = subparsers.add_parser("profile", help="analyse profiler traces")
    commands = profile.add_subparsers(dest="profile_command", metavar="COMMAND")
    commands.required = True
    report = commands.add_parser("report", help="per-rank, per-step time breakdown and report of a trace")
    report.add_argument("path", type=Path, help="trace file, folder of per-rank traces, or run folder")
    report.add_argument("--format", choices=[f.value for f in ReportFormat], default=None,
                        help="table (terminal); csv, json, parquet (the breakdown, integer ns); md, html (the full "
                             "report); tensorboard (-o LOGDIR). Default: from the -o suffix, else table")
    report.add_argument("-o", "--output", type=Path, default=None, help="write here instead of stdout")
    report.add_argument("--op-args", action="store_true",
                        help="read the op args (dtypes, Input Dims, split sizes) whatever the traces' size")
    report.add_argument("--timings", action="store_true",
                        help="print the seconds each analysis took (load, breakdown, idle causes, critical path, "
                             "findings with their what-ifs, ...) to stderr")
    report.add_argument("--executor", choices=["local", "ray", "dask"], default=None,
                        help="analyse each rank in a worker (scale.analyze) on this executor: the local process "
                             "pool, Ray or Dask; the driver holds only the communication rows. Reports many-rank "
                             "distributions; csv/json/parquet carry the full per-rank breakdown")
    report.add_argument("--address", default=None,
                        help="with --executor ray/dask: the cluster (ray.init address, Dask scheduler); default "
                             "a local one")
    report.add_argument("--workers", type=int, default=None,
                        help="with --executor local/dask: worker processes (default: the cores)")
    _load_flags(report)
    _progress_flag(report)
    report.set_defaults(func=run_report)

    diff = commands.add_parser("diff", help="what changed between two runs, per rank and category")
    diff.add_argument("before", type=Path)
    diff.add_argument("after", type=Path)
    diff.add_argument("--format", choices=[f.value for f in DiffFormat], default=DiffFormat.TABLE.value)
    diff.add_argument("-o", "--output", type=Path, default=None, help="write here instead of stdout")
    diff.add_argument("--rank", action="append", default=None, metavar="N|A:B",
                      help="N: the rank of a trace file that does not record its own (both runs); A:B: compare "
                           "the before run's rank A with the after run's rank B (repeat, or A:B,C:D, for several "
                           "pairs; a single pair is also the rank of a file that records none). Two single-rank "
                           "runs compare whatever their rank numbers without it")
    _load_flags(diff, rank=False)
    _progress_flag(diff)
    diff.set_defaults(func=run_diff)

    merge = commands.add_parser("merge", help="all ranks in one Chrome-trace JSON (Perfetto, chrome://tracing)")
    merge.add_argument("path", type=Path)
    merge.add_argument("-o", "--output", type=Path, required=True, help="the merged trace (.json or .json.gz)")
    merge.add_argument("--op-args", action="store_true",
                       help="read the op args (dtypes, Input Dims, split sizes) whatever the traces' size")
    _load_flags(merge)
    _progress_flag(merge)
    merge.set_defaults(func=run_merge)

    whatif = commands.add_parser("whatif", help="predicted step time per rank and step under a scenario")
    whatif.add_argument("path", type=Path)
    whatif.add_argument("--scenario", action="append", required=True, metavar="S",
                        help="overlap[:dim=D,category=C] | comm_faster:k=K[,dim=D,category=C] | "
                             "no_straggler[:rank=R] | no_host_bound | pipeline:m=M[,v=V,schedule=gpipe|1f1b|"
                             "interleaved,keep=microbatch|batch]; give several to compare")
    whatif.add_argument("--format", choices=[f.value for f in DiffFormat if f is not DiffFormat.MD],
                        default=DiffFormat.TABLE.value)
    whatif.add_argument("-o", "--output", type=Path, default=None, help="write here instead of stdout")
    _load_flags(whatif)
    _progress_flag(whatif)
    whatif.set_defaults(func=run_whatif)


def _load_flags(parser, *, rank: bool = True) -> None:
    parser.add_argument("--rules", type=Path, default=None, metavar="FILE",
                        help="YAML or JSON list of communication rules {pattern, category, note, literals}; they "
                             "come before the built-in rules (first match wins) and replace one with the same "
                             "pattern")
    if rank:  # ``profile diff`` has its own --rank (N, or before:after pairs)
        parser.add_argument("--rank", type=int, default=None, metavar="N",
                            help="the rank of a single trace file that does not record its own")


def read_rules(path: Path) -> tuple:
    """The rules of a ``--rules`` file followed by the built-in ones they do not replace (same pattern).

    The file holds a list of mappings, or a mapping with a ``rules`` list; each mapping has ``pattern`` (regex)
    and ``category`` (a communication category, e.g. ``all_to_all``), optionally ``note`` and ``literals``."""
    import yaml

    from ..table.kinds import Category
    from ..table.names import DEFAULT_RULES, CommRule

    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))  # JSON is YAML
    except yaml.YAMLError as exc:
        raise UsageError(f"--rules {path}: not YAML or JSON: {' '.join(str(exc).split())}") from None
    except RecursionError:  # the parser recurses per level, as the trace readers' JSON decoders do
        raise UsageError(f"--rules {path}: nested too deep to read (lists or mappings more than about "
                         f"{sys.getrecursionlimit()} levels deep; a rules file nests two)") from None
    if isinstance(data, dict) and "rules" in data:
        data = data["rules"]
    if not isinstance(data, list) or not data:
        raise UsageError(f"--rules {path}: expected a non-empty list of rules (or a mapping with a 'rules' list)")
    rules = []
    for i, entry in enumerate(data):
        if not isinstance(entry, dict) or not isinstance(entry.get("pattern"), str) or "category" not in entry:
            raise UsageError(f"--rules {path}: rule {i} must be a mapping with a 'pattern' string and a 'category'")
        unknown = sorted(set(entry) - {"pattern", "category", "note", "literals"})
        if unknown:
            raise UsageError(f"--rules {path}: rule {i} has unknown keys {unknown}")
        try:
            category = Category(str(entry["category"]))
        except ValueError:
            raise UsageError(f"--rules {path}: rule {i}: unknown category {entry['category']!r}") from None
        literals = entry.get("literals") or ()
        if isinstance(literals, str) or not all(isinstance(t, str) for t in literals):
            raise UsageError(f"--rules {path}: rule {i}: 'literals' must be a list of strings")
        try:
            rules.append(CommRule(entry["pattern"], category, str(entry.get("note", "")), tuple(literals)))
        except ProfilingError as exc:
            raise UsageError(f"--rules {path}: rule {i}: {exc}") from None
    mine = {r.pattern for r in rules}
    return (*rules, *(r for r in DEFAULT_RULES if r.pattern not in mine))


#: Above this many bytes of trace files the report and merge commands read no op args unless ``--op-args``:
#: they keep the decode on the native scanner (faster than msgspec's, and no op-arg columns in memory); the
#: bandwidth then takes sizes from the kernels' own element counts and says dtype "" (the op args give the
#: dtype, ``Input Dims`` sizes of older PyTorch, and all-to-all-v split sizes).
OP_ARGS_MAX_BYTES = 256 << 20


def _trace_bytes(path: Path) -> int:
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def load_traces(path: Path, args: argparse.Namespace, *, op_args: bool = False):
    """``load`` with the ``--rank`` and ``--rules`` of the command line; ``op_args``: the output shows the
    collective bandwidth, whose sizes and dtypes come from the op args (read in the same decode) -- for sets
    up to ``OP_ARGS_MAX_BYTES``, or any size with ``--op-args`` (a note on stderr says when they were left
    out)."""
    from ..base.errors import MissingRankError
    from ..table.classify import classify_in_place
    from ..table.load import load

    rules = read_rules(args.rules) if getattr(args, "rules", None) is not None else None
    skipped = False
    if op_args and not getattr(args, "op_args", False):
        size = _trace_bytes(path)
        if size > OP_ARGS_MAX_BYTES:
            op_args, skipped = False, True
            print(f"shardline profile: note: {size / 1e6:.0f} MB of traces: op args (dtypes, Input Dims, split "
                  "sizes) not read, to keep the fast decoder; --op-args reads them", file=sys.stderr)
    try:
        traceset = load(path, rank=getattr(args, "rank", None), classify=rules is None, op_args=op_args)
    except MissingRankError as exc:
        raise MissingRankError(f"{exc}; on the command line: --rank N") from None
    if rules is not None:
        classify_in_place(traceset.events, rules=rules, layout=traceset.layout)
    if skipped:  # and no analysis reads the files again for them
        object.__setattr__(traceset, "reread_op_args", False)
    return traceset


def _progress_flag(parser) -> None:
    parser.add_argument("--progress", action="store_true", default=None,
                        help="show a progress bar (default: when stderr is a terminal)")


def _wants_progress(args) -> bool:
    return bool(args.progress) if args.progress is not None else sys.stderr.isatty()


@contextmanager
def _stages(names: Sequence[str], *, enabled: bool):
    """A progress bar over named stages: it names the stage under way; ``done()`` completes it and names the
    next one."""
    if not enabled:
        yield lambda: None
        return
    from tqdm import tqdm

    bar = tqdm(total=len(names), unit="stage", leave=False, file=sys.stderr, desc=names[0])

    def done() -> None:
        bar.update()
        if bar.n < len(names):
            bar.set_description(names[bar.n])

    try:
        yield done
    finally:
        bar.close()


def _print_timings(traceset, *, fmt: ReportFormat, loaded: float, total: float) -> None:
    """``--timings``: where the report's time went, one line on stderr (seconds per analysis; rendering and
    writing are the rest of the total). The machine formats compute the breakdown only."""
    from ..attribution.core import attribute

    attribution = attribute(traceset, caller="report")
    if fmt in _SECTION_FORMATS or fmt is ReportFormat.TABLE:
        from .report_sections import report_sections

        stages = dict(report_sections(attribution, traceset=traceset).timings)  # the ones just computed
    else:
        stages = {"idle_causes": attribution.timings.get("idle_causes", 0.0)}
    parts = [f"load {loaded:.3f}"] + [f"{name} {value:.3f}" for name, value in stages.items()]
    print(f"shardline profile report: seconds: {', '.join(parts)}; total {total:.3f}", file=sys.stderr)


def _fail(command: str, exc: BaseException) -> int:
    print(f"shardline profile {command}: error: {exc}", file=sys.stderr)
    return 2


def report_format(args: argparse.Namespace) -> ReportFormat:
    """The explicit ``--format``, else the one the ``-o`` suffix names, else the terminal table."""
    if args.format is not None:
        return ReportFormat(args.format)
    if args.output is not None:
        return _SUFFIX_FORMATS.get(args.output.suffix.lower(), ReportFormat.TABLE)
    return ReportFormat.TABLE


def run_report(args: argparse.Namespace) -> int:
    """Load, attribute, render."""
    fmt = report_format(args)
    try:
        if fmt in (ReportFormat.PARQUET, ReportFormat.TENSORBOARD) and args.output is None:
            raise UsageError(f"--format {fmt.value} needs -o " + ("FILE" if fmt is ReportFormat.PARQUET else
                                                                   "LOGDIR"))
        if args.executor is not None or args.address is not None or args.workers is not None:
            return _report_at_scale(args, fmt)
        with _stages(["loading", "analysing", "writing"], enabled=_wants_progress(args)) as done:
            started = time.perf_counter()
            traceset = load_traces(args.path, args, op_args=fmt in _BANDWIDTH_FORMATS)
            loaded = time.perf_counter() - started
            done()
            if fmt is ReportFormat.TENSORBOARD:
                return _write_tensorboard(traceset, logdir=args.output)
            text = _render_report(traceset, fmt=fmt, source=str(args.path), progress=_wants_progress(args))
            done()
            if args.timings:
                _print_timings(traceset, fmt=fmt, loaded=loaded, total=time.perf_counter() - started)
            if fmt is ReportFormat.PARQUET:
                _write_parquet(text, args.output)
            else:
                _emit(text, args.output)
            done()
    except (ProfilingError, OSError) as exc:
        return _fail("report", exc)
    return 0


def _report_at_scale(args: argparse.Namespace, fmt: ReportFormat) -> int:
    """``report --executor``: every rank analysed in a worker (``scale.analyze``); the distributions over the
    ranks (``rank_summary``) in table/md/html, with the per-rank table too up to ``rank_summary.MANY_RANKS``
    ranks; csv/json/parquet: the full per-rank breakdown."""
    from ..analyses import rank_summary
    from ..attribution.scale import analyze
    from ..base.errors import AttributionError
    from ..matching.collectives import match_collectives

    if args.executor is None:
        raise UsageError("--address and --workers go with --executor local|ray|dask")
    if fmt is ReportFormat.TENSORBOARD:
        raise UsageError("--executor writes table, md, html, csv, json or parquet, not tensorboard")
    if args.rules is not None or args.rank is not None:
        raise UsageError("--executor reads every file with the built-in rules and the ranks the files record: "
                         "--rules and --rank are not supported with it")
    if args.address is not None and args.executor == "local":
        raise UsageError("--address names a Ray or Dask cluster: it needs --executor ray or dask")
    started = time.perf_counter()
    result = analyze(args.path, executor=args.executor, address=args.address, workers=args.workers)
    table = result.breakdown
    if fmt in (ReportFormat.CSV, ReportFormat.JSON, ReportFormat.PARQUET):
        if fmt is ReportFormat.PARQUET:
            _write_parquet(table, args.output)
        else:
            _emit(render(table, fmt=fmt), args.output)
        return 0
    try:
        matched = match_collectives(result.attribution)
    except AttributionError:  # no communication calls in the trace
        matched = None
    kind = {ReportFormat.TABLE: "text", ReportFormat.MD: "md", ReportFormat.HTML: "html"}[fmt]
    title = (f"{args.path}: {len(result.ranks)} ranks, {result.events:,} events read by {args.executor} workers, "
             f"{result.compact_events:,} communication rows at the driver")
    text = rank_summary.summary(table, matched, fmt=kind, title=title)
    if len(result.ranks) <= rank_summary.MANY_RANKS and len(table):  # few ranks: the per-rank table too
        per_rank = render_table(table)
        text += "\n" + (per_rank if fmt is ReportFormat.TABLE else f"```\n{per_rank}```\n" if fmt is ReportFormat.MD
                        else f"<pre>{html.escape(per_rank)}</pre>")
    if fmt is ReportFormat.HTML:
        text = ("<!doctype html><html><head><meta charset='utf-8'><title>shardline report</title></head><body>"
                + text + "</body></html>")
    if args.timings:
        print(f"shardline profile report: analysed in {time.perf_counter() - started:.2f} s", file=sys.stderr)
    _emit(text, args.output)
    return 0


def _render_report(traceset, *, fmt: ReportFormat, source: str, progress: bool):
    """Text of the report in ``fmt``; for parquet, the breakdown frame itself. Every format reads the trace
    set's one ``Attribution``."""
    from ..attribution.core import attribute

    attribution = attribute(traceset, caller="breakdown")
    if fmt in _SECTION_FORMATS:
        from .report_sections import report_sections

        sections = report_sections(attribution, progress=progress, traceset=traceset)
        if fmt is ReportFormat.HTML:
            from .report_html import render_html

            return render_html(sections, events=attribution, sources=(source,))
        from .report_md import render_markdown

        return render_markdown(sections)
    from ..analyses.coverage import comm_coverage

    with warnings.catch_warnings():
        if fmt is ReportFormat.TABLE:  # report_sections below reads both again and prints their warnings, once
            warnings.simplefilter("ignore", TraceWarning)
        table = attribution.breakdown
        coverage = comm_coverage(attribution)
    if fmt is ReportFormat.TABLE:
        from .display import bandwidth_terminal
        from .report_sections import findings_terminal, report_sections, why_terminal

        sections = report_sections(attribution, traceset=traceset)
        _warn_on_stderr(sections)
        return (findings_terminal(sections) + _per_rank_or_distribution(table, sections) + why_terminal(sections)
                + render_coverage(coverage) + bandwidth_terminal(attribution, traceset=traceset))
    if len(coverage):  # the machine formats carry the breakdown only: the finding goes to stderr
        from ..analyses.coverage import coverage_note

        print(f"shardline profile report: note: {coverage_note(coverage)}", file=sys.stderr)
    return table if fmt is ReportFormat.PARQUET else render(table, fmt=fmt)


def _warn_on_stderr(sections) -> None:
    """The trace warnings the report's analyses raised (md/html show them as the breakdown's note; the terminal
    table would drop them): one line on stderr each."""
    for line in sections.warnings:
        print(f"shardline profile report: warning: {line}", file=sys.stderr)


def _per_rank_or_distribution(table: pd.DataFrame, sections) -> str:
    """The terminal's breakdown: a row per rank and step, or beyond ``rank_summary.MANY_RANKS`` ranks the
    distributions over the ranks (the per-rank table is then in ``-o FILE.csv`` / ``.parquet``)."""
    from ..analyses import rank_summary

    if not len(table) or table["rank"].nunique() <= rank_summary.MANY_RANKS:
        return render_table(table)
    return rank_summary.summary(table, sections.matched, fmt="text",
                                title=f"{table['rank'].nunique()} ranks: distributions over the ranks (the per-rank "
                                      "table: -o FILE.csv or .parquet)") + "\n"


def render_coverage(coverage: pd.DataFrame) -> str:
    """The terminal's communication-coverage lines (``report_sections.comm_coverage``); "" when all is covered."""
    if coverage.empty:
        return ""
    from ..analyses.coverage import coverage_note

    lines = ["", f"communication coverage: {coverage_note(coverage)}"]
    for row in coverage.itertuples(index=False):  # one line per (finding, name): a handful
        launched = f"; launched: {row.launched}" if row.launched else ""
        lines.append(f"  {row.finding}: {row.name} [{row.category}] x{row.count} on ranks {row.ranks}{launched}")
    return "\n".join(lines) + "\n"


def _emit(text: str, output: Path | None) -> None:
    if output is None:
        sys.stdout.write(text)
    else:
        output.write_text(text, encoding="utf-8")


def _write_parquet(table: pd.DataFrame, output: Path) -> None:
    table.to_parquet(output, index=False, engine="pyarrow")  # pyarrow: a dependency of shardline


def _write_tensorboard(traceset, *, logdir: Path) -> int:
    from .tensorboard import write_tensorboard

    write_tensorboard(traceset, logdir=logdir)
    return 0


def render(table: pd.DataFrame, *, fmt: ReportFormat) -> str:
    """The breakdown as text in ``fmt`` (table, csv or json)."""
    fmt = ReportFormat(fmt)
    if fmt is ReportFormat.CSV:
        return table.to_csv(index=False)
    if fmt is ReportFormat.JSON:
        return table.to_json(orient="records", indent=1, double_precision=15) + "\n"
    return render_table(table)


def render_table(table: pd.DataFrame) -> str:
    """Terminal table (``tables.breakdown_table``): step time and every non-zero exclusive part in ms, the
    overlap ratio in %."""
    from ..attribution.tables import TERMINAL, TERMINAL_FLOAT, breakdown_table

    if table.empty:
        return "no work events to attribute\n"
    header = ("exclusive parts (exposed communication) sum to step_ms; overlap_% = time(compute ∩ comm) / "
              "time(comm)\n")
    return header + breakdown_table(table, style=TERMINAL).to_string(index=False, float_format=TERMINAL_FLOAT) + "\n"


def run_diff(args: argparse.Namespace) -> int:
    """Load both runs, attribute both, compare (``--rank``: see ``diff_ranks``)."""
    from ..analyses.diff import diff_breakdowns
    from ..attribution.core import attribute

    try:
        ranks, pairs = diff_ranks(getattr(args, "rank", None))
        with _stages(["before", "after", "comparing"], enabled=_wants_progress(args)) as done:
            tables = []
            for path, rank in zip((args.before, args.after), ranks):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # an empty breakdown is refused by the diff, by name
                    run = argparse.Namespace(**{**vars(args), "rank": rank})
                    tables.append(attribute(load_traces(path, run), caller="breakdown").breakdown)
                done()
            result = diff_breakdowns(*tables, pairs=pairs)
            _emit(render_diff(result, fmt=DiffFormat(args.format)), args.output)
            done()
    except (ProfilingError, OSError) as exc:
        return _fail("diff", exc)
    return 0


def diff_ranks(texts) -> tuple[tuple[int | None, int | None], tuple[tuple[int, int], ...] | None]:
    """``profile diff --rank`` values -> (the load rank of the before and after runs' files that record none,
    the rank pairs to compare or None). ``N``: both files' rank; ``A:B`` (one or more): the pairs, and a single
    pair's ranks are also the files' ranks."""
    from ..analyses.diff import parse_pairs

    plain = [t for t in texts or () if ":" not in t]
    pairs = parse_pairs([t for t in texts or () if ":" in t]) or None
    if len(plain) > 1 or (plain and pairs):
        raise UsageError(f"--rank {' '.join(texts)}: give one N, or BEFORE:AFTER pairs, not both")
    if plain:
        try:
            rank = int(plain[0])
        except ValueError:
            raise UsageError(f"--rank {plain[0]!r}: expected a rank N or a pair BEFORE:AFTER") from None
        return (rank, rank), None
    if pairs and len(pairs) == 1:
        return pairs[0], pairs
    return (None, None), pairs


def _share_text(value: float) -> str:
    """A percentage of the table, or "-" where it has no sensible base (NaN)."""
    return "-" if pd.isna(value) else f"{round(value, 1) + 0.0:.1f}"  # + 0.0: no "-0.0"


def render_diff(result, *, fmt: DiffFormat) -> str:
    """The diff table as csv / json (integer ns), markdown or a terminal table (ms, non-zero rows only); the
    shares of the delta where they have a sensible base ("-" elsewhere), and every delta as a share of the
    before step."""
    from ..analyses.diff import ALL_RANKS, explain

    fmt = DiffFormat(fmt)
    table = result.table
    if fmt is DiffFormat.CSV:
        return table.to_csv(index=False)
    if fmt is DiffFormat.JSON:
        return table.to_json(orient="records", indent=1, double_precision=15) + "\n"
    shown = table[(table["before_ns"] != 0) | (table["after_ns"] != 0)]
    crossed = "rank_after" in shown and bool((shown["rank_after"] != shown["rank"]).any())

    def rank_text(before, after) -> str:
        if before == ALL_RANKS:
            return "all"
        return f"{before}->{after}" if crossed and after != before else str(before)

    after_ranks = shown["rank_after"] if "rank_after" in shown else shown["rank"]
    display = pd.DataFrame({"rank": [rank_text(b, a) for b, a in zip(shown["rank"], after_ranks)],
                            "column": shown["column"],
                            "before_ms": shown["before_ns"] / 1e6, "after_ms": shown["after_ns"] / 1e6,
                            "delta_ms": shown["delta_ns"] / 1e6,
                            "delta_%_of_step": (100 * shown["delta_of_step"]).map(_share_text),
                            "share_of_delta_%": (100 * shown["share_of_delta"]).map(_share_text)})
    lines = [explain(result, rank=r) for r in [ALL_RANKS, *sorted(set(table["rank"]) - {ALL_RANKS})]]
    notes = [f"note: {n}" for n in result.notes]
    if fmt is DiffFormat.MD:
        from ..attribution.tables import ms_text, pipe_table

        exact = display.assign(**{f"{c}_ms": ms_text(shown[f"{c}_ns"]) for c in ("before", "after", "delta")})
        return "\n".join(["# shardline profile diff", "", *[f"- {line}" for line in lines + notes], "",
                          pipe_table(exact.astype(str)), ""])
    return "\n".join(lines + notes + ["", display.to_string(index=False, float_format=lambda v: f"{v:.3f}"), ""])


def run_merge(args: argparse.Namespace) -> int:
    from .merge import merged_trace

    try:
        traceset = load_traces(args.path, args, op_args=True)  # the merged trace's args carry busbw
        merged_trace(traceset, path=args.output, progress=_wants_progress(args))
    except (ProfilingError, OSError) as exc:
        return _fail("merge", exc)
    return 0


def run_whatif(args: argparse.Namespace) -> int:
    """Parse the scenarios (a bad one fails before loading), load, predict, render."""
    from ..analyses.what_if import Scenario
    from .scenarios import what_if

    try:
        scenarios = [Scenario.parse(text) for text in args.scenario]
        table = what_if(load_traces(args.path, args), scenarios)
        fmt = DiffFormat(args.format)
        if fmt is DiffFormat.CSV:
            text = table.to_csv(index=False)
        elif fmt is DiffFormat.JSON:
            text = table.to_json(orient="records", indent=1) + "\n"
        else:
            shown = table.assign(rank=table["rank"].map(lambda r: "all" if r == -1 else str(r)),
                                 **{f"{c}_ms": table[f"{c}_ns"] / 1e6 for c in ("measured", "predicted", "saved")})
            text = shown[["step", "rank", "scenario", "method", "measured_ms", "predicted_ms", "saved_ms",
                          "note"]].to_string(index=False, float_format=lambda v: f"{v:.3f}") + "\n"
        _emit(text, args.output)
    except (ProfilingError, OSError) as exc:
        return _fail("whatif", exc)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``profile`` commands standalone: ``main(["profile", "report", path])``."""
    parser = argparse.ArgumentParser(prog="shardline")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    add_commands(commands)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
