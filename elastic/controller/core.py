"""The controller: observed view, slice state and the level-triggered
reconcile loop. The servicer calls `submit`; `run` decides and executes."""

from __future__ import annotations

import asyncio
import logging

from elastic.clock import Clock
from elastic.config import JobSpec
from elastic.controller.executor import Executor
from elastic.controller.journal import JournalTail, JournalWriter
from elastic.controller.lag import LagPromises, LoopLag, ReceiptDelay, ReceiveDrops
from elastic.policy import failure_history
from elastic.policy.adopt import Inherited
from elastic.policy.failure_history import FailureHistory
from elastic.policy.decide import Phase, SliceState, decide
from elastic.policy.state import forgive_pause
from elastic.policy.view import ClusterView, Event, observe

log = logging.getLogger("elasticd")

#: The least gap between two reconcile passes, in multiples of the last
#: pass's duration (at 10,000 hosts a pass takes tens of milliseconds; with
#: a few hosts, a fraction of one).
PASS_SPACING = 2.0
#: A pass's duration counts at most this much (seconds) for the spacing and
#: the ticks: one that took longer was paused or starved (SIGSTOP, a
#: suspended VM), not slow, and must not hold back the next decisions.
PASS_COST_CAP_S = 0.2
#: When the job ends, the controller reads on for at most this long
#: (seconds, in all) until every session open then has delivered what its
#: agent queued while no controller listened (a controller that came back
#: after the workers finished ends the job the instant they register: their
#: restores and startup phases would never reach the journal otherwise).
#: Agents still reconnecting then are not waited for.
HEAR_OUT_S = 2.0
#: How often (seconds) it looks while it reads on.
HEAR_OUT_POLL_S = 0.02


class Controller:
    """One job's controller.

    tick_s: the longest time between two reconcile passes (seconds) on a
      small slice; a lost host is noticed within heartbeat_timeout_s + tick_s.
      (With thousands of hosts the gap grows to 7x the time a pass takes, at
      most 1.4 s: PASS_SPACING and PASS_COST_CAP_S.)
    initial_generation: the last generation a previous controller of this
      job started (from its journal), so generations never repeat.
    known_step: the highest step the job had reached before this
      controller started (its journal, its checkpoint directory; -1 if
      none): where the plausibility of reported steps starts.
    inherited: the generation the journal says was still running (see
      elastic.policy.adopt): the controller adopts it if its agents agree.
    run_id: the run id the job's first controller gave its workers ("":
      this controller is the first and makes one).
    term: its leadership term (elastic.controller.leadership).
    discover: with no `inherited`, look for a running generation in the
      agents' reports first (elastic.policy.adopt.discover): the journal
      may end before it.
    failures: the failure accounting the journal carries (the restart
      budget, the crash loop, quarantine), counted on from where the
      previous controller stopped (elastic.policy.failure_history).
    """

    def __init__(self, spec: JobSpec, journal: JournalWriter, clock: Clock,
                 tick_s: float = 0.1, initial_generation: int = 0, known_step: int = -1,
                 inherited: Inherited | None = None, run_id: str = "",
                 term: int = 0, discover: bool = False,
                 failures: FailureHistory = FailureHistory()) -> None:
        self.spec = spec
        self.announced = False  # controller_started journaled (announce)
        self.known_step = known_step
        self.clock = clock
        self.tick_s = tick_s
        self.view = ClusterView()
        self.state = SliceState(generation=initial_generation, phase_since=clock.monotonic())
        if inherited is not None:
            self.state = SliceState(
                phase=Phase.ADOPTING, generation=inherited.generation,
                phase_since=clock.monotonic(), inherited=inherited,
                reason=f"adopting generation {inherited.generation}: waiting for its hosts")
        elif discover:
            self.state = SliceState(
                phase=Phase.ADOPTING, generation=initial_generation,
                phase_since=clock.monotonic(),
                reason="looking for a running generation in the agents' reports")
        self.state = failure_history.carried_into(self.state, failures, clock.monotonic(),
                                                  clock.time(), spec)
        self.executor = Executor(spec, journal, clock, run_id, term, self.view)
        # the journal as written so far, read incrementally (status computes ETTR from it)
        self.journal_tail = JournalTail(journal.path.parent)
        self._wake = asyncio.Event()
        # how far behind this controller's own loop is (see elastic.controller.lag)
        self.lag = LoopLag(clock, window_s=spec.health.heartbeat_timeout_s)
        #: the lag measured at the last pass (seconds; what acks tell agents),
        #: and the lag told to agents, which silence is judged against too
        self.measured_lag_s = 0.0
        self.promises = LagPromises()
        # seconds from an agent's send to receipt, of the last 10,000 heartbeats
        self.receipts = ReceiptDelay(keep=10_000)
        # heartbeat datagrams the kernel dropped on the full socket
        self.drops = ReceiveDrops(hold_s=spec.health.heartbeat_timeout_s)
        #: registrations refused while it was behind or admitted ones' streams
        #: waited (admission control, elastic.controller.admission)
        self.registrations_deferred = 0
        #: heartbeat datagrams taken, dropped (malformed, forged, replayed,
        #: overtaken: elastic.controller.servicer.datagram_received), and not
        #: handled because a newer one of the same host came in the same batch
        #: (elastic.controller.datagrams)
        self.datagrams_received = self.datagrams_refused = self.datagrams_superseded = 0
        #: None, or a check before every reconcile pass (see reconcile) and
        #: before the stream copies of commands are sent (Executor.send_copies)
        self.may_act = None
        self.executor.may_act = lambda: self.may_act is None or self.may_act()
        #: None, or called with each heartbeat's latency (the metrics)
        self.on_heartbeat_latency = None

    def judge_lag(self, now: float) -> None:
        """Set the lag (seconds) silence is judged against at `now`
        (controller-monotonic): the largest measured within a heartbeat
        timeout (elastic.controller.lag), or a larger one acks told agents
        and that still holds (`promise_lag`), or the timeout itself while the
        kernel drops heartbeats on the full socket (ReceiveDrops; not told
        to agents, and not counted as being behind by admission control)."""
        # what it has not read yet while behind is not the hosts' silence, nor
        # what the kernel dropped because it was behind
        self.lag.note(self.receipts.recent_s(now), now, can_pause=False)
        self.measured_lag_s = self.lag.allowance_s(now)
        self.view.lag_s = max(self.measured_lag_s, self.promises.floor(now),
                              self.drops.lag_s(now))

    def promise_lag(self, lag_s: float) -> None:
        """An ack told an agent that this controller runs `lag_s` seconds
        behind; the agent may wait that much longer before it heartbeats on
        its stream (patience + lag, elastic.agent.datagrams), so silence is
        judged against at least `lag_s` until that stream heartbeat can have
        come: a heartbeat timeout, the lag and two intervals from now."""
        h = self.spec.health
        self.promises.promise(lag_s, self.clock.monotonic() + h.heartbeat_timeout_s + lag_s
                              + 2 * h.heartbeat_interval_s)

    def count_dropped(self, datagrams: int) -> None:
        """The kernel dropped `datagrams` heartbeat datagrams on the full
        socket (elastic.controller.datagrams): unread, so judged as lag
        (ReceiveDrops), not as the hosts' silence."""
        self.drops.dropped(datagrams, self.clock.monotonic())

    def count_superseded(self, datagrams: int) -> None:
        """`datagrams` heartbeat datagrams were left unhandled: a newer one
        of their host was taken (elastic.controller.datagrams)."""
        self.datagrams_superseded += datagrams

    @property
    def sessions(self):
        return self.executor.sessions

    def submit(self, event: Event) -> None:
        """Fold an event into the view now (O(1)); wake the loop if it matters."""
        relevant, facts = observe(self.view, event, self.clock.monotonic())
        self.executor.record_facts(facts)
        if relevant:
            self._wake.set()

    def reconcile(self) -> None:
        """Decide and execute until the phase settles (a stop that completes
        at once is followed by the next start in the same pass, not a tick
        later). At most 4 passes. Nothing while `may_act()` says this
        controller's leadership may have passed (its bucket lease is stale)."""
        if self.may_act is not None and not self.may_act():
            return
        for _ in range(4):
            before = self.state.phase
            decision = decide(self.state, self.view, self.clock.monotonic(), self.spec)
            self.state = decision.state
            self.executor.apply(decision.actions)
            if self.state.phase is before or self.state.phase.terminal:
                return

    def announce(self) -> None:
        """Journal `controller_started` (once: `run` calls it too), with
        the term its agents will follow."""
        if self.announced:
            return
        self.announced = True
        inherited = self.state.inherited
        adopting = (f"; adopting generation {inherited.generation} on "
                    f"{', '.join(inherited.hosts)}" if inherited else "")
        self.executor.record("controller_started", self.state.generation,
                             f"job {self.spec.job_id}: {self.spec.min_hosts} to "
                             f"{self.spec.max_hosts} hosts, mesh {self.spec.mesh.to_text()}"
                             f"{adopting}",
                             None, {"job_id": self.spec.job_id, "spec": self.spec.source,
                                    "checkpoint_dir": self.spec.checkpoint_dir,
                                    "run_id": self.executor.run_id,
                                    "term": self.executor.term,
                                    "adopting": inherited.describe() if inherited else None,
                                    "carried": failure_history.describe(self.state,
                                                                       self.clock.monotonic())})

    async def run(self) -> int:
        """Reconcile until the job ends, then read on for at most HEAR_OUT_S
        (seconds) what the agents of open sessions queued; returns the exit
        code (0 or 1)."""
        self.announce()
        pass_s = 0.0
        probe = asyncio.create_task(self.lag.probe(self._paused))
        try:
            while not self.state.phase.terminal:
                pass_s = await self._pass(pass_s)
        finally:
            probe.cancel()
        await self.hear_out(HEAR_OUT_S)
        return self.state.exit_code or 0

    def unheard(self) -> list[str]:
        """The hosts (sorted) whose open session has not yet delivered a
        heartbeat. An agent sends what it queued while no controller
        listened first, then a heartbeat (elastic.agent.session): a session
        whose heartbeat was read has delivered its queue."""
        return sorted(host for host, s in self.sessions.items()
                      if s.close_status is None and not s.heartbeat_path)

    async def hear_out(self, limit_s: float) -> list[str]:
        """Wait (at most `limit_s` seconds, of the event loop's clock) until
        `unheard()` is empty; returns the hosts still unheard (logged)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit_s
        while (unheard := self.unheard()) and loop.time() < deadline:
            await asyncio.sleep(HEAR_OUT_POLL_S)
        if unheard:
            log.warning("ending without what %d host(s) queued while no controller listened: "
                        "%s", len(unheard), ", ".join(unheard[:10]))
        return unheard

    def behind_s(self) -> float:
        """Seconds this controller's loop has lately run late (the largest
        lateness in the last second; elastic.controller.admission.ADMIT_LAG_S)."""
        return self.lag.allowance_s(self.clock.monotonic(), window_s=1.0)

    def _paused(self, pause_s: float, now: float) -> None:
        """This controller did not run for `pause_s` seconds up to `now`:
        what it could not hear meanwhile is not silence (elastic.controller.lag)."""
        self.view.forgive_pause(pause_s, now, self.state.lost)
        self.state = forgive_pause(self.state, pause_s, now)
        self.receipts.resumed(self.clock.time())
        self.executor.record("controller_paused", self.state.generation,
                             f"the controller did not run for {pause_s:.1f} s (stopped, "
                             f"starved or suspended); silence is counted without it",
                             None, {"paused_s": round(pause_s, 3)})

    async def _pass(self, pass_s: float) -> float:
        """Wait for an event or the tick, then reconcile; returns the
        seconds the pass took."""
        # Events are decided in batches: the next pass waits at least
        # PASS_SPACING times the last one's duration, so a burst of events
        # (thousands of streams opening, each making its host startable) costs
        # at most a third of the loop, not a pass each. Ticks catch what no
        # event announces (timeouts); a pass over a very large slice costs
        # milliseconds, so ticks are kept 5x that far apart after the spacing
        # (decisions on ticks then cost at most ~1/8 of a core).
        pass_s = min(pass_s, PASS_COST_CAP_S)
        if pass_s > 0:
            await asyncio.sleep(PASS_SPACING * pass_s)
        wait_s, waited_from = max(self.tick_s, 5 * pass_s), self.clock.monotonic()
        try:
            await asyncio.wait_for(self._wake.wait(), wait_s)
        except TimeoutError:
            pass
        self._wake.clear()
        t0 = self.clock.monotonic()
        pause_s = self.lag.note(t0 - waited_from - wait_s, t0)  # (before the probe, maybe)
        if pause_s:
            self._paused(pause_s, t0)
        self.judge_lag(t0)
        self.reconcile()
        return self.clock.monotonic() - t0
