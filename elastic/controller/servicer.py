"""The gRPC servicer: a thin adapter that turns agent messages into events.

Fencing happens here, before an event exists: a message from an incarnation
that a newer registration replaced ends its stream with FAILED_PRECONDITION;
a report about a worker of an older generation is answered with `Rejected`.
"""

from __future__ import annotations

import asyncio
import json
import logging

import grpc

from elastic.controller.core import Controller
from elastic.controller.executor import Session
from elastic.controller.status import job_status
from elastic.policy import view as v
from elastic.v1 import control_pb2 as pb
from elastic.v1 import control_pb2_grpc as pb_grpc

log = logging.getLogger("elasticd")

_STATES = {pb.WORKER_IDLE: v.WorkerState.IDLE, pb.WORKER_RUNNING: v.WorkerState.RUNNING,
           pb.WORKER_EXITED: v.WorkerState.EXITED}


def worker_obs(status: pb.WorkerStatus) -> v.WorkerObs:
    """The policy's view of a WorkerStatus message."""
    return v.WorkerObs(
        generation=status.generation, state=_STATES.get(status.state, v.WorkerState.IDLE),
        pid=status.pid, exit_code=status.exit_code, signal=status.signal,
        stderr_tail=status.stderr_tail, stopped_on_request=status.stopped_on_request,
        step=status.step, committed_step=status.committed_step, metrics=dict(status.metrics),
        suspended=status.suspended)


def fence(controller: Controller, header: pb.Header) -> str | None:
    """Why a message with `header` must be refused, or None.

    Refused: another job's message, or an incarnation that is not the one
    registered for the host (replaced by a newer agent process, or never
    registered)."""
    if header.job_id != controller.spec.job_id:
        return (f"message for job {header.job_id!r} sent to the controller of job "
                f"{controller.spec.job_id!r}")
    record = controller.view.get(header.host_id)
    if record is None:
        return f"host {header.host_id!r} is not registered; call Register first"
    if record.incarnation != header.incarnation:
        return (f"incarnation {header.incarnation} of host {header.host_id} was replaced by "
                f"{record.incarnation}")
    return None


class ControllerServicer(pb_grpc.ControllerServicer):
    """Serves Register, Connect and GetStatus for one Controller."""

    def __init__(self, controller: Controller) -> None:
        self.controller = controller

    async def Register(self, request: pb.RegisterRequest, context) -> pb.RegisterResponse:
        c, h = self.controller, request.header
        if h.job_id and h.job_id != c.spec.job_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"agent is configured for job {h.job_id!r}; this controller "
                                f"runs job {c.spec.job_id!r}")
        if not h.host_id or not h.incarnation:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "header.host_id and header.incarnation are required")
        if request.devices < 1:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"host {h.host_id} reports {request.devices} devices; need >= 1")
        # The session (and its outbox) exists from registration on, so commands
        # decided before the agent opens its stream wait for it there.
        previous = c.sessions.get(h.host_id)
        if previous is not None:
            previous.close(grpc.StatusCode.FAILED_PRECONDITION,
                           f"host {h.host_id} registered again (incarnation {h.incarnation})")
        c.sessions[h.host_id] = Session(h.host_id, h.incarnation)
        c.submit(v.Registered(
            host_id=h.host_id, incarnation=h.incarnation, devices=request.devices,
            address=request.address, failure_domain=request.failure_domain or h.host_id,
            agent_pid=request.agent_pid, free_port=request.free_port,
            worker=worker_obs(request.worker)))
        health = c.spec.health
        reply = pb.RegisterResponse(job_id=c.spec.job_id, generation=c.state.generation,
                                    heartbeat_interval_s=health.heartbeat_interval_s,
                                    heartbeat_timeout_s=health.heartbeat_timeout_s)
        if c.spec.restart.prestart_workers:
            reply.launch.CopyFrom(c.executor.launch())
        return reply

    async def GetStatus(self, request: pb.StatusRequest, context) -> pb.JobStatus:
        return job_status(self.controller)

    async def Connect(self, request_iterator, context):
        c = self.controller
        first = await context.read()
        if first is grpc.aio.EOF:
            return
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
        session.attached = True
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
                c.submit(v.Disconnected(host, session.incarnation))
        if session.close_status and session.close_status[0] is not None:
            await context.abort(*session.close_status)

    async def _read(self, context, session: Session, first: pb.AgentMessage) -> None:
        message = first
        try:
            while message is not grpc.aio.EOF:
                refusal = fence(self.controller, message.header)
                if refusal:
                    session.close(grpc.StatusCode.FAILED_PRECONDITION, refusal)
                    return
                self._handle(session, message)
                message = await context.read()
        except (asyncio.CancelledError, grpc.RpcError):
            pass
        session.close()

    def _handle(self, session: Session, message: pb.AgentMessage) -> None:
        c, h = self.controller, message.header
        kind = message.WhichOneof("body")
        if kind == "heartbeat":
            hb = message.heartbeat
            if hb.sent_at:
                c.heartbeat_latency_s.append(c.clock.time() - hb.sent_at)
            c.submit(v.HeartbeatReceived(h.host_id, h.incarnation, worker_obs(hb.worker),
                                         hb.free_port, hb.preemption))
            return
        if h.generation < c.state.generation:
            # A report about a worker of an older generation: refused, so it can
            # never count for the current one. Its heartbeats still carry the truth.
            session.send(pb.ControllerMessage(
                job_id=c.spec.job_id, generation=c.state.generation,
                rejected=pb.Rejected(current_generation=c.state.generation,
                                     reason=f"{kind} of generation {h.generation} refused: "
                                            f"the current generation is {c.state.generation}")))
            c.submit(v.StaleReportRefused(h.host_id, h.incarnation, h.generation,
                                          c.state.generation, kind))
            return
        if kind == "worker_exited":
            c.submit(v.WorkerExited(h.host_id, h.incarnation, worker_obs(message.worker_exited)))
        elif kind == "progress":
            p = message.progress
            c.submit(v.ProgressReported(h.host_id, h.incarnation, h.generation, p.step,
                                        p.committed_step, dict(p.metrics)))
        elif kind == "worker_event":
            e = message.worker_event
            try:
                fields = json.loads(e.fields_json or "{}")
            except ValueError:
                fields = {}
            c.submit(v.WorkerReported(h.host_id, h.incarnation, h.generation, e.kind, e.reason,
                                      fields if isinstance(fields, dict) else {}))
