"""Table tests of when a member is lost, carried or hung: silent agents
(elastic.policy.silence) and hangs (elastic.policy.hang), with a fake clock;
and the step time a generation inherits, for its hang timeout and for the
grow decision (elastic.policy.grow)."""

from __future__ import annotations

import dataclasses

import pytest

from elastic.config import HangSpec, QuarantineSpec
from elastic.policy import decide as d
from elastic.policy.decide import Phase, decide
from elastic.policy.hang import hang_timeout
from elastic.policy.state import forgive_pause
from elastic.policy.view import (ClusterView, HeartbeatReceived, ProgressReported, Registered,
                                 WorkerObs, WorkerReported, WorkerState, observe)
from tests.policy_tables import (T0, heartbeat_all, kinds, register, running_slice, spec,
                                 worker)

# --- silent agents ----------------------------------------------------------------------

def silent_member_setup(peer_step: int, peer_step_at: float, carry: bool = True,
                        h1_jump: int = 0, peer_jump: int = 0):
    """h0, h1, h2 at step 5 at T0 (h1's last report `h1_jump` steps above
    its one before); then only h0 and h2 are heard from, reporting steps up
    to `peer_step` (reached at T0 + `peer_step_at`) `peer_jump` at a time
    (default 1), heartbeating every second."""
    view = ClusterView()
    for h in ("h0", "h1", "h2"):
        register(view, h)
    if h1_jump:
        worker(view, "h1", T0 - 1, 1, WorkerState.RUNNING, step=5 - h1_jump)
    state = running_slice(view, ["h0", "h1", "h2"])
    steps = list(range(peer_step, 5, -(peer_jump or 1)))[::-1]
    for i, step in enumerate(steps):
        for h in ("h0", "h2"):
            observe(view, ProgressReported(h, f"inc-{h}", 1, step, -1),
                    T0 + peer_step_at * (i + 1) / len(steps))
    s = spec()
    s = dataclasses.replace(s, health=dataclasses.replace(s.health, carry_silent_hosts=carry))
    return state, view, s


def beat_peers(view: ClusterView, now: float) -> None:
    for h in ("h0", "h2"):
        observe(view, HeartbeatReceived(h, f"inc-{h}", view.hosts[h].worker, 0), now)


@pytest.mark.parametrize("peer_step,peer_step_at,now,carry,h1_jump,peer_jump,outcome", [
    (20, 4.0, 4.9, True, 0, 0, None),         # not silent for heartbeat_timeout_s (5 s) yet
    # the slice went 4 steps past h1's last report: 3, and the 1 step a report
    # of the slice lately carried (h1 may have stepped once since its last)
    (9, 4.0, 5.1, True, 0, 0, "carried"),
    (8, 4.0, 5.1, True, 0, 0, "lost"),        # 3: h1 may have died inside step 8
    (7, 4.0, 5.1, True, 0, 0, "lost"),        # 2 steps: h1 may have died inside step 7
    (20, 0.05, 5.1, True, 0, 0, "lost"),      # far ahead, but no step for 5 s: the slice stalled
    (20, 4.0, 5.1, False, 0, 0, "lost"),      # health.carry_silent_hosts = false
    # h1's reports went up 4 steps at a time: its worker may have stepped on
    # to 9 after its last report and died there, its peers waiting at 10
    (10, 4.0, 5.1, True, 4, 0, "lost"),
    (12, 4.0, 5.1, True, 4, 0, "carried"),
    # h1's last reports went up 2 steps at a time, its peers' 4: h1 too may
    # have stepped on 4 past its last report (the slice's steps, not its own)
    (10, 4.0, 5.1, True, 2, 4, "lost"),
    (12, 4.0, 5.1, True, 2, 4, "carried"),
])
def test_a_silent_member_is_carried_while_the_slice_steps_past_it(peer_step, peer_step_at, now,
                                                                  carry, h1_jump, peer_jump,
                                                                  outcome):
    state, view, s = silent_member_setup(peer_step, peer_step_at, carry, h1_jump, peer_jump)
    beat_peers(view, T0 + now)
    decision = decide(state, view, T0 + now, s)
    if outcome is None:
        assert kinds(decision) == [] and decision.state == state
    elif outcome == "carried":
        assert kinds(decision) == ["agent_silent"]
        entry = decision.actions[0]
        assert entry.host == "h1" and entry.fields["lead_steps"] == peer_step - 5
        assert decision.state.phase is Phase.RUNNING and not decision.state.lost
        assert decision.state.carried == {"h1": T0}
    else:
        assert "host_lost" in kinds(decision) and decision.state.lost == {"h1"}
        assert decision.state.phase is Phase.STOPPING and not decision.state.carried


@pytest.mark.parametrize("heard_again", [False, True])
def test_a_lost_host_does_not_return_when_a_pause_of_the_controller_is_forgiven(heard_again):
    """h1 is lost at T0 + 5.1 (carry off). The controller then does not run
    for 3 s: the others' silence clocks move on by the pause, h1's does not,
    so it stays lost, unless a heartbeat of its own comes; the view's
    records stay in order of their last heartbeat."""
    state, view, s = silent_member_setup(20, 4.0, carry=False)
    beat_peers(view, T0 + 5.1)
    lost = decide(state, view, T0 + 5.1, s).state
    assert lost.lost == {"h1"}
    view.forgive_pause(3.0, T0 + 8.2, lost.lost)
    assert view.hosts["h1"].last_heartbeat_at == T0
    assert view.hosts["h0"].last_heartbeat_at == pytest.approx(T0 + 8.1)
    if heard_again:
        observe(view, HeartbeatReceived("h1", "inc-h1", view.hosts["h1"].worker, 0), T0 + 8.2)
    after = decide(lost, view, T0 + 8.3, s)
    assert ("host_returned" in kinds(after)) is heard_again
    times = [r.last_heartbeat_at for r in view.hosts.values()]
    assert times == sorted(times)


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


@pytest.mark.parametrize("decide_at,hung", [
    (13.6, False),  # at once: it stepped with the slice all along
    (22.9, False),  # no step anywhere since T0 + 13, within the 10 s timeout
    (23.1, True),   # and then the slice is hung, as ever
])
def test_a_member_that_registers_again_keeps_its_step_clock(decide_at, hung):
    """A member cut off from the controller (carried: its worker trains on)
    whose stream broke registers again with the same incarnation, reporting
    the step its worker reached. Its step clock goes on from there, not
    from the generation's start: found in an isolated soak, where each such
    reconnect was declared a hang at once and restarted a healthy slice."""
    carried, view, s = carried_member(13)
    obs = dataclasses.replace(view.hosts["h1"].worker, step=23)
    observe(view, Registered("h1", "inc-h1", 2, "10.0.0.1", "h1", 100, 5001, obs, "cpu"),
            T0 + 13.5)
    heartbeat_all(view, T0 + decide_at)
    decision = decide(carried, view, T0 + decide_at, s)
    assert ("hang_detected" in kinds(decision)) is hung, decision.reason


def test_a_registration_carries_the_step_clock_of_the_same_incarnation():
    view = ClusterView()
    for h in ("h0", "h1"):
        register(view, h)
    running_slice(view, ["h0", "h1"])
    worker(view, "h1", T0 + 20, 1, WorkerState.RUNNING, step=30)
    obs = dataclasses.replace(view.hosts["h1"].worker, step=31)
    observe(view, Registered("h1", "inc-h1", 2, "10.0.0.1", "h1", 100, 5001, obs, "cpu"),
            T0 + 25)
    assert view.hosts["h1"].step_at == T0 + 25  # it advanced: now
    observe(view, Registered("h1", "inc-h1", 2, "10.0.0.1", "h1", 100, 5001, obs, "cpu"),
            T0 + 28)
    assert view.hosts["h1"].step_at == T0 + 25  # no further step: the clock stands
    observe(view, Registered("h1", "new-inc", 2, "10.0.0.1", "h1", 100, 5001, WorkerObs(),
                             "cpu"), T0 + 29)
    assert view.hosts["h1"].step_at == 0.0  # another agent process: a new record


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


def test_a_carried_member_whose_peers_finished_finishes_the_job_with_them():
    """Its peers exit 0 at step 23 (the program's end, which they could not
    reach without its worker) and then heartbeat for long: the job
    succeeded; the silent host is neither lost nor restarted for."""
    carried, view, s = carried_member(13)
    for h in ("h0", "h2"):
        worker(view, h, T0 + 13.5, 1, WorkerState.EXITED, step=23)
    beat_peers(view, T0 + 30.0)
    done = decide(carried, view, T0 + 30.0, s)
    assert kinds(done) == ["job_succeeded"] and done.state.phase is Phase.SUCCEEDED
    assert "h1" in done.actions[0].reason and done.actions[0].fields["step"] == 23


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


# --- hangs ------------------------------------------------------------------------------

@pytest.mark.parametrize("fixed,step_time,expected", [
    (0.0, None, 10.0),   # nothing learned yet: the minimum
    (0.0, 0.5, 10.0),    # 10 x 0.5 s is below the minimum
    (0.0, 2.0, 20.0),    # learned: 10 x the median step
    (7.0, 2.0, 7.0),     # set in the job spec
])
def test_hang_timeout_table(fixed, step_time, expected):
    s = dataclasses.replace(spec(), hang=HangSpec(timeout_s=fixed))
    assert hang_timeout(s, step_time) == expected


def after_generation_1(learned: float | None, step: int, heard_at: float) -> ClusterView:
    """h0 and h1 heard at `heard_at` (registered 100 s before) running
    generation 1 at `step`, reporting a median step of `learned` seconds
    (None: no step time)."""
    view = ClusterView()
    for h in ("h0", "h1"):
        register(view, h, now=heard_at - 100)
        observe(view, HeartbeatReceived(h, f"inc-{h}", WorkerObs(
            generation=1, state=WorkerState.RUNNING, pid=42, step=step,
            metrics={"step_time_s": learned} if learned else {}), 0), heard_at)
    return view


@pytest.mark.parametrize("learned,second_step_at,own,now,hung", [
    # generation 1 learned 15 s steps: 150 s, also before generation 2's second step
    (15.0, None, None, 12.0, False),
    (15.0, None, None, 151.0, True),
    (15.0, None, 2.0, 21.5, True),      # generation 2's own median (2 s) counts once reported
    # none ever reported: the startup allowance (300 s) up to the second step ...
    (None, None, None, 250.0, False),
    (None, None, None, 301.0, True),
    (None, 5.0, None, 15.5, True),      # ... then the 10 s floor
])
def test_a_generation_uses_the_last_step_time_learned_until_it_reports_its_own(
        learned, second_step_at, own, now, hung):
    """Generation 2 made its first step at T0. Before, its rank 0's metrics
    were empty until its worker reported step_time_s (after its 11th step),
    and the limit meanwhile was the 10 s floor: a job of 15 s steps read as
    hung at every generation's second step, and each generation's first step
    kept the crash loop from ever ending it."""
    view = after_generation_1(learned, step=100, heard_at=T0 - 200)
    state = running_slice(view, ["h0", "h1"], generation=2)  # a new worker: no metrics
    if second_step_at is not None:
        for h in ("h0", "h1"):
            worker(view, h, T0 + second_step_at, 2, WorkerState.RUNNING, step=6)
    if own is not None:
        observe(view, ProgressReported("h0", "inc-h0", 2, 6, -1, {"step_time_s": own}), T0 + 1)
        observe(view, ProgressReported("h1", "inc-h1", 2, 6, -1, {"step_time_s": own}), T0 + 1)
    heartbeat_all(view, T0 + now)
    decision = decide(state, view, T0 + now, spec())
    assert ("hang_detected" in kinds(decision)) is hung, decision.reason


@pytest.mark.parametrize("learned,grows", [
    (0.1, False),    # the last generation's 0.1 s steps: 990 steps save 33 s < 1.5 x 25 s
    (None, True),    # no step time ever reported: nothing to weigh, grow
])
def test_a_grow_is_weighed_with_the_last_step_time_before_the_generation_reports_its_own(
        learned, grows):
    """Generation 2's worker has made its first step (step 9) and reported no
    step time yet (it measures one at its second step). Before, grow_pays
    read rank 0's metrics only, found "a step time is not known" in every
    generation's first steps and grew, whatever the restart cost."""
    view = after_generation_1(learned, step=3, heard_at=T0 - 50)
    state = running_slice(view, ["h0", "h1"], generation=2, restart_costs_s=(25.0,))
    register(view, "h2", now=T0 + 1)
    # generation 2's rank 0 reports the job's length with its steps, no step time yet
    observe(view, ProgressReported("h0", "inc-h0", 2, 9, -1, {"steps_total": 1_000.0}), T0 + 1)
    s = spec(restart={"grow": "immediately"})
    first = decide(state, view, T0 + 1, s)
    assert (first.state.phase is Phase.STOPPING) is grows, first.reason
    if not grows:
        assert kinds(first) == ["grow_declined"] and "at 0.100 s" in first.actions[0].reason


def hang_setup(silent_s: float, suspended: str | None = None, saving: bool = False,
               finishing: bool = False):
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
        observe(view, WorkerReported("h0", "inc-h0", 1, "checkpoint_saved", "save of step 6",
                                     {"step": 6}), T0 + 1)
    if finishing:  # process 0 said it took its last step (generation 1), then exited
        observe(view, WorkerReported("h0", "inc-h0", 1, "worker_finishing", "done", {}), T0 + 1)
        worker(view, "h0", T0 + 2, 1, WorkerState.EXITED, step=6)
    heartbeat_all(view, T0 + silent_s)
    return state, view


@pytest.mark.parametrize("silent_s,suspended,saving,hung,first_suspect,finishing", [
    (9.0, None, False, False, None, False),
    (10.5, None, False, True, "h1", False),      # h1 advanced least recently
    (10.5, "h2", False, True, "h2", False),      # a suspended worker is the prime suspect
    (30.0, None, True, False, None, False),      # a save in flight: +60 s allowance
    (71.0, None, True, True, "h1", False),
    (30.0, None, False, False, None, True),      # finishing (the last save): +60 s too
    (71.0, None, False, True, "h1", True),       # ... and no more
])
def test_hang_detection(silent_s, suspended, saving, hung, first_suspect, finishing):
    state, view = hang_setup(silent_s, suspended, saving, finishing)
    decision = decide(state, view, T0 + silent_s, spec())
    assert ("hang_detected" in kinds(decision)) is hung
    if hung:
        entry = next(a for a in decision.actions if isinstance(a, d.Journal)
                     and a.kind == "hang_detected")
        assert entry.fields["suspects"][0] == first_suspect
        # the one behind the others, or the suspended one, takes the blame
        assert entry.fields["blamed"] == [first_suspect]
        stopping = next(a for a in decision.actions if isinstance(a, d.Journal)
                        and a.kind == "slice_stopping")
        assert stopping.fields["blamed"] == [first_suspect]
        assert decision.state.phase is Phase.STOPPING
        stops = [a for a in decision.actions if isinstance(a, d.StopWorker)]
        # SIGKILL at once, after each agent has dumped its worker's stacks
        assert {(a.grace_s, a.dump_stacks) for a in stops} == {(0.0, True)}


@pytest.mark.parametrize("saved_by,hung", [
    (1, True),    # generation 1's save, cut short by its end: nothing is in flight
    (2, False),   # generation 2's own save: + hang.checkpoint_allowance_s
])
def test_only_a_save_of_the_running_generation_extends_the_hang_timeout(saved_by, hung):
    """Before, a save the previous generation started and never committed
    (its slice stopped) counted as in flight in the next generation: every
    hang timeout there was 60 s longer until that generation's first save."""
    view = ClusterView()
    for h in ("h0", "h1"):
        register(view, h, now=T0 - 100)
    worker(view, "h0", T0 - 60, 1, WorkerState.RUNNING, step=3)
    observe(view, WorkerReported("h0", "inc-h0", 1, "checkpoint_saved", "save of step 3",
                                 {"step": 3}), T0 - 50)
    state = running_slice(view, ["h0", "h1"], generation=2)  # step 5 at T0
    view.step_time_s = 0.5  # (learned: the 10 s floor)
    if saved_by == 2:
        observe(view, WorkerReported("h0", "inc-h0", 2, "checkpoint_saved", "save of step 5",
                                     {"step": 5}), T0 + 1)
    heartbeat_all(view, T0 + 30)
    decision = decide(state, view, T0 + 30, spec())
    assert ("hang_detected" in kinds(decision)) is hung, decision.reason


@pytest.mark.parametrize("commits,hung", [
    (5, True),       # the save of step 5 committed: nothing in flight, the 10 s floor
    (None, False),   # still in flight: + hang.checkpoint_allowance_s
    (4, False),      # an older save's commit, reported late, does not end step 5's save
])
def test_a_commit_below_the_newest_step_ever_committed_ends_the_save_in_flight(commits, hung):
    """Generation 1 committed step 100, which would not read; generation 2
    restored an older step and saves step 5. Before, a commit at or below
    the newest step ever committed went unnoticed (unless an emergency
    save's): the save stayed in flight, 60 s more on every hang timeout,
    until training passed step 100."""
    view = ClusterView()
    for h in ("h0", "h1"):
        register(view, h, now=T0 - 600)
    worker(view, "h0", T0 - 510, 1, WorkerState.RUNNING, step=100)
    observe(view, ProgressReported("h0", "inc-h0", 1, 100, 100), T0 - 500)
    state = running_slice(view, ["h0", "h1"], generation=2)  # step 5 at T0
    view.step_time_s = 0.5  # (learned: the 10 s floor)
    observe(view, WorkerReported("h0", "inc-h0", 2, "checkpoint_saved", "save of step 5",
                                 {"step": 5}), T0 + 1)
    if commits is not None:
        facts = observe(view, ProgressReported("h0", "inc-h0", 2, 5, commits), T0 + 5)[1]
        assert [f.kind for f in facts] == (["checkpoint_committed"] if commits == 5 else [])
    heartbeat_all(view, T0 + 30)
    decision = decide(state, view, T0 + 30, spec())
    assert ("hang_detected" in kinds(decision)) is hung, decision.reason
    assert view.committed_step == 100  # (the newest stays the newest)


@pytest.mark.parametrize("stepped,progressed,blamed", [
    # every member stopped at step 5 (lockstep: all wait in one collective):
    # none singled out, so none blamed, and none quarantined
    ({"h0": 5, "h1": 5, "h2": 5}, True, []),
    ({"h0": 6, "h1": 5, "h2": 6}, True, ["h1"]),     # h1 behind: h1
    ({"h0": 5, "h1": 5, "h2": 6}, True, ["h0", "h1"]),
    # no first step yet on any (one would start the slice's progress)
    ({"h0": -1, "h1": -1, "h2": -1}, False, []),
])
def test_a_hang_is_blamed_on_the_members_it_singles_out(stepped, progressed, blamed):
    view = ClusterView()
    hosts = ["h0", "h1", "h2"]
    for h in hosts:
        register(view, h)
    state = running_slice(view, hosts, progressed=progressed)
    for h, step in stepped.items():
        worker(view, h, T0 + 1, 1, WorkerState.RUNNING, step=step)
    heartbeat_all(view, T0 + 700)
    # one failure quarantines: before, a lockstep hang set aside every host
    # min_hosts allowed, healthy ones included
    s = dataclasses.replace(spec(), quarantine=QuarantineSpec(failures=1, window_s=1000,
                                                              cooldown_s=600))
    decision = decide(state, view, T0 + 700, s)
    hang = next(a for a in decision.actions if isinstance(a, d.Journal)
                and a.kind == "hang_detected")
    assert hang.fields["blamed"] == blamed
    assert hang.fields["suspects"] and set(blamed) <= set(hang.fields["suspects"])
    stopping = next(a for a in decision.actions if isinstance(a, d.Journal)
                    and a.kind == "slice_stopping")
    assert stopping.fields["blamed"] == blamed
    assert sorted(decision.state.quarantined) == blamed
    assert decision.state.phase is Phase.STOPPING


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


@pytest.mark.parametrize("reports,now,hung", [
    ([(1.0, True), (2.0, True), (3.0, True)], 3.5, True),   # stopped 2.5 s: hung
    ([(1.0, True), (2.0, True)], 2.5, False),               # stopped 1.5 s: not yet
    ([(1.0, False), (2.0, False)], 250.0, False),           # starting: the startup allowance
])
def test_a_worker_stopped_before_its_first_step_is_hung_after_the_suspended_timeout(
        reports, now, hung):
    """Before, the startup branch returned before the suspended check: a
    worker SIGSTOPped before its first step waited out hang.startup_timeout_s
    (300 s) instead of hang.suspended_timeout_s (2 s)."""
    view = ClusterView()
    for h in ("h0", "h1"):
        register(view, h)
    state = running_slice(view, ["h0", "h1"], progressed=False)  # STARTING at T0
    inc = view.hosts["h1"].incarnation
    for at, suspended in reports:
        observe(view, HeartbeatReceived("h1", inc, WorkerObs(
            generation=1, state=WorkerState.RUNNING, pid=42, step=-1, suspended=suspended), 0),
            T0 + at)
    decision = decide(state, view, T0 + now, spec())
    assert ("hang_detected" in kinds(decision)) is hung, decision.reason
    if hung:
        entry = next(a for a in decision.actions if isinstance(a, d.Journal)
                     and a.kind == "hang_detected")
        assert entry.fields["suspects"] == ["h1"] and entry.fields["blamed"] == ["h1"]
        assert entry.fields["timeout_s"] == 2.0 and "stopped" in entry.reason


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


@pytest.mark.parametrize("progressed,pause_s,now,hung", [
    (False, 120.0, 320.0, False),  # 200 s of startup before the pause, 0 after: 200 s
    (False, 120.0, 425.0, True),   # ... and 105 s after it: 305 s of startup
    (False, 0.0, 320.0, True),     # no pause: 320 s of startup
    # a member with no step yet counts from the first step (T0), 9 s, then a 30 s pause
    (True, 30.0, 39.0 + 0.5, False),
    (True, 30.0, 39.0 + 1.5, True),
])
def test_a_controller_pause_does_not_count_against_the_hang_clock(progressed, pause_s, now,
                                                                   hung):
    """The controller did not run for `pause_s` seconds (stopped, starved,
    its VM suspended) from 200 s into the startup, or from 9 s after the
    first step, which one member has not made yet. Before, forgive_pause
    moved the view's step and heartbeat clocks but not phase_since, which
    the startup allowance (and a member with no step yet) counts from: a
    120 s pause 200 s into a 300 s startup declared a hang."""
    s = dataclasses.replace(spec(), hang=HangSpec(startup_timeout_s=300))
    view = ClusterView()
    for h in ("h0", "h1"):
        register(view, h)
    state = running_slice(view, ["h0", "h1"], progressed=False)  # STARTING at T0
    if progressed:  # h0's first step at T0; h1's worker has made none yet
        worker(view, "h0", T0, 1, WorkerState.RUNNING, step=5)
        state = dataclasses.replace(state, phase=Phase.RUNNING, progressed=True)
        view.step_time_s = 0.5  # (learned: the 10 s floor)
    paused_at = 9.0 if progressed else 200.0
    resumed = T0 + paused_at + pause_s
    view.forgive_pause(pause_s, resumed)
    state = forgive_pause(state, pause_s, resumed)
    heartbeat_all(view, T0 + now)
    decision = decide(state, view, T0 + now, s)
    assert ("hang_detected" in kinds(decision)) is hung, decision.reason
