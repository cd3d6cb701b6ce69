"""Table-driven tests of the pure decisions about starting a generation:
waiting for hosts, settling, streams that are still opening, coordinators
and failure domains (fake clock; builders in policy_tables.py)."""

from __future__ import annotations

import pytest

from elastic.policy import decide as d
from elastic.policy import silence
from elastic.policy.decide import Phase, SliceState, decide
from elastic.policy.view import (ClusterView, Disconnected, HeartbeatReceived, ProgressReported,
                                 WorkerObs, observe)
from tests.policy_tables import T0, kinds, register, spec

@pytest.mark.parametrize("registered,min_hosts,max_hosts,dt,started", [
    (1, 2, 4, 5.0, None),  # below min_hosts: wait, say so
    (2, 2, 4, 0.5, None),  # enough, but settling for more
    (2, 2, 4, 1.5, 2),     # settled: start with what there is
    (4, 2, 4, 0.0, 4),     # max_hosts reached: start at once
    (5, 1, 4, 0.0, 4),     # more than max_hosts: only max_hosts join
])
def test_waiting_table(registered, min_hosts, max_hosts, dt, started):
    view = ClusterView()
    for i in range(registered):
        register(view, f"h{i}")
    s = spec(min_hosts=min_hosts, max_hosts=max_hosts)
    decision = decide(SliceState(phase_since=T0), view, T0 + dt, s)
    starts = [a for a in decision.actions if isinstance(a, d.StartWorker)]
    if started is None:
        assert decision.state.phase is Phase.WAITING and not starts
        assert ("waiting" in decision.reason)
    else:
        assert decision.state.phase is Phase.STARTING
        assert len(starts) == started
        assert [a.process_id for a in starts] == list(range(started))
        assert {a.num_processes for a in starts} == {started}
        assert decision.state.generation == 1
        assert kinds(decision) == ["generation_started"]


@pytest.mark.parametrize("streams,disconnected,started", [
    (("h0", "h1", "h2"), (), 3),
    (("h0", "h1"), (), None),      # h2 only registered: a start would wait in its outbox
    (("h0", "h1", "h2"), ("h2",), None),  # h2's stream closed (within reconnect_grace_s)
])
def test_only_hosts_with_an_open_stream_start(streams, disconnected, started):
    view = ClusterView()
    for h in ("h0", "h1", "h2"):
        register(view, h, stream=h in streams)
    for h in disconnected:
        observe(view, Disconnected(h, f"inc-{h}"), T0 + 0.1)
    decision = decide(SliceState(phase_since=T0), view, T0 + 0.2, spec(min_hosts=3, max_hosts=3))
    starts = [a.host for a in decision.actions if isinstance(a, d.StartWorker)]
    if started is None:
        assert decision.state.phase is Phase.WAITING and not starts
        if len(streams) < 3:
            assert "1 registered host has not opened a stream yet" in decision.reason
    else:
        assert sorted(starts) == ["h0", "h1", "h2"]


@pytest.mark.parametrize("h2_streams_at,started_at,hosts", [
    (3.0, 3.0, 3),    # its stream opened late: all three start then (max_hosts reached)
    (None, silence.STREAM_OPEN_S + 0.1, 2),  # never: it is lost, the other two start
])
def test_the_first_generation_waits_for_streams_still_opening(h2_streams_at, started_at, hosts):
    """min_hosts 2, max_hosts 3; h2 registered with the others but its stream
    has not sent anything: the settle (1 s) ends, the slice still waits."""
    view, s = ClusterView(), spec(min_hosts=2, max_hosts=3)
    for h in ("h0", "h1", "h2"):
        register(view, h, stream=h != "h2")
    state = SliceState(phase_since=T0)
    for at in (1.5, 2.0, started_at - 0.2, started_at):
        for record in list(view.hosts.values()):  # the others heartbeat
            if record.streamed:
                observe(view, HeartbeatReceived(record.host_id, record.incarnation,
                                                record.worker, 0), T0 + at)
        if at == h2_streams_at:
            observe(view, HeartbeatReceived("h2", "inc-h2", WorkerObs(), 0), T0 + at)
        decision = decide(state, view, T0 + at, s)
        state = decision.state
        starts = [a.host for a in decision.actions if isinstance(a, d.StartWorker)]
        if at < started_at:
            assert state.phase is Phase.WAITING and not starts, at
            assert "1 registered host has not opened a stream yet" in decision.reason, at
        else:
            assert len(starts) == hosts and state.phase is Phase.STARTING


def test_a_host_registering_again_and_again_without_a_stream_holds_no_start_for_long():
    """h2 registers every 1.9 s (new incarnations) and never sends on a
    stream: the wait for its stream counts from its first registration, so
    h0 and h1 start once STREAM_OPEN_S has passed, not after
    restart.waiting_timeout_s."""
    view, s = ClusterView(), spec(min_hosts=1, max_hosts=3)
    for h in ("h0", "h1"):
        register(view, h)
    state, at, started = SliceState(phase_since=T0), 0.0, None
    while at < 3 * silence.STREAM_OPEN_S and started is None:
        at += 1.9
        register(view, "h2", now=T0 + at, incarnation=f"flap-{int(at / 1.9) % 2}",
                 stream=False)
        for h in ("h0", "h1"):
            observe(view, HeartbeatReceived(h, f"inc-{h}", view.hosts[h].worker, 0), T0 + at)
        decision = decide(state, view, T0 + at + 0.5, s)
        state = decision.state
        if state.phase is Phase.STARTING:
            started = at
    assert started is not None and started <= silence.STREAM_OPEN_S + 2 * 1.9 + 1.0, started
    assert state.members == ("h0", "h1")


def test_a_streams_first_message_wakes_the_decisions_and_a_plain_heartbeat_does_not():
    view = ClusterView()
    register(view, "h0", stream=False)
    beat = HeartbeatReceived("h0", "inc-h0", view.hosts["h0"].worker, 0)
    assert observe(view, beat, T0 + 0.1) == (True, [])   # h0 can be started now
    assert observe(view, beat, T0 + 1.1) == (False, [])  # nothing a decision reads changed
    register(view, "h1", stream=False)  # an agent sends what it queued before a heartbeat
    progress = ProgressReported("h1", "inc-h1", 0, -1, -1)
    assert observe(view, progress, T0 + 1.2) == (True, [])
    assert observe(view, progress, T0 + 1.3) == (False, [])


def test_below_min_hosts_journaled_once():
    view = ClusterView()
    register(view, "h0")
    s = spec(min_hosts=3)
    first = decide(SliceState(phase_since=T0), view, T0, s)
    again = decide(first.state, view, T0 + 1, s)
    assert kinds(first) == ["waiting_for_hosts"] and "min_hosts is 3" in first.reason
    assert kinds(again) == []


def test_coordinator_follows_rank_zero_and_its_free_port():
    view = ClusterView()
    for h in ("h1", "h2"):
        register(view, h)
    decision = decide(SliceState(), view, T0 + 2, spec(max_hosts=2))
    starts = [a for a in decision.actions if isinstance(a, d.StartWorker)]
    assert starts[0].host == "h1"
    assert {a.coordinator_address for a in starts} == {"10.0.0.1:5001"}


def test_coordinator_port_of_previous_generation_is_not_reused():
    view = ClusterView()
    register(view, "h1")
    state = SliceState(generation=3, coordinator="10.0.0.1:5001")
    same = decide(state, view, T0 + 2, spec(max_hosts=1))
    assert same.state.phase is Phase.WAITING and "fresh coordinator port" in same.reason
    observe(view, HeartbeatReceived("h1", "inc-h1", WorkerObs(), 6001), T0 + 2.1)
    fresh = decide(same.state, view, T0 + 2.1, spec(max_hosts=1))
    assert fresh.state.phase is Phase.STARTING and fresh.state.coordinator == "10.0.0.1:6001"


def test_failure_domains_whole_only():
    view = ClusterView()
    # domain a complete (2 hosts), domain b has one of its two hosts
    for host, dom in (("h0", "a"), ("h1", "a"), ("h2", "b")):
        register(view, host, domain=dom)
    s = spec(max_hosts=4, hosts_per_failure_domain=2)
    decision = decide(SliceState(), view, T0 + 2, s)
    starts = [a.host for a in decision.actions if isinstance(a, d.StartWorker)]
    assert starts == ["h0", "h1"]


@pytest.mark.parametrize("streamed,after_s,lost", [
    (True, 5.1, True),
    (False, 5.1, False),   # registered, its stream not taken up yet (a storm)
    (False, silence.STREAM_OPEN_S + 0.1, True)])
def test_a_registered_host_has_time_to_open_its_stream(streamed, after_s, lost):
    view = ClusterView()
    register(view, "h0", stream=streamed)
    decision = decide(SliceState(phase_since=T0), view, T0 + after_s, spec(min_hosts=2))
    assert ("host_lost" in kinds(decision)) is lost
