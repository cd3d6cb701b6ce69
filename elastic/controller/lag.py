"""How far behind the controller itself is: its event loop's lag.

Every message, timer and decision of the controller runs on one asyncio
loop. When it has more work than one core does (thousands of agents
registering at once, a burst of reports, CPU starvation, a SIGSTOP or a
suspended VM), a callback that became ready waits: a heartbeat that arrived
on time is read late. Judging a host's silence against `heartbeat_timeout_s`
alone then declares healthy hosts lost for heartbeats the controller has not
read yet, which restarts the slice and adds a storm of re-registrations to
the overload. So the controller measures its own lag, as Node.js and
asyncio's debug mode do (how late a timer fires), and the policy judges
silence against `heartbeat_timeout_s + lag` (ClusterView.lag_s).

Two measures: the loop's own lateness, and how late heartbeats reach it
(ReceiptDelay: messages can also wait in gRPC's core, unseen by the loop);
and heartbeats the kernel dropped on the full socket count as lag of
their own (ReceiveDrops).
A probe task sleeps PROBE_S and records how much later than asked it woke;
the reconcile loop records its own wake-lateness too (it may run before the
probe after a pause). Two kinds of lateness:
- lag (up to PAUSE_S): the loop runs but behind. `allowance_s` is the
  largest lag within a window (the heartbeat timeout), added to every
  silence limit: a dead host is still found, `allowance_s` later.
- a pause (over PAUSE_S at one wake): the loop did not run at all (SIGSTOP,
  a suspended VM, starvation). Agents that heard nothing from it meanwhile
  may have closed their streams to look for another controller, so what
  follows a pause is not judged by the allowance but forgiven: `note`
  returns the seconds of the pause not forgiven before (the probe and the
  loop both see one pause), and the caller moves the hosts' silence clocks
  forward by them (ClusterView.forgive_pause). A loop over PAUSE_S late at
  every wake counts as paused each time: detection slows down rather than
  restarting a healthy slice for a controller far beyond its capacity.
"""

from __future__ import annotations

import asyncio
import collections
import itertools

from elastic.clock import Clock

#: Seconds between probes.
PROBE_S = 0.1
#: Lateness below this is noise (a pass, GC), not lag (seconds).
NOISE_S = 0.05
#: Lateness at one wake above which the controller counts itself paused
#: (seconds; a pass, a burst of messages and GC stay well below).
PAUSE_S = 2.0


class LoopLag:
    """Samples of the controller loop's lateness (seconds, at controller-
    monotonic times), kept for `window_s` seconds."""

    def __init__(self, clock: Clock, window_s: float) -> None:
        self.clock = clock
        self.window_s = window_s
        self._samples: collections.deque[tuple[float, float]] = collections.deque()
        #: The largest lateness ever noted (seconds).
        self.worst_s = 0.0
        # the end of the latest pause (controller-monotonic seconds)
        self._paused_until = float("-inf")

    def note(self, lateness_s: float, at: float, can_pause: bool = True) -> float:
        """Record that a wake-up due at `at - lateness_s` came at `at` (or,
        with `can_pause` False, a lag measured otherwise: never a pause).
        Returns the seconds of a pause (lateness over PAUSE_S) that no
        earlier note covered, for the caller to forgive; else 0.0."""
        if lateness_s < NOISE_S:
            return 0.0
        self.worst_s = max(self.worst_s, lateness_s)
        if lateness_s > PAUSE_S and can_pause:
            new_s = at - max(at - lateness_s, self._paused_until)
            self._paused_until = max(self._paused_until, at)
            return new_s if new_s >= NOISE_S else 0.0
        # keep the deque decreasing in lateness: an older, smaller sample can
        # never be the window's maximum again (a monotonic queue, O(1) amortised)
        while self._samples and self._samples[-1][1] <= lateness_s:
            self._samples.pop()
        self._samples.append((at, lateness_s))
        return 0.0

    def allowance_s(self, now: float, window_s: float | None = None) -> float:
        """The largest lateness recorded within the last `window_s` seconds
        (default: the window given at construction) before `now`; 0.0 if
        none."""
        horizon = now - (self.window_s if window_s is None else window_s)
        while self._samples and self._samples[0][0] < now - self.window_s:
            self._samples.popleft()
        return next((late for at, late in self._samples if at >= horizon), 0.0)

    async def probe(self, on_pause) -> None:
        """Sleep PROBE_S at a time and note the lateness; a pause's new
        seconds go to `on_pause(pause_s, now)`. Runs until cancelled."""
        while True:
            due = self.clock.monotonic() + PROBE_S
            await asyncio.sleep(PROBE_S)
            now = self.clock.monotonic()
            pause_s = self.note(now - due, now)
            if pause_s:
                on_pause(pause_s, now)


class ReceiptDelay:
    """How late heartbeats reach the controller's code: the lag its event
    loop cannot see (messages queued in gRPC's core and the kernel while
    its I/O thread works through a storm of TLS handshakes, say).

    Each heartbeat carries its send time on the controller's clock as its
    agent estimates it from earlier acks (elastic.agent.clock_offset; on
    the agent's own clock before the first estimate, or from an agent that
    makes none): receipt - send is its delay, whatever the clocks' offset. `recent_s` is the median of the heartbeats
    received in the last second, over at least MIN_SAMPLES of them: how late
    the typical heartbeat is read now. A few hosts with wrong clocks do not
    move a median. (A per-host baseline kept here, the least delay each host
    ever showed, would also remove offsets, but in a storm a host's first
    heartbeats are already late, and its baseline with them; the agents'
    correction moves only by what round trips prove, and a wait on the way
    to the controller proves nothing about its clock.)"""

    MIN_SAMPLES = 3
    #: Heartbeats (the latest within the window) whose median is the delay.
    MEDIAN_OF = 512

    def __init__(self, keep: int = 4096) -> None:
        self._recent: collections.deque[tuple[float, float, str | None]] = \
            collections.deque(maxlen=keep)
        #: when (wall-clock seconds) the controller last resumed from a pause
        self.resumed_at = float("-inf")

    def latencies(self) -> list[float]:
        """The delays (seconds) of the last `keep` heartbeats, oldest first
        (for `elasticd status`'s percentiles)."""
        return [latency for _, latency, _ in self._recent]

    def note(self, latency_s: float, at: float, host: str | None = None) -> None:
        """A heartbeat of `host` received at `at` (controller-monotonic
        seconds), `latency_s` after its send time (seconds). O(1): it runs
        for every heartbeat."""
        self._recent.append((at, latency_s, host))

    def heard(self, sent_at: float, received_at: float, at: float, host: str | None = None
              ) -> float | None:
        """A heartbeat sent at `sent_at` (on this controller's wall clock as
        its agent estimates it, elastic.agent.clock_offset) and received at
        `received_at` (controller's wall clock) and `at` (its monotonic
        clock): its delay (seconds), noted; None when it tells nothing
        (no send time, or sent before the controller resumed from a pause:
        it waited for the controller to run again, which `resumed` forgave,
        and would otherwise read as lag for a second after)."""
        if not sent_at or sent_at < self.resumed_at:
            return None
        self.note(received_at - sent_at, at, host)
        return received_at - sent_at

    def resumed(self, at: float) -> None:
        """The controller runs again at `at` (wall-clock seconds) after a
        pause (elastic.controller.core: controller_paused)."""
        self.resumed_at = at

    def recent_s(self, now: float, window_s: float = 1.0) -> float:
        """The (lower) median delay (seconds, 0.0 if negative) of the heartbeats
        received within `window_s` before `now`, the latest MEDIAN_OF of them
        at most; 0.0 with fewer than MIN_SAMPLES. (Every pass asks: sorting
        all of a second's heartbeats took 5.4 % of the controller's samples
        in a 5,000-agent bench/scale.py run under py-spy on 2026-11-26, the
        latest 512 2.1 %; they tell the typical delay as well, at a cost
        that does not grow with the hosts.) Of a host's heartbeats there,
        only its latest counts: a stream cut by a partition delivers all it
        queued at once when the link heals, each as late as it waited, and
        one host's backlog, the network's delay, made the controller judge
        itself 10 s behind and turn that very host's registration away
        (tests/test_isolation.py, 2026-11-29); its latest heartbeat is read
        as soon as it was sent. The count of heartbeats, all of them, must
        reach MIN_SAMPLES."""
        horizon = now - window_s
        recent = list(itertools.islice(
            itertools.takewhile(lambda r: r[0] >= horizon, reversed(self._recent)),
            self.MEDIAN_OF))
        if len(recent) < self.MIN_SAMPLES:
            return 0.0
        seen: set[str] = set()
        delays = []
        for _, delay, host in recent:  # (newest first)
            if host is None or host not in seen:
                delays.append(delay)
                if host is not None:
                    seen.add(host)
        delays.sort()
        # (the lower median: of two hosts, one late one does not decide)
        return max(0.0, delays[(len(delays) - 1) // 2])


class LagPromises:
    """The lag (seconds) this controller told agents in its heartbeat
    acks, each kept until the moment it was promised for.

    An agent adds the lag its latest ack reported to its patience before it
    moves its heartbeats from datagrams to its stream
    (elastic.agent.datagrams), so the controller must keep judging that
    host's silence against at least that lag until the agent's stream
    heartbeat can have come: the samples behind `LoopLag.allowance_s` age
    out after one heartbeat timeout, sooner than that. `floor(now)` is the
    largest lag still promised. A monotonic queue: O(1) amortised."""

    def __init__(self) -> None:
        self._promises: collections.deque[tuple[float, float]] = collections.deque()

    def promise(self, lag_s: float, until: float) -> None:
        """`lag_s` was told to an agent and holds until `until`
        (controller-monotonic seconds). A promise must not end before a
        smaller one made earlier (as `Controller.promise_lag` makes them:
        now + a constant + the lag), which it replaces."""
        if lag_s <= 0:
            return
        # a promise both smaller and shorter than the new one never counts again
        while self._promises and self._promises[-1][1] <= lag_s:
            self._promises.pop()
        self._promises.append((until, lag_s))

    def floor(self, now: float) -> float:
        """The largest lag promised until `now` or later; 0.0 if none."""
        while self._promises and self._promises[0][0] < now:
            self._promises.popleft()
        return self._promises[0][1] if self._promises else 0.0


class ReceiveDrops:
    """Heartbeats the kernel dropped because the controller's socket was
    full: never read, so not silence of their hosts. Which hosts lost
    datagrams is unknown (the kernel counts them per socket), and the
    endpoint sees drops only when it reads, which a controller this busy
    does seldom; so until `hold_s` (a heartbeat timeout) after the last drop
    seen any host may have lost its heartbeats, and `lag_s(at)` is `hold_s`,
    added to every silence limit (ClusterView.lag_s) beside the loop's own
    lag. A dead host is still found, within about twice the timeout. Unlike
    the loop's lag it is not told to agents in acks (their datagrams being
    dropped, they should move to their streams as soon as ever) and does not
    defer registrations (elastic.controller.admission).

    `dropped(n, at)` notes `n` drops seen at `at` (controller-monotonic
    seconds). `total` counts every drop."""

    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s
        self.total = 0
        self._last = float("-inf")

    def dropped(self, n: int, at: float) -> None:
        if n > 0:
            self._last, self.total = max(self._last, at), self.total + n

    def lag_s(self, at: float) -> float:
        """`hold_s` within `hold_s` of the last drop seen before `at`; else 0.0."""
        return self.hold_s if 0.0 <= at - self._last <= self.hold_s else 0.0
