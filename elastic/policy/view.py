"""What the controller has observed of the hosts, and how events update it.

The view holds facts (last heartbeat, worker state, steps), never decisions.
`observe` folds one event into it in O(1) and says whether the event can
change a decision; heartbeats that change nothing do not wake `decide`.
No I/O and no clock reads here: times come in with the events.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import signal as signals
from collections.abc import Collection, Iterator


class WorkerState(enum.Enum):
    """A worker as its agent sees it."""
    IDLE = "idle"
    RUNNING = "running"
    EXITED = "exited"


@dataclasses.dataclass(slots=True)
class WorkerObs:
    """An agent's report of its worker.

    generation: the worker's generation (0 = never started one).
    exit_code / signal: how it ended when EXITED (signal 0 = normal exit).
    step / committed_step: last reported training / checkpoint step, -1 none.
    process_id / num_processes: its rank in its generation and the
      generation's process count (0 / 0: not reported).
    failure_cause: "" (not said), or the worker's word that it is failing
      (it may still be running): "own" (its own error) or "peer" (a
      collective failed under it: a peer's failure seen from here).
    """

    generation: int = 0
    state: WorkerState = WorkerState.IDLE
    pid: int = 0
    exit_code: int = 0
    signal: int = 0
    stderr_tail: str = ""
    stopped_on_request: bool = False
    step: int = -1
    committed_step: int = -1
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    suspended: bool = False
    process_id: int = 0
    num_processes: int = 0
    failure_cause: str = ""

    @property
    def running(self) -> bool:
        return self.state is WorkerState.RUNNING

    @property
    def succeeded(self) -> bool:
        return self.state is WorkerState.EXITED and self.exit_code == 0 and self.signal == 0

    @property
    def failed_by_peer(self) -> bool:
        """Whether its failure reads as another process's seen from here: a
        collective failed under it ("peer"), or JAX's coordination service
        aborted it (SIGABRT, what it does to the peers of a dead process)."""
        return self.failure_cause == "peer" or (self.signal == signals.SIGABRT
                                                and self.failure_cause != "own")

    def describe_exit(self) -> str:
        """"exit code 3" / "signal 9 (SIGKILL)", for reasons."""
        if self.signal:
            try:
                name = signals.Signals(self.signal).name
            except ValueError:
                name = "?"
            return f"signal {self.signal} ({name})"
        return f"exit code {self.exit_code}"


@dataclasses.dataclass(slots=True)
class HostRecord:
    """One registered host. Times are controller-monotonic seconds."""

    host_id: str
    incarnation: str
    devices: int
    address: str
    failure_domain: str
    agent_pid: int
    registered_at: float
    last_heartbeat_at: float
    free_port: int = 0
    worker: WorkerObs = dataclasses.field(default_factory=WorkerObs)
    exited_at: float = 0.0
    first_step_at: float = 0.0
    # When the worker's step last went up (0: no step in this generation yet).
    step_at: float = 0.0
    # Steps its reports went up by per report, lately (a decaying maximum, in
    # this generation): how far its worker may have gone past its last report.
    step_jump: int = 0
    # Since when its agent reports the worker stopped (SIGSTOP; 0: it is not).
    suspended_at: float = 0.0
    # Why the host is being taken away ("" if it is not), and since when.
    preemption: str = ""
    preempted_at: float = 0.0
    device_kind: str = ""
    # When its agent last reported a different device count or kind (0: never).
    devices_changed_at: float = 0.0
    # The generation whose worker said it took its last step and is finishing
    # (writing its last checkpoint, leaving the distributed runtime); 0: none.
    finishing_generation: int = 0
    # the agent's own gRPC port and metrics port at `address` (0: none)
    service_port: int = 0
    metrics_port: int = 0
    # Whether anything came on its stream since it registered.
    streamed: bool = False
    # When it registered first since something last came on one of its
    # streams: registrations again without a message on a stream (a host
    # flapping) keep it, so that the wait for opening streams is bounded.
    unstreamed_since: float = 0.0


# --- events (made by the servicer from messages) ---------------------------

@dataclasses.dataclass(frozen=True)
class Registered:
    """An agent registered (a new incarnation, or the same one reconnecting)."""
    host_id: str
    incarnation: str
    devices: int
    address: str
    failure_domain: str
    agent_pid: int
    free_port: int
    worker: WorkerObs
    device_kind: str = ""
    # what the agent did when it heard no controller for its lease
    fenced: str = ""
    # the agent's own gRPC port and metrics port at `address` (0: none)
    service_port: int = 0
    metrics_port: int = 0


@dataclasses.dataclass(frozen=True)
class HeartbeatReceived:
    """A heartbeat: the whole worker status, a free port for a coordinator,
    the preemption reason once the host is being taken away, and the host's
    device count and kind as its agent counts them now (devices 0: not
    reported)."""
    host_id: str
    incarnation: str
    worker: WorkerObs
    free_port: int
    preemption: str = ""
    devices: int = 0
    device_kind: str = ""


@dataclasses.dataclass(frozen=True)
class Disconnected:
    """The agent's stream to the controller ended without the agent
    registering again first: its process died (the kernel closes its
    sockets at once), it exited, or the connection broke."""
    host_id: str
    incarnation: str


@dataclasses.dataclass(frozen=True)
class WorkerExited:
    """A worker ended (reported the moment its agent reaped it)."""
    host_id: str
    incarnation: str
    worker: WorkerObs


@dataclasses.dataclass(frozen=True)
class ProgressReported:
    """A first step, a committed checkpoint step or new metrics, sent at once."""
    host_id: str
    incarnation: str
    generation: int
    step: int
    committed_step: int
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)


# What a worker may write into the journal through its agent.
WORKER_EVENT_KINDS = frozenset({"worker_phases", "checkpoint_restored",
                                "checkpoint_restore_failed", "checkpoint_saved",
                                "checkpoint_save_failed", "checkpoint_save_skipped",
                                "checkpoint_save_delayed", "checkpoint_delete_failed",
                                "worker_finishing", "compiled_ahead"})


@dataclasses.dataclass(frozen=True)
class WorkerReported:
    """A worker's own journal entry (kind in WORKER_EVENT_KINDS)."""

    host_id: str
    incarnation: str
    generation: int
    kind: str
    reason: str
    fields: dict


@dataclasses.dataclass(frozen=True)
class StacksReported:
    """A hung worker's stacks, dumped by its agent before its stop."""

    host_id: str
    incarnation: str
    generation: int
    process_id: int
    pid: int
    stacks: str
    frame: str
    error: str


@dataclasses.dataclass(frozen=True)
class StaleReportRefused:
    """A report about a worker of an older generation, refused by fencing."""

    host_id: str
    incarnation: str
    generation: int
    current_generation: int
    kind: str


Event = (Registered | HeartbeatReceived | Disconnected | WorkerExited | ProgressReported
         | WorkerReported | StacksReported | StaleReportRefused)


@dataclasses.dataclass(frozen=True)
class Fact:
    """Something observed that belongs in the journal (kind, host, reason, fields)."""

    kind: str
    host: str
    generation: int
    reason: str
    fields: dict = dataclasses.field(default_factory=dict)


class ClusterView:
    """Registered hosts, kept in order of their last heartbeat (oldest first),
    so that finding silent hosts reads only the silent ones."""

    def __init__(self) -> None:
        self.hosts: collections.OrderedDict[str, HostRecord] = collections.OrderedDict()
        self.last_registration_at = float("-inf")
        # When a host's stream last sent its first message (it became startable).
        self.last_stream_opened_at = float("-inf")
        # Latest committed checkpoint step any worker reported, and when.
        self.committed_step = -1
        self.committed_at = float("-inf")
        # When the latest save started (a save is in flight while this is
        # newer than committed_at), its step and the generation of the
        # worker that said so; the step of the latest emergency (preemption)
        # save.
        self.save_started_at = float("-inf")
        self.save_step = -1
        self.save_generation = 0
        self.emergency_save_step = -1
        self.emergency_save_at = float("-inf")
        # When an emergency save said it waits for the save before it
        # (checkpoint_save_delayed), and the generation of its worker.
        self.emergency_delayed_at = float("-inf")
        self.emergency_delayed_generation = 0
        # When the latest emergency save was reported failed, and why.
        self.emergency_failed_at = float("-inf")
        self.emergency_failure = ""
        # The latest median step time (seconds) any worker reported (metric
        # step_time_s), kept across generations: a worker measures its
        # generation's first at its second step (see step_time).
        self.step_time_s: float | None = None
        # Hosts whose stream ended and that have not registered since: when.
        self.disconnected: dict[str, float] = {}
        # Seconds the controller itself is behind (its loop's lag lately, see
        # elastic.controller.lag): what it has not read yet is not silence, so
        # every silence limit is judged against limit + lag_s.
        self.lag_s = 0.0

    def forgive_pause(self, pause_s: float, now: float,
                      lost: Collection[str] = frozenset()) -> None:
        """The controller itself did not run for `pause_s` seconds up to
        `now` (it was stopped, starved of CPU, or its VM suspended): what it
        could not hear meanwhile is not silence. Moves every time silence is
        measured from (last heartbeat, last step, stream closed) `pause_s`
        later, to `now` at most (what was heard since it resumed stays),
        except for hosts already `lost`: their silence was judged, and
        moving it would read as their heartbeats resumed (a lost host
        "returned" after every pause of the controller, bench/scale.py at
        10,000 agents on 2026-11-26). The records stay in order of their
        last heartbeat."""
        for record in self.hosts.values():
            if record.host_id in lost:
                continue
            record.last_heartbeat_at = min(record.last_heartbeat_at + pause_s, now)
            if record.step_at:
                record.step_at = min(record.step_at + pause_s, now)
        for host, at in self.disconnected.items():
            if host not in lost:
                self.disconnected[host] = min(at + pause_s, now)
        if lost:  # (a lost host's clock stayed: others may have moved past it)
            for host in sorted(self.hosts, key=lambda h: self.hosts[h].last_heartbeat_at):
                self.hosts.move_to_end(host)

    def save_in_flight(self, generation: int) -> str:
        """What `generation`'s workers are saving ("" if nothing): a save
        they started that has neither committed nor failed, or an emergency
        (preemption) save that waits for the save before it and has neither
        started nor failed yet. The latter counts from the moment the save
        before it commits: the emergency save starts only then, and the
        workers, stopped at the preemption sync point, take no step
        meanwhile (without it, a commit more than the hang timeout after
        the last step read as a hang, which killed the emergency save). A
        save of an older generation does not count: its workers are gone,
        and it never commits."""
        if self.save_generation == generation and self.save_started_at > self.committed_at:
            return "a checkpoint save in flight"
        if self.emergency_delayed_generation == generation and \
                self.emergency_delayed_at > max(self.emergency_save_at, self.emergency_failed_at):
            return "an emergency save waiting for the save before it"
        return ""

    def step_time(self, worker: WorkerObs) -> float | None:
        """`worker`'s median step time (seconds) if it reported one in its
        generation, else the latest any worker of the job reported (None:
        none ever did). A generation's workers start with no metrics, and
        until their second step they have measured no step: without the
        last generation's, a job of 15 s steps read as hung (the 10 s floor)
        between the first and second steps of every generation."""
        own = worker.metrics.get("step_time_s")
        return own if own and own > 0 else self.step_time_s

    def _learn(self, metrics: dict[str, float]) -> None:
        """Keep the step time `metrics` carry (step_time_s, seconds), if any."""
        value = metrics.get("step_time_s")
        if value and value > 0:
            self.step_time_s = value

    def get(self, host_id: str) -> HostRecord | None:
        """The record of `host_id`, None if it never registered."""
        return self.hosts.get(host_id)

    def silent(self, cutoff: float) -> Iterator[HostRecord]:
        """Hosts whose last heartbeat is older than `cutoff`, oldest first."""
        for record in self.hosts.values():
            if record.last_heartbeat_at >= cutoff:
                return
            yield record

    def _touch(self, record: HostRecord, now: float) -> bool:
        """A message came from `record`'s host on its stream at `now`; True
        if it is the stream's first (the host can now be sent a start)."""
        opened = not record.streamed
        record.last_heartbeat_at, record.streamed = now, True
        self.hosts.move_to_end(record.host_id)
        if opened:
            self.last_stream_opened_at = now
        return opened


def command_taken(worker: WorkerObs, command: str, generation: int) -> bool:
    """Whether an agent that reports `worker` has acted on the `command`
    ("start" or "stop") of `generation`: it reports that generation's
    worker or a later one, for a start; no worker of that generation or an
    older one running, for a stop (it stopped, or never started it).
    Raises ValueError for any other command."""
    if command == "start":
        return worker.generation >= generation
    if command == "stop":
        return not (worker.running and worker.generation <= generation)
    raise ValueError(f"not a command a host acts on: {command!r}")


def _merge_worker(record: HostRecord, reported: WorkerObs, now: float) -> bool:
    """Take the agent's report; True when something a decision reads changed."""
    old = record.worker
    changed = (old.generation != reported.generation or old.state is not reported.state
               or (old.step < 0 <= reported.step))
    if reported.state is WorkerState.EXITED and (changed or not record.exited_at):
        record.exited_at = now
    if old.step < 0 <= reported.step or old.generation != reported.generation:
        record.first_step_at = now if reported.step >= 0 else 0.0
    if old.generation != reported.generation:
        record.step_at = now if reported.step >= 0 else 0.0
        record.step_jump = 0
    elif reported.step > old.step:
        record.step_at = now
        _note_jump(record, old.step, reported.step)
    changed |= old.suspended != reported.suspended or old.failure_cause != reported.failure_cause
    record.suspended_at = (record.suspended_at or now) if reported.suspended else 0.0
    record.worker = reported
    return changed


def _note_jump(record: HostRecord, old_step: int, step: int) -> None:
    """Fold one report's step increase into record.step_jump (halved at
    every report, so one slow report ages out)."""
    if old_step >= 0:
        record.step_jump = max(step - old_step, record.step_jump // 2)


def _note_commit(view: ClusterView, record: HostRecord, generation: int,
                 committed_step: int, now: float) -> list[Fact]:
    """Record a committed checkpoint step newer than any seen, or the commit
    of the save in flight; its journal fact.

    Steps are global (one checkpoint directory per job), so the first host to
    report a step is the one journaled."""
    new = committed_step > record.worker.committed_step  # (for this worker)
    record.worker.committed_step = max(record.worker.committed_step, committed_step)
    if committed_step <= view.committed_step:
        # A step below the newest ever committed: after a restore fell back
        # past a step that would not read. The save in flight (or the
        # emergency save a drain waits for) committed now; the newest step
        # stays the newest. (Before, such a commit went unnoticed, and the
        # save stayed in flight, 60 s more on every hang timeout, until
        # training passed the old newest step.)
        emergency = committed_step == view.emergency_save_step and \
            view.committed_at < view.emergency_save_at
        in_flight = new and committed_step >= view.save_step and \
            view.committed_at < view.save_started_at
        if not (emergency or in_flight):
            return []
        view.committed_at = now
        return [Fact("checkpoint_committed", record.host_id, generation,
                     f"checkpoint step {committed_step} committed ("
                     + ("emergency; " if emergency else "")
                     + f"step {view.committed_step} is newer)", {"step": committed_step})]
    view.committed_step, view.committed_at = committed_step, now
    return [Fact("checkpoint_committed", record.host_id, generation,
                 f"checkpoint step {committed_step} committed", {"step": committed_step})]


def _devices_changed(record: HostRecord, devices: int, kind: str, now: float) -> list[Fact]:
    """The journal fact for a host whose agent now reports other devices
    than `devices` of `kind` (none if it does not); notes when."""
    if (devices, kind) == (record.devices, record.device_kind):
        return []
    record.devices_changed_at = now
    was = f"{devices} {kind}".strip()
    now_has = f"{record.devices} {record.device_kind}".strip()
    return [Fact("host_devices_changed", record.host_id, record.worker.generation,
                 f"its agent now counts {now_has} device(s); it had {was}",
                 {"devices": record.devices, "device_kind": record.device_kind,
                  "previous_devices": devices, "previous_device_kind": kind})]


def observe(view: ClusterView, event: Event, now: float) -> tuple[bool, list[Fact]]:
    """Fold `event` (received at `now`) into `view`.

    Returns (relevant, facts): relevant is False for a heartbeat that changed
    nothing a decision reads; facts are journal entries the event implies.
    Events from an incarnation other than the registered one are ignored
    (the servicer fences them before they get here).
    """
    if isinstance(event, Registered):
        old = view.hosts.pop(event.host_id, None)
        record = HostRecord(
            host_id=event.host_id, incarnation=event.incarnation, devices=event.devices,
            address=event.address, failure_domain=event.failure_domain,
            agent_pid=event.agent_pid, registered_at=now, last_heartbeat_at=now,
            free_port=event.free_port, worker=event.worker, device_kind=event.device_kind,
            service_port=event.service_port, metrics_port=event.metrics_port,
            unstreamed_since=old.unstreamed_since if old is not None and not old.streamed
            else now)
        view.hosts[event.host_id] = record
        view._learn(event.worker.metrics)
        if record.unstreamed_since == now:  # (not one registering again without a stream)
            view.last_registration_at = now
        view.disconnected.pop(event.host_id, None)
        fenced = [Fact("host_fenced", event.host_id, event.worker.generation, event.fenced,
                       {"incarnation": event.incarnation})] if event.fenced else []
        if old is not None and old.incarnation == event.incarnation:
            record.exited_at, record.first_step_at = old.exited_at, old.first_step_at
            record.devices_changed_at = old.devices_changed_at
            # its worker's step clock goes on from the old record (a fresh
            # one, step_at 0, read as "no step since the generation's first"
            # and made a broken stream a hang at once), advanced by what
            # the registration reports
            record.worker, record.step_at = old.worker, old.step_at
            record.step_jump, record.suspended_at = old.step_jump, old.suspended_at
            _merge_worker(record, event.worker, now)
            # a reconnect of the same agent process, which may have counted
            # its devices again meanwhile
            return True, fenced + _devices_changed(record, old.devices, old.device_kind, now)
        replaced = f", replacing incarnation {old.incarnation}" if old else ""
        kind = f" ({event.device_kind})" if event.device_kind else ""
        return True, [Fact("host_registered", event.host_id, event.worker.generation,
                           f"{event.devices} devices{kind} at {event.address}, failure domain "
                           f"{event.failure_domain}{replaced}",
                           {"incarnation": event.incarnation, "devices": event.devices,
                            "device_kind": event.device_kind,
                            "agent_pid": event.agent_pid})] + fenced
    record = view.hosts.get(event.host_id)
    if record is None or record.incarnation != event.incarnation:
        return False, []
    if isinstance(event, HeartbeatReceived):
        opened = view._touch(record, now)
        record.free_port = event.free_port or record.free_port
        facts = _note_commit(view, record, event.worker.generation,
                             event.worker.committed_step, now)
        changed = _merge_worker(record, event.worker, now)
        view._learn(event.worker.metrics)
        if event.devices and (event.devices, event.device_kind) != (record.devices,
                                                                     record.device_kind):
            old = record.devices, record.device_kind
            record.devices, record.device_kind = event.devices, event.device_kind
            facts += _devices_changed(record, *old, now)
        if event.preemption and not record.preemption:
            record.preemption, record.preempted_at = event.preemption, now
            facts.append(Fact("preemption_notice", event.host_id, event.worker.generation,
                              f"host is being taken away: {event.preemption}"))
        return opened or changed or bool(facts), facts
    if isinstance(event, Disconnected):
        view.disconnected[event.host_id] = now
        return True, []
    if isinstance(event, WorkerExited):
        view._touch(record, now)
        _merge_worker(record, event.worker, now)
        w = event.worker
        how = "on request" if w.stopped_on_request else "by itself"
        tail = w.stderr_tail.strip().splitlines()[-1:] if w.stderr_tail.strip() else []
        return True, [Fact("worker_exited", event.host_id, w.generation,
                           f"worker pid {w.pid} ended {how} with {w.describe_exit()}"
                           + (f"; stderr: {tail[0][:200]}" if tail else ""),
                           {"exit_code": w.exit_code, "signal": w.signal,
                            "stopped_on_request": w.stopped_on_request, "step": w.step,
                            "failure_cause": w.failure_cause,
                            "stderr_tail": w.stderr_tail[-2000:]})]
    if isinstance(event, ProgressReported):
        opened = view._touch(record, now)  # (an agent sends what it queued first)
        w = record.worker
        if event.generation != w.generation:
            return opened, []
        facts = _note_commit(view, record, event.generation, event.committed_step, now)
        first = w.step < 0 <= event.step
        if first:
            record.first_step_at = now
        if event.step > w.step:
            record.step_at = now
            _note_jump(record, w.step, event.step)
            if event.metrics:
                w.metrics = dict(event.metrics)
                view._learn(w.metrics)
        w.step = max(w.step, event.step)
        return opened or first or bool(facts), facts
    if isinstance(event, StacksReported):
        who = f"rank {event.process_id} (pid {event.pid})"
        reason = f"{who} was stuck in {event.frame}" if event.stacks else \
            f"no stacks of {who}: {event.error}"
        return False, [Fact("worker_stacks", event.host_id, event.generation, reason,
                            {"rank": event.process_id, "pid": event.pid, "frame": event.frame,
                             "stacks": event.stacks})]
    if isinstance(event, WorkerReported):
        if event.kind not in WORKER_EVENT_KINDS or event.generation != record.worker.generation:
            return False, []
        if event.kind == "checkpoint_saved":
            view.save_started_at, view.save_generation = now, event.generation
            view.save_step = int(event.fields.get("step", -1))
            if event.fields.get("preemption"):
                view.emergency_save_step = int(event.fields.get("step", -1))
                view.emergency_save_at = now
        if event.kind == "checkpoint_save_delayed" and event.fields.get("preemption"):
            view.emergency_delayed_at = now
            view.emergency_delayed_generation = event.generation
        if event.kind == "worker_finishing":
            record.finishing_generation = event.generation
        if event.kind == "checkpoint_save_failed":
            view.save_started_at = float("-inf")  # nothing is being written any more
            if event.fields.get("preemption"):
                view.emergency_failed_at = now
                view.emergency_failure = event.reason
        changed = event.kind in ("checkpoint_saved", "checkpoint_save_failed")
        return changed, [Fact(event.kind, event.host_id, event.generation, event.reason,
                              dict(event.fields))]
    if isinstance(event, StaleReportRefused):
        return False, [Fact("stale_message_rejected", event.host_id, event.current_generation,
                            f"{event.kind} about generation {event.generation} refused: the "
                            f"current generation is {event.current_generation}",
                            {"stale_generation": event.generation, "message": event.kind})]
    raise TypeError(f"unknown event {event!r}")
