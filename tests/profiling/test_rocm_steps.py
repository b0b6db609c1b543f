"""ROCm step windows (issue 19, section 2): GPU-side ``ProfilerStep#N`` annotations are checked against the
kernels each CPU step launched (by correlation id) and, where they are stubs, out of order or missing, every
window of the rank is derived from that work: [first start, last end) of what CPU step N launched, with one
``TraceWarning`` naming the file. Healthy annotations stay as they are. Generic RCCL kernels
(``ncclDevKernel_Generic``, no collective in their args) take the collective of the op that launched them.

The traces are Kineto JSON written here, laid out in whole µs so every expected ns is exact."""

from __future__ import annotations

import gzip
import json
import warnings
from pathlib import Path

import pytest

from shardline.profiling.attribution.core import EXCLUSIVE_COLUMNS, attribute, breakdown
from shardline.profiling.base.errors import TraceWarning
from shardline.profiling.table.load import load

BASE_NS = 1_700_000_000_000_000_000
STEPS = (1, 2, 3)
KERNEL = "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>()"
GENERIC = "ncclDevKernel_Generic(ncclDevKernelArgsStorage<4096ul>)"  # RCCL's generic kernel, no args


def _cpu_step(n: int) -> tuple[int, int]:
    """CPU ProfilerStep#n in µs: 9 ms every 10 ms."""
    return 10_000 * n, 10_000 * n + 9_000


def _kernels(n: int) -> list[tuple[int, int, int]]:
    """(correlation, start µs, dur µs) of the three kernels CPU step n launches: launched at +100/+1100/+2100,
    each starting 500 µs after its launch and running 800 µs."""
    lo, _ = _cpu_step(n)
    return [(100 * n + j, lo + 600 + 1_000 * j, 800) for j in range(3)]


def launched_window(n: int) -> tuple[int, int]:
    """The rule's window of step n in ns: first launched kernel start to last launched kernel end."""
    ks = _kernels(n)
    return BASE_NS + 1_000 * ks[0][1], BASE_NS + 1_000 * (ks[-1][1] + ks[-1][2])


def _event(cat, name, ts, dur, *, gpu, **args):
    pid, tid = (0, 7) if gpu else (4242, 4242)
    if gpu:
        args.update(device=0, stream=7)
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur, "args": args}


def write_trace(folder: Path, gpu_steps: dict[int, tuple[int, int]] | None, *, extra=()) -> Path:
    """One rank-0 trace of the three steps; ``gpu_steps``: step -> (start µs, dur µs) of its GPU-side
    annotation (None: the healthy ones, the hull of each step's kernels)."""
    if gpu_steps is None:
        gpu_steps = {n: (_kernels(n)[0][1], _kernels(n)[-1][1] + 800 - _kernels(n)[0][1]) for n in STEPS}
    events = []
    for n in STEPS:
        lo, hi = _cpu_step(n)
        events.append(_event("user_annotation", f"ProfilerStep#{n}", lo, hi - lo, gpu=False))
        for corr, start, dur in _kernels(n):
            events.append(_event("cuda_runtime", "hipLaunchKernel", start - 500, 10, gpu=False, correlation=corr))
            events.append(_event("kernel", KERNEL, start, dur, gpu=True, correlation=corr))
    for n, (start, dur) in gpu_steps.items():
        events.append(_event("gpu_user_annotation", f"ProfilerStep#{n}", start, dur, gpu=True))
    events.extend(extra)
    doc = {"schemaVersion": 1, "distributedInfo": {"backend": "nccl", "rank": 0, "world_size": 1},
           "baseTimeNanoseconds": BASE_NS, "deviceProperties": [{"id": 0, "name": "AMD Instinct MI300X"}],
           "traceEvents": events}
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "rank0.pt.trace.json.gz"
    with gzip.open(path, "wt") as fh:
        json.dump(doc, fh)
    return path


def _breakdown_and_notes(path: Path, *, rank: int | None = None):
    ts = load(path, rank=rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        table = breakdown(ts)
    notes = [str(w.message) for w in caught if issubclass(w.category, TraceWarning)]
    assert (table[list(EXCLUSIVE_COLUMNS)].sum(axis=1) == table["step_ns"]).all()
    return table, notes


def _windows(table) -> dict[int, tuple[int, int]]:
    return {int(s): (int(a), int(b)) for s, a, b in zip(table["step"], table["start_ns"], table["end_ns"])}


def _expect_derived(path: Path, *phrases: str) -> None:
    table, notes = _breakdown_and_notes(path)
    assert _windows(table) == {n: launched_window(n) for n in STEPS}
    assert len(notes) == 1, notes
    assert notes[0].startswith(f"{path}: GPU step annotations are ")
    assert "steps derived from the kernels each CPU step launched (first start to last end)" in notes[0]
    for phrase in phrases:
        assert phrase in notes[0], notes[0]
    # Each window holds exactly its step's three kernels (2.4 ms of compute in a 2.8 ms window).
    assert table["compute"].tolist() == [2_400_000] * 3 and table["idle"].tolist() == [400_000] * 3


def test_stub_gpu_annotations_are_replaced(tmp_path):
    # 8 µs stubs at each step's first kernel, for steps whose CPU span is 9 ms and kernels span 2.8 ms.
    path = write_trace(tmp_path, {n: (_kernels(n)[0][1], 8) for n in STEPS})
    _expect_derived(path, "stubs (3 of 3 steps): step 1 is 8 µs on the GPU but 9 ms on the CPU, "
                          "its kernels span 2.8 ms")


def test_out_of_order_gpu_annotations_are_replaced(tmp_path):
    healthy = {n: (_kernels(n)[0][1], 2_800) for n in STEPS}
    swapped = {1: healthy[1], 2: healthy[3], 3: healthy[2]}  # steps 2 and 3 trade places
    path = write_trace(tmp_path, swapped)
    _expect_derived(path, "out of order (2 of 3 steps): step 3 starts 10 ms before step 2 on the GPU")


def test_misplaced_gpu_annotation_is_out_of_order(tmp_path):
    # Right length, in order, but step 2's annotation sits over the idle gap after its kernels.
    gpu = {n: (_kernels(n)[0][1], 2_800) for n in STEPS}
    gpu[2] = (_kernels(2)[0][1] + 4_000, 2_800)
    path = write_trace(tmp_path, gpu)
    _expect_derived(path, "out of place (1 of 3 steps): step 2 covers 0% of the span of its kernels on the GPU")


def test_missing_gpu_annotations_are_replaced(tmp_path):
    gpu = {n: (_kernels(n)[0][1], 2_800) for n in STEPS if n != 2}
    path = write_trace(tmp_path, gpu)
    _expect_derived(path, "missing (1 of 3 steps): step 2")


def test_several_failures_make_one_warning(tmp_path):
    gpu = {1: (_kernels(1)[0][1], 8), 3: (_kernels(3)[0][1], 2_800)}  # step 1 a stub, step 2 missing
    path = write_trace(tmp_path, gpu)
    _expect_derived(path, "stubs (1 of 3 steps): step 1 is 8 µs", "; missing (1 of 3 steps): step 2;")


def test_healthy_gpu_annotations_are_kept_without_warning(tmp_path):
    # Healthy annotations a little wider than their kernels (GPU work the check does not see, e.g. a memset
    # launched outside the step) stay exactly as recorded.
    gpu = {n: (_kernels(n)[0][1] - 50, 2_900) for n in STEPS}
    path = write_trace(tmp_path, gpu)
    table, notes = _breakdown_and_notes(path)
    assert notes == []
    assert _windows(table) == {n: (BASE_NS + 1_000 * s, BASE_NS + 1_000 * (s + d)) for n, (s, d) in gpu.items()}


def test_no_gpu_annotations_keeps_the_work_step_rule(tmp_path):
    # No GPU-side annotation at all (the common CUDA case without them): rule 2 of attribution, no warning.
    path = write_trace(tmp_path, {})
    table, notes = _breakdown_and_notes(path)
    assert notes == []
    ends = [launched_window(2)[0], launched_window(3)[0], launched_window(3)[1]]
    assert _windows(table) == {n: (launched_window(n)[0], end) for n, end in zip(STEPS, ends)}


def test_warning_is_issued_on_every_breakdown_read(tmp_path):
    path = write_trace(tmp_path, {n: (_kernels(n)[0][1], 8) for n in STEPS})
    ts = load(path)
    for _ in range(2):
        with pytest.warns(TraceWarning, match="GPU step annotations are stubs"):
            breakdown(ts)
    rank = attribute(ts).rank(0)
    assert rank.window_note is not None and rank.windows["start_ns"].tolist() == [launched_window(n)[0]
                                                                                  for n in STEPS]


def test_events_table_without_files_names_the_rank(tmp_path):
    path = write_trace(tmp_path, {n: (_kernels(n)[0][1], 8) for n in STEPS})
    events = load(path).events
    with pytest.warns(TraceWarning, match=r"^rank 0: GPU step annotations are stubs"):
        breakdown(events)


def test_generic_rccl_kernel_takes_the_collective_of_its_op(tmp_path):
    # ROCm/RCCL's ncclDevKernel_Generic carries no collective: the c10d op that launched it names it.
    lo, _ = _cpu_step(1)
    extra = [_event("cpu_op", "c10d::allreduce_", lo + 5_000, 200, gpu=False),
             _event("cuda_runtime", "hipLaunchKernel", lo + 5_050, 10, gpu=False, correlation=999),
             _event("kernel", GENERIC, lo + 5_100, 300, gpu=True, correlation=999)]
    path = write_trace(tmp_path, None, extra=extra)
    ts = load(path)
    events = ts.events
    generic = events[events["name"] == GENERIC]
    assert generic["collective"].astype(str).tolist() == [""]  # nothing in its own args
    assert generic["category"].astype(str).tolist() == ["all_reduce"]
    assert int(generic["step"].iloc[0]) == 1
    # Step 1's annotation no longer spans its work (the all-reduce runs after its end): derived windows.
    table, notes = _breakdown_and_notes(path)
    assert _windows(table)[1] == (launched_window(1)[0], BASE_NS + 1_000 * (lo + 5_400))
    assert table.loc[table["step"] == 1, "all_reduce"].tolist() == [300_000]
    assert len(notes) == 1 and "out of place (1 of 3 steps): step 1 covers 58% of the span" in notes[0]


def test_corpus_rocm_trace_steps_from_launched_work(traces_dir):
    """The MI250 ROCm 6.2 trace (HTA's tests/data/amd_trace): its GPU ProfilerStep#1 spans 1.03 ms of a
    9.29 ms CPU step whose kernels run for 8.9 ms (the backward thread's launches fall outside it)."""
    path = traces_dir / "hta" / "amd_trace" / "mi250_minitoy_train_ROCm6_2_kineto.json.gz"
    if not path.is_file():
        pytest.skip(f"corpus file absent: {path}")
    ts = load(path, rank=0)
    ev = ts.events
    cpu = ev[(ev["lane"] == "cpu") & (ev["step"] == 1) & (ev["correlation"] >= 0)]
    gpu = ev[(ev["lane"] == "gpu") & ev["cat"].astype(str).isin(["kernel", "gpu_memcpy", "gpu_memset"])
             & ev["correlation"].isin(set(cpu["correlation"]))]
    want = (int(gpu["start_ns"].min()), int((gpu["start_ns"] + gpu["dur_ns"]).max()))
    table, notes = _breakdown_and_notes(path, rank=0)
    assert _windows(table) == {1: want}
    assert len(notes) == 1 and notes[0].startswith(f"{path}: GPU step annotations are stubs (1 of 1 steps): "
                                                   "step 1 is 1.03 ms on the GPU but 9.29 ms on the CPU")
