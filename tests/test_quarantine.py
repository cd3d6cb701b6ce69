"""Failures that come again, by table with a fake clock: the crash loop,
the restart budget and quarantine (builders in policy_tables.py; the other
decisions in test_decide.py)."""

from __future__ import annotations

import dataclasses

import pytest

from elastic.config import QuarantineSpec
from elastic.policy import decide as d
from elastic.policy.decide import Phase, SliceState, decide
from elastic.policy.view import ClusterView, Disconnected, HeartbeatReceived, WorkerState, observe
from tests.policy_tables import (T0, heartbeat_all, kinds, register, running_slice, spec,
                                 stop_and_settle, worker)


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


def test_a_host_failing_at_every_start_is_set_aside_and_the_others_train_on():
    """With the defaults (quarantine.failures = restart.crash_loop_failures
    = 3) the failure that sets the host aside also starts the crash-loop
    count again: the job goes on without it instead of failing."""
    s = spec()
    view = ClusterView()
    for h in ("h0", "h1", "h2", "h3"):
        register(view, h)
    state, now, generations = SliceState(phase_since=T0), T0 + 2, []
    for attempt in range(4):
        heartbeat_all(view, now)
        for r in view.hosts.values():
            r.free_port = 6000 + attempt * 10 + int(r.host_id[-1])
        started = decide(state, view, now, s)
        state = started.state
        members = [a.host for a in started.actions if isinstance(a, d.StartWorker)]
        generations.append(members)
        for h in members:
            worker(view, h, now + 0.5, state.generation, WorkerState.RUNNING)
        if "h3" not in members:
            break
        worker(view, "h3", now + 1, state.generation, WorkerState.EXITED, exit_code=1)
        end = stop_and_settle(state, view, now + 1, s)
        state, now = end.state, now + 2
        assert state.phase is Phase.WAITING, end.reason
    assert generations == [["h0", "h1", "h2", "h3"]] * 3 + [["h0", "h1", "h2"]]
    assert "h3" in state.quarantined and state.failures_without_progress == 0


def test_quarantine_counts_only_the_hosts_not_lost():
    """A host lost long ago is no host the job could use instead: h1 is not
    set aside when that would leave the job below min_hosts."""
    view = ClusterView()
    for h in ("h0", "h1", "h2"):
        register(view, h)
    s = dataclasses.replace(spec(min_hosts=2, restart={"crash_loop_failures": 99}),
                            quarantine=QuarantineSpec(failures=1, window_s=100, cooldown_s=50))
    state = running_slice(view, ["h0", "h1"], lost=frozenset({"h2"}))
    view.hosts["h2"].last_heartbeat_at = T0 - 1000
    worker(view, "h1", T0 + 1, 1, WorkerState.EXITED, exit_code=3)
    stopping = decide(state, view, T0 + 1, s)
    assert stopping.state.phase is Phase.STOPPING
    assert not stopping.state.quarantined, kinds(stopping)
    # a lost member blamed for the failure is set aside when the others
    # still make min_hosts (it is not counted twice)
    view = ClusterView()
    for h in ("h0", "h1", "h2"):
        register(view, h)
    state = running_slice(view, ["h0", "h1", "h2"])
    observe(view, Disconnected("h2", "inc-h2"), T0 + 0.5)  # its agent went away
    for h in ("h0", "h1"):
        observe(view, HeartbeatReceived(h, f"inc-{h}", view.hosts[h].worker, 0), T0 + 2)
    stopping = decide(state, view, T0 + 2, s)
    assert "h2" in stopping.state.lost and "h2" in stopping.state.quarantined, kinds(stopping)


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
