"""Short chaos runs: each fault kind once, seeded, on a local 4-host slice of
the tiny worker. The job must reach its last step, never restart from less
than the latest committed checkpoint, and the report must list exactly the
injected fault, with no process left behind."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from elastic.chaos import parse_chaos, schedule
from elastic.goodput import account
from elastic.v1 import control_pb2 as pb
from tests.conftest import tiny_spec

STEPS = 420
# the slice's step at each of a run's three faults; every restart lines the
# hosts up again (tiny workers step on their own: a host may be done early).
# After the last one, 240 steps (~4.8 s) outlast a stopped agent's 3.5 s:
# with 120, the others could finish while it was stopped, and it was lost.
FAULT_STEPS = (40, 110, 180)


def chaos_spec(tmp_path, steps: int = STEPS):
    spec = tiny_spec(tmp_path, f"--steps {steps} --step-time-s 0.02 --checkpoint-every 20 "
                               f"--save-time-s 0.3")
    spec.write_text(spec.read_text() + """
[hang]
min_timeout_s = 3.0

[preemption]
drain_timeout_s = 5.0

[restart]
grow = "immediately"
""")
    return spec


@pytest.mark.parametrize("kinds", [("kill-during-save", "kill-worker", "stop-agent"),
                                   # a preempted host drains and a killed one grows
                                   # back: alone, so that nothing overlaps them
                                   ("stop-worker",), ("preempt",), ("kill-host",)])
def test_each_fault_kind(tmp_path, local_job, kinds):
    """Faults of the given kinds in one run (one run per kind cost 70 s of
    the suite), each on another host, far enough apart that the slice has
    recovered from one before the next."""
    planned = [f"{kind}:host-{i + 1}@step={step}"
               for i, (kind, step) in enumerate(zip(kinds, FAULT_STEPS))]
    steps = STEPS if len(kinds) > 1 else 150
    job = local_job(chaos_spec(tmp_path, steps), faults=tuple(planned))
    assert job.wait(90) == 0, job.output()
    journal = job.journal()
    faults = [e for e in journal if e["kind"] == "fault_injected"]
    assert [(f["fault"], f["host"]) for f in faults] == \
        [(kind, f"host-{i + 1}") for i, kind in enumerate(kinds)]
    done = job.outcome()
    assert done["kind"] == "job_succeeded" and done["step"] == steps - 1

    # no committed checkpoint lost: every generation after the first resumed from
    # the latest step committed before it started
    for started in (e for e in journal if e["kind"] == "generation_started"
                    and e["generation"] > 1):
        committed = [e["step"] for e in journal if e["kind"] == "checkpoint_committed"
                     and e["ts"] < started["ts"]]
        restored = [e for e in journal if e["kind"] == "checkpoint_restored"
                    and e["generation"] == started["generation"]]
        if committed:
            assert restored and restored[0]["step"] == max(committed), (started, restored)

    goodput = account(journal)
    assert [(i.kind, i.host) for i in goodput.incidents] == \
        [(f["fault"], f["host"]) for f in faults], goodput.incidents
    for incident in goodput.incidents:
        assert incident.recovered_after_s is not None, incident
        # a stopped agent whose worker steps on with the others costs no restart
        assert incident.restarted is (incident.kind != "stop-agent"), incident
    failure_stops = [e for e in journal if e["kind"] == "slice_stopping"
                     and e.get("cause") in ("failure", "preemption")]
    assert len(failure_stops) == sum(i.restarted for i in goodput.incidents), failure_stops
    assert 0.0 < goodput.ettr <= 1.0
    # the CLI report says the same
    out = subprocess.run([sys.executable, "-m", "elastic.cli", "report", "--json",
                          "--state-dir", str(job.state_dir)], capture_output=True, text=True,
                         timeout=30, env=job.env)
    report = json.loads(out.stdout)
    assert report["ettr"] == pytest.approx(goodput.ettr, abs=1e-4)
    assert [i["kind"] for i in report["incidents"]] == list(kinds)


def test_network_faults_are_skipped_without_isolated_hosts(tmp_path):
    """Random network faults drawn on hosts in the root namespace (no
    `--isolate`) are journaled as skipped, with the reason."""
    from elastic.chaos import NETWORK_KINDS, Chaos
    from elastic.controller.journal import read_journal

    status, host = pb.JobStatus(generation=2), pb.HostStatus(host_id="host-1")
    chaos = Chaos(None, "127.0.0.1:1", None, tmp_path, lambda h: None, lambda h: 0, 1.0)
    for kind in NETWORK_KINDS:
        chaos.inject(kind, host, status)
    chaos.stop()
    entries = read_journal(tmp_path)
    assert [(e["kind"], e["fault"], e["host"]) for e in entries] == \
        [("fault_skipped", kind, "host-1") for kind in NETWORK_KINDS]
    assert all("not isolated" in e["reason"] for e in entries)


def test_chaos_spec_and_schedule_are_deterministic():
    spec = parse_chaos("mtbf=60,seed=7,kinds=kill-worker+preempt,count=3")
    assert spec.kinds == ("kill-worker", "preempt") and spec.count == 3
    assert schedule(spec, 5) == schedule(spec, 5)
    assert schedule(spec, 5) != schedule(parse_chaos("mtbf=60,seed=8"), 5)
    gaps = [gap for gap, _, _ in schedule(parse_chaos("mtbf=60,seed=1"), 2000)]
    assert 55 < sum(gaps) / len(gaps) < 65  # exponential with mean mtbf
    with pytest.raises(ValueError, match="unknown fault kind"):
        parse_chaos("kinds=explode")


def test_a_killed_host_stays_down_as_long_as_the_spec_says(tmp_path):
    from elastic.chaos import Chaos

    def chaos(spec):
        return Chaos(spec, "127.0.0.1:1", None, tmp_path, lambda h: None, lambda h: 0, 5.0)

    assert chaos(None).host_down_s == 7.0  # a reboot: the heartbeat timeout + 2 s
    assert chaos(parse_chaos("mtbf=60")).host_down_s == 7.0
    repair = parse_chaos("mtbf=60,host-down=600")
    assert repair.host_down_s == 600.0 and chaos(repair).host_down_s == 600.0
    with pytest.raises(ValueError, match="host-down"):
        parse_chaos("host-down=-1")


def test_storage_faults_act_on_the_proxy_and_are_journaled(tmp_path, gcs_emulator):
    """storage-slow and storage-outage set the proxy in front of the bucket,
    are journaled without a host (they hit the whole bucket) and healed when
    due; without a proxy they are skipped, with the reason."""
    from elastic.chaos import STORAGE_FAULT_S, STORAGE_SLOW_LATENCY_S, Chaos
    from elastic.checkpoint.faulty_storage import FaultProxy
    from elastic.controller.journal import read_journal

    status = pb.JobStatus(generation=3)
    host = pb.HostStatus(host_id="host-1")
    with FaultProxy(gcs_emulator.url) as proxy:
        chaos = Chaos(None, "127.0.0.1:1", None, tmp_path, lambda h: None, lambda h: 0, 1.0,
                      storage=proxy)
        chaos.inject("storage-slow", host, status)
        assert proxy.faults.latency_s == STORAGE_SLOW_LATENCY_S
        chaos.inject("storage-outage", host, status)
        assert proxy.faults.outage_until > 0
        chaos.stop()  # runs what is due later: both heal
        assert proxy.faults == type(proxy.faults)()
    no_proxy = Chaos(None, "127.0.0.1:1", None, tmp_path, lambda h: None, lambda h: 0, 1.0)
    no_proxy.inject("storage-outage", host, status)
    no_proxy.stop()
    entries = [(e["kind"], e.get("fault"), e["host"]) for e in read_journal(tmp_path)]
    assert entries == [("fault_injected", "storage-slow", None),
                       ("fault_injected", "storage-outage", None),
                       ("fault_healed", "storage-slow", None),
                       ("fault_healed", "storage-outage", None),
                       ("fault_skipped", "storage-outage", None)], entries
    injected = [e for e in read_journal(tmp_path) if e["kind"] == "fault_injected"]
    assert all(e["duration_s"] == STORAGE_FAULT_S and e["generation"] == 3 for e in injected)


def test_a_planned_storage_fault_needs_the_emulator(tmp_path, proc_env):
    out = subprocess.run([sys.executable, "-m", "elastic.cli", "local", "--config",
                          str(chaos_spec(tmp_path)), "--state-dir", str(tmp_path / "s"),
                          "--fault", "storage-outage:all@step=5"],
                         capture_output=True, text=True, timeout=60, env=proc_env)
    assert out.returncode == 2
    assert out.stderr.strip() == ("elasticd: error: --fault storage-outage needs --gcs-emulator "
                                  "(the fault acts on the emulator's bucket through a proxy)")


def test_a_host_comes_back_even_when_its_old_agent_is_slow_to_be_reaped(tmp_path):
    """preempt: SIGTERM to the agent; once it is gone, the host comes back.
    The launcher may not reap the old process at the first try (its main
    thread shows Z while the kernel still ends the others): restart_agent
    then answers False, and is asked again until it starts the agent."""
    import threading

    from elastic.chaos import Chaos

    agent = subprocess.Popen(["sleep", "60"])
    answers, calls, done = [False, False, True], [], threading.Event()

    def restart(host_id: str) -> bool:
        calls.append(host_id)
        if len(calls) == len(answers):
            done.set()
        return answers[len(calls) - 1]

    chaos = Chaos(None, "127.0.0.1:1", None, tmp_path, restart, lambda h: agent.pid, 1.0,
                  keep_running=True)
    chaos.start()
    try:
        chaos.inject("preempt", pb.HostStatus(host_id="host-1", agent_pid=agent.pid),
                     pb.JobStatus(generation=1))
        assert agent.wait(10) == -signal.SIGTERM
        assert done.wait(15), calls
    finally:
        chaos.stop()
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    assert calls == ["host-1"] * 3


def _one_member_status():
    from types import SimpleNamespace
    return SimpleNamespace(generation=1, hosts=[SimpleNamespace(host_id="host-1",
                                                                state="member")])


def test_random_faults_keep_to_their_timeline_however_long_an_injection_takes(tmp_path):
    """Each fault comes at its own time from the start (on a fake clock);
    an injection that takes long (a kill-during-save waits for a save) does
    not push the later ones back. Before, each gap began when the last
    injection returned: the soak at one fault per 15 s delivered 34 of the
    37 faults its 600 s scheduled."""
    import itertools

    from elastic.chaos import Chaos
    from elastic.clock import FakeClock

    spec = parse_chaos("mtbf=10,seed=3,kinds=kill-worker,count=8")
    clock = FakeClock()
    chaos = Chaos(spec, "127.0.0.1:1", None, tmp_path, lambda h: None, lambda h: 0, 5.0,
                  clock=clock)
    t0, made = clock.monotonic(), []

    def wait(seconds: float) -> bool:
        clock.advance(max(0.0, seconds))
        return True

    def inject(kind, host, status) -> None:
        made.append(clock.monotonic() - t0)
        clock.advance(6.0)  # this injection's own time

    chaos._wait, chaos.inject, chaos._running_status = wait, inject, _one_member_status
    chaos._run_random()
    chaos.stop()
    due = list(itertools.accumulate(gap for gap, _, _ in schedule(spec, 8)))
    expected = []
    for at in due:  # at its time, or as soon as the one before is done
        expected.append(max(at, expected[-1] + 6.0) if expected else at)
    assert made == pytest.approx(expected)
    assert chaos.injected == 8


def test_an_injector_that_fails_keeps_its_error(tmp_path):
    """A fault that raises ends the injector: the error is kept for the
    benchmark to fail on, not lost with the thread (a soak whose injector
    died read as a run with fewer faults)."""
    from elastic.chaos import Chaos

    chaos = Chaos(parse_chaos("mtbf=0.01,seed=1,kinds=kill-worker,count=3"), "127.0.0.1:1",
                  None, tmp_path, lambda h: None, lambda h: 0, 5.0)

    def inject(kind, host, status) -> None:
        raise RuntimeError("the status call failed")

    chaos.inject, chaos._running_status = inject, _one_member_status
    chaos.start()
    chaos.join(30)
    chaos.stop()
    assert not chaos.is_alive()
    assert isinstance(chaos.error, RuntimeError) and chaos.injected == 0
    with pytest.raises(RuntimeError, match="failed after 0 faults .*the status call failed"):
        chaos.check()


def test_faults_scheduled_counts_those_due_within_the_duration():
    import itertools

    from elastic.chaos import faults_scheduled

    spec = parse_chaos("mtbf=60,seed=1")
    due = list(itertools.accumulate(gap for gap, _, _ in schedule(spec, 200)))
    assert faults_scheduled(spec, 600) == sum(at < 600 for at in due) > 0
    assert faults_scheduled(parse_chaos("mtbf=60,seed=1,count=3"), 10_000) == 3
    assert faults_scheduled(spec, 0) == 0


def test_a_kill_during_save_waits_for_its_save_off_the_timeline(tmp_path):
    """A kill-during-save waits for the next save in a thread of its own:
    the faults due meanwhile come at their times (on a fake clock), not all
    at once when its save comes, where one restart took them all."""
    import itertools
    import threading

    from elastic.chaos import Chaos
    from elastic.clock import FakeClock

    spec = parse_chaos("mtbf=10,seed=1,kinds=kill-during-save+kill-worker,count=6")
    planned = schedule(spec, 6)
    kinds = [kind for _, kind, _ in planned]
    assert kinds[0] == "kill-during-save" and kinds.count("kill-worker") == 2
    clock = FakeClock()
    chaos = Chaos(spec, "127.0.0.1:1", None, tmp_path, lambda h: None, lambda h: 0, 5.0,
                  clock=clock)
    t0, made, save = clock.monotonic(), [], threading.Event()

    def wait(seconds: float) -> bool:
        clock.advance(max(0.0, seconds))
        return True

    def inject(kind, host, status) -> None:
        if kind == "kill-during-save":
            assert save.wait(30)  # (the save comes once the timeline is done)
        made.append((kind, clock.monotonic() - t0))

    chaos._wait, chaos.inject, chaos._running_status = wait, inject, _one_member_status
    try:
        chaos._run_random()
        due = list(itertools.accumulate(gap for gap, _, _ in planned))
        # the worker kills came at their times while every kill-during-save waited
        assert made == [("kill-worker", pytest.approx(at))
                        for kind, at in zip(kinds, due) if kind == "kill-worker"]
    finally:
        save.set()
        for thread in threading.enumerate():
            if thread.name == "chaos-kill-during-save":
                thread.join(30)
    chaos.stop()
    assert [kind for kind, _ in made].count("kill-during-save") == 4
    assert chaos.injected == 6 and chaos.error is None


def test_two_kills_during_saves_take_a_save_each(tmp_path):
    """Two kill-during-saves waiting at once (two due within one save
    interval) kill in two saves, not both in the first: one restart would
    take both faults."""
    import queue
    import threading
    import time
    from types import SimpleNamespace

    from elastic.chaos import Chaos
    from elastic.controller.journal import JournalWriter, read_journal

    host = SimpleNamespace(host_id="host-1", state="member", step=99, worker_pid=0, agent_pid=0)
    status = SimpleNamespace(generation=1, hosts=[host])  # (pid 0: kills nobody)
    chaos = Chaos(None, "127.0.0.1:1", None, tmp_path, lambda h: None, lambda h: 0, 5.0)
    chaos._status = lambda: status
    faults: queue.Queue = queue.Queue()  # what the injector journals, as it journals it
    chaos.journal.listeners.append(faults.put)
    for _ in range(2):
        chaos._in_background("kill-during-save",
                             lambda: chaos.inject("kill-during-save", host, status))
    saves = JournalWriter(tmp_path)

    def next_fault() -> dict:
        return faults.get(timeout=30)  # (raises queue.Empty if none comes)

    saves.write(time.time(), "checkpoint_saved", 1, "save", None, {"step": 100})
    first = next_fault()
    # (stamped ahead: the second waits for a save after the first kill)
    saves.write(time.time() + 5.0, "checkpoint_saved", 1, "save", None, {"step": 200})
    second = next_fault()
    for thread in threading.enumerate():
        if thread.name == "chaos-kill-during-save":
            thread.join(30)
    chaos.stop()
    saves.close()
    notes = [e["reason"].rpartition("; ")[2] for e in (first, second)]
    assert notes == ["save of step 100 in flight", "save of step 200 in flight"]
    assert sum(e["kind"] == "fault_injected" for e in read_journal(tmp_path)) == 2
