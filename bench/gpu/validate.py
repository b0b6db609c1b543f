"""One prepared run that validates shardline on a lent GPU machine (``bench/gpu/validate.sh`` sets it up).

Stages, each in its own process (one that crashes or runs past its limit costs only itself, and the parent never
initialises CUDA, so the stages can fork their ranks; ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` makes
``torch.cuda.is_available()`` ask NVML too, so a test module's skip condition does not initialise CUDA before its
ranks fork), each writing its results into ``OUT/validate.json`` and
``OUT/validate.md`` the moment it ends:

1. ``environment``: device, driver, torch, CUDA, NCCL, the carried wheels, and every shardline module imported
   (what this torch lacks is named per module instead of stopping the run);
2. ``gpu_tests``: the ``gpu``-marked tests (one device: ``tests/recipes/test_gpu_single.py``; two or more:
   also the NCCL parity and resume tests, else skipped with that reason), JUnit XML in ``OUT/pytest.xml``;
3. ``gemm``: bf16 GEMMs of the projections the planner prices (Llama 3 8B and 70B layers at tp 1, 2, 4, 8:
   q/k/v, o, gate/up, down and the head; forward and both backward products) and causal SDPA attention,
   achieved TFLOP/s per shape (``OUT/gemm.json``), under ``torch.profiler(record_shapes=True)``: the trace
   (``OUT/gemm_trace.json.gz``) is what ``shardline plan --calibrate`` reads, and its calibration is written as
   a catalog override (``OUT/catalog_calibrated.yaml``, ``shardline plan --catalog``);
4. ``train``: ``llama_tiny`` and a ~1.1B Llama trained for a few dozen bf16 steps on one GPU through
   ``HybridParallelStrategy`` (ZeRO-1, torch's AdamW): tokens/s, MFU (the planner's model FLOPs per step over
   the measured step), peak allocated and reserved memory, beside ``shardline plan``'s prediction for the same
   model, batch and layout; the 1.1B run is profiled by ``StepProfiler``;
5. ``profile``: ``shardline profile report`` on that run's CUDA trace (``OUT/profile_report.md``): compute,
   memcpy and idle shares, and the profiled step against the wall clock the training stage measured.

``--dry-run`` runs every stage's CPU-side logic on the CPU (tiny shapes, a few steps, the CUDA-only parts
skipped, each with its reason): a step of ``.ci/run``, so the script does not rot between GPU loans.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CARRY = Path(__file__).resolve().parent / "carry"
STAGES = ("environment", "gpu_tests", "gemm", "train", "profile")
#: Seconds each stage may take on the GPU (the whole run fits 5 minutes on an H100 with room to spare).
LIMITS = {"environment": 60, "gpu_tests": 150, "gemm": 60, "train": 150, "profile": 60}
#: The catalog GPU of each device name (substring, lower case).
CATALOG_GPUS = (("h200", "h200"), ("h100", "h100-sxm"), ("a100", "a100-80gb"), ("b200", "b200"),
                ("mi300", "mi300x"))
#: The models the training stage runs (llama_tiny's shape, and a TinyLlama-1.1B-shaped Llama).
MODELS = {
    "llama_tiny": dict(architecture="llama", vocab_size=256, seq_len=128, n_layer=2, n_head=4, n_kv_head=2,
                       d_model=128, d_ff=344, tie_embeddings=False),
    "llama_1b": dict(architecture="llama", vocab_size=32000, seq_len=2048, n_layer=22, n_head=32, n_kv_head=4,
                     d_model=2048, d_ff=5632, tie_embeddings=False),
}
#: Sequences per step, steps (the first ``WARM`` excluded from the timing) per model; the dry run's in brackets.
BATCHES = {"llama_tiny": (32, 40, [8, 3]), "llama_1b": (4, 30, [1, 3])}
WARM = 5


def _commit() -> dict:
    """The commit measured: git's where there is a checkout, else what prepare.sh recorded in carry/."""
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                                    capture_output=True, text=True, timeout=10).stdout.strip())
        return {"commit": head, "dirty": dirty, "source": "git"}
    except (OSError, subprocess.SubprocessError):
        recorded = CARRY / "commit.json"
        if recorded.is_file():
            return {**json.loads(recorded.read_text()), "source": "bench/gpu/carry/commit.json"}
        return {"commit": "unknown", "dirty": None, "source": "none"}


# --- stages (each runs in its own process: ``validate.py --stage NAME``) ---------------------------------------

def stage_environment(dry: bool, out: Path) -> dict:
    import importlib
    import pkgutil

    import torch

    found: dict = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
                   "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        found.update(device=props.name, devices=torch.cuda.device_count(), capability=f"{props.major}.{props.minor}",
                     memory_gib=round(props.total_memory / 2**30, 1), multiprocessors=props.multi_processor_count,
                     nccl=".".join(map(str, torch.cuda.nccl.version())), cudnn=torch.backends.cudnn.version())
        try:
            found["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                             capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError) as error:
            found["driver"] = f"nvidia-smi failed: {error}"
    else:
        found["skipped"] = "no CUDA device: device, driver, NCCL and cuDNN not read"
    found["carried"] = sorted(p.name for p in CARRY.glob("*.whl")) if CARRY.is_dir() else []
    versions = {}
    for name in ("deepspeed", "pytorch_lightning", "lightning", "msgspec", "crc32c", "jsonargparse", "pydantic",
                 "transformers", "safetensors", "pandas", "pyarrow", "numpy"):
        try:
            versions[name] = getattr(importlib.import_module(name), "__version__", "?")
        except Exception as error:  # noqa: BLE001 - a missing or broken package is a finding, named
            versions[name] = f"not importable: {type(error).__name__}: {error}"
    found["packages"] = versions
    failed = {}
    import shardline

    for info in pkgutil.walk_packages(shardline.__path__, "shardline."):
        try:
            importlib.import_module(info.name)
        except Exception as error:  # noqa: BLE001 - what this torch lacks, per module
            failed[info.name] = f"{type(error).__name__}: {error}"
    found["modules_failed"] = failed
    floor = "2.13"
    found["torch_floor_note"] = (f"pyproject asks torch>={floor}; this run is on {torch.__version__}: "
                                 f"{'every module imported' if not failed else f'{len(failed)} modules failed'}")
    return found


def stage_gpu_tests(dry: bool, out: Path) -> dict:
    import torch

    files = ["tests/recipes/test_gpu_single.py"]
    devices = torch.cuda.device_count()  # NVML's count: pytest's process forks ranks, so no CUDA init here
    multi = ["tests/recipes/test_gpt_parity.py", "tests/plugins/test_checkpoint_resume.py"]
    result: dict = {"devices": devices}
    if devices >= 2:
        files += multi
    else:
        result["multi_gpu"] = ("skipped: NCCL across GPUs (the parity of tp2, pp2 and ZeRO-2, resume on NCCL: "
                               f"{', '.join(multi)}) needs two or more GPUs; this machine has {devices}")
    xml = out / "pytest.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", f"--junitxml={xml}",
               *files]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=LIMITS["gpu_tests"] - 10)
    result.update(returncode=done.returncode, tail=done.stdout[-3000:] + done.stderr[-1500:], files=files)
    result.update(_junit(xml))
    if dry:
        result["skipped_reason"] = "no CUDA device: the gpu-marked tests skip (their reasons are in the tail)"
    return result


def _junit(xml: Path) -> dict:
    import xml.etree.ElementTree as ET

    if not xml.is_file():
        return {"junit": "no JUnit file written"}
    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    cases = []
    for case in suite.iter("testcase"):
        state = "passed"
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                state = f"{tag}: {(node.get('message') or '')[:300]}"
        cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "seconds": float(case.get("time", 0)),
                      "result": state})
    return {"cases": cases}


def gemm_shapes(dry: bool) -> list[dict]:
    """The bf16 GEMMs of a Llama 3 8B and 70B layer at tp 1, 2, 4, 8 for 8192 tokens (one micro-batch of a 8192
    sequence), forward and backward: ``[M, K] x [K, N]`` each."""
    tokens = 8192
    shapes = []
    for model, d, heads, kv, ffn, vocab in (("llama3-8b", 4096, 32, 8, 14336, 128256),
                                            ("llama3-70b", 8192, 64, 8, 28672, 128256)):
        hd = d // heads
        for tp in (1, 2, 4, 8):
            for name, k, n in (("qkv", d, (heads + 2 * kv) * hd // tp), ("o", heads * hd // tp, d),
                               ("gate_up", d, 2 * ffn // tp), ("down", ffn // tp, d), ("head", d, vocab // tp)):
                for kind, mkn in (("fwd", (tokens, k, n)), ("bwd_input", (tokens, n, k)),
                                  ("bwd_weight", (k, tokens, n))):
                    shapes.append({"model": model, "tp": tp, "op": name, "pass": kind, "mkn": mkn})
    if dry:  # the code path, not the numbers: a few shapes, 64x smaller
        shapes = [dict(s, mkn=tuple(max(1, v // 64) for v in s["mkn"])) for s in shapes[:6]]
    return shapes


def stage_gemm(dry: bool, out: Path) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available() and not dry
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    rows = []

    def timed(fn, reps):
        for _ in range(2):
            fn()
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3 / reps
        begin = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - begin) / reps

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=True) as prof:
        for shape in gemm_shapes(dry):
            m, k, n = shape["mkn"]
            a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
            seconds = timed(lambda a=a, b=b: torch.mm(a, b), 10 if cuda else 2)
            rows.append({**shape, "mkn": list(shape["mkn"]), "seconds": seconds,
                         "tflops": 2 * m * n * k / seconds / 1e12})
            del a, b
        for heads, seq in ((32, 8192), (8, 8192)):  # 8B's heads at tp 1 and 4, one 8192 sequence, causal
            if dry:
                heads, seq = 2, 256
            q, k, v = (torch.randn(1, heads, seq, 128, device=device, dtype=dtype, requires_grad=True)
                       for _ in range(3))

            def attention(q=q, k=k, v=v):
                y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
                y.sum().backward()

            seconds = timed(attention, 5 if cuda else 1)
            flops = 4 * heads * seq * seq * 128 / 2 * 3.5  # causal; backward 2.5x the forward
            rows.append({"model": "llama3-8b", "op": "sdpa_causal_fwd_bwd", "heads": heads, "seq": seq,
                         "seconds": seconds, "tflops": flops / seconds / 1e12})
        # one rank of one: the profiler's loader (and so --calibrate) names every trace's rank
        prof.add_metadata_json("distributedInfo", json.dumps({"backend": "nccl", "rank": 0, "world_size": 1}))
    trace = out / "gemm_trace.json.gz"
    prof.export_chrome_trace(str(trace))
    result: dict = {"device": device, "dtype": str(dtype), "rows": rows}
    (out / "gemm.json").write_text(json.dumps(rows, indent=1))
    result["calibration"] = _calibrate(trace, out, dry)
    if dry:
        result["skipped_reason"] = "no CUDA device: float32 on the CPU, 6 shapes 64x smaller; no rate is meaningful"
    return result


def _catalog_gpu(out: Path) -> str:
    """The catalog GPU of the device the environment stage read (asking torch here would initialise CUDA in a
    process that forks ranks after it); an H100 where there is none (the dry run)."""
    device = str(_read_results(out).get("environment", {}).get("result", {}).get("device", "h100")).lower()
    return next((gpu for key, gpu in CATALOG_GPUS if key in device), "h100-sxm")


def _calibrate(trace: Path, out: Path, dry: bool) -> dict:
    """``shardline plan --calibrate``'s fit of the sweep's trace, written as a catalog override."""
    import warnings

    from shardline.recipes.planning.calibrate import calibrate
    from shardline.recipes.planning.catalog import load_catalog

    gpu, catalog = _catalog_gpu(out), load_catalog()
    cluster = catalog.cluster(next(name for name, entry in catalog.clusters.items() if entry["gpu"] == gpu))
    from shardline.recipes.planning.catalog import PlanError

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            calibration = calibrate(trace, cluster)
        except PlanError as error:  # a CPU trace (the dry run) has no kernel to fit: said, not raised
            return {"cluster": cluster.name, "error": str(error)}
    (out / "catalog_calibrated.yaml").write_text(calibration.to_yaml())
    return {"cluster": cluster.name, "summary": calibration.summary(),
            "warnings": [str(w.message)[:300] for w in caught]}


def _fit_one(rank, world, name, model, batch, steps, accelerator, precision, profile_dir, wait):
    """One rank's training run (forked by ``run_ranks``): per-step wall times and peak memory."""
    import pytorch_lightning as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from shardline.plugins.lightning.profiler_callback import StepProfiler
    from shardline.plugins.lightning.strategy import HybridParallelStrategy
    from shardline.plugins.testing import adopt_process_group_in_lightning
    from shardline.recipes.lit_lm import LanguageModule

    adopt_process_group_in_lightning()
    cuda = accelerator == "gpu"

    class Clock(pl.Callback):
        def __init__(self):
            self.seconds, self.losses, self._start = [], [], 0.0

        def on_train_batch_start(self, *args):
            if cuda:
                torch.cuda.synchronize()
            self._start = time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, *args):
            if cuda:
                torch.cuda.synchronize()
            self.seconds.append(time.perf_counter() - self._start)
            self.losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))

    clock = Clock()
    callbacks = [clock]
    if profile_dir:
        callbacks.append(StepProfiler(wait=wait, warmup=1, active=2, output_dir=profile_dir))
    tokens = torch.randint(0, model["vocab_size"], (batch * steps, model["seq_len"] + 1),
                           generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()), batch_size=batch)
    trainer = pl.Trainer(accelerator=accelerator, devices=1, strategy=HybridParallelStrategy(zero_stage=1),
                         precision=precision, max_steps=steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    trainer.fit(LanguageModule(**model, lr=3e-4, warmup_steps=2), data)
    peak = ({"allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
             "reserved_gib": torch.cuda.max_memory_reserved() / 2**30} if cuda else {})
    return {"seconds": clock.seconds, "losses": clock.losses, "memory": peak}


def _plan(name: str, model: dict, batch: int, gpu: str, scratch: Path) -> dict:
    """``shardline plan``'s prediction for the run (the same model, batch, sequence and layout), as JSON."""
    spec = scratch / f"{name}.yaml"
    spec.write_text(json.dumps({"name": name, **model}))  # JSON is YAML
    command = [sys.executable, "-m", "shardline.recipes.cli", "plan", "--model", str(spec), "--gpus", "1", "--gpu",
               gpu, "--seq", str(model["seq_len"]), "--global-batch", str(batch), "--json",
               "--layout", "tp=1,pp=1,cp=1,zero=1,recompute=none,micro_batches=1"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        return {"error": (done.stderr or done.stdout)[-800:]}
    rows = json.loads(done.stdout)["layouts"]
    row = rows[0] if rows else {}
    return {k: row.get(k) for k in ("fits", "step_s", "tokens_per_s_per_gpu", "tflops_per_gpu", "mfu", "memory_gib",
                                    "time_s", "problems")}


def stage_train(dry: bool, out: Path) -> dict:
    import torch

    from shardline.plugins.testing import run_ranks

    cuda = torch.cuda.device_count() > 0 and not dry  # NVML's count: no CUDA initialised before the fork
    accelerator, precision = ("gpu", "bf16-mixed") if cuda else ("cpu", "bf16-mixed")
    scratch = Path(os.environ.get("SHARDLINE_VALIDATE_SCRATCH", "/tmp/shardline-validate"))
    scratch.mkdir(parents=True, exist_ok=True)
    gpu = _catalog_gpu(out)
    result: dict = {"accelerator": accelerator, "precision": precision, "catalog_gpu": gpu, "runs": {}}
    for name, model in MODELS.items():
        batch, steps, (dry_batch, dry_steps) = BATCHES[name]
        if dry:
            if name != "llama_tiny":
                result["runs"][name] = {"skipped": "no CUDA device: the 1.1B run is GPU-only (planned below)",
                                        "plan": _plan(name, model, batch, gpu, scratch)}
                continue
            batch, steps = dry_batch, dry_steps
        profile_dir = str(scratch / "profile") if (name == "llama_1b" or dry) else None
        wait = min(WARM, steps - 3)  # the profiled steps: wait+1, wait+2 (after one warm-up step)
        run = run_ranks(_fit_one, 1, name, model, batch, steps, accelerator, precision, profile_dir, wait,
                        backend="nccl" if cuda else "gloo", timeout=LIMITS["train"] - 20)[0]
        result["profiled_steps"] = [wait + 1, wait + 2] if profile_dir else None
        timed = run["seconds"][WARM:] if len(run["seconds"]) > WARM + 2 else run["seconds"][1:]
        step_s = sorted(timed)[len(timed) // 2] if timed else float("nan")
        plan = _plan(name, model, batch, gpu, scratch)
        measured = {"step_s_median": step_s, "tokens_per_s": batch * model["seq_len"] / step_s,
                    "steps_timed": len(timed), "losses_first_last": [run["losses"][0], run["losses"][-1]],
                    "memory": run["memory"], "batch": batch, "steps": steps, "profiled": bool(profile_dir)}
        if plan.get("step_s") and plan.get("mfu") is not None:
            # the planner's model FLOPs per step (Megatron's convention) over the measured step
            measured["mfu"] = plan["mfu"] * plan["step_s"] / step_s
            measured["measured_over_predicted_step"] = step_s / plan["step_s"]
        if not cuda:
            measured["mfu_note"] = "CPU run: the MFU is against the catalog GPU's peak, meaningless here"
        result["runs"][name] = {"measured": measured, "plan": plan, "all_step_s": run["seconds"]}
    return result


def stage_profile(dry: bool, out: Path) -> dict:
    scratch = Path(os.environ.get("SHARDLINE_VALIDATE_SCRATCH", "/tmp/shardline-validate"))
    traces = sorted((scratch / "profile").rglob("*.pt.trace.json*"))
    if not traces:
        return {"error": f"no StepProfiler trace under {scratch / 'profile'} (did the train stage run?)"}
    folder = traces[0].parent
    report = out / "profile_report.md"
    result: dict = {"trace": str(traces[0]), "trace_mb": traces[0].stat().st_size / 1e6}
    for fmt, target in (("md", report), ("json", scratch / "breakdown.json")):
        done = subprocess.run([sys.executable, "-m", "shardline.recipes.cli", "profile", "report", str(folder),
                               "--format", fmt, "-o", str(target)], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            result[f"{fmt}_error"] = (done.stderr or done.stdout)[-1500:]
    breakdown = scratch / "breakdown.json"
    if breakdown.is_file():
        result["breakdown"] = _shares(json.loads(breakdown.read_text()))
    if report.is_file():
        text = report.read_text()
        at = text.find("Findings")
        result["findings"] = text[at:at + 2500] if at >= 0 else "no findings section"
    train = _read_results(Path(os.environ["SHARDLINE_VALIDATE_OUT"])).get("train", {}).get("result", {})
    key = "llama_tiny" if dry else "llama_1b"
    wall = train.get("runs", {}).get(key, {}).get("all_step_s") or []
    which = train.get("profiled_steps")
    if wall and which and result.get("breakdown", {}).get("steps"):
        profiled = [wall[i] for i in which if i < len(wall)]
        result["wall_clock_of_profiled_steps_s"] = profiled
        result["profiled_step_over_wall"] = [s["step_s"] / w for s, w in
                                             zip(result["breakdown"]["steps"], profiled, strict=False)]
    if dry:
        result["skipped_reason"] = "no CUDA device: a CPU trace (no kernels, so no compute/memcpy split)"
    return result


def _shares(rows) -> dict:
    """Per (rank, step) of the breakdown's JSON rows (integer ns): the step's time, the share of each exclusive
    category, and whether the categories sum to the step (they must)."""
    skip = {"rank", "step", "lanes", "start_ns", "end_ns", "step_ns", "comm_ns", "pageable_memcpy_ns", "overlap_ratio"}
    steps = []
    for row in rows if isinstance(rows, list) else []:
        total = row.get("step_ns")
        if not isinstance(total, int) or total <= 0:
            continue
        parts = {k: v for k, v in row.items() if k not in skip and not k.startswith(("overlapped_", "idle_"))
                 and isinstance(v, int)}
        steps.append({"rank": row.get("rank"), "step": row.get("step"), "step_s": total / 1e9,
                      "parts_sum_to_step": sum(parts.values()) == total,
                      "shares": {k: round(v / total, 4) for k, v in parts.items() if v}})
    return {"steps": steps}


# --- the driver --------------------------------------------------------------------------------------------------

def _read_results(out: Path) -> dict:
    path = out / "validate.json"
    return json.loads(path.read_text()).get("stages", {}) if path.is_file() else {}


def _write(out: Path, header: dict, stages: dict) -> None:
    (out / "validate.json").write_text(json.dumps({**header, "stages": stages}, indent=1, default=str))
    lines = [f"# shardline GPU validation{' (dry run)' if header['dry_run'] else ''}", "",
             f"commit {header['commit']['commit']}{' (dirty)' if header['commit'].get('dirty') else ''}; "
             f"started {header['started']}", ""]
    for name in STAGES:
        if name not in stages:
            continue
        stage = stages[name]
        lines += [f"## {name}: {stage['status']} in {stage['seconds']:.1f} s", "", "```",
                  json.dumps(stage.get("result", stage.get("error")), indent=1, default=str)[:6000], "```", ""]
    (out / "validate.md").write_text("\n".join(lines))


def run_stage(name: str, dry: bool, out: Path) -> None:
    """In the stage's own process: run it and print its result as the last line (JSON)."""
    result = globals()[f"stage_{name}"](dry, out)
    print("\n@@result@@ " + json.dumps(result, default=str))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--stage", choices=STAGES, help="(internal) run one stage in this process")
    parser.add_argument("--only", default=",".join(STAGES), help="comma-separated stages to run")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.stage:
        run_stage(args.stage, args.dry_run, out)
        return 0
    os.environ["SHARDLINE_VALIDATE_OUT"] = str(out)
    header = {"commit": _commit(), "dry_run": args.dry_run, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
              "host": platform.node()}
    stages: dict = {}
    failed = 0
    for name in [s for s in STAGES if s in args.only.split(",")]:
        begin = time.monotonic()
        try:
            done = subprocess.run([sys.executable, __file__, "--out", str(out), "--stage", name,
                                   *(["--dry-run"] if args.dry_run else [])], capture_output=True, text=True,
                                  timeout=LIMITS[name])
            marker = done.stdout.rfind("@@result@@ ")
            if done.returncode == 0 and marker >= 0:
                stage = {"status": "ok", "result": json.loads(done.stdout[marker + len("@@result@@ "):])}
            else:
                stage = {"status": f"failed (exit {done.returncode})", "error": (done.stdout + done.stderr)[-4000:]}
        except subprocess.TimeoutExpired as timeout:
            said = (timeout.stdout or b"")[-2000:] + (timeout.stderr or b"")[-2000:]
            stage = {"status": f"timed out after {LIMITS[name]} s",
                     "error": said.decode(errors="replace") if isinstance(said, bytes) else str(said)}
        except Exception:  # noqa: BLE001 - the driver reports and goes on to the next stage
            stage = {"status": "failed in the driver", "error": traceback.format_exc()[-4000:]}
        stage["seconds"] = time.monotonic() - begin
        failed += stage["status"] != "ok"
        stages[name] = stage
        _write(out, header, stages)
        print(f"validate: {name}: {stage['status']} ({stage['seconds']:.1f} s)", flush=True)
    print(f"validate: results in {out / 'validate.md'} and {out / 'validate.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
