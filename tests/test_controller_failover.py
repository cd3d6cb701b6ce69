"""The controller dies and comes back (`kill-controller`: SIGKILL, started
again 2 s later at the same address with the same spec and state dir, as
systemd restarts it) while the slice trains, and while a preempted host's
emergency checkpoint is under way: each time the new controller adopts the
running slice from the journal and the agents' reports, with no new
generation and no step lost. (The kill during a restart of the slice is in
tests/test_training.py, against the undisturbed run's loss; a leader cut off
from agents and bucket, replaced by a standby through the bucket lease, in
tests/test_isolation.py.)"""

from __future__ import annotations

import sys

import pytest

from elastic.chaos import CONTROLLER_RESTART_S
from tests.conftest import tiny_spec, wait_until


def test_a_restarted_controller_adopts_the_running_slice(tmp_path, local_job):
    # (no periodic save: a preemption that finds the step the slice stands at
    # committed stops it at once, before the second kill can land in the
    # drain this test is about; and the job runs until generation 2 steps
    # (a cue file): with a fixed 240 steps, a slow machine's restarts and
    # adoptions could outlast the run, or bring the adoption to a save)
    finish = tmp_path / "finish"
    spec = tiny_spec(tmp_path, "--steps 100000 --step-time-s 0.04 --checkpoint-every 100000 "
                     f"--save-time-s 1.5 --finish-when-file {finish}",
                     min_hosts=2, max_hosts=3)
    job = local_job(spec, hosts=3, faults=(
        "kill-controller:all@step=20",
        "preempt:host-0@after=slice_adopted",
        "kill-controller:all@after=preemption_notice"))
    job.wait_for("first_progress", generation=2, timeout_s=120)
    finish.touch()
    assert job.wait(120) == 0, job.output()
    journal = job.journal()
    kinds = [e["kind"] for e in journal]
    faults = [i for i, k in enumerate(kinds) if k == "fault_injected"]
    starts = [e for e in journal if e["kind"] == "controller_started"]
    assert len(faults) == 3 and len(starts) == 3, kinds

    # 1. killed while the slice trained: adopted, nothing restarted
    kill = journal[faults[0]]
    adopted = next(e for e in journal[faults[0]:] if e["kind"] == "slice_adopted")
    assert starts[1]["adopting"] == {"generation": 1, "hosts": ["host-0", "host-1", "host-2"],
                                     "progressed": True}
    assert starts[1]["run_id"] == starts[0]["run_id"]  # the same run: snapshots stay valid
    assert adopted["generation"] == 1 and adopted["step"] > kill["step"]  # it trained on
    between = kinds[faults[0]:journal.index(adopted)]
    assert not {"generation_started", "slice_stopping", "host_lost"} & set(between), between

    # 2. killed right after a preemption notice: the new controller adopts
    # generation 1, then drains it for the emergency checkpoint and goes on
    # without the preempted host
    notice = kinds.index("preemption_notice")
    assert faults[1] < notice < faults[2]
    second = next(e for e in journal[faults[2]:] if e["kind"] in ("slice_adopted",
                                                                   "slice_stopping"))
    assert second["kind"] == "slice_adopted" and second["generation"] == 1, second
    stop = next(e for e in journal[faults[2]:] if e["kind"] == "slice_stopping")
    assert stop["cause"] == "preemption" and stop["generation"] == 1, stop
    emergency = [e for e in journal if e["kind"] == "checkpoint_committed"
                 and e["ts"] > journal[notice]["ts"] and e["ts"] < stop["ts"]]
    assert emergency, "the emergency checkpoint committed before the slice stopped"
    started = [e for e in journal if e["kind"] == "generation_started"]
    assert [e["generation"] for e in started][:2] == [1, 2], started
    assert "host-0" not in started[1]["hosts"]  # (it may come back at a grow, generation 3)
    restored = next(e for e in journal if e["kind"] == "checkpoint_restored")
    assert restored["step"] == emergency[-1]["step"]  # not a step of it lost

    # never two generations at once: each started after the last one stopped
    stopped = [e for e in journal if e["kind"] == "slice_stopped"]
    assert stopped[0]["generation"] == 1 and stopped[0]["ts"] <= started[1]["ts"]
    assert kinds[-2:] == ["job_succeeded", "controller_stopped"]
    # every exit of a controller but the kills journaled controller_stopped
    assert kinds.count("controller_stopped") == 1


def test_a_standby_takes_over_at_once_and_a_deposed_term_is_not_obeyed(tmp_path, local_job):
    """`elasticd local --standby`: the leader is killed and the standby, on
    another port, takes the lock, adopts the slice and leads with a higher term; the
    killed one comes back as the new standby. The job ends once."""
    spec = tiny_spec(tmp_path, "--steps 160 --step-time-s 0.04 --checkpoint-every 50",
                     min_hosts=2, max_hosts=2)
    job = local_job(spec, hosts=2, faults=("kill-controller:all@step=20",),
                    extra_args=("--standby",))
    assert job.wait(90) == 0, job.output()
    journal = job.journal()
    kinds = [e["kind"] for e in journal]
    starts = [e for e in journal if e["kind"] == "controller_started"]
    assert 0 < starts[0]["term"] < starts[1]["term"], starts
    kill = journal[kinds.index("fault_injected")]
    adopted = journal[kinds.index("slice_adopted")]
    assert "standby takes over" in kill["reason"]
    # no restart delay to wait out: the standby led before the killed one
    # could even be started again (an order, not a bound on the adoption,
    # which takes the agents' reconnects: 1.0 s median, 1.7 s p95 when idle)
    assert starts[1]["ts"] - kill["ts"] < CONTROLLER_RESTART_S, (kill, starts[1])
    assert starts[1]["ts"] < adopted["ts"], (starts[1], adopted)
    assert kinds.count("generation_started") == 1 and "slice_stopping" not in kinds
    assert kinds[-2:] == ["job_succeeded", "controller_stopped"]
    log = (tmp_path / "state" / "controller.log").read_text()
    assert "the leader is gone; this controller holds the lock on" in log
    assert "this standby has nothing to do" in log  # the killed one, back as standby


def test_an_agent_refuses_commands_of_a_deposed_term(tmp_path):
    from elastic.agent.agent import Agent, AgentSettings
    from elastic.v1 import control_pb2 as pb

    agent = Agent(AgentSettings(controller="127.0.0.1:1", host_id="h0", devices=1,
                                address="127.0.0.1", failure_domain="h0",
                                state_dir=str(tmp_path), tls=None))
    spawned = []
    agent._spawn = lambda coro: (spawned.append(coro), coro.close())
    agent._term = 3
    stop = pb.StopWorker(generation=1, grace_s=0.0, reason="from the old leader")
    agent._command(pb.ControllerMessage(job_id="", generation=1, term=2, stop=stop))
    assert spawned == []  # refused
    agent._command(pb.ControllerMessage(job_id="", generation=1, term=3, stop=stop))
    assert len(spawned) == 1  # the current leader's is carried out


def test_an_agent_follows_no_deposed_leader_of_a_job_and_any_leader_of_the_next(
        tmp_path, monkeypatch):
    """Terms are compared within a job: a deposed leader of a job the agent
    followed is refused, the next job's leader is followed whatever its
    term (it may run on another host, with another clock)."""
    import asyncio

    from elastic import protocol
    from elastic.agent import session
    from elastic.agent.agent import Agent, AgentSettings
    from elastic.v1 import control_pb2 as pb

    class Followed(Exception):
        """The agent went on to open its stream."""

    replies = []

    class Stub:
        def __init__(self, channel) -> None:
            pass

        async def Register(self, request, timeout):
            return replies.pop(0)

        def Connect(self):
            raise Followed

    monkeypatch.setattr(session.pb_grpc, "ControllerStub", Stub)
    agent = Agent(AgentSettings(controller="127.0.0.1:1", host_id="h0", devices=1,
                                address="127.0.0.1", failure_domain="h0",
                                state_dir=str(tmp_path), tls=None))

    def register(job: str, term: int) -> str:
        replies.append(pb.RegisterResponse(job_id=job, term=term, heartbeat_interval_s=1.0,
                                           heartbeat_timeout_s=5.0, protocol=protocol.PROTOCOL,
                                           release=protocol.release()))
        try:
            asyncio.run(agent._session(None, "127.0.0.1:1"))
        except Followed:
            return "followed"
        except session._Deposed:
            return "refused"
        raise AssertionError("neither")

    assert register("a", 5) == "followed"
    agent._commanded = (5, 7)  # (a's generation 7 was started)
    assert register("a", 4) == "refused"   # a's deposed leader
    assert register("b", 3) == "followed" and agent.job_id == "b"
    assert agent._commanded == (0, 0)      # b's starts are not ordered after a's
    assert register("a", 4) == "refused"   # still a's deposed leader


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_bucket_lease_passes_only_after_the_leader_stops_renewing(tmp_path, gcs_emulator,
                                                                       gcs_bucket):
    """Two controllers with state dirs of their own and one bucket (the real
    emulator, a fake clock): the lease is the journal object, renewed by
    generation-matched uploads; a standby claims it only after lease_s
    without a renewal, with the leader's journal; the deposed leader's next
    renewal fails; a controller restarted on the holder's own state dir
    takes it back at once."""
    from elastic.controller.bucket_lease import BucketLease

    clock, client = FakeClock(), gcs_emulator.client()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = BucketLease(f"{gcs_bucket}/job", tmp_path / "a", 10.0, client, clock)
    b = BucketLease(f"{gcs_bucket}/job", tmp_path / "b", 10.0, client, clock)
    (tmp_path / "a" / "events.jsonl").write_text('{"ts": 1, "kind": "controller_started"}\n')
    assert a.try_acquire()  # no object yet: the first one leads
    assert not b.try_acquire()  # first sight of the generation
    clock.now += 8
    assert not b.try_acquire()
    with open(tmp_path / "a" / "events.jsonl", "a") as f:
        f.write('{"ts": 2, "kind": "generation_started"}\n')
    assert a.renew() == ""  # a new generation: the standby's wait starts again
    clock.now += 8
    assert not b.try_acquire()
    clock.now += 8
    assert not b.try_acquire()  # 8 s since it saw the renewal
    clock.now += 3
    assert b.try_acquire()  # 11 s without a renewal
    assert (tmp_path / "b" / "events.jsonl").read_text() == \
        (tmp_path / "a" / "events.jsonl").read_text()  # the journal goes on
    assert "deposed" in a.renew()
    assert b.renew() == ""
    again = BucketLease(f"{gcs_bucket}/job", tmp_path / "b", 10.0, client, clock)
    assert again.try_acquire()  # its own state dir's lease: no wait
    assert "deposed" in b.renew()  # (the old process of that state dir)


def test_a_deleted_lease_object_is_put_back_by_its_leader_not_taken_by_a_standby(
        tmp_path, gcs_emulator, gcs_bucket):
    """The journal object is deleted under a leader (a lifecycle rule, a
    cleanup of the prefix). Before, a standby claimed the missing object at
    once with its own, empty journal, and the leader's next renewal found
    itself deposed (an audit found it). Now the leader uploads it again at
    its next renewal, and a standby takes a missing object only after
    lease_s, as it would a silent one."""
    from elastic.controller.bucket_lease import BucketLease

    clock, client = FakeClock(), gcs_emulator.client()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = BucketLease(f"{gcs_bucket}/job", tmp_path / "a", 10.0, client, clock, job_id="j")
    b = BucketLease(f"{gcs_bucket}/job", tmp_path / "b", 10.0, client, clock, job_id="j",
                    standby=True)
    assert a.try_acquire()  # the job's first start: no object, nothing of it journaled
    started = b'{"ts": 1, "kind": "controller_started", "job_id": "j"}\n'
    (tmp_path / "a" / "events.jsonl").write_bytes(started)  # (journaled once it leads)
    blob = client.bucket(gcs_bucket.removeprefix("gs://")).blob(
        "job.elastic-controller/events.jsonl")
    blob.delete()
    clock.now += 0.5
    assert not b.try_acquire()  # missing: its wait starts
    assert a.renew() == "" and blob.exists()  # put back, not deposed
    assert blob.download_as_bytes() == started
    clock.now += 2.5
    assert not b.try_acquire() and not (tmp_path / "b" / "events.jsonl").exists()
    # a leader gone for good: the standby takes a missing object after lease_s
    blob.delete()
    assert not b.try_acquire()
    clock.now += 10
    assert b.try_acquire()
    # a controller restarted on a state dir where this job ran waits too
    blob.delete()
    again = BucketLease(f"{gcs_bucket}/job", tmp_path / "a", 10.0, client, clock, job_id="j")
    assert not again.try_acquire()


def test_a_controller_restarted_on_its_own_state_dir_keeps_its_unuploaded_lines(
        tmp_path, gcs_emulator, gcs_bucket):
    """A leader journals a quarantine and is killed before its next upload;
    restarted on its own state dir it takes its lease back at once. Before,
    the bucket's copy replaced its journal and the quarantine was dropped as
    a deposed controller's line (an audit found it)."""
    from elastic.controller.bucket_lease import BucketLease

    clock, client = FakeClock(), gcs_emulator.client()
    (tmp_path / "a").mkdir()
    a = BucketLease(f"{gcs_bucket}/job", tmp_path / "a", 10.0, client, clock, job_id="j")
    assert a.try_acquire()
    (tmp_path / "a" / "events.jsonl").write_text(
        '{"ts": 1, "kind": "controller_started", "job_id": "j", "term": 5}\n')
    assert a.renew() == ""
    with open(tmp_path / "a" / "events.jsonl", "a") as f:  # journaled, then SIGKILL
        f.write('{"ts": 2, "kind": "host_quarantined", "host": "h1", "until_s": 600}\n')
    again = BucketLease(f"{gcs_bucket}/job", tmp_path / "a", 10.0, client, clock, job_id="j")
    assert again.try_acquire()
    assert b"host_quarantined" in (tmp_path / "a" / "events.jsonl").read_bytes()
    blob = client.bucket(gcs_bucket.removeprefix("gs://")).get_blob(
        "job.elastic-controller/events.jsonl")
    assert b"host_quarantined" in blob.download_as_bytes()  # and the bucket has it


def test_a_claim_keeps_the_stretches_of_other_jobs_in_the_state_dir(tmp_path):
    """Job a (checkpoints on a bucket) ran in a state dir, then job b; a
    starts again there and claims its own object, which holds only a's
    entries: b's stretch stays in the local journal, so a's next
    generation follows b's and b's checkpoint directory stays known; a
    deposed controller's own lines and a's that the object has are not
    taken twice, fault lines stay."""
    import json

    from elastic.controller.bucket_lease import merge_tools_lines
    from elastic.controller.journal import recorded

    def line(ts, kind, **fields):
        return json.dumps({"ts": ts, "kind": kind, "host": None, "reason": "", **fields})

    a_started = [line(1, "controller_started", generation=0, job_id="a", run_id="ra",
                      checkpoint_dir="gs://x/a"),
                 line(2, "generation_started", generation=1, hosts=["h0"], coordinator="c:1")]
    b_stretch = [line(5, "controller_started", generation=1, job_id="b", run_id="rb",
                      checkpoint_dir="gs://x/b"),
                 line(6, "generation_started", generation=2, hosts=["h0"], coordinator="c:2")]
    bucket = "".join(x + "\n" for x in a_started).encode()
    local = "".join(x + "\n" for x in [*a_started, line(3, "first_progress", generation=1),
                                       line(4, "fault_injected", generation=1), *b_stretch])
    merged = merge_tools_lines(bucket, local.encode(), "a")
    assert merged.decode().splitlines() == [*a_started, line(4, "fault_injected", generation=1),
                                            *b_stretch]
    (tmp_path / "events.jsonl").write_bytes(merged)
    got = recorded(tmp_path, "a")
    assert (got.generation, got.running, got.run_id) == (2, None, "ra")
    assert got.other_checkpoints == {"gs://x/b": "b"} and got.after_other_job
    # without the job (as before): b's stretch is dropped with the deposed lines
    assert b"rb" not in merge_tools_lines(bucket, local.encode())


def test_a_new_leader_outranks_every_term_it_can_know_of():
    from elastic.controller.server import leader_term

    assert leader_term(0, 0, now=1000.5) == 1000  # a fresh job: the time in seconds
    assert leader_term(3, 1000, now=1000.9) == 1001  # the same second: still above
    assert leader_term(2000, 1000, now=1500.0) == 2000  # the lock's count is higher


def test_a_controller_waits_through_an_outage_for_its_lease_but_not_through_a_mistake():
    """The first try at the bucket lease: an outage (a transient
    StorageError) is polled through, standby or not, until the lease is
    taken; a mistake (no such bucket) ends the start at once without
    --standby. A controller restarted during an outage must not fail for
    good."""
    import asyncio

    from elastic.checkpoint.storage import StorageError
    from elastic.controller.server import _wait_to_lead

    def acquirer(answers):
        async def acquire():
            answer = answers.pop(0)
            if isinstance(answer, Exception):
                raise answer
            return answer
        return acquire

    async def lead(answers, standby=False):
        return await _wait_to_lead(acquirer(answers), "the lease", standby, 0.01,
                                   asyncio.Event(), [])

    outage = StorageError("503 from the bucket", transient=True)
    answers = [outage, outage, True]
    assert asyncio.run(lead(answers)) == (None, True) and answers == []
    with pytest.raises(StorageError, match="no such bucket"):
        asyncio.run(lead([StorageError("no such bucket"), True]))
    # a standby polls through either (the bucket may be fixed meanwhile)
    assert asyncio.run(lead([StorageError("no such bucket"), False, True], standby=True)) == \
        (None, True)


def test_a_renewal_rides_out_a_failed_upload_and_a_lost_answer(tmp_path, gcs_emulator,
                                                                gcs_bucket):
    """A 503 on one upload is tried again (no step-down for one failure); an
    upload that went through but whose answer was lost is recognised on the
    retry as this process's own write; a controller on another state dir,
    even with the same host name and path, is not taken for the holder."""
    from google.api_core import exceptions

    from elastic.controller.bucket_lease import BucketLease, holder_id

    clock, client = FakeClock(), gcs_emulator.client()
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "events.jsonl").write_text('{"ts": 1, "kind": "controller_started"}\n')
    lease = BucketLease(f"{gcs_bucket}/job", tmp_path / "a", 10.0, client, clock)
    assert lease.try_acquire()
    real_upload, calls = lease._upload, []

    def flaky(data: bytes, match: int) -> int:
        calls.append(match)
        if len(calls) == 1:
            raise exceptions.ServiceUnavailable("try again")
        if len(calls) == 2:
            real_upload(data, match)
            raise exceptions.ServiceUnavailable("the answer was lost")
        return real_upload(data, match)

    lease._upload = flaky
    before = lease.generation
    assert lease.renew() == ""
    blob = client.bucket(gcs_bucket.removeprefix("gs://")).get_blob(
        "job.elastic-controller/events.jsonl")
    assert lease.generation == blob.generation > before and len(calls) == 4
    assert holder_id(tmp_path / "a") == holder_id(tmp_path / "a") == lease.holder
    (tmp_path / "b").mkdir()
    assert holder_id(tmp_path / "b") != lease.holder


def test_a_controller_stopped_past_the_heartbeat_timeout_loses_no_host(tmp_path, local_job):
    """stop-controller: SIGSTOP for the heartbeat timeout + 2 s while the
    slice trains, then SIGCONT. Its own pause is not the hosts' silence:
    no host lost, no restart, one generation to the end."""
    spec = tiny_spec(tmp_path, "--steps 160 --step-time-s 0.04 --checkpoint-every 100",
                     min_hosts=2, max_hosts=2)
    job = local_job(spec, hosts=2, faults=("stop-controller:all@step=10",))
    assert job.wait(120) == 0, job.output()
    journal = job.journal()
    kinds = [e["kind"] for e in journal]
    paused = next(e for e in journal if e["kind"] == "controller_paused")
    assert paused["paused_s"] >= 1.5, paused  # (heartbeat_timeout_s)
    assert kinds.count("generation_started") == 1, kinds
    assert not {"host_lost", "slice_stopping", "agent_silent"} & set(kinds), kinds
    assert kinds[-2:] == ["job_succeeded", "controller_stopped"] and journal[-2]["step"] == 159


def test_a_restarted_controller_counts_on_the_crash_loop(tmp_path, local_job):
    """A worker that crashes at every start, and the controller killed at the
    first failure's stop: its successor reads the count from the journal, so
    the job fails after restart.crash_loop_failures (3) failures in all, not
    3 more (which would let a crash loop that takes its controller down too
    run forever). min_hosts = 2: no host can be set aside."""
    job = local_job(tiny_spec(tmp_path, "--crash-on-start", min_hosts=2, max_hosts=2), hosts=2,
                    faults=("kill-controller:all@after=slice_stopping",))
    assert job.wait(90) == 1, job.output()
    journal = job.journal()
    starts = [e for e in journal if e["kind"] == "controller_started"]
    assert len(starts) == 2, [e["kind"] for e in journal]
    carried = starts[1]["carried"]
    assert 1 <= carried["failures_without_progress"] == carried["failure_restarts"], carried
    failed = job.outcome()
    assert failed["kind"] == "job_failed" and "crash loop: 3 failures in a row" in failed["reason"]
    stops = [e for e in journal if e["kind"] == "slice_stopping"]
    assert [e["cause"] for e in stops] == ["failure"] * 3, stops
    assert [e["generation"] for e in journal if e["kind"] == "generation_started"] == [1, 2, 3]


def test_a_worker_crash_while_no_controller_runs_counts_as_a_failure(tmp_path, local_job):
    """The controller is killed at the first step; host-1's worker crashes
    once the kill is journaled (the test's cue: a file), before the next
    controller starts (2 s later). The successor finds it exited: a failure
    of host-1, not a mere restart of a slice it could not adopt, so with
    restart.max_restarts = 1 the crash of generation 2 exhausts the budget
    (2 failures), where uncounted it would take a third generation. (The
    crash once came 5 steps in, which raced the kill: on a slow CI machine
    the controller was killed more than 0.5 s after the first step and saw
    the crash itself.)"""
    cue = tmp_path / "crash-now"
    spec = tiny_spec(tmp_path, "--steps 2000 --step-time-s 0.1 --crash-on-host host-1 "
                     f"--crash-when-file {cue}", min_hosts=2, max_hosts=2,
                     extra="[restart]\nmax_restarts = 1")
    job = local_job(spec, hosts=2, faults=("kill-controller:all@after=first_progress",))
    job.wait_for("fault_injected", timeout_s=60)  # (the controller's kill)
    cue.touch()
    assert job.wait(90) == 1, job.output()
    journal = job.journal()
    stops = [e for e in journal if e["kind"] == "slice_stopping"]
    assert [(e["cause"], e["blamed"]) for e in stops] == [("failure", ["host-1"])] * 2, stops
    assert "while no controller ran" in stops[0]["reason"], stops[0]
    failed = job.outcome()
    assert "restart budget exhausted: 2 failures" in failed["reason"], failed
    assert [e["generation"] for e in journal if e["kind"] == "generation_started"] == [1, 2]


def test_a_leader_puts_its_term_in_the_bucket_before_any_agent_learns_it(
        tmp_path, proc_env, pki, gcs_emulator, gcs_bucket):
    """The term a leader gives its agents is in the bucket's journal before
    it answers any agent, not at its first renewal (lease_s / 4: 15 s here),
    nor while an upload started with it is still under way (a bucket 0.3 s
    away here): a standby that took over from a leader dead before that
    upload landed, on a clock behind the leader's, would lead with a lower
    term, which every agent refuses (two audits of the controller found
    it)."""
    import json
    import subprocess

    from elastic.checkpoint.faulty_storage import FaultProxy

    spec = tiny_spec(tmp_path, min_hosts=2, max_hosts=2,
                     job_extra=f'checkpoint_dir = "{gcs_bucket}/job"',
                     extra="leader_lease_s = 60.0")
    log = (tmp_path / "controller.log").open("wb")
    with FaultProxy(gcs_emulator.url) as proxy:
        proxy.set(latency_s=0.3)
        controller = subprocess.Popen(
            [sys.executable, "-m", "elastic.cli", "start", "--config", str(spec),
             "--state-dir", str(tmp_path / "state"), "--listen", "127.0.0.1:0", "--tls-dir",
             str(pki.controller.cert.parent)], env=dict(proc_env, **proxy.env),
            stdout=subprocess.DEVNULL, stderr=log)
        try:
            serving = tmp_path / "state" / "controller.addr"

            def answers_agents():  # (written once its gRPC server serves)
                if controller.poll() is not None:
                    raise AssertionError((tmp_path / "controller.log").read_text()[-3000:])
                return serving.exists()

            wait_until(answers_agents, 60, "the controller serving")
            blob = gcs_emulator.client().bucket(gcs_bucket.removeprefix("gs://")).blob(
                "job.elastic-controller/events.jsonl")
            # (read at once: no later upload counts)
            entries = [json.loads(line) for line in blob.download_as_bytes().splitlines()]
            term = next((e["term"] for e in entries if e["kind"] == "controller_started"), None)
            local = [json.loads(line) for line in
                     (tmp_path / "state" / "events.jsonl").read_text().splitlines()]
            assert term == next(e["term"] for e in local if e["kind"] == "controller_started")
        finally:
            controller.terminate()
            controller.wait(30)
            log.close()
