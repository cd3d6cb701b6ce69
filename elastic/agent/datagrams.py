"""The agent's heartbeat datagrams for one session with a controller
(elastic.heartbeat_datagram has the why and the format).

The periodic heartbeats go as datagrams once the controller offers a port
and a key and has answered on the stream (until it has taken the stream up,
which with thousands of agents connecting takes seconds, it drops them).
Its acks come back the same way, and so do its starts and stops, into the
session's inbox like the stream's messages (a command's stream copy follows
a heartbeat interval later unless this agent's reports show it acted on it:
elastic.controller.executor; the agent acts on a command's first copy). A
heartbeat goes on the stream instead when the datagram would be too long,
when the stream has messages waiting (a datagram must not overtake them),
and from the moment datagrams have gone unacked for `patience_s`, plus the
lag the controller's latest ack reported (UDP blocked on the way, or
dropped): the controller then hears the stream before its heartbeat
timeout. Every REPROBE_S after that, one heartbeat goes both ways; an ack
of its datagram brings datagrams back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from elastic import transport
from elastic.heartbeat_datagram import DatagramChannel, DatagramError, TO_CONTROLLER
from elastic.v1 import control_pb2 as pb

log = logging.getLogger("elastic-agent")

_parse = transport.lenient(pb.ControllerMessage)

#: Seconds between tries of datagrams again once they went unacked.
REPROBE_S = 30.0
#: Put into the session's inbox when the agent gives datagrams up: its first
#: stream heartbeat has just gone, and the controller's silence is counted
#: again from here (elastic.agent.session).
WENT_TO_STREAM = object()


class HeartbeatDatagrams(asyncio.DatagramProtocol):
    """A session's datagram endpoint toward the controller's `address`
    ((host, port), resolved). Not connected: an answer may come from another
    address of the controller's host (the key, not the address, says who
    sent it).

    `send(message)` -> True when the AgentMessage went as a datagram, False
    when the caller must put it on the stream. Acks, starts and stops that open
    under the session's key are put into `inbox` (ControllerMessages).
    `acks`: how many acks came; `given_up`: datagrams are no longer used."""

    def __init__(self, key: bytes, host_id: str, inbox: asyncio.Queue, address: tuple,
                 patience_s: float, interval_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.channel = DatagramChannel(key, host_id, TO_CONTROLLER)
        self.inbox, self.address, self.clock = inbox, address, clock
        self.patience_s = patience_s
        self.interval_s = interval_s
        # a gap this long between two sends: this agent did not run meanwhile
        self.held_up_s = max(2 * interval_s, patience_s)
        self.transport: asyncio.DatagramTransport | None = None
        self.unacked_since: float | None = None  # the first datagram since the last ack
        self.sent_at: float | None = None  # the last call of send()
        self.given_up = False
        self.given_up_at = 0.0
        self.acks = 0
        #: the controller's lag (seconds) as its latest ack gave it
        self.controller_lag_s = 0.0

    def connection_made(self, transport) -> None:
        self.transport = transport

    def send(self, message: pb.AgentMessage) -> bool:
        if self.given_up or self.transport is None or self.transport.is_closing():
            return False
        now = self.clock()
        if self.sent_at is not None and now - self.sent_at > self.held_up_s:
            self.unacked_since = None  # this agent did not run (stopped): no sign of the path
        self.sent_at = now
        if self.unacked_since is not None and now - self.unacked_since > self.waits_s():
            self.given_up, self.given_up_at = True, now
            log.warning("heartbeat datagrams to the controller unacked for %.1f s (UDP blocked "
                        "or lost on the way, or the controller behind?); heartbeats go on the "
                        "stream, and try datagrams again every %.0f s", now - self.unacked_since,
                        REPROBE_S)
            self.inbox.put_nowait(WENT_TO_STREAM)
            return False
        if not self._sendto(message):
            return False
        if self.unacked_since is None:
            self.unacked_since = now
        return True

    def _sendto(self, message: pb.AgentMessage) -> bool:
        """Seal `message` and send it to the controller; False when it is
        too long for a datagram (MAX_DATAGRAM bytes)."""
        try:
            data = self.channel.seal(message.SerializeToString())
        except ValueError:
            return False
        self.transport.sendto(data, self.address)
        return True

    def waits_s(self) -> float:
        """Seconds of datagrams without an ack before the agent goes to its
        stream: its patience, and the lag the controller's latest ack gave
        (at most as much again). A controller behind its work acks late; it
        judges silence against its heartbeat timeout plus the lag it told
        (elastic.controller.lag.LagPromises) until this agent's stream
        heartbeat can have come, so waiting as much longer keeps the stream
        in time; sending a controller that is behind the dearer
        stream heartbeats instead puts it further behind (bench/scale.py at
        10,000 agents on 2026-11-26: a third of the agents moved to their
        streams while the controller ran 3.2 s behind)."""
        return self.patience_s + min(self.controller_lag_s, self.patience_s)

    def going_to_stream(self) -> bool:
        """Whether datagrams went unacked and the agent has not gone to its
        stream yet, which it does at a heartbeat once they have gone unacked
        for `waits_s()`. Until then the controller has had no heartbeat it
        could ack on the stream, so its silence is no sign yet: with the
        lag it told added, the wait can be longer than the session's
        silence limit (elastic.agent.session)."""
        return not self.given_up and self.unacked_since is not None and \
            self.clock() - self.unacked_since <= self.waits_s() + 2 * self.interval_s

    def probe_due(self) -> bool:
        """Whether to try datagrams again (they went unacked REPROBE_S or
        more ago): then send the heartbeat on the stream and `probe` it."""
        return self.given_up and self.clock() - self.given_up_at >= REPROBE_S

    def probe(self, message: pb.AgentMessage) -> None:
        """Send `message` (already on the stream, with an older header.seq)
        as a datagram too: its ack brings datagrams back."""
        self.given_up_at = self.clock()
        if self.transport is not None and not self.transport.is_closing():
            self._sendto(message)

    def datagram_received(self, data: bytes, addr) -> None:
        try:
            message = _parse(self.channel.open(data))
        except DatagramError:
            return
        kind = message.WhichOneof("body") if message is not None else None
        if kind in ("start", "stop"):  # its stream copy may follow (the agent acts once)
            self.inbox.put_nowait(message)
        elif kind == "ack":
            if self.given_up:
                log.info("heartbeat datagrams acked again: heartbeats go as datagrams")
            self.unacked_since, self.given_up = None, False
            self.controller_lag_s = max(0.0, message.ack.controller_lag_s)
            self.acks += 1
            self.inbox.put_nowait(message)

    def error_received(self, exc: Exception) -> None:
        log.debug("heartbeat datagram: %s", exc)  # (ICMP: the port is closed) patience decides


async def open_datagrams(address: str, reply: pb.RegisterResponse, host_id: str,
                         inbox: asyncio.Queue) -> HeartbeatDatagrams | None:
    """The session's datagram endpoint toward the controller at `address`
    ("HOST:PORT"; its host's first address, the reply's heartbeat port), or
    None when the reply offers none, its timings leave no safe patience
    (elastic.heartbeat_datagram.patience_s) or the endpoint cannot be made
    (warned: heartbeats then go on the stream)."""
    import socket

    from elastic.heartbeat_datagram import KEY_BYTES, patience_s

    patience = patience_s(reply.heartbeat_interval_s, reply.heartbeat_timeout_s)
    if not 0 < reply.heartbeat_port < 65536 or len(reply.heartbeat_key) != KEY_BYTES or \
            patience is None:
        return None
    host = address.rsplit(":", 1)[0].strip("[]")
    loop = asyncio.get_running_loop()
    try:
        family, _, _, _, resolved = (await loop.getaddrinfo(
            host, reply.heartbeat_port, type=socket.SOCK_DGRAM))[0]
        _, endpoint = await loop.create_datagram_endpoint(
            lambda: HeartbeatDatagrams(reply.heartbeat_key, host_id, inbox, resolved, patience,
                                       reply.heartbeat_interval_s),
            local_addr=("::" if family == socket.AF_INET6 else "0.0.0.0", 0))
    except (OSError, ValueError) as e:
        log.warning("heartbeats on the stream: no datagram endpoint to %s port %d: %s",
                    host, reply.heartbeat_port, e)
        return None
    return endpoint
