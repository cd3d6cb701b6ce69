"""What the controller's decisions (elastic.policy.decide) work on: the
job's phase, the controller's own state (`SliceState`), the actions the
executor carries out, and a pass's `Decision`. Plain frozen data."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping

from elastic.policy.adopt import Inherited


class Phase(enum.Enum):
    """The controller's phase for the job (see the module docstring)."""
    ADOPTING = "adopting"
    WAITING = "waiting"
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    SUCCEEDED = "succeeded"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in (Phase.SUCCEEDED, Phase.FAILED)


# --- actions (performed by the executor) -----------------------------------

@dataclasses.dataclass(frozen=True)
class Journal:
    """Append one line to the journal."""

    kind: str
    generation: int
    reason: str
    host: str | None = None
    fields: Mapping = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class StartWorker:
    """Tell `host` to start its worker as `process_id` of `num_processes`,
    putting `devices_per_host` of its devices in the mesh (0: all), and
    sending replicas of its snapshots to `replica_host`'s agent at
    `replica_address` (host:port; "": none; elastic.policy.buddies);
    `next_slices`: ((process count, devices per host), ...) the program is
    compiled for ahead (elastic.policy.slice_plan.next_slices);
    `replica_senders`: the hosts whose buddy `host` is (it takes replicas
    from them only)."""

    host: str
    generation: int
    process_id: int
    num_processes: int
    coordinator_address: str
    devices_per_host: int = 0
    replica_host: str = ""
    replica_address: str = ""
    next_slices: tuple[tuple[int, int], ...] = ()
    replica_senders: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class StopWorker:
    """Tell `host` to end its worker of `generation`: SIGTERM, `grace_s`
    seconds, SIGKILL (grace 0: SIGKILL at once); with `dump_stacks` (a
    hang), its agent first reports the stacks of the worker's threads."""

    host: str
    generation: int
    grace_s: float
    reason: str
    dump_stacks: bool = False


@dataclasses.dataclass(frozen=True)
class Finish:
    """End the controller with `exit_code` (0 succeeded, 1 failed)."""

    exit_code: int


Action = Journal | StartWorker | StopWorker | Finish


@dataclasses.dataclass(frozen=True)
class SliceState:
    """The controller's own state. Times are controller-monotonic seconds.

    generation: the last generation started (0 before the first).
    members / incarnations: hosts of the generation in rank order, and the
      agent incarnation each had when it started.
    coordinator: "host:port" of the generation's JAX coordinator.
    stop_kind: "failure", "preemption" or "grow" while STOPPING.
    failure_restarts: times of failure restarts (for the restart budget).
    failures_without_progress: failures in a row with no progress in between
      (elastic.policy.crash_loop).
    failure_step: the step the failure that began that count reached (-1:
      none, or it made no step), which a generation must get away from to
      count as progress (elastic.policy.crash_loop).
    lost: hosts currently considered lost (journaled once).
    carried: members silent past heartbeat_timeout_s whose worker the others'
      steps show still training (host -> its last heartbeat; see
      elastic.policy.silence); journaled once, not lost.
    stop_requested: host -> time a stop was last sent to a non-member worker.
    grow_ready_since: when a bigger slice first became possible.
    draining_since: when a member's preemption notice was first seen (the
      slice waits for the emergency checkpoint before it stops).
    stop_hurried: a grow stop whose emergency checkpoint committed has sent
      SIGKILL to the workers still waiting (instead of letting the grace run).
    host_failures / quarantined: failures attributed to each host, and the
      hosts set aside (host -> (until, reason)).
    devices_per_host / device_kind: what each member puts in the mesh.
    left_out: host -> why the last plan could not use it (another device
      kind, too few devices, an incomplete failure domain); journaled when
      it changes.
    inherited: while ADOPTING, the generation the journal says was running
      (None: the journal says none was; the agents' reports are searched for
      one, elastic.policy.adopt.discover).
    fenced_until: no generation starts before this time: the host of the
      last one's process 0 was lost, not seen to stop its worker, which may
      commit a checkpoint until its agent's controller lease runs out
      (elastic.policy.fencing).
    fence_host: that host, when `members` does not say (a fence carried
      from the journal; "" if unknown).
    restart_began: when the latest restart's stop began (None once the
      next generation made its first step).
    restart_costs_s: what the latest restarts cost (stop began -> first
      step; the first generation: start -> first step), for elastic.policy.grow.
    grow_declined: the device count of the last grow judged not worth its
      restart (journaled once per count; 0: none).
    """

    phase: Phase = Phase.WAITING
    generation: int = 0
    phase_since: float = 0.0
    reason: str = "waiting for the first hosts"
    members: tuple[str, ...] = ()
    incarnations: tuple[str, ...] = ()
    coordinator: str = ""
    progressed: bool = False
    stop_kind: str = ""
    stop_deadline: float = 0.0
    failure_restarts: tuple[float, ...] = ()
    restarts: int = 0
    failures_without_progress: int = 0
    failure_step: int = -1
    lost: frozenset[str] = frozenset()
    carried: Mapping[str, float] = dataclasses.field(default_factory=dict)
    stop_requested: Mapping[str, float] = dataclasses.field(default_factory=dict)
    grow_ready_since: float | None = None
    draining_since: float | None = None
    stop_hurried: bool = False
    waiting_journaled_at: float = float("-inf")
    host_failures: Mapping[str, tuple[float, ...]] = dataclasses.field(default_factory=dict)
    quarantined: Mapping[str, tuple[float, str]] = dataclasses.field(default_factory=dict)
    devices_per_host: int = 0
    device_kind: str = ""
    left_out: Mapping[str, str] = dataclasses.field(default_factory=dict)
    exit_code: int | None = None
    inherited: Inherited | None = None
    fenced_until: float = 0.0
    fence_host: str = ""
    restart_began: float | None = None
    restart_costs_s: tuple[float, ...] = ()
    grow_declined: int = 0


@dataclasses.dataclass(frozen=True)
class Decision:
    """What one reconcile pass decided: the next state, the actions to
    perform in order, and a one-line reason (shown by `elasticd status`)."""
    state: SliceState
    actions: tuple[Action, ...]
    reason: str


def forgive_pause(state: SliceState, pause_s: float, now: float) -> SliceState:
    """`state` after the controller itself did not run for `pause_s`
    seconds up to `now` (controller-monotonic seconds; the view's clocks
    move too: ClusterView.forgive_pause): the first pass after a pause would
    otherwise judge what it has not read yet. While STOPPING, the deadline
    for stop acknowledgements moves `pause_s` later; while STARTING or
    RUNNING, `phase_since` does (to `now` at most), which the hang check
    counts from before the first step (hang.startup_timeout_s) and for
    members with no step yet: before, a 120 s pause 200 s into a 300 s
    startup declared a hang. (A drain's start stays: the emergency save it
    waits for is matched against it.)"""
    if state.phase is Phase.STOPPING:
        return dataclasses.replace(state, stop_deadline=state.stop_deadline + pause_s)
    if state.phase in (Phase.STARTING, Phase.RUNNING):
        return dataclasses.replace(state, phase_since=min(state.phase_since + pause_s, now))
    return state
