"""The controller's UDP endpoint for heartbeat datagrams
(elastic.heartbeat_datagram has the why and the format): a non-blocking
socket with a receive buffer large enough for a second of heartbeats, read
in batches, each host's newest datagram first.

Why batches: a heartbeat is a snapshot of its host (worker state, steps,
preemption), so of several datagrams from one host waiting in the socket
only the newest tells anything. A controller that falls behind (more
heartbeats a second than one core opens and handles, ~70 us each in
Python) used to work through every queued datagram in arrival order: at
10,000 simulated agents (bench/scale.py on 2026-11-26, `be529a9`) the
16 MiB buffer held a standing queue of 3.2 s of heartbeats, every heartbeat
was read 3.2 s late, admission control deferred registrations for as long
as that lag lasted (it never ended), and agents whose acks came later than
their patience moved to their streams, which cost the controller more.
Reading the socket empty and handling one datagram per host makes the work
of a batch proportional to the hosts, not to the backlog: the queue drains
in one batch, and a controller past its capacity hears each host less
often instead of ever later (the same reason Kubernetes' node leases are
overwritten, not queued). Below capacity a batch holds a datagram or a few,
and nothing changes. (Batches without coalescing, up to 256 datagrams per
readiness callback, changed nothing measurable: 28.4 % against 29.2 % of a
core at 2,000 agents, 2026-11-26.)

What the kernel drops when the buffer is full is never read, so it is no
silence of the hosts that sent it: before each batch is read the endpoint
asks the kernel how many it dropped (Linux: SO_MEMINFO) and, if the buffer
is at least half full then (the kernel also drops datagrams with a bad
checksum, which anyone can send), tells the controller, which counts that
as lag (elastic.controller.lag.ReceiveDrops).

A batch of more than CHUNK_HOSTS hosts is handled that many at a time,
giving the event loop back between chunks (the streams, the decisions and
the lag probe run meanwhile), and the socket is not read again until it is
done. (Smaller batches, the usual ones, are handled at once: pausing the
reader costs two epoll_ctl calls and asyncio's bookkeeping, which below
capacity would be per datagram.)
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import sys
from collections.abc import Callable

from elastic.heartbeat_datagram import DatagramError, named

log = logging.getLogger("elasticd")

#: The socket's receive buffer (bytes, as the kernel counts them: ~1 KiB per
#: datagram): with 10,000 agents at 1 Hz, about a second of heartbeats
#: waiting while the loop makes a long pass. The kernel caps it at
#: net.core.rmem_max unless the controller may go past it (root).
BUFFER_BYTES = 16 * 1024 * 1024

#: Linux's SO_RCVBUFFORCE (asm-generic/socket.h), which Python's socket
#: module does not name: SO_RCVBUF past net.core.rmem_max, for CAP_NET_ADMIN.
SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33 if sys.platform == "linux" else None)

#: Datagrams read at most per batch (about what BUFFER_BYTES holds; reading
#: one costs ~2 us, handling one ~70 us).
MAX_BATCH = 16_384
#: Hosts handled per turn of the event loop.
CHUNK_HOSTS = 256
#: Linux's SO_MEMINFO (asm-generic/socket.h; None elsewhere) and, in the u32s
#: it returns (linux/sock_diag.h), the indices of the bytes the socket holds,
#: its buffer's size and the datagrams the kernel dropped on it.
SO_MEMINFO = 55 if sys.platform == "linux" else None
SK_MEMINFO_RMEM_ALLOC, SK_MEMINFO_RCVBUF, SK_MEMINFO_DROPS, SK_MEMINFO_VARS = 0, 1, 8, 9
#: Bytes read per datagram: more than any datagram of ours
#: (heartbeat_datagram.MAX_DATAGRAM), so a longer one shows as too long.
READ_BYTES = 2048

Reply = Callable[[bytes], None]
#: on_datagram(data, reply) -> True when the datagram was taken as its
#: host's heartbeat, False when it was refused (and counted).
OnDatagram = Callable[[bytes, Reply], bool]


def newest_per_host(batch: list[tuple[bytes, object]]) -> list[list[tuple[bytes, object]]]:
    """Group a batch of (datagram, sender), in arrival order, by the host
    each names: [each host's datagrams, highest counter first (the newest:
    UDP may reorder, and a replay may arrive last)], hosts in the order of
    their last arrival; a datagram naming no host (not ours) makes a group
    of its own, after them. Header fields are not authenticated yet: a
    forged high counter only puts a datagram that will not open first.
    Pure; O(len(batch)) when every host sends one datagram (the usual
    batch: no sort), O(len(batch) log len(batch)) at worst."""
    groups: dict[str, list[tuple[int, int, tuple[bytes, object]]]] = {}
    loose: list[list[tuple[bytes, object]]] = []
    for i, item in enumerate(batch):
        try:
            host, counter = named(item[0])
        except DatagramError:
            loose.append([item])
            continue
        group = groups.pop(host, None)  # (re-inserted: the dict keeps last arrivals' order)
        if group is None:
            groups[host] = [(counter, i, item)]
        else:
            group.append((counter, i, item))
            groups[host] = group
    ordered: list[list[tuple[bytes, object]]] = []
    for group in groups.values():
        if len(group) == 1:  # (a sort with a key costs ~1 us a host: at 10,000 hosts a
            ordered.append([group[0][2]])  # tenth of the controller's time)
        else:  # (counter, arrival): arrivals differ, so items are never compared
            group.sort(reverse=True)
            ordered.append([item for _, _, item in group])
    return ordered + loose


class DatagramEndpoint:
    """UDP on `host`:`port` (its first address that binds). Each host's
    newest datagram of a batch (highest counter) goes to
    `on_datagram(data, reply)`; if that refuses it, the host's next older
    one does, and so on (a forged datagram naming a host must not hide the
    host's own). `reply(bytes)` answers the datagram's sender (an answer the
    kernel cannot take at once is dropped, as the network might drop it).
    `on_superseded(n)` is told of the n datagrams of a host never handed on
    because a newer one of it was taken; `on_dropped(n)` of n datagrams the
    kernel dropped since the last read while the socket's buffer was at
    least half full (Linux: SO_MEMINFO; elsewhere never told). `await
    open()` binds it; `close()` stops it (idempotent)."""

    def __init__(self, host: str, port: int, on_datagram: OnDatagram,
                 on_superseded: Callable[[int], None] = lambda n: None,
                 on_dropped: Callable[[int], None] = lambda n: None) -> None:
        self.host, self.port = host, port
        self.on_datagram, self.on_superseded = on_datagram, on_superseded
        self.on_dropped = on_dropped
        self.sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drops: int | None = None  # the kernel's count at the last read (None: unknown)

    async def open(self) -> None:
        """Bind and start reading. Raises OSError when the address cannot
        be bound."""
        self._loop = asyncio.get_running_loop()
        error: OSError | None = None
        for family, kind, proto, _, address in await self._loop.getaddrinfo(
                self.host, self.port, type=socket.SOCK_DGRAM):
            sock = None
            try:
                sock = socket.socket(family, kind, proto)
                sock.setblocking(False)
                sock.bind(address)
                break
            except OSError as e:  # (the next address, as asyncio's own endpoint does)
                if sock is not None:
                    sock.close()
                error = e
        else:
            raise error or OSError(f"no address for {self.host!r}")
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
        self.sock = sock
        self._drops = self._kernel_drops()
        self._loop.add_reader(sock.fileno(), self._read_batch)

    def close(self) -> None:
        if self.sock is not None:
            self._loop.remove_reader(self.sock.fileno())
            self.sock.close()
            self.sock = None

    def _meminfo(self) -> tuple[int, int, int] | None:
        """(bytes the socket holds, its buffer's size, datagrams the kernel
        has dropped on it since it was made); None where SO_MEMINFO is not
        there."""
        if SO_MEMINFO is None:
            return None
        try:
            raw = self.sock.getsockopt(socket.SOL_SOCKET, SO_MEMINFO, 4 * SK_MEMINFO_VARS)
        except OSError:
            return None
        if len(raw) < 4 * SK_MEMINFO_VARS:
            return None
        values = struct.unpack_from(f"{SK_MEMINFO_VARS}I", raw)
        return (values[SK_MEMINFO_RMEM_ALLOC], values[SK_MEMINFO_RCVBUF],
                values[SK_MEMINFO_DROPS])

    def _kernel_drops(self) -> int | None:
        """Datagrams the kernel has dropped on the socket; None where it
        does not say."""
        info = self._meminfo()
        return None if info is None else info[2]

    def _read_batch(self) -> None:
        sock = self.sock
        if self._drops is not None:  # (one getsockopt a batch; the u32 count may wrap)
            info = self._meminfo()
            if info is not None and info[2] != self._drops:
                held, size, drops = info
                new, self._drops = (drops - self._drops) % (1 << 32), drops
                if 2 * held >= size:  # (a full buffer's drops, not bad checksums)
                    self.on_dropped(new)
                else:
                    log.debug("heartbeat socket: %d datagrams dropped, not for a full buffer",
                              new)
        batch: list[tuple[bytes, object]] = []
        while len(batch) < MAX_BATCH:
            try:
                batch.append(sock.recvfrom(READ_BYTES))
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:  # (ICMP for an earlier answer: the next read goes on)
                log.debug("heartbeat datagram socket: %s", e)
                break
        if not batch:
            return
        groups = [batch] if len(batch) == 1 else newest_per_host(batch)
        if len(groups) <= CHUNK_HOSTS:  # (the usual batch: handled now, reading goes on)
            self._handle(groups, 0, paused=False)
            return
        self._loop.remove_reader(sock.fileno())  # until this batch is handled
        self._handle(groups, 0, paused=True)

    def _handle(self, groups: list, start: int, paused: bool) -> None:
        if self.sock is None:
            return  # closed meanwhile
        end = min(start + CHUNK_HOSTS, len(groups))
        try:
            for group in groups[start:end]:
                for i, (data, sender) in enumerate(group):
                    try:
                        if self.on_datagram(data, self._reply_to(sender)):
                            if i < len(group) - 1:
                                self.on_superseded(len(group) - 1 - i)
                            break
                    except Exception:  # noqa: BLE001 - a bug must not end the endpoint
                        log.exception("heartbeat datagram from %s failed", sender)
        finally:  # (whatever escapes, the rest of the batch and the reader go on)
            if self.sock is not None and end < len(groups):
                self._loop.call_soon(self._handle, groups, end, paused)
            elif self.sock is not None and paused:
                self._loop.add_reader(self.sock.fileno(), self._read_batch)

    def _reply_to(self, sender) -> Reply:
        def reply(answer: bytes) -> None:
            if self.sock is None:
                return
            try:
                self.sock.sendto(answer, sender)
            except OSError as e:  # (a full send buffer: dropped, as on the way)
                log.debug("heartbeat ack to %s not sent: %s", sender, e)
        return reply
