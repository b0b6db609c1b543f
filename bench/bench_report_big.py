"""`shardline profile report -o report.html` on a large trace set: wall time and peak memory.

Builds a >= 1 GB multi-rank Kineto set by repeating a real trace (bench_profiling.build_big), runs the report
command in a child process, and records its wall time and peak RSS (the child's and its workers', via
RUSAGE_CHILDREN), so the claim "a 1 GB trace set reports without exhausting memory" is measured, not assumed.
The command's ``--timings`` line gives the seconds of each analysis, so the share of the idle causes, critical
path, launch statistics and findings (what-ifs included) is measured in the same run.
Writes bench/results/bench_report_big.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _publish import publish

HERE = Path(__file__).resolve().parent


def _bench_profiling():
    spec = importlib.util.spec_from_file_location("bench_profiling", HERE / "bench_profiling.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: The report stages issue 20 added (``report_sections`` timings; idle causes run inside the breakdown).
WHY_STAGES = ("idle_causes", "critical_path", "launch_stats", "findings")


def _timings(stderr: str) -> dict[str, float]:
    """The stage seconds of ``shardline profile report --timings``' line."""
    line = next(t for t in reversed(stderr.splitlines()) if t.startswith("shardline profile report: seconds:"))
    return {k: float(v) for k, v in re.findall(r"(\w+) (\d+\.\d+)", line.split("seconds: ", 1)[1])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megabytes", type=int, default=1024, help="total JSON MB of the generated set")
    args = parser.parse_args()
    bp = _bench_profiling()
    work = Path(tempfile.mkdtemp(prefix="shardline-big-"))
    try:
        traces = work / "traces"
        traces.mkdir()
        bp.build_big(traces, megabytes=args.megabytes)
        size_mb = bp.json_megabytes(traces)
        report = work / "report.html"
        load_before = os.getloadavg()[0]
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "shardline.recipes.cli", "profile", "report", str(traces),
                               "-o", str(report), "--timings"], capture_output=True, text=True, timeout=3600)
        wall = time.perf_counter() - start
        peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        if done.returncode != 0:
            raise SystemExit(f"report failed ({done.returncode}): {done.stderr[-2000:]}")
        sections = report.read_text().count("<h2>")
        stages = _timings(done.stderr)
        why = sum(stages.get(k, 0.0) for k in WHY_STAGES)  # the "why and what to change" analyses
        rest = stages["total"] - why
        table = "\n".join([
            "# bench_report_big: `shardline profile report -o report.html` on a large trace set",
            "",
            f"Machine: 2 cores, 24 GiB; load average {load_before:.1f} at start.",
            "",
            "Peak RSS is the largest single process (the command, or one of its forked reader workers).",
            "",
            "| JSON MB | ranks | wall s | peak RSS MB (largest process) | peak / JSON size | HTML sections |",
            "|---:|---:|---:|---:|---:|---:|",
            f"| {size_mb:.0f} | 2 | {wall:.1f} | {peak_mb:.0f} | {peak_mb / size_mb:.2f} | {sections} |",
            "",
            "Where the command's time went (its own `--timings`, seconds): "
            + ", ".join(f"{k} {v:.2f}" for k, v in stages.items()) + ".",
            "",
            f"Idle causes, critical path, launch statistics and findings (with their what-ifs) together: {why:.2f} s, "
            f"{100 * why / rest:.1f}% on top of the rest of the report ({rest:.2f} s); target <= 20%: "
            + ("met." if why <= 0.2 * rest else "NOT met."),
        ])
        publish([*table.split("\n"), ""], HERE / "results" / "bench_report_big.md")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
