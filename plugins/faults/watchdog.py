"""The collective watchdog: when a rank dies or hangs, every rank stops with one error naming it.

:class:`CollectiveWatchdog` runs on every rank from the moment the strategy's grid exists until teardown. A
daemon thread keeps, per process group, the last collective this rank entered and completed
(:mod:`.collective_record`) and talks to the other ranks through the c10d store only (it keeps working when
collectives are broken; keys under ``shardline/watchdog/<generation>/``):

* ``hb/<rank>``: a heartbeat every ``beat`` seconds carrying the record's summary;
* ``abort``: the first failure anyone noticed (``by``, ``kind``, ``reason``). A rank notices when its main
  thread's collective raises (gloo: "Connection closed by peer" when a peer dies, or the backend's timeout),
  when one of its own collectives is in flight longer than the collective timeout (a hung peer), or when a
  peer's heartbeat is silent that long (a dead peer nobody is talking to);
* ``final/<rank>``: every live rank's fresh record, published within a tick of seeing ``abort``;
* ``verdict``: composed once, by the rank that wrote ``abort``, from the finals (and the heartbeats of ranks
  that did not answer: the dead) by :func:`.collective_diagnosis.diagnose`; every rank reads the same one.

Each rank writes its record to ``<dump_dir>/rank<N>.json`` on failure. The main thread, once its collective
raises, takes the verdict in ``on_exception`` and the strategy raises it as :class:`CollectiveError` at
teardown (a rank whose own code raised something else keeps its own exception). A thread cannot interrupt a
main thread stuck in C++ (or in a hang): if the main thread has not come back ``exit_grace`` seconds after the
verdict, the watchdog prints the error and the stacks, dumps, and ends the process with ``os._exit(70)``. A
main thread that took the verdict is the caller's again: nothing ends it.

Every group's backend timeout is set to ``collective_timeout + slack``, so the watchdog notices a hang (at
``collective_timeout``) and has the verdict ready before any rank's collective gives up. See :class:`Timing`
for the bound this gives: every rank is gone within ``collective_timeout + 15 s`` of the failure.

Every torch private used here goes through :mod:`shardline.plugins.torch_compat`. The injected-hang test hook
(:class:`~.collective_record.InjectedHang`) applies only where the test harness installed it
(:func:`~.collective_record.install_hang`); nothing here reads the environment for it.

One file: the heartbeat, abort, final and verdict keys above are one protocol over one store connection, and
its timing bound (:class:`Timing`) holds only for the whole of it; the record and the diagnosis it reads are
their own modules.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import json
import logging
import math
import os
import queue
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from shardline.plugins.errors import CollectiveError, ContractError

from .. import torch_compat
from .collective_diagnosis import (
    RankReport,
    Verdict,
    diagnose,
    is_collective_error,
    local_verdict,
    short_reason,
)
from .collective_record import (
    CallRecord,
    FlightRecorderRecord,
    HangObserver,
    Interposer,
    group_refs,
    installed_hang,
)

log = logging.getLogger(__name__)

#: NCCL's own default. Longer than any legitimate wait between the ranks of a healthy job (the slowest rank's
#: sharded checkpoint write, the first step's warm-up), three times shorter than gloo's 30 min default.
DEFAULT_COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
EXIT_CODE = 70  # a process the watchdog ended (EX_SOFTWARE)


def collective_timeout_seconds(value) -> float:
    """``value`` (seconds or a timedelta) as positive, finite seconds; ContractError naming it otherwise (an
    infinite timeout would leave a hung job waiting for ever: the watchdog could never call a rank hung)."""
    seconds = value.total_seconds() if isinstance(value, datetime.timedelta) else value
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < math.inf:
        raise ContractError(f"collective_timeout={value!r} must be a positive number of seconds or a "
                            "datetime.timedelta (finite: with no timeout a hung rank is never named)")
    return float(seconds)


@dataclass(frozen=True)
class Timing:
    """The watchdog's clock, all derived from the collective timeout ``T`` (seconds).

    A failure is noticed at the latest ``T + tick`` after it (an op in flight for ``T``, or a heartbeat silent
    for ``T``; a dead gloo peer at once). The verdict follows within ``tick + answer`` (every live rank answers
    the abort within a tick; the composer waits ``answer`` for those that do not). Backends give up at
    ``T + slack``, after the verdict: a main thread they free raises it. The watchdog ends any rank whose main
    thread has not come back ``exit_grace`` after the verdict.
    So every rank is gone within ``T + bound`` of the failure, ``bound`` <= 11.5 s (5.25 s at T = 5 s).
    """

    timeout: float

    @property
    def tick(self) -> float:
        return min(max(self.timeout / 20, 0.1), 1.0)

    @property
    def beat(self) -> float:
        return min(max(self.timeout / 10, 0.25), 5.0)

    @property
    def answer(self) -> float:
        return max(1.0, 3 * self.tick)

    @property
    def slack(self) -> float:
        return self.tick + self.answer + 2.0

    @property
    def exit_grace(self) -> float:
        return self.slack + 0.5

    @property
    def store(self) -> float:
        """How long one store operation of the watchdog may take before the store counts as not answering."""
        return max(5.0, self.answer + 2 * self.tick)

    @property
    def bound(self) -> float:
        return 2 * self.tick + self.answer + self.exit_grace


def store_lost_reason(exc: BaseException, *, rank: int, host: str | None) -> str:
    """Why rank ``rank`` gives up on the store: the store's own error, and, where the store is a TCPStore that
    rank 0 hosts (``host``: its ``"address:port"``), that rank 0 is the likely casualty."""
    reason = f"the c10d store stopped answering ({short_reason(f'{type(exc).__name__}: {exc}')})"
    if host is not None and rank != 0:
        reason += f"; rank 0 hosts it ({host}): rank 0 is the likely casualty (dead, stopped, or its host unreachable)"
    return reason


class StoreNotAnswering(RuntimeError):
    """A store operation of the watchdog did not come back within :attr:`Timing.store` seconds."""


class BoundedStore:
    """The watchdog's store operations, each given at most ``seconds``: c10d's TCPStore client honours its
    timeout only while waiting for a key, and blocks for ever in ``add``/``set``/``check`` when the store's host
    (rank 0) is stopped or hung. The calls run one at a time on a daemon thread of their own; one that does not
    come back raises :class:`StoreNotAnswering` here and leaves that thread blocked (and later calls then time
    out too: the store is gone for this process)."""

    def __init__(self, store, seconds: float):
        self._store, self._seconds = store, seconds
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="shardline-watchdog-store", daemon=True).start()

    def _serve(self) -> None:
        while True:
            method, args, box, done = self._jobs.get()
            try:
                box.append((True, getattr(self._store, method)(*args)))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                box.append((False, exc))
            done.set()

    def _call(self, method: str, *args):
        box: list = []
        done = threading.Event()
        self._jobs.put((method, args, box, done))
        if not done.wait(self._seconds):
            raise StoreNotAnswering(f"store {method}{args[:1]!r} did not answer within {self._seconds:g} s")
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def check(self, keys: list[str]) -> bool:
        return self._call("check", keys)

    def get(self, key: str) -> bytes:
        return self._call("get", key)

    def set(self, key: str, value: str) -> None:
        self._call("set", key, value)

    def add(self, key: str, amount: int) -> int:
        return self._call("add", key, amount)


class CollectiveWatchdog:
    """One rank's watchdog; build it with :meth:`start` (collective: every rank at the same point). Without a
    ``dump_dir`` the records go to a fresh ``<temp dir>/shardline_collectives/<date-time>-pid<rank 0's pid>``."""

    def __init__(self, grid, *, timeout: float, dump_dir: str | Path | None = None, record: str = "auto"):
        if record not in ("auto", "flight_recorder", "calls"):
            raise ContractError(f"record={record!r} must be 'auto', 'flight_recorder' or 'calls'")
        torch_compat.check_version()
        self.grid, self.rank, self.world = grid, dist.get_rank(), dist.get_world_size()
        self.timing = Timing(collective_timeout_seconds(timeout))
        base = torch_compat.default_store()
        self.generation = (base.add("shardline/watchdog/starts", 1) - 1) // self.world
        prefix = f"shardline/watchdog/{self.generation}/"
        if dump_dir is None:  # one fresh folder per run, the same on every rank (rank 0 names it)
            setup = dist.PrefixStore(prefix, base)  # the job's store timeout: ranks arrive at different times
            if self.rank == 0:
                setup.set("run", f"{time.strftime('%Y%m%d-%H%M%S')}-pid{os.getpid()}")
            dump_dir = Path(tempfile.gettempdir()) / "shardline_collectives" / setup.get("run").decode()
        self._store = BoundedStore(dist.PrefixStore(prefix, torch_compat.store_client(base)), self.timing.store)
        self.dump_dir = Path(dump_dir)
        dist.barrier()  # every rank has its generation; and a first collective for the flight recorder
        self._refs = group_refs(grid)
        self.record = self._choose_record(record)
        self._timed: set[str] = set()
        self._apply_timeouts()
        self._lock = threading.RLock()
        self._hang = self._injected_hang()
        observers = ([self._hang] if self._hang else []) + ([self.record] if self.record.kind == "calls" else [])
        self._interposer = Interposer(observers) if observers else None
        self._state, self._error_text, self.cause, self.error = "running", None, None, None
        self._abort: dict | None = None
        self._abort_seen, self._answered, self._handed, self._own_error = 0.0, False, False, False
        self.verdict: Verdict | None = None
        self._verdict_at = 0.0
        self._verdict_event = threading.Event()
        self._stop = threading.Event()
        self._beats, self._next_beat = 0, 0.0
        self._peers: dict[int, tuple[int, float]] = {}
        self._started = time.monotonic()
        #: called (no arguments) before the watchdog ends this process itself; exceptions are ignored
        self.before_exit = None
        self._thread = threading.Thread(target=self._loop, name=f"shardline-watchdog-{self.rank}", daemon=True)

    @classmethod
    def start(cls, grid, *, timeout, dump_dir=None, record: str = "auto") -> CollectiveWatchdog:
        watchdog = cls(grid, timeout=timeout, dump_dir=dump_dir, record=record)
        if watchdog._interposer is not None:
            watchdog._interposer.install()
        watchdog._beat()
        watchdog._thread.start()
        return watchdog

    # --- setup ------------------------------------------------------------------------------------------------

    def _choose_record(self, choice: str):
        if choice == "flight_recorder":
            torch_compat.require_flight_recorder()
        fr = FlightRecorderRecord(self._refs)
        world_name = torch_compat.default_group().group_name
        if choice == "flight_recorder" or (choice == "auto" and fr.sees(world_name)):
            return fr
        return CallRecord(self._refs)

    def _injected_hang(self) -> HangObserver | None:
        hang = installed_hang()
        if hang is None:
            return None
        group = self.grid.group(hang.axis)
        if hang.rank != self.rank or group is None:
            return None
        return HangObserver(hang, group, self._refs[group].label if group in self._refs else hang.axis)

    def _apply_timeouts(self) -> None:
        """Every group this rank is in gives up ``slack`` after the watchdog noticed (groups made later too)."""
        limit = datetime.timedelta(seconds=self.timing.timeout + self.timing.slack)
        for pg, name in torch_compat.process_groups():
            if name not in self._timed:
                self._timed.add(name)
                try:
                    torch_compat.set_group_timeout(pg, limit)
                except (ValueError, RuntimeError, AssertionError) as exc:
                    log.debug("collective timeout not set on group %s: %s", name, exc)

    def _rescan(self) -> None:
        refs = group_refs(self.grid, known=self._refs)
        if len(refs) != len(self._refs):
            self._refs = refs
            self.record.set_refs(refs)
        self._apply_timeouts()

    # --- the store --------------------------------------------------------------------------------------------

    def _read(self, key: str) -> dict | None:
        if not self._store.check([key]):
            return None
        return json.loads(self._store.get(key))

    def _write(self, key: str, value: dict) -> None:
        self._store.set(key, json.dumps(value))

    def _beat(self) -> None:
        self._beats += 1
        self._next_beat = time.monotonic() + self.timing.beat
        self._write(f"hb/{self.rank}", {"beat": self._beats, "time": time.time(), "state": self._state,
                                        "pid": os.getpid(), "host": socket.gethostname(),
                                        "groups": self.record.summaries()})

    def _publish_final(self) -> None:
        self.record.refresh()
        self._write(f"final/{self.rank}", {"time": time.time(), "state": self._state, "error": self._error_text,
                                           "groups": self.record.summaries(recent=True)})
        self._write_dump()

    def _trigger(self, kind: str, reason: str) -> None:
        """Raise the abort, unless someone already did (the first writer wins)."""
        with self._lock:
            if self._abort is not None:
                return
            if self._store.add("abort_count", 1) == 1:
                abort = {"by": self.rank, "kind": kind, "reason": short_reason(reason), "time": time.time()}
                self._write("abort", abort)
            else:
                abort = self._wait_key("abort", self.timing.answer)
            if abort is not None:
                self._abort, self._abort_seen = abort, time.monotonic()

    def _wait_key(self, key: str, seconds: float) -> dict | None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            value = self._read(key)
            if value is not None:
                return value
            time.sleep(min(0.05, self.timing.tick))
        return None

    # --- the thread -------------------------------------------------------------------------------------------

    def _loop(self) -> None:
        trouble_since, warned = None, False
        while not self._stop.wait(self.timing.tick):
            if self._handed:
                return  # the main thread has the verdict: nothing is left to guard
            try:
                if self.verdict is not None:
                    self._guard()
                    continue
                self._tick()
                trouble_since = None
            except Exception as exc:  # noqa: BLE001 - a failing store or recorder must not end the thread
                if not self._store_answers():
                    trouble_since = trouble_since or time.monotonic()
                    if time.monotonic() - trouble_since > self.timing.answer + self.timing.tick:
                        self._store_lost(exc)
                elif not warned:  # our own fault, not the job's: say so once and carry on
                    warned = True
                    log.warning("shardline watchdog rank %d: %s: %s", self.rank, type(exc).__name__, exc)

    def _store_answers(self) -> bool:
        try:
            self._store.check(["abort"])
            return True
        except Exception:  # noqa: BLE001 - any failure of the store itself
            return False

    def _tick(self) -> None:
        self.record.poll()
        now = time.monotonic()
        if now >= self._next_beat:
            self._beat()
            self._rescan()
            if self._abort is None:
                self._watch_peers(now)
        if self._abort is None:
            self._watch_own_collectives()
            abort = self._read("abort")
            if abort is not None:
                with self._lock:
                    self._abort, self._abort_seen = abort, now
        if self._abort is not None:
            self._progress()

    def _watch_own_collectives(self) -> None:
        if not any((g["in_flight_s"] or 0) > self.timing.timeout for g in self.record.summaries()):
            return
        self.record.refresh()  # the cheap status can lag: confirm with a full record before raising an abort
        for g in self.record.summaries():
            if (g["in_flight_s"] or 0) > self.timing.timeout:
                op = g["entered"] or {}
                self._trigger("in_flight", f"rank {self.rank}: {op.get('op')} #{op.get('seq') or op.get('id')} "
                                           f"in {g['group']} in flight for {g['in_flight_s']:.1f} s")
                return

    def _watch_peers(self, now: float) -> None:
        peers = sorted({r for ref in self._refs.values() if ref.axis != "world" for r in ref.ranks} - {self.rank})
        for peer in peers or [r for r in range(self.world) if r != self.rank]:
            hb = self._read(f"hb/{peer}")
            beat = hb["beat"] if hb else 0
            if hb is not None and hb["state"] != "running":
                continue
            last = self._peers.get(peer)
            if last is None or last[0] != beat:
                self._peers[peer] = (beat, now if hb is not None else self._started)
            elif now - last[1] > self.timing.timeout:
                self._trigger("heartbeat", f"rank {peer} sent no heartbeat for {now - last[1]:.1f} s")
                return

    def _progress(self) -> None:
        if not self._answered:
            self._answered = True
            self._publish_final()
        if self._abort["by"] == self.rank:
            self._take(self._publish_verdict(self._compose()))
            return
        verdict = self._read("verdict")
        if verdict is not None:
            self._take(Verdict.from_dict(verdict))
        elif time.monotonic() - self._abort_seen > self.timing.answer + 4 * self.timing.tick + 2:
            self._take(self._publish_verdict(self._compose()))  # the composer is gone: compose here

    def _compose(self) -> Verdict:
        finals: dict[int, dict] = {}
        deadline = time.monotonic() + self.timing.answer
        while True:
            for r in range(self.world):
                if r not in finals:
                    final = self._read(f"final/{r}")
                    if final is not None:
                        finals[r] = final
            if len(finals) == self.world or time.monotonic() >= deadline:
                break
            time.sleep(min(0.05, self.timing.tick))
            if time.monotonic() >= self._next_beat:
                self._beat()
        reports = {}
        for r in range(self.world):
            if r in finals:
                f = finals[r]
                reports[r] = RankReport(r, "final", state=f["state"], groups=tuple(f["groups"]), error=f["error"])
                continue
            hb = self._read(f"hb/{r}")
            reports[r] = RankReport(r, "none") if hb is None else RankReport(
                r, "heartbeat", state=hb["state"], groups=tuple(hb["groups"]), silent_s=time.time() - hb["time"])
        return diagnose(reports, trigger=self._abort, world_size=self.world, dump_dir=str(self.dump_dir),
                        timeout_s=self.timing.timeout)

    def _publish_verdict(self, verdict: Verdict) -> Verdict:
        if self._store.add("verdict_count", 1) == 1:
            self._store.set("verdict", verdict.to_json())
            return verdict
        published = self._wait_key("verdict", 2.0)
        return verdict if published is None else Verdict.from_dict(published)

    def _take(self, verdict: Verdict) -> None:
        with self._lock:
            if self.verdict is not None:
                return
            self.verdict, self._verdict_at = verdict, time.monotonic()
        self._write_dump()
        self._verdict_event.set()
        if self.grid.backend == "nccl":  # NCCL can abort a blocked communicator; gloo cannot (it times out)
            try:
                torch_compat.abort_groups()
            except Exception as exc:  # noqa: BLE001 - best effort: the exit guard still ends the process
                log.debug("abort of the NCCL groups failed: %s", exc)

    def _guard(self) -> None:
        if time.monotonic() - self._verdict_at >= self.timing.exit_grace:
            self._end_process(f"its main thread did not come back within {self.timing.exit_grace:.1f} s of the "
                              "verdict")

    def _store_lost(self, exc: Exception) -> None:
        """The store stopped answering (its host, rank 0 under TCPStore, is gone): a verdict of our own."""
        reason = store_lost_reason(exc, rank=self.rank, host=torch_compat.store_host())
        with self._lock:
            self._abort = self._abort or {"by": self.rank, "kind": "store", "reason": reason}
        self._take(local_verdict(self.rank, self.record.summaries(), reason=reason, dump_dir=str(self.dump_dir)))

    def report_exit(self, rank: int, how: str) -> None:
        """Another rank's process ended (``how``: "was killed by SIGKILL", "exited with code 3"), as its launcher
        saw: raise the abort now, rather than at the collective timeout, so the verdict comes before anyone is
        ended (a no-op once an abort is under way or the run stopped)."""
        if self._state == "stopped" or self._abort is not None:
            return
        try:
            self._trigger("exited", f"rank {rank}'s process {how}")
        except Exception as exc:  # noqa: BLE001 - the store is gone: the thread finds that out itself
            log.debug("abort for the exit of rank %d not raised: %s", rank, exc)

    def wait_verdict(self, seconds: float) -> Verdict | None:
        """The verdict, waiting at most ``seconds`` for it; None if there is none by then."""
        self._verdict_event.wait(max(seconds, 0.0))
        return self.verdict

    def _end_process(self, why: str) -> None:
        """Say why (the verdict itself only on its speaker; every thread's stack goes to a file beside the
        record), then let the launcher end its workers, then end this process."""
        stacks: Path | str = self.dump_dir / f"rank{self.rank}-stacks.txt"
        try:
            self.dump_dir.mkdir(parents=True, exist_ok=True)
            with open(stacks, "w") as out:
                faulthandler.dump_traceback(file=out, all_threads=True)
        except OSError as exc:
            stacks = f"not written ({exc})"
        text = f"\nshardline watchdog, rank {self.rank}: ending this process ({why}); its stacks: {stacks}\n"
        if self.verdict.speaks(self.rank):
            text += f"{CollectiveError.__name__}: {self.verdict.message}\n"
        sys.stderr.write(text)
        sys.stderr.flush()
        try:
            self._write_dump(ended_by="watchdog")
            if self.before_exit is not None:  # e.g. the launcher ends the workers it started, once they said theirs
                with contextlib.suppress(Exception):
                    self.before_exit()
        finally:
            os._exit(EXIT_CODE)

    def _write_dump(self, **extra) -> None:
        with self._lock:
            doc = {"rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(),
                   "generation": self.generation, "record": self.record.kind, "timeout_s": self.timing.timeout,
                   "state": self._state, "error": self._error_text, "abort": self._abort,
                   "verdict": None if self.verdict is None else self.verdict.message,
                   "culprits": None if self.verdict is None else list(self.verdict.culprits),
                   "injected_hang": None if self._hang is None else self._hang.fired,
                   "written_at": time.time(), "written_at_monotonic": time.monotonic(), "ended_by": None,
                   "groups": self.record.summaries(recent=True), "flight_recorder_entries": self.record.entries()}
            doc.update(extra)
            path = self.dump_dir / f"rank{self.rank}.json"
            try:
                self.dump_dir.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".json.tmp{os.getpid()}")
                tmp.write_text(json.dumps(doc, indent=1, default=str))
                os.replace(tmp, path)
            except OSError as exc:  # a record that cannot be written must not change how the run ends
                log.warning("shardline watchdog rank %d: cannot write %s: %s", self.rank, path, exc)

    # --- the main thread --------------------------------------------------------------------------------------

    def on_exception(self, exc: BaseException) -> None:
        """The main thread's exception: raise the abort (unless one is under way), answer it, and wait for the
        verdict. Afterwards :attr:`error` is the CollectiveError to raise, or None where this rank's own
        exception is the cause (it then keeps it)."""
        if isinstance(exc, CollectiveError) or self._state == "stopped":
            return
        collective = is_collective_error(exc)
        with self._lock:
            if collective:
                self.record.mark_failed()
            self._state, self.cause, self._own_error = "failed", exc, not collective
            self._error_text = short_reason(f"{type(exc).__name__}: {exc}")
        try:
            self._trigger("collective_error" if collective else "exception", self._error_text)
            self._answered = True
            self._publish_final()
        except Exception as store_exc:  # noqa: BLE001 - the store is gone too: a verdict of this rank's own
            self._store_lost(store_exc)
        self._await_verdict()
        self._handed = True

    def _await_verdict(self) -> None:
        t = self.timing
        if not self._verdict_event.wait(2 * t.answer + 8 * t.tick + 2):
            with self._lock:  # the thread did not get one (a broken store): compose what this rank knows
                self._abort = self._abort or {"by": self.rank, "kind": "collective_error",
                                              "reason": self._error_text or ""}
            self._store_lost(RuntimeError("no verdict arrived"))
        verdict = self.verdict
        self.error = None if self._own_error else CollectiveError(
            verdict.message, kind=verdict.kind, culprits=verdict.culprits, dump_dir=str(self.dump_dir))

    def stop(self) -> CollectiveError | None:
        """At teardown. Without a failure: stop the thread and put torch.distributed back; returns None. After
        one: the error to raise (None on a rank whose own exception, not a collective's, interrupted it)."""
        if self._abort is None and self.verdict is None:
            self._state = "stopped"
            self._stop.set()
            self._thread.join(timeout=self.timing.answer + 2 * self.timing.tick)
            if self._interposer is not None:
                self._interposer.restore()
            try:
                self._beat()
            except Exception as exc:  # noqa: BLE001 - a last heartbeat is a courtesy to the peers
                log.debug("final heartbeat not written: %s", exc)
            return None
        if self.verdict is None or (self.error is None and self.cause is None):
            self._await_verdict()
        self._handed = True
        if self._interposer is not None:
            self._interposer.restore()
        return self.error
