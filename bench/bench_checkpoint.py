"""Checkpoint save and load: shardline's layout-independent checkpoint (``HybridParallelStrategy.save_checkpoint``
/ ``load_checkpoint``) against DeepSpeed's own ``engine.save_checkpoint`` / ``engine.load_checkpoint`` on the same
engine at the same layout, side by side in one run, on 4 forked gloo CPU ranks; plus a resharding load (a
checkpoint saved in another layout), which DeepSpeed cannot do, so it is ours alone.

Method, per (model, layout), in one set of 4 forked ranks (``run_ranks``):

- A Lightning ``Trainer`` with ``HybridParallelStrategy`` fits one step of AdamW (float32), so the optimizer
  state exists; everything below runs in that step's ``on_train_batch_end``, on the trained engine.
- Lightning's ``dump_checkpoint`` (the same for both sides: ``trainer.save_checkpoint`` calls it before either
  strategy's save) runs once, timed apart. Ours is ``strategy.save_checkpoint(checkpoint, folder)``; DeepSpeed's
  is what Lightning's own ``DeepSpeedStrategy`` does with it: ``engine.save_checkpoint(dir, tag=...,
  client_state=<the checkpoint without state_dict and optimizer_states>)``. Loads: ours is
  ``strategy.load_checkpoint(folder)``, DeepSpeed's ``engine.load_checkpoint(dir, tag=...,
  load_optimizer_states=True, load_lr_scheduler_states=False)`` (again what ``DeepSpeedStrategy`` calls).
- One untimed warm-up round, then ``repeats`` rounds; each round saves with both (the order alternating round by
  round), then loads both (alternating), then the resharding load where there is one. Each operation starts after
  ``gc.collect()``, ``malloc_trim(0)`` and a barrier; its time is the slower rank's; the table shows medians.
- Page cache, the same for both: before every operation (untimed) every file of every checkpoint on hand is
  fsynced and dropped from the page cache (``posix_fadvise(DONTNEED)``), and the previous round's deletions are
  flushed (``os.sync()``) before the next round, so no save's write-back spills into the next operation, every
  load reads from the device, cold, and none runs beside the other side's cached files. (Without that, whichever side
  ran second in a round ran beside the first one's 4-5 GB of cached files and took up to twice as long.) Then rank 0
  waits for the device to go idle (nothing in flight, its counters still for 0.25 s: ext4's ``discard`` TRIMs of
  deleted files reach the device after ``os.sync()``, and had slowed whichever save came first in a round).
  Ours fsyncs each file inside its save (an atomic,
  durable commit); DeepSpeed's ``torch.save`` does not, so "DS + fsync" adds the fsync of DeepSpeed's files
  (each rank a quarter of them, in parallel, the slower rank) for the same durability.
- Memory per rank: ``VmHWM`` (peak RSS, reset through ``/proc/self/clear_refs`` right before the operation) minus
  ``VmRSS`` before it: how much an operation adds on top of the training state; and the peak of ``RssAnon``
  (sampled every 5 ms by a thread) above its start, which leaves out the checkpoint files a reader maps.
- ``--profile`` (default: every model but the tiny one): one more save and load of each side under cProfile on
  every rank, after the timed rounds; rank 0's breakdown goes into the results, the pstats files and their top
  functions into bench/out/bench_checkpoint/.

Models: a tiny Llama at three layouts, and bench_construction's Llama shape (vocab 32000, d_model 2048, GQA
16/8 heads, d_ff 5632) with fewer layers. The 16-layer 0.89B does not fit this machine (24 GB for the 4 ranks):
its first AdamW step at tp2 x pp2 x ZeRO-1 was OOM-killed at 21.7 GB, before any checkpoint, and a load needs
about 12 bytes per parameter of the rank's part on top of the training state on either side. ``big`` (4 layers,
0.32B) is timed at tp2 x pp2 x ZeRO-1, pp4 x ZeRO-0 (a resharding load: saved at the first, loaded at the
second) and dp4 x ZeRO-3 (a resharding load from pp4: every rank needs a quarter of every whole tensor a stage
saved, the case the chunk CRCs are for: only the chunks holding its rows are read); ``mid`` (1 layer, 0.18B) at
dp4 x ZeRO-3. ``--big-layers 16`` runs the 0.89B where memory allows.

Writes bench/results/bench_checkpoint.md (``--results`` elsewhere) and prints it; the raw per-rank numbers go to
bench/out/bench_checkpoint/raw.json.

    python bench/bench_checkpoint.py --quick      # the tiny model only (~4 min)
    python bench/bench_checkpoint.py              # + big and mid (~20 min; up to ~17 GB on disk at once)
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from _publish import publish
from torch.utils.data import DataLoader, TensorDataset

from shardline.plugins.lightning.strategy import HybridParallelStrategy
from shardline.plugins.testing import adopt_process_group_in_lightning, run_ranks
from shardline.recipes.lit_lm import LanguageModule

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "bench_checkpoint.md"
OUT = ROOT / "bench" / "out" / "bench_checkpoint"
WORLD, SEQ, BATCH = 4, 16, 4  # one global batch of 4 sequences of 16 tokens: the step only has to create state
_LLAMA = dict(architecture="llama", vocab_size=32000, seq_len=2048, n_head=16, n_kv_head=8, d_model=2048, d_ff=5632,
              tie_embeddings=False, lr=3e-4, warmup_steps=4)  # bench/bench_construction.py's Llama, 16 layers: 0.89B
MODELS = {
    "tiny": dict(architecture="llama", vocab_size=256, seq_len=64, n_layer=4, n_head=4, n_kv_head=2, d_model=128,
                 tie_embeddings=False, lr=3e-3, warmup_steps=4),
    # The 0.89B model does not fit here (24 GB for 4 ranks): its first AdamW step at tp2 x pp2 x ZeRO-1 alone was
    # OOM-killed (21.7 GB for the 4 ranks). These keep its shape with fewer layers; --big-layers 16 is the 0.89B.
    "big": dict(_LLAMA, n_layer=4),
    "mid": dict(_LLAMA, n_layer=1),  # ZeRO-3: our load holds the whole unpartitioned model on every rank
}
LAYOUTS = {
    "dp4_zero1": dict(zero_stage=1),
    "tp2_pp2_zero1": dict(tp=2, pp=2, zero_stage=1),
    "dp4_zero3": dict(zero_stage=3),
    "pp4_zero0": dict(pp=4, zero_stage=0),
}
# (model, layout, timed rounds, the layout whose checkpoint of this model it also loads (resharding), or None).
# tiny: 31 rounds (a round takes about two seconds, most of it the page-cache eviction and the device's quiet
# wait): its 20-40 ms operations' ratio ours/DS varies by +-0.3 round to round on this 2-core host (4 ranks share
# 2 cores: a rank's wall time includes the others' work), and with 11 rounds the median itself moved 1.08-1.30
# between runs of the same code (1c3f738); 31 rounds make its spread about 0.6x as wide.
QUICK = [("tiny", "tp2_pp2_zero1", 31, None), ("tiny", "dp4_zero1", 31, None),
         ("tiny", "dp4_zero3", 31, "tp2_pp2_zero1")]
FULL = [*QUICK, ("big", "tp2_pp2_zero1", 4, None), ("big", "pp4_zero0", 4, "tp2_pp2_zero1"),
        ("big", "dp4_zero3", 3, "pp4_zero0"), ("mid", "dp4_zero3", 5, None)]


def n_params(m: dict) -> int:
    d, ff, kv = m["d_model"], m.get("d_ff") or 4 * m["d_model"], m["n_kv_head"] * m["d_model"] // m["n_head"]
    block = 2 * d * d + 2 * d * kv + 3 * d * ff + 2 * d
    return m["vocab_size"] * d * (1 if m["tie_embeddings"] else 2) + m["n_layer"] * block + d


# --- per-rank measurement helpers ---------------------------------------------------------------------------

def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5": reset VmHWM to the current RSS (Linux >= 4.0)
        f.write("5")


_LIBC = ctypes.CDLL("libc.so.6")


def _quiet_heap() -> None:
    gc.collect()
    _LIBC.malloc_trim(0)  # what the previous operation freed goes back to the OS: each peak starts clean


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in Path(folder).rglob("*") if p.is_file())


def _evict(folder: Path, share: tuple[int, int] = (0, 1)) -> None:
    """fsync every file of ``folder`` (this rank's ``share``) and drop it from the page cache."""
    me, of = share
    for path in _files(folder)[me::of]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _device_stat(folder: Path) -> Path | None:
    """``/sys/dev/block/MAJOR:MINOR/stat`` of the block device holding ``folder`` (None where there is none: a
    network or in-memory file system)."""
    folder = Path(folder)
    while not folder.exists():  # the checkpoints' folder may not be made yet: the device of its nearest parent
        folder = folder.parent
    dev = os.stat(folder).st_dev
    path = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat")
    return path if path.is_file() else None


def _quiet_device(stat: Path | None, *, still: float = 0.25, limit: float = 20.0) -> float:
    """Wait until the device has nothing in flight and its counters (reads, writes, discards) stayed unchanged
    for ``still`` seconds, at most ``limit``; the seconds waited. With ext4's ``discard`` mount option a deletion's
    TRIMs reach the device after ``os.sync()`` returns: without this wait whichever operation ran first in a round
    paid for the previous round's deletions (bench at 83afba1: ours 3.1-3.2 s when first, 1.8 s when second)."""
    if stat is None:
        return 0.0
    start = time.monotonic()
    last, since = None, start
    while time.monotonic() - start < limit:
        fields = stat.read_text().split()
        now = (fields[0], fields[4], *fields[11:12])  # reads, writes, discards completed
        if now != last or fields[8] != "0":  # fields[8]: I/Os in flight
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= still:
            break
        time.sleep(0.02)
    return time.monotonic() - start


def _bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in _files(folder))


class _AnonPeak(threading.Thread):
    """Samples ``RssAnon`` (the process's anonymous memory: not the file pages a reader maps) every 5 ms."""

    def __init__(self):
        super().__init__(daemon=True)
        self.done, self.peak = threading.Event(), _status("RssAnon:")

    def run(self):
        while not self.done.wait(0.005):
            self.peak = max(self.peak, _status("RssAnon:"))

    def stop(self) -> int:
        self.done.set()
        self.join()
        return max(self.peak, _status("RssAnon:"))


def _timed(fn, *args, what: str = "") -> dict:
    """Seconds of ``fn(*args)`` on this rank (started after a barrier), its peak RSS (VmHWM) and peak anonymous memory
    (sampled), each above the value before it, in bytes."""
    _quiet_heap()
    dist.barrier()
    before, anon_before = _status("VmRSS:"), _status("RssAnon:")
    _reset_peak()
    sampler = _AnonPeak()
    sampler.start()
    start = time.perf_counter()
    fn(*args)
    seconds = time.perf_counter() - start
    anon = sampler.stop()
    peak = _status("VmHWM:")
    dist.barrier()
    if what and dist.get_rank() == 0 and os.environ.get("BENCH_CHECKPOINT_VERBOSE"):
        print(f"  rank 0 {what}: {seconds:.2f} s, peak RSS +{(peak - before) / 2 ** 20:,.0f} MB, anon "
              f"+{(anon - anon_before) / 2 ** 20:,.0f} MB", flush=True)
    return {"s": seconds, "peak_above": peak - before, "anon_above": anon - anon_before, "rss_before": before}


def _relink(optimizer) -> None:
    """DeepSpeed 0.19's ZeRO-1/2 ``load_checkpoint`` re-links every parameter's fragment of the flat float32
    partition (``_link_all_hp_params``) but leaves ``_hp_optimizer_states_linked`` set, so the fragments' optimizer
    states stay unlinked and ``safe_get_full_optimizer_state`` (which our save uses) fails from then on; link them
    again (untimed, cheap)."""
    if getattr(optimizer, "_hp_optimizer_states_linked", False):
        optimizer._hp_optimizer_states_linked = False
        optimizer._lazy_init_hp_params_optimizer_state()


class _Bench(pl.Callback):
    """The measurement, run once the first training step has created the optimizer state."""

    def __init__(self, *, root: Path, repeats: int, reshard_from: Path | None, keep_to: Path | None,
                 profile_to: Path | None):
        self.root, self.repeats, self.reshard_from = root, repeats, reshard_from
        self.keep_to, self.profile_to = keep_to, profile_to
        self.result: dict = {}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        strategy, rank = trainer.strategy, dist.get_rank()
        engine = strategy.model  # the DeepSpeedEngine (under pp > 1: this rank's stages)
        optimizer = engine.optimizer
        from shardline.plugins.lightning import deepspeed_compat as compat

        keys = compat.optimizer_state_keys(optimizer)
        assert keys, "no optimizer state after the first step"
        gc.collect()
        gc.freeze()  # what exists now is never garbage here: each operation's gc.collect() scans only its own
        start = time.perf_counter()
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        dump_s = time.perf_counter() - start
        client_state = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        ds_dir = self.root / "ds"

        def ours_path(i):
            return self._folder("ours", i)

        def async_save(i):  # async_checkpoint=True: returns once the pieces are copied; a thread writes them
            strategy.async_checkpoint = True
            try:
                strategy.save_checkpoint(checkpoint, self._folder("async", i))
            finally:
                strategy.async_checkpoint = False

        ops = {
            "ours_save": lambda i: strategy.save_checkpoint(checkpoint, ours_path(i)),
            "async_save": async_save,
            "async_commit": lambda i: strategy.checkpointer.settle(),  # waits for the writes, then commits
            "ds_save": lambda i: engine.save_checkpoint(str(ds_dir), tag=f"step-{i}", client_state=client_state),
            "ours_load": lambda i: strategy.load_checkpoint(ours_path(i)),
            "ds_load": lambda i: engine.load_checkpoint(str(ds_dir), tag=f"step-{i}", load_optimizer_states=True,
                                                        load_lr_scheduler_states=False, load_module_strict=True),
        }
        if self.reshard_from is not None:
            ops["reshard_load"] = lambda i: strategy.load_checkpoint(self.reshard_from)
        rows: dict[str, list] = {name: [] for name in [*ops, "ds_fsync"]}
        sizes = {}
        device = _device_stat(self.root)

        def settle(i):
            """Before every timed operation (rank 0; the others wait in ``_timed``'s barrier): no checkpoint file
            in the page cache, none left to write back and the device idle, so each starts from the same state."""
            if rank == 0:
                for folder in (ours_path(i), self._folder("ds", i), self._folder("async", i), self.reshard_from):
                    if folder is not None and folder.exists():
                        _evict(folder)
                _quiet_device(device)

        for i in range(self.repeats + 1):  # round 0 is the warm-up
            saves = ["ours_save", "ds_save"] if i % 2 else ["ds_save", "ours_save"]
            for name in saves:
                settle(i)
                rows[name].append(_timed(ops[name], i, what=f"{name} round {i}"))
                if name == "ds_save":  # what ours does inside its save: every file on the device
                    rows["ds_fsync"].append(_timed(_evict, self._folder("ds", i), (rank, WORLD)))
            settle(i)
            rows["async_save"].append(_timed(ops["async_save"], i, what=f"async_save round {i}"))
            rows["async_commit"].append(_timed(ops["async_commit"], i, what=f"async_commit round {i}"))
            if rank == 0:
                sizes = {"ours": _bytes(ours_path(i)), "ds": _bytes(self._folder("ds", i))}
            loads = ["ours_load", "ds_load"] if i % 2 else ["ds_load", "ours_load"]
            for name in [*loads, *(["reshard_load"] if self.reshard_from is not None else [])]:
                settle(i)
                rows[name].append(_timed(ops[name], i, what=f"{name} round {i}"))
                strategy.checkpointer.rng_state = None  # no training step follows
                if name == "ds_load":
                    _relink(optimizer)
            if rank == 0 and i < self.repeats:  # the last pair stays for the profile and the resharding source
                shutil.rmtree(ours_path(i))
                shutil.rmtree(self._folder("ds", i))
                shutil.rmtree(self._folder("async", i))
                os.sync()  # the deletions reach the device now, not during the next round's first save
            dist.barrier()
        last = self.repeats
        if rank == 0:
            shutil.rmtree(self._folder("async", last))
        dist.barrier()
        if self.profile_to is not None:
            self._profile(strategy, ops, last, rank)
        if self.keep_to is not None and rank == 0:
            os.replace(ours_path(last), self.keep_to)
        dist.barrier()
        self.result = {"rows": {k: v[1:] for k, v in rows.items()}, "warmup": {k: v[:1] for k, v in rows.items()},
                       "sizes": sizes, "dump_s": dump_s, "keys": keys, "rss": _status("VmRSS:"),
                       "params": sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters()),
                       "optimizer": type(optimizer).__name__, "zero": strategy.config.get("zero_optimization")}

    def _profile(self, strategy, ops, last: int, rank: int) -> None:
        """One more save and load of each side under cProfile on every rank (the same cold reads as above)."""
        import cProfile

        self.profile_to.mkdir(parents=True, exist_ok=True)
        extra = last + 1
        for side in ("ours", "ds"):
            for op in ("save", "load"):
                profiler = cProfile.Profile()
                _quiet_heap()
                dist.barrier()
                profiler.enable()
                ops[f"{side}_{op}"](extra)
                profiler.disable()
                strategy.checkpointer.rng_state = None
                if side == "ds" and op == "load":
                    _relink(strategy.model.optimizer)
                profiler.dump_stats(str(self.profile_to / f"{side}_{op}_rank{rank}.pstats"))
                dist.barrier()
                if op == "save":
                    _evict(self._folder(side, extra), (rank, WORLD))
                dist.barrier()
            if rank == 0:
                shutil.rmtree(self._folder(side, extra), ignore_errors=True)
            dist.barrier()
        if "reshard_load" in ops:
            if rank == 0:
                _evict(self.reshard_from)
            profiler = cProfile.Profile()
            _quiet_heap()
            dist.barrier()
            profiler.enable()
            ops["reshard_load"](extra)
            profiler.disable()
            strategy.checkpointer.rng_state = None
            profiler.dump_stats(str(self.profile_to / f"reshard_load_rank{rank}.pstats"))
            dist.barrier()

    def _folder(self, side: str, i: int) -> Path:
        return self.root / side / f"step-{i}"


def _dataset(vocab: int) -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=g)
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def _rank(rank, world, model, layout, root, repeats, reshard_from, keep_to, profile_to):
    adopt_process_group_in_lightning()
    bench = _Bench(root=Path(root), repeats=repeats, reshard_from=reshard_from, keep_to=keep_to,
                   profile_to=profile_to)
    strategy = HybridParallelStrategy(**LAYOUTS[layout])
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, callbacks=[bench], precision="32-true")
    dp = strategy.layout_for(world).dp
    trainer.fit(LanguageModule(**MODELS[model]),
                DataLoader(_dataset(MODELS[model]["vocab_size"]), batch_size=BATCH // dp))
    return bench.result


# --- the profile's summary -----------------------------------------------------------------------------------

#: Per operation: (label, cProfile function names whose cumulative time counts under it: "file.py:function" for
#: Python functions, a substring of the name for built-ins, "self:" + a name for that function's own time only);
#: an indented label is a part of the line above it. (Before a1f7b84, and again since 34d4aea, a load reads
#: through memory maps: its device reads happen at the first touch of the bytes, which is the CRC's, so they
#: count under the CRC line, not under "device reads (readinto)".)
PROFILE_GROUPS = {
    "ours_save": [
        # the rank's ZeRO fragments (a view), else its whole TP-part value (DeepSpeed's full accessors)
        ("values", ("deepspeed_compat.py:local_fragment", "checkpoint_access.py:weight", "checkpoint_access.py:state",
                    "checkpointing.py:weight", "checkpointing.py:state")),
        ("  safe_get_full_*, a collective over dp", ("tensor_fragment.py:safe_get_full_fp32_param",
                                                      "tensor_fragment.py:safe_get_full_optimizer_state")),
        ("  ZeRO-3 GatheredParameters", ("partition_parameters.py:__enter__", "partition_parameters.py:__exit__")),
        ("pieces: to_canonical, flat_boxes, clone", ("boxes.py:to_canonical", "boxes.py:flat_boxes",
                                                      "method 'clone'")),
        ("write_safetensors", ("files.py:write_safetensors",)),
        ("  CRC (what its thread left to wait for)", ("zlib.crc32", "crc32c.crc32c", "crc.py:_crc32c",
                                                       "files.py:_crc_results")),
        # a file of DIRECT_MIN bytes or more: the writer thread's O_DIRECT writes, as far as they were waited for
        ("  writes (O_DIRECT: what the writer thread left to wait for)", ("files.py:_wait", "files.py:_write_all")),
        ("  copies into the aligned buffers", ("self:files.py:write",)),
        ("  fsync", ("posix.fsync",)),
        ("rank/trainer state files and records", ("state.py:encode", "files.py:write_small")),
        ("manifest + commit", ("files.py:build_manifest", "files.py:commit")),
        ("c10d calls and waits", ("torch._C._distributed_c10d",)),
    ],
    "ours_load": [
        ("CheckpointReader init", ("reader.py:__init__",)),
        ("CheckpointReader.read, read_flat", ("reader.py:read", "reader.py:read_flat")),
        ("  device reads (readinto)", ("method 'readinto'",)),
        ("  copy into a box of other pieces", ("self:reader.py:read",)),
        # the load defers its checks (CheckpointReader(defer_checks=True)): what is left to wait for is in verify
        # _settle is named so that verify -> _settle -> result counts once (the summary subtracts named callers)
        ("CRC: what its thread left to wait for (in read or verify; mapped: with the device reads)", (
            "reader.py:verify", "reader.py:_settle", "zlib.crc32", "crc32c.crc32c", "crc.py:_crc32c", "files.py:result",
            "_base.py:result")),
        ("assembly: from_canonical, cat", ("boxes.py:from_canonical", "torch.cat")),
        ("setting: apply, set_weight, set_state", ("checkpoint_access.py:apply", "checkpointing.py:set_weight",
                                                    "checkpointing.py:set_state")),
        ("  set_local_fragment / ZeRO-3 partition", ("deepspeed_compat.py:set_local_fragment",
                                                     "deepspeed_compat.py:set_zero3_weight_partition")),
        ("  safe_set_full_*", ("tensor_fragment.py:safe_set_full_fp32_param",
                               "tensor_fragment.py:safe_set_full_optimizer_state")),
        ("  ZeRO-3 GatheredParameters", ("partition_parameters.py:__enter__", "partition_parameters.py:__exit__")),
        ("rank/trainer state files", ("reader.py:state_file",)),
        ("c10d calls and waits", ("torch._C._distributed_c10d",)),
    ],
    "ds_save": [
        ("torch.save", ("serialization.py:save",)),
        ("  write_record", ("write_record",)),
        ("c10d calls and waits", ("torch._C._distributed_c10d",)),
    ],
    "ds_load": [
        ("torch.load", ("serialization.py:load",)),
        ("  reading: get_storage_from_record", ("get_storage_from_record",)),
        ("module load_state_dict", ("module.py:load_state_dict",)),
        ("optimizer load_state_dict", ("stage_1_and_2.py:load_state_dict", "stage3.py:load_state_dict",
                                       "optimizer.py:load_state_dict")),
        ("c10d calls and waits", ("torch._C._distributed_c10d",)),
    ],
}


def _label(key: tuple) -> str:
    file, _, name = key
    return name if file == "~" else f"{os.path.basename(file)}:{name}"


def _matches(needle: str, label: str) -> bool:
    return needle == label or (label.startswith("<") and needle in label)


def _profile_summary(path: Path, op: str) -> list[tuple[str, float]]:
    """Seconds per ``PROFILE_GROUPS`` line: the cumulative time of the functions it names, less what they spend
    in calls from another function it names (so recursion and nesting inside one line count once)."""
    import pstats

    stats = pstats.Stats(str(path)).stats
    out = [("total (profiled)", max(ct for (_, _, _, ct, _) in stats.values()))]
    for label, needles in PROFILE_GROUPS[op]:
        own = [n.removeprefix("self:") for n in needles if n.startswith("self:")]
        whole = [n for n in needles if not n.startswith("self:")]

        def hit(key, whole=whole):
            return any(_matches(n, _label(key)) for n in whole)

        seconds = sum(ct - sum(v[3] for c, v in callers.items() if hit(c))
                      for key, (_, _, _, ct, callers) in stats.items() if hit(key))
        seconds += sum(tt for key, (_, _, tt, _, _) in stats.items() if any(_matches(n, _label(key)) for n in own))
        out.append((label, seconds))
    return out


def _top(path: Path, n: int = 30) -> str:
    import io
    import pstats

    buf = io.StringIO()
    pstats.Stats(str(path), stream=buf).sort_stats("tottime").print_stats(n)
    return buf.getvalue()


# --- the tables ------------------------------------------------------------------------------------------------

def _s(seconds: float) -> str:
    """Seconds for the tables: three decimals under a second (tiny's operations take tens of ms), else two."""
    return f"{seconds:.3f}" if seconds < 1 else f"{seconds:.2f}"


def _mb(value: float) -> str:
    return f"{value / 2 ** 20:,.0f}"


def _summarise(model: str, layout: str, results: list[dict], reshard_from: str | None) -> dict:
    """Per operation: every round's seconds (the slower rank), the median, and per rank the largest peaks."""
    names = list(results[0]["rows"])
    seconds = {n: [max(r["rows"][n][i]["s"] for r in results) for i in range(len(results[0]["rows"][n]))]
               for n in names}
    peak = {n: [max(x["peak_above"] for x in r["rows"][n]) for r in results] for n in names}
    anon = {n: [max(x["anon_above"] for x in r["rows"][n]) for r in results] for n in names}
    return {"model": model, "layout": layout, "reshard_from": reshard_from, "seconds": seconds,
            "median": {n: statistics.median(v) for n, v in seconds.items()}, "peak": peak, "anon": anon,
            "sizes": results[0]["sizes"], "dump_s": max(r["dump_s"] for r in results),
            "rss": [r["rss"] for r in results], "params": [r["params"] for r in results],
            "optimizer": results[0]["optimizer"], "repeats": len(seconds["ours_save"])}


def _compact(summary: list[tuple[str, float]]) -> str:
    """``total 6.7 s = a 1.2 (b 0.4, c 0.3), d 2.0, ...``: the lines of a profile summary that took >= 0.01 s."""
    total, parts = summary[0][1], []
    for label, seconds in summary[1:]:
        if seconds < 0.01:
            continue
        if label.startswith(" ") and parts:
            parts[-1][1].append(f"{label.strip()} {seconds:.2f}")
        elif not label.startswith(" "):
            parts.append((f"{label} {seconds:.2f}", []))
    return f"total {total:.2f} s = " + ", ".join(head + (f" ({', '.join(sub)})" if sub else "") for head, sub in parts)


def _memory_cell(row: dict, name: str) -> str:
    if name not in row["peak"]:
        return ""
    return "/".join(f"{_mb(p)} ({_mb(a)})" for p, a in zip(row["peak"][name], row["anon"][name], strict=True))


def _model_line(name: str) -> str:
    m = MODELS[name]
    shape = ", ".join(f"{k}={v}" for k, v in m.items() if k not in ("architecture", "lr", "warmup_steps"))
    n = n_params(m)
    count = f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"
    return f"`{name}` ({count} parameters: Llama, {shape})"


def _median_of_sums(row: dict, first: str, then: str) -> float:
    """The median over the rounds of two operations' seconds added (each round's pair ran back to back)."""
    return statistics.median(a + b for a, b in zip(row["seconds"][first], row["seconds"][then], strict=True))


def _lines(rows: list[dict], where: str, profiles: dict, load: tuple) -> list[str]:
    used = sorted({r["model"] for r in rows}, key=list(MODELS).index)
    lines = [
        "# bench_checkpoint: shardline's checkpoint vs DeepSpeed's save_checkpoint/load_checkpoint, 4 CPU ranks",
        "",
        f"Models: {'; '.join(_model_line(m) for m in used)}. Float32 weights, AdamW (exp_avg, exp_avg_sq) after one "
        f"training step. The 0.89B Llama (bench_construction's, 16 layers) does not fit this machine (24 GB for 4 "
        f"ranks): its first AdamW step at tp2 x pp2 x ZeRO-1 was OOM-killed at 21.7 GB before any checkpoint; "
        f"`big` is the same shape with 4 layers. 4 forked gloo ranks, 1 thread each; checkpoints on {where}.",
        "",
        "Each operation's time is the slower rank's, the median of the timed rounds after one warm-up round; ours "
        "and DeepSpeed's alternate in the same processes on the same engine. Before every operation all the "
        "checkpoints are fsynced and dropped from the page cache and the device is let go idle (its TRIMs of "
        "deleted files done), so each starts alike and every load reads from the device. Ours fsyncs each file "
        "inside its save (its atomic commit); DeepSpeed's `torch.save` does not, so 'DS + fsync' adds the fsync "
        "of DeepSpeed's files (4 ranks in parallel) for the same durability.",
        "",
        "| model | layout | size MB ours / DS | save s ours | save s DS | **ours / DS** | DS + fsync s | ours / "
        "(DS + fsync) | load s ours | load s DS | **ours / DS** |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        m = r["median"]
        durable = _median_of_sums(r, "ds_save", "ds_fsync")
        lines.append(
            f"| {r['model']} | {r['layout']} | {_mb(r['sizes']['ours'])} / {_mb(r['sizes']['ds'])} | "
            f"{_s(m['ours_save'])} | {_s(m['ds_save'])} | **{m['ours_save'] / m['ds_save']:.2f}** | "
            f"{_s(durable)} | {m['ours_save'] / durable:.2f} | {_s(m['ours_load'])} | {_s(m['ds_load'])} | "
            f"**{m['ours_load'] / m['ds_load']:.2f}** |")
    lines += ["", "Target: ours / DS <= 1.3 at the same layout.", "",
              "Asynchronous save (`HybridParallelStrategy(async_checkpoint=True)`, ours only, in each round after the "
              "two saves above): 'returns' is what the save costs the training loop (the pieces copied in memory, "
              "ZeRO-3's gathers, the small files pickled); 'then committed' is the wait, started at once, for the "
              "thread's writes and fsyncs and the commit (in a run, training goes on meanwhile); peak anonymous "
              "memory of the copy per rank.", "",
              "| model | layout | returns s | **returns / DS save** | then committed s | returns + committed s | "
              "copy MB per rank (anon peak) |",
              "|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        m = r["median"]
        both = _median_of_sums(r, "async_save", "async_commit")
        lines.append(f"| {r['model']} | {r['layout']} | {_s(m['async_save'])} | "
                     f"**{m['async_save'] / m['ds_save']:.2f}** | {_s(m['async_commit'])} | {_s(both)} | "
                     f"{'/'.join(_mb(a) for a in r['anon']['async_save'])} |")
    lines += ["",
              "Resharding load (ours only: DeepSpeed's `load_checkpoint` reads only the layout that saved, with its "
              "tp/pp degrees and ZeRO partitioning, so there is nothing to compare with):", "",
              "| model | saved in | loaded into | load s | that layout's own load s (above) |",
              "|---|---|---|---:|---:|"]
    lines += [f"| {r['model']} | {r['reshard_from']} | {r['layout']} | {_s(r['median']['reshard_load'])} | "
              f"{_s(r['median']['ours_load'])} |" for r in rows if r["reshard_from"]]
    lines += ["", "Memory per rank (ranks 0/1/2/3), MB above the rank's RSS before the operation, the largest over "
              "the rounds: peak RSS (VmHWM, reset right before) and, in brackets, peak anonymous memory (RssAnon "
              "sampled every 5 ms: without the checkpoint files a reader maps, which the kernel can drop).", "",
              "| model | layout | RSS after the step MB | save ours | save DS | load ours | load DS "
              "| resharding load |",
              "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = " | ".join(_memory_cell(r, n) for n in ("ours_save", "ds_save", "ours_load", "ds_load", "reshard_load"))
        lines.append(f"| {r['model']} | {r['layout']} | {'/'.join(_mb(x) for x in r['rss'])} | {cells} |")
    lines += ["", "Every round's seconds (ours save | DS save | DS fsync | async returns | async then committed | "
              "ours load | DS load | resharding load; "
              "the two sides of a round ran back to back, so their ratio saw the same machine load), "
              "Lightning's `dump_checkpoint` (run once, common to both sides, not in the tables), parameters per "
              "rank, DeepSpeed's optimizer:", ""]
    for r in rows:
        s = r["seconds"]
        parts = " | ".join(", ".join(f"{x:.2f}" for x in s[n]) for n in
                           ("ours_save", "ds_save", "ds_fsync", "async_save", "async_commit", "ours_load", "ds_load",
                            "reshard_load") if n in s)
        paired = "; ".join(
            f"{op} ours/DS per round " + ", ".join(f"{a / b:.2f}" for a, b in zip(s[f"ours_{op}"], s[f"ds_{op}"],
                                                                                  strict=True))
            for op in ("save", "load"))
        lines.append(f"- {r['model']} {r['layout']}: {r['repeats']} rounds: {parts} ({paired}); dump_checkpoint "
                     f"{r['dump_s']:.2f} s; parameters per rank {'/'.join(f'{x / 1e6:.1f}M' for x in r['params'])}; "
                     f"{r['optimizer']}.")
    if profiles:
        lines += ["", "Where rank 0's time goes (cProfile, one extra call of each after the timed rounds, "
                  "cold reads as above; seconds; parts of a line in brackets; 'c10d calls and waits' includes "
                  "the barriers where a rank waits for slower ones):", ""]
        lines += [f"- {title}: {_compact(summary)}" for title, summary in profiles.items()]
    lines += ["", f"Machine: {os.cpu_count()} cores shared with other work; 1-minute load average {load[0]:.1f} "
              f"before and {load[1]:.1f} after the run.", ""]
    return lines


def main() -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the tiny model only (~4 min)")
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: a folder in /tmp)")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds per layout (default: per plan)")
    parser.add_argument("--profile", action=argparse.BooleanOptionalAction, default=None,
                        help="cProfile one save and load per side and layout (default: for all but tiny)")
    parser.add_argument("--only", default=None, help="only these MODEL:LAYOUT entries of the plan (comma separated)")
    parser.add_argument("--big-layers", type=int, default=None,
                        help="n_layer of the big model (default 4: 0.32B; 16 is the 0.89B)")
    parser.add_argument("--results", default=str(RESULTS), help="the results file to write")
    args = parser.parse_args()
    if args.big_layers:
        MODELS["big"]["n_layer"] = args.big_layers  # the forked ranks inherit it
    plan = QUICK if args.quick else FULL
    if args.only:
        wanted = set(args.only.split(","))
        plan = [p for p in plan if f"{p[0]}:{p[1]}" in wanted]
    base = Path(args.dir or tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    OUT.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    rows, profiles, raw = [], {}, []
    with tempfile.TemporaryDirectory(dir=base, prefix="bench_checkpoint-") as tmp:
        tmp, keep = Path(tmp), {}
        sources = {(m, src) for m, _, _, src in plan if src}
        for model, layout, repeats, src in plan:
            keep_to = tmp / f"keep-{model}-{layout}" if (model, layout) in sources else None
            reshard = keep.get((model, src)) if src else None
            profile = args.profile if args.profile is not None else model != "tiny"
            prof_dir = OUT / f"{model}-{layout}" if profile else None
            if prof_dir is not None:
                shutil.rmtree(prof_dir, ignore_errors=True)  # no stale profile of an earlier run
            start = time.perf_counter()
            results = run_ranks(_rank, WORLD, model, layout, str(tmp / f"{model}-{layout}"), args.repeats or repeats,
                                reshard, keep_to, prof_dir, timeout=600 if model == "tiny" else 5400)
            print(f"{model} {layout}: {time.perf_counter() - start:.0f} s", flush=True)
            shutil.rmtree(tmp / f"{model}-{layout}", ignore_errors=True)
            if keep_to is not None:
                keep[(model, layout)] = keep_to
            rows.append(_summarise(model, layout, results, src if reshard else None))
            raw.append({"model": model, "layout": layout, "ranks": results})
            if prof_dir is not None:
                titles = {"ours_save": "ours save", "ours_load": "ours load", "ds_save": "DeepSpeed save",
                          "ds_load": "DeepSpeed load", "reshard_load": f"ours resharding load (saved in {src})"}
                for op, title in titles.items():
                    path = prof_dir / f"{op}_rank0.pstats"
                    if path.exists():
                        groups = "ours_load" if op == "reshard_load" else op
                        profiles[f"{model} {layout}, {title}"] = _profile_summary(path, groups)
                        (prof_dir / f"{op}_rank0.txt").write_text(_top(path))
        where = f"{base} ({_filesystem(base)})"
    (OUT / "raw.json").write_text(json.dumps(raw, indent=1, default=str))
    return publish(_lines(rows, where, profiles, (load_before[0], os.getloadavg()[0])), Path(args.results))


def _filesystem(path: Path) -> str:
    """The filesystem type and device of ``path`` (from /proc/mounts: the longest mount point above it)."""
    best = ("?", "?", "")
    with contextlib.suppress(OSError), open("/proc/mounts") as f:
        for line in f:
            device, mount, kind, *_ = line.split()
            inside = str(path.resolve()).startswith(mount.rstrip("/") + "/") or mount == "/"
            if inside and len(mount) > len(best[2]):
                best = (kind, device, mount)
    return f"{best[0]} on {best[1]}"


if __name__ == "__main__":
    main()
