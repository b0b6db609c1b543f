"""Fixtures of the recipe tests: running the ``shardline`` command as a user does."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

#: Generous: 4 fresh interpreters importing torch + Lightning + DeepSpeed on 2 shared cores.
COMMAND_TIMEOUT_S = 300


def _run_command(command: list[str], cwd: Path, timeout: int = COMMAND_TIMEOUT_S) -> subprocess.CompletedProcess:
    # Own session, so a timeout kills the launcher *and* the workers it started; never a hang.
    proc = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{command} did not finish in {timeout} s; output tail:\n{out[-4000:]}")
    return subprocess.CompletedProcess(command, proc.returncode, out)


@pytest.fixture
def run_command():
    """``run_command(command, cwd, timeout=300)``: the command's CompletedProcess (stdout and stderr together);
    a timeout kills its whole process group and fails the test with the output's tail."""
    return _run_command
