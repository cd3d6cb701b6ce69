"""The wire protocol: the generated code in elastic/v1 matches proto/
(regenerated in a temp dir), and agents and controllers of other protocol
versions refuse each other (elastic.protocol)."""

from __future__ import annotations

import asyncio
import logging
import pathlib
import sys
import types

import grpc
import pytest

from elastic import protocol, protogen, transport
from elastic.agent.agent import Agent, AgentSettings
from elastic.config import load_spec
from elastic.controller import servicer
from elastic.controller.journal import read_journal
from elastic.controller.server import ControllerServer
from elastic.security.allow import AllowList
from elastic.v1 import control_pb2 as pb
from elastic.v1 import control_pb2_grpc as pb_grpc
from tests.conftest import TINY_WORKER, tiny_spec, until


def test_generated_code_is_up_to_date(tmp_path):
    generated = protogen.generate(tmp_path)
    assert generated, "no .proto files found"
    stale = []
    for path in generated:
        committed = protogen.REPO / path.relative_to(tmp_path)
        if not committed.exists() or committed.read_bytes() != path.read_bytes():
            stale.append(str(committed.relative_to(protogen.REPO)))
    assert not stale, f"out of date with proto/ (run `python -m elastic.protogen`): {stale}"


def test_every_agent_message_carries_the_fencing_header():
    for message in (pb.RegisterRequest, pb.AgentMessage):
        header = message.DESCRIPTOR.fields_by_name["header"].message_type
        assert header is pb.Header.DESCRIPTOR
    assert [f.name for f in pb.Header.DESCRIPTOR.fields] == [
        "job_id", "host_id", "incarnation", "generation", "seq"]
    # commands carry the generation they are for
    for message in (pb.StartWorker, pb.StopWorker, pb.ControllerMessage):
        assert "generation" in message.DESCRIPTOR.fields_by_name


def test_no_message_carries_credentials():
    names = {f.name for m in pb.DESCRIPTOR.message_types_by_name.values() for f in m.fields}
    assert not names & {"token", "password", "credential", "secret", "auth"}
    # the one key: a registration's heartbeat-datagram key, sent by the
    # controller in its answer on the mutually authenticated channel
    keys = [(m.name, f.name) for m in pb.DESCRIPTOR.message_types_by_name.values()
            for f in m.fields if "key" in f.name and f.type == f.TYPE_BYTES]
    assert keys == [("RegisterResponse", "heartbeat_key")]
    assert pathlib.Path(protogen.PROTO_ROOT / "elastic" / "v1" / "control.proto").exists()


def test_the_recorded_fingerprint_is_the_protos():
    """A change to the proto is looked at: does a peer of the release before
    misread it (then PROTOCOL goes up)?"""
    assert protocol.fingerprint() == protocol.PROTOCOL_FINGERPRINT, (
        "proto/elastic/v1/control.proto changed: if an agent or a controller of the release "
        "before would misread the change, raise elastic.protocol.PROTOCOL; then set "
        f"PROTOCOL_FINGERPRINT = {protocol.fingerprint()!r}")


@pytest.mark.parametrize("theirs,release,says", [
    (protocol.PROTOCOL, "0.1.0", None),
    (0, "", "the agent (release unknown) speaks no protocol version (a release before the "
            "check); this controller"),
    (protocol.PROTOCOL + 1, "0.2.0", f"the agent (release 0.2.0) speaks protocol "
                                     f"{protocol.PROTOCOL + 1}; this controller"),
    (7, "x\x1b[2J" + "y" * 100, "release x\ufffd[2J" + "y" * 35 + ")"),  # the peer's text, cleaned, cut
])
def test_a_peer_of_another_protocol_is_named_with_both_releases(theirs, release, says):
    problem = protocol.mismatch(theirs, release, "agent", "controller")
    if says is None:
        assert problem is None
    else:
        assert says in problem and f"speaks protocol {protocol.PROTOCOL}: run agents" in problem


def test_an_agent_and_a_controller_of_other_protocols_refuse_each_other(tmp_path, pki, caplog,
                                                                        monkeypatch):
    """Real gRPC, both ways: a registration of protocol 0 (an agent of a
    release before the check) is refused with FAILED_PRECONDITION and
    journaled; a real agent answered by a controller of another protocol
    logs why and opens no stream."""
    spec = load_spec(tiny_spec(tmp_path, max_hosts=1))

    async def main():
        server = ControllerServer(spec, "127.0.0.1:0", tmp_path / "state", pki.controller)
        address = await server.start()
        async with transport.aio_channel(address, pki.host("h0")) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await pb_grpc.ControllerStub(channel).Register(pb.RegisterRequest(
                    header=pb.Header(job_id="test", host_id="h0", incarnation="inc-1"),
                    devices=1, address="127.0.0.1", release="0.0.9"), timeout=10)
        assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert "release 0.0.9) speaks no protocol version" in refused.value.details()

        # the controller now answers as one of the next protocol would
        monkeypatch.setattr(servicer, "protocol", types.SimpleNamespace(
            PROTOCOL=protocol.PROTOCOL + 1, release=lambda: "9.9"))
        settings = AgentSettings(controller=address, host_id="h0", devices=1,
                                 address="127.0.0.1", failure_domain="h0",
                                 state_dir=str(tmp_path / "agent"), tls=pki.host("h0"),
                                 allow=AllowList.parse([f"{sys.executable} {TINY_WORKER}"]),
                                 job_id="test")
        agent = Agent(settings)
        task = asyncio.create_task(agent.run())
        await until(lambda: sum("cannot follow" in r.message for r in caplog.records) >= 2,
                    30, "the agent to refuse twice")  # (once, and again)
        assert agent.sessions_opened == 0
        agent.shutdown()
        await task
        await server.stop("test over")

    caplog.set_level(logging.ERROR)
    asyncio.run(asyncio.wait_for(main(), 60))
    said = next(r.message for r in caplog.records if "cannot follow" in r.message)
    assert f"release 9.9) speaks protocol {protocol.PROTOCOL + 1}; this agent" in said, said
    refusals = [e for e in read_journal(tmp_path / "state") if e["kind"] == "message_refused"]
    assert refusals and refusals[0]["refusal"] == "incompatible", refusals
