"""Is a silent host's worker still training? Read it off its peers' steps.

A host's heartbeats come from its agent; its worker trains without it. An
agent that stops (SIGSTOP, a stuck process, a control-network fault) goes
silent while its worker keeps stepping with the others, and restarting the
slice for it would throw away a healthy run. In lockstep SPMD training every
step has a collective across all processes, so no process can finish step
k + 1 before every other one has reached step k + 1: a peer that reports
step `s + CARRY_LEAD_STEPS` proves the silent host's worker went past its
last reported step `s`. The lead is 3 and not 2 because the silent worker may
have finished a step whose report its stopped agent never sent, and may have
taken part in all of the next step's collectives before it died. Agents report
steps with their heartbeats, not at every step, so a worker may also have gone
as many steps past its last report as one report usually carries
(`HostRecord.step_jump`): those are added to the lead a silent host needs.
Without them, a host frozen whole (agent and worker) just before its next
heartbeat, on steps faster than heartbeats, looked carried for a moment and
was lost a timeout later than it should have been. The steps added are the
most that any member's reports lately went up by, not the silent host's own:
in lockstep every member steps at the same rate and reports as often, and one
host's last few reports can carry fewer steps than the next one would have
(tests/test_silent_agent.py on a slow evening: a frozen host whose reports had
gone up by 2 was carried at a lead of 5).

The same idea as Kubernetes' node lifecycle: a node that stops reporting
becomes NotReady, but its pods keep running until the taint's
`tolerationSeconds` (300 s by default) ends; a silent control plane is not
proof of a dead data plane.
"""

from __future__ import annotations

from collections.abc import Iterable

from elastic.policy.view import HostRecord

#: Steps the other members must be ahead of a silent member's last report.
CARRY_LEAD_STEPS = 3
#: Seconds a host that registered may take to open its stream and send on it
#: before its silence counts. When thousands of agents connect at once, gRPC
#: hands the controller new calls one by one, each after a turn of its event
#: loop, and a registered agent's stream waits in gRPC's queue for seconds
#: while the controller's loop and the heartbeats on open streams keep up
#: (bench/scale.py at 3,000 agents: 1,600 hosts declared lost in the first
#: 30 s without this; at 10,000, with 30 s, thousands of streams still waited
#: longer). The controller gives up on a stream that sends nothing for as
#: long (elastic.controller.servicer); gRPC waits longer still
#: (elastic.transport.SERVER_CALL_WAIT_S).
STREAM_OPEN_S = 60.0


def opening(record: HostRecord, now: float, lag_s: float) -> bool:
    """True while `record` registered less than STREAM_OPEN_S (+ the
    controller's lag) ago and nothing came on its stream since."""
    return not record.streamed and now - record.registered_at <= STREAM_OPEN_S + lag_s


def slice_front(members: Iterable[HostRecord], generation: int, now: float,
                window_s: float) -> int:
    """The highest step any of `members` reported in `generation` whose step
    went up within the last `window_s` seconds, or whose worker exited 0
    (`now` and the records' times: controller-monotonic seconds); -1 if
    none. A silent member's own step is never recent (a step report is also
    a sign of life), so the front of all members is the front of its peers;
    a peer that finished the program went through its every collective,
    with the silent member too. O(members): computed once per pass."""
    return max((r.worker.step for r in members if r.worker.generation == generation
                and r.worker.step >= 0 and (now - r.step_at <= window_s or r.worker.succeeded)),
               default=-1)


def slice_jump(members: Iterable[HostRecord], generation: int) -> int:
    """The most steps one report of any of `members` running `generation`
    lately went up by (HostRecord.step_jump); 0 if none. O(members)."""
    return max((r.step_jump for r in members if r.worker.generation == generation), default=0)


def lead_needed(silent: HostRecord, jump: int = 0) -> int:
    """Steps the slice must be ahead of `silent`'s last report to carry it:
    CARRY_LEAD_STEPS plus the most steps a report lately went up by, its own
    or the slice's (`jump`: see slice_jump)."""
    return CARRY_LEAD_STEPS + max(silent.step_jump, jump)


def peer_lead(silent: HostRecord, front: int, generation: int) -> int:
    """Steps the slice's `front` (see slice_front) is ahead of `silent`'s last
    reported step; 0 if `silent` is not running in `generation` or stopped (a
    worker that never reported a step is carried by no one)."""
    w = silent.worker
    if w.generation != generation or not w.running or w.step < 0 or w.suspended:
        return 0
    return max(0, front - w.step)
