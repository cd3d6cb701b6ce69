"""Progress reports from a worker to its agent: one small datagram per
report on a Unix datagram socket in the abstract namespace.

Sending never blocks: when the agent is slow and the socket buffer is full
(Linux queues `net.unix.max_dgram_qlen` datagrams, 10 on these machines),
or the agent is gone, the report is dropped (the next one carries the newer
step; heartbeats carry the latest). Measured cost: a few microseconds per
report, far under 1 % of a training step. What no later report carries is
not dropped: an event that finds the socket full goes to a thread that
waits for room; `failing()` waits for room itself; and at the end,
`close()` sends the last step and committed step again and waits (at most
FLUSH_S each) for room.

An abstract socket has no file permissions and its name is listed in
/proc/net/unix for every local user, so the agent's end (`ProgressReceiver`)
asks the kernel for each sender's uid (SO_PASSCRED) and keeps only reports
from its own user: the one its workers run as.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import socket
import struct
import threading
from collections.abc import Callable

log = logging.getLogger("elastic-agent")

#: How long (seconds) `ProgressReporter.close` and `.failing` wait for room
#: in the agent's socket for each of the reports that must not be dropped.
FLUSH_S = 2.0

#: A worker's judgement of its failure (elastic.worker.failure_cause): its
#: own error, or a collective failing under it because a peer failed.
FAILURES = ("own", "peer")


def socket_address(text: str) -> str:
    """"@name" (how the address travels in an environment variable) -> the
    abstract socket address "\\0name"; other text is a filesystem path."""
    return "\0" + text[1:] if text.startswith("@") else text


@dataclasses.dataclass(frozen=True)
class Report:
    """One datagram: a step (with metrics), a committed step, an event, or
    a failure (`failure`: one of FAILURES, the worker's judgement of why it
    is failing)."""

    generation: int
    step: int | None = None
    committed_step: int | None = None
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    event: str | None = None
    reason: str = ""
    fields: dict = dataclasses.field(default_factory=dict)
    failure: str | None = None

    def encode(self) -> bytes:
        body: dict = {"g": self.generation}
        for key, value in (("s", self.step), ("c", self.committed_step), ("e", self.event),
                           ("x", self.failure)):
            if value is not None:
                body[key] = value
        if self.metrics:
            body["m"] = self.metrics
        if self.event:
            body["r"], body["f"] = self.reason, self.fields
        return json.dumps(body, separators=(",", ":")).encode()


def decode(data: bytes) -> Report:
    """Parse a datagram. Raises ValueError on a malformed one."""
    try:
        body = json.loads(data)
        report = Report(generation=body["g"], step=body.get("s"), committed_step=body.get("c"),
                        metrics={str(k): float(v) for k, v in body.get("m", {}).items()},
                        event=body.get("e"), reason=str(body.get("r", "")),
                        fields=dict(body.get("f", {})), failure=body.get("x"))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"bad progress report {data[:100]!r}: {e}") from None
    if not isinstance(report.generation, int):
        raise ValueError(f"bad progress report {data[:100]!r}: generation")
    if report.failure is not None and report.failure not in FAILURES:
        raise ValueError(f"bad progress report {data[:100]!r}: failure")
    return report


class ProgressReporter:
    """Reports steps and committed checkpoint steps of one generation.

    address: the agent's socket ("@name" or a path); None makes every call a
    no-op (a program run outside an agent).
    """

    def __init__(self, address: str | None, generation: int) -> None:
        self.generation = generation
        self.dropped = 0
        # the latest step and committed-step reports, sent again at close()
        self._last: dict[str, bytes] = {}
        self._address = socket_address(address) if address else None
        self._sock = None
        # events that found the socket full, and the thread sending them
        self._backlog: collections.deque[bytes] = collections.deque()
        self._backlog_lock = threading.Lock()
        self._backlog_sender: threading.Thread | None = None
        if self._address:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.setblocking(False)

    def _send(self, payload: bytes) -> None:
        sock = self._sock  # (once: the snapshot writer's thread sends too, and close() clears it)
        if sock is None:
            return
        try:
            sock.sendto(payload, self._address)
        except OSError:  # buffer full, agent gone: never block training
            self.dropped += 1

    def step(self, step: int, **metrics: float) -> None:
        """Step `step` (an integer, counted from 0) finished; optional scalar
        metrics (e.g. loss=2.31) travel with it to `elasticd status`."""
        self._last["step"] = Report(self.generation, step=step,
                                    metrics={k: float(v) for k, v in metrics.items()}).encode()
        self._send(self._last["step"])

    def committed(self, step: int) -> None:
        """The checkpoint of step `step` is committed (complete on storage).
        Never blocks, and not dropped for a full socket: as an event, it
        waits for room in a thread of its own, up to FLUSH_S (no later
        report carries it, and a grow or a preemption drain waits on it;
        close() sends the latest again)."""
        self._last["committed"] = Report(self.generation, committed_step=step).encode()
        self._send_or_queue(self._last["committed"])

    def event(self, kind: str, reason: str, **fields) -> None:
        """Something for the job's journal (kind must be one the controller
        accepts: elastic.policy.view.WORKER_EVENT_KINDS). Never blocks; unlike
        a step report, an event that finds the agent's socket full is not
        dropped but sent by a thread of its own, waiting up to FLUSH_S for
        room: events are few, and each is the only one of its kind (the
        journal's record of a save, the startup phases, the snapshot a
        buddy is to copy)."""
        self._send_or_queue(Report(self.generation, event=kind, reason=reason,
                                   fields=fields).encode())

    def _send_or_queue(self, payload: bytes) -> None:
        """Send `payload` now, or, the agent's socket full, from the backlog thread."""
        sock = self._sock
        if sock is None:
            return
        try:
            sock.sendto(payload, self._address)
        except BlockingIOError:  # (the agent is behind)
            with self._backlog_lock:
                self._backlog.append(payload)
                if self._backlog_sender is None:
                    self._backlog_sender = threading.Thread(
                        target=self._send_backlog, name="elastic-progress-events", daemon=True)
                    self._backlog_sender.start()
        except OSError:  # (the agent is gone)
            self.dropped += 1

    def _send_backlog(self) -> None:
        while True:
            with self._backlog_lock:
                if not self._backlog:
                    self._backlog_sender = None
                    return
                payload = self._backlog.popleft()
            self._send_waiting([payload], FLUSH_S)

    def failing(self, cause: str, flush_s: float = FLUSH_S) -> None:
        """Tell the agent this worker is failing and why (`cause`: "own" or
        "peer", see FAILURES), waiting up to `flush_s` seconds for room: the
        controller blames the host of a worker failing by itself before the
        peers failing with it, whichever exit it hears of first. Raises
        ValueError for another cause."""
        if cause not in FAILURES:
            raise ValueError(f"failure cause {cause!r}: expected one of {FAILURES}")
        if self._sock is not None:
            self._send_waiting([Report(self.generation, failure=cause).encode()], flush_s)

    def close(self, flush_s: float = FLUSH_S) -> None:
        """Send the latest step and committed-step reports again, each
        waiting up to `flush_s` seconds for room in the agent's socket (on a
        socket of its own: the only sends that may block, at the end of
        training, where the report of where it ended must not be the one
        dropped), then close. Reports sent after this are no-ops."""
        if self._sock is None:
            return
        self._sock.close()
        self._sock = None
        sender = self._backlog_sender
        if sender is not None:  # (the events first: a worker_finishing, say)
            sender.join(flush_s)
        self._send_waiting(list(self._last.values()), flush_s)

    def _send_waiting(self, payloads: list[bytes], flush_s: float) -> None:
        if not payloads:
            return
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as flush:
            flush.settimeout(flush_s)
            for payload in payloads:
                try:
                    flush.sendto(payload, self._address)
                except OSError:  # (the agent is gone, or still behind after flush_s)
                    self.dropped += 1


def sender_uid(ancillary: list[tuple[int, int, bytes]]) -> int | None:
    """The sender's uid from a datagram's ancillary data (SCM_CREDENTIALS,
    `struct ucred` = pid, uid, gid), None if the kernel attached none."""
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(data) >= 12:
            return struct.unpack("iII", data[:12])[1]
    return None


class ProgressReceiver:
    """The agent's end of the progress socket: bound at `address` ("@name"
    or a path), it calls `on_datagram(data)` for each datagram sent by a
    process of this user and drops (and counts in `dropped`) the others'.
    `attach(loop)` starts receiving on an asyncio loop; `close()` ends it.
    Raises OSError from the constructor when the address is taken."""

    _UCRED = socket.CMSG_SPACE(struct.calcsize("iII"))

    def __init__(self, address: str, on_datagram: Callable[[bytes], None]) -> None:
        self.on_datagram = on_datagram
        self.uid = os.geteuid()
        self.dropped = 0
        self._loop = None
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(socket_address(address))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.setblocking(False)

    def attach(self, loop) -> None:
        self._loop = loop
        loop.add_reader(self.sock.fileno(), self.receive)

    def receive(self) -> None:
        """Take every datagram waiting now."""
        while True:
            try:
                data, ancillary, _, _ = self.sock.recvmsg(65536, self._UCRED)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                log.warning("progress socket: %s", e)
                return
            uid = sender_uid(ancillary)
            if uid != self.uid:
                self.dropped += 1
                if self.dropped == 1 or self.dropped % 1000 == 0:
                    log.warning("dropped %d progress report(s) from uid %s: only this agent's "
                                "user (uid %d) may report", self.dropped, uid, self.uid)
                continue
            self.on_datagram(data)

    def close(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self.sock.fileno())
        self.sock.close()
