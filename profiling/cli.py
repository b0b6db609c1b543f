"""``shardline profile report <path>``: the per-(rank, step) breakdown on the terminal, or as CSV / JSON.

``add_commands(subparsers)`` registers ``profile`` on the ``shardline`` console script (each leaf parser sets
``func(args) -> int``); ``main(argv)`` runs the same parser standalone, for tests and ``python -m``.
Presentation only: the numbers come from ``breakdown`` unchanged (CSV/JSON keep integer ns; the table shows
ms and shares of the step, and hides columns that are zero on every row).
"""

from __future__ import annotations

import argparse
import enum
import sys
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from shardline.profiling.errors import ProfilingError


class ReportFormat(str, enum.Enum):
    TABLE = "table"
    CSV = "csv"
    JSON = "json"


def add_commands(subparsers) -> None:
    """Add ``profile report`` to an ``argparse`` subparsers object."""
    profile = subparsers.add_parser("profile", help="analyse profiler traces")
    commands = profile.add_subparsers(dest="profile_command", metavar="COMMAND")
    commands.required = True
    report = commands.add_parser("report", help="per-rank, per-step time breakdown of a trace")
    report.add_argument("path", type=Path, help="trace file, folder of per-rank traces, or run folder")
    report.add_argument("--format", choices=[f.value for f in ReportFormat], default=ReportFormat.TABLE.value,
                        help="table (terminal), csv or json (integer ns, for machines)")
    report.add_argument("-o", "--output", type=Path, default=None, help="write here instead of stdout")
    report.set_defaults(func=run_report)


def run_report(args: argparse.Namespace) -> int:
    """Load, attribute, render; our errors become one line on stderr and exit status 2."""
    from shardline.profiling.attribution import breakdown
    from shardline.profiling.load import load

    try:
        table = breakdown(load(args.path))
    except (ProfilingError, OSError) as exc:
        print(f"shardline profile report: error: {exc}", file=sys.stderr)
        return 2
    text = render(table, fmt=ReportFormat(args.format))
    if args.output is None:
        sys.stdout.write(text)
    else:
        args.output.write_text(text)
    return 0


def render(table: pd.DataFrame, *, fmt: ReportFormat) -> str:
    """The breakdown as text in ``fmt``."""
    fmt = ReportFormat(fmt)
    if fmt is ReportFormat.CSV:
        return table.to_csv(index=False)
    if fmt is ReportFormat.JSON:
        return table.to_json(orient="records", indent=1, double_precision=15) + "\n"
    return render_table(table)


def render_table(table: pd.DataFrame) -> str:
    """Terminal table: step time and every non-zero exclusive part in ms, the overlap ratio in %."""
    from shardline.profiling.attribution import EXCLUSIVE_COLUMNS

    if table.empty:
        return "no work events to attribute\n"
    parts = [c for c in EXCLUSIVE_COLUMNS if (table[c] != 0).any()]
    shown = pd.DataFrame({"rank": table["rank"], "step": table["step"], "lanes": table["lanes"],
                          "step_ms": table["step_ns"] / 1e6})
    for column in parts:
        shown[f"{column}_ms"] = table[column] / 1e6
    shown["overlap_%"] = [f"{100 * v:.1f}" for v in table["overlap_ratio"]]  # one entry per rank x step
    header = ("exclusive parts (exposed communication) sum to step_ms; overlap_% = time(compute ∩ comm) / "
              "time(comm)\n")
    return header + shown.to_string(index=False, float_format=lambda v: f"{v:.3f}") + "\n"


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
