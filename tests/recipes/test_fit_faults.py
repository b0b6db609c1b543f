"""A stopped worker under ``shardline fit`` (issue 46 §3), end to end as a user meets it: two ranks training,
rank 1 SIGSTOPped (as a debugger or a stuck disk would hold it). Rank 0 names it in one error, printed once,
and before rank 0 exits the stopped worker is gone (SIGKILL: a SIGTERM stays pending on a stopped process)."""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import time

import pytest

from shardline.plugins.testing import process_gone
from shardline.recipes.fit import RECIPES_DIR

from .test_fit import _command

TIMEOUT_S = 3  # the collective timeout: the stop is noticed after it, every rank is gone within it + 10 s


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as children:
        return [int(p) for p in children.read().split()]


def _read_until(proc: subprocess.Popen, marker: str, seconds: float, out: list[str]) -> bool:
    """Read ``proc``'s output into ``out`` until ``marker`` appears (True), it ends or ``seconds`` pass."""
    deadline = time.monotonic() + seconds
    fd = proc.stdout.fileno()
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                return False
            out.append(chunk.decode(errors="replace"))
            if marker in "".join(out[-2:]):
                return True
    return False


@pytest.mark.slow
def test_a_stopped_worker_is_named_once_and_ended_before_the_launcher_exits(tmp_path):
    head, _ = _command()
    dumps = tmp_path / "dumps"
    command = [*head, "fit", "--config", str(RECIPES_DIR / "tiny.yaml"), "--trainer.devices", "2",
               "--trainer.strategy.init_args.tp", "1", "--trainer.strategy.init_args.pp", "1",
               "--trainer.strategy.init_args.collective_timeout", str(TIMEOUT_S),
               "--trainer.strategy.init_args.collective_dump_dir", str(dumps),
               "--trainer.max_steps", "100000", "--trainer.limit_val_batches", "0", "--data.max_bytes", "100000",
               "--model.d_model", "32", "--model.n_layer", "1", "--trainer.logger", "false"]
    proc = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    out: list[str] = []
    worker = None
    try:
        assert _read_until(proc, "train_loss=", 240, out), "".join(out)[-4000:]
        (worker,) = _children(proc.pid)
        os.kill(worker, signal.SIGSTOP)
        stopped_at = time.monotonic()
        _read_until(proc, "\x00never", 120, out)  # everything, to the end
        proc.wait(timeout=30)
        took = time.monotonic() - stopped_at
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        if worker is not None and not process_gone(worker):
            os.kill(worker, signal.SIGKILL)
    text = "".join(out).replace("\r", "\n")
    assert proc.returncode == 1, text[-4000:]
    assert process_gone(worker), f"worker {worker} outlived the launcher"
    assert took < TIMEOUT_S + 20, took
    # Told once, by rank 0, with the rank and its group table; every rank's traceback written, the path said.
    errors = re.findall(r"shardline fit: error: CollectiveError: (.*)", text)
    assert len(errors) == 1 and errors[0].startswith("rank 1 is dead"), text[-4000:]
    assert re.search(r"group 0: ranks 0,1\n    rank 0: entered .*\n    rank 1: entered .*dead\]", text), text[-4000:]
    assert "Traceback (most recent call last)" not in text
    assert f"(each rank's full traceback: {dumps}/rank<N>-error.txt)" in text
    assert (dumps / "rank0-error.txt").read_text().startswith("Traceback")
    assert f"shardline: ended rank 1 (PID {worker})" in text
