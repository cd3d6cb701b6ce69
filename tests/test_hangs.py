"""Hangs, stopped agents, stubborn workers and crashing hosts, with real
processes and real signals (tiny worker, no JAX)."""

from __future__ import annotations

import signal
import time

from tests.conftest import alive, signal_process, tiny_spec, wait_until

HANG = "[hang]\nmin_timeout_s = 3.0\n"


def with_sections(spec, text: str):
    spec.write_text(spec.read_text() + "\n" + text)
    return spec


def test_sigstop_worker_is_a_hang(tmp_path, local_job):
    job = local_job(with_sections(tiny_spec(tmp_path), HANG))
    job.wait_for("first_progress", generation=1)
    # (the first step may be reported before host-2's heartbeat names its
    # worker: a pid of 0 would SIGSTOP this test's own process group)
    victim = wait_until(lambda: (h := job.host("host-2")).get("workerPid") and h, 10,
                        "host-2 to report its worker's pid")
    stopped_at = time.time()
    signal_process(victim["workerPid"], signal.SIGSTOP)
    hang = job.wait_for("hang_detected", generation=1, timeout_s=30)
    assert hang["host"] == "host-2" and hang["suspects"][0] == "host-2"
    assert "suspended" in hang["reason"]
    # within the hang timeout (3 s) + 2 s; step reports arrive with heartbeats (0.25 s)
    assert hang["ts"] - stopped_at <= hang["timeout_s"] + 2.0, hang
    # its agent dumped its stacks (py-spy) before the kill: rank and frame named
    stacks = job.wait_for("worker_stacks", host="host-2", timeout_s=10)
    assert stacks["rank"] == victim["rank"] and stacks["pid"] == victim["workerPid"]
    # (where SIGSTOP lands: the worker's loop, or elastic's reporter it called)
    assert "workers/tiny/worker.py:" in stacks["frame"].rsplit(", called from ", 1)[-1], stacks
    assert stacks["frame"] in stacks["reason"], stacks
    assert stacks["stacks"].startswith("Thread ") and '"MainThread"' in stacks["stacks"]
    job.wait_for("generation_started", generation=2)
    job.wait_for("first_progress", generation=2)
    # SIGKILL reached the stopped process
    wait_until(lambda: not alive(victim["workerPid"]), 10, "the stopped worker to be killed")


def _started_after(job, generation: int, timeout_s: float = 30.0) -> dict:
    """The first generation_started of a generation above `generation`."""
    return wait_until(lambda: next((e for e in job.journal() if e["kind"] == "generation_started"
                                    and e["generation"] > generation), None),
                      timeout_s, f"a generation after {generation}")


def test_sigstop_agent_is_lost_then_rejoins(tmp_path, local_job):
    # (the tiny worker's processes do not step in lockstep, so its peers'
    # steps prove nothing about it: the heartbeat timeout alone decides)
    spec = with_sections(tiny_spec(tmp_path, extra="carry_silent_hosts = false"),
                         '[restart]\ngrow = "immediately"\n')
    job = local_job(spec)
    # the slice on all 4 hosts (on a loaded machine a host may register after
    # the others' settle time and join only at a grow, in generation 2)
    full = wait_until(lambda: next((e for e in job.journal() if e["kind"] == "generation_started"
                                    and len(e["hosts"]) == 4), None), 60, "a slice of 4 hosts")
    job.wait_for("first_progress", generation=full["generation"])
    # (the first step may be reported before host-1's heartbeat names its worker:
    # its pid of 0 then failed the check of the worker below, in a fresh clone's run)
    victim = wait_until(lambda: (h := job.host("host-1")).get("workerPid") and h, 10,
                        "host-1 to report its worker's pid")
    signal_process(victim["agentPid"], signal.SIGSTOP)
    try:
        job.wait_for("host_lost", host="host-1")
        started = _started_after(job, full["generation"])
        assert sorted(started["hosts"]) == ["host-0", "host-2", "host-3"]
        job.wait_for("first_progress", generation=started["generation"])
        assert alive(victim["workerPid"])  # its worker went on while the agent was stopped
    finally:
        signal_process(victim["agentPid"], signal.SIGCONT)
    # the old worker is stopped before the host rejoins
    wait_until(lambda: not alive(victim["workerPid"]), 15, "the stale worker to be stopped")
    rejoined = _started_after(job, started["generation"])
    assert sorted(rejoined["hosts"]) == ["host-0", "host-1", "host-2", "host-3"]
    # its reports about its old generation were refused (fencing), and it rejoined only after
    refused = [e for e in job.journal() if e["kind"] == "stale_message_rejected"
               and e["host"] == "host-1"]
    assert refused and refused[0]["stale_generation"] == full["generation"]
    assert refused[0]["ts"] < rejoined["ts"]


def test_worker_ignoring_sigterm_is_killed_after_grace(tmp_path, local_job):
    job = local_job(tiny_spec(tmp_path, "--steps 100000 --step-time-s 0.02 --ignore-sigterm "
                                        "--spawn-child", max_hosts=2), hosts=2)
    job.wait_for("first_progress", generation=1)
    workers = job.worker_pids().values()
    t0 = time.monotonic()
    job.proc.send_signal(signal.SIGTERM)
    assert job.wait(30) == 128 + signal.SIGTERM
    # agents give workers 5 s (--stop-grace-s) after SIGTERM, then SIGKILL the group
    assert time.monotonic() - t0 < 5.0 + 5.0
    for pid in workers:
        assert not alive(pid)
    # the grandchildren (sleep 1000) are checked by the proc_env guard


def test_host_that_keeps_crashing_is_quarantined(tmp_path, local_job):
    spec = with_sections(
        tiny_spec(tmp_path, "--steps 400 --step-time-s 0.02 --crash-on-host host-2 "
                            "--crash-after-steps 5"),
        '[quarantine]\nfailures = 2\nwindow_s = 600\ncooldown_s = 600\n')
    job = local_job(spec)
    quarantined = job.wait_for("host_quarantined", timeout_s=60)
    assert quarantined["host"] == "host-2"
    started = job.wait_for("generation_started", generation=3)
    # the others go on without it (under load a host whose start of generation 2
    # was still in flight when that generation failed may join only at a grow)
    assert "host-2" not in started["hosts"] and "host-0" in started["hosts"]
    host = job.host("host-2")
    assert host["state"] == "quarantined" and "2 failures" in host["note"]
    assert job.wait(60) == 0, job.output()
    assert job.outcome()["kind"] == "job_succeeded"
