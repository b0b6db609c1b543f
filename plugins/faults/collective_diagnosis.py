"""From every rank's collective record to one verdict: who is dead or hung, in which groups, and where each
rank was. Pure: plain values in (the JSON summaries of :mod:`.collective_record`), a :class:`Verdict` out.

The rules, in order:

* **dead**: a rank that did not answer the abort (no final record within the answer window) and had not
  finished; its record is its last heartbeat's.
* **raised**: the abort came from a rank whose own code raised something other than a collective error; it is
  the cause.
* **hung**: in a group where some rank waits inside a collective (in flight, or it failed), a member that never
  entered that collective (its last entered sequence number is lower) while it is itself inside no collective
  is hung: stuck in Python or compute, or in a call that never reached the backend. A member that is behind
  because it waits in another group is a consequence, not a cause.
* **stuck**: every member of a group entered the same collective and none completed it (a backend or network
  fault, or a mismatch inside the collective): the group is named, no rank.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from shardline.plugins.grid import AXES, COMBINED_AXES

_AXIS_ORDER = {axis: i for i, axis in enumerate(AXES + COMBINED_AXES + ("world",))}
_REASON_CHARS = 300
_COLLECTIVE_MARKERS = ("gloo", "nccl", "connection closed", "connection reset", "timed out", "broken pipe",
                       "application timeout", "pair closure", "processgroup", "c10d", "socket")


@dataclass(frozen=True)
class RankReport:
    """What the composer knows of one rank. ``source``: ``"final"`` (it answered the abort with a fresh record),
    ``"heartbeat"`` (only its last heartbeat's record) or ``"none"`` (never heard of). ``state``: ``"running"``,
    ``"failed"`` (its main thread raised) or ``"stopped"`` (it had finished). ``silent_s``: seconds since its last
    heartbeat, for a rank that did not answer."""

    rank: int
    source: str
    state: str = "running"
    groups: tuple = ()
    error: str | None = None
    silent_s: float | None = None


@dataclass(frozen=True)
class Verdict:
    """The diagnosis: ``kind`` is ``dead``, ``raised``, ``hung``, ``stuck`` or ``unknown``; ``culprits`` the
    ranks named; ``groups`` the labels of the groups shown; ``message`` the one text every rank raises."""

    kind: str
    culprits: tuple[int, ...]
    groups: tuple[str, ...]
    message: str
    rows: dict = field(default_factory=dict)  # label -> rank -> (entered, completed) as shown
    #: the one rank that prints the error for all (the others log theirs): the rank whose own code raised, else
    #: the lowest rank not named; None where each rank has only its own verdict (the store was lost)
    speaker: int | None = None

    def speaks(self, rank: int) -> bool:
        """Whether ``rank`` prints this verdict (every rank does with a verdict of its own)."""
        return self.speaker is None or self.speaker == rank

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Verdict:
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, data: dict) -> Verdict:
        return cls(kind=data["kind"], culprits=tuple(data["culprits"]), groups=tuple(data["groups"]),
                   message=data["message"], rows=data.get("rows", {}), speaker=data.get("speaker"))


def short_reason(text: str) -> str:
    """The first line of an error text, at most 300 characters."""
    line = (text or "").strip().splitlines()[0] if (text or "").strip() else ""
    return line if len(line) <= _REASON_CHARS else line[:_REASON_CHARS - 3] + "..."


def _resolve(reports: dict[int, RankReport]) -> dict[str, dict]:
    """``{label: {"ref": first summary, "rows": {rank: summary}}}`` with every op named where any member knows
    the name of that sequence number (collectives run in the same order on every member of a group)."""
    names: dict[str, dict[int, str]] = {}
    for report in reports.values():
        for g in report.groups:
            for seq, op in (g.get("recent") or {}).items():
                names.setdefault(g["group"], {})[int(seq)] = op
    groups: dict[str, dict] = {}
    for rank, report in sorted(reports.items()):
        for g in report.groups:
            g = dict(g)
            for key in ("entered", "completed", "failed", "started"):
                ref = g.get(key)
                if ref is None:
                    continue
                ref = dict(ref)
                if ref.get("seq") is None and g.get("ids_are_seqs"):
                    ref["seq"] = ref["id"]
                if ref.get("op") is None and ref.get("seq") is not None:
                    ref["op"] = names.get(g["group"], {}).get(ref["seq"])
                g[key] = ref
            entry = groups.setdefault(g["group"], {"ref": g, "rows": {}})
            entry["rows"][rank] = g
    return groups


def _seq(row: dict | None, key: str = "entered") -> int:
    ref = None if row is None else row.get(key)
    if ref is None:
        return 0
    return ref["seq"] if ref.get("seq") is not None else ref["id"]


def _waiting(row: dict) -> bool:
    return row.get("in_flight_s") is not None or row.get("failed") is not None


def _hung(groups: dict, reports: dict[int, RankReport]) -> tuple[list[int], list[str]]:
    waiting_ranks = {r for g in groups.values() for r, row in g["rows"].items() if _waiting(row)}
    hung, where = set(), []
    for label, g in groups.items():
        rows = g["rows"]
        if not any(_waiting(row) for row in rows.values()):
            continue
        top = max(_seq(row) for row in rows.values())
        behind = [r for r in g["ref"]["ranks"] if _seq(rows.get(r)) < top and r in reports]
        idle = [r for r in behind if r not in waiting_ranks]
        if idle:
            hung.update(idle)
            where.append(label)
    return sorted(hung), where


def _stuck(groups: dict) -> list[str]:
    out = []
    for label, g in groups.items():
        rows = g["rows"]
        members = g["ref"]["ranks"]
        if len(rows) == len(members) and all(_waiting(row) for row in rows.values()) and \
                len({_seq(row) for row in rows.values()}) == 1:
            out.append(label)
    return out


def _order(label: str, groups: dict) -> tuple:
    ref = groups[label]["ref"]
    return _AXIS_ORDER.get(ref["axis"], len(_AXIS_ORDER)), ref["index"] if ref["index"] is not None else 0, label


def _fmt(ref: dict | None) -> str:
    if ref is None:
        return "nothing"
    if ref.get("seq") is None:
        return f"({ref.get('op') or '?'}, op id {ref['id']})"
    return f"({ref.get('op') or '?'}, {ref['seq']})"


def _row_text(rank: int, row: dict | None, report: RankReport | None, culprits: set[int], kind: str) -> str:
    if row is None:
        return f"rank {rank}: no record of this group"
    entered = row["failed"] if row.get("failed") is not None else row.get("entered")
    tags = []
    if row.get("failed") is not None:
        tags.append("failed")
    elif row.get("in_flight_s") is not None:
        tags.append(f"in flight {row['in_flight_s']:.1f} s")
    if report is not None and report.source == "heartbeat":
        tags.append("as of its last heartbeat")
    if rank in culprits:
        tags.append(kind)
    if report is not None and report.state == "stopped":
        tags.append("finished")
    tail = f"  [{', '.join(tags)}]" if tags else ""
    return f"rank {rank}: entered {_fmt(entered)}, completed {_fmt(row.get('completed'))}{tail}"


def _headline(kind: str, culprits: list[int], groups: dict, reports: dict, trigger: dict, where: list[str],
              timeout_s: float) -> str:
    by, reason = trigger.get("by"), short_reason(trigger.get("reason", ""))
    noticed = f"first noticed by rank {by}: {reason}" if reason else f"first noticed by rank {by}"
    who = f"rank {culprits[0]}" if len(culprits) == 1 else f"ranks {','.join(map(str, culprits))}"
    if kind == "dead":
        silent = [reports[r].silent_s for r in culprits if reports[r].silent_s is not None]
        since = f"no heartbeat for {max(silent):.1f} s, " if silent else ""
        verb = "is" if len(culprits) == 1 else "are"
        return f"{who} {verb} dead ({since}no answer to the abort); {noticed}"
    if kind == "raised":
        error = short_reason(reports[culprits[0]].error or trigger.get("reason", "")) if culprits[0] in reports \
            else reason
        return f"{who} raised {error}; the other ranks were stopped"
    if kind == "hung":
        label = where[0]
        rows = groups[label]["rows"]
        waiter = max((r for r, row in rows.items() if _waiting(row)), key=lambda r: rows[r].get("in_flight_s") or 0)
        op = rows[waiter].get("failed") or rows[waiter]["entered"]
        return (f"{who} hung: never entered {_fmt(op)} of {label}, which rank {waiter} entered and waited in "
                f"(collective timeout {timeout_s:g} s), and is inside no collective (its heartbeat went on: "
                f"stuck in Python or compute, or in a call that never reached the backend); {noticed}")
    if kind == "stuck":
        label = where[0]
        row = next(iter(groups[label]["rows"].values()))
        return (f"every rank of {label} entered {_fmt(row.get('failed') or row['entered'])} and none completed it "
                f"within the collective timeout ({timeout_s:g} s); {noticed}")
    return f"collectives stopped and no rank could be named; {noticed}"


def diagnose(reports: dict[int, RankReport], *, trigger: dict, world_size: int, dump_dir: str,
             timeout_s: float) -> Verdict:
    """The verdict from every rank's report (``reports[r]``; ranks never heard of may be absent) and the abort
    that started it (``trigger``: ``by``, ``kind``, ``reason``). The message shows, for each rank of each group
    shown, the last collective entered and completed: the culprits' groups in which some rank waits or failed
    (all their groups that carried a collective when none does), or the stuck groups."""
    reports = {r: reports.get(r, RankReport(r, "none")) for r in range(world_size)}
    groups = _resolve(reports)
    dead = [r for r, rep in reports.items() if rep.source != "final" and rep.state != "stopped"]
    where: list[str] = []
    if dead:
        kind, culprits = "dead", dead
    elif trigger.get("kind") == "exception" and trigger.get("by") in reports:
        kind, culprits = "raised", [trigger["by"]]
    else:
        culprits, where = _hung(groups, reports)
        kind = "hung" if culprits else "unknown"
        if not culprits:
            where = _stuck(groups)
            kind = "stuck" if where else "unknown"
    if kind in ("dead", "raised", "hung"):
        # The culprits' groups in which some rank waits or failed; all their active groups if none does.
        theirs = [label for label, g in groups.items() if set(g["ref"]["ranks"]) & set(culprits)
                  and any(_seq(row) > 0 for row in g["rows"].values())]
        shown = [label for label in theirs if any(_waiting(row) for row in groups[label]["rows"].values())] \
            or theirs
    else:
        shown = list(where)
    shown.sort(key=lambda label: _order(label, groups))
    where.sort(key=lambda label: _order(label, groups))
    lines = [_headline(kind, culprits, groups, reports, trigger, where, timeout_s)]
    rows: dict[str, dict] = {}
    if shown:
        lines.append("Process groups (last collective entered, completed on each rank, as (op, seq)):")
    for label in shown:
        g = groups[label]
        lines.append(f"  {label}")
        rows[label] = {}
        for rank in g["ref"]["ranks"]:
            row = g["rows"].get(rank)
            lines.append("    " + _row_text(rank, row, reports.get(rank), set(culprits), kind))
            if row is not None:
                rows[label][str(rank)] = [_fmt(row.get("failed") or row.get("entered")), _fmt(row.get("completed"))]
    in_shown = {r for label in shown for r in groups[label]["ref"]["ranks"]}
    others = [_elsewhere(r, groups, reports[r]) for r in range(world_size) if r not in in_shown]
    if others:
        lines.append("Other ranks: " + "; ".join(others))
    lines.append(f"Each rank's collective record: {dump_dir}/rank<N>.json (written on that rank's host).")
    speaker = culprits[0] if kind == "raised" else min(set(range(world_size)) - set(culprits), default=None)
    return Verdict(kind=kind, culprits=tuple(culprits), groups=tuple(shown), message="\n".join(lines), rows=rows,
                   speaker=speaker)


def _elsewhere(rank: int, groups: dict, report: RankReport) -> str:
    if report.state == "stopped":
        return f"rank {rank} had finished"
    if report.source != "final":
        return f"rank {rank} did not answer (its last heartbeat {report.silent_s or 0:.1f} s before)"
    waits = sorted(((label, g["rows"][rank]) for label, g in groups.items()
                    if rank in g["rows"] and _waiting(g["rows"][rank])), key=lambda lr: _order(lr[0], groups))
    if not waits:
        return f"rank {rank} inside no collective"
    label, row = waits[0]
    state = "failed in" if row.get("failed") is not None else "waiting in"
    return f"rank {rank} {state} {label} at {_fmt(row.get('failed') or row['entered'])}"


def local_verdict(rank: int, groups: list[dict], *, reason: str, dump_dir: str) -> Verdict:
    """The verdict of a rank that cannot reach the others (the store is gone): what it knows of itself."""
    resolved = _resolve({rank: RankReport(rank, "final", groups=tuple(groups))})
    labels = sorted(resolved, key=lambda label: _order(label, resolved))
    lines = [f"rank {rank} cannot reach the other ranks: {short_reason(reason)}; no rank could be named",
             f"Rank {rank}'s process groups (last collective entered, completed, as (op, seq)):"]
    lines += [f"  {label}\n    " + _row_text(rank, resolved[label]["rows"][rank], None, set(), "unknown")
              for label in labels]
    lines.append(f"Each rank's collective record: {dump_dir}/rank<N>.json (written on that rank's host).")
    return Verdict(kind="unknown", culprits=(), groups=tuple(labels), message="\n".join(lines))


def is_collective_error(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it was raised from) is a failed collective: a DistError, or a RuntimeError whose
    text carries a backend's marks (gloo's "Connection closed by peer", "Timed out", NCCL's errors)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if any(cls.__name__ == "DistError" for cls in type(exc).__mro__) or (
                isinstance(exc, RuntimeError) and any(m in str(exc).lower() for m in _COLLECTIVE_MARKERS)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False
