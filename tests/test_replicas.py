"""Buddy replication of local snapshots: who sends to whom (a table), and
the agents' PutReplica over real mutual TLS on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import random

import grpc
import numpy as np
import pytest

from elastic import transport
from elastic.agent.replicas import ReplicaSender, ReplicaStore
from elastic.agent.service import AgentService
from elastic.checkpoint.snapshot import replica_name
from elastic.policy.buddies import buddies, keep_replicas_within
from elastic.v1 import control_pb2 as pb
from elastic.v1 import control_pb2_grpc as pb_grpc
from tests.conftest import assert_matches_reference, lm_run_spec, lm_samples, until

YES = {h: True for h in ("a", "b", "c", "d")}


@pytest.mark.parametrize("hosts, domains, can_receive, expected", [
    (("a", "b", "c"), {"a": "a", "b": "b", "c": "c"}, YES,       # a domain each: a ring
     {"a": "b", "b": "c", "c": "a"}),
    (("a", "b", "c", "d"), {"a": "x", "b": "x", "c": "y", "d": "y"}, YES,  # two 2-host slices:
     {"a": "c", "b": "c", "c": "a", "d": "a"}),                  # always the other slice
    (("a", "b"), {"a": "x", "b": "x"}, YES, {"a": "b", "b": "a"}),  # one domain: still a peer
    (("a", "b", "c"), {"a": "a", "b": "b", "c": "c"}, {"a": True, "c": True},  # b serves no port
     {"a": "c", "b": "c", "c": "a"}),
    (("a",), {"a": "a"}, YES, {}),                               # a slice of one: none
    (("a", "b"), {"a": "a", "b": "b"}, {"a": True}, {"b": "a"}),
])
def test_buddies(hosts, domains, can_receive, expected):
    assert buddies(hosts, domains, can_receive) == expected


def scan_of_successors(hosts, domains, can_receive) -> dict[str, str]:
    """The rule of elastic.policy.buddies, written as its plain O(hosts^2) scan."""
    out = {}
    for i, host in enumerate(hosts):
        after = [hosts[(i + k) % len(hosts)] for k in range(1, len(hosts))]
        receivers = [h for h in after if can_receive.get(h, False)]
        elsewhere = [h for h in receivers if domains.get(h) != domains.get(host)]
        if receivers:
            out[host] = (elsewhere or receivers)[0]
    return out


def test_buddies_follow_the_plain_scan_on_random_slices():
    rng = random.Random(7)
    for _ in range(500):
        hosts = [f"h{i}" for i in range(rng.randint(1, 12))]
        domains = {h: f"d{rng.randrange(rng.randint(1, 4))}" for h in hosts}
        can_receive = {h: rng.random() < 0.7 for h in hosts}
        assert buddies(hosts, domains, can_receive) == \
            scan_of_successors(hosts, domains, can_receive), (hosts, domains, can_receive)


def snapshot_file(directory: pathlib.Path, step: int, size: int = 3_000_000) -> bytes:
    data = bytes([step % 251]) * size
    (directory / f"step-{step:010d}.snap").write_bytes(data)
    return data


@contextlib.asynccontextmanager
async def h0_sending_to_h1(tmp_path, pki, generation, senders):
    """h1's agent service over mutual TLS on loopback, keeping replicas in
    tmp_path/h1 for controller run "run-1" (`generation()` and `senders()`:
    what its worker's start said), and h0's sender of tmp_path/h0's
    snapshots: yields (mine, theirs, store, port, sender); both stopped on
    exit."""
    mine, theirs = tmp_path / "h0", tmp_path / "h1"
    mine.mkdir(mode=0o700)
    theirs.mkdir(mode=0o700)
    store = ReplicaStore(theirs, lambda: "run-1", generation, senders)
    service = AgentService("127.0.0.1:0", pki.host("h1"), str(tmp_path / "state"),
                           replicas=lambda: store)
    port = await service.start()
    sender = ReplicaSender(mine, pki.host("h0"))
    try:
        yield mine, theirs, store, port, sender
    finally:
        await sender.close()
        await service.stop()


def test_a_host_keeps_its_buddys_snapshots_under_the_buddys_certificate_name(tmp_path, pki):
    async def main():
        now = {"generation": 2, "senders": frozenset({"h0"})}  # what h1's start said
        async with h0_sending_to_h1(tmp_path, pki, lambda: now["generation"],
                                    lambda: now["senders"]) as (mine, theirs, store, port,
                                                                sender):
            sender.target("h1", f"127.0.0.1:{port}", "run-1", 2)
            sent = {step: snapshot_file(mine, step) for step in (10, 20, 30)}
            sender.offer(10, 2)
            await until(lambda: sender.sent == 1)
            assert (theirs / replica_name("h0", 10)).read_bytes() == sent[10]
            sender.offer(20, 2)
            sender.offer(30, 2)  # 20 may be replaced by 30 while 10... is done: newest wins
            await until(lambda: sender.last_sent_step == 30)
            names = sorted(p.name for p in theirs.iterdir())
            assert names[-1] == replica_name("h0", 30) and len(names) <= store.keep, names
            assert (theirs / replica_name("h0", 30)).read_bytes() == sent[30]
            assert (theirs / replica_name("h0", 30)).stat().st_mode & 0o077 == 0
            assert sender.failed == 0

            # a replica of another controller run, or of another generation than
            # the receiver's worker's (a send that outlived it), is refused
            snapshot_file(mine, 40)
            for run, generation in (("run-0", 2), ("run-1", 1)):
                sender.target("h1", f"127.0.0.1:{port}", run, generation)
                sender.offer(40, generation)
                await until(lambda: sender.failures_total == (1 if run == "run-0" else 2))
                assert not (theirs / replica_name("h0", 40)).exists()

            # the receiver must be the buddy by its certificate: an agent serving
            # with h2's certificate where the controller said h1 gets nothing
            impostor = AgentService("127.0.0.1:0", pki.host("h2"), str(tmp_path / "h2-state"),
                                    replicas=lambda: store)
            impostor_port = await impostor.start()
            try:
                failed = sender.failures_total
                sender.target("h1", f"127.0.0.1:{impostor_port}", "run-1", 2)
                sender.offer(40, 2)
                await until(lambda: sender.failures_total == failed + 1)
                assert not (theirs / replica_name("h0", 40)).exists()
                # ... also when the buddy becomes h3 at the address h1 had: the
                # channel that checked h1's name is not used for h3
                sent = sender.sent
                sender.target("h1", f"127.0.0.1:{port}", "run-1", 2)
                sender.offer(40, 2)
                await until(lambda: sender.sent == sent + 1)
                (theirs / replica_name("h0", 40)).unlink()
                sender.target("h3", f"127.0.0.1:{port}", "run-1", 2)
                sender.offer(40, 2)
                await until(lambda: sender.failures_total == failed + 2)
                assert not (theirs / replica_name("h0", 40)).exists()
            finally:
                await impostor.stop()

            # only hosts send replicas; a short stream is not kept
            async with transport.aio_agent_channel(f"127.0.0.1:{port}", pki.operator) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as denied:
                    await pb_grpc.AgentStub(ch).PutReplica(
                        iter([pb.ReplicaChunk(run_id="run-1", generation=2, step=50, size=3,
                                               data=b"abc")]))
                assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED

            def replica(generation, step, *parts):
                size = sum(map(len, parts))
                return [pb.ReplicaChunk(run_id="run-1", generation=generation, step=step,
                                        size=size, data=parts[0]),
                        *(pb.ReplicaChunk(data=part) for part in parts[1:])]

            async with transport.aio_agent_channel(f"127.0.0.1:{port}", pki.host("h2"),
                                                   roles=(transport.Role.HOST,)) as ch:
                put = pb_grpc.AgentStub(ch).PutReplica
                # a host of the job that h1 is not the buddy of: it could otherwise
                # plant a "replica" of any step for the next restore to take
                with pytest.raises(grpc.aio.AioRpcError) as planted:
                    await put(iter(replica(2, 10 ** 9, b"abc")))
                assert planted.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert "does not send replicas to this host" in planted.value.details()
                now["senders"] = frozenset({"h0", "h2"})
                with pytest.raises(grpc.aio.AioRpcError) as short:
                    await put(iter([pb.ReplicaChunk(run_id="run-1", generation=2, step=50,
                                                    size=9, data=b"abc")]))
                assert short.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                with pytest.raises(grpc.aio.AioRpcError) as ahead:  # h1 has not started 3
                    await put(iter(replica(3, 50, b"abc")))
                assert ahead.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert (await put(iter(replica(2, 50, b"abc", b"def")))).size == 6

                # one stream per sender at a time; a replica whose generation the
                # receiver's worker left while it came is not put in place
                release = asyncio.Event()

                async def slow():
                    first, *rest = replica(2, 60, b"abc", b"def")
                    yield first
                    await release.wait()
                    for chunk in rest:
                        yield chunk
                held = asyncio.ensure_future(put(slow()))
                await until(lambda: "h2" in store.receiving)
                with pytest.raises(grpc.aio.AioRpcError) as second:
                    await put(iter(replica(2, 70, b"xyz")))
                assert second.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                now["generation"] = 3
                release.set()
                with pytest.raises(grpc.aio.AioRpcError) as outlived:
                    await held
                assert outlived.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert (theirs / replica_name("h2", 50)).read_bytes() == b"abcdef"
            assert not (theirs / replica_name("h2", 60)).exists()
            assert not list(theirs.glob(".*.tmp")) and not store.receiving

    asyncio.run(main())


def test_a_late_report_of_the_generation_before_is_not_sent_as_the_new_ones(tmp_path, pki):
    """The agent names the next generation to its sender (target) before
    its worker's status moves to it, and a late `snapshot_written` of the
    worker before could come in between: the sender took the step and
    tagged it with the new generation, which the buddy (already in it)
    accepted, so a step of a line of training the new generation may have
    given up was offered at its next restore. offer() now carries the
    report's generation and drops a step of another one."""
    async def main():
        async with h0_sending_to_h1(tmp_path, pki, lambda: 3, lambda: frozenset({"h0"})) as (
                mine, theirs, _, port, sender):
            sender.target("h1", f"127.0.0.1:{port}", "run-1", 3)
            snapshot_file(mine, 40)  # written by the worker of generation 2
            snapshot_file(mine, 50)
            sender.offer(40, 2)  # its report, late
            await asyncio.sleep(0)  # (a send started would be under way now)
            sender.offer(50, 3)
            await until(lambda: sender.last_sent_step == 50)
            assert sender.sent == 1 and sender.failures_total == 0
            assert sorted(p.name for p in theirs.iterdir()) == [replica_name("h0", 50)]

    asyncio.run(main())


def test_a_lost_host_of_a_sharded_state_costs_no_step_beyond_the_last_snapshot(
        tmp_path, local_job, lm_reference):
    """The reference model tensor-parallel over 4 devices on 2 hosts (mesh
    model=4: each host holds half of every layer's weights), a third host
    spare; snapshots every 5 steps, checkpoints every 20. host-1 is killed
    at step 29: its half is gone with it, and the newest committed
    checkpoint is step 20. Its buddy host-0 holds replicas of its
    snapshots, so the slice of host-0 and the spare resumes from the newest
    snapshot step the slice reached, and trains on to the undisturbed run's
    end."""
    spec = lm_run_spec(tmp_path, "sharded", snapshot_every=5, checkpoint_every=20,
                       mesh="model = 4\ndata = -1")
    job = local_job(spec, hosts=3, devices=2, name="sharded",
                    faults=("kill-host:host-1@step=29",))
    assert job.wait(240) == 0, job.output()
    journal = job.journal()
    started = [e for e in journal if e["kind"] == "generation_started"]
    assert started[0]["hosts"] == ["host-0", "host-1"] and started[0]["mesh_shape"] == [4, 1]
    assert started[1]["hosts"] == ["host-0", "host-2"], started[1]
    committed = [e["step"] for e in journal if e["kind"] == "checkpoint_committed"
                 and e["ts"] < started[1]["ts"]]
    assert max(committed) == 20
    # the last step of generation 1 (host-0 went on a little before it was stopped)
    reached = max(e["step"] for e in journal if e["kind"] == "worker_exited"
                  and e["generation"] == 1)
    restored = next(e for e in journal if e["kind"] == "checkpoint_restored"
                    and e["generation"] == 2)
    assert restored["source"] == "snapshot" and restored["step"] % 5 == 0, restored
    # the newest snapshot, or the one before if host-1 died as it wrote the newest
    assert max(reached - 10, 20) < restored["step"] <= reached, (reached, restored)
    assert restored["replicas_of"] == "host-1" and restored["sent_by"] == [0], restored
    assert not [e for e in journal if e["kind"] == "message_refused"]
    assert_matches_reference(lm_samples(tmp_path / "sharded-samples.jsonl"), lm_reference)


RING = {"h0": "h1", "h1": "h2", "h2": "h3", "h3": "h0"}


@pytest.mark.parametrize("pool, size, gone, expected", [
    # the mesh takes 2 of the 3 survivors of h2: only h1 + h3 hold all four parts
    (["h0", "h1", "h3"], 2, ["h2"], ("h1", "h3")),
    (["h0", "h2", "h3"], 2, ["h1"], ("h0", "h2")),            # the first choice already does
    (["h0", "h1", "h2", "h3"], 4, [], ("h0", "h1", "h2", "h3")),
    (["h0", "h3"], 2, ["h1", "h2"], None),                    # h1's only replica died with h2
    (["h0", "h1", "h3"], 3, ["h2"], ("h0", "h1", "h3")),      # room for everyone
    (["h0", "h1"], 3, ["h2"], None),
])
def test_keep_replicas_within(pool, size, gone, expected):
    assert keep_replicas_within(pool, size, gone, RING) == expected


def regions_by_host(axes: tuple[tuple[str, int], ...], hosts: list[str]) -> dict:
    """Per host, the regions of a (4, 8) leaf sharded P(None, "model") that
    its 2 devices hold, the mesh laid out over the hosts' devices in rank
    order as jax.make_mesh lays it on CPU."""
    sizes = [n for _, n in axes]
    devices = 2 * len(hosts)
    sizes[sizes.index(-1)] = devices // -np.prod(sizes)
    model = [name for name, _ in axes].index("model")
    width = 8 // sizes[model]
    out: dict[str, set] = {h: set() for h in hosts}
    for k in range(devices):
        block = np.unravel_index(k, sizes)[model]
        out[hosts[k // 2]].add(((0, 4), (block * width, (block + 1) * width)))
    return out


@pytest.mark.parametrize("axes, lost, restarted_on", [
    # data outermost: h0, h2 hold model blocks 0-1, h1, h3 blocks 2-3; nobody
    # holds a part alone, yet {h0, h2} (h1's buddy kept) lack blocks 2-3
    ((("data", -1), ("model", 4)), "h1", ["h0", "h2"]),
    ((("data", -1), ("model", 4)), "h2", ["h1", "h3"]),  # (h0's buddy and h2's kept)
    ((("model", 4), ("data", -1)), "h2", ["h1", "h3"]),  # each host its own block
    ((("data", -1), ("model", 2)), "h1", ["h0", "h2", "h3"]),  # data parallel: no replica
])
def test_the_slice_the_planner_keeps_can_make_up_the_last_snapshot(axes, lost, restarted_on):
    """The worker's choice to ask for a replica (snapshot.replica_adds),
    the controller's choice of the next slice (decide, keeping a lost
    host's buddy) and the restore's vote (snapshot.choose_restore),
    composed: 4 hosts of 2 devices on a ring of buddies, one lost, 3
    survivors. The worker used to ask only for a part no other process
    held, while the planner trusts every host's snapshot to live on its
    buddy: with data outermost no worker asked, and the slice of h0 and h1's
    buddy h2 went back to the checkpoint."""
    from elastic.checkpoint.snapshot import choose_restore, replica_adds
    from elastic.config import MeshSpec
    from elastic.policy import decide as d
    from elastic.policy.slice_plan import buddy_map
    from elastic.policy.view import ClusterView, HeartbeatReceived, observe
    from tests.policy_tables import T0, register, running_slice, spec, stop_and_settle

    hosts = ["h0", "h1", "h2", "h3"]
    view = ClusterView()
    for h in hosts:
        register(view, h)
        view.hosts[h].service_port = 7000 + int(h[-1])
    s = spec(max_hosts=4, mesh=MeshSpec(axes), restart={"replicate_snapshots": True})
    state = running_slice(view, hosts)
    buddy_of = buddy_map(view, tuple(hosts))
    alive = [h for h in hosts if h != lost]
    for h in alive:
        observe(view, HeartbeatReceived(h, f"inc-{h}", view.hosts[h].worker, 0), T0 + 5.1)
    settled = stop_and_settle(state, view, T0 + 5.1, s)
    assert settled.state.lost == {lost}
    for h in alive:
        observe(view, HeartbeatReceived(h, f"inc-{h}", view.hosts[h].worker, 0), T0 + 7)
    restart = d.decide(settled.state, view, T0 + 7, s)
    started = [a.host for a in restart.actions if isinstance(a, d.StartWorker)]
    assert started == restarted_on

    own = regions_by_host(axes, hosts)
    by_process = {p: {"w": own[h]} for p, h in enumerate(hosts)}
    asked = {h for p, h in enumerate(hosts) if replica_adds(by_process, p)}
    held = {h: own[h] | {r for g in asked if buddy_of[g] == h for r in own[g]} for h in started}
    votes = [{"own": [], "held": {"9": {"w": sorted(held[h])}}} for h in started]
    assert choose_restore(votes, 8, {"w": (4, 8)}) is not None, (asked, held)
    if axes[-1] == ("model", 2):
        assert not asked  # every host holds the whole leaf: replicas would add nothing
