"""Let gRPC's asyncio wake-ups keep up with a busy event loop.

grpcio's asyncio stack (1.85, and its main branch as of 2026-11) hands gRPC
core's completions to the event loop through a socket pair: its poller
thread queues each completion and writes one byte to the pair; the loop's
reader callback (`PollerCompletionQueue._handle_events`) reads one byte and
handles every completion queued. When completions come faster than the loop
turns, the unread bytes pile up. Each one-byte write takes about 768 bytes
of the pair's send buffer (212,992 bytes by default on Linux), so after
about 277 unread bytes the poller thread blocks in write(), and from then on
one completion gets through per turn of the loop: for every call of the
process at once (reads, writes, new calls, answers). At 10,000 agents
(bench/scale.py, 2026-11-26, `ss -x` every 5 s) the controller's pair held
200 or more unread bytes in 26 of 88 samples, up to 278, while streams
waited tens of seconds to be taken up and, in other runs, gRPC answered
nothing for minutes after a start.

`drain_wakeups(loop)` wraps that reader callback: it reads the unread bytes
but KEEP_UNREAD, then lets gRPC's callback read one and handle the queue.
A completion is queued before its byte is written, so every completion
whose byte was read is in the queue that call handles: none is left
waiting, and the poller thread, far from its ~277, no longer blocks. The
bytes kept are spares: should gRPC's callback raise halfway through its
queue (a completion for another, closed loop), they wake it again for the
rest, as every byte does without the wrapper. The cost: one turn of
the loop now handles every completion that is ready, so under heavy gRPC
traffic a turn takes longer (the blocked thread throttled gRPC instead).
Measured with bench/scale.py (2026-11-26, one run each way): at 7,500
agents registration took 91.9 s instead of 139.4 s, heartbeat latency p50
7.6 ms instead of 220.8 ms, and no host was falsely lost instead of 3.
"""

from __future__ import annotations

import asyncio
import fcntl
import functools
import os
import struct
import termios

_GRPC_READER = ("PollerCompletionQueue", "_handle_events")
#: Wake-up bytes left unread at each turn (see the module's docstring).
KEEP_UNREAD = 32


def drain_wakeups(loop: asyncio.AbstractEventLoop) -> bool:
    """Wrap gRPC's wake-up reader on `loop` (a selector event loop, after
    gRPC's asyncio stack has started on it: a server or channel made).
    Returns True if it is wrapped (now or before), False if no such reader
    is registered on `loop` (no asyncio gRPC object yet, another loop
    class, or another grpcio layout: nothing is changed)."""
    selector = getattr(loop, "_selector", None)
    if selector is None:
        return False
    for key in list(selector.get_map().values()):
        reader = key.data[0] if isinstance(key.data, tuple) else None
        callback = getattr(reader, "_callback", None)
        if getattr(callback, "drains_wakeups", False):
            return True
        # (grpcio 1.85 registers functools.partial(queue._handle_events, loop))
        method = callback.func if isinstance(callback, functools.partial) else callback
        owner = getattr(method, "__self__", None)
        if (type(owner).__name__, getattr(method, "__name__", "")) != _GRPC_READER:
            continue
        loop.remove_reader(key.fd)
        loop.add_reader(key.fd, _drain_then(key.fd, callback))
        return True
    return False


def _drain_then(fd: int, handle_events):
    """A reader callback for `fd` that reads its unread bytes but
    KEEP_UNREAD, then calls gRPC's `handle_events` (which reads one). (A
    loop in another thread may read the same socket meanwhile: then there
    is less to read, or nothing.)"""
    def drain_then_handle() -> None:
        unread = struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]
        if unread > KEEP_UNREAD:
            try:
                os.read(fd, unread - KEEP_UNREAD)
            except BlockingIOError:
                pass
        handle_events()

    drain_then_handle.drains_wakeups = True
    return drain_then_handle
