"""The executor: the only controller code with side effects.

It turns the actions `decide` returns into journal lines and messages on the
agents' streams. Sending never blocks: each agent stream has its own queue.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from typing import Callable

import grpc

from elastic import config

from elastic import worker_env
from elastic.clock import Clock
from elastic.config import JobSpec
from elastic.controller.journal import JournalWriter
from elastic.heartbeat_datagram import DatagramChannel
from elastic.policy import decide as d
from elastic.policy.view import ClusterView, Fact, command_taken
from elastic.v1 import control_pb2 as pb

log = logging.getLogger("elasticd")


#: Messages an agent's stream may have waiting for it; an agent that does
#: not read its stream (flow control holds them back) is disconnected
#: rather than let them grow without bound.
MAX_OUTBOX = 1024
#: The commands a held-back stream copy belongs to (Session.send).
COMMANDS = ("start", "stop")
#: A start or a stop sent as a datagram is queued on the host's stream too,
#: after this many heartbeat intervals, unless the host's heartbeats say it
#: acted on it: a lost datagram delays a command by that much, and the
#: controller is spared a stream write per host when it is not lost
#: (thousands of them, at ~0.1-0.2 ms each, were most of a start's and a
#: stop's fan-out: bench/scale.py, 2026-11-26). The agent acts on a command's
#: first copy only (elastic.agent.agent).
COPY_AFTER_INTERVALS = 1.0
#: Commands go as datagrams to hosts whose heartbeat datagram was taken
#: within this many heartbeat intervals (the agent's datagram path works).
DATAGRAMS_HEARD_INTERVALS = 3.0


@dataclasses.dataclass(eq=False)
class Session:
    """One agent registration: the incarnation it belongs to, the SHA-256
    of the certificate it registered with ("" without TLS) and the outbox its
    stream (Connect, at most one) drains. Compared and hashed by identity:
    two registrations are never the same one.

    `close(code, details)` ends the stream with that gRPC status."""

    host_id: str
    incarnation: str
    fingerprint: str = ""
    #: when it registered (controller-monotonic seconds)
    registered_at: float = 0.0
    outbox: asyncio.Queue = dataclasses.field(default_factory=asyncio.Queue)
    close_status: tuple | None = None
    attached: bool = False
    #: when the controller took its stream up: read its first message
    #: (controller wall-clock seconds; 0.0 until then)
    attached_at: float = 0.0
    #: when its latest heartbeat ack was queued (controller-monotonic seconds)
    acked_at: float = float("-inf")
    #: its heartbeat datagrams (elastic.heartbeat_datagram; None: stream only),
    #: how to answer where the latest came from, and when one was last acked
    datagrams: DatagramChannel | None = None
    datagram_reply: Callable[[bytes], None] | None = None
    datagram_acked_at: float = float("-inf")
    #: when its latest heartbeat datagram was taken (controller-monotonic seconds)
    datagram_heard_at: float = float("-inf")
    #: the highest header.seq seen from the agent; how its last heartbeat came
    last_seq: int = 0
    heartbeat_path: str = ""
    #: a command sent as a datagram whose stream copy is held back (see send)
    copy_due: pb.ControllerMessage | None = None
    #: the last start or stop sent to it (a registration of the same agent
    #: process sends it again: elastic.controller.servicer)
    last_command: pb.ControllerMessage | None = None

    def send(self, message: pb.ControllerMessage, datagram: bool = False,
             payload: bytes | None = None, hold_copy: bool = True) -> None:
        """Queue `message`; past MAX_OUTBOX waiting, close the stream
        (RESOURCE_EXHAUSTED) instead. With `datagram` (a command the agent
        may get twice: a start or a stop), send it at once as a datagram to
        where the host's latest came from, if it fits, and with `hold_copy`
        (the executor's choice for hosts whose datagrams it hears lately)
        hold its stream copy back in `copy_due` instead of queuing it (the
        executor queues it later, unless the host has acted on it by then:
        Executor.COPY_AFTER_INTERVALS). A later start or stop supersedes a
        copy still held back (acks and refusals do not). `payload`:
        `message` already serialized (a message sent to many hosts is
        serialized once)."""
        if self.close_status is not None:
            return
        if message.WhichOneof("body") in COMMANDS:
            self.copy_due = None
            self.last_command = message
        if datagram and self.datagram_reply is not None:
            try:
                self.datagram_reply(self.datagrams.seal(
                    payload if payload is not None else message.SerializeToString()))
                if hold_copy:
                    self.copy_due = message
                    return
            except ValueError:  # too long for a datagram: the stream only
                pass
        self.queue(message)

    def queue(self, message: pb.ControllerMessage) -> None:
        """Put `message` on the stream's outbox; past MAX_OUTBOX waiting,
        close the stream (RESOURCE_EXHAUSTED) instead."""
        if self.close_status is not None:
            return
        if self.outbox.qsize() >= MAX_OUTBOX:
            self.close(grpc.StatusCode.RESOURCE_EXHAUSTED,
                       f"more than {MAX_OUTBOX} messages wait for this agent; it does not read "
                       f"its stream")
            return
        self.outbox.put_nowait(message)

    def close(self, code=None, details: str = "") -> None:
        self.close_status = (code, details)
        self.outbox.put_nowait(None)


class Executor:
    """Applies actions. `sessions` maps host id to its open stream; `run_id`
    names this run of the job to the workers (local snapshots of another run
    are never restored): the one given (the journal's, kept by every
    controller that takes the job over), else a new one. `term`: this
    controller's leadership term, sent with every command
    (elastic.controller.leadership). `view`: the controller's view of the
    hosts, read to skip the stream copies of commands hosts acted on (None:
    every copy is sent)."""

    def __init__(self, spec: JobSpec, journal: JournalWriter, clock: Clock,
                 run_id: str = "", term: int = 0, view: ClusterView | None = None) -> None:
        self.run_id = run_id or uuid.uuid4().hex[:16]
        self.term = term
        self.spec = spec
        self.journal = journal
        self.clock = clock
        self.sessions: dict[str, Session] = {}
        #: host -> the latest start or stop that found it without a session
        #: (its stream broke): sent when the same agent registers again, if
        #: still due (elastic.controller.servicer)
        self.undelivered: dict[str, pb.ControllerMessage] = {}
        self.view = view
        #: whether `controller_stopped` was journaled: nothing is journaled after it
        self.stopped = False
        #: stream copies of datagram commands queued, and skipped (send_copies)
        self.copies_sent = self.copies_skipped = 0
        #: None, or the controller's check that it may still act (Controller.may_act)
        self.may_act = None

    def worker_env(self) -> dict[str, str]:
        """Job-level variables every worker gets (hosts add their own)."""
        return {**self.spec.env,
                worker_env.ENV_JOB_ID: self.spec.job_id,
                worker_env.ENV_RUN_ID: self.run_id,
                worker_env.ENV_MESH: self.spec.mesh.to_text(),
                worker_env.ENV_CHECKPOINT_DIR: self.spec.checkpoint_dir or "",
                worker_env.ENV_JAX_HEARTBEAT_TIMEOUT_S:
                    str(config.jax_heartbeat_timeout_s(self.spec)),
                worker_env.ENV_BATCH_MODE: self.spec.batch.mode,
                worker_env.ENV_LR_SCALING: self.spec.batch.lr_scaling}

    def launch(self) -> pb.StartWorker:
        """The job's worker command — argv, job-level env, workdir and
        whether agents pre-start the next process — without generation or
        rank (a start fills those in; registration sends it as is)."""
        return pb.StartWorker(argv=list(self.spec.command), env=self.worker_env(),
                              workdir=self.spec.workdir,
                              prestart_next=self.spec.restart.prestart_workers)

    def record(self, kind: str, generation: int, reason: str, host: str | None = None,
               fields: dict | None = None) -> dict | None:
        """Journal one entry (timestamped with the injected clock), log it and
        return it (None when not journaled). A line the disk refuses is lost,
        logged and counted, not raised (JournalWriter): a full disk on host 0
        does not stop the job.
        After `controller_stopped` only log it: a controller's journal ends
        with its own stop (a killed host's agent registering again while the
        server shut down was journaled after it, under load)."""
        log.info("%s gen=%s%s: %s", kind, generation, f" host={host}" if host else "", reason)
        if self.stopped:
            return None
        self.stopped = kind == "controller_stopped"
        return self.journal.write(self.clock.time(), kind, generation, reason, host, fields)

    def record_facts(self, facts: list[Fact]) -> None:
        """Journal the facts `observe` returned."""
        for fact in facts:
            self.record(fact.kind, fact.generation, fact.reason, fact.host, fact.fields)

    def send(self, host: str, message: pb.ControllerMessage, datagram: bool = False,
             payload: bytes | None = None) -> Session | None:
        """Send `message` on `host`'s session (with `datagram` as a datagram
        first, its stream copy held back: Session.send); returns the
        session, or None (and a warning) when the host has no registration
        (its heartbeats will show what it runs). `payload`: `message`
        already serialized, with this executor's term in it. Raises
        ValueError for a payload of another term."""
        session = self.sessions.get(host)
        if payload is not None and message.term != self.term:
            raise ValueError(f"a payload serialized with term {message.term}, not {self.term}")
        message.term = self.term
        command = message.WhichOneof("body") in COMMANDS
        if session is None:
            log.warning("no stream to host %s; %s not sent (its heartbeats will tell)",
                        host, message.WhichOneof("body"))
            if command:
                self.undelivered[host] = message
            return None
        if command:
            self.undelivered.pop(host, None)
        # A host heard by datagram lately: the way back is likely open too,
        # and its stream copy is held back. One heard by datagram before but
        # not lately heartbeats on its stream: its datagrams went unacked,
        # because UDP is blocked one way or because this controller fell
        # behind and its socket dropped them (bench/scale.py at 10,000
        # agents: thousands of hosts moved to their streams after a start,
        # and the next stop reached them seconds late through the controller's
        # stream writes). It gets the datagram too, which costs one send, and
        # its stream copy at once; the agent acts on the first to arrive.
        recent = self.clock.monotonic() - session.datagram_heard_at <= \
            self.spec.health.heartbeat_interval_s * DATAGRAMS_HEARD_INTERVALS
        session.send(message, datagram, payload, hold_copy=recent)
        return session

    def apply(self, actions: tuple[d.Action, ...]) -> None:
        """Perform `actions` in order. Raises TypeError on an unknown action.

        The job-level part of the start messages is built once per call and
        copied into each (a third of the time per host: ~3 us against ~9 us,
        which at 10,000 hosts is 30 ms against 90 ms of the loop). Starts
        and stops go as datagrams where heartbeats come that way, their
        stream copies COPY_AFTER_INTERVALS heartbeat intervals later to the
        hosts that have not acted on them by then (`send_copies`; outside
        a running event loop, which cannot time them, on the stream only)."""
        launch, held = None, []
        stops: dict[tuple, tuple[pb.ControllerMessage, bytes]] = {}  # one message a kind
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        for action in actions:
            session = message = None
            if isinstance(action, d.Journal):
                self.record(action.kind, action.generation, action.reason, action.host,
                            dict(action.fields))
            elif isinstance(action, d.StartWorker):
                if launch is None:
                    launch = self.launch()
                start = pb.StartWorker()
                start.CopyFrom(launch)
                start.generation, start.process_id = action.generation, action.process_id
                start.num_processes = action.num_processes
                start.coordinator_address = action.coordinator_address
                start.devices_per_host = action.devices_per_host
                start.replica_host = action.replica_host
                start.replica_address = action.replica_address
                start.replica_senders.extend(action.replica_senders)
                for processes, per_host in action.next_slices:
                    start.next_slices.add(num_processes=processes, devices_per_host=per_host)
                message = pb.ControllerMessage(job_id=self.spec.job_id,
                                               generation=action.generation, start=start)
                session = self.send(action.host, message, datagram=loop is not None)
            elif isinstance(action, d.StopWorker):
                # A slice's stop is the same message to every member: built and
                # serialized once (shared by the held copies too, which are
                # told apart by their sessions). A hang's stop, which first
                # dumps the worker's stacks, goes on the stream only: dumping
                # twice would cost seconds.
                kind = (action.generation, action.grace_s, action.reason, action.dump_stacks)
                if kind not in stops:
                    stop = pb.ControllerMessage(
                        job_id=self.spec.job_id, generation=action.generation, term=self.term,
                        stop=pb.StopWorker(generation=action.generation, grace_s=action.grace_s,
                                           reason=action.reason, dump_stacks=action.dump_stacks))
                    stops[kind] = stop, stop.SerializeToString()
                message, payload = stops[kind]
                session = self.send(action.host, message,
                                    datagram=loop is not None and not action.dump_stacks,
                                    payload=payload)
            elif isinstance(action, d.Finish):
                pass  # the loop ends on the terminal phase
            else:
                raise TypeError(f"unknown action {action!r}")
            if session is not None and session.copy_due is message:
                held.append((session, message))
        if held:
            loop.call_later(COPY_AFTER_INTERVALS * self.spec.health.heartbeat_interval_s,
                            self.send_copies, held)

    def send_copies(self, held: list[tuple[Session, pb.ControllerMessage]]) -> None:
        """Queue the stream copies of the commands in `held` ((session,
        message), sent as datagrams) that are still due: not superseded by a
        later command, to a host that has not acted on them
        (elastic.policy.view.command_taken: its reports say), on the
        session it was sent on or a new one of the same agent process (it
        registered again meanwhile). None while `may_act()` says this
        controller's leadership may have passed (as its decisions). Counted
        in `copies_sent` and `copies_skipped`."""
        if self.may_act is not None and not self.may_act():
            self.copies_skipped += len(held)
            return
        for session, message in held:
            host = session.host_id
            try:
                if session.copy_due is not message:
                    continue  # superseded (that command handles its own copy)
                session.copy_due = None
                current = self.sessions.get(host)
                record = self.view.get(host) if self.view is not None else None
                if current is None or current.incarnation != session.incarnation or \
                        current.close_status is not None or (
                        record is not None and record.incarnation == session.incarnation and
                        command_taken(record.worker, message.WhichOneof("body"),
                                      message.generation)):
                    self.copies_skipped += 1
                else:
                    self.copies_sent += 1
                    current.queue(message)
            except Exception:  # noqa: BLE001 - one host's copy must not cost the others theirs
                log.exception("stream copy of a command to host %s failed", host)
