"""Processes that end with the one that started them, and ending the ones that did not.

:func:`die_with_parent` asks the kernel to SIGKILL the calling process when its parent ends (Linux's
``PR_SET_PDEATHSIG``; elsewhere it returns False and nothing is armed). SIGKILL because a process that is stopped
(SIGSTOP, a debugger) keeps a SIGTERM pending forever, and one in a hung collective ignores it.
:func:`end_processes` waits a bounded time for processes to finish on their own, then SIGKILLs and reaps the rest.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time

_PR_SET_PDEATHSIG = 1


def die_with_parent(expected_parent: int | None = None) -> bool:
    """Arm SIGKILL-on-parent-death for this process; True if armed. With ``expected_parent``, a parent already
    gone (this process was reparented before the call) ends this process at once, as the kernel would have."""
    if not sys.platform.startswith("linux"):
        return False
    with contextlib.suppress(OSError, AttributeError):
        if ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
            return False
        if expected_parent is not None and os.getppid() != expected_parent:
            os.kill(os.getpid(), signal.SIGKILL)
        return True
    return False


def end_processes(procs: list[subprocess.Popen], *, grace: float) -> list[int]:
    """Wait up to ``grace`` seconds for every process of ``procs`` to exit, then SIGKILL and reap those still
    there (stopped, hung or just slow); returns the PIDs that had to be killed."""
    deadline = time.monotonic() + max(grace, 0.0)
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    killed = []
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            killed.append(proc.pid)
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
    return killed


def describe_exit(code: int) -> str:
    """``-9`` as ``"was killed by SIGKILL"``, ``3`` as ``"exited with code 3"``."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"
