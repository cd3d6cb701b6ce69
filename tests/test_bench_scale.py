"""bench/scale.py's simulated agents stand for 10,000 real ones. One that
stops heartbeating is a host the controller rightly declares lost, and the
benchmark counted it as the controller's false loss: from `f3b1238`
(2026-11-29) to 2026-12-07 every simulated agent whose heartbeat datagrams
went unacked stopped heartbeating for good the moment it gave them up, and
runs read thousands of "false" host losses."""

from __future__ import annotations

import asyncio
import importlib
import pathlib
import socket
import sys
from types import SimpleNamespace

import pytest

from elastic.agent.datagrams import WENT_TO_STREAM, HeartbeatDatagrams
from elastic.v1 import control_pb2 as pb

BENCH = pathlib.Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture(scope="module")
def scale():
    """bench/scale.py and its simulated agents (bench/scale_agents.py), as
    one namespace."""
    sys.path.insert(0, str(BENCH))  # (they import bench/common.py and each other)
    try:
        driver, agents = (importlib.import_module(name) for name in ("scale", "scale_agents"))
    finally:
        sys.path.remove(str(BENCH))
    return SimpleNamespace(ArrivalStamps=agents.ArrivalStamps, split_losses=driver.split_losses)


def test_a_simulated_agent_that_gives_its_datagrams_up_goes_on_heartbeating(scale):
    """Its datagrams go unacked past their patience (a controller that acks
    nothing, on loopback): `send` says "on the stream" and the inbox gets
    the agent's marker, as for a real agent; before, the benchmark's inbox
    raised on the marker, out of `send`, and ended the heartbeat task."""

    async def main() -> tuple[list[bool], object, dict]:
        loop = asyncio.get_running_loop()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as deaf:
            deaf.bind(("127.0.0.1", 0))
            now = [0.0]
            queue: asyncio.Queue = asyncio.Queue()
            transport, datagrams = await loop.create_datagram_endpoint(
                lambda: HeartbeatDatagrams(bytes(16), "sim-00001", queue, deaf.getsockname(),
                                           patience_s=3.0, interval_s=1.0, clock=lambda: now[0]),
                local_addr=("127.0.0.1", 0))
            try:
                received: dict = {}
                datagrams.inbox = scale.ArrivalStamps(queue, transport, "sim-00001", received)
                message = pb.AgentMessage(header=pb.Header(host_id="sim-00001"),
                                          heartbeat=pb.Heartbeat(seq=1))
                sent = []
                for second in range(5):  # (a heartbeat a second)
                    now[0] = float(second)
                    sent.append(datagrams.send(message))
                return sent, queue.get_nowait(), received
            finally:
                transport.close()

    sent, marker, received = asyncio.run(main())
    assert sent == [True, True, True, True, False]  # the fifth goes on the stream
    assert marker is WENT_TO_STREAM
    assert received == {}  # (no start or stop arrived)


@pytest.mark.parametrize("gaps, loss_ts, unsent, quiet_s", [
    ({}, 100.0, False, 0.0),  # it sent within SEND_GAP_S: the controller's doing
    ({"h": [(93.0, 101.0)]}, 100.0, True, None),  # nothing sent for 7 s by then
    ({"h": [(96.0, 101.0)]}, 100.0, False, 4.0),  # 4 s: under the 5 s timeout
    ({"h": [(90.0, 99.0)]}, 100.0, False, 0.0),  # a gap that ended before the loss
    ({"h": [(80.0, 88.0), (95.0, 130.0)]}, 100.0, True, None),  # still silent at the end
    ({"other": [(90.0, 101.0)]}, 100.0, False, 0.0),  # another host's gap
])
def test_losses_are_split_by_whether_the_simulated_agent_sent(scale, gaps, loss_ts, unsent,
                                                              quiet_s):
    loss = {"kind": "host_lost", "host": "h", "ts": loss_ts, "silent_s": 6.0}
    got_unsent, got_unread = scale.split_losses([loss], gaps, timeout_s=5.0)
    assert got_unsent == ([loss] if unsent else [])
    assert got_unread == ([] if unsent else [(loss, quiet_s)])
