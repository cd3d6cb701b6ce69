"""Heartbeats as UDP datagrams, sealed with a key per registration.

Why: at scale a heartbeat on the agent's gRPC stream is the controller's
dearest recurring cost. Measured with `bench/scale.py` (2,000 agents, TLS,
2026-11-26): the controller used 55 % of a core, most of it gRPC reading
the streams and writing the acks, not deciding. A datagram costs a
`recvfrom`, an AES-GCM open and a protobuf parse. So the periodic
heartbeats go as datagrams when the controller offers a port; everything
else (registration, reports, commands, and heartbeats sent because
something changed) stays on the mutually authenticated stream. Liveness
over UDP with the stream for state is how SWIM-style membership (Das et
al., DSN 2002; HashiCorp memberlist) keeps a failure detector cheap.

Security: the key (16 random bytes, AES-128-GCM) is made by the controller
for one registration and sent in its RegisterResponse, over the mutual-TLS
channel whose certificate names the host. Only that agent and the
controller know it, so a datagram that opens under it was sealed by one of
them: nobody else on the network can speak for the host, read what it says,
or forge the controller's acks, starts and stops (these go this way first,
their stream copies later where needed: elastic.controller.executor). Each
direction has its own counter, the GCM nonce (never reused under one key)
and the replay check (a counter must be higher than every counter accepted
before). The header (magic, direction, host id, counter) is authenticated
as associated data.

Frame: b"EHB1" | direction (1 byte) | host-id length (1 byte) | host id
(UTF-8) | counter (8 bytes, big-endian) | ciphertext and 16-byte tag. The
plaintext is a serialized AgentMessage (a heartbeat, to the controller)
or ControllerMessage (an ack, a start or a stop, to the agent).
"""

from __future__ import annotations

import os
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

MAGIC = b"EHB1"
#: Directions: they keep the two sides' nonces apart under one key.
TO_CONTROLLER, TO_AGENT = 1, 2
KEY_BYTES = 16
TAG_BYTES = 16
#: The largest datagram either side sends or accepts (bytes): under the
#: 1,280 bytes IPv6 guarantees to carry unfragmented. A heartbeat that
#: would not fit (a long stderr tail) goes on the stream.
MAX_DATAGRAM = 1200
_COUNTER = struct.Struct(">Q")
_HEADER_BYTES = len(MAGIC) + 2 + _COUNTER.size  # and the host id


#: A heartbeat is acked when the last ack that way is this fraction of the
#: heartbeat timeout old (the stream's acks and the datagrams' each).
ACK_EVERY = 0.25


def patience_s(interval_s: float, timeout_s: float) -> float | None:
    """How long (seconds) an agent waits for an ack of its heartbeat
    datagrams before it heartbeats on its stream again, or None when the
    timings leave no safe value (then it heartbeats on its stream only).

    A healthy path leaves a datagram unacked for up to an ack interval
    (ACK_EVERY of `timeout_s`) and a heartbeat interval: patience must be
    longer. When datagrams stop arriving, the controller goes without a
    heartbeat for up to patience + 2 intervals (the last one it heard came an
    interval before the first unacked one; the agent gives up only at a
    beat): that must stay half an interval inside the timeout. So patience
    is an ack interval and two heartbeats, capped at the timeout minus 2.5
    intervals; datagrams need `timeout_s` > ~4.7 x `interval_s` (5 s and
    1 s by default: patience 2.5 s). An agent waits the lag its latest
    ack reported on top; the controller judges silence against that lag too
    for as long (elastic.controller.lag.LagPromises)."""
    needed = ACK_EVERY * timeout_s + interval_s
    patience = min(needed + interval_s, timeout_s - 2.5 * interval_s)
    return patience if patience > needed else None


class DatagramError(ValueError):
    """A datagram that is not one of ours, or does not open under the key."""


def new_key() -> bytes:
    """A fresh random key for one registration (KEY_BYTES bytes)."""
    return os.urandom(KEY_BYTES)


def _header(direction: int, host_id: bytes, counter: int) -> bytes:
    return MAGIC + bytes((direction, len(host_id))) + host_id + _COUNTER.pack(counter)


def _nonce(direction: int, counter: int) -> bytes:
    return bytes((direction, 0, 0, 0)) + _COUNTER.pack(counter)


def host_of(datagram: bytes) -> str:
    """The host id a datagram names (not yet authenticated: only to find
    its key). Raises DatagramError when it is not a datagram of ours."""
    return named(datagram)[0]


def named(datagram: bytes) -> tuple[str, int]:
    """(host id, counter) as a datagram's header says, not yet
    authenticated: to find its key, and to try a host's datagrams highest
    counter first. Raises DatagramError when it is not a datagram of ours."""
    if len(datagram) > MAX_DATAGRAM or len(datagram) < len(MAGIC) + 2 or \
            not datagram.startswith(MAGIC):
        raise DatagramError("not a heartbeat datagram")
    length = datagram[len(MAGIC) + 1]
    end = len(MAGIC) + 2 + length
    if len(datagram) < end + _COUNTER.size + TAG_BYTES:
        raise DatagramError("truncated heartbeat datagram")
    try:
        host = datagram[len(MAGIC) + 2:end].decode()
    except UnicodeDecodeError:
        raise DatagramError("heartbeat datagram with an undecodable host id") from None
    return host, _COUNTER.unpack_from(datagram, end)[0]


class DatagramChannel:
    """One registration's datagrams, seen from one side: `sends` is the
    direction it sends (TO_CONTROLLER for the agent, TO_AGENT for the
    controller); it opens only datagrams of the other direction.

    `seal(payload)` numbers and seals a payload; `open(datagram)` returns
    the payload of an authentic datagram for this host whose counter is
    above every counter it accepted before. Not thread-safe (each side
    uses it from its event loop)."""

    def __init__(self, key: bytes, host_id: str, sends: int) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"a heartbeat key has {KEY_BYTES} bytes, not {len(key)}")
        self.key, self.host_id, self.sends = key, host_id, sends
        self.receives = TO_AGENT if sends == TO_CONTROLLER else TO_CONTROLLER
        self._name = host_id.encode()
        if not 0 < len(self._name) < 256:
            raise ValueError(f"host id {host_id[:64]!r}: need 1 to 255 bytes")
        self._aead = AESGCM(key)
        self.sent = 0      # the counter of the last datagram sealed
        self.received = 0  # the highest counter accepted

    def seal(self, payload: bytes) -> bytes:
        """The next datagram carrying `payload`. Raises ValueError when it
        would be longer than MAX_DATAGRAM bytes (send it another way)."""
        if _HEADER_BYTES + len(self._name) + len(payload) + TAG_BYTES > MAX_DATAGRAM:
            raise ValueError(f"a datagram of {len(payload)} payload bytes is longer than "
                             f"{MAX_DATAGRAM} bytes")
        self.sent += 1
        header = _header(self.sends, self._name, self.sent)
        return header + self._aead.encrypt(_nonce(self.sends, self.sent), payload, header)

    def open(self, datagram: bytes) -> bytes:
        """The payload of `datagram`. Raises DatagramError when it is
        malformed, names another host, travels the other way, does not
        open under the key (forged or altered), or is not newer than every
        datagram accepted before (replayed, or overtaken by a newer one)."""
        if host_of(datagram) != self.host_id:
            raise DatagramError(f"heartbeat datagram not for host {self.host_id!r}")
        if datagram[len(MAGIC)] != self.receives:
            raise DatagramError("heartbeat datagram travelling the other way")
        end = len(MAGIC) + 2 + len(self._name)
        (counter,) = _COUNTER.unpack_from(datagram, end)
        header = datagram[:end + _COUNTER.size]
        try:
            payload = self._aead.decrypt(_nonce(self.receives, counter),
                                         datagram[len(header):], header)
        except (InvalidTag, ValueError):
            raise DatagramError(f"heartbeat datagram of host {self.host_id[:64]!r} does not "
                                f"open under its key") from None
        if counter <= self.received:
            raise DatagramError(f"heartbeat datagram {counter} of host {self.host_id[:64]!r} "
                                f"is not newer than {self.received}")
        self.received = counter
        return payload
