"""Kernel-to-op linking: the CPU op that launched each GPU kernel (``launching_op``: the innermost
communication op or annotation containing its launch, else the ``record_param_comms`` op with its External id),
the outer c10d op of each nested comm op, and a backend worker's run paired with the post it carries out
(``worker_span_pairs``: gloo, MPI, UCC)."""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass

import numpy as np
import pandas as pd

from ..base.schema import (
    category_texts,
    codes_or_end,
    sorted_categorical,
)
from .dims import group_keys
from .kinds import CATEGORY_CODE, CATEGORY_NAMES, COMM_CODES, NO_CATEGORY, P2P_CODES, Category, Lane
from .names import _per_category, match_names, op_category

#: The op columns a linked communication kernel takes where its own are missing.
_FILL_COLUMNS = ("collective", "pg_name", "pg_desc", "pg_ranks", "pg_size", "seq", "msg_bytes")


def _link_kernels_to_ops(ev: pd.DataFrame, category: np.ndarray, want: np.ndarray):
    """For rows in ``want``: (category code of the linked CPU comm op or ``NO_CATEGORY``, index of that op row
    or -1). ``category`` holds the rows' category codes; the op is ``launching_op``'s among the CPU comm rows,
    one with a specific category (not other_comm) preferred."""
    result = np.full(len(ev), NO_CATEGORY, dtype=np.int8)
    link = np.full(len(ev), -1, dtype=np.int64)
    if not want.any():
        return result, link
    ops = np.flatnonzero((ev["lane"] == Lane.CPU.value).to_numpy() & COMM_CODES[category])
    rows = np.flatnonzero(want)
    link[rows] = launching_op(ev, ops=ops, rows=rows, prefer=category != CATEGORY_CODE[Category.OTHER_COMM.value])
    linked = link >= 0
    result[linked] = category[link[linked]]
    return result, link


def launch_rows(events: pd.DataFrame, rows=None) -> np.ndarray:
    """For each of ``rows`` (positions in ``events`` or a boolean mask; default every row): the position of
    the row that launched it -- the first CPU row of its rank with its correlation id (the runtime call that
    Kineto's ``ac2g`` flow joins to a kernel, memcpy or memset) -- or -1 (no correlation id, no such row)."""
    rows = _positions(rows, len(events))
    out = np.full(len(rows), -1, dtype=np.int64)
    corr = events["correlation"].to_numpy()
    rows_with = np.flatnonzero(corr[rows] >= 0)
    if len(rows_with):
        launches = np.flatnonzero((events["lane"] == Lane.CPU.value).to_numpy() & (corr >= 0))
        out[rows_with] = _row_by_key(launches, events["rank"].to_numpy(), corr, queries=rows[rows_with],
                                     keep="first")
    return out


def launching_op(events: pd.DataFrame, *, ops, rows=None, prefer=None) -> np.ndarray:
    """For each of ``rows`` (positions in ``events`` or a boolean mask; default every row), the position of the
    op among ``ops`` (CPU rows: positions or a mask) that launched it -- the op it belongs to -- or -1. By
    evidence, strongest first:

    1. its launch: a GPU row's is ``launch_rows``'s, a CPU row is its own (so a CPU row among ``ops`` is its own
       op). The op is the innermost of ``ops`` holding the launch on its thread: same rank and stream,
       ``op.start <= launch.start`` and ``launch.end <= op.end``; of ops that start together the shorter is the
       inner one. ``prefer`` (a boolean per events row): the innermost preferred op holding the launch wins
       over inner ones that are not preferred; ops that are not are tried only where no preferred one holds it.
    2. where that finds none, its External id (recent Kineto gives a kernel its launching op's): the last op of
       its rank with that id, if it began no later than the row (old Kineto reuses a kernel's correlation id
       as its External id, which can equal a later op's).

    Every caller that needs "the op of this kernel" asks here: the classifier (a kernel's collective and group
    from its comm op), calibration (a GEMM's shapes), ``collective_bandwidth`` (a call's size args) and
    ``report_sections.comm_coverage``. Vectorised: a sorted search per (rank, thread) holding ops, then a walk
    back over the earlier ops only while one of them still reaches the launch."""
    rows = _positions(rows, len(events))
    ops = np.unique(_positions(ops, len(events)))
    out = np.full(len(rows), -1, dtype=np.int64)
    if not len(rows) or not len(ops):
        return out
    rank, stream = events["rank"].to_numpy(), events["stream"].to_numpy()
    start = events["start_ns"].to_numpy()
    dur = events["dur_ns"].to_numpy()
    cpu = (events["lane"] == Lane.CPU.value).to_numpy()
    point = np.where(cpu[rows], rows, launch_rows(events, rows))
    has = np.flatnonzero(point >= 0)
    for allowed in ((ops[np.asarray(prefer)[ops]],) if prefer is not None else ()) + (ops,):
        todo = has[out[has] < 0]
        if len(todo) and len(allowed):
            out[todo] = _innermost(allowed, point[todo], rank=rank, stream=stream, start=start, dur=dur)
    ext = events["external_id"].to_numpy()
    rest = np.flatnonzero((out < 0) & (ext[rows] >= 0))
    if len(rest):
        hit = _row_by_key(ops[ext[ops] >= 0], rank, ext, queries=rows[rest], keep="last")
        ok = hit >= 0
        ok[ok] = start[hit[ok]] <= start[rows[rest[ok]]]
        out[rest[ok]] = hit[ok]
    return out


def _positions(rows, n: int) -> np.ndarray:
    if rows is None:
        return np.arange(n, dtype=np.int64)
    rows = np.asarray(rows)
    return np.flatnonzero(rows) if rows.dtype == bool else rows.astype(np.int64, copy=False)


def _row_by_key(rows: np.ndarray, rank: np.ndarray, key: np.ndarray, *, queries: np.ndarray,
                keep: str) -> np.ndarray:
    """For each query row: the row among ``rows`` (ascending) with the same rank and key -- the first or the
    last of several -- or -1. Per rank, a sorted search (no hashing of (rank, key) pairs)."""
    out = np.full(len(queries), -1, dtype=np.int64)
    q_rank = rank[queries]
    for r in np.unique(q_rank):
        mine = rows[rank[rows] == r]
        if not len(mine):
            continue
        order = np.argsort(key[mine], kind="stable")  # equal keys stay in row order
        keys, owners = key[mine][order], mine[order]
        q = np.flatnonzero(q_rank == r)
        wanted = key[queries[q]]
        pos = np.searchsorted(keys, wanted, side="left" if keep == "first" else "right")
        if keep != "first":
            pos -= 1
        ok = (pos >= 0) & (pos < len(keys))
        ok[ok] = keys[pos[ok]] == wanted[ok]
        out[q[ok]] = owners[pos[ok]]
    return out


def _innermost(ops: np.ndarray, points: np.ndarray, *, rank, stream, start, dur) -> np.ndarray:
    """Position of the innermost op of ``ops`` holding each point row (same rank and thread), or -1.

    Per thread the ops are sorted by start (the longer first among equal starts, so a parent precedes its
    child); the innermost holder of a point is the last op at or before the point's start that ends no earlier
    than the point. Candidates are walked back one op at a time, only for points that some earlier op still
    reaches (the running maximum of the ends): one step where ops nest or follow each other, a few more past
    the earlier children of a parent."""
    out = np.full(len(points), -1, dtype=np.int64)
    end = start + dur
    order = ops[np.lexsort((-dur[ops], start[ops], stream[ops], rank[ops]))]
    r_sorted, s_sorted = rank[order], stream[order]
    change = np.flatnonzero((r_sorted[1:] != r_sorted[:-1]) | (s_sorted[1:] != s_sorted[:-1])) + 1
    for group in np.split(order, change):
        sel = np.flatnonzero((rank[points] == rank[group[0]]) & (stream[points] == stream[group[0]]))
        if not len(sel):
            continue
        g_start, g_end = start[group], end[group]
        reach = np.maximum.accumulate(g_end)
        p_start, p_end = start[points[sel]], end[points[sel]]
        cand = np.searchsorted(g_start, p_start, side="right") - 1
        todo = np.flatnonzero(cand >= 0)
        while len(todo):
            c = cand[todo]
            live = reach[c] >= p_end[todo]  # else no op at or before c holds the point
            todo, c = todo[live], c[live]
            hit = g_end[c] >= p_end[todo]
            out[sel[todo[hit]]] = group[c[hit]]
            todo = todo[~hit]
            cand[todo] -= 1
            todo = todo[cand[todo] >= 0]
    return out


#: How many comm ops after a c10d op (by start, on its thread) ``_link_outer_ops`` looks through for its record.
_NESTED_LOOKAHEAD = 4


def _link_outer_ops(out: pd.DataFrame, category: np.ndarray) -> np.ndarray:
    """Per row: for a CPU communication op without a process group (``c10d::allreduce_`` and friends: torch
    records the group, its seq and sizes on the ``record_param_comms`` op inside it), the communication op right
    inside it on its thread (the first of the next :data:`_NESTED_LOOKAHEAD` by start) that has a group and names
    the outer op's collective; -1 elsewhere. Without it the outermost op, the one a CPU-lane rank's calls are
    matched by, had no group: every group's calls fell into one anonymous group matched by order."""
    link = np.full(len(out), -1, dtype=np.int64)
    rows = np.flatnonzero(COMM_CODES[category] & (out["lane"] != Lane.GPU.value).to_numpy())
    if len(rows) < 2:
        return link
    start = out["start_ns"].to_numpy()[rows].astype(np.int64)
    end = start + out["dur_ns"].to_numpy()[rows].astype(np.int64)
    rank, stream = out["rank"].to_numpy()[rows], out["stream"].to_numpy()[rows]
    order = np.lexsort((start - end, start, stream, rank))  # by thread, then start; an enclosing op first
    rows, start, end, rank, stream = rows[order], start[order], end[order], rank[order], stream[order]
    group = ((out["pg_name"].iloc[rows].astype(str).to_numpy() != "")
             | (out["pg_ranks"].iloc[rows].astype(str).to_numpy() != ""))
    # The inner op's own collective must be the outer op's category: a c10d op may hold another call's record
    # (a helper group's, one op of a batch of sends and receives), whose group and seq are not its own.
    said = np.array([CATEGORY_CODE.get(c, NO_CATEGORY) for c in _per_category(out["collective"], op_category)],
                    dtype=np.int8)[codes_or_end(out["collective"])[rows]]
    want = category[rows]
    for ahead in range(_NESTED_LOOKAHEAD, 0, -1):  # the nearest qualifying op inside wins: it is written last
        outer, inner = slice(0, -ahead), slice(ahead, None)
        hit = ((rank[outer] == rank[inner]) & (stream[outer] == stream[inner]) & (start[inner] >= start[outer])
               & (end[inner] <= end[outer]) & ~group[outer] & group[inner] & (said[inner] == want[outer]))
        link[rows[:-ahead][hit]] = rows[ahead:][hit]
    return link


#: The backend's own record of running a call (ProcessGroupGloo / MPI / UCC): on a worker thread of the backend
#: when the call was posted from another thread (a collective), inside the posting op when run inline (a send).
WORKER_SPAN_RE = r"^(gloo|mpi|ucc):"


#: Any backend's own span: a worker-capable one, or NCCL's/RCCL's ``nccl:*`` (always inside its op).
BACKEND_SPAN_RE = r"^(gloo|mpi|ucc|nccl|rccl):"


#: A run may carry out a post of another collective: gloo runs ``reduce_scatter_tensor`` as one all-reduce.
RUN_SERVES = {"all_reduce": ("all_reduce", "reduce_scatter")}


#: How many of the oldest unpaired posts a worker run may be paired with (the posts of other groups' queues that
#: ran later lie among them)
_POST_WINDOW = 64


def _on_thread(stream: np.ndarray, start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row: (nested: inside an earlier row of its thread -- ``c10d op > record_param_comms > gloo:*``; of rows
    that start together the longer holds the other; begun: it starts inside an earlier row of its thread, as a
    nested row and a transport span that outlasts its op do; the outermost row holding that start, or -1)."""
    n = len(start)
    nested, begun, holder = np.zeros(n, dtype=bool), np.zeros(n, dtype=bool), np.full(n, -1, dtype=np.int64)
    if n < 2:
        return nested, begun, holder
    order = np.lexsort((start - end, start, stream))  # by thread, then start; an enclosing row first
    thread, first, finish = stream[order], start[order], end[order]
    reach = pd.Series(finish).groupby(thread).cummax().to_numpy()  # the furthest end so far on the thread
    same = np.concatenate([[False], thread[1:] == thread[:-1]])
    before = np.concatenate([[np.iinfo(np.int64).min], reach[:-1]])
    nested[order] = same & (finish <= before)
    inside = same & (first < before)  # starts while an earlier row of the thread is still running
    # the outermost rows (not inside any earlier one) in sorted order; each row's is the last one at or before it
    outer = np.flatnonzero(~inside)
    last_outer = outer[np.searchsorted(outer, np.arange(n), side="right") - 1]
    begun[order] = inside
    holder[order[inside]] = order[last_outer[inside]]
    return nested, begun, holder


def worker_span_pairs(rank: np.ndarray, stream: np.ndarray, start: np.ndarray, end: np.ndarray,
                      category: np.ndarray, names: np.ndarray, group: np.ndarray, *,
                      launched: np.ndarray | None = None) -> WorkerSpans:
    """A collective posted on one thread and run on a backend worker thread is two CPU rows: the posting op
    (``c10d::allreduce_``, microseconds) and the backend's span (``gloo:all_reduce`` on the process group's worker
    thread, the whole run). The arrays describe CPU communication rows (all of them, nested ones included);
    ``category`` holds category names, ``names`` per row 0 (an op), 1 (a worker-capable backend span,
    :data:`WORKER_SPAN_RE`) or 2 (another backend's span, ``nccl:*``); ``group`` is a group key ("" for none).

    - A backend span that starts inside an op on its own thread is that op's transport (a gloo send or receive,
      NCCL's ``nccl:*``), even where it outlasts the op (an ``irecv``'s lifetime): the op is the call.
    - A worker-capable span that starts inside no op of its thread is a run posted from another thread. Its post:
      the earliest unpaired outermost op of its rank, on another thread, started no later than the run, whose
      collective the run can carry out (the same, or one of :data:`RUN_SERVES`), and that holds no backend span of
      its own nor launched a GPU kernel (``launched``: the op, or one inside it on its thread, that a communication
      kernel was launched from; such an op, an NCCL call, is complete) -- taken in the runs' start order, as a
      process group's queue runs its posts in order. Where posts carry groups, a worker thread serves one
      process group, so once a thread's run is paired with a group's post its later runs take that group's
      posts first. A run that found no post, after a paired reduce-scatter, is one of its further runs (gloo's list
      ``reduce_scatter`` posts one all-reduce per rank: :func:`_extra_runs`). Limits: the first run of a thread
      takes the oldest ready post, which may be another group's whose own worker is busy; a run looks at the
      :data:`_POST_WINDOW` oldest unpaired posts only."""
    n = len(start)
    empty = np.zeros(0, dtype=np.int64)
    nested, begun, holder = _on_thread(np.asarray(stream), start, end)
    if not (names > 0).any():
        return WorkerSpans(nested, empty, empty, empty, empty, empty)
    backend = names > 0
    transports = np.flatnonzero(backend & begun)
    # ops holding a backend span on their thread ran it inline: complete calls, no worker's posts
    complete = np.zeros(n, dtype=bool)
    complete[holder[transports]] = True
    if launched is not None:
        complete |= launched
        inner = np.flatnonzero(launched & begun)
        complete[holder[inner]] = True
    runs = np.flatnonzero((names == 1) & ~begun)
    posts = np.flatnonzero(~backend & ~begun & ~complete)
    if not len(runs) or not len(posts):
        return WorkerSpans(nested, empty, empty, transports, empty, empty)
    waiting: dict[tuple, collections.deque[int]] = {}
    for p in posts[np.lexsort((start[posts], rank[posts]))].tolist():
        waiting.setdefault((rank[p], category[p]), collections.deque()).append(p)
    served: dict[tuple, str] = {}  # (rank, worker thread) -> the group its first paired post named
    out_runs, out_posts = [], []
    for x in runs[np.argsort(start[runs], kind="stable")].tolist():
        ready = []  # (post start, queue, index in it) of the posts this run may carry out
        for kind in RUN_SERVES.get(category[x], (category[x],)):
            queue = waiting.get((rank[x], kind))
            if queue:
                ready += [(start[p], queue, i) for i, p in enumerate(itertools.islice(queue, _POST_WINDOW))
                          if start[p] <= start[x] and stream[p] != stream[x]]
        if not ready:
            continue
        ready.sort(key=lambda item: item[0])
        want = served.get((rank[x], stream[x]))
        _, queue, i = next((r for r in ready if want is not None and group[r[1][r[2]]] == want), ready[0])
        p = queue[i]
        del queue[i]
        if group[p] != "":
            served.setdefault((rank[x], stream[x]), group[p])
        out_runs.append(x)
        out_posts.append(p)
    extra_runs, extra_posts = _extra_runs(rank, stream, start, category, runs, posts, out_runs, out_posts)
    return WorkerSpans(nested, np.array(out_runs, dtype=np.int64), np.array(out_posts, dtype=np.int64), transports,
                       extra_runs, extra_posts)


def _extra_runs(rank, stream, start, category, runs, posts, out_runs, out_posts) -> tuple[np.ndarray, np.ndarray]:
    """The unpaired runs that are a paired post's further runs: gloo's list ``reduce_scatter`` posts one all-reduce
    per rank, so an all-reduce run that found no post, and whose rank's latest post before it (on another thread)
    is a paired reduce-scatter, is that post's. Positions of the runs and of their posts."""
    paired = set(out_runs)
    lone = [x for x in runs.tolist() if x not in paired and category[x] in RUN_SERVES["all_reduce"]]
    multi = {p for p in out_posts if category[p] == "reduce_scatter"}
    if not lone or not multi:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    by_rank: dict = {}
    for p in posts[np.argsort(start[posts], kind="stable")].tolist():
        by_rank.setdefault(rank[p], []).append(p)
    extra_runs, extra_posts = [], []
    for x in lone:
        mine = [p for p in by_rank.get(rank[x], []) if start[p] <= start[x] and stream[p] != stream[x]]
        if mine and mine[-1] in multi:
            extra_runs.append(x)
            extra_posts.append(mine[-1])
    return np.array(extra_runs, dtype=np.int64), np.array(extra_posts, dtype=np.int64)


@dataclass(frozen=True)
class WorkerSpans:
    """:func:`worker_span_pairs`' answer: per row whether it is nested in an earlier row of its thread; and
    positions in its arrays of each paired run and its post, of the backend spans that are their op's transport,
    and of a post's further runs with their posts (:func:`_extra_runs`; neither is a call)."""

    nested: np.ndarray
    runs: np.ndarray
    posts: np.ndarray
    transports: np.ndarray
    extra_runs: np.ndarray
    extra_posts: np.ndarray


def span_kinds(names: pd.Series) -> np.ndarray:
    """Per row of a categorical name column: 0 (not a backend span), 1 (``gloo:*``/``mpi:*``/``ucc:*``), 2 (``nccl:*``,
    ``rccl:*``), for :func:`worker_span_pairs`."""
    return np.where(match_names(names, WORKER_SPAN_RE), 1, np.where(match_names(names, BACKEND_SPAN_RE), 2, 0))


def _link_worker_spans(out: pd.DataFrame, category: np.ndarray, launched: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row: for a backend span run on a worker thread (:func:`worker_span_pairs`), the op that posted it, so
    that the run -- which the calls are matched by -- takes the post's group, seq and sizes; -1 elsewhere (and
    where the run has its own). Also ``category`` with each paired run given its post's collective (gloo's
    all-reduce that carries out a ``reduce_scatter_tensor`` is that reduce-scatter)."""
    link = np.full(len(out), -1, dtype=np.int64)
    rows = np.flatnonzero(COMM_CODES[category] & ~P2P_CODES[category] & (out["lane"] != Lane.GPU.value).to_numpy())
    if len(rows) < 2:
        return link, category
    kinds = span_kinds(out["name"])[rows]
    if not (kinds == 1).any():
        return link, category
    start = out["start_ns"].to_numpy()[rows].astype(np.int64)
    end = start + out["dur_ns"].to_numpy()[rows].astype(np.int64)
    group = group_keys(out["pg_name"].iloc[rows], out["pg_ranks"].iloc[rows])
    names = np.array(CATEGORY_NAMES + ("",), dtype=object)[category[rows]]
    found = worker_span_pairs(out["rank"].to_numpy()[rows], out["stream"].to_numpy()[rows], start, end, names, kinds,
                              group, launched=launched[rows])
    runs = rows[np.concatenate([found.runs, found.extra_runs])]
    posts = rows[np.concatenate([found.posts, found.extra_posts])]
    link[runs] = posts
    if (category[runs] != category[posts]).any():
        category = category.copy()
        category[runs] = category[posts]
    return link, category


def _fill_from_ops(out: pd.DataFrame, link: np.ndarray) -> None:
    """Copy the linked row's collective/process-group columns onto each linked row (a kernel: from its op; an
    outer op: from the op inside it) where that row lacks them."""
    rows = np.flatnonzero(link >= 0)
    if not len(rows):
        return
    src = link[rows]
    for column in _FILL_COLUMNS:
        values = out[column]
        if isinstance(values.dtype, pd.CategoricalDtype):
            # On the codes: "" is a category like any other; the result keeps the used values, sorted.
            vocabulary = [*category_texts(values.dtype.categories), ""]
            codes = codes_or_end(values).astype(np.int32)  # a copy: the column itself is replaced below
            _dedupe(vocabulary, codes)
            empty = vocabulary.index("")
            missing = (codes[rows] == empty) & (codes[src] != empty)
            if not missing.any():  # every linked kernel has its own (or its op has none): the column stays
                continue
            codes[rows[missing]] = codes[src[missing]]
            out[column] = sorted_categorical(codes, vocabulary)
        else:
            current = values.to_numpy()
            missing = (current[rows] < 0) & (current[src] >= 0)
            if not missing.any():
                continue
            current = current.copy()
            current[rows[missing]] = current[src[missing]]
            out[column] = current.astype(values.dtype)


def _dedupe(vocabulary: list, codes: np.ndarray) -> None:
    """Rewrite ``codes`` so repeated texts in ``vocabulary`` (a "" category and the missing slot; 0 and "0")
    use the first code: equal texts become one category."""
    first: dict = {}
    remap = np.array([first.setdefault(text, i) for i, text in enumerate(vocabulary)], dtype=np.int32)
    if (remap != np.arange(len(vocabulary))).any():
        codes[:] = remap[codes]
