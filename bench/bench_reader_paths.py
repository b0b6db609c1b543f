"""Each decode path of the Kineto reader, forced alone, on the shared corpus and on a generated big trace.

The question it answers: does every path the plan (``profiling/readers/_plan.py``) keeps win somewhere?
(SLICES is kept regardless: it is the only path that salvages a damaged trace.) Each
(path, input) is read in a fresh child process (``read_kineto(force=...)``: the path reads the whole trace
itself or refuses it), best of ``--runs``, timing the read alone (imports excluded), and recording the child's
peak RSS. The corpus is read file by file, summed; the big trace is a plain file of ``--big-mb`` MB built by
repeating the events of a corpus trace (``bench_profiling.build_big``), read mapped (STREAM) and in memory
(the others), and also gzip'd (in memory, for every path).

Writes bench/results/bench_reader_paths.md.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _publish import publish

HERE = Path(__file__).resolve().parent
TRACES = Path(os.environ.get("SHARDLINE_TRACES", HERE.parent.parent / "shared" / "traces"))
PATHS = ("native", "stream", "one_call", "slices")
#: The measurement that dropped the fifth path (Arrow's JSON reader on chunks), kept with the results: the
#: same script with the path still there, at the commit named (seconds, peak RSS, wins of five / of four
#: without the scanner).
DROPPED = [
    "## Dropped: the Arrow chunk path",
    "",
    "Measured by this script with the path still in the reader, at commit `b4e52ea45359` (dirty tree: this",
    "work), 2026-12-01 08:45 UTC, 2 cores. It won on no input, with or without the native scanner:",
    "",
    "| input | native | stream | one_call | arrow | slices |",
    "|---|---|---|---|---|---|",
    "| corpus, 32 files < 1 MB | 0.164 s, wins 32 | 0.354 s, 0 (3 w/o native) | 0.346 s, 0 (26) | "
    "0.669 s, 0 (0), refused 1 | 0.381 s, 0 (3) |",
    "| corpus, 2 files >= 1 MB | 0.158 s, wins 2 | 0.391 s, 0 (0) | 0.388 s, 0 (2) | 0.618 s, 0 (0) | "
    "0.440 s, 0 (0) |",
    "| generated, 202 MB plain | 1.370 s / 828 MB, wins 1 | 3.013 s / 378 MB, 0 (1) | 3.530 s / 1135 MB | "
    "3.214 s / 583 MB | 3.375 s / 596 MB |",
    "| generated, 202 MB gzip | 1.810 s / 829 MB, wins 1 | 3.449 s / 518 MB, 0 (1) | 3.637 s / 1133 MB | "
    "3.570 s / 589 MB | 3.674 s / 594 MB |",
    "",
    "The plan's default on the 202 MB plain file then streamed with Arrow on the dense chunks: 3.314 s, 10%",
    "slower than streaming with msgspec alone (3.013 s). Big in-memory documents above the one-call size now",
    "go through msgspec chunks (STREAM) instead.",
    "",
]

_CHILD = r"""
import json, resource, sys, time, warnings
warnings.simplefilter("ignore")
from pathlib import Path
from shardline.profiling.readers import kineto
from shardline.profiling.readers._plan import PathRefused
files, way, runs = [Path(f) for f in json.loads(sys.argv[1])], sys.argv[2] or None, int(sys.argv[3])
seconds = {}
for file in files:
    best = None
    for _ in range(runs):
        start = time.perf_counter()
        try:
            result = kineto.read_kineto(file, force=way)
        except PathRefused:
            break
        if result.skipped:  # not a trace (an execution trace, a memory timeline): nothing to time
            break
        best = min(best or 1e9, time.perf_counter() - start)
    seconds[str(file)] = best
print(json.dumps({"seconds": seconds, "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""
WAYS = ("default", *PATHS)


def _child(files: list[Path], way: str | None, runs: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", _CHILD, json.dumps([str(f) for f in files]), way or "", str(runs)],
                          capture_output=True, text=True, env=env, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"{way} failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _measure(files: list[Path], runs: int) -> dict:
    """way -> its child's output, over the same files."""
    return {way: _child(files, None if way == "default" else way, runs) for way in WAYS}


def _row(label: str, results: dict) -> str:
    """Total seconds over the files every path reads, peak RSS, files refused, and wins (files where the
    path is the fastest of the five)."""
    files = list(results["default"]["seconds"])
    common = [f for f in files if all(results[way]["seconds"][f] is not None for way in WAYS)]
    wins, wins_no_native = dict.fromkeys(PATHS, 0), dict.fromkeys(PATHS, 0)
    for f in common:
        wins[min(PATHS, key=lambda way: results[way]["seconds"][f])] += 1
        wins_no_native[min(PATHS[1:], key=lambda way: results[way]["seconds"][f])] += 1
    cells = []
    for way in WAYS:
        seconds = results[way]["seconds"]
        total = sum(seconds[f] for f in common)
        refused = sum(1 for f in files if seconds[f] is None and results["default"]["seconds"][f] is not None)
        cell = f"{total:.3f} s, {results[way]['rss_mb']:.0f} MB"
        if way != "default":
            cell += f", wins {wins[way]}" + (f" ({wins_no_native[way]} w/o native)" if way != "native" else "")
            cell += f", refused {refused}" if refused else ""
        cells.append(cell)
    return f"| {label} ({len(common)} read by all) | " + " | ".join(cells) + " |"


def _verdicts(rows: list[str]) -> list[str]:
    """Which path wins where, read back from the table's cells (every kept path must win somewhere)."""
    out = []
    for way in PATHS:
        column = 2 + PATHS.index(way)
        wins = [row.split(" | ")[column] for row in rows]
        some = any(", wins 0" not in cell or "w/o native" in cell and " (0 w/o native)" not in cell
                   for cell in wins)
        out.append(f"- `{way}`: " + ("wins on some input (kept)" if some else "**wins nowhere**"))
    return out


def _corpus() -> list[Path]:
    sys.path.insert(0, str(HERE.parent.parent))
    from shardline.profiling.table.load import _discover

    return [path for path, fmt in _discover(TRACES) if "kineto" in str(fmt).lower()]


def _build_big(folder: Path, megabytes: int) -> Path:
    spec = importlib.util.spec_from_file_location("bench_profiling", HERE / "bench_profiling.py")
    bench_profiling = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_profiling)
    try:
        import orjson  # noqa: F401
    except ImportError:  # build_big's writer: the stdlib writes the same JSON, compactly, more slowly
        import types

        sys.modules["orjson"] = types.SimpleNamespace(
            dumps=lambda value: json.dumps(value, separators=(",", ":")).encode())
    bench_profiling.build_big(folder, megabytes=megabytes, ranks=1)
    return next(folder.glob("*.json"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--big-mb", type=int, default=200, help="size of the generated plain trace (0: skip)")
    parser.add_argument("--runs", type=int, default=3, help="reads per file; the best counts")
    args = parser.parse_args()
    rows = []
    corpus = _corpus()
    small = [f for f in corpus if f.stat().st_size < (1 << 20)]
    large = [f for f in corpus if f.stat().st_size >= (1 << 20)]
    for label, files in ((f"corpus, {len(small)} files < 1 MB on disk", small),
                         (f"corpus, {len(large)} files >= 1 MB on disk", large)):
        rows.append(_row(label, _measure(files, args.runs)))
        print(rows[-1], flush=True)
    if args.big_mb:
        with tempfile.TemporaryDirectory(prefix="shardline-paths-") as scratch:
            big = _build_big(Path(scratch), args.big_mb)
            mb = big.stat().st_size / 1e6
            packed = big.with_name(big.name + ".gz")
            packed.write_bytes(gzip.compress(big.read_bytes(), compresslevel=1))
            for label, file in ((f"generated, {mb:.0f} MB plain", big), (f"generated, {mb:.0f} MB gzip", packed)):
                rows.append(_row(label, _measure([file], 1)))
                print(rows[-1], flush=True)
    publish([
        "# bench_reader_paths: each Kineto decode path, forced alone",
        "",
        "Per cell: seconds to read the files every path reads (best of the runs per file, imports excluded),",
        "peak RSS of the reading process, `wins` = files on which that path is the fastest of the four (in",
        "brackets: of the three left where the scanner is not built, no C compiler at install), and",
        "`refused` = traces that path declines (a forced path reads the whole input itself or refuses it).",
        "`default` is the plan's own choice (native scanner first where built, see `profiling/readers/_plan.py`).",
        f"Machine: {os.cpu_count()} cores. Corpus: `$SHARDLINE_TRACES` ({_shown(TRACES)}).",
        "",
        "| input | default | " + " | ".join(PATHS) + " |",
        "|---|" + "---|" * (len(PATHS) + 1),
        *rows,
        "",
        *_verdicts(rows),
        "",
        *DROPPED,
    ], HERE / "results" / "bench_reader_paths.md")


if __name__ == "__main__":
    main()


def _shown(path: Path) -> str:
    """The corpus folder as the results file names it: relative to the checkout's parent when it lies there (a
    results file must not carry one machine's absolute paths)."""
    try:
        return f"`../{Path(path).resolve().relative_to(HERE.parent.parent.resolve())}`"
    except ValueError:
        return f"`{Path(path).name}`"
