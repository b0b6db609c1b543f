"""The launcher the strategy uses where Lightning starts the workers itself: Lightning's, ending every process it
started, and letting the watchdog's verdict reach the terminal before anything is ended.

Lightning's :class:`~pytorch_lightning.strategies.launchers.subprocess_script._SubprocessScriptLauncher` (``devices=N``
on one machine: rank 0 re-runs the command line N-1 times) leaves two holes that :class:`ShardlineLauncher` closes:

* A worker outlived the run: one that was stopped (SIGSTOP, a debugger) or stuck in uninterruptible I/O stayed
  behind, reparented to PID 1, holding its memory (on a GPU, its device memory) after the others had named it and
  exited. Here the launcher ends every worker it started before it exits (bounded wait, then SIGKILL: a SIGTERM
  stays pending on a stopped process), and every worker arms ``PR_SET_PDEATHSIG`` (SIGKILL) so that it dies with
  the launcher whichever way the launcher ends (killed, ``os._exit`` by the watchdog). Where the stopped process
  is the launcher itself (rank 0), nothing inside the job can end it; its workers end with their watchdogs'
  verdict, and the stopped launcher stays until whoever started it ends it.
* The verdict never reached the terminal: Lightning's child-process observer SIGKILLs every rank within ~5 s of a
  worker's non-zero exit, before the watchdogs have agreed who died (their dumps say ``verdict: None``). Here the
  observer tells rank 0's watchdog at once which rank exited and how (so the abort does not wait for the
  collective timeout), waits for the verdict and for the workers to finish saying it, and only then ends what is
  left. Without a watchdog (the worker died before the ranks connected) it says which rank exited and how, and
  ends the run.

Workers on other machines are their own machine's launcher's (or scheduler's) to end.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from typing import Any

from shardline.plugins.faults.processes import describe_exit, die_with_parent, end_processes
from shardline.plugins.faults.watchdog import EXIT_CODE, Timing
from shardline.plugins.lightning.lightning_compat import SubprocessScriptLauncher, set_num_threads_if_needed

log = logging.getLogger(__name__)

#: Set by the launcher in the workers' environment: its PID, which each worker checks is still its parent.
LAUNCHER_PID_VARIABLE = "SHARDLINE_LAUNCHER_PID"
#: How often the observer looks at the workers.
POLL_S = 0.25
#: Without a watchdog (no process group yet), how long the others get after a worker's exit before they are ended.
EARLY_GRACE_S = 3.0


def arm_worker() -> bool:
    """In a worker this launcher started (its PID in the environment): die with it. True if armed."""
    parent = os.environ.get(LAUNCHER_PID_VARIABLE, "")
    if os.environ.get("LOCAL_RANK", "0") == "0" or not parent.isdigit():
        return False
    return die_with_parent(expected_parent=int(parent))


class ShardlineLauncher(SubprocessScriptLauncher):
    """Lightning's subprocess launcher (same arguments, same command lines) whose workers never outlive it; see
    the module docstring. ``strategy`` is read for its ``watchdog`` and ``collective_timeout`` when a worker
    ends."""

    def __init__(self, cluster_environment, num_processes: int, num_nodes: int, *, strategy: Any) -> None:
        super().__init__(cluster_environment, num_processes, num_nodes)
        self._strategy = strategy
        self._observer: _Observer | None = None
        self._lock = threading.Lock()
        self._ended = False

    @classmethod
    def replacing(cls, launcher: SubprocessScriptLauncher, strategy: Any) -> ShardlineLauncher:
        return cls(launcher.cluster_environment, launcher.num_processes, launcher.num_nodes, strategy=strategy)

    def launch(self, function, *args: Any, trainer=None, **kwargs: Any) -> Any:
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            os.environ[LAUNCHER_PID_VARIABLE] = str(os.getpid())
            self._call_children_scripts()
            atexit.register(self.end_workers)
            self._observer = _Observer(self)
            self._observer.start()
        set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)

    def grace(self) -> float:
        """How long a worker may take to end on its own once the run is over or failed: the watchdog's bound
        from noticing a failure to every rank having ended (:class:`~shardline.plugins.faults.watchdog.Timing`)."""
        timeout = getattr(self._strategy, "collective_timeout", None)
        seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else timeout
        try:
            return Timing(float(seconds)).bound
        except (TypeError, ValueError):
            return Timing(600.0).bound

    def end_workers(self, grace: float | None = None) -> list[int]:
        """Wait (bounded) for the workers this launcher started to end, then SIGKILL those left; returns their
        PIDs. Runs at this process's exit and before the watchdog ends it; once (a second caller waits for the
        first to finish)."""
        with self._lock:
            if self._ended:
                return []
            if self._observer is not None:
                self._observer.stop()
            grace = self.grace() if grace is None else grace
            killed = end_processes(self.procs, grace=grace)
            self._ended = True
        for pid in killed:
            rank = next((self._global_rank(i) for i, p in enumerate(self.procs) if p.pid == pid), "?")
            sys.stderr.write(f"shardline: ended rank {rank} (PID {pid}), which had not exited "
                             f"{grace:.1f} s after the run ended (stopped, hung or in uninterruptible I/O)\n")
        sys.stderr.flush()
        return killed

    def _global_rank(self, index: int) -> int:
        """``procs[index]`` is local rank ``index + 1`` of this node."""
        return self.cluster_environment.node_rank() * self.num_processes + index + 1


class _Observer(threading.Thread):
    """Watches the workers; on the first that ends with a non-zero status, has the verdict made, then ends the
    rest (see the module docstring)."""

    def __init__(self, launcher: ShardlineLauncher) -> None:
        super().__init__(daemon=True, name="shardline-launcher-observer")
        self._launcher = launcher
        self._stopped = threading.Event()

    def stop(self) -> None:
        self._stopped.set()

    def run(self) -> None:
        procs = self._launcher.procs
        while not self._stopped.wait(POLL_S):
            codes = [p.poll() for p in procs]
            failed = next((i for i, code in enumerate(codes) if code not in (None, 0)), None)
            if failed is not None:
                self._after_failure(failed, codes[failed])
                return
            if all(code == 0 for code in codes):
                return

    def _after_failure(self, index: int, code: int) -> None:
        launcher = self._launcher
        rank, how = launcher._global_rank(index), describe_exit(code)
        watchdog = getattr(launcher._strategy, "watchdog", None)
        if watchdog is None:  # before the ranks connected, or after the watchdog stopped: nobody else names it
            time.sleep(EARLY_GRACE_S)  # its own message (a recipe error, an import error) is printed first
            if self._stopped.is_set():
                return
            when = ("before the ranks connected" if getattr(launcher._strategy, "grid", None) is None
                    else "outside a fit (no collective watchdog)")
            sys.stderr.write(f"shardline: rank {rank} (PID {launcher.procs[index].pid}) {how} {when}; ending the "
                             "run\n")
            sys.stderr.flush()
            launcher.end_workers(grace=0.0)
            os._exit(EXIT_CODE)
        watchdog.report_exit(rank, how)
        timing = watchdog.timing
        # The verdict comes within tick + answer of the abort; then each rank prints it and ends within exit_grace.
        watchdog.wait_verdict(timing.tick + timing.answer + 2 * timing.tick + 2.0)
        if self._stopped.is_set():
            return
        launcher.end_workers(grace=timing.exit_grace + timing.tick)
