"""The generated code in elastic/v1 matches proto/ (regenerated in a temp dir)."""

from __future__ import annotations

import pathlib

from elastic import protogen
from elastic.v1 import control_pb2 as pb


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
