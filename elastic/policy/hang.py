"""Hang detection: a running generation that stops making step progress.

Pure: (members' observed records, now, spec) -> a Hang or None. A worker its
agent reports stopped (SIGSTOP) for `hang.suspended_timeout_s` is hung at
once, before its first step too. Otherwise the default timeout is learned
from the step times the workers report: max(hang.min_timeout_s,
hang.step_time_factor x median step time), the last one reported (an
earlier generation's) until the running one reports its own; with a
separate allowance for startup (process start, distributed init, restore,
first compile; also up to the second step while no step time was ever
reported) and extra time while a checkpoint save is in flight.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from elastic.config import JobSpec
from elastic.policy.view import ClusterView, HostRecord


@dataclasses.dataclass(frozen=True)
class Hang:
    """reason: one line; suspects: hosts that most likely stopped first, in
    order (journaled, for the operator); blamed: the hosts the failure is
    attributed to (quarantine), those the hang singles out — () when every
    member stopped at the same step, as in lockstep SPMD training a slice
    stuck in a collective does: the steps cannot say who stopped it, and
    blaming all of them would set healthy hosts aside (the restart budget
    and crash loop still count the failure); silent_s: seconds without
    progress; timeout_s: the limit used."""

    reason: str
    suspects: tuple[str, ...]
    silent_s: float
    timeout_s: float
    blamed: tuple[str, ...] = ()


def hang_timeout(spec: JobSpec, step_time_s: float | None) -> float:
    """Seconds without a step before a running generation is hung."""
    h = spec.hang
    if h.timeout_s > 0:
        return h.timeout_s
    if step_time_s and step_time_s > 0:
        return max(h.min_timeout_s, h.step_time_factor * step_time_s)
    return h.min_timeout_s


def suspects(records: Sequence[HostRecord]) -> tuple[str, ...]:
    """Members that stopped first: those whose worker is suspended (SIGSTOP);
    else those with the lowest last step, the one whose step went up least
    recently first."""
    stopped = [r.host_id for r in records if r.worker.suspended]
    if stopped:
        return tuple(stopped)
    lowest = min(r.worker.step for r in records)
    behind = sorted((r for r in records if r.worker.step == lowest), key=lambda r: r.step_at)
    return tuple(r.host_id for r in behind)


def singled_out(records: Sequence[HostRecord]) -> tuple[str, ...]:
    """The members a hang can be blamed on: those whose worker is suspended;
    else those behind the others (a lower last step, first steps included:
    -1 is none yet); else () — every member at the same step."""
    stopped = tuple(r.host_id for r in records if r.worker.suspended)
    if stopped or not records:
        return stopped
    steps = {r.worker.step for r in records}
    if len(steps) == 1:
        return ()
    return tuple(r.host_id for r in records if r.worker.step == min(steps))


def check_hang(members: Sequence[HostRecord], view: ClusterView, started_at: float,
               progressed: bool, now: float, spec: JobSpec) -> Hang | None:
    """A Hang if the generation (members in rank order) has made no step for
    too long, else None. `started_at`: when the generation started (before
    its first step) or when its first step came (after); `now`: seconds."""
    if not members:
        return None
    # A stopped worker first, before the first step too: it cannot step, and
    # the startup allowance (300 s) is no reason to wait for it.
    stop_limit = spec.hang.suspended_timeout_s
    stopped = [r for r in members if r.worker.running and r.worker.suspended and r.suspended_at
               and now - r.suspended_at >= stop_limit] if stop_limit > 0 else []
    active = [r for r in members if r.worker.running]
    # (a member with no step yet counts from when the generation's first step came)
    progress_at = min(max(r.step_at, started_at) for r in active) if progressed and active \
        else started_at
    if stopped:
        longest = now - min(r.suspended_at for r in stopped)
        return Hang(f"worker stopped (SIGSTOP) for {longest:.1f} s (hang.suspended_timeout_s = "
                    f"{stop_limit:g}); suspects: {', '.join(r.host_id for r in stopped)} "
                    f"(suspended)", tuple(r.host_id for r in stopped), now - progress_at,
                    stop_limit, tuple(r.host_id for r in stopped))
    if not progressed:
        limit = spec.hang.startup_timeout_s
        silent = now - started_at
        if silent <= limit:
            return None
        waiting = tuple(r.host_id for r in members if r.worker.step < 0) or \
            tuple(r.host_id for r in members)
        return Hang(f"no first step {silent:.1f} s after the generation started "
                    f"(hang.startup_timeout_s = {limit:g})", waiting, silent, limit,
                    singled_out(members))
    # The member that advanced least recently sets the clock: in SPMD training
    # every process waits for the slowest, and a member that stopped alone is
    # as stuck as a slice that stopped together. Finished workers are done.
    if not active:
        return None
    limit, basis = _step_limit(members, active, view, spec)
    saving = view.save_in_flight(max(r.worker.generation for r in members))
    # (process 0 says so, and may well have exited before the others)
    finishing = any(r.finishing_generation and r.finishing_generation == r.worker.generation
                    for r in members)
    if saving or finishing:
        limit += spec.hang.checkpoint_allowance_s
    limit += view.lag_s  # (steps the controller has not read yet)
    silent = now - progress_at
    if silent <= limit:
        return None
    found = suspects(active)
    how = "suspended" if any(r.worker.suspended for r in active) else \
        f"no step since step {min(r.worker.step for r in active)}"
    return Hang(f"no step progress for {silent:.1f} s (timeout {limit:.1f} s, {basis}"
                + (f", {saving}" if saving else "")
                + (", the workers finishing" if finishing else "")
                + f"); suspects: {', '.join(found)} ({how})", found, silent, limit,
                singled_out(active))


def _step_limit(members: Sequence[HostRecord], active: Sequence[HostRecord], view: ClusterView,
                spec: JobSpec) -> tuple[float, str]:
    """(seconds without a step before a generation past its first step is
    hung, allowances aside; what that limit is based on). The step time is
    rank 0's median in this generation or, until it reports one (it
    measures one at its second step), the latest the job's workers reported
    (ClusterView.step_time). With none ever reported, hang.startup_timeout_s
    holds until some member's second step: the first steps after a start
    may be slow, and nothing says how slow yet."""
    if spec.hang.timeout_s > 0:
        return spec.hang.timeout_s, "fixed hang.timeout_s"
    step_time = view.step_time(members[0].worker)
    if step_time:
        own = step_time == members[0].worker.metrics.get("step_time_s")
        whose = "a median step" if own else "the last median step reported"
        return hang_timeout(spec, step_time), f"learned from {whose} of {step_time:.3f} s"
    # (a member's step_jump turns positive at its first report above its
    # first step of the generation: its second step)
    if not any(r.step_jump > 0 for r in active):
        return (spec.hang.startup_timeout_s,
                "hang.startup_timeout_s until the second step: no step time known yet")
    return spec.hang.min_timeout_s, "hang.min_timeout_s"
