"""Hosts that differ, in the pure decisions (fake clock): a host whose
devices do not fit is left out and said so, a member that loses a device
costs one restart, a spec no set of hosts satisfies waits, and the wait is
bounded. (The planner's own tables: test_mesh.py; end to end:
test_degraded_host.py.)"""

from __future__ import annotations

import pytest

from elastic.config import MeshSpec
from elastic.policy import decide as d
from elastic.policy.decide import Phase, SliceState, decide
from elastic.policy.view import ClusterView, HeartbeatReceived, observe
from tests.policy_tables import (T0, heartbeat_all, kinds, register, running_slice, spec,
                                 stop_and_settle)


def starts(decision: d.Decision) -> list[d.StartWorker]:
    return [a for a in decision.actions if isinstance(a, d.StartWorker)]


def journal(decision: d.Decision, kind: str) -> list[d.Journal]:
    return [a for a in decision.actions if isinstance(a, d.Journal) and a.kind == kind]


def devices_now(view: ClusterView, host: str, devices: int, now: float, kind: str = "cpu"):
    """`host`'s agent counts `devices` now (a heartbeat carries it); its facts."""
    record = view.hosts[host]
    return observe(view, HeartbeatReceived(host, record.incarnation, record.worker, 0,
                                           devices=devices, device_kind=kind), now)


def test_a_degraded_host_is_left_out_and_journaled_once():
    view = ClusterView()
    for host, n in (("h0", 2), ("h1", 2), ("h2", 2), ("h3", 1)):
        register(view, host, devices=n)
    s = spec(max_hosts=4, mesh=MeshSpec.from_text("data=-1,model=2"))
    first = decide(SliceState(phase_since=T0), view, T0 + 2, s)
    assert [a.host for a in starts(first)] == ["h0", "h1", "h2"]
    assert {a.devices_per_host for a in starts(first)} == {2}
    left = journal(first, "host_left_out")
    assert [(a.host, a.reason) for a in left] == [
        ("h3", "reports 1 device; the slice's hosts use 2")]
    assert "left out: h3" in first.reason and first.state.left_out == {"h3": left[0].reason}
    # not a failure of anyone: no restart, no quarantine count
    assert first.state.host_failures == {} and first.state.restarts == 0
    again = decide(first.state, view, T0 + 3, s)
    assert journal(again, "host_left_out") == []


def test_a_member_that_loses_a_device_costs_one_restart():
    view = ClusterView()
    hosts = ["h0", "h1", "h2"]
    for h in hosts:
        register(view, h)
    s = spec(max_hosts=3)
    state = running_slice(view, hosts)
    facts = devices_now(view, "h1", 1, T0 + 5)
    assert facts[0] and facts[1][0].kind == "host_devices_changed"
    assert "now counts 1 cpu device(s); it had 2 cpu" in facts[1][0].reason
    stopping = decide(state, view, T0 + 5, s)
    assert stopping.state.phase is Phase.STOPPING
    assert "host h1 now reports 1 device(s); generation 1 uses 2 per host" in stopping.reason
    after = stop_and_settle(state, view, T0 + 5, s)
    restarted = decide(after.state, view, T0 + 6, s)
    assert [a.host for a in starts(restarted)] == ["h0", "h2"]
    assert restarted.state.generation == 2 and restarted.state.restarts == 1
    assert [a.host for a in journal(restarted, "host_left_out")] == ["h1"]
    # a failure of that host like any other: it counts toward its quarantine
    # and the restart budget (a chip that fails again and again is set aside)
    assert list(stopping.state.host_failures) == ["h1"]
    assert stopping.state.failures_without_progress == 1


def test_an_agent_that_comes_back_with_fewer_devices_is_left_out():
    view = ClusterView()
    for h in ("h0", "h1", "h2"):
        register(view, h)
    s = spec(max_hosts=3)
    state = running_slice(view, ["h0", "h1", "h2"])
    register(view, "h2", now=T0 + 5, devices=1, incarnation="inc-h2-b")  # restarted agent
    after = stop_and_settle(state, view, T0 + 5, s)
    assert "agent of host h2 restarted" in after.state.reason
    restarted = decide(after.state, view, T0 + 6, s)
    assert [a.host for a in starts(restarted)] == ["h0", "h1"]


def test_more_devices_or_another_kind_on_a_member():
    view = ClusterView()
    for h in ("h0", "h1"):
        register(view, h)
    s = spec(max_hosts=2)
    state = running_slice(view, ["h0", "h1"])
    devices_now(view, "h0", 4, T0 + 1)  # more than the mesh uses: nothing to do
    assert decide(state, view, T0 + 1, s).state.phase is Phase.RUNNING
    devices_now(view, "h1", 2, T0 + 2, kind="gpu")
    stopping = decide(state, view, T0 + 2, s)
    assert stopping.state.phase is Phase.STOPPING and "2 gpu device(s)" in stopping.reason


def test_a_repaired_host_grows_the_slice_back():
    view = ClusterView()
    for host, n in (("h0", 2), ("h1", 2), ("h2", 1)):
        register(view, host, devices=n)
    s = spec(max_hosts=3, restart={"grow": "immediately"})
    state = running_slice(view, ["h0", "h1"], left_out={"h2": "reports 1 device; ..."})
    assert decide(state, view, T0 + 1, s).state.phase is Phase.RUNNING
    devices_now(view, "h2", 2, T0 + 2)
    grown = decide(state, view, T0 + 2, s)
    assert grown.state.phase is Phase.STOPPING and "grow from 2 to 3 hosts" in grown.reason
    assert grown.state.left_out == {}


def test_a_spec_no_set_of_hosts_satisfies_waits_and_says_why():
    view = ClusterView()
    for host, n in (("h0", 2), ("h1", 2), ("h2", 1)):
        register(view, host, devices=n)
    s = spec(max_hosts=3, mesh=MeshSpec.from_text("data=-1,model=8"))
    first = decide(SliceState(phase_since=T0), view, T0 + 2, s)
    assert first.state.phase is Phase.WAITING and starts(first) == []
    assert kinds(first) == ["waiting_for_hosts"]
    assert "mesh data=-1,model=8 fits no slice of 1 to 3 of the 3 ready hosts" in first.reason


@pytest.mark.parametrize("limit,waited,fails", [
    (1800.0, 1799.0, False),
    (1800.0, 1800.0, True),
    (0.0, 10 * 86400.0, False),  # 0 waits forever
])
def test_waiting_is_bounded(limit, waited, fails):
    view = ClusterView()
    register(view, "h0", devices=1)
    s = spec(min_hosts=2, restart={"waiting_timeout_s": limit})
    state = decide(SliceState(phase_since=T0), view, T0, s).state
    decision = decide(state, view, T0 + waited, s)
    assert (decision.state.phase is Phase.FAILED) is fails
    if fails:
        assert kinds(decision)[-1] == "job_failed"
        assert "no slice could start for 1800 s (restart.waiting_timeout_s = 1800)" \
            in decision.reason
        assert "min_hosts is 2" in decision.reason


def test_a_recount_with_more_devices_grows_a_slice_at_max_hosts():
    view = ClusterView()
    for host, n in (("h0", 8), ("h1", 7)):
        register(view, host, devices=n)
    s = spec(max_hosts=2, restart={"grow": "immediately"})
    state = running_slice(view, ["h0", "h1"])
    assert state.devices_per_host == 7
    assert decide(state, view, T0 + 1, s).state.phase is Phase.RUNNING
    devices_now(view, "h1", 8, T0 + 2)
    grown = decide(state, view, T0 + 2, s)
    assert grown.state.phase is Phase.STOPPING
    assert "grow from 2 to 2 hosts (8 devices each)" in grown.reason


def test_a_possible_grow_does_not_call_members_left_out():
    view = ClusterView()
    for host, n in (("h0", 2), ("h1", 1), ("h2", 2), ("h3", 2)):
        register(view, host, devices=n)
    s = spec(max_hosts=4, restart={"grow": "after_checkpoint"})
    # running 2 x 1 (h0, h1); h2 and h3 with 2 devices make 3 x 2 possible
    state = running_slice(view, ["h0", "h1"])
    decision = decide(state, view, T0 + 1, s)
    assert decision.state.grow_ready_since == T0 + 1
    assert journal(decision, "host_left_out") == [] and decision.state.left_out == {}


def test_hosts_of_another_kind_are_left_out_while_the_job_waits():
    view = ClusterView()
    for h in ("h0", "h1"):
        register(view, h, kind="cpu")
    s = spec(max_hosts=2, device_kind="tpu")
    first = decide(SliceState(phase_since=T0), view, T0 + 2, s)
    assert first.state.phase is Phase.WAITING and starts(first) == []
    assert [a.host for a in journal(first, "host_left_out")] == ["h0", "h1"]
    assert first.state.left_out["h0"] == "reports devices of kind 'cpu'; job.device_kind is 'tpu'"
    assert "none of the 2 ready reports devices of kind 'tpu'" in first.reason


def test_a_slice_that_can_start_when_the_wait_runs_out_starts():
    view = ClusterView()
    register(view, "h0")
    s = spec(max_hosts=1, restart={"waiting_timeout_s": 60.0})
    heartbeat_all(view, T0 + 60.0)
    decision = decide(SliceState(phase_since=T0), view, T0 + 60.0, s)
    assert decision.state.phase is Phase.STARTING
