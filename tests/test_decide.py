"""Table-driven tests of the pure decisions, with a fake clock (builders in
policy_tables.py; waiting and starting in test_starting.py; silent members
and hangs in test_liveness.py; the crash loop, the restart budget and
quarantine in test_quarantine.py; fencing in test_fencing.py)."""

from __future__ import annotations

import dataclasses

import pytest

from elastic.config import MeshSpec
from elastic.policy import decide as d
from elastic.policy import strays
from elastic.policy.decide import Phase, SliceState, decide
from elastic.policy.view import (ClusterView, Disconnected, HeartbeatReceived, ProgressReported,
                                 WorkerState, observe)
from tests.policy_tables import (T0, heartbeat_all, kinds, register, running_slice, spec,
                                 stop_and_settle, worker)

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


@pytest.mark.parametrize("silent_s,controller_lag_s,lost", [
    (4.9, 0.0, False), (5.1, 0.0, True),
    # a controller 3 s behind has not read the last 3 s of heartbeats yet
    (7.9, 3.0, False), (8.1, 3.0, True)])
def test_lost_host_after_heartbeat_timeout(silent_s, controller_lag_s, lost):
    view = ClusterView()
    for h in ("h0", "h1"):
        register(view, h)
    view.lag_s = controller_lag_s
    state = running_slice(view, ["h0", "h1"])
    observe(view, HeartbeatReceived("h0", "inc-h0", view.hosts["h0"].worker, 0), T0 + silent_s)
    decision = decide(state, view, T0 + silent_s, spec())
    assert ("host_lost" in kinds(decision)) is lost
    assert (decision.state.phase is Phase.STOPPING) is lost
    if lost:
        assert decision.state.lost == {"h1"}


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
    # h0 exited, h2 is stopped: the stop waits only for h1, whose connection
    # is closed; it is lost now, 0.15 s after it closed, not after
    # reconnect_grace_s (1 s), and the next slice starts without it
    worker(view, "h2", T0 + 1.1, 1, WorkerState.EXITED, sig=9)
    heartbeat_all(view, T0 + 1.15)
    stopped = decide(decision.state, view, T0 + 1.15, spec())
    assert kinds(stopped)[:2] == ["host_lost", "slice_stopped"], kinds(stopped)
    assert "not waiting out reconnect_grace_s" in stopped.actions[0].reason
    assert stopped.state.lost == {"h1"} and stopped.state.phase is Phase.WAITING
    started = decide(stopped.state, view, T0 + 1.2, spec())
    assert started.state.members == ("h0", "h2"), kinds(started)


def test_a_stop_waits_out_the_grace_when_no_member_is_known_to_have_ended():
    """Every agent closed its stream (they do when the controller is silent
    for 5 s, then register again): nobody is known stopped, so their workers
    may still train together; the stop waits for acknowledgements."""
    view = ClusterView()
    for h in ("h0", "h1"):
        register(view, h)
    state = running_slice(view, ["h0", "h1"])
    worker(view, "h0", T0 + 1.0, 1, WorkerState.RUNNING, step=5)
    stopping = d._begin_stop(state, view, T0 + 1.0, spec(), [], "grow", "grow", ())
    for h in ("h0", "h1"):
        observe(view, Disconnected(h, f"inc-{h}"), T0 + 1.1)
    waiting = decide(stopping, view, T0 + 1.5, spec())
    assert waiting.state.phase is Phase.STOPPING and not waiting.state.lost, kinds(waiting)


def h1_closed_and_h0_exited():
    """(view, state) of a 3-host slice that began to stop at T0 + 1.05:
    h1's stream closed at T0 + 1.0, h0's worker exited with code 1 (its
    collective failed); h2's worker still runs."""
    view = ClusterView()
    for h in ("h0", "h1", "h2"):
        register(view, h)
    state = running_slice(view, ["h0", "h1", "h2"])
    observe(view, Disconnected("h1", "inc-h1"), T0 + 1.0)
    worker(view, "h0", T0 + 1.05, 1, WorkerState.EXITED, exit_code=1)
    return view, decide(state, view, T0 + 1.05, spec()).state


def test_a_stop_waits_for_a_closed_member_while_the_controller_is_behind():
    view, stopping = h1_closed_and_h0_exited()
    worker(view, "h2", T0 + 1.05, 1, WorkerState.EXITED, sig=9)
    view.lag_s = 0.5  # (its Register may be queued unread)
    assert decide(stopping, view, T0 + 1.3, spec()).state.phase is Phase.STOPPING
    assert decide(stopping, view, T0 + 1.55, spec()).state.lost == {"h1"}


def test_a_stop_waits_for_a_closed_member_while_another_has_not_stopped():
    view, stopping = h1_closed_and_h0_exited()
    heartbeat_all(view, T0 + 1.1)
    waiting = decide(stopping, view, T0 + 1.1, spec())  # h2 still runs
    assert waiting.state.phase is Phase.STOPPING and not waiting.state.lost


def test_agent_restart_is_member_failure():
    view = ClusterView()
    for h in ("h0", "h1"):
        register(view, h)
    state = running_slice(view, ["h0", "h1"])
    register(view, "h1", now=T0 + 1, incarnation="new")
    decision = decide(state, view, T0 + 1, spec())
    assert decision.state.phase is Phase.STOPPING and "restarted" in decision.reason


def test_stop_then_restart_on_survivors():
    view = ClusterView()
    for h in ("h0", "h1", "h2"):
        register(view, h)
    state = running_slice(view, ["h0", "h1", "h2"])
    heartbeat_all(view, T0 + 4)
    observe(view, HeartbeatReceived("h0", "inc-h0", view.hosts["h0"].worker, 0), T0 + 6)
    observe(view, HeartbeatReceived("h2", "inc-h2", view.hosts["h2"].worker, 0), T0 + 6)
    s = spec()
    stopped = stop_and_settle(state, view, T0 + 9.5, s)  # h1 silent 5.5 s
    assert stopped.state.phase is Phase.WAITING
    assert "slice_stopped" in kinds(stopped) and "waiting_for_fencing" not in kinds(stopped)
    restart = decide(stopped.state, view, T0 + 11, s)
    starts = [a for a in restart.actions if isinstance(a, d.StartWorker)]
    assert restart.state.generation == 2
    assert [a.host for a in starts] == ["h0", "h2"]  # h1 lost; ranks dense
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


# --- grow ----------------------------------------------------------------------------------

@pytest.mark.parametrize("policy,commit_after_join,finishing,grows", [
    ("never", True, False, False),
    ("immediately", False, False, True),
    ("after_checkpoint", False, False, False),
    ("after_checkpoint", True, False, True),
    # the last step is taken and its checkpoint commits: nothing to grow for
    ("after_checkpoint", True, True, False),
    ("immediately", False, True, False),
    # a member's worker already exited 0 (one that reports no worker_finishing)
    ("immediately", False, "exited", False),
])
def test_grow_policy(policy, commit_after_join, finishing, grows):
    state, view = slice_with_a_waiting_host()
    if finishing == "exited":
        worker(view, "h1", T0 + 0.5, state.generation, WorkerState.EXITED, step=149)
    elif finishing:
        view.hosts["h0"].finishing_generation = state.generation
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


@pytest.mark.parametrize("steps_total,step_time_s,costs_s,grows", [
    (None, 0.1, (2.0,), True),        # the job's length unknown: grow
    (1_000, None, (2.0,), True),      # no step time yet: grow
    (1_000, 0.1, (), True),           # no restart measured yet: grow
    # 990 steps left at 0.1 s on 4 devices instead of 6: saves 33 s
    (1_000, 0.1, (2.0, 3.0, 30.0), True),   # median cost 3 s: pays
    (1_000, 0.1, (25.0,), False),           # 33 s < 1.5 x 25 s
    (100, 0.1, (2.5,), False),              # 90 steps left save 3 s < 1.5 x 2.5 s
])
def test_a_grow_happens_only_when_it_pays(steps_total, step_time_s, costs_s, grows):
    state, view = slice_with_a_waiting_host()
    state = dataclasses.replace(state, restart_costs_s=costs_s)
    metrics = {k: v for k, v in (("steps_total", steps_total), ("step_time_s", step_time_s))
               if v is not None}
    observe(view, ProgressReported("h0", "inc-h0", 1, 9, -1, metrics), T0 + 1)
    s = spec(restart={"grow": "immediately"})
    first = decide(state, view, T0 + 1, s)
    assert (first.state.phase is Phase.STOPPING) is grows
    if not grows:
        assert kinds(first) == ["grow_declined"]
        assert "not worth it" in first.actions[0].reason
        again = decide(first.state, view, T0 + 2, s)  # journaled once
        assert again.state.phase is Phase.RUNNING and "grow_declined" not in kinds(again)
    elif steps_total and step_time_s and costs_s:
        assert "would save ~33.0 s" in first.reason


def test_first_progress_measures_what_the_restart_cost():
    state, view = slice_with_a_waiting_host()
    s = spec(restart={"grow": "immediately"})
    stopping = decide(state, view, T0 + 1, s).state
    assert stopping.phase is Phase.STOPPING and stopping.restart_began == T0 + 1
    settled = stop_and_settle(stopping, view, T0 + 2, s)
    heartbeat_all(view, T0 + 2.3)
    settled = decide(settled.state, view, T0 + 2.3, s)
    assert settled.state.phase is Phase.STARTING
    g = settled.state.generation
    for h in settled.state.members:
        worker(view, h, T0 + 6, g, WorkerState.RUNNING, step=10)
    running = decide(settled.state, view, T0 + 6, s)
    progress = next(a for a in running.actions if getattr(a, "kind", "") == "first_progress")
    assert progress.fields["restart_cost_s"] == 5.0
    assert running.state.restart_costs_s == (5.0,) and running.state.restart_began is None


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


@pytest.mark.parametrize("phase, members, ran, lost, why", [
    # a member whose worker is of an older generation
    (Phase.RUNNING, ("h0", "h1"), 3, (), "worker of generation 3 is not part of generation 5"),
    # a host left out of the slice whose worker still runs the current generation
    (Phase.RUNNING, ("h0",), 5, (),
     "host is not a member of generation 5, and its worker of generation 5 still runs"),
    # the slice stopped: every running worker is a stray, said so
    (Phase.WAITING, (), 5, (), "worker of generation 5 still runs, and no generation does now"),
    # while the slice stops, its members still count as members
    (Phase.STOPPING, ("h0", "h1"), 3, (), "worker of generation 3 is not part of generation 5"),
    # a lost host is not sent anything (its heartbeats are not heard)
    (Phase.RUNNING, ("h0",), 3, ("h1",), None),
])
def test_stray_workers_table(phase, members, ran, lost, why):
    view = ClusterView()
    for h in ("h0", "h1"):
        register(view, h)
    if members:  # (h0 runs the slice's worker)
        worker(view, "h0", T0, 5, WorkerState.RUNNING, step=7)
    worker(view, "h1", T0, ran, WorkerState.RUNNING, step=7)
    state = SliceState(phase=phase, generation=5, phase_since=T0, members=members,
                       incarnations=tuple(f"inc-{h}" for h in members), progressed=True,
                       devices_per_host=2, device_kind="cpu", lost=frozenset(lost))
    actions = []
    after = strays.stop_strays(state, view, T0 + 0.1, spec(), actions)
    journaled = [(a.host, a.reason) for a in actions if isinstance(a, d.Journal)]
    stops = [(a.host, a.generation, a.reason) for a in actions if isinstance(a, d.StopWorker)]
    if why is None:
        assert not actions and after is state
        return
    assert journaled == [("h1", why)] and stops == [("h1", ran, why)]
    assert after.stop_requested == {"h1": T0 + 0.1}
    # not again within stop_timeout_s (10 s); again after it
    assert strays.stop_strays(after, view, T0 + 5, spec(), []) is after
    resent = []
    assert strays.stop_strays(after, view, T0 + 10.2, spec(), resent).stop_requested == \
        {"h1": T0 + 10.2}
    assert [a.host for a in resent if isinstance(a, d.StopWorker)] == ["h1"]
    # once its worker has stopped, the request is forgotten
    worker(view, "h1", T0 + 11, ran, WorkerState.EXITED)
    assert strays.stop_strays(after, view, T0 + 11, spec(), []).stop_requested == {}


def test_stops_requested_are_kept_for_strays_and_unknown_hosts_only():
    view = ClusterView()
    for h in ("h0", "h1"):
        register(view, h)
    state = dataclasses.replace(running_slice(view, ["h0", "h1"], generation=5),
                                stop_requested={"h1": T0, "gone": T0})
    after = strays.stop_strays(state, view, T0 + 1, spec(), [])
    # h1 runs its slice's worker now: no stray, its request is dropped; a host
    # the view no longer knows keeps its request
    assert after.stop_requested == {"gone": T0}


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


# --- preemption ---------------------------------------------------------------------------

def preempted_slice():
    view = ClusterView()
    for h in ("h0", "h1", "h2"):
        register(view, h)
    state = running_slice(view, ["h0", "h1", "h2"])
    view.step_time_s = 0.5  # (steps of 0.5 s learned: the hang timeout is the 10 s floor)
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
    # a regular commit of step 9, the slice at step 12 by now
    observe(view, ProgressReported("h0", "inc-h0", 1, 12, 9), T0 + 2)
    decision = decide(state, view, T0 + 2, spec())
    assert decision.state.phase is Phase.RUNNING and "draining" in decision.reason


def test_an_emergency_save_below_the_newest_step_ever_committed_is_waited_for():
    """After a restore fell back past committed step 20 (it would not read),
    the slice trains at step 9 when h2 is preempted. Before, its emergency
    save of step 9 was never seen to commit (step 20 was newer), and the
    drain stopped the slice while the save was still being written, as if
    step 9 were committed already (an audit of the checkpoint code)."""
    s = spec()
    state, view = preempted_slice()
    view.committed_step, view.committed_at = 20, T0 - 100  # the step that would not read
    draining = decide(state, view, T0 + 1, s)
    observe(view, d_event_saved(), T0 + 1.5)  # the emergency save of step 9 starts
    observe(view, ProgressReported("h0", "inc-h0", 1, 9, -1), T0 + 1.5)
    saving = decide(draining.state, view, T0 + 1.5 + 3 * s.health.heartbeat_interval_s, s)
    assert saving.state.phase is Phase.RUNNING and "draining" in saving.reason, saving.reason
    heartbeat_all(view, T0 + 5)
    relevant, facts = observe(view, ProgressReported("h0", "inc-h0", 1, 9, 9), T0 + 6)
    assert [(f.kind, f.fields["step"]) for f in facts] == [("checkpoint_committed", 9)]
    assert view.committed_step == 20  # still the newest
    stopping = decide(saving.state, view, T0 + 6, s)
    assert stopping.state.phase is Phase.STOPPING and stopping.state.stop_kind == "preemption"
    assert "emergency checkpoint step 9 committed" in stopping.reason


def test_a_drain_ends_once_the_step_the_slice_stands_at_is_committed():
    """As after an adoption: the emergency save ran while no controller did.
    A report of the committed step alone is not enough while the slice may
    still be stepping (a commit of step 9 reported before step 10 was):
    the step must have stayed there for two heartbeat intervals, within
    which any step taken since would have been reported."""
    s = spec()
    state, view = preempted_slice()
    observe(view, ProgressReported("h0", "inc-h0", 1, 9, 9), T0 + 2)
    decision = decide(state, view, T0 + 2, s)
    assert decision.state.phase is Phase.RUNNING and "draining" in decision.reason
    quiet = T0 + 2 + 2 * s.health.heartbeat_interval_s
    decision = decide(decision.state, view, quiet, s)
    assert decision.state.phase is Phase.STOPPING and decision.state.stop_kind == "preemption"
    assert "checkpoint step 9, the step the slice reached, committed" in decision.reason
    # rank 0 just registered (after an adoption: no step seen yet, step_at 0):
    # quiet is counted from its registration
    state, view = preempted_slice()
    observe(view, ProgressReported("h0", "inc-h0", 1, 9, 9), T0 + 1.2)
    view.hosts["h0"].step_at, view.hosts["h0"].registered_at = 0.0, T0 + 1.2  # (as a new record)
    assert decide(state, view, T0 + 1.3, s).state.phase is Phase.RUNNING


def test_a_failed_emergency_save_ends_the_drain_at_once():
    from elastic.policy.view import WorkerReported
    state, view = preempted_slice()
    draining = decide(state, view, T0 + 1, spec())
    observe(view, d_event_saved(), T0 + 2)
    relevant, facts = observe(view, WorkerReported(
        "h0", "inc-h0", 1, "checkpoint_save_failed", "save of step 9 failed on process(es) 1",
        {"step": 9, "preemption": True}), T0 + 3)
    assert relevant and [f.kind for f in facts] == ["checkpoint_save_failed"]
    stopping = decide(draining.state, view, T0 + 3, spec())
    assert stopping.state.phase is Phase.STOPPING and stopping.state.stop_kind == "preemption"
    assert "the emergency checkpoint failed (save of step 9" in stopping.reason
    assert "resuming from checkpoint step" in stopping.reason


def test_a_regular_save_that_failed_leaves_the_drain_waiting():
    from elastic.policy.view import WorkerReported
    state, view = preempted_slice()
    draining = decide(state, view, T0 + 1, spec())
    observe(view, WorkerReported("h0", "inc-h0", 1, "checkpoint_save_failed", "step 8 failed",
                                 {"step": 8, "preemption": False}), T0 + 2)
    still = decide(draining.state, view, T0 + 2, spec())
    assert still.state.phase is Phase.RUNNING and "draining" in still.reason


def test_a_hang_ends_a_preemption_drain_at_once():
    state, view = preempted_slice()  # members made step 5 at T0
    draining = decide(state, view, T0 + 1, spec())
    assert "draining" in draining.reason
    heartbeat_all(view, T0 + 10.5)  # no step since T0: over the 10 s hang timeout
    hung = decide(draining.state, view, T0 + 10.5, spec())
    assert hung.state.phase is Phase.STOPPING and hung.state.stop_kind == "failure"
    assert "hang_detected" in kinds(hung)


def test_a_drain_whose_emergency_checkpoint_committed_is_a_preemption_not_a_hang():
    """The emergency save waited for an earlier save in flight, and its
    commit comes after the hang timeout (10 s) counted from the last step:
    within the save's allowance while it was in flight, not after it."""
    state, view = preempted_slice()  # members made step 5 at T0
    draining = decide(state, view, T0 + 1, spec())
    observe(view, d_event_saved(), T0 + 7)
    heartbeat_all(view, T0 + 10.5)
    saving = decide(draining.state, view, T0 + 10.5, spec())
    assert saving.state.phase is Phase.RUNNING and "draining" in saving.reason
    observe(view, ProgressReported("h0", "inc-h0", 1, 9, 9), T0 + 12)
    heartbeat_all(view, T0 + 12)
    stopping = decide(saving.state, view, T0 + 12, spec())
    assert stopping.state.phase is Phase.STOPPING and stopping.state.stop_kind == "preemption"
    assert "hang_detected" not in kinds(stopping)
    assert "emergency checkpoint step 9 committed" in stopping.reason


def test_preemption_drain_is_bounded():
    state, view = preempted_slice()
    draining = decide(state, view, T0 + 1, spec())
    heartbeat_all(view, T0 + 21.5)
    for h in ("h0", "h1", "h2"):  # still stepping (no hang), but no emergency save
        observe(view, ProgressReported(h, f"inc-{h}", 1, 50, -1), T0 + 21)
    late = decide(draining.state, view, T0 + 21.5, spec())
    assert late.state.phase is Phase.STOPPING and "no emergency checkpoint" in late.reason


@pytest.mark.parametrize("replicate, expected", [
    (True, [("h1", "h3", "10.0.0.1:7003"), ("h2", "h3", "10.0.0.1:7003"),
            ("h3", "h1", "10.0.0.1:7001")]),
    (False, [("h1", "", ""), ("h2", "", ""), ("h3", "", "")]),
])
def test_each_host_is_told_its_buddy(replicate, expected):
    """The next host that serves a port (h2 serves none); the choice among
    failure domains is elastic.policy.buddies' (tests/test_replicas.py)."""
    view = ClusterView()
    for host in ("h1", "h2", "h3"):
        register(view, host)
    view.hosts["h1"].service_port, view.hosts["h3"].service_port = 7001, 7003
    decision = decide(SliceState(), view, T0 + 2,
                      spec(max_hosts=3, restart={"replicate_snapshots": replicate}))
    assert [(a.host, a.replica_host, a.replica_address) for a in decision.actions
            if isinstance(a, d.StartWorker)] == expected


@pytest.mark.parametrize("replicate, restarted_on", [
    (True, ["h1", "h3"]),   # h2's part lives on in h3 (its buddy), h0's in h1
    (False, ["h0", "h1"]),  # the planner's own order
])
def test_a_smaller_slice_keeps_the_lost_hosts_buddy(replicate, restarted_on):
    """Mesh model=4 on hosts of 2 devices: 3 survivors of a 4-host slice
    make room for 2. Buddies went round the ring h0 -> h1 -> h2 -> h3 -> h0;
    with h2 lost, only h1 and h3 hold every part of the last snapshot."""
    view = ClusterView()
    for h in ("h0", "h1", "h2", "h3"):
        register(view, h)
        view.hosts[h].service_port = 7000 + int(h[-1])
    s = spec(max_hosts=4, mesh=MeshSpec((("model", 4), ("data", -1))),
             restart={"replicate_snapshots": replicate})
    state = running_slice(view, ["h0", "h1", "h2", "h3"])
    for h in ("h0", "h1", "h3"):  # h2 silent for longer than the heartbeat timeout
        observe(view, HeartbeatReceived(h, f"inc-{h}", view.hosts[h].worker, 0), T0 + 5.1)
    settled = stop_and_settle(state, view, T0 + 5.1, s)
    assert settled.state.lost == {"h2"}
    for h in ("h0", "h1", "h3"):
        observe(view, HeartbeatReceived(h, f"inc-{h}", view.hosts[h].worker, 0), T0 + 7)
    restart = decide(settled.state, view, T0 + 7, s)
    assert [a.host for a in restart.actions if isinstance(a, d.StartWorker)] == restarted_on
    started = next(a for a in restart.actions if getattr(a, "kind", "") == "generation_started")
    assert ("every host's last snapshot" in started.reason) is replicate


@pytest.mark.parametrize("expected, third_at, start_at, hosts", [
    (0, None, 2.1, 2),      # none expected: the settle (1 s after the last registration)
    (3, 5.0, 5.0, 3),       # the third comes 5 s later: one generation on all three
    (3, None, 30.0, 2),     # it never comes: started on two at EXPECTED_WAIT_S
    (9, 5.0, 5.0, 3),       # (more than max_hosts expected: max_hosts)
])
def test_the_first_generation_waits_for_the_expected_hosts(expected, third_at, start_at, hosts):
    """elasticd local launches 3 hosts (health.expected_hosts = 3); on a
    busy machine the third registers seconds after the others."""
    s = spec(min_hosts=2, max_hosts=3)
    s = dataclasses.replace(s, health=dataclasses.replace(s.health, expected_hosts=expected))
    view, state = ClusterView(), SliceState(phase_since=T0)
    for h in ("h0", "h1"):
        register(view, h, T0 + 1)
    for t in (1.5, 2.1, 4.9, 5.0, 29.9, 30.0):
        if third_at is not None and t == third_at:
            register(view, "h2", T0 + t)
        heartbeat_all(view, T0 + t)
        decision = decide(state, view, T0 + t, s)
        started = [a.host for a in decision.actions if isinstance(a, d.StartWorker)]
        if started:
            assert t == start_at and len(started) == hosts, (t, started)
            return
        state = decision.state
    raise AssertionError(f"no generation started; {state.reason}")
