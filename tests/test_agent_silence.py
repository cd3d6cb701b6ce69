"""When an agent gives up on a silent controller: a real agent against a
controller stand-in over mutual TLS on loopback (its timings shortened)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc
import pytest

from elastic import transport
from elastic.agent import session as agent_session
from elastic.agent.agent import UNDELIVERED_MAX, Agent
from elastic.protocol import PROTOCOL
from elastic.v1 import control_pb2 as pb
from elastic.v1 import control_pb2_grpc as pb_grpc
from tests.test_grpc import agent_settings, run


@contextlib.asynccontextmanager
async def agent_of(fake: pb_grpc.ControllerServicer, tmp_path, pki):
    """A real agent (host h0) running against `fake`, served over mutual
    TLS on loopback; both stopped on exit."""
    server = transport.aio_server()
    pb_grpc.add_ControllerServicer_to_server(fake, server)
    port = transport.add_listen_port(server, "127.0.0.1:0", pki.controller)
    await server.start()
    agent = Agent(agent_settings(tmp_path, pki, f"127.0.0.1:{port}", "h0"))
    task = asyncio.create_task(agent.run())
    try:
        yield agent
    finally:
        agent.shutdown()
        await task
        await server.stop(0)


class QuietController(pb_grpc.ControllerServicer):
    """Registers every agent (a heartbeat timeout of 0.5 s), then answers
    `answers` messages on its stream and nothing more (a stream still held
    in gRPC's queue, answers=0, or a controller that stopped)."""

    def __init__(self, answers: int, lease_s: float, stream_wait_s: float = 0.0) -> None:
        self.answers, self.lease_s, self.stream_wait_s = answers, lease_s, stream_wait_s
        self.registered_at: list[float] = []
        self.again = asyncio.Event()  # the agent registered a second time

    async def Register(self, request, context):
        self.registered_at.append(time.monotonic())
        if len(self.registered_at) >= 2:
            self.again.set()
        return pb.RegisterResponse(job_id="test", protocol=PROTOCOL, heartbeat_interval_s=0.1,
                                   heartbeat_timeout_s=0.5, controller_lease_s=self.lease_s,
                                   stream_wait_s=self.stream_wait_s)

    async def Connect(self, request_iterator, context):
        for _ in range(self.answers):
            await context.read()
            await context.write(pb.ControllerMessage(job_id="test",
                                                     ack=pb.HeartbeatAck(seq=1)))
        while await context.read() is not grpc.aio.EOF:
            pass


@pytest.mark.parametrize("silence_s, stream_wait_s, lease_s, wait_s", [
    (5.0, 0.0, None, 60.0),       # STREAM_OPEN_S
    (5.0, 40.0, None, 100.0),     # + the lag the registration's reply named
    (5.0, 900.0, None, 300.0),    # at most as long as gRPC holds a call
    (5.0, float("nan"), None, 60.0),
    (5.0, -3.0, None, 60.0),
    (5.0, 40.0, 30.0, 15.0),      # a worker runs: half the lease, which only
    (20.0, 40.0, 30.0, 20.0),     # a registration renews; never below the silence
])
def test_how_long_an_agent_waits_for_its_streams_first_answer(silence_s, stream_wait_s,
                                                             lease_s, wait_s):
    assert agent_session.first_answer_wait_s(silence_s, stream_wait_s, lease_s) == wait_s


@pytest.mark.parametrize("answers, stream_wait_s, waited", [
    (0, 0.0, 2.0),   # STREAM_OPEN_S (here 2 s)
    (0, 1.5, 3.5),   # + the lag the registration's reply named
    (1, 0.0, 0.5),   # answered: the heartbeat timeout
])
def test_an_agent_waits_for_its_streams_first_answer_as_long_as_the_controller_waits_for_it(
        tmp_path, pki, caplog, monkeypatch, answers, stream_wait_s, waited):
    """Before the controller's first answer on the stream the agent waits
    STREAM_OPEN_S (here 2 s) plus the wait its registration's reply named,
    before it registers again, as the controller waits that long for the
    stream (with thousands of agents connecting it sits in gRPC's queue
    meanwhile); after it, the heartbeat timeout. (An agent without a worker:
    the lease bounds the wait only while one runs, see above.)"""
    monkeypatch.setattr(agent_session, "STREAM_OPEN_S", 2.0)
    fake = QuietController(answers, lease_s=3.0, stream_wait_s=stream_wait_s)

    async def main():
        async with agent_of(fake, tmp_path, pki):
            try:
                await asyncio.wait_for(fake.again.wait(), 10)
            except TimeoutError:
                pass  # (asserted below)

    with caplog.at_level(logging.WARNING, logger="elastic-agent"):
        run(main())
    assert len(fake.registered_at) >= 2, "the agent never registered again"
    gave_up = [r.getMessage() for r in caplog.records if "looking for a controller" in
               r.getMessage()]
    since = " since the stream opened" if answers == 0 else ";"
    assert gave_up and f"silent for {waited:.1f} s{since}" in gave_up[0], gave_up
    assert fake.registered_at[1] - fake.registered_at[0] >= waited  # not before


class StalledController(pb_grpc.ControllerServicer):
    """Its first stream answers the first heartbeat, then reads nothing more
    (a controller cut off or stopped: the agent's writes back up until it
    gives up on the silence); later streams read everything: the worker
    events each got are kept in `events[i]`."""

    def __init__(self) -> None:
        self.connected = asyncio.Event()
        self.events: list[list[str]] = []
        self.second = asyncio.Event()  # the second stream read the last event

    async def Register(self, request, context):
        return pb.RegisterResponse(job_id="test", protocol=PROTOCOL, heartbeat_interval_s=0.1,
                                   heartbeat_timeout_s=1.0, controller_lease_s=30.0)

    async def Connect(self, request_iterator, context):
        events: list[str] = []
        self.events.append(events)
        if len(self.events) == 1:
            await context.read()
            await context.write(pb.ControllerMessage(job_id="test", ack=pb.HeartbeatAck(seq=1)))
            self.connected.set()
            await asyncio.Event().wait()  # (until the agent ends the call)
        while (message := await context.read()) is not grpc.aio.EOF:
            if message.WhichOneof("body") == "worker_event":
                events.append(message.worker_event.kind)
                if message.worker_event.kind == f"e{POSTED - 1}":
                    self.second.set()


POSTED = 200  # 60 MB: far beyond what gRPC takes in on a stream that is not read


def test_reports_still_queued_when_a_stream_ends_go_to_the_next_session(tmp_path, pki):
    """Reports the agent had not yet written when it gave up on a silent
    controller's stream are sent on its next stream, in order; before, they
    were dropped with the stream's queue (journal events lost for good).
    (Those gRPC had taken are lost with the stream: nothing acks a report.)"""
    fake = StalledController()

    async def main():
        async with agent_of(fake, tmp_path, pki) as agent:
            await asyncio.wait_for(fake.connected.wait(), 10)
            for i in range(POSTED):
                agent._post(worker_event=pb.WorkerEvent(kind=f"e{i}", reason="x" * 300_000))
            await asyncio.wait_for(fake.second.wait(), 20)

    run(main())
    again = fake.events[1]
    assert again == [f"e{i}" for i in range(POSTED - len(again), POSTED)], again[:3]
    assert 100 < len(again) <= UNDELIVERED_MAX, len(again)  # (past it the oldest are dropped)


class DyingController(pb_grpc.ControllerServicer):
    """Registers every agent, then breaks its stream at once (UNAVAILABLE),
    as a controller killed again just after it started would; `registered`
    is set at the `times`-th registration."""

    def __init__(self, times: int) -> None:
        self.times, self.count, self.registered = times, 0, asyncio.Event()

    async def Register(self, request, context):
        self.count += 1
        if self.count >= self.times:
            self.registered.set()
        return pb.RegisterResponse(job_id="test", protocol=PROTOCOL, heartbeat_interval_s=0.1,
                                   heartbeat_timeout_s=1.0, controller_lease_s=30.0)

    async def Connect(self, request_iterator, context):
        await context.abort(grpc.StatusCode.UNAVAILABLE, "controller going away")


def test_a_registration_starts_the_reconnect_backoff_again(tmp_path, pki):
    """A controller that registers the agent and then breaks its stream, 20
    times in a row: the agent registers again at once each time. Before, a
    stream broken after a registration counted as a round no controller
    answered, and the jittered backoff went on growing (0.1 s doubling to
    2 s: about 16 s over 20 rounds); a host came back to a restarted
    controller 2.8 s late that way, and missed its 4 s adoption window (the
    suite found it)."""
    fake = DyingController(20)

    async def main():
        async with agent_of(fake, tmp_path, pki):
            t0 = time.monotonic()
            await asyncio.wait_for(fake.registered.wait(), 60)
            return time.monotonic() - t0

    took_s = run(main())
    assert took_s < 10.0, f"20 registrations took {took_s:.1f} s: the backoff was not reset"
