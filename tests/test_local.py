"""`elasticd local` end to end: real processes, real gRPC, real signals.

Each test checks that nothing it started is left (process group and the
test tag in every descendant's environment, see conftest)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from elastic.procs import signal_group
from tests.conftest import signal_process, tiny_spec, wait_until


def test_all_workers_exit_zero_job_succeeds(tmp_path, local_job):
    job = local_job(tiny_spec(tmp_path, "--steps 30 --step-time-s 0.01", max_hosts=3), hosts=3)
    assert job.wait(60) == 0, job.output()
    kinds = [e["kind"] for e in job.journal()]
    assert kinds.count("host_registered") == 3
    assert kinds.count("generation_started") == 1
    assert "first_progress" in kinds and kinds[-2:] == ["job_succeeded", "controller_stopped"]
    exits = [e for e in job.journal() if e["kind"] == "worker_exited"]
    assert len(exits) == 3 and all(e["exit_code"] == 0 for e in exits)


def test_sigkill_worker_restarts_whole_slice(tmp_path, local_job):
    job = local_job(tiny_spec(tmp_path))
    job.wait_for("first_progress", generation=1)
    others = job.worker_pids()
    victim = job.host("host-2")
    assert victim["state"] == "member"
    signal_process(victim["workerPid"], signal.SIGKILL)
    stopping = job.wait_for("slice_stopping", generation=1)
    assert stopping["host"] == "host-2" and "SIGKILL" in stopping["reason"]
    started = job.wait_for("generation_started", generation=2)
    assert sorted(started["hosts"]) == ["host-0", "host-1", "host-2", "host-3"]
    job.wait_for("first_progress", generation=2)
    # every worker of generation 1 was stopped: no old pid survives
    for pid in others.values():
        wait_until(lambda: not os.path.exists(f"/proc/{pid}") or
                   open(f"/proc/{pid}/stat").read().split()[2] == "Z", 10, f"pid {pid} gone")
    # the new generation resumed after the last committed step
    committed = [e["step"] for e in job.journal() if e["kind"] == "checkpoint_committed"]
    assert committed, "tiny worker commits every 10 steps"


def test_lost_host_then_rejoin(tmp_path, local_job, proc_env):
    spec = tiny_spec(tmp_path, extra="", job_extra="")
    text = spec.read_text().replace("[health]", '[restart]\ngrow = "immediately"\n\n[health]')
    spec.write_text(text)
    job = local_job(spec)
    job.wait_for("first_progress", generation=1)
    victim = job.running_host("host-1")
    killed_at = time.time()
    signal_process(victim["agentPid"], signal.SIGKILL)
    # the worker dies with its agent (PR_SET_PDEATHSIG); its group may be gone already
    signal_group(victim["workerPid"], signal.SIGKILL)
    lost = job.wait_for("host_lost", host="host-1")
    # heartbeat_timeout_s + 1 s, judged against the controller's lag (elastic.controller.lag)
    assert lost["ts"] - killed_at <= 1.5 + lost.get("controller_lag_s", 0.0) + 1.0, lost
    started = job.wait_for("generation_started", generation=2)
    assert sorted(started["hosts"]) == ["host-0", "host-2", "host-3"]
    job.wait_for("first_progress", generation=2)

    # the host comes back: a new agent process (new incarnation) joins at the next generation
    argv = job.local_info()["agents"]["host-1"]["argv"]
    registered = [e for e in job.journal() if e["kind"] == "host_registered"]  # (before it starts)
    log = open(tmp_path / "host-1-again.log", "wb")
    job.extra_procs.append(subprocess.Popen(argv, env=proc_env, stdout=log,
                                            stderr=subprocess.STDOUT))
    log.close()
    again = job.wait_for("generation_started", generation=3)
    assert sorted(again["hosts"]) == ["host-0", "host-1", "host-2", "host-3"]
    assert len([e for e in job.journal() if e["kind"] == "host_registered"]) == len(registered) + 1
    job.wait_for("first_progress", generation=3)
    # it pre-started a process when it registered: its first worker started warm
    # (the first step of generation 3 may come from another host: wait for the line)
    log_path = tmp_path / "host-1-again.log"
    wait_until(lambda: "worker of generation 3 started" in log_path.read_text(), 10,
               "host-1's agent to start its worker")
    log_text = log_path.read_text()
    assert "pre-started pid" in log_text, log_text
    assert "worker of generation 3 started in its pre-started process" in log_text, log_text

    # elasticd logs reads a host's output from its agent (back, on the same
    # disk): what its worker of generation 1 wrote before the kill, its new
    # worker's, and the new agent's own log, each line prefixed
    def logs(*args: str) -> list[str]:
        out = subprocess.run([sys.executable, "-m", "elastic.cli", "logs", "--state-dir",
                              str(job.state_dir), "--host", "host-1", *args], env=proc_env,
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        return out.stdout.splitlines()

    first_hosts = next(e for e in job.journal() if e["kind"] == "generation_started")["hosts"]
    rank = first_hosts.index("host-1")
    everything = logs()
    assert any(line.startswith(f"host-1 g1 r{rank} | tiny worker: process {rank}/4 "
                               f"generation 1") for line in everything), everything
    assert any(line.startswith("host-1 g3 r") for line in everything), everything
    assert any(line.startswith("host-1 agent | ") and "registered with" in line
               for line in everything), everything
    first = logs("--generation", "1", "--no-agent", "--tail-bytes", "200")
    assert first and all(line.startswith(f"host-1 g1 r{rank} | ") for line in first), first
    assert sum(len(line) - len(f"host-1 g1 r{rank} | ") + 1 for line in first) <= 200


def test_crash_loop_fails_job_with_reason(tmp_path, local_job):
    # (min_hosts = 2: no host can be set aside, which would start the count again)
    job = local_job(tiny_spec(tmp_path, "--crash-on-start", min_hosts=2, max_hosts=2), hosts=2)
    assert job.wait(60) == 1, job.output()
    failed = job.outcome()
    assert failed["kind"] == "job_failed"
    assert "crash loop: 3 failures in a row" in failed["reason"]
    assert "exit code 1" in failed["reason"]
    assert [e["generation"] for e in job.journal() if e["kind"] == "generation_started"] == [1, 2, 3]
    exits = [e for e in job.journal() if e["kind"] == "worker_exited" and e["exit_code"] == 1]
    assert "crashing on purpose" in exits[0]["stderr_tail"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_everything(tmp_path, local_job, sig):
    job = local_job(tiny_spec(tmp_path), hosts=2)
    job.wait_for("first_progress", generation=1)
    workers = job.worker_pids().values()
    job.proc.send_signal(sig)
    assert job.wait(30) == 128 + sig
    for pid in workers:
        assert not os.path.exists(f"/proc/{pid}") or \
            open(f"/proc/{pid}/stat").read().split()[2] == "Z"


def test_status_table(tmp_path, local_job, proc_env):
    job = local_job(tiny_spec(tmp_path), hosts=2)
    job.wait_for("first_progress", generation=1)
    out = subprocess.run(["python", "-m", "elastic.cli", "status", "--state-dir",
                          str(job.state_dir)], env=proc_env, capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0, out.stderr
    assert "job test: running, generation 1" in out.stdout
    for column in ("HOST", "STATE", "DEVICES", "AGENT PID", "WORKER PID", "HEARTBEAT AGE", "STEP"):
        assert column in out.stdout
    assert out.stdout.count(" member ") == 2
