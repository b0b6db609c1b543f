"""Per process group, the last collective this rank entered, completed and saw fail: the watchdog's record.

Two sources, one summary shape (:meth:`summaries`, plain JSON):

* :class:`FlightRecorderRecord` reads PyTorch's flight recorder (on by default, ``TORCH_FR_BUFFER_SIZE``
  entries). Its ``pg_status`` gives, per group, the id of the last collective enqueued ("entered") and
  completed; on NCCL a work item completes when its kernel is seen done (with ``TORCH_NCCL_ENABLE_TIMING`` it
  also gives "started"). On gloo an entry is marked ``retired`` the moment its work finishes, but the status's
  completed count can stay one op behind for as long as the process issues nothing more (a rank that stopped
  right after a collective): "completed" is the newer of the two, and an op that looks in flight for a second
  is confirmed by a full dump. Reading ``pg_status`` is cheap, so it is polled every watchdog tick. Op
  names and the per-group collective sequence number come from the entries, whose full dump costs time per
  entry: they are re-read at most at a rate that keeps that under 1 % of a core, and always at a failure.
  What gloo's recorder does not give: point-to-point ops (no entries; they advance
  the op id but not the collective sequence number), and which op failed (a failed op is retired like a
  finished one) - the op the main thread was in when its collective raised is the newest entry, marked by
  :meth:`mark_failed`. A destroyed group's entries stay in the ring buffer, so each group name is read from
  its newest recorder id only.
* :class:`CallRecord` is ours, for when the flight recorder is off (``TORCH_FR_BUFFER_SIZE=0``): it wraps
  ``torch.distributed``'s collective functions (:class:`Interposer`) and counts, per group, the calls entered,
  returned (or whose async work finished) and raised. It sees only calls made through ``torch.distributed.<op>``.

A summary names its group by layout axis and index (``"tp group 1: ranks 2,3"``), see :func:`group_refs`.

The test hook (:class:`InjectedHang`) is an :class:`Interposer` observer too: the one way the tests make a rank
hang at a chosen collective. Nothing here reads it from the environment: the test harness installs it
(:func:`install_hang`; ``shardline.plugins.testing``'s workers do so from :data:`TEST_HANG_ENV`).

Every torch private read here goes through :mod:`shardline.plugins.torch_compat`.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from shardline.plugins.errors import ContractError
from shardline.plugins.grid import AXES, COMBINED_AXES

from .. import torch_compat

log = logging.getLogger(__name__)

#: The collectives :class:`Interposer` wraps (the object collectives call these, so they are seen too).
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
               "broadcast", "barrier", "all_to_all", "all_to_all_single", "reduce", "gather", "scatter")
_RECENT = 16  # op names kept per group, for naming another rank's op by its sequence number
#: Test hook: ``rank=3,axis=tp,op=all_reduce,seq=30`` makes global rank 3 sleep, instead of entering, the first
#: ``all_reduce`` on its tp group whose sequence number would be >= 30. For tests of this module only. The
#: variable the test harness (``shardline.plugins.testing``) reads it from; library code never reads it.
TEST_HANG_ENV = "SHARDLINE_TEST_HANG_AT"


def format_ranks(ranks) -> str:
    """``[2, 3]`` -> ``"2,3"``; runs of three or more consecutive ranks as ``"0-3"``."""
    ranks, parts, i = sorted(ranks), [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(f"{ranks[i]}-{ranks[j]}" if j - i >= 2 else ",".join(map(str, ranks[i:j + 1])))
        i = j + 1
    return ",".join(parts)


@dataclass(frozen=True)
class GroupRef:
    """One process group this rank belongs to: its layout axis and index among that axis's groups."""

    axis: str  # a grid axis, "world", or the description of a group the grid did not make
    index: int | None
    ranks: tuple[int, ...]
    name: str  # the c10d group name (the flight recorder's ``process_group[0]``)

    @property
    def label(self) -> str:
        where = f"{self.axis} group {self.index}" if self.index is not None else f"group {self.axis!r}"
        return f"{where}: ranks {format_ranks(self.ranks)}"


def group_refs(grid, *, known: dict | None = None) -> dict:
    """``{process group: GroupRef}`` for this rank's groups of more than one rank: the world, every grid axis,
    then any other group that exists now (DeepSpeed's, the pipeline's gloo twin), named by its description."""
    refs = dict(known or {})
    taken = {ref.name for ref in refs.values()}

    def add(pg, ref):
        if pg is not None and ref.name not in taken and len(ref.ranks) > 1:
            refs[pg] = ref
            taken.add(ref.name)

    world = torch_compat.default_group()
    add(world, GroupRef("world", 0, tuple(range(dist.get_world_size())), world.group_name))
    for axis in AXES + COMBINED_AXES:
        pg = grid.group(axis)
        if pg is not None:
            ranks = grid.ranks(axis)
            add(pg, GroupRef(axis, grid.dims.group_ranks(axis).index(ranks), tuple(ranks), pg.group_name))
    for pg, name in torch_compat.process_groups():
        if pg not in refs and name not in taken:
            desc = getattr(pg, "group_desc", "")
            desc = desc if desc and desc != "undefined" else f"c10d group {name}"  # new_group's default desc
            add(pg, GroupRef(desc, None, tuple(dist.get_process_group_ranks(pg)), name))
    return refs


def _op_ref(op: str | None, seq: int | None, op_id: int | None) -> dict | None:
    return None if op_id is None or op_id < 1 else {"op": op, "seq": seq, "id": op_id}


class FlightRecorderRecord:
    """The record read from PyTorch's flight recorder (see the module docstring for what it holds on gloo)."""

    kind = "flight_recorder"
    _MAX_DUTY = 0.01  # share of one core the periodic full dumps may take (a failure always takes one)
    _CONFIRM_S = 1.0  # an op that looks in flight this long since the last full dump gets one to confirm it

    def __init__(self, refs: dict):
        self._lock = threading.RLock()
        self._by_name = {ref.name: ref for ref in refs.values()}
        self._pg_names: dict[str, str] = {}  # flight-recorder pg_id -> c10d group name
        # A name's newest pg_id: a destroyed group's entries stay in the ring buffer, and a group made after it
        # may get the same name (the default group is "0" again after destroy + init in one process).
        self._current: dict[str, int] = {}
        self._nameless: set[str] = set()  # pg_ids whose entries had left the ring buffer before we looked
        self._ops: dict[str, dict[int, tuple[str, int]]] = {}  # group name -> op id -> (op, collective seq)
        self._ids_are_seqs: dict[str, bool] = {}  # no point-to-point op yet: op id == collective seq
        self._status: dict[str, tuple[int, int, int]] = {}  # group name -> (enqueued, started, completed) ids
        self._retired: dict[str, int] = {}  # group name -> newest op id whose entry is retired (finished)
        self._since: dict[str, tuple[int, float]] = {}  # group name -> (in-flight op id, first seen at)
        self._failed: dict[str, int] = {}
        self._entries: list[dict] = []  # the latest full dump's entries of our groups, for the dump file
        self._dump_cost, self._next_names, self._named_status, self._refreshed = 0.0, 0.0, None, 0.0

    @staticmethod
    def _dump(entries: bool) -> dict:
        return torch_compat.dump_flight_recorder(entries=entries)

    def set_refs(self, refs: dict) -> None:
        with self._lock:
            self._by_name = {ref.name: ref for ref in refs.values()}

    def sees(self, name: str) -> bool:
        """Whether the recorder has recorded a collective of group ``name`` (false when it is off, or when this
        torch cannot dump it)."""
        if not torch_compat.flight_recorder_available():
            return False
        self.refresh()
        return name in self._status

    def poll(self) -> None:
        """Read ``pg_status`` (cheap); re-read the entries when new op ids appeared and the duty cycle allows."""
        with self._lock:
            status = self._dump(False).get("pg_status", {})
            now = time.monotonic()
            if set(status) - set(self._pg_names) - self._nameless or (
                    status != self._named_status and now >= self._next_names):
                self.refresh()
                return
            self._apply_status(status, now)
            if any(self._refreshed < since < now - self._CONFIRM_S for _, since in self._since.values()):
                self.refresh()

    def refresh(self) -> None:
        """A full dump: op names and sequence numbers of every entry, then the status."""
        with self._lock:
            start = time.perf_counter()
            trace = self._dump(True)
            entries = trace.get("entries", [])
            for entry in entries:
                name = entry["process_group"][0]
                self._pg_names[str(entry["pg_id"])] = name
                if entry["pg_id"] > self._current.get(name, -1):
                    self._forget(name)
                    self._current[name] = entry["pg_id"]
            mine = []
            for entry in entries:
                name = entry["process_group"][0]
                if name not in self._by_name or entry["pg_id"] != self._current[name]:
                    continue
                mine.append(entry)
                if entry["retired"]:
                    self._retired[name] = max(self._retired.get(name, -1), entry["op_id"])
                op = entry["profiling_name"].split(":", 1)[-1]
                ops = self._ops.setdefault(name, {})
                ops[entry["op_id"]] = (op, entry["collective_seq_id"])
                self._ids_are_seqs[name] = self._ids_are_seqs.get(name, True) and \
                    entry["op_id"] == entry["collective_seq_id"]
            for ops in self._ops.values():
                for op_id in sorted(ops)[:-_RECENT * 4]:
                    del ops[op_id]
            self._entries = mine[-_RECENT * 4:]
            status = trace.get("pg_status", {})
            self._nameless = set(status) - set(self._pg_names)
            self._named_status = status
            self._dump_cost = time.perf_counter() - start
            self._refreshed = time.monotonic()
            self._next_names = self._refreshed + self._dump_cost / self._MAX_DUTY
            self._apply_status(status, time.monotonic())

    def _forget(self, name: str) -> None:
        for table in (self._ops, self._ids_are_seqs, self._status, self._since, self._failed, self._retired):
            table.pop(name, None)

    def _apply_status(self, status: dict, now: float) -> None:
        for pg_id, st in status.items():
            name = self._pg_names.get(pg_id)
            if name not in self._by_name or int(pg_id) != self._current.get(name):
                continue
            # An entry is retired when its work finishes; pg_status's count can stay one op behind until the
            # process issues another, so the newest retired entry (as of the last full dump) counts too.
            entered = st["last_enqueued_collective"]
            completed = max(st["last_completed_collective"], self._retired.get(name, -1))
            self._status[name] = (entered, st.get("last_started_collective", -1), completed)
            if entered > completed:
                if self._since.get(name, (None,))[0] != entered:
                    self._since[name] = (entered, now)
            else:
                self._since.pop(name, None)

    def mark_failed(self) -> None:
        """The main thread's collective just raised: the newest entry of our groups is the op that failed."""
        with self._lock:
            self.refresh()
            if self._entries:
                newest = max(self._entries, key=lambda e: e["record_id"])
                self._failed[newest["process_group"][0]] = newest["op_id"]

    def _named(self, name: str, op_id: int) -> dict | None:
        op, seq = self._ops.get(name, {}).get(op_id, (None, op_id if self._ids_are_seqs.get(name) else None))
        return _op_ref(op, seq, op_id)

    def summaries(self, *, recent: bool = False) -> list[dict]:
        """One summary per group with a recorded collective (see :func:`summary`)."""
        with self._lock:
            now, out = time.monotonic(), []
            for name, (entered, started, completed) in self._status.items():
                failed = self._failed.get(name)
                if failed is not None and failed <= completed:
                    done = [i for i in self._ops.get(name, {}) if i < failed]
                    completed = max(done) if done else failed - 1
                since = self._since.get(name)
                ops = self._ops.get(name, {})
                out.append(summary(
                    self._by_name[name], entered=self._named(name, entered),
                    completed=self._named(name, completed), failed=None if failed is None else
                    self._named(name, failed), started=self._named(name, started),
                    in_flight_s=None if since is None or failed is not None else now - since[1],
                    ids_are_seqs=self._ids_are_seqs.get(name, False),
                    recent={seq: op for _, (op, seq) in sorted(ops.items())[-_RECENT:]} if recent else None))
            return out

    def entries(self) -> list[dict]:
        """The newest flight-recorder entries of our groups (for the dump file), JSON-ready."""
        keep = ("record_id", "pg_id", "process_group", "op_id", "collective_seq_id", "p2p_seq_id",
                "profiling_name", "state", "retired", "time_created_ns", "timeout_ms", "input_sizes")
        with self._lock:
            return [{k: e.get(k) for k in keep} for e in self._entries]


def summary(ref: GroupRef, *, entered, completed, failed=None, started=None, in_flight_s=None,
            ids_are_seqs=False, recent=None) -> dict:
    """The JSON summary of one group on one rank. ``entered``/``completed``/``failed``/``started`` are
    ``{"op", "seq", "id"}`` or None; ``seq`` is the group's collective sequence number (the same on every
    member), ``id`` the backend's op counter on this rank (it also counts point-to-point ops)."""
    out = {"group": ref.label, "axis": ref.axis, "index": ref.index, "ranks": list(ref.ranks),
           "entered": entered, "completed": completed, "failed": failed, "in_flight_s": in_flight_s,
           "ids_are_seqs": ids_are_seqs}
    if started is not None:
        out["started"] = started
    if recent is not None:
        out["recent"] = {str(seq): op for seq, op in recent.items()}
    return out


class Interposer:
    """Wraps ``torch.distributed``'s collective functions with observers, and puts the originals back.

    An observer has ``before(op, group) -> token`` (may block: the test hang), ``after(token, work)`` and
    ``failed(token)``. Only calls that look the function up on ``torch.distributed`` (or ``distributed_c10d``)
    at call time are seen; ``from torch.distributed import all_reduce`` made before :meth:`install` is not.
    """

    def __init__(self, observers: list, ops: tuple[str, ...] = COLLECTIVES):
        self._observers = observers
        self._ops = ops
        self._saved: dict[str, Callable] = {}

    def install(self) -> None:
        c10d = dist.distributed_c10d
        for op in self._ops:
            original = getattr(c10d, op, None)
            if original is None or op in self._saved:
                continue
            self._saved[op] = original
            wrapped = self._wrap(op, original)
            setattr(c10d, op, wrapped)
            if getattr(dist, op, None) is original:
                setattr(dist, op, wrapped)

    def restore(self) -> None:
        c10d = dist.distributed_c10d
        for op, original in self._saved.items():
            for module in (c10d, dist):
                if getattr(getattr(module, op, None), "__wrapped__", None) is original:
                    setattr(module, op, original)
        self._saved.clear()

    def _wrap(self, op: str, original: Callable) -> Callable:
        params = list(inspect.signature(original).parameters)
        at_group = params.index("group") if "group" in params else None
        at_async = params.index("async_op") if "async_op" in params else None
        observers = self._observers

        @functools.wraps(original)
        def call(*args, **kwargs):
            group = kwargs.get("group", args[at_group] if at_group is not None and len(args) > at_group else None)
            is_async = kwargs.get("async_op", args[at_async] if at_async is not None and len(args) > at_async
                                  else False)
            tokens = [(o, o.before(op, group)) for o in observers]
            try:
                work = original(*args, **kwargs)
            except BaseException:
                for o, token in tokens:
                    o.failed(token)
                raise
            for o, token in tokens:
                o.after(token, work if is_async else None)
            return work

        return call


class CallRecord:
    """Our own record (the flight recorder is off): per group, the calls entered, finished and raised, each
    ``(op, seq)`` with ``seq`` counted per group from the watchdog's start (the same on every member, since
    every rank starts it at the same point of setup)."""

    kind = "calls"

    def __init__(self, refs: dict):
        self._lock = threading.Lock()
        self._refs = dict(refs)
        self._world = torch_compat.default_group()
        self._seq: dict[str, int] = {}
        self._state: dict[str, dict] = {}  # label -> entered/completed/failed (op, seq), entered_at
        self._recent: dict[str, dict[int, str]] = {}

    def set_refs(self, refs: dict) -> None:
        with self._lock:
            self._refs = dict(refs)

    def before(self, op: str, group):
        ref = self._refs.get(self._world if group is None else group)
        if ref is None:
            return None
        with self._lock:
            seq = self._seq[ref.label] = self._seq.get(ref.label, 0) + 1
            state = self._state.setdefault(ref.label, {"ref": ref, "completed": None, "failed": None})
            state.update(entered=(op, seq), entered_at=time.monotonic())
            recent = self._recent.setdefault(ref.label, {})
            recent[seq] = op
            recent.pop(seq - _RECENT, None)
        return ref.label, op, seq

    def after(self, token, work) -> None:
        if token is None:
            return
        if work is None:
            self._finish(token)
        else:
            work.get_future().add_done_callback(lambda fut: self._finish(token, fut))

    def failed(self, token) -> None:
        if token is not None:
            with self._lock:
                self._state[token[0]]["failed"] = token[1:]

    def _finish(self, token, fut=None) -> None:
        if fut is not None:
            try:
                fut.value()
            except Exception:  # noqa: BLE001 - an async collective that failed is recorded as failed
                self.failed(token)
                return
        with self._lock:
            state = self._state[token[0]]
            if state["completed"] is None or state["completed"][1] < token[2]:
                state["completed"] = token[1:]

    def poll(self) -> None:
        """Nothing to read: the record is updated by the calls themselves."""

    refresh = poll

    def mark_failed(self) -> None:
        """The wrapped call that raised has marked itself."""

    def summaries(self, *, recent: bool = False) -> list[dict]:
        now, out = time.monotonic(), []
        with self._lock:
            for label, st in self._state.items():
                entered, completed, failed = st["entered"], st["completed"], st["failed"]
                waiting = failed is None and (completed is None or completed[1] < entered[1])
                out.append(summary(
                    st["ref"], entered=_op_ref(*entered, entered[1]),
                    completed=None if completed is None else _op_ref(*completed, completed[1]),
                    failed=None if failed is None else _op_ref(*failed, failed[1]),
                    in_flight_s=now - st["entered_at"] if waiting else None, ids_are_seqs=True,
                    recent=self._recent.get(label) if recent else None))
        return out

    def entries(self) -> list[dict]:
        return []


# --- the test hook ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class InjectedHang:
    """The test hook of :data:`TEST_HANG_ENV` (see there); sleeps with the GIL released, so heartbeats go on.
    A watchdog started in a process where one is installed (:func:`install_hang`) applies it."""

    rank: int
    axis: str
    op: str
    seq: int

    @classmethod
    def parse(cls, text: str) -> InjectedHang:
        fields = dict(part.split("=", 1) for part in text.split(",") if "=" in part)
        try:
            hang = cls(rank=int(fields["rank"]), axis=fields["axis"], op=fields["op"], seq=int(fields["seq"]))
        except (KeyError, ValueError):
            raise ContractError(f"{TEST_HANG_ENV}={text!r} must read rank=<int>,axis=<axis>,op=<op>,seq=<int>, "
                                "e.g. rank=3,axis=tp,op=all_reduce,seq=30") from None
        if hang.axis not in AXES + COMBINED_AXES:
            raise ContractError(f"{TEST_HANG_ENV}={text!r}: axis {hang.axis!r} is not one of "
                                f"{AXES + COMBINED_AXES}")
        return hang


#: The installed test hook (None: no hang, in every real run). Set by the test harness, never from here.
_installed_hang: InjectedHang | None = None


def install_hang(hang: InjectedHang | None) -> None:
    """Test harness only: make every watchdog started in this process (and in processes forked from it after
    this call) apply ``hang``; None removes it. ``shardline.plugins.testing``'s workers install the hook of
    :data:`TEST_HANG_ENV` when it is set; a test may also install one itself before it forks its ranks."""
    global _installed_hang
    if hang is not None and not isinstance(hang, InjectedHang):
        raise ContractError(f"install_hang({hang!r}): expected an InjectedHang or None")
    _installed_hang = hang


def installed_hang() -> InjectedHang | None:
    """The hook :func:`install_hang` installed in this process, or None."""
    return _installed_hang


class HangObserver:
    """The :class:`InjectedHang` as an :class:`Interposer` observer."""

    def __init__(self, hang: InjectedHang, group, label: str):
        self.hang, self.group, self.label, self.fired = hang, group, label, None
        self._sequence = torch_compat.sequence_number_reader(group)

    def before(self, op, group):
        if self.fired is None and op == self.hang.op and group is self.group and \
                self._sequence() + 1 >= self.hang.seq:
            seq = self._sequence() + 1
            self.fired = {"at_monotonic": time.monotonic(), "op": op, "seq": seq, "group": self.label}
            log.warning("shardline test hook %s: rank %d sleeps instead of entering %s #%d on %s",
                        TEST_HANG_ENV, self.hang.rank, op, seq, self.label)
            while True:
                time.sleep(3600)

    def after(self, token, work):
        pass

    def failed(self, token):
        pass
