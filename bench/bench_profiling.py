"""shardline.profiling vs Holistic Trace Analysis 0.5.0: load + analysis time, peak memory, MB/s per core.

Ours: ``load(folder)`` + ``breakdown(traceset)`` (classification runs inside load). HTA: ``TraceAnalysis(trace_dir)``
+ ``get_temporal_breakdown`` + ``get_gpu_kernel_breakdown`` + ``get_comm_comp_overlap``. Same files, one run.

Each side runs in its own fresh subprocess; the parent samples the RSS of that process *and its children*
(HTA parses ranks in a worker pool) every 20 ms with psutil and keeps the peak of the sum, both of the RSS
(pages shared by forked processes count in each) and of the PSS (they count once in all). Time is the child's
own measurement of load + analysis (imports excluded, reported apart); CPU seconds come from the child's
``getrusage`` of itself plus its reaped workers, so "MB/s per core" = uncompressed JSON MB / CPU seconds.
Each child also reports its peak RSS up to the end of its imports (``VmHWM``: ``ru_maxrss`` would carry the
parent's RSS over the fork), so the table shows the memory the analysis needs on top of them. The small sets
run ``--small-runs`` fresh processes per side, the sides taking turns, and report the medians. shardline's
bytecode is written first (as a wheel install does; HTA's pip install did so for HTA).

Data sets: the 8-rank DLRM traces (``param/dlrm_kineto``), HTA's own two-rank ``trace_filter`` set, and a large
two-rank set built by repeating the events of a real trace (``hta/ns_resolution_trace``: every copy shifted in
time past the previous one, correlation/External ids and ProfilerStep numbers offset so links stay unique)
to ``--big-mb`` MB of JSON in total, written under ``bench/out/`` and deleted afterwards.

HTA is installed in its own virtual environment (``--hta-python``, default ``bench/out/hta-venv/bin/python``):
it needs pandas < 3, and it is never a dependency of shardline. Run::

    python -m venv bench/out/hta-venv && bench/out/hta-venv/bin/pip install "pandas<3" numpy networkx \\
        plotly pydot psutil pyyaml && bench/out/hta-venv/bin/pip install --no-deps HolisticTraceAnalysis==0.5.0
    python bench/bench_profiling.py [--big-mb 1024] [--skip-hta]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from _publish import publish

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
TRACES = Path(os.environ.get("SHARDLINE_TRACES", REPO.parent / "shared" / "traces"))
OUT = HERE / "out"
RESULTS = HERE / "results" / "bench_profiling.md"
BIG_SEED = "hta/ns_resolution_trace/rank-0.Apr_03_18_51_38.1102.pt.trace.json.gz"

# Child programs: print one JSON line {"seconds", "import_seconds", "cpu_seconds", "detail"}.
OURS = r"""
import json, resource, sys, time, warnings
t0 = time.perf_counter()
from shardline.profiling import breakdown, load
from shardline.profiling.base.errors import TraceWarning
t1 = time.perf_counter()
import_rss_mb = int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM:")).split()[1]) / 1024
warnings.simplefilter("ignore", TraceWarning)
ts = load(sys.argv[1], workers=int(sys.argv[2]) if len(sys.argv) > 2 else None)
t2 = time.perf_counter()
table = breakdown(ts)
t3 = time.perf_counter()
ru, rc = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"seconds": t3 - t1, "import_seconds": t1 - t0, "load_seconds": t2 - t1,
                  "import_rss_mb": import_rss_mb,
                  "cpu_seconds": ru.ru_utime + ru.ru_stime + rc.ru_utime + rc.ru_stime,
                  "detail": f"{len(ts.events)} events, {len(table)} rank-step rows"}))
"""
HTA = r"""
import json, resource, sys, time, warnings
warnings.simplefilter("ignore")
t0 = time.perf_counter()
from hta.trace_analysis import TraceAnalysis
t1 = time.perf_counter()
import_rss_mb = int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM:")).split()[1]) / 1024
analysis = TraceAnalysis(trace_dir=sys.argv[1])
t2 = time.perf_counter()
temporal = analysis.get_temporal_breakdown(visualize=False)
kernels = analysis.get_gpu_kernel_breakdown(visualize=False)
overlap = analysis.get_comm_comp_overlap(visualize=False)
t3 = time.perf_counter()
ru, rc = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"seconds": t3 - t1, "import_seconds": t1 - t0, "load_seconds": t2 - t1,
                  "import_rss_mb": import_rss_mb,
                  "cpu_seconds": ru.ru_utime + ru.ru_stime + rc.ru_utime + rc.ru_stime,
                  "detail": f"{len(temporal)} temporal rows, {len(overlap)} overlap rows"}))
"""


def run_side(python: str, program: str, folder: Path, *, timeout: float, extra: tuple = ()) -> dict:
    """Run one side in a fresh process, sampling the RSS of its whole process tree; returns its report."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen([python, "-c", program, str(folder), *extra], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    parent = psutil.Process(proc.pid)
    peak, peak_pss, start = 0, 0, time.perf_counter()
    next_pss = start
    loads = [os.getloadavg()[0]]
    while proc.poll() is None:
        try:
            tree = [parent, *parent.children(recursive=True)]
            peak = max(peak, sum(p.memory_info().rss for p in tree if p.is_running()))
            if time.perf_counter() >= next_pss:
                # PSS walks the page tables (ms for a GB process): sampled at most 5% of the time, so the
                # sampling does not take a core from the measured processes.
                began = time.perf_counter()
                peak_pss = max(peak_pss, sum(getattr(p.memory_full_info(), "pss", 0) for p in tree
                                             if p.is_running()))
                next_pss = time.perf_counter() + 20 * (time.perf_counter() - began)
        except psutil.Error:
            pass
        if time.perf_counter() - start > timeout:
            proc.kill()
            return {"error": f"timed out after {timeout:.0f} s", "peak_mb": peak / 2**20}
        time.sleep(0.02)
        if len(loads) < (time.perf_counter() - start) / 5:  # the 1-minute load average every 5 s
            loads.append(os.getloadavg()[0])
    loads.append(os.getloadavg()[0])
    out, err = proc.communicate()
    if proc.returncode != 0:
        return {"error": err.strip().splitlines()[-1] if err.strip() else f"exit {proc.returncode}",
                "peak_mb": peak / 2**20}
    report = json.loads(out.strip().splitlines()[-1])
    report["peak_mb"] = peak / 2**20
    report["peak_pss_mb"] = peak_pss / 2**20
    report["load_avg"] = (min(loads), max(loads))
    return report


def run_sides(sides: list[tuple[str, str]], folder: Path, *, runs: int, timeout: float) -> list[dict]:
    """Each ``(python, program)`` side ``runs`` times, the sides taking turns (ours, HTA, ours, HTA, ...), so
    a spell of other work on the machine falls on both alike; per side, ``median_report`` of its runs."""
    reports: list[list[dict]] = [[] for _ in sides]
    for _ in range(runs):
        for mine, (python, program) in zip(reports, sides):
            mine.append(run_side(python, program, folder, timeout=timeout))
    return [median_report(mine) for mine in reports]


def median_report(reports: list[dict]) -> dict:
    """The run with the median time, with the median of each measured figure across the runs (sub-second sets
    are at the mercy of other jobs on the machine)."""
    good = [r for r in reports if "seconds" in r]
    if not good:
        return reports[0]
    middle = dict(sorted(good, key=lambda r: r["seconds"])[len(good) // 2])
    for key in ("seconds", "load_seconds", "cpu_seconds", "peak_mb", "peak_pss_mb", "import_rss_mb"):
        if all(key in r for r in good):
            middle[key] = statistics.median(r[key] for r in good)
    middle["load_avg"] = (min(r["load_avg"][0] for r in good), max(r["load_avg"][1] for r in good))
    middle["runs"] = len(good)
    return middle


def compile_bytecode() -> None:
    """Write shardline's bytecode, as a wheel install does: with ``PYTHONDONTWRITEBYTECODE`` set (as on our CI
    machines) an editable checkout would otherwise compile every module it imports inside the timed region,
    while HTA's pip-installed package has its bytecode."""
    import compileall

    for folder in ("profiling", "plugins", "recipes"):
        compileall.compile_dir(str(REPO / folder), quiet=1)


def json_megabytes(folder: Path) -> float:
    """Uncompressed JSON size of every trace in the folder, in MB (10**6 bytes)."""
    total = 0
    for path in folder.iterdir():
        if path.name.endswith(".gz"):
            with gzip.open(path, "rb") as handle:
                while chunk := handle.read(1 << 24):
                    total += len(chunk)
        elif path.suffix == ".json":
            total += path.stat().st_size
    return total / 1e6


def build_big(folder: Path, *, megabytes: int, ranks: int = 2) -> None:
    """Per-rank traces of about ``megabytes / ranks`` MB each, by repeating the seed trace's events."""
    import orjson

    seed = json.loads(gzip.decompress((TRACES / BIG_SEED).read_bytes()))
    events = [e for e in seed["traceEvents"] if e.get("ph") == "X"]
    meta = [e for e in seed["traceEvents"] if e.get("ph") == "M"]
    span = max(e["ts"] + e.get("dur", 0) for e in events) - min(e["ts"] for e in events) + 1000
    ids = max(max(e.get("args", {}).get("correlation", 0), e.get("args", {}).get("External id", 0))
              for e in events) + 1
    one_copy = len(orjson.dumps(events))
    copies = max(1, int(megabytes * 1e6 / ranks / one_copy))
    for rank in range(ranks):
        header = {k: v for k, v in seed.items() if k != "traceEvents"}
        header["distributedInfo"] = {**seed.get("distributedInfo", {}), "rank": rank, "world_size": ranks}
        with open(folder / f"rank-{rank}.trace.json", "wb") as handle:
            handle.write(orjson.dumps(header)[:-1] + b', "traceEvents": [')
            handle.write(orjson.dumps(meta)[1:-1] + b",")
            for k in range(copies):
                handle.write(orjson.dumps([_shifted(e, k, span=span, ids=ids) for e in events])[1:-1])
                handle.write(b"," if k < copies - 1 else b"]}")


def _shifted(event: dict, k: int, *, span: float, ids: int) -> dict:
    out = dict(event, ts=event["ts"] + k * span)
    args = event.get("args")
    if args:
        args = dict(args)
        for key in ("correlation", "External id"):
            if key in args:
                args[key] = args[key] + k * ids
        out["args"] = args
    name = event.get("name", "")
    if name.startswith("ProfilerStep#"):
        out["name"] = f"ProfilerStep#{int(name[13:]) + k * 1000}"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--big-mb", type=int, default=1024, help="total JSON MB of the large set (0: skip it)")
    parser.add_argument("--hta-python", default=str(OUT / "hta-venv" / "bin" / "python"))
    parser.add_argument("--skip-hta", action="store_true")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per side and data set")
    parser.add_argument("--small-runs", type=int, default=9,
                        help="fresh processes per side on the small sets (the median is reported)")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    sets = [("param/dlrm_kineto (8 ranks)", TRACES / "param" / "dlrm_kineto"),
            ("hta/trace_filter (2 ranks)", TRACES / "hta" / "trace_filter")]
    scratch = Path(tempfile.mkdtemp(dir=OUT, prefix="big-"))
    rows = []
    try:
        if args.big_mb:
            build_big(scratch, megabytes=args.big_mb)
            sets.append((f"repeated ns_resolution trace, 2 ranks, {args.big_mb} MB", scratch))
        compile_bytecode()
        for label, folder in sets:
            size = json_megabytes(folder)
            runs = args.small_runs if folder != scratch else 1
            sides = [(sys.executable, OURS)]
            if not args.skip_hta and Path(args.hta_python).exists():
                sides.append((args.hta_python, HTA))
            ours, hta = [*run_sides(sides, folder, runs=runs, timeout=args.timeout), {"error": "skipped"}][:2]
            rows.append((label, size, ours, hta))
            print(f"{label}: ours {ours}  hta {hta}", file=sys.stderr)
            if folder == scratch:
                # The same set read in one process (no reader pool): the memory-lean, single-core figure.
                single = run_side(sys.executable, OURS, folder, timeout=args.timeout, extra=("1",))
                rows.append((f"{label}, ours in 1 process", size, single, hta))
                print(f"{label} (1 process): ours {single}", file=sys.stderr)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    publish(render(rows).split("\n"), RESULTS)


def _seconds(side: dict) -> str:
    """'total (load)' seconds, to the millisecond below a second."""
    fmt = ".3f" if side.get("seconds", 1) < 1 else ".2f"
    return f"{_cell(side, 'seconds', fmt)} ({_cell(side, 'load_seconds', fmt)})"


def _cell(side: dict, key: str, fmt: str) -> str:
    return "—" if key not in side else format(side[key], fmt)


def _load_note(side: dict) -> str:
    if "load_avg" not in side:
        return ""
    low, high = side["load_avg"]
    return f" (1-min load average {low:.1f}-{high:.1f} while it ran)"


def render(rows: list) -> str:
    cpu = psutil.cpu_count(logical=True)
    lines = [
        "# shardline.profiling vs HTA 0.5.0 — load + analysis",
        "",
        f"Machine: {cpu} logical cores, {psutil.virtual_memory().total / 2**30:.0f} GiB; "
        f"Python {sys.version.split()[0]}; generated {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by "
        "`python bench/bench_profiling.py`.",
        "Ours = `load(folder)` + `breakdown(ts)`; HTA = `TraceAnalysis(trace_dir)` + temporal breakdown + kernel "
        "breakdown + comm/comp overlap. Time excludes imports; peak RSS is the whole process tree; MB/s per core "
        "= uncompressed JSON MB / CPU seconds (self + workers). Ours reads the files of a big multi-rank set in "
        "forked workers by default (HTA uses a pool too); the '1 process' row reads them one after the other.",
        "",
        "Small sets: median of several fresh processes per side, the two sides taking turns. 'Above imports' "
        "= peak RSS of the tree minus the process's peak RSS up to the end of its imports (pandas 3 + pyarrow "
        "alone are ~101 MB for ours, pandas 2 + HTA's imports ~94 MB): the memory the analysis itself needs.",
        "",
        "'PSS' = the tree's proportional set size: a page shared by forked processes (both sides fork "
        "workers) counts once in all, where the RSS sum counts it in every process that maps it; on the small "
        "sets HTA's pool makes its RSS sum ~100 MB larger than its PSS.",
        "",
        "| data set | JSON MB | ours s (load s) | HTA s (load s) | speed-up | ours peak MB | HTA peak MB | "
        "memory ratio | PSS peak: ours / HTA MB (ratio) | above imports: ours / HTA MB (ratio) | "
        "ours MB/s/core | HTA MB/s/core |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, size, ours, hta in rows:
        speed = (f"{hta['seconds'] / ours['seconds']:.1f}×" if "seconds" in hta and "seconds" in ours else "—")
        memory = (f"{ours['peak_mb'] / hta['peak_mb']:.2f}" if "seconds" in hta and "seconds" in ours else "—")
        rate = {side: (f"{size / s['cpu_seconds']:.1f}" if "cpu_seconds" in s else "—") for side, s in
                (("ours", ours), ("hta", hta))}
        above = {side: s["peak_mb"] - s["import_rss_mb"] for side, s in (("ours", ours), ("hta", hta))
                 if "peak_mb" in s and "import_rss_mb" in s}
        working = (f"{above['ours']:.0f} / {above['hta']:.0f} ({above['ours'] / above['hta']:.2f})"
                   if len(above) == 2 and above["hta"] > 0 else "—")
        pss = (f"{ours['peak_pss_mb']:.0f} / {hta['peak_pss_mb']:.0f} "
               f"({ours['peak_pss_mb'] / hta['peak_pss_mb']:.2f})"
               if "peak_pss_mb" in ours and hta.get("peak_pss_mb") else "—")
        lines.append(
            f"| {label} | {size:.1f} | {_seconds(ours)} | {_seconds(hta)} | {speed} | "
            f"{_cell(ours, 'peak_mb', '.0f')} | {_cell(hta, 'peak_mb', '.0f')} | {memory} | {pss} | {working} | "
            f"{rate['ours']} | {rate['hta']} |")
    notes = [f"- {label}: ours: {o.get('detail', o.get('error'))}{_load_note(o)}; HTA: "
             f"{h.get('detail', h.get('error'))}{_load_note(h)}" for label, _, o, h in rows]
    load1, load5, _ = os.getloadavg()
    context = (f"Load average at the end of the run: {load1:.1f} (1 min), {load5:.1f} (5 min) on {cpu} cores; "
               "other jobs on the machine slow both sides alike but make absolute times noisy.")
    return "\n".join(lines + ["", "Targets: ≥ 10× faster, ≤ 1/3 of HTA's peak memory (PSS: pages shared by forked "
                               "workers counted once).", *_verdicts(rows), "", context, "", *notes, ""])


def _verdicts(rows: list) -> list[str]:
    """Per data set: is each target met, and where memory is not, whether any in-process pandas analysis
    could meet it (our imports alone against a third of HTA's peak)."""
    out = []
    for label, _, ours, hta in rows:
        if "seconds" not in ours or "seconds" not in hta:
            continue
        speed = hta["seconds"] / ours["seconds"]
        line = f"- {label}: speed {'met' if speed >= 10 else 'NOT met'} ({speed:.1f}×)"
        if ours.get("peak_pss_mb") and hta.get("peak_pss_mb"):
            third = hta["peak_pss_mb"] / 3
            ratio = ours["peak_pss_mb"] / hta["peak_pss_mb"]
            line += f"; memory {'met' if ratio <= 1 / 3 else 'NOT met'} (PSS ratio {ratio:.2f})"
            if ratio > 1 / 3 and ours.get("import_rss_mb", 0) > third:
                line += (f": out of reach in-process, our imports alone (Python, numpy, pandas 3 + pyarrow: "
                         f"{ours['import_rss_mb']:.0f} MB) exceed a third of HTA's peak ({third:.0f} MB) before "
                         "a trace is read")
        out.append(line + ".")
    return out


if __name__ == "__main__":
    main()
