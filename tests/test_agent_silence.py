"""When an agent gives up on a silent controller: a real agent against a
controller stand-in over mutual TLS on loopback (its timings shortened)."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
import pytest

from elastic import transport
from elastic.agent import session as agent_session
from elastic.agent.agent import Agent
from elastic.v1 import control_pb2 as pb
from elastic.v1 import control_pb2_grpc as pb_grpc
from tests.test_grpc import agent_settings, run


class QuietController(pb_grpc.ControllerServicer):
    """Registers every agent (a heartbeat timeout of 0.5 s), then answers
    `answers` messages on its stream and nothing more (a stream still held
    in gRPC's queue, answers=0, or a controller that stopped)."""

    def __init__(self, answers: int, lease_s: float) -> None:
        self.answers, self.lease_s = answers, lease_s
        self.registered_at: list[float] = []
        self.again = asyncio.Event()  # the agent registered a second time

    async def Register(self, request, context):
        self.registered_at.append(time.monotonic())
        if len(self.registered_at) >= 2:
            self.again.set()
        return pb.RegisterResponse(job_id="test", heartbeat_interval_s=0.1,
                                   heartbeat_timeout_s=0.5, controller_lease_s=self.lease_s)

    async def Connect(self, request_iterator, context):
        for _ in range(self.answers):
            await context.read()
            await context.write(pb.ControllerMessage(job_id="test",
                                                     ack=pb.HeartbeatAck(seq=1)))
        while await context.read() is not grpc.aio.EOF:
            pass


@pytest.mark.parametrize("answers, lease_s, waited", [
    (0, 30.0, 2.0),  # STREAM_OPEN_S (here 2 s)
    (0, 3.0, 1.5),   # half the controller lease, which only a registration renews
    (1, 30.0, 0.5),  # answered: the heartbeat timeout
])
def test_an_agent_waits_for_its_streams_first_answer_as_long_as_the_controller_waits_for_it(
        tmp_path, pki, caplog, monkeypatch, answers, lease_s, waited):
    """Before the controller's first answer on the stream the agent waits
    STREAM_OPEN_S (here 2 s), at most half the controller lease, before it
    registers again, as the controller waits that long for the stream (with
    thousands of agents connecting it sits in gRPC's queue meanwhile);
    after it, the heartbeat timeout."""
    monkeypatch.setattr(agent_session, "STREAM_OPEN_S", 2.0)
    fake = QuietController(answers, lease_s)

    async def main():
        server = transport.aio_server()
        pb_grpc.add_ControllerServicer_to_server(fake, server)
        port = transport.add_listen_port(server, "127.0.0.1:0", pki.controller)
        await server.start()
        agent = Agent(agent_settings(tmp_path, pki, f"127.0.0.1:{port}", "h0"))
        task = asyncio.create_task(agent.run())
        try:
            await asyncio.wait_for(fake.again.wait(), 10)
        except TimeoutError:
            pass  # (asserted below)
        finally:
            agent.shutdown()
            await task
            await server.stop(0)

    with caplog.at_level(logging.WARNING, logger="elastic-agent"):
        run(main())
    assert len(fake.registered_at) >= 2, "the agent never registered again"
    gave_up = [r.getMessage() for r in caplog.records if "looking for a controller" in
               r.getMessage()]
    since = " since the stream opened" if answers == 0 else ";"
    assert gave_up and f"silent for {waited:.1f} s{since}" in gave_up[0], gave_up
    assert fake.registered_at[1] - fake.registered_at[0] >= waited  # not before
