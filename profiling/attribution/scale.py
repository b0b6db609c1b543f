"""Profiling many ranks: the per-rank work on an executor (a local process pool, Ray or Dask), only small tables
back to the driver.

``load`` + ``breakdown`` hold every rank's events in one table, so memory grows with the whole job (a 1,024-rank
job at 200 MB of JSON per rank is 200 GB). Everything but the cross-rank matching is per rank, and the
matching reads only the communication rows, so :func:`analyze` splits the work:

1. **Map, per trace file, in a worker where the file is** (nothing is shipped through the driver but its path):
   read it, survey it (``table.survey.surveyed``, as ``breakdown`` does), attribute its rank alone with the
   pipelines of its own annotations given as its ``Matching``, and keep
   - its breakdown rows (the same partition ``breakdown`` computes, its bubble from its own ``sl:pp``
     annotations);
   - its *compact rows*: the events of every communication category (collectives and p2p, with their group,
     sequence, times and sizes), the launch calls of those kernels, the step markers and the pipeline
     annotations (``sl:pp:*``, torch.distributed.pipelining's names): what the cross-rank analyses read;
   - its ``table.survey.RankContext`` (lane kind, step windows, the windows the breakdown partitions), which a
     rank's compact rows alone could not give.
   A worker holds one file at a time; the driver receives a few tables per rank.
2. **Reduce, on the driver**: the compact rows of every rank make one small events table; its ``Survey``,
   built with every rank's context, and the ``Attribution`` over it (``attribute``) are what
   ``match_collectives``, ``comm_calls``, ``p2p.match_p2p`` and ``pipelines.rank_pipelines`` read, exactly as
   on the whole table (the driver's memory grows with the number of collectives, not of events).
3. **A second map, only where a rank's bubble needs its peers** (a pipeline measured from send/recv matched
   across ranks, or torch.distributed.pipelining's single-stage names, whose stages come from the ranks'
   order): that rank is read again, its attribution given the pipelines the driver measured as its
   ``Matching``. On the driver's host the first
   map keeps such a rank's loaded table for it in a pickle, in a folder :func:`tempfile.mkdtemp` made for this
   call (mode 0700, removed when it returns) and read back only by this call's own workers, under a name the
   driver derived; nothing from a trace or a user's file is ever unpickled (whoever could write that folder
   could already run code as this user).

The results are those of the single-table path (``breakdown(load(path))``, ``match_collectives(...)``): the
tests compare both on the 8-rank corpus set and on generated sets. Executors (:data:`EXECUTORS`): ``local``
(forked processes on this machine, the default), ``ray`` (``ray.init(address=...)``: an existing cluster as
is, else a local instance) and ``dask`` (a ``distributed.Client`` of the scheduler ``address``, else a local
cluster); Ray and Dask are optional extras (``pip install shardline[scale]``).

Bad input: a file that cannot be read is named in a warning and the other ranks are analysed (its rows are
missing: ``ScaleResult.failed``); ranks missing from ``world_size`` are named in a warning; a rank that two
files both claim is refused (``MixedJobsError``), as ``load`` does.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pickle
import shutil
import socket
import tempfile
import warnings as _warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from ..base.errors import MixedJobsError, ProfilingError, TraceFormatError, TraceWarning
from ..base.schema import COMM_CATEGORIES, P2P_CATEGORIES
from ..matching.matched import BubbleMethod, Matching
from ..matching.pipelines import annotated_pipelines, rank_pipelines
from ..table import load as loading
from ..table.dims import check_layout
from ..table.kinds import Lane
from ..table.load import _concat, _discover
from ..table.names import match_names
from ..table.pipeline_rows import THIRD_PARTY_PP_PATTERN
from ..table.rows import PP_PREFIX, is_in
from ..table.survey import RankContext, Survey, surveyed
from .core import Attribution, attribute, empty_breakdown

__all__ = ["EXECUTORS", "ExecutorError", "RankContext", "RankPart", "ScaleResult", "analyze", "compact_rows",
           "map_file"]

#: The executors :func:`analyze` runs the per-rank work on.
EXECUTORS = ("local", "ray", "dask")
#: Seconds a Dask client waits to reach the scheduler at ``address``.
CONNECT_TIMEOUT_S = 30


class ExecutorError(ProfilingError):
    """An executor that cannot run here (its package is not installed, its cluster cannot be reached)."""


@dataclasses.dataclass
class RankPart:
    """One file's share of the map: its breakdown rows, compact rows and rank contexts, and what its read
    said (metadata, warnings, ``skipped``); ``error``: why it could not be read (then nothing else)."""

    file: str
    breakdown: pd.DataFrame | None = None
    compact: pd.DataFrame | None = None
    contexts: dict = dataclasses.field(default_factory=dict)
    metadata: dict = dataclasses.field(default_factory=dict)
    warnings: list = dataclasses.field(default_factory=list)
    notes: tuple = ()
    skipped: str | None = None
    error: str | None = None
    events: int = 0  # the file's event count (the compact share is what the driver holds)


@dataclasses.dataclass
class ScaleResult:
    """What :func:`analyze` gives: ``breakdown`` (one row per rank and step, as ``breakdown(load(path))``),
    ``attribution`` (the compact rows of every rank with their contexts: pass it to ``match_collectives``,
    ``comm_calls``, ``p2p.match_p2p``, ``bubbles.rank_pipelines``), ``ranks``, ``files`` (file -> its ranks),
    ``metadata`` (per rank), ``warnings`` (also issued), ``skipped`` (files with no events -> what they are),
    ``failed`` (files that could not be read -> why), ``events`` (events read in all) and ``compact_events``
    (rows the driver holds)."""

    breakdown: pd.DataFrame
    attribution: object
    ranks: tuple[int, ...]
    files: dict[str, tuple[int, ...]]
    metadata: dict[int, dict]
    warnings: tuple[str, ...]
    skipped: dict[str, str]
    failed: dict[str, str]
    events: int
    compact_events: int


def analyze(path, *, executor: str = "local", address: str | None = None, workers: int | None = None,
            layout: Mapping[str, int] | None = None, keep_python: bool = False) -> ScaleResult:
    """Per-rank analysis of the trace set at ``path`` (a folder or one file, as ``load``) on ``executor``
    (:data:`EXECUTORS`; ``address``: the Ray or Dask cluster to use, default a local one; ``workers``: processes
    for ``local``, default the cores). See the module docstring."""

    if executor not in EXECUTORS:
        raise ExecutorError(f"executor={executor!r}: expected one of {', '.join(EXECUTORS)}")
    if layout is not None:
        check_layout(layout)
        layout = dict(layout)
    files = _discover(Path(path))
    folder = tempfile.mkdtemp(prefix="shardline-scale-")
    spill = (folder, socket.gethostname())
    try:
        with _executor(executor, address=address, workers=workers) as run:
            parts = run(map_file, [(str(file), layout, keep_python, None, spill) for file, _ in files])
            return _reduce(parts, layout=layout, keep_python=keep_python, run=run, spill=spill)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def map_file(job: tuple) -> RankPart:
    """The map of one trace file (see the module docstring), run in a worker: never raises for a bad file,
    whose ``RankPart.error`` says why instead. ``job``: ``(file, layout, keep_python, given, spill)``; ``given``
    None in the first map, else rank -> the ``matching.matched.RankPipeline`` the driver measured (the second
    map; the rank's attribution is given it as its ``Matching``);
    ``spill``: ``(folder, host)`` of the driver, or None. On the driver's host, the first map keeps the loaded
    table of a rank that may need the second one (it has p2p or pipelining rows) in ``folder``, and the
    second map reads it from there instead of the trace; a worker on another host reads the trace again."""
    file, layout, keep_python, given, spill = job

    kept = _kept_path(file, spill)
    if given is not None and kept is not None and kept.exists():
        ts, noted = pickle.loads(kept.read_bytes())
    else:
        try:
            with _warnings.catch_warnings(record=True) as caught:
                _warnings.simplefilter("always", TraceWarning)
                ts = loading.load(file, layout=layout, keep_python=keep_python)
        except (TraceFormatError, OSError) as exc:
            return RankPart(file=file, error=str(exc))
        noted = [str(w.message) for w in caught if issubclass(w.category, TraceWarning)]
        if given is None and kept is not None and _may_need_peers(ts.events):
            kept.write_bytes(pickle.dumps((ts, noted), protocol=5))
    part = RankPart(file=file, metadata=dict(ts.metadata), warnings=noted,
                    skipped=next(iter(ts.skipped.values()), None), events=len(ts.events))
    if not len(ts.events):
        return part
    # The single-table path's survey; the bubble, as a given matching: in the first map, the rank's own sl:pp
    # annotations only (the other sources need the other ranks); in the second, the driver's.
    survey = surveyed(ts, caller="analyze")
    pipelines = annotated_pipelines(survey) if given is None else given
    attribution = Attribution(survey, matching=Matching(pipelines=(pipelines, ())))
    with _warnings.catch_warnings(record=True) as caught:
        _warnings.simplefilter("always", TraceWarning)  # its notes go along (``RankPart.notes``)
        part.breakdown = attribution.breakdown
    part.notes = tuple(str(w.message) for w in caught if issubclass(w.category, TraceWarning))
    part.contexts = {rank.rank: rank.context for rank in survey.ranks}
    if given is None:
        part.compact = compact_rows(survey.events, {rank.rank: rank.lanes for rank in survey.ranks})
    return part


def _kept_path(file: str, spill) -> Path | None:
    """Where the first map keeps a file's loaded table for the second: None off the driver's host."""
    if spill is None or socket.gethostname() != spill[1]:
        return None
    return Path(spill[0]) / (hashlib.sha1(file.encode()).hexdigest() + ".pickle")


def _may_need_peers(events: pd.DataFrame) -> bool:
    """Whether some rank's bubble may be measured across ranks (p2p rows, or torch.distributed.pipelining's
    names), so that the second map may read this file again."""

    return bool(is_in(events["category"], P2P_CATEGORIES).any() or match_names(events["name"],
                                                                                THIRD_PARTY_PP_PATTERN).any())


def compact_rows(events: pd.DataFrame, lanes: Mapping[int, str]) -> pd.DataFrame:
    """The rows of a classified events table the cross-rank analyses read, in table order: a rank's work rows of
    the communication categories on the lanes it is attributed on (``lanes``: rank -> ``Lane`` value: its GPU
    kernels, or on a CPU rank its comm ops), on a GPU rank also its CPU p2p ops (where a p2p kernel's peer, size
    and group come from), the ``ProfilerStep#N`` markers and the pipeline annotations (``sl:pp:*`` and
    torch.distributed.pipelining's names)."""

    rank = events["rank"].to_numpy()
    gpu_rank = np.isin(rank, [r for r, lane in lanes.items() if lane == Lane.GPU.value])
    on_gpu = (events["lane"] == Lane.GPU.value).to_numpy()
    comm = is_in(events["category"], COMM_CATEGORIES)
    keep = comm & np.where(gpu_rank, on_gpu | is_in(events["category"], P2P_CATEGORIES), ~on_gpu)
    keep |= match_names(events["name"], rf"^ProfilerStep#\d+|^{PP_PREFIX}|{THIRD_PARTY_PP_PATTERN}")
    return events[keep].reset_index(drop=True)


def _reduce(parts: list[RankPart], *, layout, keep_python: bool, run, spill) -> ScaleResult:

    notes: list[str] = []
    failed = {p.file: p.error for p in parts if p.error is not None}
    for file, why in failed.items():
        notes.append(f"{file}: not analysed ({why}); the other files were")
    good = [p for p in parts if p.error is None]
    owner: dict[int, str] = {}
    files: dict[str, tuple[int, ...]] = {}
    metadata: dict[int, dict] = {}
    for part in good:
        notes += part.warnings
        ranks = tuple(sorted(part.contexts)) if part.contexts else tuple(sorted(part.metadata))
        files[part.file] = ranks
        for rank in ranks:
            if rank >= 0 and rank in owner:
                raise MixedJobsError(f"rank {rank} is in two files: {owner[rank]} and {part.file}")
            owner[rank] = part.file
        for rank, meta in part.metadata.items():
            metadata.setdefault(rank, {}).update(meta)
    notes += _missing_ranks(metadata, owner)
    contexts = {rank: ctx for part in good for rank, ctx in part.contexts.items()}
    # In rank order without a sort (a copy of every row): the files' parts by their lowest rank; each part's
    # rows are dropped once joined (``_concat`` frees their columns as it goes on big sets).
    shares = sorted((p for p in good if p.compact is not None and len(p.compact)), key=lambda p: min(p.contexts))
    compact = _concat([p.compact for p in shares])
    for p in shares:
        p.compact = None
    del shares
    rank_column = compact["rank"].to_numpy()
    if len(rank_column) and not (rank_column[1:] >= rank_column[:-1]).all():  # a file of several ranks
        compact = compact.sort_values("rank", kind="stable").reset_index(drop=True)
    # The single-table path over the compact rows: their survey (each rank's context from its whole trace),
    # its attribution, and the pipelines its matching measures.
    attribution = attribute(Survey(compact, layout=layout, files=dict(owner), metadata=metadata, contexts=contexts))
    given = {}
    if len(compact):
        measured, pipeline_notes = rank_pipelines(attribution)
        notes += pipeline_notes
        given = {r: p for r, p in measured.items() if p.method is not BubbleMethod.ANNOTATIONS}
    rows = {rank: part for part in good for rank in part.contexts if rank >= 0}
    results = {part.file: (part.breakdown, part.notes) for part in good}
    if given:  # the ranks whose bubble needs their peers: read again with the bubble the driver measured
        again = sorted({rows[r].file for r in given if r in rows})
        jobs = [(f, layout, keep_python, {r: p for r, p in given.items() if r in rows and rows[r].file == f}, spill)
                for f in again]
        for part in run(map_file, jobs):
            if part.error is not None:
                raise TraceFormatError(f"{part.file}: could not be read again ({part.error})")
            results[part.file] = (part.breakdown, part.notes)
    tables = []
    for part in sorted(good, key=lambda p: min(p.contexts, default=0)):
        table, part_notes = results[part.file]
        if table is not None:
            tables.append(table)
        notes += [n for n in part_notes if n not in notes]
    breakdown = pd.concat(tables, ignore_index=True).sort_values(["rank", "step"], kind="stable") \
        .reset_index(drop=True) if tables else empty_breakdown()
    for note in notes:
        _warnings.warn(note, TraceWarning, stacklevel=3)
    return ScaleResult(breakdown=breakdown, attribution=attribution, ranks=tuple(sorted(r for r in owner if r >= 0)),
                       files=files, metadata=metadata, warnings=tuple(notes),
                       skipped={p.file: p.skipped for p in good if p.skipped}, failed=failed,
                       events=sum(p.events for p in good), compact_events=len(compact))


def _missing_ranks(metadata: dict[int, dict], owner: dict[int, str]) -> list[str]:
    """A warning naming the ranks ``world_size`` says exist and no file holds."""
    sizes = {info.get("world_size") for meta in metadata.values()
             if isinstance(info := meta.get("distributedInfo"), dict)} - {None}
    sizes = {s for s in sizes if isinstance(s, int) and s > 0}
    if len(sizes) != 1:
        return []
    world = sizes.pop()
    missing = sorted(set(range(world)) - set(owner))
    if not missing:
        return []
    shown = ", ".join(map(str, missing[:20])) + (f" and {len(missing) - 20} more" if len(missing) > 20 else "")
    return [f"world_size is {world} but no file holds rank(s) {shown}: their rows are missing"]


# --- executors ----------------------------------------------------------------------------------------------

class _Executor:
    """``with executor as run: run(function, jobs) -> results`` (in the jobs' order); what it starts on entry
    (a local Dask cluster) it stops on exit."""

    def __enter__(self):
        return self.run

    def __exit__(self, *exc) -> None:
        return None

    def run(self, function: Callable, jobs: Sequence) -> list:
        raise NotImplementedError


class _Local(_Executor):
    """Forked processes on this machine (spawned where fork is not available), one file per task."""

    def __init__(self, workers: int | None) -> None:
        self.workers = workers

    def run(self, function, jobs):
        count = min(len(jobs), self.workers or os.cpu_count() or 1)
        if count <= 1:
            return [function(job) for job in jobs]
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods()
                                              else "spawn")
        with ProcessPoolExecutor(max_workers=count, mp_context=context) as pool:
            return list(pool.map(function, jobs, chunksize=1))


class _Ray(_Executor):
    """Ray tasks of one CPU each: ``ray.init(address=address)`` unless Ray is initialised already (an existing
    cluster is used as is: ``address="auto"`` or ``RAY_ADDRESS``; None starts a local instance, which stays up
    for the next call: ``ray.shutdown()`` stops it)."""

    def __init__(self, address: str | None) -> None:
        try:
            import ray
        except ImportError as exc:
            raise ExecutorError("executor='ray' needs Ray: pip install 'shardline[scale]' (or ray)") from exc
        self.ray, self.address = ray, address

    def __enter__(self):
        ray = self.ray
        if not ray.is_initialized():
            try:
                ray.init(address=self.address, include_dashboard=False, log_to_driver=False,
                         configure_logging=False)
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise ExecutorError(f"executor='ray': cannot reach the cluster at address={self.address!r} "
                                    f"({exc})") from exc
        return self.run

    def run(self, function, jobs):
        task = self.ray.remote(num_cpus=1)(function)
        return self.ray.get([task.remote(job) for job in jobs])


class _Dask(_Executor):
    """Dask tasks on the scheduler at ``address`` (``distributed.Client(address)``), else on a local cluster of
    ``workers`` single-threaded processes started for this call."""

    def __init__(self, address: str | None, workers: int | None) -> None:
        try:
            import distributed
        except ImportError as exc:
            raise ExecutorError("executor='dask' needs Dask's distributed: pip install 'shardline[scale]' "
                                "(or dask distributed)") from exc
        self.distributed, self.address, self.workers = distributed, address, workers
        self.client = self.cluster = None

    def __enter__(self):
        distributed = self.distributed
        try:
            if self.address is None:
                self.cluster = distributed.LocalCluster(n_workers=self.workers or os.cpu_count() or 1,
                                                        threads_per_worker=1, processes=True,
                                                        dashboard_address=None)
                self.client = distributed.Client(self.cluster)
            else:
                self.client = distributed.Client(self.address, timeout=f"{CONNECT_TIMEOUT_S}s")
        except (OSError, TimeoutError) as exc:
            self.__exit__()
            raise ExecutorError(f"executor='dask': cannot reach the scheduler at address={self.address!r} "
                                f"({exc})") from exc
        return self.run

    def __exit__(self, *exc) -> None:
        for thing in (self.client, self.cluster):
            if thing is not None:
                thing.close()
        self.client = self.cluster = None

    def run(self, function, jobs):
        return self.client.gather(self.client.map(function, list(jobs), pure=False))


def _executor(name: str, *, address: str | None, workers: int | None) -> _Executor:
    if name == "local":
        if address is not None:
            raise ExecutorError(f"address={address!r} names a Ray or Dask cluster: executor='local' has none")
        return _Local(workers)
    if name == "ray":
        return _Ray(address)
    return _Dask(address, workers)
