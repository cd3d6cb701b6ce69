"""Fencing a stopped slice whose process 0 may live on (elastic.policy.fencing),
by table with a fake clock (builders in policy_tables.py; a slice lost whole
after an adoption in test_adoption.py; the fence carried into a successor
controller in test_failure_history.py)."""

from __future__ import annotations

import pytest

from elastic.policy.decide import Phase, decide
from elastic.policy.state import forgive_pause
from elastic.policy.view import (ClusterView, Disconnected, HeartbeatReceived, WorkerExited,
                                 WorkerObs, WorkerState, observe)
from tests.policy_tables import (T0, heartbeat_all, kinds, register, running_slice, spec,
                                 three_hosts_leased, worker)


@pytest.mark.parametrize("how_h0_went, fenced", [
    ("silent", True),          # cut off or frozen: its worker may commit a save late
    ("closed", False),         # its agent's connection closed, a peer's worker crashed:
    #                            a killed host (its worker dies with its agent)
    ("closed_quietly", True),  # closed, the peers stopped on request: perhaps its agent
    #                            gave up on a controller it stopped hearing, its worker on
    ("heard_stopped", False),  # heard again after the stop, its worker ended: lifted
])
def test_a_lost_process_0_is_waited_out_unless_seen_stopped(how_h0_went, fenced):
    """Process 0 alone makes a checkpoint's commit (after every process
    wrote its part): its host lost without being seen to stop its worker,
    no generation starts until that host's controller lease has run out,
    though its peers acknowledged the stop."""
    s, view, state = three_hosts_leased()
    heartbeat_all(view, T0 + 4)
    for h in ("h1", "h2"):
        observe(view, HeartbeatReceived(h, f"inc-{h}", view.hosts[h].worker, 0), T0 + 6)
    if how_h0_went.startswith("closed"):
        observe(view, Disconnected("h0", "inc-h0"), T0 + 5)
    if how_h0_went == "closed":  # its peer's collective failed
        worker(view, "h1", T0 + 5.1, 1, WorkerState.EXITED, exit_code=1)
    stopping = decide(state, view, T0 + 9.5, s)  # h0 silent 5.5 s
    for h in ("h1", "h2"):
        if view.hosts[h].worker.running:
            exited = WorkerObs(generation=1, state=WorkerState.EXITED, pid=42, signal=9,
                               stopped_on_request=True)
            observe(view, WorkerExited(h, f"inc-{h}", exited), T0 + 9.6)
    stopped = decide(stopping.state, view, T0 + 9.7, s)
    assert ("waiting_for_fencing" in kinds(stopped)) is (how_h0_went != "closed")
    if how_h0_went == "heard_stopped":  # (its stop acknowledgement, read late)
        worker(view, "h0", T0 + 12, 1, WorkerState.EXITED, sig=9)
    def peers_heard(now):  # (h0 stays silent unless heard above)
        for h in ("h1", "h2"):
            observe(view, HeartbeatReceived(h, f"inc-{h}", view.hosts[h].worker, 0), now)

    peers_heard(T0 + 13)
    restart = decide(stopped.state, view, T0 + 13, s)
    if fenced:  # its lease: 30 s from when it was last heard, 2 intervals, 2 checks
        assert stopped.state.fenced_until == T0 + 4 + 32.5
        assert restart.state.generation == 1
        assert "for host h0, process 0 of generation 1, to fence itself" in restart.reason
        peers_heard(T0 + 36.6)
        restart = decide(restart.state, view, T0 + 36.6, s)
    assert restart.state.generation == 2, restart.reason
    assert ("fence_lifted" in kinds(restart)) is (how_h0_went == "heard_stopped")


@pytest.mark.parametrize("forgiven", [True, False])
def test_a_controller_paused_during_a_stop_does_not_wait_out_a_fence(forgiven):
    """The controller did not run for 12 s during a grow's stop (deadline
    10 s). Forgiven (what Controller._paused does), the stop waits for the
    acknowledgements it had not read yet; without the state's forgiveness
    every member is dropped and the slice fenced for the controller lease,
    and the fence is lifted as soon as a member's acknowledgement shows its
    worker stopped. Either way the next generation starts within seconds."""
    s = spec(restart={"grow": "immediately"})
    view = ClusterView()
    for h in ("h0", "h1"):
        register(view, h)
    state = running_slice(view, ["h0", "h1"])
    register(view, "h2", now=T0 + 0.5)
    heartbeat_all(view, T0 + 1)
    state = decide(state, view, T0 + 1, s).state
    assert state.phase is Phase.STOPPING
    view.forgive_pause(12.0, T0 + 13.05, state.lost)
    if forgiven:
        state = forgive_pause(state, 12.0, T0 + 13.05)
    after = decide(state, view, T0 + 13.05, s)
    assert ("host_dropped" in kinds(after)) is not forgiven, kinds(after)
    state, journaled = after.state, kinds(after)
    for h in ("h0", "h1"):  # the acknowledgements, read now
        worker(view, h, T0 + 13.06, 1, WorkerState.EXITED, sig=15)
    for t in (13.2, 14.0, 16.0):
        heartbeat_all(view, T0 + t)
        for r in view.hosts.values():
            r.free_port = 7100 + int(r.host_id[-1])
        decision = decide(state, view, T0 + t, s)
        state, journaled = decision.state, journaled + kinds(decision)
    assert state.phase is Phase.STARTING and state.generation == 2, state.reason
    assert ("fence_lifted" in journaled) is not forgiven, journaled
