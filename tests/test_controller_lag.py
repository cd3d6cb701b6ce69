"""The controller's own lag (elastic.controller.lag): a fake clock for the
window, a real event loop blocked for real for the probe."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from elastic.clock import FakeClock, SystemClock
from elastic.controller.lag import (NOISE_S, PAUSE_S, LagPromises, LoopLag, ReceiptDelay,
                                    ReceiveDrops)


@pytest.mark.parametrize("samples,now,window_s,allowance_s", [
    ([], 100.0, None, 0.0),
    ([(90.0, 1.5)], 100.0, None, 0.0),             # older than the window (5 s)
    ([(96.0, 1.5)], 100.0, None, 1.5),             # lag 4 s ago still counts
    ([(96.0, 1.5), (99.0, 0.5)], 100.0, None, 1.5),
    ([(96.0, 1.5), (99.0, 0.5)], 100.0, 1.0, 0.5),  # only the last second
    ([(99.5, NOISE_S / 2)], 100.0, None, 0.0),      # noise is not lag
])
def test_allowance_is_the_largest_lateness_in_the_window(samples, now, window_s, allowance_s):
    lag = LoopLag(FakeClock(), window_s=5.0)
    for at, late in samples:
        lag.note(late, at)
    assert lag.allowance_s(now, window_s) == allowance_s


def test_a_pause_is_forgiven_once_and_is_not_lag():
    lag = LoopLag(FakeClock(), window_s=5.0)
    assert lag.note(3.5, 100.0) == 3.5      # the loop's wake sees the pause
    assert lag.note(3.45, 100.02) == 0.0    # the probe sees the same pause
    assert lag.note(PAUSE_S + 1, 104.0) == PAUSE_S + 1      # another pause
    assert lag.note(PAUSE_S + 1, 105.0) == pytest.approx(1.0)  # half of it was forgiven
    assert lag.allowance_s(105.0) == 0.0    # pauses are forgiven, not allowed
    assert lag.note(0.5, 105.5) == 0.0 and lag.allowance_s(105.5) == 0.5


def test_allowance_matches_a_brute_force_maximum():
    rng = random.Random(7)
    lag, kept, at = LoopLag(FakeClock(), window_s=5.0), [], 0.0
    for _ in range(2_000):
        at += rng.uniform(0.0, 0.5)
        late = rng.choice([0.0, rng.uniform(0.0, PAUSE_S)])
        lag.note(late, at)
        kept.append((at, late))
        for window_s in (1.0, 5.0):
            expected = max((x for t, x in kept if t >= at - window_s and x >= NOISE_S),
                           default=0.0)
            assert lag.allowance_s(at, window_s) == expected


@pytest.mark.parametrize("promises,now,floor", [
    ([], 100.0, 0.0),
    ([(2.0, 110.0)], 100.0, 2.0),
    ([(2.0, 110.0)], 110.5, 0.0),                  # past what it was promised for
    ([(2.0, 110.0), (1.0, 112.0)], 105.0, 2.0),    # the larger while it holds,
    ([(2.0, 110.0), (1.0, 112.0)], 111.0, 1.0),    # then the longer one
    ([(1.0, 110.0), (2.0, 112.0)], 111.0, 2.0),    # a larger, longer one replaces it
    ([(0.0, 110.0), (-1.0, 110.0)], 105.0, 0.0),   # no lag: nothing promised
])
def test_the_lag_told_to_agents_holds_until_the_time_it_was_told_for(promises, now, floor):
    told = LagPromises()
    for lag_s, until in promises:
        told.promise(lag_s, until)
    assert told.floor(now) == floor


def test_promises_match_a_brute_force_maximum():
    rng = random.Random(11)
    told, kept, now = LagPromises(), [], 0.0
    for _ in range(2_000):
        now += rng.uniform(0.0, 0.5)
        lag_s = rng.uniform(0.0, 3.0)
        told.promise(lag_s, now + 5.0 + lag_s + 2.0)
        kept.append((lag_s, now + 5.0 + lag_s + 2.0))
        assert told.floor(now) == max(x for x, until in kept if until >= now)


def test_a_controller_judges_silence_against_the_lag_its_acks_told(tmp_path):
    """After an ack told an agent the controller runs 2 s behind, the
    controller's view keeps at least that lag for a heartbeat timeout, the
    lag and two intervals, though its own measure has dropped to 0."""
    from elastic.config import load_spec
    from elastic.controller.core import Controller
    from elastic.controller.journal import JournalWriter
    from tests.conftest import tiny_spec

    spec = load_spec(tiny_spec(tmp_path, ""))
    clock = FakeClock()
    controller = Controller(spec, JournalWriter(tmp_path / "state"), clock)
    h, start = spec.health, clock.monotonic()
    controller.promise_lag(2.0)
    held_s = h.heartbeat_timeout_s + 2.0 + 2 * h.heartbeat_interval_s
    for at, lag_s in ((start, 2.0), (start + held_s, 2.0), (start + held_s + 0.01, 0.0)):
        controller.judge_lag(at)
        assert (controller.view.lag_s, controller.measured_lag_s) == (lag_s, 0.0), at


@pytest.mark.parametrize("drops, at, lag_s", [
    ((), 10.0, 0.0),                                  # none
    (((5, 10.0),), 10.0, 5.0),                        # drops: the hold (5 s) is the lag
    (((5, 10.0),), 15.0, 5.0),                        # ... for the hold after them
    (((5, 10.0),), 15.1, 0.0),                        # ... and not after
    (((5, 10.0), (3, 14.0)), 18.5, 5.0),              # the last drop counts
    (((5, 10.0),), 9.0, 0.0),                         # not before they were seen
    (((0, 10.0),), 10.0, 0.0),                        # nothing dropped
])
def test_kernel_drops_stand_for_a_heartbeat_timeout_of_lag(drops, at, lag_s):
    """While the kernel drops heartbeat datagrams any host may have lost its
    heartbeats: silence is judged against the hold (a heartbeat timeout)
    more, until a hold after the last drop."""
    seen = ReceiveDrops(hold_s=5.0)
    for n, when in drops:
        seen.dropped(n, when)
    assert seen.lag_s(at) == pytest.approx(lag_s)
    assert seen.total == sum(n for n, _ in drops)


def test_a_controller_judges_silence_against_its_drops_without_telling_agents(tmp_path):
    """Drops make the view's lag a heartbeat timeout, held a timeout after
    the last; the lag acks tell agents and admission control reads (the
    loop's own) stays 0."""
    from elastic.config import load_spec
    from elastic.controller.core import Controller
    from elastic.controller.journal import JournalWriter
    from tests.conftest import tiny_spec

    spec = load_spec(tiny_spec(tmp_path, ""))
    clock = FakeClock()
    controller = Controller(spec, JournalWriter(tmp_path / "state"), clock)
    timeout, start = spec.health.heartbeat_timeout_s, clock.monotonic()
    controller.judge_lag(start)
    assert controller.view.lag_s == 0.0
    for _ in range(3):  # drops at 0, 1 and 2 intervals
        controller.count_dropped(100)
        controller.judge_lag(clock.monotonic())
        assert (controller.view.lag_s, controller.measured_lag_s) == (timeout, 0.0)
        assert controller.behind_s() == 0.0
        clock.advance(spec.health.heartbeat_interval_s)
    last = start + 2 * spec.health.heartbeat_interval_s
    controller.judge_lag(last + timeout)
    assert controller.view.lag_s == timeout
    controller.judge_lag(last + timeout + 0.01)
    assert controller.view.lag_s == 0.0 and controller.drops.total == 300


def test_heartbeats_queued_on_a_stream_before_it_was_taken_up_are_not_lag(tmp_path):
    """A stream waits in gRPC's queue of calls until the controller takes it
    up, and the agent's heartbeats queue on it meanwhile: read then, their
    delay is that stream's wait, not the controller's lag (a wave of such
    streams made it judge every host's silence 70 s behind). Heartbeats sent
    once the stream was taken up count as before; both show as latency."""
    from elastic.config import load_spec
    from elastic.controller.core import Controller
    from elastic.controller.executor import Session
    from elastic.controller.journal import JournalWriter
    from elastic.controller.servicer import ControllerServicer
    from elastic.policy import view as v
    from elastic.v1 import control_pb2 as pb
    from tests.conftest import tiny_spec

    spec = load_spec(tiny_spec(tmp_path, ""))
    clock = FakeClock()
    controller = Controller(spec, JournalWriter(tmp_path / "state"), clock)
    latencies: list[float] = []
    controller.on_heartbeat_latency = latencies.append
    servicer = ControllerServicer(controller, authenticated=False)
    session = controller.sessions["h0"] = Session("h0", "inc-h0")
    controller.submit(v.Registered("h0", "inc-h0", 1, "127.0.0.1", "h0", 1, 0, v.WorkerObs()))
    clock.advance(60.0)  # the stream waited a minute to be taken up
    session.attached, session.attached_at = True, clock.time()

    def heartbeat(seq: int, sent_at: float) -> pb.AgentMessage:
        return pb.AgentMessage(
            header=pb.Header(job_id=spec.job_id, host_id="h0", incarnation="inc-h0", seq=seq),
            heartbeat=pb.Heartbeat(seq=seq, sent_at=sent_at, worker=pb.WorkerStatus(
                state=pb.WORKER_IDLE, step=-1, committed_step=-1)))

    for seq, age_s in enumerate((59.0, 40.0, 1.0), start=1):  # queued while it waited
        servicer._handle(session, heartbeat(seq, clock.time() - age_s))
    assert controller.receipts.latencies() == []
    assert latencies == [59.0, 40.0, 1.0]
    clock.advance(0.5)
    servicer._handle(session, heartbeat(4, clock.time() - 0.2))  # sent after the take-up
    assert controller.receipts.latencies() == [pytest.approx(0.2)]
    for seq in range(5, 8):
        servicer._handle(session, heartbeat(seq, clock.time() - 0.2))
    controller.judge_lag(clock.monotonic())
    assert controller.view.lag_s == pytest.approx(0.2)


def test_the_probe_measures_a_loop_that_was_blocked():
    async def main():
        lag = LoopLag(SystemClock(), window_s=5.0)
        probe = asyncio.create_task(lag.probe(on_pause=None))
        await asyncio.sleep(0)  # (the probe starts sleeping)
        time.sleep(0.6)  # the loop runs nothing meanwhile
        while lag.worst_s == 0.0:
            await asyncio.sleep(0.01)
        probe.cancel()
        return lag.allowance_s(time.monotonic())

    assert 0.45 <= asyncio.run(asyncio.wait_for(main(), 10)) < 5.0


def test_receipt_delay_is_the_median_of_the_last_second():
    delays = ReceiptDelay()
    for latency in (0.001, 0.002, 0.004):
        delays.note(latency, at=100.0)
    assert delays.recent_s(100.5) == 0.002
    # behind: heartbeats read 2 s late; one host's clock is 40 s off
    for latency in (2.0, 2.1, 42.0, 1.9, -38.0):
        delays.note(latency, at=110.0)
    assert delays.recent_s(110.2) == 2.0
    assert delays.recent_s(112.0) == 0.0          # nothing in the last second
    for latency in (-5.0, -4.0, -6.0):            # clocks ahead: no negative lag
        delays.note(latency, at=113.0)
    assert delays.recent_s(113.1) == 0.0
    delays.note(3.0, at=114.0)                    # fewer than MIN_SAMPLES: no figure
    assert delays.recent_s(114.1) == 0.0
    # thousands a second: the median of the latest MEDIAN_OF (here 2.5 s late,
    # after a backlog of 0.5 s that came first)
    for i in range(5 * ReceiptDelay.MEDIAN_OF):
        delays.note(0.5 if i < 4 * ReceiptDelay.MEDIAN_OF else 2.5, at=120.0 + i * 1e-5)
    assert delays.recent_s(120.5) == 2.5


def test_one_hosts_backlog_after_a_partition_is_not_the_controllers_lag():
    """A stream cut by a partition delivers the heartbeats it queued all at
    once when the link heals, each as late as it waited: before, they made
    the median of the last second (10.8 s), the controller judged itself
    behind and deferred that very host's registration for 20 s, and lost it
    (tests/test_isolation.py, 2026-11-29). Only a host's latest counts."""
    delays = ReceiptDelay()
    for i in range(4):  # two hosts heartbeat as usual
        delays.note(0.003, at=200.0 + 0.25 * i, host="host-0")
        delays.note(0.004, at=200.1 + 0.25 * i, host="host-2")
    for i in range(40):  # host-1's 10 s of queued heartbeats, the newest last
        delays.note(10.0 - 0.25 * i, at=200.9 + i * 1e-4, host="host-1")
    assert delays.recent_s(200.95) == 0.004
    # two hosts, the backlog read halfway when a pass asks (its newest read
    # so far still 5 s late): the healthy host's figure, not the late one's
    two = ReceiptDelay()
    two.note(0.003, at=400.0, host="host-0")
    for i in range(20):
        two.note(10.0 - 0.25 * i, at=400.1 + i * 1e-4, host="host-1")
    assert two.recent_s(400.2) == 0.003
    # thousands of hosts each read late: the controller is behind
    for i in range(3000):
        delays.note(2.0, at=300.0 + i * 1e-4, host=f"h{i}")
    assert delays.recent_s(300.5) == 2.0


@pytest.mark.parametrize("sent_at, resumed_at, latency", [
    (99.5, None, 0.5),        # no pause yet
    (0.0, None, None),        # no send time (an agent too old to send one)
    (97.0, 99.0, None),       # sent while the controller was paused: no lag
    (99.2, 99.0, 0.8),        # sent after it resumed
])
def test_only_heartbeats_sent_since_the_controller_last_ran_again_are_lag(
        sent_at, resumed_at, latency):
    delays = ReceiptDelay()
    if resumed_at is not None:
        delays.resumed(resumed_at)
    assert delays.heard(sent_at, received_at=100.0, at=5.0) == pytest.approx(latency)
    assert delays.latencies() == ([] if latency is None else [pytest.approx(latency)])


def test_a_burst_of_events_is_decided_in_batches(tmp_path):
    """Passes that take 20 ms (a slice of thousands of hosts), woken by an
    event every 2 ms: the loop spends at most a third of its time deciding
    (elastic.controller.core.PASS_SPACING = 2), and the last event is decided."""
    from elastic.config import load_spec
    from elastic.controller.core import Controller
    from elastic.controller.journal import JournalWriter
    from elastic.policy.view import Registered, WorkerObs
    from tests.conftest import tiny_spec

    controller = Controller(load_spec(tiny_spec(tmp_path, min_hosts=2, max_hosts=2)),
                            JournalWriter(tmp_path / "state"), SystemClock())
    passes: list[tuple[float, float, int]] = []  # (start, end, hosts seen)

    def reconcile() -> None:
        start = time.monotonic()
        time.sleep(0.02)
        passes.append((start, time.monotonic(), len(controller.view.hosts)))

    controller.reconcile = reconcile

    async def main() -> float:
        async def events() -> None:
            for i in range(200):
                controller.submit(Registered(f"h{i}", "inc", 1, "127.0.0.1", f"h{i}", 1, 0,
                                             WorkerObs()))
                await asyncio.sleep(0.002)

        burst = asyncio.create_task(events())
        began, pass_s = time.monotonic(), 0.0
        while not burst.done() or passes[-1][2] < 200:
            pass_s = await controller._pass(pass_s)
        return time.monotonic() - began

    elapsed = asyncio.run(asyncio.wait_for(main(), 10))  # (a pass that never sees the
    # last event fails here instead of hanging)
    busy = sum(end - start for start, end, _ in passes)
    # a third at PASS_SPACING 2, and slack (without the spacing: 0.96)
    assert busy / elapsed <= 0.4, (busy, elapsed, len(passes))


def test_nothing_is_journaled_after_the_controllers_own_stop(tmp_path):
    """A killed host's agent registering again while the server shut down was
    journaled after `controller_stopped` (two pytest workers, test_chaos)."""
    from elastic.clock import FakeClock
    from elastic.controller.executor import Executor
    from elastic.controller.journal import JournalWriter, read_journal
    from tests.policy_tables import spec

    executor = Executor(spec(), JournalWriter(tmp_path), FakeClock())
    executor.record("job_succeeded", 2, "all exited 0")
    executor.record("controller_stopped", 2, "the job ended")
    executor.record("host_registered", 0, "2 devices", "host-1")
    assert [e["kind"] for e in read_journal(tmp_path)] == ["job_succeeded", "controller_stopped"]
