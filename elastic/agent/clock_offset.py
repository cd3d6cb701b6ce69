"""How far the controller's clock is from this agent's, from its heartbeat
acks, so that a heartbeat's send time is stamped on the controller's clock.

The controller reads how late heartbeats reach it (receipt minus send time:
elastic.controller.lag.ReceiptDelay) and judges silence against that
lateness. With send times on the agents' own clocks, a controller whose
clock runs ahead of the agents' would read the offset as its own lag: it
would wait that much longer before declaring a host lost, and defer idle
agents' registrations while it lasted. So each ack says when the controller
read the heartbeat (`HeartbeatAck.received_at`, its wall clock), and the
agent estimates the offset as NTP's on-wire protocol does (RFC 5905, §8):
for a heartbeat sent at t1 (agent) and read at t2 (controller), acked and
the ack received at t4 (agent), offset = t2 - (t1 + t4) / 2, exact when the
two ways take as long; the controller's hold between reading and acking is
in the round trip. As NTP's clock filter does, the estimate is that of the
sample with the shortest round trip among the last `WINDOW` (its error is
at most half that round trip): a heartbeat that waited in the controller's
queues, the lateness the controller means to measure, has a long round
trip and does not move the estimate. An old sample leaves the window, so a
step of either clock is followed within `WINDOW` acks.

A session's first sample comes from its registration (its answer says when
the controller read it: `RegisterResponse.received_at`), so its first
heartbeats are stamped too; a registration that waited long in a storm
gives a rough one, which the acks' shorter round trips replace. A session
starts afresh (a new controller may keep another clock); with a controller
that says nothing, heartbeats carry the agent's own time, as before.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

#: Acks whose shortest round trip gives the estimate.
WINDOW = 16
#: Heartbeats remembered for matching their acks (by seq).
REMEMBERED = 64


class ClockOffset:
    """The controller's clock minus this agent's (seconds), from heartbeat
    acks. `wall` and `monotonic` are the agent's clocks (seconds)."""

    def __init__(self, wall: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.wall, self.monotonic = wall, monotonic
        self._sent: collections.OrderedDict[int, tuple[float, float]] = collections.OrderedDict()
        self._samples: collections.deque[tuple[float, float]] = collections.deque(maxlen=WINDOW)

    def reset(self) -> None:
        """Forget every sample (a new session: perhaps another controller)."""
        self._sent.clear()
        self._samples.clear()

    @property
    def offset_s(self) -> float | None:
        """The estimate (seconds; None before the first ack)."""
        if not self._samples:
            return None
        return min(self._samples)[1]

    def stamp(self, seq: int) -> float:
        """The send time to put in heartbeat `seq`, sent now: the
        controller's wall clock as far as it is known (seconds)."""
        wall, mono = self.now()
        self._sent[seq] = (wall, mono)
        while len(self._sent) > REMEMBERED:
            self._sent.popitem(last=False)
        offset = self.offset_s
        return wall if offset is None else wall + offset

    def now(self) -> tuple[float, float]:
        """(wall, monotonic) now: a request's send time, for `answered`."""
        return self.wall(), self.monotonic()

    def acked(self, seq: int, received_at: float) -> None:
        """The ack of heartbeat `seq` arrived now, saying the controller read
        it at `received_at` (its wall clock; 0: a controller that does not
        say, ignored)."""
        sent = self._sent.pop(seq, None)
        if sent is not None:
            self.answered(sent, received_at)

    def answered(self, sent: tuple[float, float], received_at: float) -> None:
        """A request sent at `sent` (`now()` then) was answered now, the
        controller saying it read it at `received_at` (0: not said, ignored):
        one sample. (The registration's answer gives a session its first.)"""
        t1, sent_mono = sent
        round_trip = self.monotonic() - sent_mono
        if received_at <= 0 or round_trip < 0:
            return
        self._samples.append((round_trip, received_at - (t1 + round_trip / 2)))
