"""elastic.procs: a pid or process group that is not one process's own is
never signalled. kill(2) reads 0 as the caller's own process group and -1
as every process it may signal (killpg(1) is kill(-1)): a worker pid of 0,
read before the worker was reported, once killed a whole `make test` run —
make, pytest and both its workers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from elastic import procs


@pytest.fixture
def calls(monkeypatch):
    """Record os.kill and os.killpg calls instead of making them."""
    made = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: made.append(("kill", pid, sig)))
    monkeypatch.setattr(os, "killpg", lambda pgid, sig: made.append(("killpg", pgid, sig)))
    return made


@pytest.mark.parametrize("pid", [0, -1, -12345])
def test_no_pid_of_zero_or_less_is_signalled(calls, pid):
    assert procs.signal_pid(pid, signal.SIGKILL) is False
    assert calls == []


@pytest.mark.parametrize("pgid", [0, 1, -1, -12345])
def test_no_group_of_one_or_less_is_signalled(calls, pgid):
    assert procs.signal_group(pgid, signal.SIGKILL) is False
    assert calls == []


def test_a_real_process_and_its_group_are_signalled():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             **procs.WORKER_PROCESS_GROUP)
    try:
        assert procs.signal_pid(child.pid, signal.SIGSTOP) is True
        assert procs.signal_group(child.pid, signal.SIGKILL) is True
        assert child.wait(10) == -signal.SIGKILL
        # gone (reaped): nothing to deliver to
        assert procs.signal_pid(child.pid, signal.SIGKILL) is False
        assert procs.signal_group(child.pid, signal.SIGKILL) is False
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
