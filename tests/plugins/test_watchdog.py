"""Dead and hung ranks are named (issue 17, requirement 7): a rank that dies (SIGKILL) or hangs inside a
collective makes every other rank stop within collective_timeout + 15 s with one CollectiveError naming the
rank(s), the groups by layout axis and the last collective each rank entered and completed; every rank dumps
its record; no process is left running. Real gloo ranks, a real Trainer; plus the pure diagnosis."""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import json
import multiprocessing as mp
import os
import re
import signal
import time
from pathlib import Path

import psutil
import pytest
import pytorch_lightning as pl
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from shardline.plugins.errors import CollectiveError, ContractError
from shardline.plugins.faults.collective_diagnosis import (
    RankReport,
    Verdict,
    diagnose,
    is_collective_error,
    local_verdict,
)
from shardline.plugins.faults.collective_record import (
    TEST_HANG_ENV,
    CallRecord,
    FlightRecorderRecord,
    GroupRef,
    InjectedHang,
    Interposer,
    format_ranks,
    group_refs,
    summary,
)
from shardline.plugins.faults.watchdog import EXIT_CODE, Timing
from shardline.plugins.grid import Grid, ParallelDims
from shardline.plugins.lightning.strategy import HybridParallelStrategy
from shardline.plugins.testing import adopt_process_group_in_lightning, run_ranks
from shardline.recipes.lit_gpt import GPTModule

# collective_timeout of these runs (s): short, so the suite stays fast, yet longer than the ranks of a loaded
# 2-core machine drift apart during setup (5 s was not: a slow rank's setup then counts as a hang, rightly).
TIMEOUT = 10.0
BUDGET = TIMEOUT + 15.0  # the bound on the time from the failure to every rank gone
SEQ, VOCAB, BATCH = 16, 64, 8
MODEL = dict(vocab_size=VOCAB, seq_len=SEQ, n_layer=2, n_head=4, d_model=32, lr=3e-3, warmup_steps=3,
             tie_embeddings=False)
# World 4 as tp2 x dp2: tp groups [0,1] [2,3]; ZeRO reduces over the dp_cp groups [0,2] [1,3].
LAYOUT = dict(tp=2)
VICTIM = 3
ROW = re.compile(r"^ {4}rank (\d+): entered \((\w+), (\d+)\), completed \((\w+), (\d+)\)(.*)$")


# --- the harness: each run_ranks worker supervises one trainer process ----------------------------------------

class _RaiseAt(pl.Callback):
    """On rank 1, at the start of step 2: a bug in the user's code on one rank only."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_rank == 1 and trainer.global_step == 2:
            (self.run_dir / "raised_at").write_text(repr(time.monotonic()))
            raise ValueError("deliberate bug on rank 1")


class _KillAt(pl.Callback):
    """On VICTIM, at the start of step 2: wait until its heartbeats carry its whole record, then SIGKILL."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_rank == VICTIM and trainer.global_step == 2:
            time.sleep(2.5)  # > two heartbeats (1 s at this timeout): the record others see is current
            (self.run_dir / "killed_at").write_text(repr(time.monotonic()))
            os.kill(os.getpid(), signal.SIGKILL)


def _trainer(rank: int, world: int, scenario: str, run_dir: Path) -> None:
    """A trainer rank in its own process and process group; writes how it ended to outcome<rank>.json."""
    status = 1
    try:
        with contextlib.suppress(OSError, AttributeError):  # die with the supervisor
            ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)
        dist.init_process_group("gloo", init_method=f"file://{run_dir}/rendezvous", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        adopt_process_group_in_lightning()
        g = torch.Generator().manual_seed(5)
        tokens = torch.randint(0, VOCAB, (BATCH * 2, SEQ + 1), generator=g)
        data = TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
        strategy = HybridParallelStrategy(**LAYOUT, collective_timeout=TIMEOUT,
                                          collective_dump_dir=str(run_dir / "dumps"))
        trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=12, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             callbacks={"kill": [_KillAt(run_dir)], "raise": [_RaiseAt(run_dir)]}.get(scenario, []))
        try:
            trainer.fit(GPTModule(**MODEL), DataLoader(data, batch_size=BATCH // 2))
            outcome = {"result": "finished"}
        except BaseException as exc:  # noqa: BLE001 - how each rank ended is what the test checks
            outcome = {"result": type(exc).__name__, "message": str(exc), "kind": getattr(exc, "kind", None)}
        outcome["ended"] = time.monotonic()
        (run_dir / f"outcome{rank}.json").write_text(json.dumps(outcome))
        status = 0
    finally:
        os._exit(status)


def _supervise(rank: int, world: int, scenario: str, run_dir: str) -> dict:
    """run_ranks ends a run 2 s after its first rank fails (its contract for ordinary tests); here the
    survivors must stop on their own, so the worker drops the harness's group and forks the trainer rank, then
    reports how and when it ended."""
    dist.barrier()  # every rank has joined the harness's group (gloo connects lazily), so it can go
    dist.destroy_process_group()
    run_dir = Path(run_dir)
    pid = os.fork()
    if pid == 0:
        _trainer(rank, world, scenario, run_dir)
    _, status = os.waitpid(pid, 0)
    ended = time.monotonic()
    path = run_dir / f"outcome{rank}.json"
    return {"pid": pid, "exit": os.waitstatus_to_exitcode(status), "ended": ended,
            "outcome": json.loads(path.read_text()) if path.exists() else None}


def _no_process_left(pids) -> bool:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        alive = [p for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]
        if not alive and not mp.active_children() and not any(psutil.pid_exists(pid) for pid in pids):
            return True
        time.sleep(0.05)
    return False


def _run(scenario: str, run_dir: Path) -> tuple[list[dict], dict[int, dict]]:
    results = run_ranks(_supervise, 4, scenario, str(run_dir), timeout=150)
    assert _no_process_left([r["pid"] for r in results])  # trainers and supervisors all reaped
    dumps = {}
    for path in sorted((run_dir / "dumps").glob("rank*.json")):
        dumps[int(path.stem[4:])] = json.loads(path.read_text())  # (c) each dump parses
    return results, dumps


def _blocks(message: str) -> dict[str, dict[int, tuple]]:
    """``{group label: {rank: (entered op, seq, completed op, seq, tags)}}`` from a verdict's message."""
    blocks, label = {}, None
    for line in message.splitlines():
        if line.startswith("  ") and not line.startswith("    "):
            label = line.strip()
            blocks[label] = {}
        elif (m := ROW.match(line)) and label is not None:
            r, eop, eseq, cop, cseq, tags = m.groups()
            blocks[label][int(r)] = (eop, int(eseq), cop, int(cseq), tags)
    return blocks


def _only_groups_where_someone_waits_on(culprit: int, blocks: dict) -> None:
    """The groups shown are the culprit's in which a rank waits or failed, each with a row for every member."""
    for label, rows in blocks.items():
        members = {int(r) for part in label.split("ranks ")[1].split(",")
                   for r in (range(int(part.split("-")[0]), int(part.split("-")[1]) + 1) if "-" in part
                             else [part])}
        assert culprit in members and set(rows) == members, (label, rows)
        assert any("in flight" in row[4] or "failed" in row[4] for row in rows.values()), (label, rows)


def _the_one_error(results, survivors, dumps) -> str:
    """Every survivor ended with the same verdict: raised as CollectiveError, or printed by the watchdog."""
    messages = set()
    for rank in survivors:
        outcome = results[rank]["outcome"]
        if outcome is not None:
            assert outcome["result"] == CollectiveError.__name__, (rank, outcome)
            messages.add(outcome["message"])
        else:
            assert results[rank]["exit"] == EXIT_CODE and dumps[rank]["ended_by"] == "watchdog", results[rank]
        messages.add(dumps[rank]["verdict"])
    assert len(messages) == 1, messages
    return messages.pop()


# --- (a) a rank SIGKILLed mid-training --------------------------------------------------------------------------

def test_a_killed_rank_is_named_dead_by_every_other_rank_within_the_timeout(tmp_path):
    results, dumps = _run("kill", tmp_path)
    killed_at = float((tmp_path / "killed_at").read_text())
    assert results[VICTIM]["exit"] == -signal.SIGKILL and results[VICTIM]["outcome"] is None
    survivors = [0, 1, 2]
    message = _the_one_error(results, survivors, dumps)
    took = max(results[r]["ended"] for r in survivors) - killed_at
    print(f"\nkill: every other rank gone {took:.2f} s after the SIGKILL (bound {BUDGET:g} s)\n{message}")
    assert took < BUDGET
    assert message.startswith("rank 3 is dead (")
    assert all(results[r]["outcome"]["kind"] == "dead" for r in survivors if results[r]["outcome"])
    blocks = _blocks(message)
    _only_groups_where_someone_waits_on(VICTIM, blocks)
    tp = blocks["tp group 1: ranks 2,3"]
    assert set(tp) == {2, 3}
    # Rank 2 was inside the next TP all-reduce when its peer died: it failed there; rank 3 had completed every
    # collective it entered, the same one rank 2 completed last.
    eop, eseq, _, cseq, tags = tp[2]
    assert eop == "all_reduce" and "failed" in tags and cseq == eseq - 1
    assert tp[3][1] == tp[3][3] == cseq and "as of its last heartbeat" in tp[3][4] and "dead" in tp[3][4]
    # (c) the per-rank dumps: the survivors' records hold what the message shows for them.
    assert set(dumps) == {0, 1, 2} and str(tmp_path / "dumps") in message
    mine = next(g for g in dumps[2]["groups"] if g["group"] == "tp group 1: ranks 2,3")
    assert (mine["failed"]["op"], mine["failed"]["seq"], mine["completed"]["seq"]) == (eop, eseq, cseq)
    assert dumps[2]["abort"]["kind"] == "collective_error"


# --- (b) a rank hung inside a collective (the test hook) --------------------------------------------------------

def test_b_hung_rank_is_named_and_every_process_is_gone_including_the_hung_one(tmp_path, monkeypatch):
    monkeypatch.setenv(TEST_HANG_ENV, f"rank={VICTIM},axis=tp,op=all_reduce,seq=30")  # mid-step 3
    results, dumps = _run("hang", tmp_path)
    fired = dumps[VICTIM]["injected_hang"]
    assert fired["op"] == "all_reduce" and fired["seq"] == 30 and fired["group"] == "tp group 1: ranks 2,3"
    # The hung rank itself is ended by its watchdog (its main thread never returns), after dumping.
    assert results[VICTIM]["exit"] == EXIT_CODE and dumps[VICTIM]["ended_by"] == "watchdog"
    message = _the_one_error(results, [0, 1, 2, 3], dumps)
    took = max(r["ended"] for r in results) - fired["at_monotonic"]
    print(f"\nhang: every rank gone {took:.2f} s after rank 3 stopped (bound {BUDGET:g} s)\n{message}")
    assert took < BUDGET
    assert message.startswith("rank 3 hung: never entered (all_reduce, 30) of tp group 1: ranks 2,3, which "
                              "rank 2 entered and waited in")
    assert results[2]["outcome"]["result"] == CollectiveError.__name__  # its collective gave up: it raised
    blocks = _blocks(message)
    tp = blocks["tp group 1: ranks 2,3"]
    assert tp[2][:2] == ("all_reduce", 30) and tp[2][3] == 29 and ("in flight" in tp[2][4] or "failed" in tp[2][4])
    assert tp[3][1] == tp[3][3] == 29 and "hung" in tp[3][4]
    _only_groups_where_someone_waits_on(VICTIM, blocks)
    # The waits are the timeout long (the verdict comes once one of them is): the records tell time correctly.
    ages = [float(a) for a in re.findall(r"in flight ([\d.]+) s", message)]
    assert ages and all(TIMEOUT * 0.5 < age < TIMEOUT + 5 for age in ages), ages
    assert set(dumps) == {0, 1, 2, 3} and all(d["verdict"] == message for d in dumps.values())
    assert dumps[2]["abort"]["kind"] in ("in_flight", "collective_error")


# --- a rank whose own code raised ------------------------------------------------------------------------------

def test_a_rank_whose_code_raised_keeps_its_error_and_the_others_name_it(tmp_path):
    results, dumps = _run("raise", tmp_path)
    assert results[1]["outcome"]["result"] == "ValueError"  # the cause keeps its own exception
    message = _the_one_error(results, [0, 2, 3], dumps)
    took = max(r["ended"] for r in results) - float((tmp_path / "raised_at").read_text())
    print(f"\nraise: every rank gone {took:.2f} s after rank 1 raised\n{message}")
    assert took < BUDGET
    assert message.startswith("rank 1 raised ValueError: deliberate bug on rank 1; the other ranks were stopped")
    assert dumps[1]["verdict"] == message and dumps[1]["abort"]["kind"] == "exception"
    _only_groups_where_someone_waits_on(1, _blocks(message))


# --- the records on real gloo ranks ----------------------------------------------------------------------------

def _records(rank, world, out_dir):
    grid = Grid.build(ParallelDims(world, tp=2))
    refs = group_refs(grid)
    fr, ours = FlightRecorderRecord(refs), CallRecord(refs)
    interposer = Interposer([ours])
    interposer.install()
    try:
        tp, x = grid.group("tp"), torch.ones(4)
        for _ in range(3):
            dist.all_reduce(x, group=tp)
        dist.broadcast(x, src=0, group=tp)
        dist.all_reduce(x, group=tp, async_op=True).wait()
        dist.barrier()
        time.sleep(0.1)  # gloo retires a work item just after the call returns
        fr.refresh()
        before = (fr.summaries(recent=True), ours.summaries(recent=True))
        store = dist.distributed_c10d._get_default_store()
        if rank == 1:
            store.get("rank 0 is ready")
            os._exit(0)  # rank 0's next collective then fails: "Connection closed by peer"
        store.set("rank 0 is ready", "1")
        try:
            dist.all_reduce(x, group=tp)
        except RuntimeError as exc:
            assert is_collective_error(exc)
            fr.mark_failed()
        after = (fr.summaries(), ours.summaries())
        Path(out_dir, "records.json").write_text(json.dumps({"before": before, "after": after}))
    finally:
        interposer.restore()
    return "ok"


def test_flight_recorder_and_our_record_agree_and_both_mark_the_failed_collective(tmp_path):
    with pytest.raises(Exception, match="rank 1: worker died"):
        run_ranks(_records, 2, str(tmp_path), timeout=60)
    data = json.loads((tmp_path / "records.json").read_text())
    label = "tp group 0: ranks 0,1"
    for source in (0, 1):  # the flight recorder's record and ours, side by side
        tp = next(g for g in data["before"][source] if g["group"] == label)
        assert (tp["entered"]["op"], tp["entered"]["seq"]) == ("all_reduce", 5)
        assert tp["completed"] == tp["entered"] and tp["in_flight_s"] is None and tp["failed"] is None
        assert tp["recent"] == {"1": "all_reduce", "2": "all_reduce", "3": "all_reduce", "4": "broadcast",
                                "5": "all_reduce"}
        failed = next(g for g in data["after"][source] if g["group"] == label)
        assert (failed["failed"]["op"], failed["failed"]["seq"], failed["completed"]["seq"]) == ("all_reduce", 6, 5)
    world = next(g for g in data["before"][1] if g["group"] == "world group 0: ranks 0,1")
    assert world["entered"]["op"] == "barrier"


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (one per NCCL rank)")
def test_the_flight_recorder_record_on_nccl_sees_entered_and_completed(tmp_path):
    def body(rank, world, out):
        grid = Grid.build(ParallelDims(world, tp=2))
        fr = FlightRecorderRecord(group_refs(grid))
        x = torch.ones(4, device="cuda")
        for _ in range(3):
            dist.all_reduce(x, group=grid.group("tp"))
        torch.cuda.synchronize()
        time.sleep(1.0)  # NCCL's watchdog marks work completed on its own poll
        fr.refresh()
        return [g for g in fr.summaries() if g["axis"] == "tp"]

    tp = run_ranks(body, 2, str(tmp_path), timeout=120, backend="nccl")[0][0]
    assert (tp["entered"]["op"], tp["entered"]["seq"], tp["completed"]["seq"]) == ("all_reduce", 3, 3)


# --- (d) the diagnosis from recorded summaries (pure) ----------------------------------------------------------

TP = [GroupRef("tp", 0, (0, 1), "2"), GroupRef("tp", 1, (2, 3), "4")]
DP = [GroupRef("dp_cp", 0, (0, 2), "10"), GroupRef("dp_cp", 1, (1, 3), "12")]


def _op(op, seq):
    return {"op": op, "seq": seq, "id": seq}


def _g(ref, entered, completed, *, failed=None, in_flight=None, recent=None, named=True):
    entered_ref = _op(entered[0] if named else None, entered[1]) if entered else None
    if entered_ref is not None and not named:
        entered_ref["seq"] = None
    return summary(ref, entered=entered_ref, completed=_op(*completed) if completed else None,
                   failed=_op(*failed) if failed else None, in_flight_s=in_flight, ids_are_seqs=True, recent=recent)


def _world_of_four() -> dict[int, RankReport]:
    recent = {40: "all_reduce", 41: "all_reduce"}
    groups = {
        0: (_g(TP[0], ("all_reduce", 44), ("all_reduce", 44)), _g(DP[0], ("all_reduce", 12), ("all_reduce", 11),
                                                                  in_flight=3.0)),
        1: (_g(TP[0], ("all_reduce", 44), ("all_reduce", 44)), _g(DP[1], ("all_reduce", 12), ("all_reduce", 11),
                                                                  in_flight=2.5)),
        2: (_g(TP[1], ("all_reduce", 41), ("all_reduce", 40), in_flight=5.5, recent=recent),
            _g(DP[0], ("all_reduce", 11), ("all_reduce", 11))),
        3: (_g(TP[1], ("all_reduce", 40), ("all_reduce", 40)), _g(DP[1], ("all_reduce", 11), ("all_reduce", 11))),
    }
    return {r: RankReport(r, "final", groups=groups[r]) for r in range(4)}


def _diagnose(reports, kind="in_flight", by=2, reason="rank 2: all_reduce #41 in flight for 5.5 s"):
    return diagnose(reports, trigger={"by": by, "kind": kind, "reason": reason}, world_size=4,
                    dump_dir="/runs/dumps", timeout_s=5.0)


def test_a_rank_behind_its_group_and_inside_no_collective_is_hung():
    verdict = _diagnose(_world_of_four())
    assert (verdict.kind, verdict.culprits) == ("hung", (3,))
    assert verdict.groups == ("tp group 1: ranks 2,3", "dp_cp group 1: ranks 1,3")
    assert verdict.message.splitlines() == [
        "rank 3 hung: never entered (all_reduce, 41) of tp group 1: ranks 2,3, which rank 2 entered and waited "
        "in (collective timeout 5 s), and is inside no collective (its heartbeat went on: stuck in Python or "
        "compute, or in a call that never reached the backend); first noticed by rank 2: rank 2: all_reduce #41 "
        "in flight for 5.5 s",
        "Process groups (last collective entered, completed on each rank, as (op, seq)):",
        "  tp group 1: ranks 2,3",
        "    rank 2: entered (all_reduce, 41), completed (all_reduce, 40)  [in flight 5.5 s]",
        "    rank 3: entered (all_reduce, 40), completed (all_reduce, 40)  [hung]",
        "  dp_cp group 1: ranks 1,3",
        "    rank 1: entered (all_reduce, 12), completed (all_reduce, 11)  [in flight 2.5 s]",
        "    rank 3: entered (all_reduce, 11), completed (all_reduce, 11)  [hung]",
        "Other ranks: rank 0 waiting in dp_cp group 0: ranks 0,2 at (all_reduce, 12)",
        "Each rank's collective record: /runs/dumps/rank<N>.json (written on that rank's host).",
    ]
    assert Verdict.from_json(verdict.to_json()) == verdict


def test_a_rank_that_did_not_answer_is_dead_and_its_ops_are_named_by_its_peers():
    # Rank 3's last heartbeat knew op ids only; its peers' records name sequence 40 of tp group 1.
    last_beat = (_g(TP[1], ("all_reduce", 40), ("all_reduce", 40), named=False),
                 _g(DP[1], ("all_reduce", 11), ("all_reduce", 11)))
    reports = _world_of_four()
    reports[3] = RankReport(3, "heartbeat", groups=last_beat, silent_s=1.3)
    reports[2] = RankReport(2, "final", state="failed", groups=(
        _g(TP[1], ("all_reduce", 41), ("all_reduce", 40), failed=("all_reduce", 41),
           recent={40: "all_reduce", 41: "all_reduce"}),))
    verdict = _diagnose(reports, kind="collective_error",
                        reason="RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:1234\nmore")
    assert (verdict.kind, verdict.culprits) == ("dead", (3,))
    assert verdict.groups == ("tp group 1: ranks 2,3", "dp_cp group 1: ranks 1,3")
    lines = verdict.message.splitlines()
    assert lines[0] == ("rank 3 is dead (no heartbeat for 1.3 s, no answer to the abort); first noticed by rank "
                        "2: RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:1234")
    assert lines[3] == "    rank 2: entered (all_reduce, 41), completed (all_reduce, 40)  [failed]"
    assert lines[4] == ("    rank 3: entered (all_reduce, 40), completed (all_reduce, 40)  [as of its last "
                        "heartbeat, dead]")
    assert lines[6:8] == ["    rank 1: entered (all_reduce, 12), completed (all_reduce, 11)  [in flight 2.5 s]",
                          "    rank 3: entered (all_reduce, 11), completed (all_reduce, 11)  [as of its last "
                          "heartbeat, dead]"]
    assert lines[8] == "Other ranks: rank 0 waiting in dp_cp group 0: ranks 0,2 at (all_reduce, 12)"


def test_a_rank_whose_own_code_raised_is_the_cause_and_finished_ranks_are_not_dead():
    reports = _world_of_four()
    reports[1] = RankReport(1, "final", state="failed", groups=reports[1].groups, error="ValueError: bad batch")
    reports[0] = RankReport(0, "heartbeat", state="stopped", groups=reports[0].groups)
    verdict = _diagnose(reports, kind="exception", by=1, reason="ValueError: bad batch")
    assert (verdict.kind, verdict.culprits) == ("raised", (1,))
    assert verdict.message.startswith("rank 1 raised ValueError: bad batch; the other ranks were stopped")
    assert verdict.groups == ("dp_cp group 1: ranks 1,3",)  # where rank 1 left rank 3 waiting
    assert "Other ranks: rank 0 had finished; rank 2 waiting in tp group 1: ranks 2,3 at (all_reduce, 41)" \
        in verdict.message


def test_a_group_whose_every_member_entered_and_none_completed_is_stuck():
    reports = {r: RankReport(r, "final", groups=(_g(TP[r // 2], ("all_gather", 7), ("all_reduce", 6),
                                                    in_flight=6.0),)) for r in range(4)}
    reports[0] = RankReport(0, "final", groups=(_g(TP[0], ("all_reduce", 9), ("all_reduce", 9)),))
    reports[1] = RankReport(1, "final", groups=(_g(TP[0], ("all_reduce", 9), ("all_reduce", 9)),))
    verdict = _diagnose(reports)
    assert (verdict.kind, verdict.culprits, verdict.groups) == ("stuck", (), ("tp group 1: ranks 2,3",))
    assert verdict.message.startswith("every rank of tp group 1: ranks 2,3 entered (all_gather, 7) and none "
                                      "completed it within the collective timeout (5 s)")
    assert "Other ranks: rank 0 inside no collective; rank 1 inside no collective" in verdict.message


def test_a_rank_that_lost_the_store_says_what_it_knows_of_itself():
    verdict = local_verdict(2, [_g(TP[1], ("all_reduce", 41), ("all_reduce", 40), in_flight=3.0)],
                            reason="the c10d store stopped answering (DistNetworkError: Connection refused)",
                            dump_dir="/runs/dumps")
    assert (verdict.kind, verdict.culprits, verdict.groups) == ("unknown", (), ("tp group 1: ranks 2,3",))
    assert verdict.message.splitlines()[:4] == [
        "rank 2 cannot reach the other ranks: the c10d store stopped answering (DistNetworkError: Connection "
        "refused); no rank could be named",
        "Rank 2's process groups (last collective entered, completed, as (op, seq)):",
        "  tp group 1: ranks 2,3",
        "    rank 2: entered (all_reduce, 41), completed (all_reduce, 40)  [in flight 3.0 s]"]


def test_group_labels_name_the_axis_index_and_ranks():
    assert GroupRef("tp", 1, (2, 3), "4").label == "tp group 1: ranks 2,3"
    assert GroupRef("world", 0, tuple(range(8)), "0").label == "world group 0: ranks 0-7"
    assert GroupRef("sl:pp twin", None, (0, 4), "9").label == "group 'sl:pp twin': ranks 0,4"
    assert format_ranks([5, 0, 1, 2, 7, 8]) == "0-2,5,7,8"


@pytest.mark.parametrize("timeout", [0.5, 5.0, 30.0, 600.0, 3600.0])
def test_the_timing_keeps_every_rank_within_the_timeout_plus_15_s(timeout):
    t = Timing(timeout)
    assert t.bound <= 15.0
    assert t.slack > t.tick + t.answer  # the verdict is ready before any backend collective gives up
    assert t.exit_grace > t.slack  # and a main thread that a backend timeout frees still gets to raise it


def test_bad_arguments_are_refused_with_their_values():
    with pytest.raises(ContractError, match=r"collective_timeout=-1 must be a positive number"):
        HybridParallelStrategy(collective_timeout=-1)
    with pytest.raises(ContractError, match=r"collective_timeout='5' must be"):
        HybridParallelStrategy(collective_timeout="5")
    assert HybridParallelStrategy(collective_timeout=datetime.timedelta(minutes=2)).collective_timeout == 120.0
    assert HybridParallelStrategy().collective_timeout == 600.0
    with pytest.raises(ContractError, match=r"SHARDLINE_TEST_HANG_AT='rank=3,op=x' must read rank=<int>"):
        InjectedHang.parse("rank=3,op=x")
    with pytest.raises(ContractError, match=r"axis 'tq' is not one of"):
        InjectedHang.parse("rank=3,axis=tq,op=all_reduce,seq=2")
    assert InjectedHang.parse("rank=3,axis=tp,op=all_reduce,seq=30") == InjectedHang(3, "tp", "all_reduce", 30)


def test_collective_errors_are_told_from_the_others():
    assert is_collective_error(RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:9"))
    assert is_collective_error(RuntimeError("[unbound_buffer.cc:78] Timed out waiting 8000ms for recv"))
    assert is_collective_error(RuntimeError("Application timeout caused pair closure"))  # gloo's barrier
    try:
        try:
            raise RuntimeError("gloo: Connection reset by peer")
        except RuntimeError as inner:
            raise ValueError("wrapped") from inner
    except ValueError as outer:
        assert is_collective_error(outer)
    assert not is_collective_error(ValueError("bad batch"))
    assert not is_collective_error(KeyError("gloo"))
