"""A silent agent on real lockstep JAX training: carried while its worker
steps with the others, lost within the heartbeat timeout once they stall.

workers/lm on 3 hosts x 2 CPU devices (mesh data=3, model=2: every step
all-reduces gradients across the hosts, so no process can get more than one
step ahead of another)."""

from __future__ import annotations

import signal

from tests.conftest import lm_spec, signal_process, wait_until

HEARTBEAT_TIMEOUT_S = 2.0


def spec(tmp_path):
    return lm_spec(tmp_path / "job.toml", "silent-agent",
                   ["--steps", "100000", "--checkpoint-every", "50", "--eval-every", "100000"],
                   min_hosts=2, max_hosts=3, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
                   job_extra=f'checkpoint_dir = "{tmp_path / "ckpt"}"', grow="never")


def slice_step(job) -> int:
    return min(int(h["step"]) for h in job.status()["hosts"] if h["state"] == "member")


def test_a_silent_agent_is_carried_and_a_frozen_host_is_lost(tmp_path, local_job):
    job = local_job(spec(tmp_path), hosts=3, devices=2)
    job.wait_for("first_progress", generation=1, timeout_s=120)

    # 1. host-1's agent stops; its worker trains on with the others
    quiet = job.host("host-1")
    signal_process(quiet["agentPid"], signal.SIGSTOP)
    try:
        silent = job.wait_for("agent_silent", host="host-1")
        assert silent["lead_steps"] >= 3 and silent["silent_s"] >= HEARTBEAT_TIMEOUT_S
        assert job.host("host-1")["state"] == "silent"
        step = slice_step(job)
        wait_until(lambda: slice_step(job) >= step + 20, 60, "20 more steps")
    finally:
        signal_process(quiet["agentPid"], signal.SIGCONT)
    job.wait_for("agent_heard", host="host-1")
    journal = job.journal()
    assert not [e for e in journal if e["kind"] in ("host_lost", "hang_detected",
                                                    "slice_stopping")], journal
    assert job.host("host-1")["workerPid"] == quiet["workerPid"]  # the same process

    # 2. host-2 freezes, agent and worker: the others wait in the all-reduce,
    # so nothing carries it; lost at the heartbeat timeout, not a 10 s hang
    frozen = job.host("host-2")
    for pid in (frozen["workerPid"], frozen["agentPid"]):
        signal_process(pid, signal.SIGSTOP)
    try:
        lost = job.wait_for("host_lost", host="host-2")
        # (judged against the controller's lag too: elastic.controller.lag)
        assert HEARTBEAT_TIMEOUT_S <= lost["silent_s"] < \
            HEARTBEAT_TIMEOUT_S + lost["controller_lag_s"] + 1.0, lost
        started = job.wait_for("generation_started", generation=2, timeout_s=60)
        assert sorted(started["hosts"]) == ["host-0", "host-1"]
        job.wait_for("first_progress", generation=2, timeout_s=120)
    finally:
        for pid in (frozen["agentPid"], frozen["workerPid"]):
            signal_process(pid, signal.SIGCONT)
    assert not [e for e in job.journal() if e["kind"] == "agent_silent"
                and e["host"] == "host-2"]
