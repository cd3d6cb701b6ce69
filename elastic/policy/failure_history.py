"""The failure accounting a controller inherits from the journal.

The restart budget (`restart.max_restarts` failures within
`restart.window_s`), the crash loop (`restart.crash_loop_failures` failures
in a row without a step) and quarantine (`quarantine.failures` failures of a
host within `quarantine.window_s`, then `quarantine.cooldown_s` set aside)
count failures over time. A controller that starts on a job's journal (after
its predecessor was killed, restarted by systemd, or deposed by a standby)
must go on counting where that one stopped: otherwise every controller
restart refills the budget, a crash loop that also takes the controller
down never ends, and a quarantined host is back in the next slice. The
latest restarts' costs come along too: without them a successor's grow
policy would grow whenever it can until it has restarted itself.

`after(history, entry)` folds one journal entry into a `FailureHistory` (in
the journal's Unix seconds); `carried_into(state, history, ...)` puts it in
a controller's `SliceState` on its own monotonic clock. Both are pure. A
job that ended (`job_succeeded`, `job_failed`) starts its count again: a
job started again on the same state directory is a new run, and a crash
loop it ended on (the bug since fixed) must not fail it at once.

Quarantines are the exception: they are about the host, not the run, so
they outlive the job that set them, and the next job on the same state
directory (the same job again, or another one, whose entries
`after_other_job` folds) leaves those hosts out until their cooldown ends.
That costs it nothing it needs: a slice that cannot start without a
quarantined host releases it (elastic.policy.quarantine.release_needed).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from elastic.agent.fence import fenced_by
from elastic.config import JobSpec
from elastic.policy import grow
from elastic.policy.state import SliceState


@dataclasses.dataclass(frozen=True)
class FailureHistory:
    """What the journal says about failures (times in Unix seconds, as the
    journal's `ts`):

    restarts_at: when each failure restart began (`slice_stopping` with
      cause "failure": the stop that began it is what the budget counts;
      one whose controller died before `slice_stopped` still restarted).
    without_progress: failures in a row with no progress between them (the
      crash-loop count, elastic.policy.crash_loop); 0 again after progress
      or a quarantine, as decide counts it.
    failure_step: the step reached by the failure that began that count
      (-1: none, or not known: a journal from before it was recorded, whose
      first steps end the count as they did then).
    host_failures: host -> when failures were attributed to it.
    quarantined: host -> (until, reason), set aside and not yet released.
    restart_costs_s: what the latest restarts cost (`first_progress`'s
      restart_cost_s, seconds, the newest last; at most
      elastic.policy.grow.COSTS_KEPT), which the grow policy weighs: not a
      failure count, but carried the same way.
    fenced_until: when the fence of the latest `waiting_for_fencing` runs
      out (0.0: none, or lifted, or a generation started since).
    fence_host: the host of process 0 that fence waits for ("" if none).
    process0: the host of process 0 of the latest generation started,
      discovered or adopted ("" if none).
    stop_unfinished: that generation's stop began (`slice_stopping`) and was
      not journaled as ended (`slice_stopped`): its controller died during
      the stop, and whether process 0 stopped is not known.
    journaled_until: the latest entry's time (its controller's wall clock,
      like every other time here).
    """

    restarts_at: tuple[float, ...] = ()
    without_progress: int = 0
    failure_step: int = -1
    host_failures: Mapping[str, tuple[float, ...]] = dataclasses.field(default_factory=dict)
    quarantined: Mapping[str, tuple[float, str]] = dataclasses.field(default_factory=dict)
    restart_costs_s: tuple[float, ...] = ()
    fenced_until: float = 0.0
    fence_host: str = ""
    process0: str = ""
    stop_unfinished: bool = False
    journaled_until: float = dataclasses.field(default=0.0, compare=False)


def number(entry: Mapping, key: str) -> float | None:
    """entry[key] as a finite float, else None (a damaged journal's
    NaN, infinity, or an integer too large for a float included)."""
    value = entry.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        value = float(value)
    except OverflowError:
        return None
    return value if math.isfinite(value) else None


def _step(entry: Mapping) -> int:
    """entry["step"] as a step (an integer >= 0), else -1."""
    value = entry.get("step")
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else -1


def recent(restarts: tuple[float, ...], now: float, spec: JobSpec) -> tuple[float, ...]:
    """The failure restarts (times, seconds) within `restart.window_s` before `now`."""
    return tuple(t for t in restarts if t > now - spec.restart.window_s)


def exhausted(without_progress: int, restarts: tuple[float, ...], spec: JobSpec) -> str | None:
    """Why the job must fail (a sentence) with `without_progress` failures in
    a row without a step and the failure restarts `restarts` within the
    window; None while both limits hold."""
    r = spec.restart
    if without_progress >= r.crash_loop_failures:
        return (f"crash loop: {without_progress} failures in a row with no step progress "
                f"(restart.crash_loop_failures = {r.crash_loop_failures})")
    if len(restarts) > r.max_restarts:
        return (f"restart budget exhausted: {len(restarts)} failures within {r.window_s:g} s "
                f"(restart.max_restarts = {r.max_restarts})")
    return None


def after(history: FailureHistory, entry: Mapping) -> FailureHistory:
    """`history` with one journal `entry` (as elastic.controller.journal
    parses it: `ts`, `kind`, `generation`, `host` and the kind's fields)
    folded in. Entries of other kinds, or missing the fields a kind needs,
    leave it as it is, but for `journaled_until`."""
    folded = _folded(history, entry)
    ts = number(entry, "ts")
    if ts is None or ts <= folded.journaled_until:
        return folded
    return dataclasses.replace(folded, journaled_until=ts)


def _folded(history: FailureHistory, entry: Mapping) -> FailureHistory:
    kind, ts, host = entry["kind"], number(entry, "ts"), entry.get("host")
    if ts is None:
        return history
    if kind in ("job_succeeded", "job_failed"):  # (see the module docstring)
        return FailureHistory(quarantined=history.quarantined,
                              journaled_until=history.journaled_until)
    history = _stop_progress(history, entry)
    if kind == "first_progress":
        # (a first step starts the crash-loop count again when the count has
        # no failure step to compare with, as decide's first_progress does
        # (elastic.policy.crash_loop), which also remembers the restart's cost)
        cost = number(entry, "restart_cost_s")
        costs = history.restart_costs_s if cost is None or cost < 0 else \
            grow.remember_cost(history.restart_costs_s, cost)
        without_progress = 0 if history.failure_step < 0 else history.without_progress
        return dataclasses.replace(history, without_progress=without_progress,
                                   restart_costs_s=costs)
    if kind == "slice_adopted":
        # (the adopted slice made progress: decide says so in `progressed`;
        # journals from before it said so: it made a step)
        passed = entry.get("progressed") is True if "progressed" in entry else \
            _step(entry) >= 0
        return dataclasses.replace(history, without_progress=0, failure_step=-1) \
            if passed else history
    if kind == "slice_stopping" and entry.get("cause") == "failure":
        blamed = entry.get("blamed") if isinstance(entry.get("blamed"), list) else []
        failures = dict(history.host_failures)
        for h in blamed:
            if isinstance(h, str):
                failures[h] = failures.get(h, ()) + (ts,)
        # (decide's verdict: its generation made progress, which starts the
        # count at 1 from its own step; else one more: elastic.policy.crash_loop)
        counted = {"without_progress": 1, "failure_step": _step(entry)} \
            if entry.get("progressed") is True else \
            {"without_progress": history.without_progress + 1}
        return dataclasses.replace(
            history, restarts_at=history.restarts_at + (ts,), host_failures=failures, **counted)
    if kind == "slice_stopping" and entry.get("progressed") is True:
        # (another stop of a generation that made progress ends the count)
        return dataclasses.replace(history, without_progress=0, failure_step=-1)
    if kind == "host_quarantined" and isinstance(host, str):
        until_s = number(entry, "until_s")
        if until_s is None:
            return history
        failures = {h: t for h, t in history.host_failures.items() if h != host}
        quarantined = {**history.quarantined, host: (ts + until_s, str(entry.get("reason", "")))}
        return dataclasses.replace(history, host_failures=failures, quarantined=quarantined,
                                   without_progress=0)
    if kind == "host_released" and isinstance(host, str):
        return dataclasses.replace(history, quarantined={
            h: q for h, q in history.quarantined.items() if h != host})
    if kind == "waiting_for_fencing":
        left_s = number(entry, "lease_left_s")
        return history if left_s is None else dataclasses.replace(
            history, fenced_until=ts + left_s, fence_host=host if isinstance(host, str) else "")
    if kind in ("generation_started", "generation_discovered", "fence_lifted"):
        return dataclasses.replace(history, fenced_until=0.0, fence_host="")
    return history


def _stop_progress(history: FailureHistory, entry: Mapping) -> FailureHistory:
    """`history` with the latest generation's process 0 and whether its
    stop is under way (see FailureHistory) updated by `entry`."""
    kind = entry["kind"]
    if kind in ("generation_started", "generation_discovered", "slice_adopted"):
        hosts = entry.get("hosts")
        first = hosts[0] if isinstance(hosts, list) and hosts and isinstance(hosts[0], str) \
            else ""
        return dataclasses.replace(history, process0=first or history.process0,
                                   stop_unfinished=False)
    if kind in ("slice_stopping", "slice_stopped", "fence_lifted"):
        # (a lifted fence: process 0 was seen stopped, all the stop was for)
        return dataclasses.replace(history, stop_unfinished=kind == "slice_stopping")
    return history


def after_other_job(history: FailureHistory, entry: Mapping, job: str) -> FailureHistory:
    """`history` with one journal `entry` of another job (`job`, its id) in
    the same state directory folded in: only its quarantines and releases
    count (the reason names the job); its failures, steps and fences are
    that job's own."""
    kind, ts, host = entry["kind"], number(entry, "ts"), entry.get("host")
    if ts is None or kind not in ("host_quarantined", "host_released") or \
            not isinstance(host, str):
        return history
    if kind == "host_released":
        return dataclasses.replace(history, quarantined={
            h: q for h, q in history.quarantined.items() if h != host})
    until_s = number(entry, "until_s")
    if until_s is None:
        return history
    reason = f"in job {job!r}: {entry.get('reason', '')}"
    return dataclasses.replace(history, quarantined={**history.quarantined,
                                                     host: (ts + until_s, reason)})


def carried_into(state: SliceState, history: FailureHistory, monotonic_now: float,
                 wall_now: float, spec: JobSpec) -> SliceState:
    """`state` counting the failures of `history` on the controller's
    monotonic clock (a journal time t becomes `monotonic_now - (wall_now -
    t)`), keeping only what the windows still count: failure restarts within
    `restart.window_s`, a host's failures within `quarantine.window_s`, a
    fence (elastic.policy.fencing) neither lifted nor followed by a
    generation (no generation starts before it, though this controller never
    saw the hosts: one naming its host that had not run out by the last
    entry counts a whole lease from `wall_now`, as the journal's clock may
    be another host's), and every
    quarantine: those that ended while no controller ran are released by
    the first pass, which journals it. A stop its controller did not see
    end fences the next generation as a lost process 0 does, counting its
    lease from `wall_now` (the latest its agent can have heard that
    controller), until that host is seen without a worker of the stopped
    generation (fencing.lift_fence)."""
    offset = monotonic_now - wall_now
    restarts = tuple(t + offset for t in recent(history.restarts_at, wall_now, spec))
    failures = {}
    for host, times in history.host_failures.items():
        kept = tuple(t + offset for t in times if t > wall_now - spec.quarantine.window_s)
        if kept:
            failures[host] = kept
    quarantined = {h: (until + offset, reason)
                   for h, (until, reason) in history.quarantined.items()}
    health = spec.health
    whole_lease = fenced_by(wall_now, health.controller_lease_s, health.heartbeat_interval_s)
    fenced_until, fence_host = (history.fenced_until, history.fence_host) \
        if history.fenced_until > wall_now else (0.0, "")
    if history.fence_host:
        # The fence's end is on its controller's wall clock, perhaps another
        # host's (a standby through the bucket): read on this one's, a clock
        # ahead shortened it, by 22 s dropped it (an audit found it). Unless
        # its controller journaled past its end (one clock), the whole lease
        # counts from this start (the latest that host's agent can have
        # heard a controller), unless lifted sooner (fencing.lift_fence).
        fenced_until, fence_host = (whole_lease, history.fence_host) \
            if history.fenced_until > history.journaled_until else (0.0, "")
    if history.stop_unfinished and history.process0 and whole_lease > fenced_until:
        fenced_until, fence_host = whole_lease, history.process0
    return dataclasses.replace(state, failure_restarts=restarts,
                               failures_without_progress=history.without_progress,
                               failure_step=history.failure_step,
                               host_failures=failures, quarantined=quarantined,
                               restart_costs_s=history.restart_costs_s,
                               fenced_until=fenced_until + offset if fenced_until else 0.0,
                               fence_host=fence_host)


def describe(state: SliceState, monotonic_now: float) -> dict:
    """What `controller_started` journals about the failures `state`
    counts: failure restarts within the budget's window, the crash-loop
    count, the latest restarts' costs (seconds), seconds left of a fence,
    and host -> seconds left in quarantine (those not yet ended)."""
    return {"failure_restarts": len(state.failure_restarts),
            "failures_without_progress": state.failures_without_progress,
            "restart_costs_s": list(state.restart_costs_s),
            "fenced_s": round(max(state.fenced_until - monotonic_now, 0.0), 3),
            "quarantined": {h: round(until - monotonic_now, 3)
                            for h, (until, _) in sorted(state.quarantined.items())
                            if until > monotonic_now}}  # (ended ones: released by the first pass)
