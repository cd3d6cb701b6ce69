"""Issue 14's table, row by row, tried as an outsider or a rogue host would:
a real controller and real agents on loopback, mutual TLS with real
certificates from a test CA, raw gRPC stubs for the attacker."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import socket
import ssl
import stat
import sys

import grpc
import pytest

from elastic import transport
from elastic.agent import snapshot_dir
from elastic.agent.agent import Agent, AgentSettings
from elastic.config import load_spec
from elastic.controller.journal import load_journal
from elastic.controller.server import ControllerServer
from elastic.protocol import PROTOCOL
from elastic.security import certs
from elastic.security.allow import AllowList
from elastic.security.identity import Role
from elastic.security.tls import TLSFiles
from elastic.v1 import control_pb2 as pb
from elastic.v1 import control_pb2_grpc as pb_grpc
from tests.conftest import TINY_WORKER, tiny_spec

TINY_ALLOWED = AllowList.parse([f"{sys.executable} {TINY_WORKER}"])


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


@contextlib.asynccontextmanager
async def controller(tmp_path, tls, **spec_kw):
    spec = load_spec(tiny_spec(tmp_path, **{"min_hosts": 2, "max_hosts": 2, **spec_kw}))
    server = ControllerServer(spec, "127.0.0.1:0", tmp_path / "state", tls)
    address = await server.start()
    loop_task = asyncio.create_task(server.run())
    try:
        yield server, address
    finally:
        loop_task.cancel()
        await server.stop("test over")


def header(host="h0", incarnation="inc1", generation=0) -> pb.Header:
    return pb.Header(job_id="test", host_id=host, incarnation=incarnation, generation=generation)


def register_request(host="h0", incarnation="inc1", **worker) -> pb.RegisterRequest:
    return pb.RegisterRequest(header=header(host, incarnation), devices=1, address="127.0.0.1",
                              protocol=PROTOCOL,
                              worker=pb.WorkerStatus(**{"step": -1, "committed_step": -1,
                                                        **worker}))


IDLE = pb.WorkerStatus(state=pb.WORKER_IDLE, step=-1, committed_step=-1)


async def first_start(call) -> pb.ControllerMessage:
    """The first start read from a stream (heartbeat acks may come first)."""
    while True:
        message = await call.read()
        assert message is not grpc.aio.EOF, "the stream ended before a start"
        if message.HasField("start"):
            return message


def journal(tmp_path) -> list[dict]:
    entries, skipped = load_journal(tmp_path / "state")
    assert skipped == 0
    return entries


def test_nobody_without_a_certificate_from_the_ca_gets_in(tmp_path, pki):
    stranger = certs.create_ca(tmp_path / "stranger")
    foreign = certs.issue(stranger, Role.HOST, "h0").directory

    async def main():
        async with controller(tmp_path, pki.controller) as (_, address):
            async with grpc.aio.insecure_channel(address) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as plain:
                    await pb_grpc.ControllerStub(ch).Register(register_request(), timeout=5)
            async with transport.aio_channel(address, TLSFiles.in_dir(foreign)) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as other_ca:
                    await pb_grpc.ControllerStub(ch).Register(register_request(), timeout=5)
            return plain.value.code(), other_ca.value.code()

    assert run(main()) == (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE)
    assert not any(e["kind"] == "host_registered" for e in journal(tmp_path))


def test_a_host_speaks_only_for_itself_and_reads_no_status(tmp_path, pki):
    async def main():
        async with controller(tmp_path, pki.controller) as (server, address):
            async with transport.aio_channel(address, pki.host("h1")) as h1, \
                    transport.aio_channel(address, pki.host("h0")) as h0, \
                    transport.aio_channel(address, pki.operator, (Role.OPERATOR,)) as op:
                with pytest.raises(grpc.aio.AioRpcError) as impersonation:
                    await pb_grpc.ControllerStub(h1).Register(register_request("h0"), timeout=5)
                assert impersonation.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert "host h1 cannot speak for host 'h0'" in impersonation.value.details()
                with pytest.raises(grpc.aio.AioRpcError) as operator_registers:
                    await pb_grpc.ControllerStub(op).Register(register_request("h0"), timeout=5)
                assert operator_registers.value.code() == grpc.StatusCode.PERMISSION_DENIED
                with pytest.raises(grpc.aio.AioRpcError) as nosy:
                    await pb_grpc.ControllerStub(h0).GetStatus(pb.StatusRequest(), timeout=5)
                assert nosy.value.code() == grpc.StatusCode.PERMISSION_DENIED

                stub = pb_grpc.ControllerStub(h0)
                await stub.Register(register_request("h0"), timeout=5)
                call = stub.Connect()
                await call.write(pb.AgentMessage(header=header(), heartbeat=pb.Heartbeat(worker=IDLE)))
                # the same stream reports a worker exit for another host
                await call.write(pb.AgentMessage(header=header("h1"),
                                                 worker_exited=pb.WorkerStatus()))
                with pytest.raises(grpc.aio.AioRpcError) as other_host:
                    while True:
                        await call.read()
                assert other_host.value.code() == grpc.StatusCode.PERMISSION_DENIED
                status = await pb_grpc.ControllerStub(op).GetStatus(pb.StatusRequest(), timeout=5)
                return [h.host_id for h in status.hosts]

    assert run(main()) == ["h0"]  # h1 never appeared
    refused = [e for e in journal(tmp_path) if e["kind"] == "message_refused"]
    assert {e["refusal"] for e in refused} == {"denied"}
    assert any("on the stream of host h0" in e["reason"] for e in refused)
    assert not any(e["kind"] == "worker_exited" for e in journal(tmp_path))


def test_a_host_id_that_differs_from_another_only_in_letter_case_is_refused(tmp_path, pki):
    async def main():
        async with controller(tmp_path, pki.controller) as (_, address):
            async with transport.aio_channel(address, pki.host("h1")) as h1, \
                    transport.aio_channel(address, pki.host("H1")) as upper:
                await pb_grpc.ControllerStub(h1).Register(register_request("h1"), timeout=5)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await pb_grpc.ControllerStub(upper).Register(register_request("H1"),
                                                                 timeout=5)
                # the first stays admitted
                await pb_grpc.ControllerStub(h1).Register(register_request("h1", "inc2"),
                                                          timeout=5)
                return refused.value

    refused = run(main())
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "differs from that of registered host 'h1' only in letter case" in refused.details()
    registered = [e["host"] for e in journal(tmp_path) if e["kind"] == "host_registered"]
    assert registered == ["h1", "h1"]


def test_a_second_certificate_for_a_live_host_waits_until_it_is_lost(tmp_path, pki):
    issued = pki.host("h5").cert.parent
    shutil.copytree(issued, tmp_path / "first")  # the bundle h5 holds now
    first = TLSFiles.in_dir(tmp_path / "first")
    second = pki.bundle(Role.HOST, "h5")  # re-issued: same name, another key

    async def main():
        async with controller(tmp_path, pki.controller) as (server, address):
            async with transport.aio_channel(address, first) as a, \
                    transport.aio_channel(address, second) as b:
                await pb_grpc.ControllerStub(a).Register(register_request("h5"), timeout=5)
                # the same certificate again (an agent restart) is fine
                await pb_grpc.ControllerStub(a).Register(register_request("h5", "inc2"),
                                                         timeout=5)
                with pytest.raises(grpc.aio.AioRpcError) as taken:
                    await pb_grpc.ControllerStub(b).Register(register_request("h5", "inc3"),
                                                             timeout=5)
                assert taken.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert "alive with another certificate" in taken.value.details()
                # once h5 is silent for heartbeat_timeout_s (1.5 s), the new one may take over
                loop = asyncio.get_running_loop()
                deadline = loop.time() + 10
                while True:
                    try:
                        return await pb_grpc.ControllerStub(b).Register(
                            register_request("h5", "inc4"), timeout=5)
                    except grpc.aio.AioRpcError as e:
                        assert e.code() == grpc.StatusCode.PERMISSION_DENIED
                        assert loop.time() < deadline, "the new certificate was never accepted"
                        await asyncio.sleep(0.1)

    assert run(main()).job_id == "test"


def test_forged_journal_fields_and_implausible_numbers_are_refused(tmp_path, pki):
    async def main():
        async with controller(tmp_path, pki.controller) as (server, address):
            async with transport.aio_channel(address, pki.host("h0")) as ch, \
                    transport.aio_channel(address, pki.operator, (Role.OPERATOR,)) as op:
                stub = pb_grpc.ControllerStub(ch)
                await stub.Register(register_request(), timeout=5)
                call = stub.Connect()
                await call.write(pb.AgentMessage(header=header(), heartbeat=pb.Heartbeat(worker=IDLE)))
                assert (await call.read()).WhichOneof("body") == "ack"  # heard: the lease
                forged = json.dumps({"kind": "job_succeeded", "generation": 999999, "step": 5})
                attacks = [
                    pb.AgentMessage(header=header(), worker_event=pb.WorkerEvent(
                        kind="checkpoint_saved", reason="x", fields_json=forged)),
                    pb.AgentMessage(header=header(), progress=pb.Progress(
                        step=-1, committed_step=10**18)),
                    pb.AgentMessage(header=header(generation=999999), progress=pb.Progress(
                        step=3, committed_step=-1)),
                ]
                replies = []
                for attack in attacks:
                    await call.write(attack)
                    replies.append(await call.read())
                # a heartbeat with impossible steps still says the host is alive: its
                # steps are ignored, not believed (not rejected either: the next
                # message read is the flood's budget, and the host's step stays -1;
                # acks come at most every quarter heartbeat timeout, none is due)
                await call.write(pb.AgentMessage(header=header(), heartbeat=pb.Heartbeat(
                    worker=pb.WorkerStatus(state=pb.WORKER_IDLE, step=10**18,
                                           committed_step=10**18))))
                # and a flood of reports is cut off at the budget
                flood = pb.AgentMessage(header=header(), progress=pb.Progress(step=-1,
                                                                             committed_step=-1))
                for _ in range(250):
                    await call.write(flood)
                budget = await call.read()
                status = await pb_grpc.ControllerStub(op).GetStatus(pb.StatusRequest(), timeout=5)
                call.cancel()
                return replies, budget, status

    replies, budget, status = run(main())
    assert [r.WhichOneof("body") for r in replies] == ["rejected"] * 3
    assert "reserved" in replies[0].rejected.reason
    assert "10,000,000 past" in replies[1].rejected.reason
    assert "generation 999999" in replies[2].rejected.reason
    assert "reports a second" in budget.rejected.reason
    assert status.committed_step == -1 and status.generation == 0
    assert [(h.host_id, h.step) for h in status.hosts] == [("h0", -1)]
    entries = journal(tmp_path)
    assert not any(e["kind"] == "job_succeeded" for e in entries)
    assert max(e["generation"] for e in entries) == 0
    refused = [e for e in entries if e["kind"] == "message_refused"]
    # one line per kind per 10 s, the rest counted
    assert [e["refusal"] for e in refused] == ["invalid", "implausible"], refused


def test_only_rank_0_reports_commits_and_a_stream_needs_its_registration_certificate(
        tmp_path, pki):
    async def main():
        async with controller(tmp_path, pki.controller) as (server, address):
            async with transport.aio_channel(address, pki.host("h0")) as c0, \
                    transport.aio_channel(address, pki.host("h1")) as c1, \
                    transport.aio_channel(address, pki.operator, (Role.OPERATOR,)) as op:
                calls = {}
                for host, ch in (("h0", c0), ("h1", c1)):
                    stub = pb_grpc.ControllerStub(ch)
                    request = register_request(host)
                    request.free_port = 40000  # a port for the coordinator, as agents offer
                    await stub.Register(request, timeout=5)
                    calls[host] = stub.Connect()
                    await calls[host].write(pb.AgentMessage(header=header(host),
                                                            heartbeat=pb.Heartbeat(worker=IDLE)))
                starts = {h: await first_start(call) for h, call in calls.items()}
                rank0 = next(h for h, m in starts.items() if m.start.process_id == 0)
                other = "h1" if rank0 == "h0" else "h0"
                stub = pb_grpc.ControllerStub(op)

                async def commit(host: str, step: int) -> int:
                    """Report a commit of `step` from `host`, then a heartbeat at step + 1 on
                    the same stream: once status shows it, the commit was handled."""
                    def heartbeat(at: int) -> pb.AgentMessage:
                        return pb.AgentMessage(header=header(host, generation=1),
                                               heartbeat=pb.Heartbeat(free_port=40000,
                                                                      worker=pb.WorkerStatus(
                            generation=1, state=pb.WORKER_RUNNING, step=at, committed_step=-1)))
                    await calls[host].write(heartbeat(step))  # as the agent says first
                    await calls[host].write(pb.AgentMessage(
                        header=header(host, generation=1),
                        progress=pb.Progress(step=step, committed_step=step)))
                    await calls[host].write(heartbeat(step + 1))
                    deadline = asyncio.get_running_loop().time() + 10
                    while True:
                        status = await stub.GetStatus(pb.StatusRequest(), timeout=5)
                        if next(h.step for h in status.hosts if h.host_id == host) == step + 1:
                            return status.committed_step
                        assert asyncio.get_running_loop().time() < deadline
                        await asyncio.sleep(0.02)
                ignored = await commit(other, 7)
                counted = await commit(rank0, 5)
                # h2 registers; before its agent opens its stream, a stream with another
                # certificate of h2 (a stolen older one, say) tries to take the registration
                shutil.copytree(pki.host("h2").cert.parent, tmp_path / "h2-first")
                other = pki.bundle(Role.HOST, "h2")
                async with transport.aio_channel(address, TLSFiles.in_dir(
                        tmp_path / "h2-first")) as c2, \
                        transport.aio_channel(address, other) as c2b:
                    await pb_grpc.ControllerStub(c2).Register(register_request("h2"), timeout=5)
                    stray = pb_grpc.ControllerStub(c2b).Connect()
                    await stray.write(pb.AgentMessage(header=header("h2"),
                                                      heartbeat=pb.Heartbeat(worker=IDLE)))
                    with pytest.raises(grpc.aio.AioRpcError) as hijack:
                        await stray.read()
                for call in calls.values():
                    call.cancel()
                return ignored, counted, hijack.value

    ignored, counted, hijack = run(main())
    assert (ignored, counted) == (-1, 5)
    assert hijack.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "not the one host h2 registered with" in hijack.details()


def test_an_agent_that_does_not_read_its_stream_is_cut_off():
    from elastic.controller.executor import MAX_OUTBOX, Session

    async def main():
        session = Session("h0", "i1")
        for _ in range(MAX_OUTBOX + 5):
            session.send(pb.ControllerMessage(job_id="test"))
        return session
    session = asyncio.run(main())
    assert session.close_status[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert session.outbox.qsize() == MAX_OUTBOX + 1  # the messages, then the end


@pytest.mark.parametrize("host_id", ["../etc", "h\n0 forged", "h\x00", "h" * 100_000])
def test_hosts_with_unsafe_ids_are_refused_even_without_tls(tmp_path, host_id):
    async def main():
        async with controller(tmp_path, None) as (server, address):
            async with transport.aio_channel(address, None) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await pb_grpc.ControllerStub(ch).Register(register_request(host_id),
                                                              timeout=5)
                return refused.value.code()

    assert run(main()) == grpc.StatusCode.INVALID_ARGUMENT
    entries = journal(tmp_path)
    assert [e["kind"] for e in entries][:2] == ["insecure_mode", "controller_started"]
    assert not any(e["kind"] == "host_registered" for e in entries)


def test_streams_are_capped_per_peer_and_idle_ones_closed(tmp_path, pki):
    async def main():
        async with controller(tmp_path, pki.controller) as (server, address):
            server.servicer.first_message_timeout_s = 1.0
            async with transport.aio_channel(address, pki.host("h0")) as ch:
                stub = pb_grpc.ControllerStub(ch)
                idle = [stub.Connect() for _ in range(4)]
                for call in idle:
                    await call.wait_for_connection()
                extra = stub.Connect()
                with pytest.raises(grpc.aio.AioRpcError) as capped:
                    await extra.read()
                codes = []
                for call in idle:
                    with pytest.raises(grpc.aio.AioRpcError) as closed:
                        await call.read()
                    codes.append(closed.value.code())
                return capped.value, codes

    capped, codes = run(main())
    assert capped.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "at most 4 per peer" in capped.details()
    assert codes == [grpc.StatusCode.DEADLINE_EXCEEDED] * 4


class FakeController(pb_grpc.ControllerServicer):
    """A controller an attacker runs: it tells every agent to run `argv`."""

    def __init__(self, argv: list[str], workdir: str, env: dict | None = None) -> None:
        self.argv, self.workdir, self.env = argv, workdir, env or {}
        self.registered = asyncio.Event()
        self.exits: asyncio.Queue = asyncio.Queue()

    async def Register(self, request, context):
        self.registered.set()
        return pb.RegisterResponse(job_id="test", protocol=PROTOCOL, heartbeat_interval_s=0.2,
                                   heartbeat_timeout_s=2.0)

    async def Connect(self, request_iterator, context):
        await context.read()
        await context.write(pb.ControllerMessage(job_id="test", generation=1, start=pb.StartWorker(
            generation=1, process_id=0, num_processes=1, coordinator_address="127.0.0.1:1",
            argv=self.argv, workdir=self.workdir, env=self.env)))
        while (message := await context.read()) is not grpc.aio.EOF:
            if message.WhichOneof("body") == "worker_exited":
                await self.exits.put(message.worker_exited)


async def serve_fake(fake: FakeController, bundle) -> tuple[grpc.aio.Server, str]:
    server = transport.aio_server()
    pb_grpc.add_ControllerServicer_to_server(fake, server)
    port = transport.add_listen_port(server, "127.0.0.1:0", bundle)
    await server.start()
    return server, f"127.0.0.1:{port}"


@pytest.mark.parametrize("server_bundle", ["another CA's controller", "a host certificate"])
def test_agents_do_not_talk_to_an_unverified_controller(tmp_path, pki, caplog, server_bundle):
    marker = tmp_path / "pwned"
    if server_bundle == "a host certificate":  # served anyway: the agent must refuse it
        bundle, serve_with = pki.host("h9"), None
    else:
        stranger = certs.create_ca(tmp_path / "stranger")
        bundle = TLSFiles.in_dir(certs.issue(stranger, Role.CONTROLLER, "evil").directory)
        serve_with = bundle

    async def main():
        fake = FakeController(["/bin/sh", "-c", f"touch {marker}"], str(tmp_path))
        if serve_with is None:  # a host certificate cannot pass our own checks: serve raw
            server = transport.aio_server()
            pb_grpc.add_ControllerServicer_to_server(fake, server)
            creds = grpc.ssl_server_credentials(
                [(bundle.key.read_bytes(), bundle.cert.read_bytes())],
                bundle.ca.read_bytes(), require_client_auth=False)
            address = f"127.0.0.1:{server.add_secure_port('127.0.0.1:0', creds)}"
            await server.start()
        else:
            server, address = await serve_fake(fake, serve_with)
        agent = Agent(AgentSettings(controller=address, host_id="h0", devices=1,
                                    address="127.0.0.1", failure_domain="h0",
                                    state_dir=str(tmp_path / "agent"), tls=pki.host("h0"),
                                    allow=TINY_ALLOWED))
        task = asyncio.create_task(agent.run())
        with caplog.at_level(logging.INFO, logger="elastic-agent"):
            deadline = asyncio.get_running_loop().time() + 30
            while not any("retrying (round 2)" in r.getMessage() for r in caplog.records):
                assert asyncio.get_running_loop().time() < deadline, "the agent never dialled"
                await asyncio.sleep(0.05)  # the agent tried (and failed) twice
        agent.shutdown()
        await task
        await server.stop(0)
        return fake.registered.is_set()

    assert run(main()) is False
    assert not marker.exists()


def test_a_verified_but_hostile_controller_runs_nothing_outside_the_allow_list(tmp_path, pki):
    marker = tmp_path / "pwned"

    async def attempt(argv, env=None):
        fake = FakeController(argv, str(tmp_path), env)
        server, address = await serve_fake(fake, pki.controller)  # a stolen controller key
        agent = Agent(AgentSettings(controller=address, host_id="h0", devices=1,
                                    address="127.0.0.1", failure_domain="h0",
                                    state_dir=str(tmp_path / "agent"), tls=pki.host("h0"),
                                    allow=TINY_ALLOWED))
        task = asyncio.create_task(agent.run())
        exited = await asyncio.wait_for(fake.exits.get(), 20)
        agent.shutdown()
        await task
        await server.stop(0)
        return exited

    exit_ = run(attempt(["/bin/sh", "-c", f"touch {marker}"]))
    assert exit_.exit_code == 126 and "is not in this host's allow-list" in exit_.stderr_tail
    preload = run(attempt([sys.executable, str(TINY_WORKER), "--steps", "1"],
                          {"LD_PRELOAD": str(tmp_path / "evil.so")}))
    assert preload.exit_code == 126 and "sets LD_PRELOAD" in preload.stderr_tail
    # the allowed program, with variables no deny-list named: Python's warning
    # filter imports `antigravity`, which runs $BROWSER through a shell
    browser = run(attempt([sys.executable, str(TINY_WORKER), "--steps", "1"],
                          {"PYTHONWARNINGS": "all:0:antigravity.x:0:0",
                           "BROWSER": f"/bin/sh -c 'touch {marker}' #%s"}))
    assert browser.exit_code == 126 and "sets BROWSER, which this host does not allow" in \
        browser.stderr_tail
    assert not marker.exists()


def _served_certificate(address: str, bundle) -> bytes:
    """The certificate the controller serves now (a fresh TLS handshake)."""
    context = ssl.create_default_context(cafile=str(bundle.ca))
    context.load_cert_chain(str(bundle.cert), str(bundle.key))
    context.check_hostname = False
    context.set_alpn_protocols(["h2"])
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as raw, \
            context.wrap_socket(raw, server_hostname=certs.CONTROLLER_SERVER_NAME) as tls:
        return tls.getpeercert(binary_form=True)


def test_a_renewed_controller_certificate_is_served_without_a_restart(tmp_path, pki):
    root = tmp_path / "pki"
    certs.create_ca(root)
    controller_bundle = TLSFiles.in_dir(certs.issue(root, Role.CONTROLLER, "c").directory)
    operator = TLSFiles.in_dir(certs.issue(root, Role.OPERATOR, "op").directory)

    async def main():
        async with controller(tmp_path, controller_bundle) as (server, address):
            before = await asyncio.to_thread(_served_certificate, address, operator)
            certs.issue(root, Role.CONTROLLER, "c")  # renewal: files replaced in place
            after = await asyncio.to_thread(_served_certificate, address, operator)
            async with transport.aio_channel(address, operator, (Role.OPERATOR,)) as ch:
                status = await pb_grpc.ControllerStub(ch).GetStatus(pb.StatusRequest(), timeout=5)
            return before, after, status

    before, after, status = run(main())
    assert before != after and status.job_id == "test"


def test_snapshot_directories_cannot_be_planted_or_taken_first(tmp_path, pki):
    attacker = tmp_path / "attacker"
    attacker.mkdir()
    (attacker / "keep").write_text("mine")
    explicit = tmp_path / "snapshots"  # an operator's --snapshot-dir: a known path
    os.symlink(attacker, explicit)

    def agent(state: str, snapshots: str | None) -> Agent:
        return Agent(AgentSettings(controller="127.0.0.1:1", host_id="h0", devices=1,
                                   address="127.0.0.1", failure_domain="h0",
                                   state_dir=str(tmp_path / state), tls=pki.host("h0"),
                                   allow=TINY_ALLOWED, snapshot_dir=snapshots))
    planted, default = agent("a", str(explicit)), agent("b", None)
    try:
        planted.prepare()
        default.prepare()
        st = os.lstat(explicit)
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
        assert sorted(os.listdir(attacker)) == ["keep"]  # nothing written through the link
        # the default lives in host memory under a random name, made by mkdtemp
        name = os.path.basename(default.snapshot_dir)
        assert default.snapshot_dir.startswith("/dev/shm/") and name != "elastic-snapshots-"
        assert stat.S_IMODE(os.stat(default.snapshot_dir).st_mode) == 0o700
    finally:
        for a in (planted, default):
            snapshot_dir.remove_recorded(a.settings.state_dir)
    assert not os.path.exists(default.snapshot_dir) and not os.path.exists(explicit)


def test_elasticd_logs_reads_a_host_only_from_that_hosts_agent(tmp_path, pki):
    """An agent serving with host-2's certificate where host-1's logs are
    asked for gets no request: the operator's channel checks the agent's
    name (an audit found it took any host certificate)."""
    from elastic.agent.service import AgentService
    from elastic.logs import host_logs

    async def scenario():
        agent = AgentService("127.0.0.1:0", pki.host("host-2"), str(tmp_path / "state"))
        port = await agent.start()
        try:
            lines: list[str] = []
            ask = pb.LogsRequest(tail_bytes=100)
            wrong = await host_logs("host-1", f"127.0.0.1:{port}", pki.operator, ask,
                                    lines.append, timeout_s=10)
            right = await host_logs("host-2", f"127.0.0.1:{port}", pki.operator, ask,
                                    lines.append, timeout_s=10)
            return wrong, right
        finally:
            await agent.stop()

    wrong, right = asyncio.run(scenario())
    assert wrong is not None and wrong.startswith("host-1: cannot read its logs"), wrong
    assert right is None
