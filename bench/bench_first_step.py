"""Time to the first training step: ``shardline fit --config tiny`` against a plain Lightning DDP run of the same
model on the same 4 CPU ranks, each a fresh process on warm caches (issue 54 §3: target <= 1.5x DDP's).

Both sides train ``recipes/tiny.yaml``'s model and data (``LanguageModule``, ``TextDataModule``) for ``--steps``
steps on 4 processes that Lightning's launcher starts by re-running the command line. shardline's side is the
real command (``python -m shardline.recipes.cli fit --config tiny``: tp2 x pp2, ZeRO-1, the recipe's checkpoints
off so that no save is timed); DDP's is ``_ddp_fit.py`` beside this script (``Trainer(strategy="ddp")``, the same
model fields, data, batch and precision, one process per rank on gloo). A callback (``_first_step.FirstStep``,
added to both) writes, on rank 0, the wall-clock time at the end of the first and of the last training step; the
time to first step is that minus the time this script started the command. Each side runs ``--runs`` times, the
sides taking turns; the table shows the median and the spread. Warm caches: one untimed run of each side first
(bytecode, DeepSpeed's JIT ops in ``~/.cache/torch_extensions``, the OS page cache).

Where the time goes is shown for shardline's side from its rank 0's own timestamps (``SHARDLINE_BENCH_MARKS``):
interpreter and imports until the CLI parses, the recipe checks, the launch of the other ranks, process group and
DeepSpeed initialisation, model build, first step.

    python bench/bench_first_step.py [--runs 3] [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _publish import publish

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results" / "bench_first_step.md"


def run_side(side: str, steps: int, work: Path) -> dict:
    marks = work / f"{side}-{time.monotonic_ns()}.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
           "SHARDLINE_BENCH_MARKS": str(marks), "PYTHONWARNINGS": "ignore"}
    common = ["--trainer.max_steps", str(steps), "--trainer.limit_val_batches", "0", "--trainer.logger", "false",
              "--trainer.callbacks+=_first_step.FirstStep"]
    if side == "shardline":
        command = [sys.executable, "-m", "shardline.recipes.cli", "fit", "--config", "tiny", "--ckpt-every", "0",
                   *common]
    else:
        command = [sys.executable, str(HERE / "_ddp_fit.py"), str(steps)]
    started = time.time()
    result = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        raise SystemExit(f"{side} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    data = json.loads(marks.read_text())
    return {"first": data["first_step_end"] - started, "total": time.time() - started,
            "marks": {k: v - started for k, v in data.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="first-step-"))
    sides = ("shardline", "ddp")
    for side in sides:  # warm the caches, untimed
        run_side(side, 2, work)
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    for _ in range(args.runs):
        for side in sides:
            runs[side].append(run_side(side, args.steps, work))
    first = {side: [r["first"] for r in runs[side]] for side in sides}
    med = {side: statistics.median(first[side]) for side in sides}
    ratio = med["shardline"] / med["ddp"]
    lines = [
        "# Time to the first training step: shardline fit vs a plain Lightning DDP run",
        "",
        f"`recipes/tiny.yaml`'s model and data, 4 CPU ranks, {args.steps} steps, {args.runs} fresh runs per side "
        "taking turns after one untimed warm-up run each (see the script's docstring). Seconds from starting the "
        "command to the end of rank 0's first training step.",
        "",
        "| side | median s | runs s | spread |",
        "|---|---|---|---|",
    ]
    for side, name in (("shardline", "shardline fit --config tiny (tp2 x pp2, ZeRO-1)"),
                       ("ddp", "Lightning DDP, same model and data")):
        values = first[side]
        spread = (max(values) - min(values)) / med[side]
        lines.append(f"| {name} | {med[side]:.1f} | {', '.join(f'{v:.1f}' for v in values)} | {spread:.0%} |")
    verdict = "met" if ratio <= 1.5 else "NOT met"
    lines += ["", f"Ratio shardline / DDP: {ratio:.2f} (target <= 1.5: {verdict}).", "",
              "Where shardline's time goes (rank 0, median over the runs, seconds since the command started):", ""]
    keys = list(runs["shardline"][0]["marks"])
    for key in keys:
        values = [r["marks"][key] for r in runs["shardline"] if key in r["marks"]]
        lines.append(f"- {key}: {statistics.median(values):.1f}")
    lines += ["", f"Load average at the end: {os.getloadavg()[0]:.1f} (1 min) on {os.cpu_count()} cores."]
    publish(lines, RESULTS)


if __name__ == "__main__":
    main()
