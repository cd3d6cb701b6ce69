"""A preemption drain (pure): a member's host is being taken away, and the
slice waits for the emergency checkpoint that every worker writes at JAX's
preemption sync point before elastic.policy.decide stops it; the next
generation starts without the leaving hosts and resumes at the saved step +
1. Bounded by `preemption.drain_timeout_s`."""

from __future__ import annotations

import dataclasses

from elastic.config import JobSpec
from elastic.policy.state import SliceState
from elastic.policy.view import ClusterView, HostRecord


def emergency_committed(view: ClusterView, since: float) -> bool:
    """Whether an emergency (preemption) save started at or after `since`
    (controller seconds) and has committed."""
    return (view.emergency_save_at >= since and view.committed_step >= view.emergency_save_step
            and view.committed_at >= view.emergency_save_at)


def quiet_s(rank0: HostRecord, view: ClusterView, spec: JobSpec) -> float:
    """How long (seconds) rank 0's step must have stood still before the
    drain takes it for the step the slice stopped at: two heartbeat
    intervals (a step is reported with the next heartbeat, a commit at
    once) and two of its steps (`step_time_s`, the median its worker
    reports from its second step of a generation; before, the one the job
    reported last: ClusterView.step_time). JAX's sync point is
    the step after the highest one reached when the notice came: with steps
    longer than the heartbeat intervals, it is still being computed when two
    intervals have passed, and ending the drain then killed it and its
    emergency save (an audit found it: 5 s steps, a step computed twice)."""
    return 2 * max(spec.health.heartbeat_interval_s, view.step_time(rank0.worker) or 0.0)


def verdict(state: SliceState, view: ClusterView, now: float, spec: JobSpec,
            leaving: list[HostRecord]) -> tuple[SliceState, str | None]:
    """(state, why): why the drain for the `leaving` members is over (the
    slice is to stop now), or None while it waits, at `now`
    (controller-monotonic seconds); the state notes when the drain began."""
    hosts = ", ".join(f"{r.host_id} ({r.preemption})" for r in leaving)
    since = state.draining_since if state.draining_since is not None else now
    if state.draining_since is None:
        state = dataclasses.replace(state, draining_since=since,
                                    reason=f"draining: {hosts} leaving; waiting for the "
                                           f"emergency checkpoint")
    rank0 = view.get(state.members[0]) if state.members else None
    if emergency_committed(view, since):
        why = (f"preemption of {hosts}: emergency checkpoint step "
               f"{view.emergency_save_step} committed")
    elif rank0 is not None and 0 <= rank0.worker.step <= rank0.worker.committed_step and \
            now - max(rank0.step_at, rank0.registered_at) >= quiet_s(rank0, view, spec):
        # the step the slice stands at is committed: an emergency save this
        # controller did not see start (it was saved while no controller
        # ran, before an adoption), or a periodic one; nothing is lost. (Not
        # while the slice may still step: a commit is reported at once, the
        # steps after it only with the next heartbeat, and the sync step
        # takes a step's time: quiet_s.)
        why = (f"preemption of {hosts}: checkpoint step {rank0.worker.committed_step}, the "
               f"step the slice reached, committed")
    elif view.emergency_failed_at >= since:
        why = (f"preemption of {hosts}: the emergency checkpoint failed "
               f"({view.emergency_failure}); resuming from checkpoint step {view.committed_step}")
    elif not state.progressed:
        why = f"preemption of {hosts} before the first step"
    elif now - since > spec.preemption.drain_timeout_s:
        why = (f"preemption of {hosts}: no emergency checkpoint within "
               f"{spec.preemption.drain_timeout_s:g} s (preemption.drain_timeout_s); "
               f"resuming from checkpoint step {view.committed_step}")
    else:
        return state, None
    return state, why


def member_left(view: ClusterView, blamed: tuple[str, ...], why: str) -> str | None:
    """Why a failure of the `blamed` members (`why`: the failure) is a
    preemption, not a failure: a blamed member's host has a preemption
    notice, so its worker ended because its host is leaving (the agent's
    preemption grace ran out, or a SIGTERM came before the worker could
    handle it). None when no blamed host is being taken away."""
    leaving = [r for h in blamed if (r := view.get(h)) is not None and r.preemption]
    if not leaving:
        return None
    hosts = ", ".join(f"{r.host_id} ({r.preemption})" for r in leaving)
    return f"preemption of {hosts}: {why}"
