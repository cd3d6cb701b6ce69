"""Simulated hosts that share nothing, and what a killed runner leaves.

Isolated runs (`elasticd local --isolate`) put every host and
the controller in namespaces of their own (elastic.local.network); the
checkpoints live in the emulator's bucket, reached over the private bridge.
Network faults are injected on their links; the split-brain checks read the
journal and the bucket: no object of a step is written outside the lifetime
of a generation that saved that step (a deposed generation's writer would
write after its generation stopped).
"""

from __future__ import annotations

import ipaddress
import json
import pathlib
import signal
import subprocess
import sys
import threading

import pytest

from elastic.local import network
from tests.conftest import lm_spec, tagged_pids, tiny_spec, wait_until

PROBLEM = network.capability_problem()
needs_namespaces = pytest.mark.skipif(PROBLEM is not None, reason=str(PROBLEM))
ISOLATED = ("--isolate",)  # (the emulator comes with it)


def test_killed_runner_takes_everything_with_it(tmp_path, local_job, proc_env):
    """SIGKILL of `elasticd local` ends the controller, the agents and their
    workers (PR_SET_PDEATHSIG); `--cleanup` then removes the snapshot
    directories the killed agents left in /dev/shm."""
    job = local_job(tiny_spec(tmp_path), hosts=2)
    job.wait_for("first_progress", generation=1)
    agents = job.local_info()["agents"]
    records = [tmp_path / "state" / "agents" / h / "snapshot-dir" for h in agents]
    shm = [pathlib.Path(r.read_text().strip()) for r in records]
    assert all(p.is_dir() for p in shm)
    job.proc.send_signal(signal.SIGKILL)
    job.proc.wait()
    wait_until(lambda: not tagged_pids(proc_env["ELASTIC_TEST_TAG"]), 15.0,
               "every process of the run to die with its runner")
    assert all(p.is_dir() for p in shm)  # killed agents could not remove them
    out = subprocess.run([sys.executable, "-m", "elastic.cli", "local", "--cleanup",
                          "--state-dir", str(tmp_path / "state")], env=proc_env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "snapshot directory of host-0" in out.stdout, out.stdout
    assert not any(p.exists() for p in shm)


def _poll_bucket(url: str, stop: threading.Event, seen: dict) -> None:
    """Record every object of the run's bucket with its creation time. Each
    listing is tried once (the client's default retry would go on for 120 s
    against an emulator gone at the end, and outlive the test)."""
    from elastic.checkpoint.emulator import anonymous_client

    client = anonymous_client(url)
    while not stop.wait(0.3):
        try:
            for blob in client.list_blobs("elastic-local", retry=None, timeout=5):
                seen.setdefault(blob.name, blob.time_created.timestamp())
        except Exception:  # noqa: BLE001 - the emulator goes away at the end
            pass


def assert_no_split_brain(journal: list[dict], objects: dict[str, float]) -> None:
    """Every object of step S was written while a generation that saved S
    was running (from its generation_started to its slice_stopped; any
    generation when none journaled a save of S: a save still in its
    barriers when its slice is stopped has written its directory but never
    reported), every step was committed once, and no report of a deposed
    worker reached the controller."""
    start = {e["generation"]: e["ts"] for e in journal if e["kind"] == "generation_started"}
    stop = {e["generation"]: e["ts"] for e in journal if e["kind"] == "slice_stopped"}
    end = journal[-1]["ts"]
    saved: dict[int, set[int]] = {}
    for e in journal:
        if e["kind"] == "checkpoint_saved":
            saved.setdefault(e["step"], set()).add(e["generation"])
    for name, created in objects.items():
        step_dir = name.split("/")[1].split(".")[0]
        if not step_dir.isdigit():
            continue  # Orbax's metadata beside the steps
        step = int(step_dir)
        windows = [(start[g], stop.get(g, end) + 0.5) for g in saved.get(step) or start]
        assert any(a <= created <= b for a, b in windows), \
            f"{name} written at {created:.2f}, outside generations {saved.get(step)} " \
            f"that saved step {step}: {windows}"
    committed = [e["step"] for e in journal if e["kind"] == "checkpoint_committed"]
    assert len(committed) == len(set(committed)), committed  # one writer per step
    stale = [e for e in journal if e["kind"] == "stale_message_rejected"
             and e.get("message") in ("progress", "worker_event")]
    assert not stale, stale


@needs_namespaces
def test_isolated_hosts_survive_partitions_without_split_brain(tmp_path, local_job):
    """The reference model on 3 isolated hosts x 2 devices: host-2 loses the
    controller (it still reaches its peers), later host-1 is cut off
    wholly, and last host-2 loses its peers. Each of the first two stops
    its own worker (self-fencing) after its lease; the wholly cut host is
    declared lost within the heartbeat timeout, the one that still reaches
    its peers once its fenced worker stalls the slice (it is carried while
    its worker trains: elastic.policy.silence). host-2, back after missing
    a generation, gets the step the slice resumes from a peer. The
    collectives cut from their peers hang until the hang detector restarts
    the slice. The job finishes on the hosts it has, with nothing written
    by a deposed generation."""
    timeout_s = 2.0
    spec = lm_spec(tmp_path / "job.toml", "iso", [
        "--steps", "100", "--checkpoint-every", "10", "--eval-every", "1000"],
        min_hosts=2, max_hosts=3, heartbeat_timeout_s=timeout_s, grow="never",
        controller_lease_s=1.5,  # (30 s by default: see test_controller_failover)
        hang_min_timeout_s=5.0)  # (10 s by default: the peers' partition hangs the slice)
    job = local_job(spec, hosts=3, devices=2, name="iso", extra_args=ISOLATED,
                    faults=("partition-controller:host-2@step=10", "partition:host-1@step=40",
                            "partition-peers:host-2@step=75"))
    info = job.local_info()
    seen: dict[str, float] = {}
    stop = threading.Event()
    poller = threading.Thread(target=_poll_bucket, args=(
        info["extra_env"]["STORAGE_EMULATOR_HOST"], stop, seen), daemon=True)
    poller.start()
    try:
        assert job.wait(300) == 0, job.output()
    finally:
        stop.set()
        poller.join(5)
    journal = job.journal()
    # each host at its own address on the run's network
    addresses = {e["host"]: e["reason"].split(" at ")[1].split(",")[0]
                 for e in journal if e["kind"] == "host_registered"}
    assert len(set(addresses.values())) == 3 and all(
        a.startswith("10.213.") for a in addresses.values()), addresses
    faults = [e for e in journal if e["kind"] == "fault_injected"]
    assert [(f["host"], f["fault"]) for f in faults] == [
        ("host-2", "partition-controller"), ("host-1", "partition"),
        ("host-2", "partition-peers")]
    for fault, bound_s in zip(faults, (2 * timeout_s + 1.5, timeout_s + 1.5)):
        lost = next(e for e in journal if e["kind"] in ("host_lost", "slice_stopping")
                    and e["ts"] > fault["ts"] and (e.get("host") == fault["host"]
                                                   or fault["host"] in e["reason"]))
        assert lost["ts"] - fault["ts"] <= bound_s, (fault, lost)
    started = [e for e in journal if e["kind"] == "generation_started"]
    assert started[1]["hosts"] == ["host-0", "host-1"], started
    assert "host-1" not in started[2]["hosts"] and "host-2" in started[2]["hosts"], started
    # host-2 missed generation 2: it got the step from host-0 over the network
    restored = [e for e in journal if e["kind"] == "checkpoint_restored"]
    third = next(e for e in restored if e["generation"] == 3)
    assert third.get("source") == "snapshot" and third.get("sent_by") == [0], restored
    # the peers' partition hung the collectives (until the hang detector
    # restarted the slice, or the links came back first); the controller
    # still heard host-2 all along: no host lost
    assert not [e for e in journal if e["kind"] == "host_lost" and e["ts"] > faults[2]["ts"]]
    # the partitioned hosts stopped their own workers
    for host in ("host-2", "host-1"):
        log = (tmp_path / "iso" / "hosts" / f"{host}.log").read_text()
        assert "self-fencing: heard nothing from the controller" in log, log[-2000:]
    fenced = [e for e in journal if e["kind"] == "host_fenced"]
    assert "host-2" in {e["host"] for e in fenced}, fenced  # back within the run
    assert_no_split_brain(journal, seen)
    assert any("/commit_success.txt" in n for n in seen), sorted(seen)[:20]
    # hosts that share no disk share compiled executables through the bucket
    assert any(n.startswith("compile-cache/train_step-") and n.endswith(".xla")
               for n in seen), sorted(seen)[:20]
    steps = [e for e in journal if e["kind"] == "checkpoint_committed"]
    assert steps and max(e["step"] for e in steps) >= 90
    # the network and the namespaces are gone with the run
    assert not (tmp_path / "iso" / "leftovers.json").exists()
    tags = [n for n in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                      text=True).stdout.split() if n.startswith("elastic-")]
    assert not tags, tags


@needs_namespaces
def test_a_throttled_link_is_no_host_loss(tmp_path, local_job):
    """The minimal job on 2 isolated hosts (asked for in the spec's [local]
    table) with host-1's link at 1 Mbit/s from step 20: one generation, no
    host lost."""
    spec = tmp_path / "job.toml"
    spec.write_text((pathlib.Path(__file__).parent.parent / "workers" / "minimal" /
                     "job.toml").read_text().replace(
        'command = ["python", "train.py"]',
        f'command = ["python", "train.py"]\nworkdir = "{pathlib.Path(__file__).parent.parent}'
        f'/workers/minimal"') + "\n[local]\nisolate = true\n")
    job = local_job(spec, hosts=2, devices=2, name="slow",
                    faults=("slow-link:host-1@step=20",))
    assert job.wait(120) == 0, job.output()
    journal = job.journal()
    assert [e["fault"] for e in journal if e["kind"] == "fault_injected"] == ["slow-link"]
    assert not [e for e in journal if e["kind"] in ("host_lost", "slice_stopping")]
    assert len([e for e in journal if e["kind"] == "generation_started"]) == 1


def test_network_faults_need_isolated_hosts(tmp_path, proc_env):
    out = subprocess.run([sys.executable, "-m", "elastic.cli", "local", "--config",
                          str(tiny_spec(tmp_path)), "--state-dir", str(tmp_path / "s"),
                          "--fault", "partition:host-1@t=1"], env=proc_env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "needs --isolate" in out.stderr, out.stderr
    out = subprocess.run([sys.executable, "-m", "elastic.cli", "local", "--config",
                          str(tiny_spec(tmp_path)), "--state-dir", str(tmp_path / "s"),
                          "--isolate", "--gce-metadata", "http://127.0.0.1:1"], env=proc_env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert ("does not take --gce-metadata" in out.stderr) if PROBLEM is None \
        else (PROBLEM in out.stderr)


def test_network_plan_addresses_and_names():
    plan = network.new_plan(["host-0", "host-1"], [])
    assert plan.prefix == "10.213.0" and plan.gateway == "10.213.0.1"
    assert plan.address(network.CONTROLLER) == "10.213.0.2"
    assert plan.address("host-1") == "10.213.0.4"
    assert all(len(plan.root_link(n)) <= 15 for n in plan.nodes)
    assert plan.namespace("host-0") == f"elastic-{plan.tag}-host-0"
    taken = [ipaddress.ip_network("10.213.0.0/16")]
    with pytest.raises(network.IsolationError, match="no free"):
        network.choose_prefix(taken)
    assert network.choose_prefix([ipaddress.ip_network("10.213.0.0/24")]) == "10.213.1"
    with pytest.raises(ValueError, match="cannot name"):
        network.new_plan(["Host 0"], [])
    assert "10.213.0.4 host-1\n" in network.hosts_file(plan, "host-0")
    assert network.NetworkPlan.from_json(json.loads(json.dumps(plan.to_json()))) == plan
    argv = network.wrap(plan, "host-0", ["true"], pathlib.Path("/x"))
    assert argv[:4] == ["ip", "netns", "exec", plan.namespace("host-0")]
    assert argv[-1].endswith("exec true") and "hostname host-0" in argv[-1]


@needs_namespaces
def test_a_leader_cut_off_from_everything_is_replaced_by_its_standby(tmp_path, local_job):
    """Isolated hosts with a leader and a standby controller, each on a node
    of its own, sharing nothing but the bucket. The leader's link goes down
    (cut off from the agents and the bucket): it cannot renew its lease and
    steps down; the standby takes the lease, adopts the slice and leads it
    to the end. No new generation, no step lost."""
    # (10 s of steps: the standby adopts the slice ~4 s into them)
    spec = tiny_spec(tmp_path, "--steps 250 --step-time-s 0.04 --checkpoint-every 100000",
                     min_hosts=2, max_hosts=2, extra="leader_lease_s = 3.0")
    job = local_job(spec, hosts=2, extra_args=(*ISOLATED, "--standby"))
    job.wait_for("first_progress", generation=1, timeout_s=60)
    plan = network.NetworkPlan.from_json(
        json.loads((job.state_dir / "leftovers.json").read_text())["network"])
    network.set_link(plan, network.CONTROLLER, False)
    try:
        adopted = job.wait_for("slice_adopted", timeout_s=40)
    finally:
        network.set_link(plan, network.CONTROLLER, True)
    assert job.wait(60) == 0, job.output()
    journal = job.journal()  # the standby's, continuing the leader's
    kinds = [e["kind"] for e in journal]
    terms = [e["term"] for e in journal if e["kind"] == "controller_started"]
    assert len(terms) == 2 and 0 < terms[0] < terms[1], terms
    assert adopted["generation"] == 1 and kinds.count("generation_started") == 1
    assert "slice_stopping" not in kinds and kinds[-2:] == ["job_succeeded", "controller_stopped"]
    log = (job.state_dir / "controller.log").read_text()
    assert "stepping down: could not renew the lease" in log, log[-3000:]
