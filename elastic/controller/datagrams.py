"""The controller's UDP endpoint for heartbeat datagrams
(elastic.heartbeat_datagram has the why and the format): asyncio's datagram
transport, with a receive buffer large enough for a second of heartbeats.

(Reading the socket in batches instead, up to 256 datagrams per readiness
callback, changed nothing measurable: 28.4 % against 29.2 % of a core at
2,000 agents, bench/scale.py on 2026-11-26.)
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
from typing import Callable

log = logging.getLogger("elasticd")

#: The socket's receive buffer (bytes, as the kernel counts them: ~1 KiB per
#: datagram): with 10,000 agents at 1 Hz, about a second of heartbeats
#: waiting while the loop makes a long pass. The kernel caps it at
#: net.core.rmem_max unless the controller may go past it (root).
BUFFER_BYTES = 16 * 1024 * 1024

#: Linux's SO_RCVBUFFORCE (asm-generic/socket.h), which Python's socket
#: module does not name: SO_RCVBUF past net.core.rmem_max, for CAP_NET_ADMIN.
SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33 if sys.platform == "linux" else None)

OnDatagram = Callable[[bytes, Callable[[bytes], None]], None]


class DatagramEndpoint(asyncio.DatagramProtocol):
    """UDP on `host`:`port`, handing each datagram to `on_datagram(data,
    reply)`, where `reply(bytes)` answers its sender (an answer the kernel
    cannot take is dropped, as the network might drop it). `await open()`
    binds it; `close()` stops it (idempotent)."""

    def __init__(self, host: str, port: int, on_datagram: OnDatagram) -> None:
        self.host, self.port, self.on_datagram = host, port, on_datagram
        self.transport: asyncio.DatagramTransport | None = None

    async def open(self) -> None:
        """Bind and start reading. Raises OSError when the address cannot
        be bound."""
        await asyncio.get_running_loop().create_datagram_endpoint(
            lambda: self, local_addr=(self.host, self.port))
        sock = self.transport.get_extra_info("socket")
        for option in (SO_RCVBUFFORCE, socket.SO_RCVBUF):
            try:  # (past net.core.rmem_max only with CAP_NET_ADMIN)
                sock.setsockopt(socket.SOL_SOCKET, option, BUFFER_BYTES)
                break
            except (OSError, TypeError):
                continue
        got = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)  # (Linux reports double)
        if got < BUFFER_BYTES:
            log.warning("the heartbeat socket's receive buffer is %d bytes, not the %d asked "
                        "for: with thousands of agents, raise net.core.rmem_max", got,
                        BUFFER_BYTES)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def connection_made(self, transport) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, sender) -> None:
        try:
            self.on_datagram(data, lambda answer: self.transport.sendto(answer, sender))
        except Exception:  # noqa: BLE001 - a bug must not end the endpoint
            log.exception("heartbeat datagram from %s failed", sender)

    def error_received(self, exc: Exception) -> None:
        log.debug("heartbeat datagram socket: %s", exc)  # (ICMP for an earlier answer)
