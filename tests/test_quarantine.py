"""Failures that come again, by table with a fake clock: the crash loop,
the restart budget and quarantine (builders in policy_tables.py; the other
decisions in test_decide.py)."""

from __future__ import annotations

import dataclasses

import pytest

from elastic.config import QuarantineSpec
from elastic.policy import decide as d
from elastic.policy import quarantine
from elastic.policy.decide import Phase, SliceState, decide
from elastic.policy.view import ClusterView, Disconnected, HeartbeatReceived, WorkerState, observe
from tests.policy_tables import (T0, heartbeat_all, kinds, register, restart_cycles,
                                 running_slice, spec, stop_and_settle, worker)


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


@pytest.mark.parametrize("steps, fails_at", [
    ((1001, 1001, 1001, 1001), 3),   # a deterministic crash just after the restore
    ((1000, 1001, 1000), 3),         # ... reported a step earlier or later
    ((1001, None, 1001), 3),         # (a failure before the first step counts too)
    ((None, None, None), 3),         # no step at all, as before
    ((1050, 950, 1020, 990, 1040), None),  # host faults after restores 100 steps back
    ((1001, 1003, 1001, 1003), None),      # another step each time
    ((1001, 1002, 1003, 1004), None),      # creeping on: counted from the first of them
    ((1001, 1001, 5000, 1001, 1001), None),  # got away in between
])
def test_a_crash_at_the_same_step_after_every_restore_is_a_crash_loop(steps, fails_at):
    """Every generation restores step 1000 and fails 5 s after its first
    step, 200 s apart (a big model's restore and compile). Before, a
    generation's first step started the crash-loop count again, so one that
    failed at the same step every time (bad data, a NaN assert at step 1001)
    counted 1 each time, and with the restart budget's 20 per 3600 s never
    reached at one per 200 s, the job restarted forever. A failure at a
    step within one of the step reached by the failure that began the count
    now counts on; a generation that got anywhere else made progress (the
    faults of a healthy cluster land on other steps)."""
    state, _ = restart_cycles(steps, spec())
    if fails_at is None:
        assert state.phase is Phase.WAITING and state.generation == len(steps), state.reason
    else:
        assert state.phase is Phase.FAILED and state.generation == fails_at, state.reason
        assert "crash loop: 3 failures in a row" in state.reason


def test_a_preemption_of_a_generation_that_got_away_ends_the_count():
    """Two failures at step 1001; the next generation gets to step 5000 and
    is preempted: the count starts again (it is no longer started by the
    first step when there is a failure step to compare with, so the stop
    must end it). A preemption back at step 1001 does not."""
    for middle, fails in ((5000, False), (1001, True)):
        state, _ = restart_cycles((1001, 1001, middle, 1001), spec(),
                                  kinds_of_stop={2: "preemption"})
        assert (state.phase is Phase.FAILED) is fails, (middle, state.reason)


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


def _waiting_with(quarantined: dict, hosts=("h0", "h1", "h2"), min_hosts=2, gone=(),
                  now=T0 + 10, registered_at=T0):
    """A WAITING slice (spec with `min_hosts`, up to as many hosts as `hosts`)
    whose `hosts` but those `gone` registered at `registered_at` and
    heartbeat at `now`, offering ports; `quarantined`: host -> until.
    (spec, view, state)."""
    s = spec(min_hosts=min_hosts, max_hosts=len(hosts))
    view = ClusterView()
    for h in hosts:
        if h not in gone:
            register(view, h, registered_at)
    heartbeat_all(view, now)
    for r in view.hosts.values():
        r.free_port = 6000 + int(r.host_id[-1])
    state = SliceState(phase_since=registered_at, quarantined={h: (until, f"quarantined {h}")
                                    for h, until in quarantined.items()})
    return s, view, state


def _started(decision) -> list[str]:
    return [a.host for a in decision.actions if isinstance(a, d.StartWorker)]


@pytest.mark.parametrize("case,quarantined,gone,min_hosts,released,started", [
    # the others make min_hosts: the quarantine holds
    ("not needed", {"h2": T0 + 500}, (), 2, [], ["h0", "h1"]),
    # h1 gone: without h2 no slice can start, so h2 is released early
    ("needed after a loss", {"h2": T0 + 500}, ("h1",), 2, ["h2"], ["h0", "h2"]),
    # min_hosts 3 (as at a next job's start): h2 is needed
    ("needed by min_hosts", {"h2": T0 + 500}, (), 3, ["h2"], ["h0", "h1", "h2"]),
    # two set aside, one needed: the one whose cooldown ends sooner
    ("the sooner one", {"h1": T0 + 900, "h2": T0 + 400}, (), 2, ["h2"], ["h0", "h2"]),
    # both needed
    ("both", {"h1": T0 + 900, "h2": T0 + 400}, (), 3, ["h2", "h1"], ["h0", "h1", "h2"]),
    # even with it no slice: nothing released
    ("not enough", {"h2": T0 + 500}, ("h0", "h1"), 2, [], []),
])
def test_a_quarantine_is_released_early_only_when_no_slice_can_start_without_it(
        case, quarantined, gone, min_hosts, released, started):
    s, view, state = _waiting_with(quarantined, min_hosts=min_hosts, gone=gone)
    decision = decide(state, view, T0 + 10, s)
    freed = [a for a in decision.actions if isinstance(a, d.Journal) and a.kind == "host_released"]
    assert [a.host for a in freed] == released, case
    assert all("released before its cooldown ends: no slice can start without it" in a.reason
               for a in freed)
    assert set(decision.state.quarantined) == set(quarantined) - set(released), case
    assert _started(decision) == started, (case, decision.reason)


def test_a_quarantine_is_not_released_for_hosts_still_on_their_way():
    """At a job's start the hosts register one by one: h2 (set aside) and h0
    came first; h1 is due. Within a heartbeat timeout (5 s) of the last
    registration, or while a registered host's stream is still opening, h2
    stays aside; once that settles it is released."""
    s, view, state = _waiting_with({"h2": T0 + 500}, hosts=("h0", "h2"), registered_at=T0 + 9.5)
    early = decide(state, view, T0 + 10, s)  # 0.5 s after the last registration
    assert not _started(early) and "host_released" not in kinds(early)
    register(view, "h1", T0 + 13, stream=False)  # registered, its stream not open yet
    waiting = decide(early.state, view, T0 + 18.5, s)
    assert not _started(waiting) and "host_released" not in kinds(waiting), waiting.reason
    heartbeat_all(view, T0 + 19)  # (h1's stream opens: it is usable, h2 not needed)
    view.hosts["h1"].free_port = 6001
    ready = decide(waiting.state, view, T0 + 20.5, s)
    assert _started(ready) == ["h0", "h1"] and "h2" in ready.state.quarantined
    # the same slice without h1: h2 is released once 5 s passed without a registration
    s, view, state = _waiting_with({"h2": T0 + 500}, hosts=("h0", "h2"), registered_at=T0 + 9.5)
    assert not _started(decide(state, view, T0 + 14.4, s))
    assert _started(decide(state, view, T0 + 14.5, s)) == ["h0", "h2"]


def test_a_quarantine_is_not_released_while_a_healthy_host_is_seconds_from_usable():
    """h1 is still stopping a stray worker, or its stream closed within
    reconnect_grace_s: it will be usable in seconds, so h2 stays aside."""
    s, view, state = _waiting_with({"h2": T0 + 500})
    worker(view, "h1", T0 + 10, 1, WorkerState.RUNNING)  # a stray of generation 1
    stray = decide(state, view, T0 + 10, s)
    assert "host_released" not in kinds(stray) and not _started(stray), stray.reason
    assert [a.host for a in stray.actions if isinstance(a, d.StopWorker)] == ["h1"]
    s, view, state = _waiting_with({"h2": T0 + 500})
    observe(view, Disconnected("h1", "inc-h1"), T0 + 9.8)
    closed = decide(state, view, T0 + 10, s)
    assert "host_released" not in kinds(closed) and not _started(closed), closed.reason


def test_the_shortest_run_of_quarantined_hosts_is_released():
    """Five set aside, min_hosts 4 with one healthy host: the three whose
    cooldowns end soonest, found in 4 plans (all five, then bisected), not
    one plan per host; none at all when even all five cannot make a slice."""
    hosts = tuple(f"h{i}" for i in range(6))
    until = {"h1": T0 + 300, "h2": T0 + 100, "h3": T0 + 200, "h4": T0 + 900, "h5": T0 + 400}
    s, view, state = _waiting_with(until, hosts=hosts, min_hosts=4)
    spares = {h: d.candidate(view.hosts[h]) for h in until}
    plans = []

    def counting(candidates):
        plans.append(len(candidates))
        return d.plan_mesh(s, candidates)

    quarantined = {h: (t, "") for h, t in until.items()}
    released, plan = quarantine.release_needed(quarantined, spares,
                                               [d.candidate(view.hosts["h0"])], counting)
    assert released == ["h2", "h3", "h1"] and len(plan.hosts) == 4
    assert plans == [6, 3, 4], plans
    plans.clear()
    assert quarantine.release_needed(quarantined, dict(list(spares.items())[:2]),
                                     [d.candidate(view.hosts["h0"])], counting) == ([], None)
    assert plans == [3]  # (one plan: even both are not enough)
    # the same through decide, which starts h0 and those three
    decision = decide(state, view, T0 + 10, s)
    assert [a.host for a in decision.actions if isinstance(a, d.Journal)
            and a.kind == "host_released"] == ["h2", "h3", "h1"]
    assert sorted(_started(decision)) == ["h0", "h1", "h2", "h3"]


def test_a_quarantined_host_that_is_not_usable_is_not_released():
    """h2 set aside and being taken away (a preemption notice): releasing it
    would not start a slice."""
    s, view, state = _waiting_with({"h2": T0 + 500}, gone=("h1",))
    view.hosts["h2"].preemption = "a preemption notice"
    decision = decide(state, view, T0 + 10, s)
    assert not _started(decision) and "host_released" not in kinds(decision)
    assert "h2" in decision.state.quarantined
