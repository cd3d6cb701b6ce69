"""Table-driven tests of the pure decisions, with a fake clock."""

from __future__ import annotations

import dataclasses

import pytest

from elastic.config import HealthSpec, JobSpec, MeshSpec, RestartSpec
from elastic.policy import decide as d
from elastic.policy.decide import Phase, SliceState, decide
from elastic.policy.view import (ClusterView, Disconnected, HeartbeatReceived, ProgressReported,
                                 Registered, WorkerExited, WorkerObs, WorkerState, observe)

T0 = 1000.0


def spec(**kw) -> JobSpec:
    health = HealthSpec(heartbeat_interval_s=1.0, heartbeat_timeout_s=5.0, stop_grace_s=2.0,
                        stop_timeout_s=10.0, rendezvous_settle_s=1.0)
    restart = RestartSpec(**kw.pop("restart", {}))
    return JobSpec(command=("w",), min_hosts=kw.pop("min_hosts", 1),
                   max_hosts=kw.pop("max_hosts", 4), health=health, restart=restart, **kw)


def register(view: ClusterView, host: str, now: float = T0, domain: str | None = None,
             devices: int = 2, incarnation: str | None = None) -> None:
    observe(view, Registered(host, incarnation or f"inc-{host}", devices, "10.0.0.1",
                             domain or host, 100, 5000 + int(host[-1]), WorkerObs()), now)


def worker(view: ClusterView, host: str, now: float, generation: int, state: WorkerState,
           step: int = -1, exit_code: int = 0, sig: int = 0) -> None:
    inc = view.hosts[host].incarnation
    obs = WorkerObs(generation=generation, state=state, pid=42, exit_code=exit_code, signal=sig,
                    step=step)
    event = (WorkerExited(host, inc, obs) if state is WorkerState.EXITED
             else HeartbeatReceived(host, inc, obs, 0))
    observe(view, event, now)


def heartbeat_all(view: ClusterView, now: float) -> None:
    for record in list(view.hosts.values()):
        observe(view, HeartbeatReceived(record.host_id, record.incarnation, record.worker, 0), now)


def kinds(decision: d.Decision) -> list[str]:
    return [a.kind for a in decision.actions if isinstance(a, d.Journal)]


def running_slice(view: ClusterView, hosts: list[str], now: float = T0,
                  generation: int = 1, progressed: bool = True, **kw) -> SliceState:
    for h in hosts:
        worker(view, h, now, generation, WorkerState.RUNNING, step=5 if progressed else -1)
    return SliceState(phase=Phase.RUNNING if progressed else Phase.STARTING,
                      generation=generation, phase_since=now, members=tuple(hosts),
                      incarnations=tuple(view.hosts[h].incarnation for h in hosts),
                      progressed=progressed, **kw)


# --- waiting and starting ----------------------------------------------------------------

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


# --- failures ------------------------------------------------------------------------

def test_worker_exit_stops_whole_slice_with_sigkill():
    view = ClusterView()
    hosts = ["h0", "h1", "h2"]
    for h in hosts:
        register(view, h)
    state = running_slice(view, hosts)
    worker(view, "h1", T0 + 3, 1, WorkerState.EXITED, exit_code=3)
    decision = decide(state, view, T0 + 3, spec())
    stops = [a for a in decision.actions if isinstance(a, d.StopWorker)]
    assert decision.state.phase is Phase.STOPPING
    assert sorted(a.host for a in stops) == hosts
    assert {a.grace_s for a in stops} == {0.0}
    assert "h1" in decision.reason and "exit code 3" in decision.reason


def test_first_failure_is_root_cause():
    view = ClusterView()
    for h in ("h0", "h1"):
        register(view, h)
    state = running_slice(view, ["h0", "h1"])
    worker(view, "h1", T0 + 1, 1, WorkerState.EXITED, sig=9)
    worker(view, "h0", T0 + 2, 1, WorkerState.EXITED, sig=6)  # aborted by its peer's death
    decision = decide(state, view, T0 + 2, spec())
    assert "host h1" in decision.reason and "SIGKILL" in decision.reason


@pytest.mark.parametrize("silent_s,lost", [(4.9, False), (5.1, True)])
def test_lost_host_after_heartbeat_timeout(silent_s, lost):
    view = ClusterView()
    for h in ("h0", "h1"):
        register(view, h)
    state = running_slice(view, ["h0", "h1"])
    observe(view, HeartbeatReceived("h0", "inc-h0", view.hosts["h0"].worker, 0), T0 + silent_s)
    decision = decide(state, view, T0 + silent_s, spec())
    assert ("host_lost" in kinds(decision)) is lost
    assert (decision.state.phase is Phase.STOPPING) is lost
    if lost:
        assert decision.state.lost == {"h1"}


def silent_member_setup(peer_step: int, peer_step_at: float, carry: bool = True):
    """h0, h1, h2 at step 5 at T0; then only h0 and h2 are heard from, at
    `peer_step` (reached at T0 + `peer_step_at`), heartbeating every second."""
    view = ClusterView()
    for h in ("h0", "h1", "h2"):
        register(view, h)
    state = running_slice(view, ["h0", "h1", "h2"])
    for h in ("h0", "h2"):
        observe(view, ProgressReported(h, f"inc-{h}", 1, peer_step, -1), T0 + peer_step_at)
    s = spec()
    s = dataclasses.replace(s, health=dataclasses.replace(s.health, carry_silent_hosts=carry))
    return state, view, s


def beat_peers(view: ClusterView, now: float) -> None:
    for h in ("h0", "h2"):
        observe(view, HeartbeatReceived(h, f"inc-{h}", view.hosts[h].worker, 0), now)


@pytest.mark.parametrize("peer_step,peer_step_at,now,carry,outcome", [
    (20, 4.0, 4.9, True, None),         # not silent for heartbeat_timeout_s (5 s) yet
    (8, 4.0, 5.1, True, "carried"),     # the slice went 3 steps past h1's last report
    (7, 4.0, 5.1, True, "lost"),        # 2 steps: h1 may have died inside step 7
    (20, 0.05, 5.1, True, "lost"),      # far ahead, but no step for 5 s: the slice stalled
    (20, 4.0, 5.1, False, "lost"),      # health.carry_silent_hosts = false
])
def test_a_silent_member_is_carried_while_the_slice_steps_past_it(peer_step, peer_step_at, now,
                                                                  carry, outcome):
    state, view, s = silent_member_setup(peer_step, peer_step_at, carry)
    beat_peers(view, T0 + now)
    decision = decide(state, view, T0 + now, s)
    if outcome is None:
        assert kinds(decision) == [] and decision.state == state
    elif outcome == "carried":
        assert kinds(decision) == ["agent_silent"]
        entry = decision.actions[0]
        assert entry.host == "h1" and entry.fields["lead_steps"] == 3
        assert decision.state.phase is Phase.RUNNING and not decision.state.lost
        assert decision.state.carried == {"h1": T0}
    else:
        assert "host_lost" in kinds(decision) and decision.state.lost == {"h1"}
        assert decision.state.phase is Phase.STOPPING and not decision.state.carried


def carried_member(until: int):
    """h1 carried from T0 + 5.1; h0 and h2 step once a second up to T0 + `until`."""
    state, view, s = silent_member_setup(10, 4.0)
    beat_peers(view, T0 + 5.1)
    carried = decide(state, view, T0 + 5.1, s).state
    for at in range(6, until + 1):
        observe(view, ProgressReported("h0", "inc-h0", 1, 10 + at, -1), T0 + at)
        observe(view, ProgressReported("h2", "inc-h2", 1, 10 + at, -1), T0 + at)
        later = decide(carried, view, T0 + at, s)
        # journaled once; its frozen step does not make the slice hung (10 s)
        assert kinds(later) == [] and later.state.carried == {"h1": T0}
    return carried, view, s


def test_a_carried_member_is_heard_again_once_its_reports_catch_up():
    carried, view, s = carried_member(13)
    # heartbeats resume, first with the step it had when it went silent: still
    # carried (not hung), until its step reports catch up: heard again, once
    observe(view, HeartbeatReceived("h1", "inc-h1", view.hosts["h1"].worker, 0), T0 + 13.5)
    behind = decide(carried, view, T0 + 13.5, s)
    assert kinds(behind) == [] and behind.state == carried
    observe(view, ProgressReported("h1", "inc-h1", 1, 23, -1), T0 + 13.6)
    heard = decide(carried, view, T0 + 13.6, s)
    assert kinds(heard) == ["agent_heard"] and heard.state.carried == {}
    assert heard.actions[0].fields["silent_s"] == pytest.approx(13.6)
    assert heard.state.phase is Phase.RUNNING
    assert kinds(decide(heard.state, view, T0 + 13.7, s)) == []


def test_a_carried_member_is_lost_when_the_slice_stops_stepping():
    carried, view, s = carried_member(13)
    # its worker died (or froze): the others cannot step; lost once their
    # last step is heartbeat_timeout_s (5 s) old
    beat_peers(view, T0 + 17.9)
    assert kinds(decide(carried, view, T0 + 17.9, s)) == []
    beat_peers(view, T0 + 18.1)
    lost = decide(carried, view, T0 + 18.1, s)
    assert kinds(lost)[0] == "host_lost" and "carried" in lost.actions[0].reason
    assert lost.state.lost == {"h1"} and not lost.state.carried


def test_a_carried_member_is_lost_once_the_slice_stops_for_another_reason():
    state, view, s = silent_member_setup(10, 4.0)
    beat_peers(view, T0 + 5.1)
    carried = decide(state, view, T0 + 5.1, s).state
    worker(view, "h2", T0 + 5.5, 1, WorkerState.EXITED, sig=9)
    stopping = decide(carried, view, T0 + 5.5, s)
    assert stopping.state.phase is Phase.STOPPING
    # it cannot be told to stop: not waited for, and not in the next generation
    after = decide(stopping.state, view, T0 + 5.6, s)
    assert "host_lost" in kinds(after) and "h1" in after.state.lost


@pytest.mark.parametrize("closed_for_s,reconnects,lost", [
    (0.9, False, False),  # within reconnect_grace_s (1 s): wait for it
    (1.1, False, True),   # gone: lost long before heartbeat_timeout_s (5 s)
    (1.1, True, False),   # the same agent registered again (a broken connection)
])
def test_lost_host_when_its_connection_closes(closed_for_s, reconnects, lost):
    view = ClusterView()
    for h in ("h0", "h1"):
        register(view, h)
    state = running_slice(view, ["h0", "h1"])
    observe(view, Disconnected("h1", "inc-h1"), T0 + 0.5)
    observe(view, Disconnected("h0", "other-incarnation"), T0 + 0.5)  # not the one registered
    if reconnects:
        register(view, "h1", now=T0 + 0.7)
    heartbeat_all(view, T0 + 0.5 + closed_for_s)
    decision = decide(state, view, T0 + 0.5 + closed_for_s, spec())
    assert ("host_lost" in kinds(decision)) is lost
    if lost:
        lost_entry = next(a for a in decision.actions if getattr(a, "kind", "") == "host_lost")
        assert decision.state.lost == {"h1"} and "connection closed" in lost_entry.reason
        # heartbeats it sent before cannot bring it back; registering again does
        later = decide(decision.state, view, T0 + 2, spec())
        assert "h1" in later.state.lost
        register(view, "h1", now=T0 + 3, incarnation="restarted")
        assert "h1" not in decide(later.state, view, T0 + 3, spec()).state.lost


def test_a_disconnected_member_is_blamed_before_a_peer_that_aborted():
    view = ClusterView()
    for h in ("h0", "h1", "h2"):
        register(view, h)
    state = running_slice(view, ["h0", "h1", "h2"])
    observe(view, Disconnected("h1", "inc-h1"), T0 + 1.0)  # agent and worker killed
    worker(view, "h0", T0 + 1.05, 1, WorkerState.EXITED, sig=6)  # gloo aborted
    decision = decide(state, view, T0 + 1.05, spec())
    assert decision.state.phase is Phase.STOPPING
    assert "host h1 disconnected" in decision.reason
    stopping = next(a for a in decision.actions if getattr(a, "kind", "") == "slice_stopping")
    assert stopping.fields["blamed"] == ["h1"]


def test_agent_restart_is_member_failure():
    view = ClusterView()
    for h in ("h0", "h1"):
        register(view, h)
    state = running_slice(view, ["h0", "h1"])
    register(view, "h1", now=T0 + 1, incarnation="new")
    decision = decide(state, view, T0 + 1, spec())
    assert decision.state.phase is Phase.STOPPING and "restarted" in decision.reason


def stop_and_settle(state, view, now, s):
    """From a failure to the decision after all stop acknowledgements."""
    decision = decide(state, view, now, s)
    assert decision.state.phase is Phase.STOPPING
    for h in decision.state.members:
        if view.hosts[h].worker.running and h not in decision.state.lost:
            worker(view, h, now + 0.1, decision.state.generation, WorkerState.EXITED, sig=9)
    return decide(decision.state, view, now + 0.2, s)


def test_stop_then_restart_on_survivors():
    view = ClusterView()
    for h in ("h0", "h1", "h2"):
        register(view, h)
    state = running_slice(view, ["h0", "h1", "h2"])
    heartbeat_all(view, T0 + 4)
    observe(view, HeartbeatReceived("h1", "inc-h1", view.hosts["h1"].worker, 0), T0 + 6)
    observe(view, HeartbeatReceived("h2", "inc-h2", view.hosts["h2"].worker, 0), T0 + 6)
    s = spec()
    stopped = stop_and_settle(state, view, T0 + 9.5, s)  # h0 silent 5.5 s
    assert stopped.state.phase is Phase.WAITING
    assert "slice_stopped" in kinds(stopped)
    restart = decide(stopped.state, view, T0 + 11, s)
    starts = [a for a in restart.actions if isinstance(a, d.StartWorker)]
    assert restart.state.generation == 2
    assert [a.host for a in starts] == ["h1", "h2"]  # h0 lost; ranks dense
    assert [a.process_id for a in starts] == [0, 1]


@pytest.mark.parametrize("grow,mesh,restarted_on", [
    # a newcomer has no local snapshot: with it, everyone would roll back to
    # the persistent checkpoint, which "after_checkpoint" promises not to do
    ("after_checkpoint", None, ["h0", "h1", "h2"]),
    ("immediately", None, ["h0", "h1", "h2", "h3"]),
    ("never", None, ["h0", "h1", "h2"] + ["h3"]),
    # without the newcomer the mesh (model=4, 2 devices a host) fits 2 hosts, with it 4
    ("after_checkpoint", (("data", -1), ("model", 4)), ["h0", "h1", "h2", "h3"]),
])
def test_a_failure_restart_leaves_a_newcomer_for_the_next_grow(grow, mesh, restarted_on):
    view = ClusterView()
    for h in ("h0", "h1", "h2"):
        register(view, h)
    state = running_slice(view, ["h0", "h1", "h2"])
    register(view, "h3", now=T0 + 1)
    worker(view, "h1", T0 + 2, 1, WorkerState.EXITED, sig=9)
    s = spec(restart={"grow": grow})
    if mesh:
        s = dataclasses.replace(s, mesh=MeshSpec(mesh))
    stopped = stop_and_settle(state, view, T0 + 2, s)
    restart = decide(stopped.state, view, T0 + 2.3, s)
    assert sorted(a.host for a in restart.actions if isinstance(a, d.StartWorker)) == restarted_on
    if len(restarted_on) == 3 and grow == "after_checkpoint":
        # and it grows after the next commit, as the policy says
        for h in restarted_on:
            worker(view, h, T0 + 3, 2, WorkerState.RUNNING, step=25)
        running = dataclasses.replace(restart.state, phase=Phase.RUNNING, progressed=True)
        waiting = decide(running, view, T0 + 3, s)
        assert waiting.state.phase is Phase.RUNNING
        observe(view, ProgressReported("h0", "inc-h0", 2, 30, 30), T0 + 4)
        assert "grow" in decide(waiting.state, view, T0 + 4, s).reason


def test_unacknowledged_stop_drops_host_after_timeout():
    view = ClusterView()
    for h in ("h0", "h1"):
        register(view, h)
    state = running_slice(view, ["h0", "h1"])
    worker(view, "h0", T0 + 1, 1, WorkerState.EXITED, exit_code=1)
    stopping = decide(state, view, T0 + 1, spec())
    heartbeat_all(view, T0 + 5)
    still = decide(stopping.state, view, T0 + 5, spec())
    assert still.state.phase is Phase.STOPPING
    heartbeat_all(view, T0 + 11.5)
    dropped = decide(still.state, view, T0 + 11.5, spec())
    assert dropped.state.phase is Phase.WAITING
    assert "host_dropped" in kinds(dropped)


def test_all_workers_exit_zero_succeeds():
    view = ClusterView()
    for h in ("h0", "h1"):
        register(view, h)
    state = running_slice(view, ["h0", "h1"])
    worker(view, "h0", T0 + 1, 1, WorkerState.EXITED)
    partial = decide(state, view, T0 + 1, spec())
    assert partial.state.phase is Phase.RUNNING
    worker(view, "h1", T0 + 2, 1, WorkerState.EXITED)
    done = decide(partial.state, view, T0 + 2, spec())
    assert done.state.phase is Phase.SUCCEEDED
    assert d.Finish(0) in done.actions and "job_succeeded" in kinds(done)


@pytest.mark.parametrize("prior_failures,progressed,crash_loop,fails", [
    (0, False, 3, False),
    (1, False, 3, False),
    (2, False, 3, True),   # third failure in a row without a step
    (2, True, 3, False),   # a step in between resets the count
    (0, False, 1, True),
])
def test_crash_loop(prior_failures, progressed, crash_loop, fails):
    view = ClusterView()
    register(view, "h0")
    state = running_slice(view, ["h0"], progressed=progressed,
                          failures_without_progress=prior_failures)
    worker(view, "h0", T0 + 1, 1, WorkerState.EXITED, exit_code=1)
    s = spec(restart={"crash_loop_failures": crash_loop})
    end = stop_and_settle(state, view, T0 + 1, s)
    assert (end.state.phase is Phase.FAILED) is fails
    if fails:
        assert "crash loop" in end.reason and d.Finish(1) in end.actions


@pytest.mark.parametrize("earlier,max_restarts,fails", [
    ((), 0, True),
    ((), 1, False),
    ((T0 - 100, T0 - 50), 2, True),
    ((T0 - 5000, T0 - 50), 2, False),  # the old one is outside the 3600 s window
])
def test_restart_budget(earlier, max_restarts, fails):
    view = ClusterView()
    register(view, "h0")
    state = running_slice(view, ["h0"], failure_restarts=earlier)
    worker(view, "h0", T0 + 1, 1, WorkerState.EXITED, exit_code=1)
    s = spec(restart={"max_restarts": max_restarts, "crash_loop_failures": 99})
    end = stop_and_settle(state, view, T0 + 1, s)
    assert (end.state.phase is Phase.FAILED) is fails
    if fails:
        assert "restart budget" in end.reason


# --- grow ----------------------------------------------------------------------------------

@pytest.mark.parametrize("policy,commit_after_join,grows", [
    ("never", True, False),
    ("immediately", False, True),
    ("after_checkpoint", False, False),
    ("after_checkpoint", True, True),
])
def test_grow_policy(policy, commit_after_join, grows):
    state, view = slice_with_a_waiting_host()
    s = spec(restart={"grow": policy})
    first = decide(state, view, T0 + 1, s)
    if commit_after_join:
        observe(view, ProgressReported("h0", "inc-h0", 1, 10, 9), T0 + 2)
    second = decide(first.state, view, T0 + 2, s)
    assert (Phase.STOPPING in (first.state.phase, second.state.phase)) is grows
    if grows:
        stopping = first if first.state.phase is Phase.STOPPING else second
        assert "grow" in stopping.reason
        assert {a.grace_s for a in stopping.actions if isinstance(a, d.StopWorker)} == {2.0}


def slice_with_a_waiting_host() -> tuple[SliceState, ClusterView]:
    """h0 and h1 running generation 1; h2 registered at T0 + 1."""
    view = ClusterView()
    for h in ("h0", "h1"):
        register(view, h)
    state = running_slice(view, ["h0", "h1"])
    register(view, "h2", now=T0 + 1)
    return state, view


def test_grow_restart_does_not_spend_failure_budget():
    state, view = slice_with_a_waiting_host()
    s = spec(restart={"grow": "immediately", "max_restarts": 0})
    end = stop_and_settle(state, view, T0 + 1, s)
    assert end.state.phase is Phase.WAITING and end.state.failure_restarts == ()
    again = decide(end.state, view, T0 + 3, s)
    assert len([a for a in again.actions if isinstance(a, d.StartWorker)]) == 3


def test_grow_stop_ends_when_its_emergency_checkpoint_commits():
    state, view = slice_with_a_waiting_host()
    s = spec(restart={"grow": "immediately"})
    stopping = decide(state, view, T0 + 1, s)
    assert stopping.state.stop_kind == "grow"
    heartbeat_all(view, T0 + 1.2)
    assert not decide(stopping.state, view, T0 + 1.2, s).actions  # grace runs (2 s)
    # the SIGTERM made the workers save at JAX's preemption sync point
    observe(view, d_event_saved(), T0 + 1.3)
    observe(view, ProgressReported("h0", "inc-h0", 1, 9, 9), T0 + 1.5)
    hurried = decide(stopping.state, view, T0 + 1.5, s)
    kills = [a for a in hurried.actions if isinstance(a, d.StopWorker)]
    assert [(a.host, a.grace_s) for a in kills] == [("h0", 0.0), ("h1", 0.0)]
    assert hurried.state.stop_hurried and hurried.state.phase is Phase.STOPPING
    assert not [a for a in decide(hurried.state, view, T0 + 1.6, s).actions
                if isinstance(a, d.StopWorker)]  # sent once


# --- stray workers (fencing of old generations) --------------------------------------

def test_stray_worker_of_old_generation_is_stopped_once_per_timeout():
    view = ClusterView()
    for h in ("h0", "h1"):
        register(view, h)
    state = running_slice(view, ["h0"], generation=5)
    worker(view, "h1", T0, 3, WorkerState.RUNNING, step=7)  # came back from generation 3
    first = decide(state, view, T0 + 0.1, spec())
    stops = [a for a in first.actions if isinstance(a, d.StopWorker)]
    assert [(a.host, a.generation) for a in stops] == [("h1", 3)]
    again = decide(first.state, view, T0 + 0.2, spec())
    assert not [a for a in again.actions if isinstance(a, d.StopWorker)]


def test_progress_of_other_generation_is_ignored():
    view = ClusterView()
    register(view, "h0")
    worker(view, "h0", T0, 2, WorkerState.RUNNING)
    relevant, facts = observe(view, ProgressReported("h0", "inc-h0", 1, 50, 49), T0 + 1)
    assert not relevant and not facts and view.hosts["h0"].worker.step == -1


def test_first_progress_journaled_once():
    view = ClusterView()
    register(view, "h0")
    state = running_slice(view, ["h0"], progressed=False)
    observe(view, ProgressReported("h0", "inc-h0", 1, 0, -1), T0 + 1)
    first = decide(state, view, T0 + 1, spec())
    again = decide(first.state, view, T0 + 2, spec())
    assert kinds(first) == ["first_progress"] and first.state.phase is Phase.RUNNING
    assert kinds(again) == []


def test_terminal_state_is_final():
    state = SliceState(phase=Phase.FAILED, reason="x")
    decision = decide(state, ClusterView(), T0, spec())
    assert decision.actions == () and decision.state is state


def test_mesh_spec_is_kept_in_order():
    assert MeshSpec.from_text("data=-1,model=2").axes == (("data", -1), ("model", 2))
    assert dataclasses.replace(spec(), mesh=MeshSpec((("x", 4),))).mesh.to_text() == "x=4"


# --- hangs ------------------------------------------------------------------------------

from elastic.config import HangSpec, QuarantineSpec  # noqa: E402
from elastic.policy.hang import hang_timeout  # noqa: E402


@pytest.mark.parametrize("fixed,step_time,expected", [
    (0.0, None, 10.0),   # nothing learned yet: the minimum
    (0.0, 0.5, 10.0),    # 10 x 0.5 s is below the minimum
    (0.0, 2.0, 20.0),    # learned: 10 x the median step
    (7.0, 2.0, 7.0),     # set in the job spec
])
def test_hang_timeout_table(fixed, step_time, expected):
    s = dataclasses.replace(spec(), hang=HangSpec(timeout_s=fixed))
    assert hang_timeout(s, step_time) == expected


def hang_setup(silent_s: float, suspended: str | None = None, saving: bool = False):
    view = ClusterView()
    hosts = ["h0", "h1", "h2"]
    for h in hosts:
        register(view, h)
    state = running_slice(view, hosts)  # all at step 5 at T0
    for h in ("h0", "h2"):  # h1 stopped at step 5, the others reached step 6
        worker(view, h, T0 + 1, 1, WorkerState.RUNNING, step=6)
    if suspended:
        view.hosts[suspended].worker.suspended = True
    if saving:
        view.save_started_at = T0 + 1
    heartbeat_all(view, T0 + silent_s)
    return state, view


@pytest.mark.parametrize("silent_s,suspended,saving,hung,first_suspect", [
    (9.0, None, False, False, None),
    (10.5, None, False, True, "h1"),      # h1 advanced least recently
    (10.5, "h2", False, True, "h2"),      # a suspended worker is the prime suspect
    (30.0, None, True, False, None),      # a save in flight: +60 s allowance
    (71.0, None, True, True, "h1"),
])
def test_hang_detection(silent_s, suspended, saving, hung, first_suspect):
    state, view = hang_setup(silent_s, suspended, saving)
    decision = decide(state, view, T0 + silent_s, spec())
    assert ("hang_detected" in kinds(decision)) is hung
    if hung:
        entry = next(a for a in decision.actions if isinstance(a, d.Journal)
                     and a.kind == "hang_detected")
        assert entry.fields["suspects"][0] == first_suspect
        assert decision.state.phase is Phase.STOPPING
        assert {a.grace_s for a in decision.actions if isinstance(a, d.StopWorker)} == {0.0}


@pytest.mark.parametrize("reports,now,limit,hung", [
    # (time, suspended) reports of h1's worker after every host's step 5 at T0
    ([(2.0, True), (3.0, True)], 4.5, 2.0, True),     # stopped 2.5 s: hung, long before 10 s
    ([(2.0, True), (3.0, True)], 3.5, 2.0, False),    # stopped 1.5 s: not yet
    ([(2.0, True), (3.0, False), (4.0, True)], 5.5, 2.0, False),  # resumed in between: 1.5 s
    ([(2.0, True), (3.0, True)], 4.5, 0.0, False),    # turned off: the step timeout decides
])
def test_a_stopped_worker_is_hung_after_the_suspended_timeout(reports, now, limit, hung):
    view = ClusterView()
    for h in ("h0", "h1"):
        register(view, h)
    state = running_slice(view, ["h0", "h1"])
    inc = view.hosts["h1"].incarnation
    for at, suspended in reports:
        observe(view, HeartbeatReceived("h1", inc, WorkerObs(
            generation=1, state=WorkerState.RUNNING, pid=42, step=5, suspended=suspended), 0),
            T0 + at)
    s = dataclasses.replace(spec(), hang=HangSpec(suspended_timeout_s=limit))
    decision = decide(state, view, T0 + now, s)
    assert ("hang_detected" in kinds(decision)) is hung
    if hung:
        entry = next(a for a in decision.actions if isinstance(a, d.Journal)
                     and a.kind == "hang_detected")
        assert entry.fields["suspects"] == ["h1"] and "stopped" in entry.reason
        assert entry.fields["silent_s"] == pytest.approx(now)  # since the last step


def test_startup_allowance():
    view = ClusterView()
    register(view, "h0")
    state = running_slice(view, ["h0"], progressed=False)
    s = dataclasses.replace(spec(), hang=HangSpec(startup_timeout_s=60))
    heartbeat_all(view, T0 + 59)
    assert decide(state, view, T0 + 59, s).state.phase is Phase.STARTING
    heartbeat_all(view, T0 + 61)
    late = decide(state, view, T0 + 61, s)
    assert "hang_detected" in kinds(late) and "no first step" in late.reason


# --- quarantine -----------------------------------------------------------------------------

def test_host_failing_repeatedly_is_quarantined_then_released():
    view = ClusterView()
    for h in ("h0", "h1", "h2"):
        register(view, h)
    s = dataclasses.replace(spec(restart={"crash_loop_failures": 99}),
                            quarantine=QuarantineSpec(failures=2, window_s=100, cooldown_s=50))
    state = running_slice(view, ["h0", "h1", "h2"])
    now = T0
    for generation in (1, 2):
        if generation == 2:
            state = running_slice(view, ["h0", "h1", "h2"], now=now, generation=2,
                                  **{k: getattr(state, k) for k in ("host_failures",
                                                                    "quarantined")})
        worker(view, "h1", now + 1, generation, WorkerState.EXITED, exit_code=3)
        stopping = decide(state, view, now + 1, s)
        state = stop_and_settle(state, view, now + 1, s).state
        now += 2
    assert "host_quarantined" in kinds(stopping)
    assert "h1" in state.quarantined
    heartbeat_all(view, now + 2)
    restart = decide(state, view, now + 2, s)
    assert [a.host for a in restart.actions if isinstance(a, d.StartWorker)] == ["h0", "h2"]
    heartbeat_all(view, now + 60)
    later = decide(restart.state, view, now + 60, s)
    assert "host_released" in kinds(later) and "h1" not in later.state.quarantined


# --- preemption ---------------------------------------------------------------------------

def preempted_slice():
    view = ClusterView()
    for h in ("h0", "h1", "h2"):
        register(view, h)
    state = running_slice(view, ["h0", "h1", "h2"])
    relevant, facts = observe(view, HeartbeatReceived("h2", "inc-h2", view.hosts["h2"].worker,
                                                      0, "SIGTERM to the agent"), T0 + 1)
    assert relevant and [f.kind for f in facts] == ["preemption_notice"]
    return state, view


def test_preemption_waits_for_the_emergency_checkpoint_then_restarts_without_the_host():
    state, view = preempted_slice()
    draining = decide(state, view, T0 + 1, spec())
    assert draining.state.phase is Phase.RUNNING and "draining" in draining.reason
    observe(view, d_event_saved(), T0 + 2)
    still = decide(draining.state, view, T0 + 2, spec())
    assert still.state.phase is Phase.RUNNING  # saved, not yet committed
    observe(view, ProgressReported("h0", "inc-h0", 1, 9, 9), T0 + 3)
    stopping = decide(still.state, view, T0 + 3, spec())
    assert stopping.state.phase is Phase.STOPPING and stopping.state.stop_kind == "preemption"
    assert "emergency checkpoint step 9 committed" in stopping.reason
    end = stop_and_settle(still.state, view, T0 + 3, spec())
    assert end.state.failure_restarts == ()  # not a failure
    heartbeat_all(view, T0 + 4)
    restart = decide(end.state, view, T0 + 5, spec())
    assert [a.host for a in restart.actions if isinstance(a, d.StartWorker)] == ["h0", "h1"]


def d_event_saved():
    from elastic.policy.view import WorkerReported
    return WorkerReported("h0", "inc-h0", 1, "checkpoint_saved", "emergency save",
                          {"step": 9, "preemption": True})


def test_an_older_emergency_save_does_not_end_the_drain():
    state, view = preempted_slice()
    view.emergency_save_step, view.emergency_save_at = 5, T0 - 50  # an earlier generation's
    observe(view, ProgressReported("h0", "inc-h0", 1, 9, 9), T0 + 2)  # a regular commit
    decision = decide(state, view, T0 + 2, spec())
    assert decision.state.phase is Phase.RUNNING and "draining" in decision.reason


def test_a_hang_ends_a_preemption_drain_at_once():
    state, view = preempted_slice()  # members made step 5 at T0
    draining = decide(state, view, T0 + 1, spec())
    assert "draining" in draining.reason
    heartbeat_all(view, T0 + 10.5)  # no step since T0: over the 10 s hang timeout
    hung = decide(draining.state, view, T0 + 10.5, spec())
    assert hung.state.phase is Phase.STOPPING and hung.state.stop_kind == "failure"
    assert "hang_detected" in kinds(hung)


def test_preemption_drain_is_bounded():
    state, view = preempted_slice()
    draining = decide(state, view, T0 + 1, spec())
    heartbeat_all(view, T0 + 21.5)
    for h in ("h0", "h1", "h2"):  # still stepping (no hang), but no emergency save
        observe(view, ProgressReported(h, f"inc-{h}", 1, 50, -1), T0 + 21)
    late = decide(draining.state, view, T0 + 21.5, spec())
    assert late.state.phase is Phase.STOPPING and "no emergency checkpoint" in late.reason


def test_quarantine_never_sets_aside_the_hosts_the_job_needs():
    view = ClusterView()
    register(view, "h0")
    register(view, "h1")
    s = dataclasses.replace(spec(min_hosts=2, restart={"crash_loop_failures": 99}),
                            quarantine=QuarantineSpec(failures=1, window_s=100, cooldown_s=50))
    state = running_slice(view, ["h0", "h1"])
    worker(view, "h1", T0 + 1, 1, WorkerState.EXITED, exit_code=3)
    stopping = decide(state, view, T0 + 1, s)
    assert stopping.state.phase is Phase.STOPPING
    assert "host_quarantined" not in kinds(stopping) and not stopping.state.quarantined
