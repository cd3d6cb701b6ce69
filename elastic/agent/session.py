"""The agent's side of the connection to the controller: register, one
stream of heartbeats and reports up and commands down, go round the
controller addresses for ever, and stop the worker when no controller has
been heard for the lease (self-fencing, elastic.agent.fence).

`ControllerSession` is a part of `elastic.agent.agent.Agent`, apart so that
each reads in one sitting: it uses the agent's settings, supervisor,
outbox and the handlers of what a controller sends (`_command`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time

import grpc
import tenacity

from elastic import protocol, transport
from elastic.agent import fence
from elastic.agent.datagrams import WENT_TO_STREAM, open_datagrams
from elastic.policy.adopt import AGENT_RECONNECT_MAX_S
from elastic.policy.silence import STREAM_OPEN_S
from elastic.security.tls import TLSError
from elastic.v1 import control_pb2 as pb
from elastic.v1 import control_pb2_grpc as pb_grpc

log = logging.getLogger("elastic-agent")

#: Jobs whose highest followed term an agent remembers (the oldest is
#: forgotten first: a deposed leader of a job that long past is no risk).
MAX_JOBS_REMEMBERED = 64

#: With several controller addresses, a registration that takes longer
#: (seconds) moves on to the next: a frozen or cut-off leader never answers.
REGISTER_TIMEOUT_S = 2.0


def first_answer_wait_s(silence_s: float, stream_wait_s: float, lease_s: float | None) -> float:
    """Seconds an agent waits for its stream's first answer before it
    registers again: as long as the controller waits for the stream
    (STREAM_OPEN_S plus `stream_wait_s`, what the registration's reply said
    of the controller's lag; at most SERVER_CALL_WAIT_S
    in all, after which gRPC drops a call the controller has not taken up;
    a value that is not a finite number >= 0 counts as 0), at most half
    `lease_s` (the controller lease, given while a worker runs; None: no
    worker to fence), and never less than `silence_s` (the heartbeat
    silence that ends an answered stream)."""
    extra_s = stream_wait_s if math.isfinite(stream_wait_s) and stream_wait_s > 0 else 0.0
    wait_s = min(STREAM_OPEN_S + extra_s, float(transport.SERVER_CALL_WAIT_S))
    if lease_s is not None:
        wait_s = min(wait_s, lease_s / 2)
    return max(silence_s, wait_s)


class _NoController(Exception):
    """No controller address answered in one round; `retry_after_s`: the
    longest wait a controller asked for (admission control), or None."""

    def __init__(self, retry_after_s: float | None = None) -> None:
        super().__init__()
        self.retry_after_s = retry_after_s


class _Silent(Exception):
    """The controller of a session went silent (no heartbeat ack)."""


class _Deposed(Exception):
    """A controller answered with a lower term than one already followed."""


class _Incompatible(Exception):
    """A controller answered speaking another wire protocol (elastic.protocol)."""


class ControllerSession:
    """Registration, the session's stream, reconnection and self-fencing
    (see the module docstring)."""

    def _job_to_register(self) -> str:
        """The job this agent registers for: the one it is pinned to
        (--job-id); else the job of the worker it runs (only that job's
        controller may take the worker over); else none, and any job's
        controller may take this host: a deployment's agents serve one job
        after another."""
        return self.job_id if self.settings.job_id or self.supervisor.running else ""

    def _register_request(self) -> pb.RegisterRequest:
        s = self.settings
        header = self._header()
        header.job_id = self._job_to_register()
        return pb.RegisterRequest(
            header=header, devices=self.devices.count,
            device_kind=self.devices.kind, address=s.address,
            failure_domain=s.failure_domain, agent_pid=os.getpid(),
            worker=self.supervisor.status, fenced=self._fenced,
            free_port=0 if self.supervisor.running else self.ports.probe(),
            service_port=self.service_port, metrics_port=self.metrics_port,
            protocol=protocol.PROTOCOL, release=protocol.release())

    def _next_job(self, job_id: str) -> None:
        """This idle agent (unpinned, no worker) was taken by the controller
        of another job than the last it followed: what it kept of that job
        (reports not yet delivered, its last worker's status, the run its
        local snapshots belong to: emptied at the new job's first start) is
        of no concern to the new one."""
        log.info("following job %s after job %s (%d undelivered reports of that job dropped)",
                 job_id, self.job_id, len(self._undelivered))
        self._undelivered.clear()
        self.supervisor.forget_last_worker()
        self._snapshot_run = ""
        # commands are ordered by (term, generation) within a job: the new
        # job's first start may carry a lower pair than the last one's
        self._commanded, self._last_stop, self._stopped_through = (0, 0), None, (0, 0)

    def _requeue(self, outbox: asyncio.Queue) -> None:
        """A session ended with reports still in its `outbox` (its stream
        was slow or cut): they were never written, so they go to the next
        controller first, in order, as reports made
        while none listened do. Heartbeats are dropped: the next session
        starts with a fresh one."""
        kept = 0
        while not outbox.empty():  # (_undelivered is empty: emptied into it at its start)
            message = outbox.get_nowait()
            if message.WhichOneof("body") != "heartbeat":
                self._undelivered.append(message)
                kept += 1
        if kept:
            log.info("%d reports not yet sent when the stream ended: kept for the next "
                     "controller", kept)

    async def _session(self, channel: grpc.aio.Channel, address: str) -> None:
        """Register with the controller at `address` (one attempt) and
        serve its stream until it ends. Raises grpc.RpcError when the
        controller cannot be reached or refuses."""
        stub = pb_grpc.ControllerStub(channel)
        several = "," in self.settings.controller
        sent = self.clock_offset.now()
        try:
            reply = await stub.Register(self._register_request(), timeout=min(
                self.settings.rpc_timeout_s, REGISTER_TIMEOUT_S) if several else
                self.settings.rpc_timeout_s)
        except grpc.aio.AioRpcError as e:  # (a registration's only one: another protocol)
            if e.code() is grpc.StatusCode.FAILED_PRECONDITION:
                raise _Incompatible(f"it refused this agent: {e.details()}") from None
            raise
        problem = protocol.mismatch(reply.protocol, reply.release, f"controller at {address}",
                                    "agent")
        if problem:
            raise _Incompatible(problem)
        # (a term is compared with those of the same job: another job's
        # leader, perhaps on another host, is not held to this one's clock)
        followed = self._job_terms.get(reply.job_id, 0)
        if reply.term < followed:
            raise _Deposed(f"controller {address} leads term {reply.term} of job "
                           f"{reply.job_id}; a controller of term {followed} has led it since: "
                           f"not following it")
        if self.job_id and reply.job_id != self.job_id:
            self._next_job(reply.job_id)
        self._term = reply.term
        self._job_terms.pop(reply.job_id, None)  # (the latest last: forgotten last)
        self._job_terms[reply.job_id] = reply.term
        while len(self._job_terms) > MAX_JOBS_REMEMBERED:
            del self._job_terms[next(iter(self._job_terms))]
        self.job_id = reply.job_id
        self.clock_offset.reset()  # (perhaps another controller, another clock)
        self.clock_offset.answered(sent, reply.received_at)
        self._heard_at, self._fenced = time.monotonic(), ""
        self._heartbeat_interval_s = reply.heartbeat_interval_s
        self._lease_s = reply.controller_lease_s or fence.lease_s(reply.heartbeat_interval_s,
                                                                  reply.heartbeat_timeout_s)
        log.info("registered with %s as %s (incarnation %s), job %s, generation %d",
                 address, self.settings.host_id, self.incarnation,
                 reply.job_id, reply.generation)
        argv = self._vet(reply.launch) if reply.HasField("launch") else "no launch"
        if reply.HasField("launch") and isinstance(argv, str):
            log.error("this host will refuse the job's worker: %s", argv)
        if not isinstance(argv, str) and not self.supervisor.running and not self.preemption:
            # A host without a worker (new, restarted, left out of the slice):
            # a process ready for its first start, as after any start. Awaited
            # (spawning takes milliseconds) so it exists before a start can come.
            self._prestart_next = True
            await self.supervisor.prestart_next(
                (argv, self._worker_env(reply.launch), reply.launch.workdir))
        call = stub.Connect()
        self._outbox = outbox = asyncio.Queue()
        # (acks come on the stream, or as datagrams when it offers a port)
        inbox: asyncio.Queue = asyncio.Queue()
        datagrams = None
        self.sessions_opened += 1
        if self.service is not None:
            await self.service.session(True)
        # what happened while no controller listened first, in order, then
        # the state now (a heartbeat would journal a newer commit ahead of them)
        while self._undelivered:
            outbox.put_nowait(self._undelivered.popleft())
        self._heartbeat()

        async def write() -> None:
            while True:
                message = await outbox.get()
                self._writing = True  # (in flight: a datagram must not overtake it)
                try:
                    await call.write(message)
                finally:
                    self._writing = False

        async def beat() -> None:
            while True:
                await asyncio.sleep(reply.heartbeat_interval_s)
                self._heartbeat(periodic=True)

        tasks = [asyncio.create_task(write()), asyncio.create_task(beat())]
        # A controller acks heartbeats at least every quarter of its heartbeat
        # timeout (elastic.controller.servicer.ACK_EVERY). One silent this long is
        # stopped or cut off (its connection may stay open for minutes):
        # end the session and go round the addresses (a standby may lead).
        # (Reads go through a queue: a cancelled read would end the call.)
        # While its datagrams go unacked and before it goes to the stream, and
        # from when it does, the limit counts from then: with the lag the
        # controller told added, the datagrams' wait may be longer.
        silence_s = max(reply.heartbeat_timeout_s, 3 * reply.heartbeat_interval_s)
        # Until the stream's first answer, as long as the controller waits for
        # the stream itself: with thousands of agents connecting, gRPC holds a
        # new stream in its queue until the controller's loop takes it up,
        # and ending the session then would only register the agent again,
        # adding to that queue (first_answer_wait_s; the lease bounds it while
        # a worker runs: a registration renews the lease, a stream not yet
        # answered does not).
        first_answer_s = first_answer_wait_s(silence_s, reply.stream_wait_s,
                                             self._lease_s if self.supervisor.running else None)
        answered = False

        async def read() -> None:
            try:
                while (message := await call.read()) is not grpc.aio.EOF:
                    if self._outbox is outbox:
                        # The controller answered on the stream: it has taken it up
                        # and will take datagrams too (before, it drops them).
                        self._datagrams = datagrams
                    inbox.put_nowait(message)
            finally:
                inbox.put_nowait(None)

        reader = asyncio.create_task(read())
        tasks.append(reader)
        try:
            datagrams = await open_datagrams(address, reply, self.settings.host_id, inbox)
            while True:
                wait_s = silence_s if answered else first_answer_s
                try:
                    message = await asyncio.wait_for(inbox.get(), wait_s)
                except TimeoutError:
                    await asyncio.sleep(0.5)  # (this agent may have been stopped itself)
                    if inbox.empty() and not (datagrams and datagrams.going_to_stream()):
                        log.warning("controller %s silent for %.1f s%s; looking for a "
                                    "controller", address, wait_s,
                                    "" if answered else " since the stream opened")
                        raise _Silent()
                    continue
                if message is WENT_TO_STREAM:
                    continue  # (the silence limit counts from its first stream heartbeat)
                answered = True
                if message is None:
                    await asyncio.wait([reader])
                    if reader.exception() is not None:
                        raise reader.exception()
                    break
                self._heard_at = time.monotonic()
                self._command(message)
        finally:
            self._outbox = self._datagrams = None
            self._requeue(outbox)
            if datagrams is not None:
                datagrams.transport.close()
            for task in tasks:
                task.cancel()
            call.cancel()
            if self.service is not None:
                await self.service.session(False)

    async def _connect_forever(self) -> None:
        """Keep a session with a controller: try each address of
        `settings.controller` (comma-separated: a leader and its standbys) in
        turn; when none answers, wait with jittered exponential backoff
        (0.1 s doubling to AGENT_RECONNECT_MAX_S, tenacity's
        wait_random_exponential: thousands of agents do not come back in
        step) and go round again. A session that ended starts a new round at
        once; a controller that is behind, or whose admitted registrations'
        streams still wait, may ask for a longer wait (seconds to minutes:
        elastic.controller.admission). The worker
        trains on meanwhile, for the controller lease."""
        addresses = [a.strip() for a in self.settings.controller.split(",") if a.strip()]
        backoff = tenacity.wait_random_exponential(multiplier=0.1, max=AGENT_RECONNECT_MAX_S)

        def wait(state: tenacity.RetryCallState) -> float:  # (or what the controller asked)
            return max(state.outcome.exception().retry_after_s or 0.0, backoff(state))

        def waiting(state: tenacity.RetryCallState) -> None:
            log.info("no controller answers at %s; retrying (round %d)",
                     ", ".join(addresses), state.attempt_number)

        while True:
            async for attempt in tenacity.AsyncRetrying(
                    retry=tenacity.retry_if_exception_type(_NoController),
                    wait=wait, before_sleep=waiting):
                with attempt:
                    await self._one_round(addresses)

    async def _one_round(self, addresses: list[str]) -> None:
        """One session with the first of `addresses` that answers; raises
        _NoController when none did. A controller that went silent is moved
        to the end of `addresses` (the list is changed in place)."""
        retry_after_s = None
        for address in list(addresses):
            channel = None
            opened = self.sessions_opened
            try:  # certificates are read again at every connect (renewals)
                channel = transport.aio_channel(address, self.settings.tls)
                await self._session(channel, address)
                log.info("controller %s closed the stream; reconnecting", address)
                return
            except _Silent:  # tried last from now on: a standby may lead
                addresses.remove(address)
                addresses.append(address)
                return
            except (TLSError, _Deposed, _Incompatible) as e:
                log.error("cannot follow %s: %s", address, e)
            except grpc.RpcError as e:
                log.warning("controller %s: %s: %s", address, e.code().name, e.details())
                hint = transport.retry_after_s(e)
                if hint is not None:
                    retry_after_s = max(retry_after_s or 0.0, hint)
                elif self.sessions_opened != opened:
                    # It registered this agent, then its stream broke (a controller
                    # killed again soon after a restart): a new round at once, as
                    # after a session that ended. Before, the backoff went on from
                    # the rounds before it, 2.8 s at round 9, and this host missed a
                    # restarted controller's 4 s adoption window (the suite found it).
                    return
            finally:
                if channel is not None:
                    await channel.close()
        raise _NoController(retry_after_s)

    async def _keep_lease(self, tick_s: float = fence.CHECK_EVERY_S) -> None:
        """Stop the worker when the controller has not been heard for the
        lease (elastic.agent.fence); the next registration says so."""
        checked_at = time.monotonic()
        while True:
            await asyncio.sleep(tick_s)
            now = time.monotonic()
            if self._lease_s is None:
                checked_at = now
                continue
            expired, self._heard_at = fence.check(self._heard_at, checked_at, now,
                                                  self._lease_s, tick_s,
                                                  fence.grace_s(self._heartbeat_interval_s))
            checked_at = now
            if expired and self.supervisor.running and not self._fenced:
                generation = self.supervisor.status.generation
                self._fenced = (f"heard nothing from the controller for "
                                f"{now - self._heard_at:.1f} s (lease {self._lease_s:g} s): "
                                f"stopped its worker of generation {generation} on its own")
                log.error("self-fencing: %s", self._fenced)
                self._spawn(self.supervisor.stop(generation, 0.0))
