"""The gRPC servicer: a thin adapter that turns agent messages into events.

Before a message becomes an event it passes, in order: the caps on
concurrent calls per peer and in total (RESOURCE_EXHAUSTED), the peer's
identity (a host certificate speaks only for its own host id, a stream only
with the certificate its host registered with; status is for operator and
controller certificates: PERMISSION_DENIED), the checks of
`elastic.controller.admission` (INVALID_ARGUMENT, or a `Rejected` message on
a stream), a budget of reports per host, and fencing: a message from an
incarnation that a newer registration replaced ends its stream with
FAILED_PRECONDITION; a report about a worker of an older generation is
answered with `Rejected`. Committed checkpoint steps count only from the
host of rank 0 of the latest generation (the one process that reports
commits). Refusals are journaled as `message_refused`, at most one line per
host and kind every REFUSAL_JOURNAL_INTERVAL_S (the next says how many were
not journaled).
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Callable

import grpc

from elastic import heartbeat_datagram as hd
from elastic import protocol
from elastic import transport
from elastic.controller import admission as adm
from elastic.controller.core import Controller
from elastic.controller.executor import Session
from elastic.controller.status import job_status
from elastic.policy import silence
from elastic.policy import view as v
from elastic.policy.state import Phase, SliceState
from elastic.security.identity import Identity, IdentityError
from elastic.security.text import clean_text
from elastic.security.tls import peer_identity
from elastic.v1 import control_pb2 as pb
from elastic.v1 import control_pb2_grpc as pb_grpc

log = logging.getLogger("elasticd")

_STATES = {pb.WORKER_IDLE: v.WorkerState.IDLE, pb.WORKER_RUNNING: v.WorkerState.RUNNING,
           pb.WORKER_EXITED: v.WorkerState.EXITED}
_FAILURE_CAUSES = {pb.FAILURE_CAUSE_OWN: "own", pb.FAILURE_CAUSE_PEER: "peer"}
_CODES = {"denied": grpc.StatusCode.PERMISSION_DENIED,
          "incompatible": grpc.StatusCode.FAILED_PRECONDITION,
          "invalid": grpc.StatusCode.INVALID_ARGUMENT,
          "implausible": grpc.StatusCode.INVALID_ARGUMENT}
#: Streams one peer may hold at once (an agent needs one; a reconnect may
#: overlap the old stream's end).
STREAMS_PER_PEER = 4
#: Seconds after its registration past which a stream taken up is logged,
#: with where the time went: before gRPC handed the call over (the agent, the
#: network, gRPC's queue), or before its first message was read. At 10,000
#: agents some streams waited over STREAM_OPEN_S (bench/scale.py, 2026-11-26).
STREAM_LATE_S = 10.0
#: At most one late stream is logged this often (seconds); the next line
#: counts those left out (2,387 late streams in one 10,000-agent run).
LATE_STREAM_LOG_INTERVAL_S = 5.0
#: Unary calls (Register, GetStatus) one peer may have in flight at once.
CALLS_PER_PEER = 8
#: A heartbeat is acked when the session's last ack that way is this fraction
#: of the heartbeat timeout old (an agent gives up on a controller after the
#: whole timeout, elastic.agent.session).
ACK_EVERY = hd.ACK_EVERY
#: Seconds a new stream may take to send its first message: as long as the
#: policy waits for a registered host's stream (when thousands of agents
#: connect at once, streams wait for seconds to be taken up).
FIRST_MESSAGE_TIMEOUT_S = silence.STREAM_OPEN_S
REFUSAL_JOURNAL_INTERVAL_S = 10.0
#: How often (seconds) the step the job is known to have reached is recomputed.
KNOWN_STEP_REFRESH_S = 1.0
UNDECODABLE = adm.Refusal("invalid", "the bytes received are not a valid message")
_parse_agent_message = transport.lenient(pb.AgentMessage)


def add_servicer(servicer: "ControllerServicer", server) -> None:
    """Serve `servicer` on `server` as the generated
    add_ControllerServicer_to_server does, with lenient deserializers:
    bytes that are no message reach the servicer as None.

    The methods are registered with gRPC core, not only handled
    generically: grpcio's asyncio server asks core for one call at a time
    per registered method and one for all unregistered ones, and hands the
    next over only after its serving loop has taken up the last. Before they
    were registered, Register, Connect and GetStatus waited in one queue: at
    10,000 agents an `elasticd status` waited 123 s behind the streams
    (bench/scale.py, 2026-11-26), while a health check, registered, waited
    seconds."""
    handlers = {
        "Register": grpc.unary_unary_rpc_method_handler(
            servicer.Register, request_deserializer=transport.lenient(pb.RegisterRequest),
            response_serializer=pb.RegisterResponse.SerializeToString),
        "Connect": grpc.stream_stream_rpc_method_handler(
            servicer.Connect, request_deserializer=transport.lenient(pb.AgentMessage),
            response_serializer=pb.ControllerMessage.SerializeToString),
        "GetStatus": grpc.unary_unary_rpc_method_handler(
            servicer.GetStatus, request_deserializer=transport.lenient(pb.StatusRequest),
            response_serializer=pb.JobStatus.SerializeToString),
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("elastic.v1.Controller", handlers),))
    server.add_registered_method_handlers("elastic.v1.Controller", handlers)


def worker_obs(status: pb.WorkerStatus) -> v.WorkerObs:
    """The policy's view of a WorkerStatus message (text cleaned and capped)."""
    return v.WorkerObs(
        generation=status.generation, state=_STATES.get(status.state, v.WorkerState.IDLE),
        pid=status.pid, exit_code=status.exit_code, signal=status.signal,
        stderr_tail=clean_text(status.stderr_tail, adm.MAX_STDERR_CHARS, keep_newlines=True),
        stopped_on_request=status.stopped_on_request,
        step=status.step, committed_step=status.committed_step, metrics=dict(status.metrics),
        suspended=status.suspended, process_id=status.process_id,
        num_processes=status.num_processes,
        failure_cause=_FAILURE_CAUSES.get(status.failure_cause, ""))


def _still_due(command: pb.ControllerMessage | None, state: SliceState, host: str) -> bool:
    """Whether `command`, the last start or stop sent to `host`, still
    stands: a start of the generation being started or run, of which
    `host` is a member not lost, or a stop of the generation being stopped."""
    if command is None or command.generation != state.generation:
        return False
    if command.WhichOneof("body") == "start":
        return state.phase in (Phase.STARTING, Phase.RUNNING) and host in state.members \
            and host not in state.lost
    return state.phase is Phase.STOPPING


def fence(controller: Controller, header: pb.Header) -> str | None:
    """Why a message with `header` must be refused, or None.

    Refused: another job's message, or an incarnation that is not the one
    registered for the host (replaced by a newer agent process, or never
    registered)."""
    if header.job_id != controller.spec.job_id:
        return (f"message for job {header.job_id[:128]!r} sent to the controller of job "
                f"{controller.spec.job_id!r}")
    record = controller.view.get(header.host_id)
    if record is None:
        return f"host {header.host_id!r} is not registered; call Register first"
    if record.incarnation != header.incarnation:
        return (f"incarnation {header.incarnation} of host {header.host_id} was replaced by "
                f"{record.incarnation}")
    return None


class LateStreamLog:
    """Which late stream take-ups are logged: the first, then at most one
    every `interval_s` seconds; the one logged carries how many were left
    out since the line before and the longest wait among them (seconds)."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._next_at = float("-inf")
        self._left_out = 0
        self._longest_s = 0.0

    def note(self, now: float, waited_s: float) -> tuple[int, float] | None:
        """A stream taken up at `now` (monotonic seconds) `waited_s` seconds
        after its registration: None if it is not to be logged, else (late
        streams left out before it, the longest wait among them)."""
        if now < self._next_at:
            self._left_out += 1
            self._longest_s = max(self._longest_s, waited_s)
            return None
        left_out = (self._left_out, self._longest_s)
        self._next_at, self._left_out, self._longest_s = now + self.interval_s, 0, 0.0
        return left_out


class ControllerServicer(pb_grpc.ControllerServicer):
    """Serves Register, Connect and GetStatus for one Controller.

    `authenticated`: the server uses mutual TLS (every call has a peer
    identity); False only with `--insecure`. `first_message_timeout_s`:
    how long a new stream may stay silent before it is closed."""

    def __init__(self, controller: Controller, authenticated: bool = True,
                 first_message_timeout_s: float = FIRST_MESSAGE_TIMEOUT_S) -> None:
        self.controller = controller
        self.authenticated = authenticated
        self.first_message_timeout_s = first_message_timeout_s
        total = 2 * controller.spec.max_hosts + 64
        self.streams = adm.StreamLimits(STREAMS_PER_PEER, total)
        self.calls = adm.StreamLimits(CALLS_PER_PEER, 4 * total)
        # host id -> fingerprint of the certificate it registered with
        self.certificates: dict[str, str] = {}
        # casefolded host id -> the host id admitted with it (adm.check_letter_case)
        self.folded_ids: dict[str, str] = {}
        # host id -> the session whose stream ended last, while it is not
        # registered again (its last command: see _register)
        self.ended: dict[str, Session] = {}
        self._journal_budget = adm.Budget(1.0 / REFUSAL_JOURNAL_INTERVAL_S, 1)
        self._report_budget = adm.Budget(adm.REPORTS_PER_S, adm.REPORT_BURST)
        self._known_step, self._known_at = -1, float("-inf")
        #: admitted registrations whose streams gRPC has not handed over yet
        self.intake = adm.StreamIntake(expire_s=silence.STREAM_OPEN_S)
        self._late_streams = LateStreamLog(LATE_STREAM_LOG_INTERVAL_S)
        #: the UDP port taking heartbeat datagrams (0: none; set by the server)
        self.heartbeat_port = 0

    # --- who is calling, and what is plausible ------------------------------

    async def _peer(self, context) -> tuple[Identity | None, str]:
        """(identity, key for the caps): the certificate's identity, or
        None and the peer's connection (address and port) on a plaintext
        channel, where nobody has an identity (many hosts may share an
        address behind a NAT; only the total cap applies across them)."""
        try:
            identity = peer_identity(context)
        except IdentityError as e:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))
        if identity is None:
            if self.authenticated:  # cannot happen with a TLS port: defensive
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, "no client certificate")
            return None, context.peer()
        return identity, f"{identity.role.short}:{identity.name}"

    def _plausible(self) -> adm.Plausible:
        """The current generation and the step the job is known to have
        reached: the most of what this controller started with, the
        committed step and the lowest step of the running generation's
        members (recomputed at most every KNOWN_STEP_REFRESH_S; O(members))."""
        c = self.controller
        now = c.clock.monotonic()
        if now - self._known_at >= KNOWN_STEP_REFRESH_S:
            steps = [r.worker.step for r in map(c.view.get, c.state.members)
                     if r is not None and r.worker.generation == c.state.generation]
            slice_step = min(steps) if steps and min(steps) >= 0 else -1
            self._known_step = max(c.known_step, c.view.committed_step, slice_step)
            self._known_at = now
        return adm.Plausible(c.state.generation, self._known_step)

    def _reports_commits(self, host: str) -> bool:
        """Whether `host` holds rank 0 of the latest generation: the one host
        whose worker reports committed checkpoint steps."""
        members = self.controller.state.members
        return bool(members) and members[0] == host

    def _refused(self, who: str, refusal: adm.Refusal, treatment: str = "refused") -> None:
        """Journal a refusal as `message_refused`, at most one line per
        (who, kind) every REFUSAL_JOURNAL_INTERVAL_S."""
        c = self.controller
        allowed, suppressed = self._journal_budget.take((who, refusal.kind), c.clock.monotonic())
        if not allowed:
            return
        more = f" ({suppressed} more since the last line)" if suppressed else ""
        c.executor.record("message_refused", c.state.generation,
                          f"{refusal.kind}: {refusal.reason} ({treatment}){more}",
                          who[:128] or None, {"refusal": refusal.kind, "suppressed": suppressed})

    async def _refuse(self, context, who: str, refusal: adm.Refusal) -> None:
        self._refused(who, refusal)
        await context.abort(_CODES[refusal.kind], refusal.reason)

    def _observed(self, host: str, status: pb.WorkerStatus,
                  implausible: adm.Refusal | None) -> v.WorkerObs:
        """The WorkerObs of a registration's or heartbeat's worker, whose
        admission found it `implausible` (or not): then its steps are set to
        unknown (-1: the message still counts as a sign of life). Its
        committed step is ignored unless `host` reports commits."""
        obs = worker_obs(status)
        if implausible is not None:
            self._refused(host, implausible, "its steps are ignored, the message counts")
            obs.step = obs.committed_step = -1
        if not self._reports_commits(host):
            obs.committed_step = -1
        return obs

    # --- the calls -----------------------------------------------------------

    async def Register(self, request: pb.RegisterRequest | None, context
                       ) -> pb.RegisterResponse:
        peer, key = await self._peer(context)
        deferral = self._deferral(request, peer)
        if deferral is not None:
            wait_s, why = deferral
            self.controller.registrations_deferred += 1
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{why}; register again in {wait_s:.1f} s",
                                trailing_metadata=((transport.RETRY_AFTER_KEY,
                                                    str(int(wait_s * 1000))),))
        if not self.calls.acquire(key):
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"more than {CALLS_PER_PEER} calls in flight from {key}")
        try:
            return await self._register(request, context, peer, key)
        finally:
            self.calls.release(key)

    def _deferral(self, request: pb.RegisterRequest | None, peer: Identity | None
                  ) -> tuple[float, str] | None:
        """Admission control (elastic.controller.admission): (seconds to wait,
        why) while the controller is behind, or while the streams of the
        registrations it admitted wait to be taken up; None: admit. An agent
        whose worker runs is always admitted, whatever the load: a wait could
        outlast the controller lease, and it would stop a training worker
        (elastic.agent.fence) that a restarted controller is about to adopt."""
        host = peer.name if peer is not None else \
            request.header.host_id if request is not None else ""
        earlier = self.controller.sessions.get(host)
        if earlier is not None and not earlier.attached:
            # Its agent registers again: it gave up on that stream. (The one
            # place a replaced registration is counted out: one whose stream
            # was taken up no longer counts.)
            self.intake.gone(earlier)
        if request is not None and request.worker.state == pb.WORKER_RUNNING:
            return None
        behind_s = self.controller.behind_s()
        wait_s = adm.registration_wait_s(behind_s, random.random())
        if wait_s is not None:
            return wait_s, f"the controller is {behind_s:.1f} s behind"
        deferred = self.intake.defer(self.controller.clock.monotonic(), random.random())
        if deferred is not None:
            wait_s, awaiting, taken_per_s = deferred
            return wait_s, (f"the streams of {awaiting} registrations wait to be taken up "
                            f"({taken_per_s:.0f} a second lately)")
        return None

    async def _register(self, request, context, peer: Identity | None,
                        key: str) -> pb.RegisterResponse:
        c = self.controller
        who = peer.name if peer else key
        if request is None:
            await self._refuse(context, who, UNDECODABLE)
        h, plausible = request.header, self._plausible()
        refusal_of_worker = adm.check_register(request, c.spec.job_id, peer, plausible)
        if refusal_of_worker is not None and refusal_of_worker.kind != "implausible":
            await self._refuse(context, who, refusal_of_worker)
        fingerprint = peer.fingerprint if peer else ""
        record = c.view.get(h.host_id)
        live = record is not None and h.host_id not in c.state.lost and \
            c.clock.monotonic() - record.last_heartbeat_at < c.spec.health.heartbeat_timeout_s
        refusal = adm.check_letter_case(h.host_id, self.folded_ids) or adm.check_rebind(
            self.certificates.get(h.host_id), fingerprint, h.incarnation,
            record.incarnation if record else None, live)
        if refusal:
            await self._refuse(context, h.host_id, refusal)
        self.folded_ids.setdefault(h.host_id.casefold(), h.host_id)
        worker = self._observed(h.host_id, request.worker, refusal_of_worker)
        self.certificates[h.host_id] = fingerprint
        # The session (and its outbox) exists from registration on, so commands
        # decided before the agent opens its stream wait for it there.
        previous = c.sessions.get(h.host_id) or self.ended.get(h.host_id)
        self.ended.pop(h.host_id, None)
        undelivered = c.executor.undelivered.pop(h.host_id, None)
        if previous is not None:
            previous.close(grpc.StatusCode.FAILED_PRECONDITION,
                           f"host {h.host_id} registered again (incarnation {h.incarnation})")
        session = c.sessions[h.host_id] = Session(h.host_id, h.incarnation, fingerprint,
                                                  registered_at=c.clock.monotonic())
        if previous is not None and previous.incarnation == h.incarnation and (due := next(
                (m for m in (undelivered, previous.last_command) if _still_due(m, c.state,
                                                                              h.host_id)),
                None)):
            # The same agent process registering again: its stream broke, and a
            # start or stop of this generation may have gone down with it, or
            # been decided while it had none, which nothing would send again
            # (the slice would wait out the startup-hang timeout, or a stop its
            # stop timeout). The agent takes each command once.
            session.send(due)
        self.intake.registered(session, session.registered_at)
        c.submit(v.Registered(
            host_id=h.host_id, incarnation=h.incarnation, devices=request.devices,
            address=request.address, failure_domain=request.failure_domain or h.host_id,
            agent_pid=request.agent_pid, free_port=request.free_port, worker=worker,
            device_kind=request.device_kind,
            fenced=clean_text(request.fenced, adm.MAX_REASON_CHARS),
            service_port=request.service_port, metrics_port=request.metrics_port))
        health = c.spec.health
        reply = pb.RegisterResponse(job_id=c.spec.job_id, generation=c.state.generation,
                                    heartbeat_interval_s=health.heartbeat_interval_s,
                                    heartbeat_timeout_s=health.heartbeat_timeout_s,
                                    controller_lease_s=health.controller_lease_s,
                                    term=c.executor.term,
                                    stream_wait_s=c.view.lag_s, received_at=c.clock.time(),
                                    protocol=protocol.PROTOCOL,
                                    release=protocol.release())
        if self.heartbeat_port:
            key = hd.new_key()
            session.datagrams = hd.DatagramChannel(key, h.host_id, hd.TO_AGENT)
            reply.heartbeat_port, reply.heartbeat_key = self.heartbeat_port, key
        if c.spec.restart.prestart_workers:
            reply.launch.CopyFrom(c.executor.launch())
        return reply

    async def GetStatus(self, request, context) -> pb.JobStatus:
        peer, key = await self._peer(context)
        refusal = adm.check_status_peer(peer)
        if refusal:
            await self._refuse(context, key, refusal)
        if not self.calls.acquire(key):
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"more than {CALLS_PER_PEER} calls in flight from {key}")
        try:
            return job_status(self.controller)
        finally:
            self.calls.release(key)

    async def Connect(self, request_iterator, context):
        handed_over = self.controller.clock.monotonic()  # (gRPC handed the call over)
        peer, key = await self._peer(context)
        if not self.streams.acquire(key):
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"too many streams: at most {STREAMS_PER_PEER} per peer and "
                                f"{self.streams.total} in all")
        try:
            await self._connect(context, peer, key, handed_over)
        finally:
            self.streams.release(key)

    async def _connect(self, context, peer: Identity | None, key: str,
                       handed_over: float) -> None:
        c = self.controller
        who = peer.name if peer else key
        try:
            first = await asyncio.wait_for(context.read(), self.first_message_timeout_s)
        except TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"no message within {self.first_message_timeout_s:g} s of "
                                f"opening the stream")
        if first is grpc.aio.EOF:
            return
        if first is None:
            await self._refuse(context, who, UNDECODABLE)
        refusal = adm.check_header(first.header, c.spec.job_id) or \
            adm.check_identity(peer, first.header.host_id)
        if refusal:
            await self._refuse(context, who, refusal)
        refusal = fence(c, first.header)
        if refusal:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, refusal)
        host = first.header.host_id
        session = c.sessions.get(host)
        if session is None or session.incarnation != first.header.incarnation \
                or session.attached:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"no open registration of host {host} incarnation "
                                f"{first.header.incarnation}; call Register first")
        if peer is not None and peer.fingerprint != session.fingerprint:
            await self._refuse(context, host, adm.Refusal(
                "denied", f"the stream's certificate (sha256 {peer.fingerprint[:16]}) is not the "
                          f"one host {host} registered with"))
        session.attached, session.attached_at = True, c.clock.time()
        now = c.clock.monotonic()
        self.intake.taken_up(session, now)
        waited_s = now - session.registered_at
        left_out = self._late_streams.note(now, waited_s) if waited_s > STREAM_LATE_S else None
        if left_out is not None:
            log.warning("the stream of host %s was taken up %.1f s after it registered: gRPC "
                        "handed the call over after %.1f s, its first message was read %.1f s "
                        "later%s", host, waited_s, handed_over - session.registered_at,
                        now - handed_over,
                        f" ({left_out[0]} more late since the last such line, the longest "
                        f"{left_out[1]:.1f} s)" if left_out[0] else "")
        reader = asyncio.create_task(self._read(context, session, first))
        try:
            while True:
                message = await session.outbox.get()
                if message is None:
                    break
                await context.write(message)
        finally:
            reader.cancel()
            if c.sessions.get(host) is session:  # not replaced by a new registration
                del c.sessions[host]
                if session.last_command is not None:
                    self.ended[host] = session
                c.submit(v.Disconnected(host, session.incarnation))
        if session.close_status and session.close_status[0] is not None:
            await context.abort(*session.close_status)

    async def _read(self, context, session: Session, first: pb.AgentMessage) -> None:
        message = first
        try:
            while message is not grpc.aio.EOF:
                if message is None:
                    self._refused(session.host_id, UNDECODABLE)
                    session.close(grpc.StatusCode.INVALID_ARGUMENT, UNDECODABLE.reason)
                    return
                h = message.header
                if h.host_id != session.host_id:  # a stream speaks for its own host only
                    refusal = adm.Refusal("denied", f"a message for host {h.host_id[:128]!r} on "
                                                    f"the stream of host {session.host_id}")
                    self._refused(session.host_id, refusal)
                    session.close(grpc.StatusCode.PERMISSION_DENIED, refusal.reason)
                    return
                refusal = fence(self.controller, h)
                if refusal:
                    session.close(grpc.StatusCode.FAILED_PRECONDITION, refusal)
                    return
                self._handle(session, message)
                message = await context.read()
        except (asyncio.CancelledError, grpc.RpcError):
            pass
        except Exception as e:  # noqa: BLE001 - a bug must end this stream, not hang it
            log.exception("stream of host %s failed", session.host_id)
            session.close(grpc.StatusCode.INTERNAL, f"the controller failed on a message: {e}")
            return
        session.close()

    def _reject(self, session: Session, reason: str) -> None:
        c = self.controller
        session.send(pb.ControllerMessage(
            job_id=c.spec.job_id, generation=c.state.generation, term=c.executor.term,
            rejected=pb.Rejected(current_generation=c.state.generation, reason=reason)))

    def datagram_received(self, data: bytes, reply: Callable[[bytes], None]) -> bool:
        """A UDP datagram: taken as its host's heartbeat (True) when it
        opens under the key of that host's current registration, is newer
        than every message seen from it (elastic.heartbeat_datagram),
        carries a heartbeat of the registered incarnation and the host's
        stream is open; otherwise dropped (False) and counted in the
        controller's `datagrams_refused` (never journaled: anyone can send
        datagrams). `reply(bytes)` sends a datagram back to where it came
        from (the ack)."""
        c = self.controller
        try:
            session = c.sessions.get(hd.host_of(data))
            if session is None or session.datagrams is None or not session.attached or \
                    session.close_status is not None:
                raise hd.DatagramError("no open session for it")
            message = _parse_agent_message(session.datagrams.open(data))
        except hd.DatagramError:
            c.datagrams_refused += 1
            return False
        h = message.header if message is not None else None
        if h is None or message.WhichOneof("body") != "heartbeat" or \
                h.host_id != session.host_id or h.incarnation != session.incarnation or \
                fence(c, h) is not None or h.seq <= session.last_seq:
            c.datagrams_refused += 1
            return False
        c.datagrams_received += 1
        session.datagram_reply, session.datagram_heard_at = reply, c.clock.monotonic()
        self._handle(session, message, reply)
        return True

    def _handle(self, session: Session, message: pb.AgentMessage,
                datagram_reply: Callable[[bytes], None] | None = None) -> None:
        """Act on one message of `session`'s host: from its stream, or a
        heartbeat datagram (`datagram_reply` sends the ack back that way)."""
        c, h = self.controller, message.header
        kind, plausible = message.WhichOneof("body"), self._plausible()
        refusal = adm.check_message(message, plausible)
        if kind == "heartbeat" and (refusal is None or refusal.kind == "implausible"):
            if h.seq and h.seq <= session.last_seq:
                return  # overtaken by a newer message (a datagram passed it)
            session.last_seq = max(session.last_seq, h.seq)
            session.heartbeat_path = "stream" if datagram_reply is None else "datagram"
            hb = message.heartbeat
            worker = self._observed(h.host_id, hb.worker, refusal)
            now_s = c.clock.time()
            if datagram_reply is None and 0 < hb.sent_at < session.attached_at:
                # Sent on its stream before the controller took the stream up: it
                # waited in gRPC's queue of calls, which is that stream's wait
                # (judged by STREAM_OPEN_S), not the controller's lag. A wave of
                # streams taken up at once, each with a minute of heartbeats
                # queued on it, made the controller judge every host's silence
                # 70 s behind (bench/scale.py, 10,000 agents, 2026-11-26).
                latency = now_s - hb.sent_at
            else:
                latency = c.receipts.heard(hb.sent_at, now_s, c.clock.monotonic(), h.host_id)
            if latency is not None and c.on_heartbeat_latency is not None:
                c.on_heartbeat_latency(latency)
            c.submit(v.HeartbeatReceived(h.host_id, h.incarnation, worker, hb.free_port,
                                         clean_text(hb.preemption, adm.MAX_REASON_CHARS),
                                         hb.devices, hb.device_kind))
            # The agent's proof that it is still heard (its fencing lease, and
            # its sign of a live controller): at most every ACK_EVERY of the
            # heartbeat timeout, which an agent's patience far exceeds. Half the
            # acks of 1 Hz heartbeats at the default timeout: writes are the
            # dearest part of a heartbeat at scale (bench/scale.py).
            # Each way has its own: the first datagram is acked at once (the
            # agent's proof that datagrams arrive, elastic.agent.datagrams).
            now = c.clock.monotonic()
            last = session.acked_at if datagram_reply is None else session.datagram_acked_at
            if now - last >= ACK_EVERY * c.spec.health.heartbeat_timeout_s:
                # (the lag measured, not what earlier acks promised: that would renew
                # a promise for ever)
                ack = pb.ControllerMessage(job_id=c.spec.job_id, generation=c.state.generation,
                                           term=c.executor.term, ack=pb.HeartbeatAck(
                                               seq=hb.seq, controller_lag_s=c.measured_lag_s,
                                               received_at=now_s))
                if datagram_reply is None:
                    session.acked_at = now
                    session.send(ack)
                else:
                    session.datagram_acked_at = now
                    c.promise_lag(c.measured_lag_s)
                    datagram_reply(session.datagrams.seal(ack.SerializeToString()))
            return
        session.last_seq = max(session.last_seq, h.seq)
        if refusal is None and not self._report_budget.take(h.host_id, c.clock.monotonic())[0]:
            refusal = adm.Refusal("implausible", f"more than {adm.REPORTS_PER_S:g} reports a "
                                                 f"second (a burst of {adm.REPORT_BURST})")
        if refusal:
            self._refused(h.host_id, refusal)
            self._reject(session, f"{kind} refused: {refusal.reason}")
            return
        if h.generation < c.state.generation:
            # A report about a worker of an older generation: refused, so it can
            # never count for the current one. Its heartbeats still carry the truth.
            self._reject(session, f"{kind} of generation {h.generation} refused: the current "
                                  f"generation is {c.state.generation}")
            if self._journal_budget.take((h.host_id, "stale"), c.clock.monotonic())[0]:
                c.submit(v.StaleReportRefused(h.host_id, h.incarnation, h.generation,
                                              c.state.generation, kind))
            return
        if kind == "worker_exited":
            c.submit(v.WorkerExited(h.host_id, h.incarnation, worker_obs(message.worker_exited)))
        elif kind == "progress":
            p = message.progress
            committed = p.committed_step if self._reports_commits(h.host_id) else -1
            c.submit(v.ProgressReported(h.host_id, h.incarnation, h.generation, p.step,
                                        committed, dict(p.metrics)))
        elif kind == "stacks":
            st = message.stacks
            c.submit(v.StacksReported(
                h.host_id, h.incarnation, h.generation, st.process_id, st.pid,
                clean_text(st.stacks, adm.MAX_STACKS_CHARS, keep_newlines=True),
                clean_text(st.frame, 2 * adm.MAX_FIELD_TEXT_CHARS),
                clean_text(st.error, adm.MAX_REASON_CHARS)))
        elif kind == "worker_event":
            e = message.worker_event
            fields = adm.worker_event_fields(e.fields_json, plausible)
            if isinstance(fields, adm.Refusal):
                self._refused(h.host_id, fields)
                self._reject(session, f"worker_event refused: {fields.reason}")
                return
            c.submit(v.WorkerReported(h.host_id, h.incarnation, h.generation,
                                      clean_text(e.kind, 64),
                                      clean_text(e.reason, adm.MAX_REASON_CHARS), fields))
