"""Agent guarantees: workers never outlive their agent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from elastic import worker_env
from elastic.agent.supervisor import kill_leftovers
from tests.conftest import LocalJob, alive, reaped, signal_process, stop, tiny_spec, wait_until


def test_restarted_agent_kills_leftovers_of_previous_incarnation(tmp_path, proc_env):
    owner = str(tmp_path / "agent-state")
    env = dict(proc_env, **{worker_env.ENV_WORKER_OWNER: owner})
    # a process that escaped its group (own session), as a worker's child might
    old = subprocess.Popen(["sleep", "60"], env=dict(env, **{worker_env.ENV_INCARNATION: "old"}),
                           start_new_session=True)
    mine = subprocess.Popen(["sleep", "60"], env=dict(env, **{worker_env.ENV_INCARNATION: "new"}))
    other = subprocess.Popen(["sleep", "60"], env=dict(proc_env, **{
        worker_env.ENV_WORKER_OWNER: owner + "-other", worker_env.ENV_INCARNATION: "old"}))
    try:
        killed = kill_leftovers(owner, "new")
        assert killed == [old.pid]
        assert old.wait(5) == -signal.SIGKILL
        assert mine.poll() is None and other.poll() is None
    finally:
        for p in (old, mine, other):
            p.kill()
            p.wait()


def test_worker_dies_with_its_agent(tmp_path, local_job):
    job: LocalJob = local_job(tiny_spec(tmp_path, max_hosts=2), hosts=2)
    job.wait_for("first_progress", generation=1)
    host = job.running_host("host-1")
    # a process group of its own (the agent signals it whole), in the agent's
    # session: a session each puts lockstep workers in separate autogroups
    assert os.getpgid(host["workerPid"]) == host["workerPid"]
    assert os.getsid(host["workerPid"]) == os.getsid(host["agentPid"])
    signal_process(host["agentPid"], signal.SIGKILL)  # only the agent
    wait_until(lambda: not alive(host["workerPid"]), 10, "the worker to die with its agent")


def test_agent_rejects_bad_devices(proc_env):
    out = subprocess.run([sys.executable, "-m", "elastic.agent.main", "--controller", "x:1",
                          "--host-id", "h", "--devices", "0"], env=proc_env,
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "--devices must be from 1 to 65536, got 0" in out.stderr


def test_agent_ignores_sighup(tmp_path, proc_env):
    import socket
    with socket.socket() as s:  # a port nobody listens on: the agent keeps retrying
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "agent.log"
    with open(log, "wb") as out, reaped(subprocess.Popen(
            [sys.executable, "-m", "elastic.agent.main", "--controller", f"127.0.0.1:{port}",
             "--host-id", "h0", "--state-dir", str(tmp_path / "agent"), "--insecure",
             "--allow-any-worker"], env=proc_env, stdout=out, stderr=subprocess.STDOUT)) as agent:
        wait_until(lambda: "retrying" in log.read_text(), 30, "the agent to dial")
        agent.send_signal(signal.SIGHUP)
        wait_until(lambda: "SIGHUP ignored" in log.read_text(), 10, "the agent to note SIGHUP")
        assert agent.poll() is None
        assert stop(agent, signal.SIGINT) == 0
    assert "INSECURE" in log.read_text()


def test_devices_are_counted_from_device_nodes(tmp_path):
    from elastic import simdevices
    from elastic.agent.host import Devices, discover_devices

    dev, proc = tmp_path / "dev", tmp_path / "proc"
    dev.mkdir()
    assert discover_devices(str(dev), str(proc)) == Devices(1, "cpu")
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"):
        (dev / name).touch()
    assert discover_devices(str(dev), str(proc)) == Devices(2, "gpu")  # no driver info
    info = proc / "driver/nvidia/gpus/0000:04:00.0/information"
    info.parent.mkdir(parents=True)
    info.write_text("Model: \t\t NVIDIA H100 80GB HBM3\nIRQ: 42\n")
    assert discover_devices(str(dev), str(proc)) == Devices(2, "NVIDIA H100 80GB HBM3")
    # TPU nodes come first; a simulated host's nodes are TPU-style
    simdevices.set_devices(dev, 4)
    assert discover_devices(str(dev), str(proc)) == Devices(4, "tpu")
    assert simdevices.remove_device(dev) == "accel3"
    assert discover_devices(str(dev), str(proc)).count == 3
    simdevices.restore_device(dev, "accel3")
    simdevices.set_devices(dev, 1)
    assert discover_devices(str(dev), str(proc)).count == 1
    assert simdevices.remove_device(dev) is None  # a host keeps one
