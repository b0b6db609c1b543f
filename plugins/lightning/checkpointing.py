"""Layout-independent checkpoints for :class:`~.strategy.HybridParallelStrategy`: save in one layout, load in any.

Every rank saves, per tensor of its module (:mod:`shardline.plugins.checkpoint.names`), its part of the float32
master weight and of every optimizer state (Adam's ``exp_avg`` and ``exp_avg_sq``) in the canonical tensor's
coordinates, so nothing is written twice: under ZeRO its own partition's fragment of each parameter, per
parameter and without a collective, otherwise its tensor-parallel part split over the data-parallel replicas
(:mod:`.checkpoint_access` has both paths; DeepSpeed's flat buffers are never read). Loading reads, on each
rank, exactly the boxes its new layout needs, so tp, pp (and chunks), dp, cp, the SP mode, the ZeRO stage,
offload and the world size may all change.

Besides the tensors: the optimizer's step count and hyper-parameters (the scheduled ``lr``), DeepSpeed's engine
counters, the trainer's own state (loops with the data position, callbacks, LR schedulers) and, per rank, the
RNG states (torch, CUDA when present, numpy, Python). RNG states are restored on the same layout only, at the
first training step after the load (so the random draws of the resumed run's first step are the uninterrupted
run's); draws made between a checkpoint and the next training step (a validation loop started at that step
boundary draws its DataLoader seed) are not replayed.

Loading checks everything before it changes anything: the architecture (every tensor this model has, with its
shape), every piece it reads (CRC), on every rank; any failure raises :class:`CheckpointError` on all ranks,
naming the file and the tensor, and no weight has been overwritten.

The strategy holds one :class:`Checkpointer`, which owns the state between its saves and loads (the pending
asynchronous save, the window in which a save may be asynchronous, the pipeline stages the last save exchanged,
the RNG states a load leaves for the first training step); the strategy's checkpoint hooks call it.

One file: save, the asynchronous settle and load share the collective rounds (:meth:`Checkpointer._hello`,
:func:`_written`, :func:`_committed`, :func:`_agree`) that give every rank the same view of one checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardline.plugins.checkpoint import state
from shardline.plugins.checkpoint.files import (
    MANIFEST,
    TRAINER_FILE,
    AtomicSave,
    ShardWriter,
    build_manifest,
    describe_files,
    fsync_all,
    phase,
    rank_file,
    resolve,
    write_small,
)
from shardline.plugins.checkpoint.names import Entry, architectures, entries, models
from shardline.plugins.checkpoint.reader import CheckpointReader
from shardline.plugins.errors import CheckpointError
from shardline.plugins.lightning import deepspeed_compat as compat
from shardline.plugins.lightning.checkpoint_access import Access


def capture_rng() -> dict[str, Any]:
    import numpy as np

    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    import numpy as np

    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _engine_counters(engine) -> dict[str, int]:
    return {k: int(getattr(engine, k)) for k in ("global_steps", "global_samples", "micro_steps", "skipped_steps")
            if hasattr(engine, k)}


def _fitting(strategy) -> bool:
    from pytorch_lightning.trainer.states import TrainerFn

    trainer = strategy.lightning_module.trainer
    return trainer is not None and trainer.state.fn == TrainerFn.FITTING


def _optimizer(strategy):
    engine = strategy.model
    return getattr(engine, "optimizer", None) if _fitting(strategy) else None


def _first_stage_writes(grid, mine: list[Entry], everyone: list[tuple[int, list[str]]]) -> list[Entry]:
    """``mine`` with ``writes`` cleared where a lower pipeline stage holds the same tensor (a parameter outside
    the pipeline's layers lives on every stage): each tensor is written by one stage only. ``everyone``: every
    rank's ``(pipeline stage, tensor names)``."""
    if grid.size("pp") == 1:
        return mine
    first: dict[str, int] = {}
    for pp, names in everyone:
        for name in names:
            first[name] = min(first.get(name, pp), pp)
    for entry in mine:
        entry.writes = entry.writes and first[entry.name] == grid.coords["pp"]
    return mine


def _group(strategy):
    """The process group of the checkpoint's own collectives (CPU tensors, a few words each): the strategy's
    gloo ``control_group`` where the training groups are NCCL's, else the default group."""
    return getattr(strategy, "control_group", None)


def _reduce_words(words: list[int], op: str, group=None) -> list[int]:
    """The element-wise ``op`` (``"max"`` or ``"or"``) over the ranks of ``group`` of every rank's int64
    ``words`` (the same length on each), the same result on every rank: a gather to the group's first rank and
    its broadcast of the result. gloo runs an all-reduce of more than a word or two as a ring, 2(N-1) hops one
    after another, each of which waits for its receiver to be scheduled, where the gather and the broadcast
    are two rounds (a 1-word all-reduce stays one). The root's reduction is over N short rows, so this holds
    for thousands of ranks too."""
    mine = torch.tensor(words, dtype=torch.int64)
    if len(words) <= 1:
        dist.all_reduce(mine, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.BOR, group=group)
        return mine.tolist()
    first = dist.get_rank(group) == 0
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))] if first else None
    dist.gather(mine, rows, group=group, group_dst=0)
    if first:
        stacked = torch.stack(rows)
        if op == "max":
            mine = stacked.amax(0)
        else:
            mine = stacked[0].clone()
            for row in stacked[1:]:
                mine.bitwise_or_(row)
    dist.broadcast(mine, group=group, group_src=0)
    return mine.tolist()


def _records_file(rank: int) -> str:
    return f".records-{rank:05d}.json"


def _read_records(path: Path, rank: int) -> tuple[list, dict]:
    """Rank ``rank``'s record of what it wrote (its pieces, its files), from the save's folder."""
    try:
        records, files = json.loads(path.read_bytes())
    except (OSError, ValueError) as failure:
        raise CheckpointError(f"{path}: rank {rank}'s record of the files it wrote cannot be read ({failure}); "
                              "the save is not committed") from failure
    return records, files


def _hello(checkpointer: Checkpointer, path: str, keys: list, names: list[str]):
    """Before writing, one element-wise maximum of four int64 (:func:`_reduce_words`): rank 0's token (the
    others send 0), a digest of this rank's ``(path, optimizer state kinds)`` and its negation, and under pp a
    "my tensor names changed since the last save" flag. Every rank sent the same digest exactly when the
    maximum of the digests is minus the maximum of their negations; where they differ (ranks given different
    folders), rank 0's folder and state kinds are broadcast, and every rank uses them. Under pp every rank's
    ``(pipeline stage, tensor names)`` for :func:`_first_stage_writes` are gathered once and kept
    (:attr:`Checkpointer.saved_stages`), again only when some rank's flag is set."""
    strategy = checkpointer.strategy
    grid, me, world = strategy.grid, strategy.global_rank, dist.get_world_size()
    token = AtomicSave.new_token() if me == 0 else None
    digest = int.from_bytes(hashlib.blake2b(repr((path, list(keys))).encode(), digest_size=7).digest(), "little")
    pipelined = grid.size("pp") > 1
    mine = (grid.coords["pp"], names)
    kept = checkpointer.saved_stages
    changed = int(pipelined and (kept is None or kept[me] != mine))
    group = _group(strategy)
    number, most, least_negated, changed = _reduce_words([int(token, 16) if me == 0 else 0, digest, -digest,
                                                           changed], "max", group)
    token = f"{number:0{2 * AtomicSave.TOKEN_BYTES}x}"  # every rank alike: rank 0's, zero-padded
    if most != -least_negated:  # not the same (path, keys) everywhere: rank 0's, on every rank
        box = [(path, keys) if me == 0 else None]
        dist.broadcast_object_list(box, src=0, group=group)
        path, keys = box[0]
    if not pipelined:
        return path, token, keys, []
    if changed:
        gathered: list = [None] * world
        dist.all_gather_object(gathered, mine, group=group)
        checkpointer.saved_stages = kept = [(pp, list(n)) for pp, n in gathered]
    return path, token, keys, kept


def _save(checkpointer: Checkpointer, checkpoint: dict[str, Any], filepath, *, max_file_bytes: int) -> None:
    """Collective: every rank writes its pieces of ``checkpoint`` (Lightning's dict; its ``state_dict`` and
    ``optimizer_states`` are replaced by the pieces) into the folder ``filepath``, atomically.

    Three collective rounds: one before writing (:func:`_hello`: rank 0's token, and whether every rank has
    the same folder and optimizer state kinds; under pp, every rank's tensor names when they changed since the
    last save, in a second); once every rank's files,
    and its record of what it wrote (``.records-RRRRR.json``, which rank 0 reads and removes), are durable, a
    1-element ``all_reduce(MAX)`` of "this rank failed" (:func:`_written`); after rank 0's commit, its 1-element
    broadcast of the commit's outcome (:func:`_committed`). The records travel by the shared folder, not by a
    gather: a small collective of fixed-size words costs a fraction of pickling and gathering them.

    With ``strategy.async_checkpoint`` and while fitting, the call returns once every piece is copied
    (:class:`_Pending`): a thread writes and fsyncs the files while training goes on, and the last two rounds
    and the commit run in :meth:`Checkpointer.settle`, at the first training batch that finds every rank's
    writes done (or at the next save or load, or the end of the fit). A save already pending is settled first,
    so at most one copy of the state is held.

    A rank that fails while writing (a full disk, an unwritable folder) or a commit that fails on rank 0 raises
    one :class:`CheckpointError` on every rank at once, naming the rank and its error, instead of leaving the
    others waiting in a barrier until the collective timeout; nothing is committed, the partial folder is
    removed, and the previous checkpoint and ``latest`` stay as they were."""
    checkpointer.settle()
    strategy = checkpointer.strategy
    grid, me, world = strategy.grid, strategy.global_rank, dist.get_world_size()
    background = checkpointer.asynchronous()
    optimizer = _optimizer(strategy)
    access = Access(optimizer)
    # Lightning leaves the optimizer out of a weights-only checkpoint (ModelCheckpoint(save_weights_only=True)).
    weights_only = "optimizer_states" not in checkpoint
    keys = compat.optimizer_state_keys(optimizer) if optimizer is not None and not weights_only else []
    module = strategy.lightning_module
    mine = entries(module, tp=grid.size("tp"), tp_rank=grid.rank("tp"), shape_of=compat.whole_shape)
    names = [e.name for e in mine] if grid.size("pp") > 1 else []
    path, token, keys, stages = _hello(checkpointer, str(filepath), keys, names)
    target = AtomicSave(Path(path), token)
    meta = None
    small = {rank_file(me): {"rank": me, "coords": grid.coords, "rng": capture_rng(),
                              "engine": _engine_counters(strategy.model)}}
    if me == 0:
        trainer_state = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        if optimizer is not None and not weights_only:
            trainer_state["shardline_optimizer"] = {
                "step": compat.optimizer_step_count(optimizer),
                "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]}
        small[TRAINER_FILE] = trainer_state
        meta = {"world_size": world, "layout": strategy.layout_record(),
                "global_step": checkpoint.get("global_step"), "optimizer_state_keys": keys,
                "module": f"{type(module).__module__}.{type(module).__qualname__}", "models": models(module)}
    failure = None
    try:
        # bytes now (the state goes on changing); a value that is not plain data is refused here, by its key
        small = {name: state.encode(obj, where="the trainer's state" if name == TRAINER_FILE else f"rank {me}'s state")
                 for name, obj in small.items()}
        target.create()  # every rank: whoever comes first makes it
        if background and me == 0:
            target.reserve()
        phase("before_shards", me)
        replicas, replica = grid.size("dp_cp"), grid.rank("dp_cp")
        # Under async, private pieces (copies where they are not copies already): the next step may change every
        # parameter and moment the moment this returns.
        pieces = ((name, entry.placement.canonical_shape(), box, piece)
                  for entry in _first_stage_writes(grid, mine, stages)
                  for name, box, piece in access.pieces(entry, keys, replicas=replicas, replica=replica,
                                                        private=background))
        if background:
            staged = list(pieces)  # here: the whole-value path's gathers are collective
        else:
            _write(target, me, pieces, small, max_file_bytes)
    except Exception as error:  # noqa: BLE001 - every rank learns of it in _written, and raises
        failure = error
    if background:  # also after a failure: every rank then raises it from the same settle
        checkpointer.pending = _Pending(target, meta, None if failure is not None else
                                        (target, me, staged, small, max_file_bytes), failure)
        return
    _finish(target, failure, me, world, meta, _group(strategy))


def _write(target: AtomicSave, me: int, pieces, small: dict[str, memoryview], max_file_bytes: int) -> None:
    """This rank's files: its ``pieces`` (``(name, canonical shape, box, tensor)``), its state files
    (``small``: name -> bytes) and its record of them, all fsynced."""
    writer = ShardWriter(target.tmp, rank=me, max_file_bytes=max_file_bytes)
    for name, shape, box, piece in pieces:
        writer.add(name, shape, box, piece)
    writer.flush()
    crcs = {name: write_small(data, target.tmp / name) for name, data in small.items()}
    mine_files = writer.written + list(crcs)
    record = target.tmp / _records_file(me)
    write_small(json.dumps([writer.records, describe_files(target.tmp, mine_files, crcs)]).encode(), record)
    fsync_all([*(target.tmp / name for name in mine_files), record])  # together: one journal commit where it can


def _finish(target: AtomicSave, failure: Exception | None, me: int, world: int, meta: dict | None,
            group=None) -> None:
    """After this rank's writes (``failure``: their error): the two collective rounds (over ``group``) and rank
    0's commit."""
    _written(target, failure, me, world, group)
    failure = None
    if me == 0:
        try:
            gathered = [_read_records(target.tmp / _records_file(r), r) for r in range(world)]
            records = [r for r, _ in gathered]
            files = {name: info for _, described in gathered for name, info in described.items()}
            for r in range(world):  # the folder's fsync in the commit makes the removals durable with the manifest
                (target.tmp / _records_file(r)).unlink()
            target.commit(build_manifest(records, files, meta), rank=me)
        except Exception as error:  # noqa: BLE001 - every rank learns of it in _committed, and raises
            failure = error
    _committed(target, failure, me, group)


class _Pending:
    """A save whose files a thread writes (``async_checkpoint``), not yet committed: :meth:`Checkpointer.settle`
    commits it.
    ``removals``: checkpoints Lightning asked to remove meanwhile (``save_top_k``), removed only once this one
    is committed, so a crash in between never leaves fewer complete checkpoints than ``save_top_k``."""

    def __init__(self, target: AtomicSave, meta: dict | None, work: tuple | None, failure: Exception | None):
        self.target, self.meta, self.failure = target, meta, failure
        self.removals: list[str] = []
        self.thread = None
        if work is not None:
            # A daemon: only an abandoned save (the run failed) can still be writing when the interpreter exits.
            self.thread = threading.Thread(target=self._run, args=work, name="shardline-save", daemon=True)
            self.thread.start()

    def _run(self, *work) -> None:
        try:
            _write(*work)
        except BaseException as error:  # noqa: BLE001 - raised on every rank by Checkpointer.settle
            self.failure = error if isinstance(error, Exception) else CheckpointError(
                f"{self.target.final}: the save's writer thread was interrupted ({error!r})")

    def done(self) -> bool:
        return self.thread is None or not self.thread.is_alive()

    def wait(self, timeout: float | None = None) -> Exception | None:
        """This rank's writes' error, once they end (or ``timeout`` seconds pass: see :meth:`done`)."""
        if self.thread is not None:
            self.thread.join(timeout)
        return self.failure


def _said(error: BaseException) -> str:
    return str(error) if isinstance(error, CheckpointError) else f"{type(error).__name__}: {error}"


def _written(target: AtomicSave, failure: Exception | None, me: int, world: int, group=None) -> None:
    """After every rank's writes: one 1-element ``all_reduce(MAX)`` of "this rank failed"; when one did, every
    rank's error (``all_gather_object``, on that path alone), the partial folder removed (rank 0: every rank is
    past its writes) and one CheckpointError on every rank naming the ranks that failed."""
    failed = torch.tensor([int(failure is not None)], dtype=torch.int64)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
    if not failed.item():
        return
    everyone: list = [None] * world
    dist.all_gather_object(everyone, None if failure is None else _said(failure), group=group)
    if me == 0:
        shutil.rmtree(target.tmp, ignore_errors=True)
    said = "; ".join(f"rank {r}: {message}" for r, message in enumerate(everyone) if message is not None)
    raise CheckpointError(f"{target.final}: the save failed while writing ({said}); nothing was committed, the "
                          "partial folder was removed, and the previous checkpoint and 'latest' are unchanged") \
        from failure


def _committed(target: AtomicSave, failure: Exception | None, me: int, group=None) -> None:
    """After rank 0's commit: its 1-element broadcast of the outcome; on a failure, its error and whether the
    folder was already renamed into place (a second broadcast, on that path alone), the partial folder removed
    where it was not, and one CheckpointError on every rank."""
    failed = torch.tensor([int(failure is not None)], dtype=torch.int64)
    dist.broadcast(failed, src=0, group=group)
    if not failed.item():
        return
    if me == 0:
        renamed = not target.tmp.exists() and (target.final / MANIFEST).is_file()
        if not renamed:
            shutil.rmtree(target.tmp, ignore_errors=True)
    box = [(_said(failure), renamed) if me == 0 else None]
    dist.broadcast_object_list(box, src=0, group=group)
    said, renamed = box[0]
    where = ("the folder is complete and in place, but 'latest' may still name the previous checkpoint"
             if renamed else "nothing was committed; the previous checkpoint and 'latest' are unchanged")
    raise CheckpointError(f"{target.final}: rank 0 could not commit the save ({said}); {where}") from failure


def _first_failure(errors: list[str | None]) -> str | None:
    """One message for every rank's errors (the lowest failing rank's, and how many more failed)."""
    failed = [(rank, text) for rank, text in enumerate(errors) if text]
    if not failed:
        return None
    rank, text = failed[0]
    more = f" (and {len(failed) - 1} more ranks)" if len(failed) > 1 else ""
    return f"rank {rank}: {text}{more}; nothing was loaded"


def _check_mine(reader: CheckpointReader, module, mine: list[Entry]) -> str | None:
    """This rank's part of the architecture check: the same models, and each of its tensors, with its shape."""
    saved = [(m["prefix"], m["architecture"]) for m in reader.manifest.get("models", [])]
    now = architectures(module)
    if saved != now:
        def say(pairs):
            return ", ".join(f"{arch} at {prefix or 'the top'!r}" for prefix, arch in pairs) or "no shardline model"

        return f"{reader.folder}: the checkpoint holds {say(saved)}; this module has {say(now)}"
    for entry in mine:
        if entry.name not in reader.tensors:
            return f"{reader.folder}: the checkpoint has no tensor {entry.name!r} (this model's {entry.path})"
        want, have = tuple(entry.placement.canonical_shape()), reader.shape(entry.name)
        if want != have:
            return (f"{reader.folder}: tensor {entry.name!r} has shape {list(have)} in the checkpoint, this "
                    f"model's {entry.path} needs {list(want)}")
    return None


def _extra_message(reader: CheckpointReader, extra: list[str]) -> str:
    """The refusal for the checkpoint's weights ``extra`` (sorted) that no rank has a place for."""
    return f"{reader.folder}: checkpoint tensors this model has no place for: {extra[:8]}" + (
        f" and {len(extra) - 8} more" if len(extra) > 8 else "")


@dataclass
class _Read:
    """One rank's whole load, read and checked, nothing set (:func:`_read_everything`)."""

    found: str | None = None  # the checkpoint folder the path resolved to
    reader: CheckpointReader | None = None
    mine: list[Entry] = field(default_factory=list)  # this rank's tensors
    staged: list[tuple[Entry, dict]] = field(default_factory=list)  # each with its values, for Access.apply
    trainer_state: dict = field(default_factory=dict)
    own: dict | None = None  # this rank's own file (RNG states, engine counters), where the checkpoint has one
    error: str | None = None


def _read_everything(strategy, checkpoint_path, optimizer, access: Access, trust_pickle: bool = False) -> _Read:
    """This rank's whole load, read and checked, nothing set. Any bad input is the :attr:`_Read.error`, not a
    raise, so that every rank reaches the one exchange of :func:`load`. ``trust_pickle``: a version 1-2
    checkpoint's pickled state files are unpickled (:meth:`CheckpointReader.state_file`)."""
    me, grid = strategy.global_rank, strategy.grid
    out = _Read()
    try:
        with warnings.catch_warnings():
            if me != 0:  # every rank resolves the path; rank 0 alone says which partial saves it skipped
                warnings.simplefilter("ignore")
            out.found = str(resolve(checkpoint_path))
        # all verified below, before use; mapped: every value read is copied into the model and the optimizer
        reader = out.reader = CheckpointReader(out.found, defer_checks=True, mapped=True)
        out.mine = entries(strategy.lightning_module, tp=grid.size("tp"), tp_rank=grid.rank("tp"),
                           shape_of=compat.whole_shape)
        out.error = _check_mine(reader, strategy.lightning_module, out.mine)
        if out.error is not None:
            return out
        saved_keys = reader.manifest.get("optimizer_state_keys", [])
        now_keys = compat.optimizer_state_keys(optimizer) if optimizer is not None and saved_keys else []
        if now_keys and set(now_keys) != set(saved_keys):
            raise CheckpointError(f"{reader.folder}: the checkpoint's optimizer keeps {saved_keys}, this one "
                                  f"{now_keys}")
        out.trainer_state = reader.state_file(TRAINER_FILE, trust_pickle=trust_pickle)
        own_name = rank_file(me)
        out.own = reader.state_file(own_name, trust_pickle=trust_pickle) if reader.has_state(own_name) else None
        out.staged = [(entry, access.stage(reader, entry, saved_keys if optimizer is not None else []))
                      for entry in out.mine]
        reader.verify()  # every CRC of what was read (they ran beside the reads)
    except CheckpointError as failure:  # load raises it on every rank; nothing read is used
        out.error = str(failure)
    finally:
        if out.reader is not None:
            out.reader.close()
    return out


def _load(checkpointer: Checkpointer, checkpoint_path, *, weights_only: bool | None) -> dict[str, Any]:
    """Collective: load the checkpoint (or the newest in a folder of them) into this layout; returns the
    trainer's state for Lightning to restore (loops, callbacks, schedulers).

    ``weights_only`` is Lightning's (``trainer.fit(ckpt_path=..., weights_only=...)``): a checkpoint of today's
    format holds no pickle, so it loads the same either way. Only an explicit ``weights_only=False`` unpickles a
    version 1-2 checkpoint's ``trainer.pt`` and ``rank-N.pt``, with a warning that it trusts their author; None
    or True refuse them with a :class:`CheckpointError` naming the file and ``shardline convert --migrate``.

    One collective round: every rank resolves the path, reads and checks all it needs
    (:func:`_read_everything`),
    then the ranks agree (:func:`_agree`); any error anywhere (or ranks that found different checkpoints, or
    checkpoint weights no rank has a place for) raises on every rank before anything is set. An
    ``async_checkpoint`` save still pending is committed first (:meth:`Checkpointer.settle`)."""
    checkpointer.settle()
    strategy = checkpointer.strategy
    optimizer = _optimizer(strategy)
    access = Access(optimizer)
    got = _read_everything(strategy, checkpoint_path, optimizer, access, trust_pickle=weights_only is False)
    if weights_only is False and got.reader is not None and got.reader.version < 3 and got.error is None:
        warnings.warn(f"{got.found}: unpickled its pickled state files (format version {got.reader.version}) "
                      "because weights_only=False: that runs any code their author put in them", stacklevel=2)
    try:
        return _agree_and_apply(checkpointer, got, optimizer, access)
    finally:  # set, or refused here or on another rank: no view of a map outlives the load (nor its error)
        got.staged.clear()


def _agree_and_apply(checkpointer: Checkpointer, got: _Read, optimizer, access: Access) -> dict[str, Any]:
    """:func:`_load` after this rank's reads: the exchange, then everything set, or the one error on every
    rank."""
    reader, trainer_state = got.reader, got.trainer_state
    failure = _agree(got, _group(checkpointer.strategy))
    if failure is not None:
        raise CheckpointError(failure)
    saved_keys = reader.manifest.get("optimizer_state_keys", [])
    if optimizer is not None and saved_keys:
        compat.ensure_optimizer_state(optimizer, saved_keys)
    step = (trainer_state.get("shardline_optimizer") or {}).get("step")
    for entry, values in got.staged:  # nothing below can fail on bad input: everything was read and checked
        access.apply(entry, values, step)
    _restore_counters(checkpointer, reader, trainer_state, got.own, optimizer)
    return trainer_state


_FAILED, _MISSING = 2, 1  # a rank's flags in the agreement
_BITS = 63  # names per int64 word of the coverage mask (the sign bit left alone)
#: Words of the coverage mask that travel in the agreement's one all-reduce (for up to 63 x 32 = 2016 weights:
#: a 405B Llama has 1,138); a checkpoint with more weights sends the rest of its mask in a second round.
AGREE_WORDS = 32


def _coverage(weights: list[str], names: set[str]) -> list[int]:
    """The bit mask of ``weights`` (sorted) that this rank has a place for: bit ``i % 63`` of word ``i // 63``."""
    mask = [0] * -(-len(weights) // _BITS)
    for i, name in enumerate(weights):
        if name in names:
            mask[i // _BITS] |= 1 << (i % _BITS)
    return mask


def _agree(got: _Read, group=None) -> str | None:
    """The one exchange of a load: None when every rank read the same checkpoint without an error and every
    checkpoint weight has a place on some rank; otherwise the message, the same on every rank.

    One element-wise OR (:func:`_reduce_words`, over ``group``) of ``3 + AGREE_WORDS`` int64: ``key``,
    ``~key``, the flags and the first words of the coverage mask, ``key`` a digest of the folder and of its
    weight names. Every rank read the same checkpoint exactly when the two ORs have no bit in common (a rank
    whose key differs sets a bit in one that another's sets in the other); the flags say whether a rank failed
    (``_FAILED``) or lacks some of the checkpoint's weights (``_MISSING``: a pipeline stage holds only its own
    layers), and then the OR of the masks (the same weights on every rank: the same key) says which weights no
    rank has a place for. A second round only for the failures' messages (``all_gather_object``), or for the
    rest of the mask of a checkpoint of more than ``63 x AGREE_WORDS`` weights (another OR). The words' gather
    and broadcast are cheap where the objects' gather takes two collectives and pickling; and on a host with
    more ranks than cores every collective also waits for the slowest rank to be scheduled."""
    reader, names = got.reader, {e.name for e in got.mine}
    weights = sorted(n for n in reader.tensors if not n.startswith("optimizer.")) if got.error is None else []
    digest = hashlib.blake2b(repr((got.found, weights)).encode(), digest_size=7).digest()
    key = int.from_bytes(digest, "little")
    flags = _FAILED if got.error is not None else _MISSING if any(n not in names for n in weights) else 0
    mask = _coverage(weights, names) if flags == _MISSING else []
    sent = [key, ~key, flags, *mask[:AGREE_WORDS]]
    words = _reduce_words(sent + [0] * (3 + AGREE_WORDS - len(sent)), "or", group)
    if words[0] & words[1] or words[2] & _FAILED:  # the details, from every rank
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (got.found, got.error), group=group)
        failure = _first_failure([e for _, e in everyone])
        if failure is None:
            failure = "the ranks found different checkpoints (or the same folder changed between their reads): " + \
                ", ".join(f"rank {r}: {f}" for r, (f, _) in enumerate(everyone)) + "; nothing was loaded"
        return failure
    if words[2] & _MISSING:  # the same weights on every rank (the same key): which has a place somewhere
        covered = words[3:3 + min(len(mask), AGREE_WORDS)]
        if len(mask) > AGREE_WORDS:  # every rank knows it (the same weights): one more round, the same on all
            covered += _reduce_words(mask[AGREE_WORDS:], "or", group)
        extra = [name for i, name in enumerate(weights) if not covered[i // _BITS] >> (i % _BITS) & 1]
        return f"{_extra_message(reader, extra)}; nothing was loaded" if extra else None
    return None


def _restore_counters(checkpointer: Checkpointer, reader: CheckpointReader, trainer_state: dict, own: dict | None,
                      optimizer) -> None:
    """The optimizer's step and hyper-parameters, and this rank's own file (``own``): DeepSpeed's counters and,
    on the saving layout, the RNG states for the first training step (:attr:`Checkpointer.rng_state`)."""
    strategy = checkpointer.strategy
    saved = trainer_state.get("shardline_optimizer") or {}
    if optimizer is not None and saved:
        if saved.get("step") is not None:
            compat.set_optimizer_step_count(optimizer, saved["step"])
        groups = saved.get("param_groups", [])
        if len(groups) != len(optimizer.param_groups):
            warnings.warn(f"{reader.folder}: {len(groups)} optimizer param groups saved, {len(optimizer.param_groups)} "
                          "now; their hyper-parameters (lr) are not restored", stacklevel=3)
        else:
            for group, values in zip(optimizer.param_groups, groups, strict=True):
                group.update(values)
    same = (reader.manifest.get("world_size") == dist.get_world_size()
            and reader.manifest.get("layout") == strategy.layout_record())
    if own is not None:
        for key, value in own.get("engine", {}).items():
            if hasattr(strategy.model, key):
                setattr(strategy.model, key, value)
        checkpointer.rng_state = own["rng"] if same else None


class Checkpointer:
    """The checkpoints of one :class:`~.strategy.HybridParallelStrategy`: its save, load and removal, and the
    state between them, which only this object changes (the strategy's hooks call it):

    - :attr:`pending`: the ``async_checkpoint`` save being written (:class:`_Pending`), committed by
      :meth:`settle`; ``removals`` Lightning asked for meanwhile wait for it;
    - :attr:`window`: from the fit's ``on_train_start`` to its ``on_train_end`` (the strategy's hooks, which every
      rank runs after the callbacks' and the module's), where a save may be asynchronous (:meth:`asynchronous`);
    - :attr:`saved_stages`: under pp, every rank's ``(stage, tensor names)`` as the last save exchanged them;
    - :attr:`rng_state`: this rank's RNG states of a loaded checkpoint, restored at the first training step
      (:meth:`restore_rng`)."""

    def __init__(self, strategy):
        self.strategy = strategy
        self.pending: _Pending | None = None
        self.window = False
        self.saved_stages: list[tuple[int, list[str]]] | None = None
        self.rng_state: dict[str, Any] | None = None

    def asynchronous(self) -> bool:
        """Whether a save now is an asynchronous one: with the strategy's ``async_checkpoint``, inside the
        :attr:`window`, while fitting. It is committed by the next batch, save or load, or at the latest by
        ``on_train_end``, so only a save made in that window may be one; a save in ``on_fit_end``, a
        ``teardown`` hook or after ``fit`` is synchronous."""
        return (bool(getattr(self.strategy, "async_checkpoint", False)) and self.window
                and _fitting(self.strategy))

    def save(self, checkpoint: dict[str, Any], filepath, *, max_file_bytes: int = 1 << 30) -> None:
        """Collective: the layout-independent checkpoint folder ``filepath`` (:func:`_save`)."""
        _save(self, checkpoint, filepath, max_file_bytes=max_file_bytes)

    def load(self, checkpoint_path, *, weights_only: bool | None = None) -> dict[str, Any]:
        """Collective: the checkpoint loaded into this layout; the trainer's state (:func:`_load`)."""
        return _load(self, checkpoint_path, weights_only=weights_only)

    def remove(self, filepath) -> None:
        """Rank 0 removes the checkpoint folder; while a save is :attr:`pending`, only once that one is committed
        (``save_top_k`` rotation never leaves fewer complete checkpoints than it keeps)."""
        if self.pending is not None:
            self.pending.removals.append(str(filepath))
            return
        if self.strategy.is_global_zero:
            shutil.rmtree(filepath, ignore_errors=True)

    def open_window(self) -> None:
        """The fit's ``on_train_start``: saves from here may be asynchronous."""
        self.window = True

    def close_window(self) -> None:
        """The fit's ``on_train_end`` (collective: every rank ends training here): the pending save committed;
        saves from here on are synchronous."""
        self.window = False
        self.settle()

    def settle(self, *, poll: bool = False) -> None:
        """Collective: commit the :attr:`pending` save, waiting for this rank's writes; then remove the
        checkpoints removed meanwhile (rank 0). ``poll``: only if every rank's writes are already done (one
        1-element ``all_reduce(MIN)``), else leave it pending: the per-batch check."""
        pending = self.pending
        if pending is None:
            return
        strategy = self.strategy
        if poll:
            done = torch.tensor([int(pending.done())], dtype=torch.int64)
            dist.all_reduce(done, op=dist.ReduceOp.MIN, group=_group(strategy))
            if not done.item():
                return
        self.pending = None
        me = strategy.global_rank
        try:
            _finish(pending.target, pending.wait(), me, dist.get_world_size(), pending.meta, _group(strategy))
        except CheckpointError:
            if me == 0:  # nothing committed: the name is free again (the checkpoints to remove are kept)
                pending.target.unreserve()
            raise
        for path in pending.removals:  # nothing pending now: removed at once (rank 0's)
            self.remove(path)

    def abandon(self, *, wait_s: float = 30.0) -> None:
        """The strategy's teardown, where no collective can be trusted (after a failure): the window closed, and
        a :attr:`pending` save's writes waited for (at most ``wait_s``) and the save left uncommitted. Its
        partial folder is ignored, with a warning, by whoever loads the folder next, and its placeholder
        (:meth:`AtomicSave.reserve`, which ``last.ckpt`` may link to) loads the latest complete checkpoint beside
        it, with a warning."""
        self.window = False
        pending = self.pending
        if pending is None:
            return
        self.pending = None
        pending.wait(wait_s)
        still = not pending.done()
        warnings.warn(f"{pending.target.final}: an asynchronous save was {'still being' if still else 'being'} "
                      f"written when the run failed; it is not committed (its partial folder "
                      f"{pending.target.tmp.name} is ignored{'; its writer thread is still running' if still else ''})",
                      stacklevel=2)

    def restore_rng(self) -> None:
        """At a training step: this rank's RNG states of a loaded checkpoint, where the uninterrupted run drew
        next (once)."""
        if self.rng_state is not None:
            restore_rng(self.rng_state)
            self.rng_state = None


__all__ = ["Checkpointer", "capture_rng", "restore_rng"]
