"""No process left behind, and the verdict told once (issue 46 §3).

The parts, each on real processes and a real c10d store: a stopped process is ended by SIGKILL and reaped; a
worker armed with ``die_with_parent`` dies with its parent; the watchdog's store calls give up on a store whose
host is stopped (c10d's own client would block for ever); the store's host is named; the verdict names one
speaker; ``shardline fit`` prints an error once, from the speaker, with every rank's traceback in a file. The
whole of it, a stopped worker under ``shardline fit``, is one end-to-end test in tests/recipes/test_fit_faults.py.
"""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from shardline.plugins.errors import CheckpointError, CollectiveError, ErrorReport, attach_report
from shardline.plugins.faults.collective_diagnosis import RankReport, diagnose, local_verdict
from shardline.plugins.faults.processes import describe_exit, end_processes
from shardline.plugins.faults.watchdog import BoundedStore, StoreNotAnswering, store_lost_reason
from shardline.plugins.testing import process_gone, thread_states


def _wait_stopped(pid: int) -> None:
    """Until every thread of ``pid`` is stopped (the store server answers from a thread of its own)."""
    deadline = time.monotonic() + 10
    while not all(state in "tT" for state in thread_states(pid)):
        assert time.monotonic() < deadline, f"process {pid} did not stop: thread states {thread_states(pid)}"
        time.sleep(0.01)


def test_a_stopped_process_is_killed_and_reaped_and_a_finished_one_is_left_alone():
    stopped = subprocess.Popen(["sleep", "60"])
    finished = subprocess.Popen(["true"])
    os.kill(stopped.pid, signal.SIGSTOP)
    killed = end_processes([stopped, finished], grace=0.3)
    assert killed == [stopped.pid]
    assert stopped.returncode == -signal.SIGKILL and finished.returncode == 0
    assert not os.path.exists(f"/proc/{stopped.pid}")  # reaped, not a zombie
    assert describe_exit(-9) == "was killed by SIGKILL" and describe_exit(3) == "exited with code 3"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_an_armed_worker_dies_with_its_parent_even_when_stopped(tmp_path):
    """Parent -> worker (armed, then SIGSTOPped): SIGKILL the parent and the worker is gone."""
    pid_file = tmp_path / "worker.pid"
    worker = textwrap.dedent(f"""
        import os, time
        from shardline.plugins.faults.processes import die_with_parent
        assert die_with_parent(expected_parent=os.getppid())
        open({str(pid_file)!r}, "w").write(str(os.getpid()))
        time.sleep(60)
    """)
    parent = subprocess.Popen([sys.executable, "-c",
                               f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {worker!r}]); "
                               "time.sleep(60)"])
    try:
        deadline = time.monotonic() + 30
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline, "the worker never started"
            time.sleep(0.05)
        pid = int(pid_file.read_text())
        os.kill(pid, signal.SIGSTOP)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while not process_gone(pid):
            assert time.monotonic() < deadline, f"worker {pid} outlived its parent"
            time.sleep(0.05)
    finally:
        parent.kill()


def test_a_worker_whose_parent_is_already_gone_ends_itself():
    code = "from shardline.plugins.faults.processes import die_with_parent; die_with_parent(expected_parent=1); " \
           "print('still here')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == -signal.SIGKILL and "still here" not in out.stdout


def test_the_watchdogs_store_calls_give_up_when_the_store_host_is_stopped():
    import torch.distributed as dist

    server = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import datetime, sys, time
        import torch.distributed as dist
        store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60))
        print(store.port, flush=True)
        time.sleep(120)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        client = dist.TCPStore("127.0.0.1", port, 1, False, timeout=datetime.timedelta(seconds=60))
        store = BoundedStore(client, 1.0)
        assert store.add("n", 1) == 1 and store.check(["n"])
        os.kill(server.pid, signal.SIGSTOP)
        _wait_stopped(server.pid)  # the signal is delivered asynchronously: a request sent before could be served
        started = time.monotonic()
        with pytest.raises(StoreNotAnswering, match=r"store add\('n',\) did not answer within 1 s"):
            store.add("n", 1)
        with pytest.raises(StoreNotAnswering):
            store.check(["n"])  # queued behind the blocked call: the store is gone for this process
        assert time.monotonic() - started < 5
    finally:
        server.kill()
        server.wait()


def test_a_rank_that_loses_the_store_rank_0_hosts_says_rank_0_is_the_likely_casualty():
    code = textwrap.dedent("""
        import datetime, socket
        import torch.distributed as dist
        from shardline.plugins.torch_compat import store_host
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=60))
        print(port, store_host())
        dist.destroy_process_group()
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    port, host = out.stdout.split()
    assert host == f"127.0.0.1:{port}", out.stderr[-2000:]  # Lightning's and torchrun's rendezvous: a TCPStore
    lost = StoreNotAnswering("store add('abort_count',) did not answer within 5 s")
    assert store_lost_reason(lost, rank=2, host=host) == (
        "the c10d store stopped answering (StoreNotAnswering: store add('abort_count',) did not answer within 5 s); "
        f"rank 0 hosts it ({host}): rank 0 is the likely casualty (dead, stopped, or its host unreachable)")
    assert "casualty" not in store_lost_reason(lost, rank=2, host=None)  # a file store has no host


def test_the_verdict_names_one_speaker():
    reports = {r: RankReport(r, "final", groups=()) for r in range(4)}
    raised = diagnose(reports, trigger={"by": 2, "kind": "exception", "reason": "ValueError: x"}, world_size=4,
                      dump_dir="/d", timeout_s=5)
    assert raised.kind == "raised" and raised.speaker == 2 and raised.speaks(2) and not raised.speaks(0)
    dead = diagnose({**reports, 0: RankReport(0, "none")}, trigger={"by": 3, "kind": "exited", "reason": "r"},
                    world_size=4, dump_dir="/d", timeout_s=5)
    assert dead.kind == "dead" and dead.culprits == (0,) and dead.speaker == 1
    assert type(dead).from_json(dead.to_json()).speaker == 1
    local = local_verdict(3, [], reason="the store stopped answering", dump_dir="/d")
    assert local.speaker is None and local.speaks(3)  # a verdict of its own: every rank tells its own


def _failure(tmp_path, error, *, speaks, capsys):
    from shardline.recipes.fit import report_failure

    report = ErrorReport(rank=3, speaks=speaks, log_dir=str(tmp_path / "logs"))
    try:
        raise error
    except Exception as raised:  # noqa: BLE001 - a real traceback to write
        attach_report(raised, report)
        status = report_failure(raised)
    return status, capsys.readouterr().err, report.traceback_path()


def test_an_error_after_launch_is_printed_once_by_its_speaker_and_logged_by_every_rank(tmp_path, capsys):
    error = CheckpointError("model.safetensors: tensor wte.weight has shape [7, 4], this model [8, 4]")
    status, err, log = _failure(tmp_path, error, speaks=False, capsys=capsys)
    assert status == 1 and err == ""  # not the speaker: silent, but its traceback is on disk
    assert "Traceback (most recent call last)" in log.read_text() and "wte.weight" in log.read_text()

    status, err, log = _failure(tmp_path, error, speaks=True, capsys=capsys)
    lines = err.strip().splitlines()
    assert status == 1 and len(lines) == 2 and "Traceback" not in err
    assert lines[0] == f"shardline fit: error: CheckpointError: {error}"
    assert lines[1] == f"(each rank's full traceback: {tmp_path / 'logs'}/rank<N>-error.txt)"

    status, err, _ = _failure(tmp_path, ValueError("val_check_interval (9) must be <= 4"), speaks=True,
                              capsys=capsys)
    assert status == 1 and "Traceback (most recent call last)" in err and err.count("val_check_interval") == 1


def test_a_collective_error_keeps_its_table_and_one_without_a_report_prints_as_before(tmp_path, capsys):
    from shardline.recipes.fit import report_failure

    table = "rank 1 is dead\nProcess groups (...):\n  dp group 0: ranks 0,1"
    status, err, _ = _failure(tmp_path, CollectiveError(table, kind="dead", culprits=(1,)), speaks=True,
                              capsys=capsys)
    assert status == 1 and f"CollectiveError: {table}" in err
    assert report_failure(CheckpointError("x.safetensors: bad")) == 1  # before the ranks connected: no report
    assert capsys.readouterr().err.strip() == "shardline fit: error: CheckpointError: x.safetensors: bad"


class _Watchdog:
    """What the launcher's observer uses of the watchdog: it records the exit it is told of."""

    def __init__(self):
        from shardline.plugins.faults.watchdog import Timing

        self.timing, self.told = Timing(1.0), []

    def report_exit(self, rank, how):
        self.told.append((rank, how))

    def wait_verdict(self, seconds):
        return None


def _launcher(strategy):
    from lightning_fabric.plugins.environments import LightningEnvironment

    from shardline.plugins.lightning.launcher import ShardlineLauncher

    return ShardlineLauncher(LightningEnvironment(), 3, 1, strategy=strategy)


def test_a_workers_death_is_told_to_the_watchdog_before_the_others_are_ended():
    from types import SimpleNamespace

    from shardline.plugins.lightning.launcher import _Observer

    watchdog = _Watchdog()
    launcher = _launcher(SimpleNamespace(watchdog=watchdog, grid=object(), collective_timeout=1.0))
    launcher.procs = [subprocess.Popen(["sleep", "60"]), subprocess.Popen(["sleep", "60"])]
    os.kill(launcher.procs[1].pid, signal.SIGKILL)
    observer = _Observer(launcher)
    observer.start()
    observer.join(timeout=30)
    assert not observer.is_alive()
    assert watchdog.told == [(2, "was killed by SIGKILL")]  # procs[1] is local rank 2
    assert launcher.procs[0].returncode == -signal.SIGKILL  # the survivor, ended after the grace
    assert launcher.end_workers() == []  # once: the exit hook finds nothing left to do


def test_a_worker_that_dies_before_the_ranks_connect_ends_the_run_saying_so():
    code = textwrap.dedent("""
        import subprocess, time
        from types import SimpleNamespace
        from lightning_fabric.plugins.environments import LightningEnvironment
        from shardline.plugins.lightning.launcher import ShardlineLauncher, _Observer
        launcher = ShardlineLauncher(LightningEnvironment(), 3, 1,
                                     strategy=SimpleNamespace(watchdog=None, grid=None, collective_timeout=5))
        launcher.procs = [subprocess.Popen(["sleep", "60"]), subprocess.Popen(["sh", "-c", "exit 3"])]
        print(launcher.procs[0].pid, flush=True)
        _Observer(launcher).start()
        time.sleep(60)
    """)
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 70 and time.monotonic() - started < 60, out.stderr[-2000:]
    assert "shardline: rank 2 (PID " in out.stderr and ") exited with code 3 before the ranks connected; ending " \
        "the run" in out.stderr
    assert process_gone(int(out.stdout.split()[0]))
