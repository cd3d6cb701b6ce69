"""A worker's exit is reported the moment it ends, even while a process it
started holds its stdout and stderr open; and one that ended by itself
before its agent's stop arrived is reported as ended by itself, not "on
request": adoption and the journal tell a crash from a stop by it
(elastic.agent.supervisor, elastic.agent.child)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from conftest import reaped
from elastic.agent.supervisor import WorkerSupervisor, _ended
from elastic.procs import signal_pid

LEAVES_A_PIPE_HOLDER = """
import pathlib, subprocess, sys
# a process it started outlives it and holds its stdout and stderr open
holder = subprocess.Popen(["sleep", "30"], start_new_session=sys.argv[1] == "session")
pathlib.Path("holder.pid").write_text(str(holder.pid))
sys.exit(1)
"""


def _supervisor(tmp_path, exits: list) -> tuple[WorkerSupervisor, asyncio.Event]:
    """A supervisor (in a running loop) that appends each exit report to
    `exits` and sets the event returned."""
    reported = asyncio.Event()
    sup = WorkerSupervisor(str(tmp_path / "state"), "inc",
                           lambda status: (exits.append(status), reported.set()))
    return sup, reported


def _exit_of(pid: int) -> None:
    """Return once child `pid` has exited (reaping nothing)."""
    try:
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
    except ChildProcessError:  # (asyncio's child watcher reaped it first)
        pass


@pytest.mark.parametrize("where", ["group", "session"])
def test_an_exit_is_reported_at_once_and_a_stop_after_it_is_not_its_reason(tmp_path, proc_env,
                                                                          where):
    """In the worker's process group, the holder goes with the group (the
    agent kills it once the worker has ended); in a session of its own it
    stays, and the agent reads the pipes for a second more. asyncio's
    Process.wait() would have waited for it (30 s here). The controller's
    stop arrives after the exit, while the pipes are still read."""
    (tmp_path / "worker.py").write_text(LEAVES_A_PIPE_HOLDER)
    exits = []

    async def scenario():
        sup, reported = _supervisor(tmp_path, exits)
        try:
            await sup.start(1, [sys.executable, "worker.py", where], dict(proc_env),
                            str(tmp_path))
            await asyncio.wait_for(asyncio.to_thread(_exit_of, sup.status.pid), 60)
            if where == "session":
                assert sup.running  # (its pipes are still read)
            await sup.stop(1, 0.0)
            await asyncio.wait_for(reported.wait(), 10)
            if where == "session":  # reported while the holder still runs
                assert signal_pid(int((tmp_path / "holder.pid").read_text()), 0)
        finally:
            sup.kill_now()

    try:
        asyncio.run(scenario())
    finally:
        signal_pid(int((tmp_path / "holder.pid").read_text()), 9)  # (gone with its group?)
    [status] = exits
    assert (status.exit_code, status.signal) == (1, 0)
    assert not status.stopped_on_request


def test_a_line_longer_than_the_pipe_reader_takes_does_not_hide_the_exit(tmp_path, proc_env):
    """asyncio's readline() raises ValueError past its limit (64 KiB): that
    ended the agent's reading of the worker's exit, which went unreported."""
    (tmp_path / "worker.py").write_text(
        "import sys\nsys.stderr.write('x' * 100_000 + '\\n')\n"
        "sys.stderr.write('the last words\\n')\nsys.exit(2)\n")
    exits = []

    async def scenario():
        sup, reported = _supervisor(tmp_path, exits)
        try:
            await sup.start(1, [sys.executable, "worker.py"], dict(proc_env), str(tmp_path))
            await asyncio.wait_for(reported.wait(), 60)
        finally:
            sup.kill_now()

    asyncio.run(scenario())
    [status] = exits
    assert status.exit_code == 2
    assert status.stderr_tail.splitlines()[-2:] == [
        "[elastic-agent: a line of over 64 KiB was left out]", "the last words"]


def test_ended_tells_a_child_that_exited_before_it_is_reaped(proc_env):
    with reaped(subprocess.Popen(["sleep", "30"], env=proc_env)) as running:
        assert not _ended(running.pid)
    with reaped(subprocess.Popen(["true"], env=proc_env)) as child:
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # (waits; reaps nothing)
        assert _ended(child.pid)  # a zombie
    assert _ended(child.pid)  # reaped


def test_a_start_whose_stop_came_while_it_waited_for_the_start_before_starts_nothing(
        tmp_path, proc_env):
    """The start of generation 1 is under way; the start of 2 waits for it,
    and the stop of 2 comes meanwhile. The stop waits for the start under
    way and finds only 1's worker; before, the start of 2 then ran a worker
    of a generation already stopped, which nothing stopped (found by reading
    the agent)."""
    exits = []

    async def scenario():
        sup, _ = _supervisor(tmp_path, exits)
        stopped_through = [0]
        argv = [sys.executable, "-c", "import time; time.sleep(60)"]
        try:
            first = asyncio.create_task(sup.start(1, argv, dict(proc_env), str(tmp_path)))
            second = asyncio.create_task(sup.start(2, argv, dict(proc_env), str(tmp_path),
                                                   overtaken=lambda: stopped_through[0] >= 2))
            await asyncio.sleep(0)  # (both under way: the second waits for the first)
            stopped_through[0] = 2  # the agent took the stop of 2
            await asyncio.gather(first, second, sup.stop(2, 0.0))
            return sup.running, sup.status.generation
        finally:
            await sup.stop(1 << 30, 0.0)

    running, generation = asyncio.run(scenario())
    assert not running, f"a worker of generation {generation} runs after its stop"
