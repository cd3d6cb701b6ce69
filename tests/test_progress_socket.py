"""The agent's progress socket takes reports only from its own user."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
import uuid

import pytest

from elastic.worker.progress import ProgressReceiver, ProgressReporter, Report, decode


def test_reports_from_another_user_are_dropped(proc_env):
    setpriv = shutil.which("setpriv")
    if setpriv is None or os.geteuid() != 0:
        pytest.skip("needs root and util-linux setpriv to send as another user")
    address = f"@elastic-progress-test-{uuid.uuid4().hex[:8]}"
    received: list[bytes] = []

    async def main():
        got = asyncio.Event()
        receiver = ProgressReceiver(address, lambda data: (received.append(data), got.set()))
        receiver.attach(asyncio.get_running_loop())
        try:
            # the other user sends a well-formed report with the standard
            # library only (it may not be able to read this checkout)
            payload = Report(7, step=10**9).encode()
            forged = ("import socket, sys; s = socket.socket(socket.AF_UNIX, "
                      "socket.SOCK_DGRAM); s.sendto(bytes.fromhex(sys.argv[1]), "
                      "b'\\0' + sys.argv[2][1:].encode())")
            await asyncio.to_thread(subprocess.run, [
                setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable,
                "-I", "-c", forged, payload.hex(), address], env=proc_env, check=True,
                timeout=60)
            ProgressReporter(address, 7).step(3, loss=1.5)  # this user: the worker's
            await asyncio.wait_for(got.wait(), 10)
            return receiver.dropped
        finally:
            receiver.close()

    dropped = asyncio.run(main())
    assert dropped == 1
    assert [decode(d).step for d in received] == [3]


def test_the_last_reports_reach_a_slow_agent_when_the_worker_finishes():
    """Reports that find the agent's socket full are dropped (training never
    waits for the agent); at the end there is no next report to carry the
    last step, so close() sends the last step and committed step again and
    waits for room. Here the agent reads nothing until the worker has sent
    600 steps (more than any queue of Linux's datagram sockets holds), then
    reads while close() waits."""
    import threading

    address = f"@elastic-progress-test-{uuid.uuid4().hex[:8]}"
    received: list[Report] = []
    receiver = ProgressReceiver(address, lambda data: received.append(decode(data)))
    try:
        reporter = ProgressReporter(address, 3)
        reporter.committed(399)
        for step in range(600):
            reporter.step(step, loss=1.0 / (step + 1))
        assert reporter.dropped > 0  # the agent was too slow for them all
        closing = threading.Thread(target=reporter.close)
        closing.start()
        _read_while(closing, receiver)  # the agent catches up while close() waits for room
        last = received[-2:]
        assert Report(3, step=599, metrics={"loss": 1.0 / 600}) in last, last
        assert Report(3, committed_step=399) in last, last
        count = len(received)
        reporter.step(600)  # after close: nothing sent
        receiver.receive()
        assert len(received) == count
    finally:
        receiver.close()


def _slow_agent(address: str) -> tuple[ProgressReceiver, list[Report], ProgressReporter]:
    """An agent's receiver at `address` that has read nothing while a
    reporter of generation 3 sent 600 steps, more than any queue of Linux's
    datagram sockets holds (some were dropped): (receiver, the reports it
    will have read, reporter)."""
    received: list[Report] = []
    receiver = ProgressReceiver(address, lambda data: received.append(decode(data)))
    reporter = ProgressReporter(address, 3)
    for step in range(600):
        reporter.step(step)
    assert reporter.dropped > 0
    return receiver, received, reporter


def _read_while(thread, receiver: ProgressReceiver) -> None:
    """Read as the agent does while `thread` (waiting at most FLUSH_S a
    report for room) runs, then what is left."""
    while thread.is_alive():
        receiver.receive()
    receiver.receive()


def test_a_worker_failing_tells_even_a_slow_agent_why():
    """The word that a worker is failing (and whether by its own error or a
    peer's) decides which host is blamed: like the last reports, it waits
    for room in a full socket instead of being dropped."""
    import threading

    receiver, received, reporter = _slow_agent(f"@elastic-progress-test-{uuid.uuid4().hex[:8]}")
    try:
        failing = threading.Thread(target=reporter.failing, args=("peer",))
        failing.start()
        _read_while(failing, receiver)
        assert received[-1] == Report(3, failure="peer"), received[-1]
        with pytest.raises(ValueError, match="failure cause 'both'"):
            reporter.failing("both")
        with pytest.raises(ValueError, match="failure"):
            decode(b'{"g":3,"x":"both"}')
    finally:
        receiver.close()

PREEMPTED_WORKER = """
import logging, sys, types
from elastic.worker.progress import ProgressReporter
from elastic.worker.runtime import WorkerContext
reporter = ProgressReporter(sys.argv[1], 3)
for step in range(600):
    reporter.step(step)
dropped = reporter.dropped
reporter.committed(599)  # (the emergency checkpoint: its report finds the socket full,
assert reporter.dropped == dropped  # and waits in the backlog)
print("filled", flush=True)  # (the agent may read now)
ctx = types.SimpleNamespace(progress=reporter, log=logging.getLogger("w"))
WorkerContext._preempted(ctx, 599, True, wait_s=0.0)  # (exits 75)
"""


def test_a_preempted_worker_sends_its_emergency_commit_again(proc_env):
    """The controller stops a preempted slice once it hears that the
    emergency checkpoint committed; a worker that has saved it takes no
    further step, so nothing would carry a dropped report of it."""
    address = f"@elastic-progress-test-{uuid.uuid4().hex[:8]}"
    received: list[Report] = []
    receiver = ProgressReceiver(address, lambda data: received.append(decode(data)))
    try:
        worker = subprocess.Popen([sys.executable, "-c", PREEMPTED_WORKER, address],
                                  env=proc_env, stdout=subprocess.PIPE, text=True)
        try:
            assert worker.stdout.readline() == "filled\n"  # (its commit report waits)
            deadline = time.monotonic() + 60
            while worker.poll() is None and time.monotonic() < deadline:
                receiver.receive()  # (its resend waits for room while this reads)
        finally:
            if worker.poll() is None:
                worker.kill()
            worker.wait()
            worker.stdout.close()
        receiver.receive()
        assert worker.returncode == 75
        assert Report(3, committed_step=599) in received[-2:], received[-2:]
    finally:
        receiver.close()


def test_an_event_that_finds_the_socket_full_is_sent_later_without_blocking():
    """Step reports that find the agent's socket full are dropped (the next
    one carries the newer step); an event is the only one of its kind (a
    save's journal entry, the snapshot a buddy copies), so a thread sends it
    once there is room, and training does not wait for that."""
    receiver, received, reporter = _slow_agent(f"@elastic-progress-test-{uuid.uuid4().hex[:8]}")
    try:
        dropped = reporter.dropped
        reporter.event("checkpoint_saved", "save of step 599 started", step=599)
        assert reporter.dropped == dropped  # (kept, not dropped, and not waited for here)
        reporter.step(600)
        assert reporter.dropped == dropped + 1  # (a step report still is)
        sender = reporter._backlog_sender
        assert sender is not None
        _read_while(sender, receiver)
        saved = Report(3, event="checkpoint_saved", reason="save of step 599 started",
                       fields={"step": 599})
        assert saved in received and reporter.dropped == dropped + 1
    finally:
        receiver.close()


def test_a_commit_that_finds_the_socket_full_is_sent_later_without_blocking():
    """No later report carries a committed step (a step report does not), and
    the controller's grow and preemption drain wait on it: before, a commit
    report that found the socket full was dropped until the next commit, a
    whole interval later (an audit of the agent found it)."""
    receiver, received, reporter = _slow_agent(f"@elastic-progress-test-{uuid.uuid4().hex[:8]}")
    try:
        dropped = reporter.dropped
        reporter.committed(500)
        assert reporter.dropped == dropped
        sender = reporter._backlog_sender
        assert sender is not None
        _read_while(sender, receiver)
        assert Report(3, committed_step=500) in received
    finally:
        receiver.close()


class _Steps:
    """Records the step reports a WorkerContext makes (a ProgressReporter's
    `step` and `event`, without a socket)."""

    def __init__(self) -> None:
        self.reports: list[tuple[int, dict]] = []

    def step(self, step: int, **metrics: float) -> None:
        self.reports.append((step, metrics))

    def event(self, kind: str, reason: str, **fields) -> None:
        pass


def test_the_step_time_is_reported_from_the_second_step_on():
    """Before, step_time_s came with every 10th measured step only, the first
    with the 11th step of each generation; until then the controller knew no
    step time for the generation and a job of steps over 10 s read as hung
    at its second step. Now each step report from the second on carries it
    (no extra message: a field of the report sent anyway)."""
    import logging

    from elastic.worker.runtime import WorkerContext
    steps = _Steps()
    ctx = WorkerContext(env=None, mesh=None, process_index=1, process_count=2, generation=3,
                        progress=steps, log=logging.getLogger("test"), timings={})
    for step in range(3):
        ctx.step_done(step, loss=2.0)
    assert [s for s, _ in steps.reports] == [0, 1, 2]
    assert "step_time_s" not in steps.reports[0][1]  # (no step measured yet)
    for _, metrics in steps.reports[1:]:
        assert metrics["step_time_s"] > 0 and metrics["loss"] == 2.0
