"""A controller that starts on a job's journal counts failures on from where
its predecessor stopped (elastic.policy.failure_history): by table with a
fake clock, decisions journaled as the executor writes them, read back
through the journal file, and carried into a new controller's state. (End to
end, a controller killed in a crash loop: tests/test_controller_failover.py.)"""

from __future__ import annotations

import dataclasses
import json

import pytest

from elastic.config import QuarantineSpec
from elastic.controller.journal import JournalWriter, recorded
from elastic.policy import decide as d
from elastic.policy import failure_history
from elastic.policy.decide import Phase, SliceState, decide
from elastic.policy.failure_history import FailureHistory
from elastic.policy.view import ClusterView, WorkerState
from tests.policy_tables import (T0, heartbeat_all, kinds, register, restart_cycles,
                                 running_slice, spec, stop_and_settle, three_hosts_leased,
                                 worker)

#: The journal's Unix time at the fake clock's T0, and the successor's
#: monotonic clock at the same instant (another process: another origin).
WALL0 = 1.8e9
SUCCESSOR_T0 = 5.0


def journal(path, decisions, at):
    """Write the Journal actions of `decisions` (made at monotonic times
    `at`) as the executor does, at the matching Unix times."""
    writer = JournalWriter(path)
    for decision, now in zip(decisions, at):
        for a in decision.actions:
            if isinstance(a, d.Journal):
                writer.write(WALL0 + now - T0, a.kind, a.generation, a.reason, a.host,
                             a.fields)
    writer.close()


def carried(path, now, s, skew_s: float = 0.0) -> SliceState:
    """A successor's state, started on the journal at `path` at monotonic
    time `now` of the fake clock, its wall clock `skew_s` ahead of the
    journal's."""
    history = recorded(path).failures
    return failure_history.carried_into(SliceState(), history, SUCCESSOR_T0 + now - T0,
                                        WALL0 + now - T0 + skew_s, s)


def start_generation(view, state, now, s, attempt):
    """Decide's start of the next generation at `now`, every host heartbeating
    and offering a coordinator port of its own for this `attempt`."""
    heartbeat_all(view, now)
    for r in view.hosts.values():
        r.free_port = 6000 + attempt * 10 + int(r.host_id[-1])
    return decide(state, view, now, s)


def shifted(times):
    return tuple(round(t - T0 + SUCCESSOR_T0, 6) for t in times)


@pytest.mark.parametrize("step", [None, 1001])
def test_a_successor_counts_what_its_predecessor_counted(tmp_path, step):
    """Three failures blamed on h3 (one quarantines it, which starts the
    crash-loop count again) and one on h1, each before its generation's
    first step or at the same step: what a controller counts and what its
    successor reads back from the journal are the same, on the successor's
    clock."""
    s = dataclasses.replace(spec(restart={"crash_loop_failures": 99}),
                            quarantine=QuarantineSpec(failures=3, window_s=100, cooldown_s=500))
    view = ClusterView()
    for h in ("h0", "h1", "h2", "h3"):
        register(view, h)
    state, now, decisions, at = SliceState(phase_since=T0), T0 + 2, [], []
    for attempt, blamed in enumerate(["h3", "h3", "h3", "h1"]):
        started = start_generation(view, state, now, s, attempt)
        decisions.append(started), at.append(now)
        state = started.state
        for h in (a.host for a in started.actions if isinstance(a, d.StartWorker)):
            worker(view, h, now + 0.5, state.generation, WorkerState.RUNNING,
                   step=-1 if step is None else step)
        worker(view, blamed, now + 1, state.generation, WorkerState.EXITED, exit_code=1,
               step=-1 if step is None else step)
        stopping = decide(state, view, now + 1, s)
        decisions.append(stopping), at.append(now + 1)
        for h in stopping.state.members:
            if view.hosts[h].worker.running:
                worker(view, h, now + 1.1, state.generation, WorkerState.EXITED, sig=9)
        stopped = decide(stopping.state, view, now + 1.2, s)
        decisions.append(stopped), at.append(now + 1.2)
        state, now = stopped.state, now + 2
        assert state.phase is Phase.WAITING, stopped.reason
    assert "h3" in state.quarantined and state.failures_without_progress == 1
    journal(tmp_path, decisions, at)

    successor = carried(tmp_path, now, s)
    assert successor.failure_restarts == shifted(state.failure_restarts)
    assert successor.failures_without_progress == state.failures_without_progress == 1
    assert successor.failure_step == state.failure_step == (-1 if step is None else step)
    assert {h: tuple(round(t, 6) for t in times)
            for h, times in successor.host_failures.items()} == \
        {h: shifted(times) for h, times in state.host_failures.items() if times} == \
        {"h1": shifted([T0 + 9])}
    (until, reason), = successor.quarantined.values()
    assert list(successor.quarantined) == ["h3"] and reason == state.quarantined["h3"][1]
    assert round(until, 6) == shifted([state.quarantined["h3"][0]])[0]
    described = failure_history.describe(successor, SUCCESSOR_T0 + now - T0)
    assert described["failure_restarts"] == 4 and described["quarantined"]["h3"] > 490

    # ... and the successor does not put h3 back in the next slice
    later = SUCCESSOR_T0 + now - T0
    successor = dataclasses.replace(successor, phase_since=later, generation=state.generation)
    view = ClusterView()  # (the hosts register with the successor)
    for h in ("h0", "h1", "h2", "h3"):
        register(view, h, now=later)
    heartbeat_all(view, later + 2)
    nxt = decide(successor, view, later + 2, s)
    assert [a.host for a in nxt.actions if isinstance(a, d.StartWorker)] == ["h0", "h1", "h2"]


def test_a_crash_loop_goes_on_counting_across_a_controller_restart(tmp_path):
    """Two failures without a step, then the controller restarts: the
    successor's next failure is the third in a row, and fails the job."""
    s = spec(min_hosts=2, restart={"crash_loop_failures": 3})
    view = ClusterView()
    for h in ("h0", "h1"):
        register(view, h)
    decisions, at, now = [], [], T0 + 1
    state = running_slice(view, ["h0", "h1"], progressed=False)
    for generation in (1, 2):
        if generation == 2:
            state = running_slice(view, ["h0", "h1"], now=now, generation=2, progressed=False,
                                  failures_without_progress=state.failures_without_progress)
        worker(view, "h0", now, generation, WorkerState.EXITED, exit_code=1)
        decisions.append(decide(state, view, now, s)), at.append(now)
        end = stop_and_settle(state, view, now, s)
        decisions.append(end), at.append(now + 0.2)
        state, now = end.state, now + 2
    journal(tmp_path, decisions, at)
    assert recorded(tmp_path).failures.without_progress == 2

    successor = carried(tmp_path, now, s)
    third = running_slice(view, ["h0", "h1"], now=now, generation=3, progressed=False,
                          failures_without_progress=successor.failures_without_progress)
    worker(view, "h1", now + 1, 3, WorkerState.EXITED, exit_code=1)
    end = stop_and_settle(third, view, now + 1, s)
    assert end.state.phase is Phase.FAILED and "crash loop: 3 failures" in end.reason


@pytest.mark.parametrize("steps, kinds_of_stop, count, failure_step", [
    ((1001, 1001), {}, 2, 1001),       # the same step again: counted on
    ((1001, 1000), {}, 2, 1001),       # (within a step of it)
    ((1001, 1003), {}, 1, 1003),       # another step: progress, counted from it
    ((1001, None), {}, 2, 1001),       # no step: counted on, from the step before
    ((None, None), {}, 2, -1),
    ((None, 1001), {}, 1, 1001),       # a step after failures with none
    ((1001, 1001, 5000), {2: "preemption"}, 0, -1),  # a stop that got away ends it
    ((1001, 1001, 1001), {2: "preemption"}, 2, 1001),  # one that did not leaves it
])
def test_a_successor_counts_the_crash_loop_from_the_same_steps(tmp_path, steps, kinds_of_stop,
                                                               count, failure_step):
    """A crash loop at one step after every restore (the first step no
    longer ends the count when a failure step is there to compare with):
    the successor reads back from the journal the count and the step
    decide had, and goes on from them. Before, the journal's reader reset
    the count at every first_progress, as decide did."""
    s = spec()
    state, decisions = restart_cycles(steps, s, kinds_of_stop=kinds_of_stop)
    assert (state.failures_without_progress, state.failure_step) == (count, failure_step)
    journal(tmp_path, [dn for dn, _ in decisions], [t for _, t in decisions])
    now = decisions[-1][1] + 1
    successor = carried(tmp_path, now, s)
    assert (successor.failures_without_progress, successor.failure_step) == (count, failure_step)
    if count != 2 or failure_step != 1001:
        return
    # ... and its next failure at that step is the third in a row
    view = ClusterView()
    register(view, "h0", now)
    nxt = running_slice(view, ["h0"], now=now, generation=len(steps) + 1,
                        failures_without_progress=successor.failures_without_progress,
                        failure_step=successor.failure_step)
    worker(view, "h0", now + 1, nxt.generation, WorkerState.EXITED, exit_code=1, step=1001)
    end = stop_and_settle(nxt, view, now + 1, s)
    assert end.state.phase is Phase.FAILED and "crash loop: 3 failures" in end.reason


def test_a_successor_weighs_grows_with_the_restart_costs_its_predecessor_measured(tmp_path):
    """Decide remembers every first step's restart cost for the grow policy;
    a successor reads the same costs back from the journal."""
    s = spec(min_hosts=2)
    view = ClusterView()
    for h in ("h0", "h1"):
        register(view, h)
    state, now, decisions, at = SliceState(phase_since=T0), T0 + 2, [], []
    for attempt in range(2):
        started = start_generation(view, state, now, s, attempt)
        decisions.append(started), at.append(now)
        state = started.state
        first_step = now + 1.5 + attempt  # (the second start costs a second more)
        for h in state.members:
            worker(view, h, first_step, state.generation, WorkerState.RUNNING, step=0)
        running = decide(state, view, first_step, s)
        decisions.append(running), at.append(first_step)
        assert "first_progress" in kinds(running)
        state = running.state
        if attempt == 0:
            worker(view, "h1", first_step + 1, state.generation, WorkerState.EXITED, exit_code=1)
            end = stop_and_settle(state, view, first_step + 1, s)
            decisions.append(end), at.append(first_step + 1.2)
            state, now = end.state, first_step + 2
    assert len(state.restart_costs_s) == 2
    journal(tmp_path, decisions, at)

    successor = carried(tmp_path, now, s)
    assert successor.restart_costs_s == state.restart_costs_s
    assert failure_history.describe(successor, now)["restart_costs_s"] == \
        list(state.restart_costs_s)


def _entry(ts, kind, host=None, **fields):
    return {"ts": WALL0 + ts, "kind": kind, "generation": 1, "host": host, "reason": "",
            **fields}


def test_the_fold_by_table():
    """What each kind does to the history; a job that ended starts it again."""
    h = FailureHistory()
    h = failure_history.after(h, _entry(0, "generation_started"))
    h = failure_history.after(h, _entry(1, "slice_stopping", cause="failure", blamed=["a"]))
    assert (h.without_progress, h.restarts_at, dict(h.host_failures)) == \
        (1, (WALL0 + 1,), {"a": (WALL0 + 1,)})
    h = failure_history.after(h, _entry(2, "slice_stopping", cause="preemption", blamed=[]))
    h = failure_history.after(h, _entry(3, "slice_stopping", cause="grow", blamed=[]))
    assert len(h.restarts_at) == 1  # (only failures count)
    h = failure_history.after(h, _entry(4, "slice_adopted", step=0))  # adopted at step 0
    h = failure_history.after(h, _entry(5, "slice_stopping", cause="failure", blamed=["b"]))
    assert h.without_progress == 1  # a step between: the count starts again
    h = failure_history.after(h, _entry(6, "host_quarantined", "b", until_s=60.0))
    assert h.without_progress == 0 and "b" not in h.host_failures
    assert h.quarantined["b"][0] == WALL0 + 66
    h = failure_history.after(h, _entry(7, "host_quarantined", "c"))  # no until_s: ignored
    assert "c" not in h.quarantined
    h = failure_history.after(h, _entry(8, "host_released", "b"))
    assert not h.quarantined
    h = failure_history.after(h, _entry(9, "slice_stopping", cause="failure", blamed="a"))
    assert h.host_failures == {"a": (WALL0 + 1,)}  # (blamed not a list: no host blamed)
    assert h.without_progress == 1
    # a first step starts the crash-loop count again, across restarts that are
    # no failures (a grow), as decide's first_progress does
    for kind, fields in (("generation_started", {}), ("first_progress", {}),
                         ("slice_stopping", {"cause": "grow"}), ("generation_started", {})):
        h = failure_history.after(h, _entry(9.5, kind, **fields))
    assert h.without_progress == 0
    # a damaged journal's numbers are passed over, not raised on or kept
    for bad in (float("nan"), float("inf"), 10 ** 400):
        assert failure_history.after(h, _entry(9.7, "host_quarantined", "d", until_s=bad)) == h
        assert failure_history.after(h, {**_entry(0, "slice_stopping", cause="failure",
                                                  blamed=["d"]), "ts": bad}) == h
    for end in ("job_failed", "job_succeeded"):
        assert failure_history.after(h, _entry(10, end)) == FailureHistory()
    # but a quarantine outlives the job: it is about the host
    h = failure_history.after(h, _entry(11, "host_quarantined", "e", until_s=60.0,
                                        reason="3 failures"))
    for end in ("job_failed", "job_succeeded"):
        assert failure_history.after(h, _entry(12, end)) == \
            FailureHistory(quarantined={"e": (WALL0 + 71, "3 failures")})


def test_the_next_job_keeps_the_quarantines_of_the_jobs_before_it(tmp_path):
    """Job a set h1 and h2 aside and released h2; job b, in the same state
    directory, inherits h1's quarantine (the reason naming job a), not a's
    failures, its restarts or the hosts it released."""
    entries = [
        {"kind": "controller_started", "job_id": "a"},
        {"kind": "slice_stopping", "cause": "failure", "blamed": ["h0"]},
        {"kind": "host_quarantined", "host": "h1", "until_s": 600.0, "reason": "2 failures"},
        {"kind": "host_quarantined", "host": "h2", "until_s": 600.0, "reason": "2 failures"},
        {"kind": "host_released", "host": "h2"},
        {"kind": "job_succeeded"},
        {"kind": "controller_started", "job_id": "b"},
    ]
    (tmp_path / "events.jsonl").write_text("".join(
        json.dumps({"ts": WALL0 + i, "generation": 1, "host": None, "reason": "", **e}) + "\n"
        for i, e in enumerate(entries)))
    got = recorded(tmp_path, "b").failures
    assert got == FailureHistory(quarantined={"h1": (WALL0 + 602, "in job 'a': 2 failures")})
    # job a's own controller, started again on the journal, counts its quarantine too
    assert recorded(tmp_path, "a").failures.quarantined == {"h1": (WALL0 + 602, "2 failures")}
    # carried into b's controller: h1 stays out for what is left of its cooldown
    state = failure_history.carried_into(SliceState(), got, 100.0, WALL0 + 10, spec())
    assert failure_history.describe(state, 100.0)["quarantined"] == {"h1": 592.0}


@pytest.mark.parametrize("skew_s", [0.0, 25.0, -25.0])
def test_a_successor_keeps_the_fence_of_a_lost_process_0(tmp_path, skew_s):
    """The host of process 0 cut off (its worker may still commit a save)
    and the controller restarted during the fence: its successor, which
    never saw that host, starts no generation before a whole lease from its
    own start, whatever its wall clock says: it may be a standby on another
    host. Before, the fence's end was read on the successor's wall clock,
    and one 25 s ahead dropped the fence (an audit found it)."""
    s, view, state = three_hosts_leased()
    started = d.Decision(state, (d.Journal("generation_started", 1, "", None, {}),), "")
    heartbeat_all(view, T0 + 4)
    for h in ("h1", "h2"):
        worker(view, h, T0 + 6, 1, WorkerState.RUNNING)
    stopping = decide(state, view, T0 + 9.5, s)  # h0 silent 5.5 s
    for h in ("h1", "h2"):
        worker(view, h, T0 + 9.6, 1, WorkerState.EXITED, sig=9)
    stopped = decide(stopping.state, view, T0 + 9.7, s)
    assert "waiting_for_fencing" in kinds(stopped)
    journal(tmp_path, [started, stopping, stopped], [T0, T0 + 9.5, T0 + 9.7])
    # heard at T0 + 4 by the journal's clock; the successor counts, from its
    # start, the lease (30 s), the agent's grace after a held-up check (2
    # intervals) and two checks (0.25 s each)
    successor = dataclasses.replace(carried(tmp_path, T0 + 12, s, skew_s), phase=Phase.WAITING,
                                    generation=1)
    assert (successor.fenced_until, successor.fence_host) == (SUCCESSOR_T0 + 12 + 32.5, "h0")
    assert failure_history.describe(successor, SUCCESSOR_T0 + 12)["fenced_s"] == 32.5
    fresh = ClusterView()
    for h in ("h1", "h2", "h3"):
        register(fresh, h, SUCCESSOR_T0 + 12)
    waiting = decide(successor, fresh, SUCCESSOR_T0 + 12, s)
    assert waiting.state.generation == 1 and "to fence itself" in waiting.reason
    later = start_generation(fresh, waiting.state, SUCCESSOR_T0 + 44.6, s, 1)
    assert later.state.generation == 2, later.reason
    # a generation started since, or the fence lifted: nothing carried
    for after in ("generation_started", "fence_lifted"):
        history = failure_history.after(recorded(tmp_path).failures, _entry(11, after))
        assert history.fenced_until == 0.0


def test_a_successor_fences_a_stop_its_predecessor_did_not_see_end(tmp_path):
    """The controller dies between slice_stopping and slice_stopped, the host
    of process 0 cut off: its worker may still commit a save. Before, the
    successor read no running slice and no fence, and started the next
    generation on the others at once (an audit found it). Now it waits for
    that host's lease, counted from its own start, unless the host is seen
    without a worker of that generation."""
    s, view, state = three_hosts_leased()
    started = d.Decision(state, (d.Journal("generation_started", 1, "", None,
                                           {"hosts": ["h0", "h1", "h2"]}),), "")
    heartbeat_all(view, T0 + 4)
    for h in ("h1", "h2"):
        worker(view, h, T0 + 6, 1, WorkerState.RUNNING)
    stopping = decide(state, view, T0 + 9.5, s)  # h0 silent 5.5 s: lost, the slice stops
    assert "slice_stopping" in kinds(stopping)
    journal(tmp_path, [started, stopping], [T0, T0 + 9.5])  # ... and the controller dies
    assert recorded(tmp_path).running is None
    successor = dataclasses.replace(carried(tmp_path, T0 + 12, s), phase=Phase.WAITING,
                                    generation=1)
    # the lease counted from the successor's start (T0 + 12), as if heard then
    assert (successor.fenced_until, successor.fence_host) == (SUCCESSOR_T0 + 12 + 32.5, "h0")
    fresh = ClusterView()
    for h in ("h1", "h2", "h3"):
        register(fresh, h, SUCCESSOR_T0 + 12)
    waiting = start_generation(fresh, successor, SUCCESSOR_T0 + 13, s, 1)
    assert waiting.state.generation == 1 and "host h0 of generation 1 to fence itself" in \
        waiting.reason, waiting.reason
    # h0 comes back without a worker of generation 1: the fence is lifted
    register(fresh, "h0", SUCCESSOR_T0 + 14)
    lifted = start_generation(fresh, waiting.state, SUCCESSOR_T0 + 14, s, 2)
    assert "fence_lifted" in kinds(lifted) and lifted.state.generation == 2, lifted.reason
    # a fence lifted (journaled; its controller died before a start) leaves
    # nothing to fence either
    only_lifted = d.Decision(lifted.state, tuple(a for a in lifted.actions if isinstance(
        a, d.Journal) and a.kind == "fence_lifted"), "")
    assert only_lifted.actions
    journal(tmp_path / "lifted", [started, stopping, only_lifted], [T0, T0 + 9.5, T0 + 14])
    assert carried(tmp_path / "lifted", T0 + 15, s).fenced_until == 0.0
    # a stop journaled as ended leaves nothing to fence
    stopped = decide(stopping.state, view, T0 + 60, s)
    assert "slice_stopped" in kinds(stopped)
    journal(tmp_path / "ended", [started, stopping, stopped], [T0, T0 + 9.5, T0 + 60])
    assert carried(tmp_path / "ended", T0 + 62, s).fenced_until == 0.0


def test_only_what_the_windows_still_count_is_carried():
    s = dataclasses.replace(spec(restart={"window_s": 100}),
                            quarantine=QuarantineSpec(failures=3, window_s=50, cooldown_s=30))
    history = FailureHistory(restarts_at=(WALL0 - 150, WALL0 - 50), without_progress=2,
                             host_failures={"a": (WALL0 - 60, WALL0 - 10), "b": (WALL0 - 70,)},
                             quarantined={"c": (WALL0 - 5, "old"), "d": (WALL0 + 20, "new")})
    state = failure_history.carried_into(SliceState(), history, 300.0, WALL0, s)
    assert state.failure_restarts == (250.0,)
    assert state.host_failures == {"a": (290.0,)}
    assert state.failures_without_progress == 2
    assert state.quarantined == {"c": (295.0, "old"), "d": (320.0, "new")}
    # controller_started lists the one not ended (not "c": -5.0, a day late after a job)
    assert failure_history.describe(state, 300.0)["quarantined"] == {"d": 20.0}
    # the first pass releases the quarantine that ended while no controller ran
    view = ClusterView()
    first = decide(dataclasses.replace(state, phase_since=300.0), view, 300.0, s)
    assert kinds(first).count("host_released") == 1 and list(first.state.quarantined) == ["d"]


def test_a_limit_used_up_before_the_controller_started_fails_the_job_at_once():
    """Its predecessor died between the stop of the failure that used up the
    crash loop and the check at the stop's end: the successor, waiting,
    fails the job instead of starting another generation."""
    s = spec(min_hosts=1, restart={"crash_loop_failures": 3})
    view = ClusterView()
    register(view, "h0")
    heartbeat_all(view, T0 + 2)
    state = SliceState(phase_since=T0, generation=3, failures_without_progress=3)
    first = decide(state, view, T0 + 2, s)
    assert first.state.phase is Phase.FAILED, first.reason
    assert "crash loop: 3 failures" in first.reason and "before this controller" in first.reason
    assert not [a for a in first.actions if isinstance(a, d.StartWorker)]
    budget = spec(min_hosts=1, restart={"max_restarts": 1})
    state = SliceState(phase_since=T0, generation=3, failure_restarts=(T0 - 10, T0 - 5))
    assert decide(state, view, T0 + 2, budget).state.phase is Phase.FAILED
    state = SliceState(phase_since=T0, generation=3, failure_restarts=(T0 - 5,))
    assert decide(state, view, T0 + 2, budget).state.phase is not Phase.FAILED
