"""A/B of shardline.profiling's load + analysis time against an earlier commit: interleaved fresh processes.

Issue 48 (the profiler in layers) asks that the restructuring make no ratio of ``bench_profiling`` worse beyond
the run-to-run spread of at least three interleaved A/B runs against its starting commit. HTA's side of that bench
does not change between the two commits, so this script times only ours: the same child program as
``bench_profiling.py`` (``load(folder)`` + ``breakdown(traceset)``, imports excluded) on the same data sets,
once with the base commit's source and once with this checkout's, the two taking turns (base, head, base, head,
...) so that other work on the machine falls on both alike.

The base commit is checked out in a detached git worktree under ``bench/out/ab-base`` and its native Kineto
scanner built in place; each side imports ``shardline`` from a folder of links to its tree's packages (the
installed editable package is never imported: the child prints the path it imported from and the script checks
it). Run::

    python bench/bench_profiling_ab.py [--base d3ad876] [--runs 5] [--big-mb 256]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _publish import publish
from bench_profiling import OURS, OUT, REPO, TRACES, build_big, json_megabytes, run_side

RESULTS = Path(__file__).resolve().parent / "results" / "bench_profiling_ab.md"
PACKAGES = ("job", "plugins", "profiling", "recipes")
# The child program of bench_profiling, plus a line on stderr naming the tree it imported shardline.profiling from.
PROGRAM = OURS.replace(
    "from shardline.profiling.base.errors import TraceWarning",
    "import shardline.profiling as _p\n"
    "print('imported', _p.__file__, file=sys.stderr)\n"
    "try:\n    from shardline.profiling.base.errors import TraceWarning\n"
    "except ImportError:\n    from shardline.profiling.errors import TraceWarning",
)


def shadow(tree: Path, folder: Path) -> Path:
    """A folder holding ``shardline/<package>`` links to ``tree``'s package folders (a namespace package, as the
    package-dir mapping of pyproject.toml makes it)."""
    root = folder / "shardline"
    root.mkdir(parents=True, exist_ok=True)
    for name in PACKAGES:
        if (tree / name).is_dir() and not (root / name).exists():
            (root / name).symlink_to(tree / name)
    return folder


def base_tree(rev: str) -> Path:
    """A detached worktree of ``rev`` with its native scanner built in place."""
    tree = OUT / "ab-base"
    if tree.exists():
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False)
        shutil.rmtree(tree, ignore_errors=True)
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), rev], check=True,
                   capture_output=True)
    subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=tree, check=True,
                   capture_output=True)
    built = list(tree.glob("shardline/profiling/readers/_kscan*.so"))
    for path in built:  # --inplace follows the package name, not the package-dir mapping
        path.rename(tree / "profiling" / "readers" / path.name)
    return tree


def time_side(folder: Path, runs_dir: Path, *, timeout: float) -> dict:
    env_path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(runs_dir)
    try:
        return run_side(sys.executable, PROGRAM, folder, timeout=timeout)
    finally:
        if env_path is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = env_path


def compare(name: str, folder: Path, sides: dict[str, Path], *, runs: int, timeout: float) -> dict:
    times: dict[str, list[float]] = {side: [] for side in sides}
    for _ in range(runs):
        for side, path in sides.items():
            report = time_side(folder, path, timeout=timeout)
            if "seconds" not in report:
                raise SystemExit(f"{name}: the {side} side failed: {report.get('error')}")
            times[side].append(report["seconds"])
    base, head = statistics.median(times["base"]), statistics.median(times["head"])
    spread = max((max(t) - min(t)) / statistics.median(t) for t in times.values())
    return {"name": name, "mb": json_megabytes(folder), "times": times, "base": base, "head": head,
            "ratio": head / base, "spread": spread}


def check_sources(sides: dict[str, Path]) -> None:
    """Each side must import shardline.profiling from its own tree, not from the installed package."""
    for side, path in sides.items():
        out = subprocess.run([sys.executable, "-c", "import shardline.profiling as p; print(p.__file__)"],
                             env={**os.environ, "PYTHONPATH": str(path)}, capture_output=True, text=True, check=True)
        if not out.stdout.strip().startswith(str(path)):
            raise SystemExit(f"the {side} side imported shardline.profiling from {out.stdout.strip()}, not {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="d3ad876", help="the commit to compare against")
    parser.add_argument("--runs", type=int, default=5, help="interleaved runs per side and data set (>= 3)")
    parser.add_argument("--big-mb", type=int, default=256, help="JSON MB of the large set (0: skip it)")
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args()
    if args.runs < 3:
        raise SystemExit(f"--runs {args.runs}: at least 3 interleaved runs are needed to see the spread")
    base_rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=12", args.base], check=True,
                              capture_output=True, text=True).stdout.strip()
    tree = base_tree(args.base)
    work = Path(tempfile.mkdtemp(prefix="ab-", dir=OUT))
    try:
        sides = {"base": shadow(tree, work / "base"), "head": shadow(REPO, work / "head")}
        check_sources(sides)
        sets = [("param/dlrm_kineto (8 ranks)", TRACES / "param" / "dlrm_kineto"),
                ("hta/trace_filter (2 ranks)", TRACES / "hta" / "trace_filter")]
        rows = [compare(name, folder, sides, runs=args.runs, timeout=args.timeout) for name, folder in sets]
        if args.big_mb:
            big = work / "big"
            big.mkdir()
            build_big(big, megabytes=args.big_mb)
            rows.append(compare(f"repeated ns_resolution trace, 2 ranks, {args.big_mb} MB", big, sides,
                                runs=args.runs, timeout=args.timeout))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False)
    lines = [
        f"# shardline.profiling: this commit against `{base_rev}` (load + analysis)",
        "",
        f"{args.runs} fresh processes per side and data set, the sides taking turns; time excludes imports "
        "(the child program of `bench_profiling.py`). Ratio = head median / base median; spread = the larger "
        "side's (max - min) / median over its runs. A ratio above 1 + spread is a regression beyond the noise.",
        "",
        "| data set | JSON MB | base s (runs) | head s (runs) | ratio head/base | spread | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        fmt = lambda ts: ", ".join(f"{t:.3f}" for t in ts)  # noqa: E731
        worse = row["ratio"] > 1 + row["spread"]
        verdict = "slower beyond the spread" if worse else "within the spread or faster"
        lines.append(f"| {row['name']} | {row['mb']:.1f} | {row['base']:.3f} ({fmt(row['times']['base'])}) | "
                     f"{row['head']:.3f} ({fmt(row['times']['head'])}) | {row['ratio']:.3f} | "
                     f"{row['spread']:.1%} | {verdict} |")
    publish(lines, RESULTS)


if __name__ == "__main__":
    main()
