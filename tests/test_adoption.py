"""Table tests of adoption (elastic.policy.adopt, the ADOPTING phase of
elastic.policy.decide) and of what the journal hands a restarted controller
(elastic.controller.journal.recorded), with a fake clock."""

from __future__ import annotations

import dataclasses
import json

import pytest

from elastic.controller.journal import job_entries, job_sharing, read_journal, recorded
from elastic.policy import failure_history
from elastic.policy.adopt import Inherited, discover, judge, window_s
from elastic.policy.decide import Phase, SliceState, decide
from elastic.policy.view import ClusterView, Registered, WorkerObs, WorkerState, observe
from tests import test_failure_history as fh
from tests.policy_tables import T0, kinds, spec

HOSTS = ("h0", "h1", "h2")
INHERITED = Inherited(generation=4, hosts=HOSTS, incarnations=("inc-h0", "inc-h1", "inc-h2"),
                      coordinator="10.0.0.1:5000", devices_per_host=2, device_kind="cpu",
                      progressed=True, restarts=3)


def come_back(view: ClusterView, host: str, now: float = T0, **worker) -> None:
    """`host`'s agent registers again, reporting its worker (by default:
    running generation 4 at its rank of 3, step 120)."""
    rank = HOSTS.index(host)
    obs = dict(generation=4, state=WorkerState.RUNNING, pid=40 + rank, step=120,
               process_id=rank, num_processes=3)
    obs.update(worker)
    incarnation = obs.pop("incarnation", f"inc-{host}")
    observe(view, Registered(host, incarnation, 2, "10.0.0.1", host, 100, 0,
                             WorkerObs(**obs), "cpu"), now)


@pytest.mark.parametrize("changes,back,waited,verdict,why", [
    ({}, HOSTS, 0.5, "adopt", "all 3 hosts"),
    ({}, HOSTS[:2], 1.0, None, ""),                                   # h2 not back yet
    ({}, HOSTS[:2], 5.0, "restart", "h2 of generation 4 did not register within 5 s"),
    ({"h1": {"incarnation": "new"}}, HOSTS, 0.5, "restart", "agent of host h1 restarted"),
    ({"h1": {"generation": 5}}, HOSTS, 0.5, "restart", "a worker of generation 5"),
    ({"h1": {"generation": 0, "state": WorkerState.IDLE}}, HOSTS, 0.5, "restart", "no worker"),
    ({"h2": {"state": WorkerState.EXITED, "exit_code": 1}}, HOSTS, 0.5, "failure",
     "h2 exited with exit code 1 while no controller ran"),
    # a crash waits for every member (the missing one may be its cause) ...
    ({"h1": {"state": WorkerState.EXITED, "signal": 9}}, HOSTS[:2], 0.5, None, ""),
    # ... and, the window over, is blamed on the member still missing
    ({"h1": {"state": WorkerState.EXITED, "signal": 9}}, HOSTS[:2], 5.0, "failure",
     "h2 did not register within 5 s while no controller ran"),
    # the likeliest cause: an exit of its own before a kill, an abort (what JAX
    # does to a dead process's peers) last
    ({"h0": {"state": WorkerState.EXITED, "signal": 6},
      "h1": {"state": WorkerState.EXITED, "signal": 9},
      "h2": {"state": WorkerState.EXITED, "exit_code": 1}}, HOSTS, 0.5, "failure",
     "h2 exited with exit code 1"),
    ({"h0": {"state": WorkerState.EXITED, "signal": 6},
      "h1": {"state": WorkerState.EXITED, "signal": 9}}, HOSTS, 0.5, "failure", "h1 exited"),
    # a worker its agent stopped (self-fencing once no controller was heard
    # for its lease) failed nothing: the slice restarts, no host is blamed
    ({"h1": {"state": WorkerState.EXITED, "signal": 9, "stopped_on_request": True}}, HOSTS, 0.5,
     "restart", "h1 was stopped by its agent"),
    ({"h1": {"process_id": 2}}, HOSTS, 0.5, "restart", "runs rank 2 of 3"),
    # a worker that finished while no controller ran is adopted (the job may be done)
    ({"h0": {"state": WorkerState.EXITED}}, HOSTS, 0.5, "adopt", "all 3 hosts"),
    # an agent that does not say its worker's rank (older) is judged on the rest
    ({"h1": {"process_id": 0, "num_processes": 0}}, HOSTS, 0.5, "adopt", "all 3"),
])
def test_judge(changes, back, waited, verdict, why):
    view = ClusterView()
    for host in back:
        come_back(view, host, **changes.get(host, {}))
    result = judge(INHERITED, view, waited, window_s(5.0))
    if verdict is None:
        assert result is None
    else:
        assert result.what == verdict and why in result.why, result
        assert len(result.blamed) == (verdict == "failure")


def adopting(now: float = T0) -> SliceState:
    return SliceState(phase=Phase.ADOPTING, generation=4, phase_since=now, inherited=INHERITED)


def test_a_slice_whose_hosts_agree_is_adopted_as_it_runs():
    view, s = ClusterView(), spec()
    for host in HOSTS[:2]:
        come_back(view, host, T0 + 0.2)
    waiting = decide(adopting(), view, T0 + 0.3, s)
    # nothing sent meanwhile: the workers being adopted are no strays
    assert waiting.actions == () and waiting.state.phase is Phase.ADOPTING
    assert "2 of its 3 hosts" in waiting.reason
    come_back(view, "h2", T0 + 0.4)
    adopted = decide(waiting.state, view, T0 + 0.5, s)
    assert kinds(adopted) == ["slice_adopted"], adopted.actions
    st = adopted.state
    assert (st.phase, st.generation, st.members, st.coordinator, st.restarts) == (
        Phase.RUNNING, 4, HOSTS, "10.0.0.1:5000", 3)
    assert st.incarnations == INHERITED.incarnations and st.inherited is None
    assert adopted.actions[0].fields["step"] == 120
    # and it runs on: no stop, no new generation, a later pass is quiet
    assert kinds(decide(st, view, T0 + 1.0, s)) == []


def test_a_disagreeing_host_restarts_the_slice_without_blame():
    view, s = ClusterView(), spec()
    come_back(view, "h0")
    come_back(view, "h1", incarnation="new")
    come_back(view, "h2")
    stopping = decide(adopting(), view, T0 + 0.1, s)
    assert kinds(stopping) == ["slice_stopping"]
    entry = stopping.actions[0]
    assert entry.fields["cause"] == "adoption" and "restarted" in entry.reason
    assert stopping.state.phase is Phase.STOPPING and not stopping.state.host_failures
    assert {a.host for a in stopping.actions[1:]} == set(HOSTS)  # every member told to stop
    # the agents acknowledge: the next generation is 5, not counted as a failure
    for host in HOSTS:
        come_back(view, host, T0 + 0.2, state=WorkerState.EXITED, signal=9,
                  incarnation=view.hosts[host].incarnation)
    waiting = decide(stopping.state, view, T0 + 0.3, s)
    assert waiting.state.phase in (Phase.WAITING, Phase.STARTING)
    assert waiting.state.failure_restarts == () and waiting.state.restarts == 4


def test_a_worker_that_crashed_while_no_controller_ran_is_a_failure_of_its_host():
    """Not an adoption restart: the crash counts towards the restart budget
    and the host's quarantine (and, with no step made, the crash loop), as
    it would have with a controller running."""
    for progressed, count in ((True, 1), (False, 3)):
        view, s = ClusterView(), spec()
        for host in HOSTS:
            come_back(view, host, **({} if host != "h1" else
                                     {"state": WorkerState.EXITED, "exit_code": 2}),
                      **({} if progressed else {"step": -1}))
        state = dataclasses.replace(adopting(), failures_without_progress=2,
                                    inherited=dataclasses.replace(INHERITED,
                                                                  progressed=False))
        stopping = decide(state, view, T0 + 0.1, s)
        entry = stopping.actions[0]
        assert (entry.kind, entry.fields["cause"], entry.fields["blamed"]) == \
            ("slice_stopping", "failure", ["h1"]), entry
        assert "exit code 2 while no controller ran" in entry.reason
        assert stopping.state.host_failures == {"h1": (T0 + 0.1,)}
        assert stopping.state.failures_without_progress == count
        for host in ("h0", "h2"):
            come_back(view, host, T0 + 0.2, state=WorkerState.EXITED, signal=9)
        after = decide(stopping.state, view, T0 + 0.3, s)
        if progressed:
            assert after.state.failure_restarts == (T0 + 0.1,), after.reason
        else:
            assert after.state.phase is Phase.FAILED and "crash loop" in after.reason


def test_a_slice_cut_off_whole_is_replaced_only_after_its_lease():
    """Every member lost at once, none seen to stop: they may train on
    together until their agents' controller lease runs out."""
    from tests.policy_tables import heartbeat_all, register, running_slice
    s = spec(min_hosts=1)
    s = dataclasses.replace(s, health=dataclasses.replace(s.health, controller_lease_s=30.0))
    view = ClusterView()
    for h in ("h0", "h1", "h3"):
        register(view, h)
    state = running_slice(view, ["h0", "h1"])
    heartbeat_all(view, T0)
    for t in range(1, 8):  # only the spare h3 is heard from
        register(view, "h3", T0 + t, incarnation="inc-h3")
    lost = decide(state, view, T0 + 5.5, s)
    assert kinds(lost)[:2] == ["host_lost", "host_lost"]
    stopped = decide(lost.state, view, T0 + 5.6, s)
    assert "waiting_for_fencing" in kinds(stopped)
    assert stopped.state.phase is Phase.WAITING
    assert "host h0, process 0 of generation 1, to fence itself" in decide(
        stopped.state, view, T0 + 20.0, s).reason
    # the lease (30 s from when they were last heard), the grace of an agent
    # whose checks were held up (2 intervals) and two checks (0.25 s) later
    assert stopped.state.fenced_until == T0 + 32.5
    register(view, "h3", T0 + 31.5, incarnation="inc-h3")
    assert "to fence itself" in decide(stopped.state, view, T0 + 32.4, s).reason
    started = decide(stopped.state, view, T0 + 32.6, s)
    assert "generation_started" in kinds(started), started.reason


def journal(tmp_path, *entries) -> None:
    lines = [json.dumps({"ts": 1.0 + i, "host": None, "reason": "", **e})
             for i, e in enumerate(entries)]
    (tmp_path / "events.jsonl").write_text("\n".join(lines) + "\n")


STARTED = {"kind": "generation_started", "generation": 2, "hosts": ["h0", "h1"],
           "incarnations": ["a", "b"], "coordinator": "10.0.0.1:5000",
           "devices_per_host": 2, "device_kind": "cpu", "restarts": 1}


@pytest.mark.parametrize("after,running,progressed", [
    ([], True, False),
    ([{"kind": "first_progress", "generation": 2, "step": 0}], True, True),
    ([{"kind": "slice_adopted", "generation": 2}], True, False),
    ([{"kind": "slice_stopping", "generation": 2}], False, False),
    ([{"kind": "job_succeeded", "generation": 2}], False, False),
])
def test_the_journal_names_the_generation_still_running(tmp_path, after, running, progressed):
    journal(tmp_path, {"kind": "controller_started", "generation": 0, "run_id": "r1"},
            STARTED, *after, {"kind": "controller_started", "generation": 2, "run_id": "r2"})
    got = recorded(tmp_path)
    assert got.generation == 2 and got.run_id == "r1"  # the first controller's run id
    if not running:
        assert got.running is None
    else:
        assert got.running == Inherited(2, ("h0", "h1"), ("a", "b"), "10.0.0.1:5000", 2, "cpu",
                                        progressed, 1)


@pytest.mark.parametrize("named", ["field", "reason"])  # (journals before the field: its reason)
def test_a_new_job_in_the_state_dir_inherits_only_generation_and_term(tmp_path, named):
    """Job "b" after job "a" in one state directory: not a's run id (the
    hosts' local snapshots of a would be restored into b), steps, end or
    running slice; its generations and terms go on from a's, and a's
    checkpoint directory is known as a's."""
    a = {"job_id": "a"} if named == "field" else {}
    journal(tmp_path, {"kind": "controller_started", "generation": 0, "run_id": "r1", "term": 3,
                       "reason": "job a: 1 to 4 hosts, mesh data=-1", "checkpoint_dir": "/c/a/",
                       **a},
            STARTED, {"kind": "checkpoint_committed", "generation": 2, "step": 40},
            {"kind": "job_succeeded", "generation": 2})
    got = recorded(tmp_path, "b")
    assert (got.generation, got.term, got.other_checkpoints, got.after_other_job) == \
        (2, 3, {"/c/a/": "a"}, True)
    assert (got.run_id, got.step, got.committed_step, got.running, got.ended) == \
        ("", -1, -1, None, None)
    assert recorded(tmp_path, "a").run_id == "r1" and recorded(tmp_path, "a").ended == 0
    # b's own controller since: b's entries count again
    with (tmp_path / "events.jsonl").open("a") as f:
        f.write(json.dumps({"ts": 9.0, "host": None, "reason": "", "kind": "controller_started",
                            "generation": 2, "run_id": "r2", "job_id": "b", "term": 4}) + "\n")
    got = recorded(tmp_path, "b")
    assert (got.run_id, got.term, got.committed_step, got.after_other_job) == ("r2", 4, -1, False)


def test_a_job_back_after_another_adopts_its_slice_only_if_none_ran_since(tmp_path):
    """a, then b, then a again in one state directory: a's generation 2
    still runs if b started nothing (b's controller took no host: the
    agents running a's workers are a's), and has ended once b started its
    generation 3, after which a's next generation follows b's."""
    journal(tmp_path, {"kind": "controller_started", "generation": 0, "job_id": "a"}, STARTED,
            {"kind": "controller_started", "generation": 2, "job_id": "b"})
    got = recorded(tmp_path, "a")
    assert got.running is not None and got.running.generation == 2 and got.after_other_job
    with (tmp_path / "events.jsonl").open("a") as f:
        f.write(json.dumps({**STARTED, "generation": 3, "ts": 9.0, "reason": ""}) + "\n")
    got = recorded(tmp_path, "a")
    assert got.running is None and got.generation == 3 and got.after_other_job


def test_another_job_that_named_no_checkpoint_directory_kept_them_in_the_default(tmp_path):
    journal(tmp_path, {"kind": "controller_started", "generation": 0, "job_id": "a"})
    assert recorded(tmp_path, "b").other_checkpoints == {str(tmp_path / "checkpoints"): "a"}


@pytest.mark.parametrize("mine,theirs,shared", [
    ("gs://b/x", "gs://b/x/", True),
    ("gs://b/x/a", "gs://b/x", True),       # inside the other's: Orbax removes non-steps
    ("gs://b/x", "gs://b/x/a", True),
    ("gs://b/x-a", "gs://b/x", False),      # a name that begins alike is another directory
    ("gs://b/a", "gs://b/x", False),
    ("{tmp}/link/c", "{tmp}/real/c", True),  # one directory under two names
    ("{tmp}/real/d", "{tmp}/real/c", False),
])
def test_job_sharing_finds_checkpoints_in_or_around_another_jobs(tmp_path, mine, theirs, shared):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    others = {theirs.format(tmp=tmp_path): "other"}
    assert (job_sharing(mine.format(tmp=tmp_path), others) == "other") is shared


@pytest.mark.parametrize("jobs,of,kept", [
    (["a", "a", "b", "b"], None, [2, 3]),   # the latest job's stretch
    (["a", "a", "b", "b"], "a", []),        # a ran before b: nothing of a is current
    (["a", "b", "a"], None, [2]),
    ([None, "a"], None, [0, 1]),            # unnamed entries count as the job after them
    (["b"], "b", [0]),
])
def test_job_entries_keeps_the_latest_stretch_of_a_job(jobs, of, kept):
    entries = [{"kind": "controller_started", "reason": "", "i": i,
                **({"job_id": job} if job else {})} for i, job in enumerate(jobs)]
    assert [e["i"] for e in job_entries(entries, of)] == kept


@pytest.mark.parametrize("back,waited,found", [
    (HOSTS, 0.5, "all"),           # every rank of generation 4 reports: rebuilt
    (HOSTS[:2], 1.0, None),        # rank 2 not back yet: wait
    (HOSTS[:2], 5.0, ""),          # not within the window: give up (a restart)
    ((), 1.0, None),               # nobody registered yet
])
def test_a_generation_the_journal_lacks_is_found_in_the_reports(back, waited, found):
    view = ClusterView()
    for host in back:
        come_back(view, host)
    result = discover(view, 3, waited, window_s(5.0), 4)
    if found == "all":
        assert result == Inherited(4, HOSTS, INHERITED.incarnations, "", 2, "cpu", True)
    else:
        assert result == found


def test_no_generation_to_find_when_the_hosts_run_none():
    view = ClusterView()
    come_back(view, "h0", generation=0, state=WorkerState.IDLE)
    assert discover(view, 0, 0.1, window_s(5.0), 3) == ""  # a new job: start at once
    # the first host back is idle; the slice's hosts may still be reconnecting
    assert discover(view, 3, 0.1, window_s(5.0), 3) is None
    assert discover(view, 3, window_s(5.0), window_s(5.0), 3) == ""  # the window is over
    come_back(view, "h1", generation=3)  # the journal's own generation: not newer
    come_back(view, "h2", generation=0, state=WorkerState.IDLE)
    # max_hosts back, but two never ran the journal's generation: spares, while
    # the hosts of a generation the journal lacks may still be reconnecting
    assert discover(view, 3, 0.1, window_s(5.0), 3) is None
    for host in ("h0", "h2"):
        come_back(view, host, generation=3, state=WorkerState.EXITED)
    assert discover(view, 3, 0.1, window_s(5.0), 3) == ""  # max_hosts of it back, none newer


def test_a_controller_whose_journal_ends_early_adopts_what_the_agents_report():
    view, s = ClusterView(), spec()
    for host in HOSTS:
        come_back(view, host, T0 + 0.2)
    state = SliceState(phase=Phase.ADOPTING, generation=3, phase_since=T0)
    decision = decide(state, view, T0 + 0.3, s)
    assert kinds(decision) == ["generation_discovered", "slice_adopted"], decision.actions
    assert (decision.state.phase, decision.state.generation, decision.state.members) == (
        Phase.RUNNING, 4, HOSTS)


def test_no_generation_a_worker_reports_is_started_again():
    """The journal ends at generation 3, but the hosts' workers were of 5
    (the journal ended early and 5 could not be adopted): the next is 6."""
    from tests.policy_tables import register, worker

    view, s = ClusterView(), spec()
    for host in HOSTS:
        register(view, host, T0)
        worker(view, host, T0 + 0.1, 5, WorkerState.EXITED, sig=9)
    state = SliceState(phase=Phase.WAITING, generation=3, phase_since=T0)
    started = decide(state, view, T0 + 5.0, s)
    assert kinds(started)[-1] == "generation_started", started.reason
    assert started.state.generation == 6


@pytest.mark.parametrize("crashed,failure_step,count", [
    (False, -1, 0),   # adopted at step 120: the crash loop is over, as a first step ends it
    (True, -1, 1),    # h1 crashed while no controller ran, after the slice's step 120
    (False, 50, 0),   # the count's failure was at step 50: the slice got away from it
    (False, 120, 2),  # ... at step 120, where the slice stands: not yet
    (True, 121, 3),   # ... and h1 crashed there (within a step) again
    (True, 50, 1),
])
def test_an_adopted_slice_counts_the_crash_loop_as_its_journal_does(tmp_path, crashed,
                                                                    failure_step, count):
    """Two failures in a row without progress were journaled before the
    controller restarted (the first at `failure_step`, -1: none); the slice
    it finds made a step since. Live and from the journal alike, the count
    starts again unless the slice stands at the step of those failures (an
    audit found the first two cases off: live 2 and 3, the journal 0 and 3;
    and a crash at the same step after every restore was never counted)."""
    view, s = ClusterView(), spec()
    for host in HOSTS:
        come_back(view, host, **({"state": WorkerState.EXITED, "exit_code": 1}
                                 if crashed and host == "h1" else {}))
    state = dataclasses.replace(adopting(), failures_without_progress=2,
                                failure_step=failure_step)
    decision = decide(state, view, T0 + 0.1, s)
    assert kinds(decision)[0] == ("slice_stopping" if crashed else "slice_adopted")
    assert decision.state.failures_without_progress == count
    fh.journal(tmp_path, [decision], [T0 + 0.1])
    replayed = failure_history.FailureHistory(without_progress=2, failure_step=failure_step)
    for entry in read_journal(tmp_path):
        replayed = failure_history.after(replayed, entry)
    assert (replayed.without_progress, replayed.failure_step) == \
        (count, decision.state.failure_step)


def test_a_member_missing_at_adoption_must_still_acknowledge_the_stop():
    """h0 (process 0) misses the adoption window; the slice restarts. h0
    comes back during the stop, its worker of generation 4 still running:
    the stop waits for its acknowledgement. Before, it was a member of
    incarnation "" and counted as stopped at once, unfenced (an audit)."""
    view, s = ClusterView(), spec()
    for host in ("h1", "h2"):
        come_back(view, host)
    stopping = decide(adopting(), view, T0 + 5.1, s)
    assert kinds(stopping)[0] == "slice_stopping" and "h0" in stopping.reason
    assert stopping.state.incarnations == INHERITED.incarnations
    come_back(view, "h0", T0 + 5.2)  # the same agent process, its worker running
    for host in ("h1", "h2"):
        come_back(view, host, T0 + 5.2, state=WorkerState.EXITED, signal=9)
    later = decide(stopping.state, view, T0 + 5.3, s)
    assert later.state.phase is Phase.STOPPING, later.reason  # waiting for h0
    come_back(view, "h0", T0 + 5.4, state=WorkerState.EXITED, signal=9)
    done = decide(later.state, view, T0 + 5.5, s)
    assert "slice_stopped" in kinds(done) and done.state.fenced_until == 0.0
