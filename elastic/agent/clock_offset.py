"""How far the controller's clock is from this agent's, from its answers,
so that a heartbeat's send time is stamped on the controller's clock.

The controller reads how late heartbeats reach it (receipt minus send time:
elastic.controller.lag.ReceiptDelay) and judges silence against that
lateness. With send times on the agents' own clocks, a controller whose
clock runs ahead of the agents' would read the offset as its own lag: it
would wait that much longer before declaring a host lost, and defer idle
agents' registrations while it lasted.

So each ack, and the answer to a registration, says when the controller
read the request (`received_at`, its wall clock). A request sent at t1 and
answered at t4 (this agent's clock) was read at t2 (the controller's)
somewhere in between, so the offset (controller minus agent) lies within
[t2 - t4, t2 - t1]: the bounds NTP's intersection algorithm works with
(RFC 5905, §11.2.1; Marzullo). The agent intersects the bounds of its last
`WINDOW` samples and corrects by the smallest amount the intersection
allows: nothing when it contains 0 (clocks that agree, however long the
round trips), else its bound nearest 0. Not the midpoint of a round trip,
as NTP's offset is: a heartbeat that waited in the controller's queues —
the lag the controller means to measure — lengthens only the way there,
and a midpoint would hide half of it from the controller for as long as the
wait lasts; a bound moves only with the way it lies on. (With the
controller's clock ahead, the lower bound t2 - t4 holds the correction, and
waits on the way there leave it alone; with it behind, a wait can hide up
to the shortest one within the window, where uncorrected stamps hid all of
it.)

Samples whose bounds do not meet (a clock was stepped) leave the newest
alone. A session starts afresh (a new controller may keep another clock);
with a controller that says nothing, heartbeats carry the agent's own time,
as before.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable

#: Samples whose bounds are intersected.
WINDOW = 16
#: Heartbeats remembered for matching their acks (by seq).
REMEMBERED = 64


class ClockOffset:
    """The controller's clock minus this agent's (seconds), from the
    controller's answers. `wall` and `monotonic` are the agent's clocks
    (seconds)."""

    def __init__(self, wall: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.wall, self.monotonic = wall, monotonic
        self._sent: collections.OrderedDict[int, tuple[float, float]] = collections.OrderedDict()
        self._bounds: collections.deque[tuple[float, float]] = collections.deque(maxlen=WINDOW)

    def reset(self) -> None:
        """Forget every sample (a new session: perhaps another controller)."""
        self._sent.clear()
        self._bounds.clear()

    @property
    def offset_s(self) -> float | None:
        """The correction (seconds; None before the first sample): the point
        of the samples' common bounds nearest 0."""
        if not self._bounds:
            return None
        low, high = self._common()
        return min(max(0.0, low), high)

    def _common(self) -> tuple[float, float]:
        """(low, high): the intersection of the samples' bounds (seconds)."""
        return max(b[0] for b in self._bounds), min(b[1] for b in self._bounds)

    def now(self) -> tuple[float, float]:
        """(wall, monotonic) now: a request's send time, for `answered`."""
        return self.wall(), self.monotonic()

    def stamp(self, seq: int) -> float:
        """The send time to put in heartbeat `seq`, sent now: the
        controller's wall clock as far as it is known (seconds)."""
        wall, mono = self.now()
        self._sent[seq] = (wall, mono)
        while len(self._sent) > REMEMBERED:
            self._sent.popitem(last=False)
        offset = self.offset_s
        return wall if offset is None else wall + offset

    def acked(self, seq: int, received_at: float) -> None:
        """The ack of heartbeat `seq` arrived now, saying the controller read
        it at `received_at` (its wall clock; 0: a controller that does not
        say, ignored)."""
        sent = self._sent.pop(seq, None)
        if sent is not None:
            self.answered(sent, received_at)

    def answered(self, sent: tuple[float, float], received_at: float) -> None:
        """A request sent at `sent` (`now()` then) was answered now, the
        controller saying it read it at `received_at` (0, or not a finite
        number: not said, ignored): one sample. (The registration's answer
        gives a session its first.)"""
        t1, sent_mono = sent
        round_trip = self.monotonic() - sent_mono
        if not math.isfinite(received_at) or received_at <= 0 or round_trip < 0:
            return
        low, high = received_at - (t1 + round_trip), received_at - t1
        if self._bounds:
            common_low, common_high = self._common()
            if low > common_high or high < common_low:
                self._bounds.clear()  # (they do not meet: a clock was stepped)
        self._bounds.append((low, high))
