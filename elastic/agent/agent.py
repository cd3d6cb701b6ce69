"""The agent's connection to the controller: register, one stream of
heartbeats and reports up and commands down, reconnect forever.

While the controller is away the worker keeps running for the agent's lease
(elastic.agent.fence); an agent that hears nothing from the controller for
longer stops its worker on its own (self-fencing) and says so when it
registers again.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import math
import os
import shutil
import signal
import time
import uuid

import grpc
import tenacity

from elastic import config, transport
from elastic.agent import fence, snapshot_dir
from elastic.agent.host import Devices, PortProber, discover_devices
from elastic.agent.preemption import watch_metadata
from elastic.agent.supervisor import WorkerSupervisor, kill_leftovers
from elastic.policy.adopt import AGENT_RECONNECT_MAX_S
from elastic.security.allow import AllowList, check_launch
from elastic.security.text import clean_text
from elastic.security.files import private_dir
from elastic.security.tls import TLSError, TLSFiles
from elastic.worker import progress
from elastic.v1 import control_pb2 as pb
from elastic.v1 import control_pb2_grpc as pb_grpc

log = logging.getLogger("elastic-agent")


#: With several controller addresses, a registration that takes longer
#: (seconds) moves on to the next: a frozen or cut-off leader never answers.
REGISTER_TIMEOUT_S = 2.0

#: Reports kept for the next controller while none is connected (the oldest
#: are dropped past this many).
UNDELIVERED_MAX = 256


class _NoController(Exception):
    """No controller address answered in one round."""


class _Silent(Exception):
    """The controller of a session went silent (no heartbeat ack)."""


class _Deposed(Exception):
    """A controller answered with a lower term than one already followed."""


@dataclasses.dataclass(frozen=True)
class AgentSettings:
    """controller: "HOST:PORT", or several comma-separated (a leader and
    its standbys, tried in turn); devices / device_kind: this host's
    accelerators at start; device_dir: where to count them again at every
    heartbeat (None: `devices` is fixed, e.g. given on the command line;
    the kind is fixed at start either way);
    address: where peers reach this host; state_dir: where leftovers are
    tracked; tls: this host's certificate bundle (None: plaintext, trusting
    whatever answers at `controller`); allow: the workers this host may run
    (empty: none); stop_grace_s: SIGTERM -> SIGKILL when the agent itself stops;
    rpc_timeout_s: deadline of each unary call; metadata_url: GCE metadata
    base URL to watch for preemption notices (None: do not watch);
    preemption_grace_s: after a preemption notice, how long the agent waits
    for the controller to stop its worker before it stops it hard;
    snapshot_dir: the worker's local snapshots (default: a fresh random
    directory in /dev/shm, see elastic.agent.snapshot_dir), made when the
    agent starts, emptied when a new controller run starts a worker here
    and removed when the agent stops; compile_cache_dir: the worker's executable cache
    (elastic.worker.compile_cache; default STATE_DIR/compile-cache), which
    hosts of one machine type may share."""

    controller: str
    host_id: str
    devices: int
    address: str
    failure_domain: str
    state_dir: str
    tls: TLSFiles | None
    allow: AllowList = AllowList()
    job_id: str = ""
    stop_grace_s: float = 5.0
    rpc_timeout_s: float = 5.0
    metadata_url: str | None = None
    preemption_grace_s: float = 25.0
    snapshot_dir: str | None = None
    compile_cache_dir: str | None = None
    device_kind: str = "cpu"
    device_dir: str | None = None


class Agent:
    """One host's agent. `await run()` returns when SIGTERM/SIGINT arrives
    (or `shutdown()` is called), after ending the worker."""

    def __init__(self, settings: AgentSettings) -> None:
        self.settings = settings
        self.incarnation = uuid.uuid4().hex[:12]
        self.job_id = settings.job_id
        self.supervisor = WorkerSupervisor(os.path.abspath(settings.state_dir),
                                           self.incarnation, self._worker_exited)
        self.ports = PortProber()
        self._prestart_next = False
        self.progress_address = f"@elastic-progress-{self.incarnation}"
        self._outbox: asyncio.Queue | None = None
        # reports made while no controller was connected (a worker's events,
        # a commit, an exit), sent to the next one: its journal stays whole
        self._undelivered: collections.deque[pb.AgentMessage] = collections.deque(
            maxlen=UNDELIVERED_MAX)
        self._stopping = asyncio.Event()
        self.preemption = ""  # why this host is being taken away, once it is
        self._leave_after_stop = False
        self._hard_stop = False
        self._seq = 0
        self._tasks: set[asyncio.Task] = set()
        self.snapshot_dir = ""  # made by prepare()
        self._snapshot_run = ""  # the controller run the snapshots belong to
        self._snapshot_generation = 0  # the generation whose worker wrote them last
        self._prepared = False
        self.devices = Devices(settings.devices, settings.device_kind)
        # the fencing lease: renewed by every word from the controller; none
        # until the first registration tells the controller's timeouts
        self._lease_s: float | None = None
        self._heartbeat_interval_s = 1.0
        self._heard_at = time.monotonic()
        self._fenced = ""  # why this agent stopped its worker on its own, until told
        # the highest controller term heard (elastic.controller.leadership):
        # a controller of a lower term was deposed and is not obeyed
        self._term = 0

    def _recount_devices(self) -> None:
        """Count the device nodes again (when not fixed); a change rides on
        the next heartbeat, and the controller re-plans a slice this host
        can no longer serve. Only the count: the kind stays what it was at
        start (a driver file that cannot be read once must not turn an H100
        into a "gpu" and stop the slice)."""
        if self.settings.device_dir is None:
            return
        count = discover_devices(self.settings.device_dir).count
        if count != self.devices.count:
            log.warning("this host now has %d %s device(s); it had %d", count,
                        self.devices.kind, self.devices.count)
            self.devices = Devices(count, self.devices.kind)

    def prepare(self) -> None:
        """Before `run`: kill what an earlier agent process left and make
        the private directories (the state directory, a new snapshot
        directory, the compile cache). Raises OSError when they cannot be
        made."""
        killed = kill_leftovers(os.path.abspath(self.settings.state_dir), self.incarnation)
        if killed:
            log.warning("killed %d leftover process(es) of a previous agent: %s",
                        len(killed), killed)
        # a host that restarts keeps no state of the last one
        self.snapshot_dir = str(snapshot_dir.make(self.settings.state_dir,
                                                  self.settings.snapshot_dir))
        private_dir(self._cache_dir())
        self._prepared = True

    def _cache_dir(self) -> str:
        return os.path.abspath(self.settings.compile_cache_dir or
                               os.path.join(self.settings.state_dir, "compile-cache"))

    # --- messages up -------------------------------------------------------

    def _header(self) -> pb.Header:
        return pb.Header(job_id=self.job_id, host_id=self.settings.host_id,
                         incarnation=self.incarnation,
                         generation=self.supervisor.status.generation)

    def _post(self, **body) -> None:
        message = pb.AgentMessage(header=self._header(), **body)
        if self._outbox is None:
            if "heartbeat" not in body:  # (the next session starts with a fresh one)
                self._undelivered.append(message)
        elif self._outbox.qsize() < 1000:
            self._outbox.put_nowait(message)

    def _heartbeat(self) -> None:
        self._seq += 1
        self._recount_devices()
        running = self.supervisor.running
        self.supervisor.status.suspended = running and self.supervisor.suspended()
        free_port = 0 if running or self.preemption else self.ports.probe()
        self._post(heartbeat=pb.Heartbeat(seq=self._seq, worker=self.supervisor.status,
                                          free_port=free_port, preemption=self.preemption,
                                          sent_at=time.time(), devices=self.devices.count,
                                          device_kind=self.devices.kind))

    def _worker_exited(self, status: pb.WorkerStatus) -> None:
        self._post(worker_exited=status)
        # (it recounts the devices: a chip failure often shows first as a crash)
        self._heartbeat()  # offers a fresh coordinator port for the next generation
        if self._leave_after_stop:  # preempted by SIGTERM: leave once the report is out
            asyncio.get_running_loop().call_later(0.2, self._stopping.set)

    # --- preemption --------------------------------------------------------

    def preempt(self, reason: str, leave: bool) -> None:
        """This host is being taken away: tell the controller (it waits for
        the emergency checkpoint, then stops the slice and restarts without
        this host) and tell the worker (SIGTERM to its main process: JAX's
        preemption service makes every process save at the next common
        step). With `leave`, the agent exits once its worker is stopped; it
        stops the worker itself after preemption_grace_s at the latest."""
        if self.preemption:
            return
        self.preemption = reason
        self._leave_after_stop = leave
        log.warning("preemption: %s", reason)
        self.supervisor.discard_prestarted()  # no next generation on this host
        self.supervisor.signal_main(signal.SIGTERM)
        self._heartbeat()
        loop = asyncio.get_running_loop()
        loop.call_later(self.settings.preemption_grace_s, self._preemption_deadline)
        if leave and not self.supervisor.running:
            loop.call_later(0.2, self._stopping.set)

    def _preemption_deadline(self) -> None:
        if self.supervisor.running:
            log.error("preemption grace of %.0f s over; stopping the worker hard",
                      self.settings.preemption_grace_s)
            self._spawn(self.supervisor.stop(self.supervisor.status.generation, 0.0))
        if self._leave_after_stop:
            self._stopping.set()

    def _on_sigterm(self) -> None:
        if self.preemption:  # the second SIGTERM: stop hard, now
            log.warning("second SIGTERM: stopping the worker hard")
            self._hard_stop = True
            self._stopping.set()
        else:
            self.preempt("SIGTERM to the agent", leave=True)

    def _progress(self, data: bytes) -> None:
        try:
            report = progress.decode(data)
        except ValueError as e:
            log.warning("%s", e)
            return
        if report.event:
            if report.generation == self.supervisor.status.generation:
                self._post(worker_event=pb.WorkerEvent(
                    kind=report.event, reason=report.reason,
                    fields_json=json.dumps(report.fields)))
            return
        first, newer = self.supervisor.note_progress(report.generation, report.step,
                                                     report.committed_step, report.metrics)
        if first and self._prestart_next:
            self._spawn(self.supervisor.prestart_next())
        if first or newer:
            status = self.supervisor.status
            self._post(progress=pb.Progress(step=status.step, committed_step=status.committed_step,
                                            metrics=status.metrics))

    # --- commands down -----------------------------------------------------

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _worker_env(self, start: pb.StartWorker) -> dict[str, str]:
        """The environment the agent gives the worker `start` describes:
        the job's variables, the generation's and this host's."""
        return {**start.env,
                config.ENV_COORDINATOR: start.coordinator_address,
                config.ENV_PROCESS_ID: str(start.process_id),
                config.ENV_NUM_PROCESSES: str(start.num_processes),
                config.ENV_GENERATION: str(start.generation),
                config.ENV_HOST_ID: self.settings.host_id,
                config.ENV_DEVICES_PER_HOST: str(start.devices_per_host or self.devices.count),
                config.ENV_HOST_DEVICES: str(self.devices.count),
                config.ENV_PROGRESS_SOCKET: self.progress_address,
                config.ENV_SNAPSHOT_DIR: self.snapshot_dir,
                config.ENV_CACHE_DIR: self._cache_dir(),
                "PYTHONUNBUFFERED": "1"}

    def _vet(self, launch: pb.StartWorker) -> list[str] | str:
        """The argv this host runs for `launch` (its program the absolute
        path the allow-list checked), or why it must not run it (cleaned:
        it quotes what the controller sent)."""
        verdict = check_launch(self.settings.allow, list(launch.argv), dict(launch.env),
                               launch.workdir, shutil.which)
        return clean_text(verdict, 2000) if isinstance(verdict, str) else verdict

    async def _start(self, start: pb.StartWorker) -> None:
        argv = self._vet(start)
        if isinstance(argv, str):
            log.error("refusing to start the worker of generation %d: %s", start.generation,
                      argv)
            await self.supervisor.refuse(start.generation, f"elastic-agent on "
                                         f"{self.settings.host_id} refused to start the worker: "
                                         f"{argv}")
            return
        host, _, port = start.coordinator_address.rpartition(":")
        if start.process_id == 0 and port.isdigit():
            self.ports.used(int(port))
        env = self._worker_env(start)
        run = start.env.get(config.ENV_RUN_ID, "")
        # Snapshots are of use only to the line of training the slice goes on
        # with: those of another controller run never are (a file an old
        # worker still writes has the old run id: never restored, deleted at
        # the next restore), and a host that missed a generation (lost, cut
        # off, fenced, left out) may hold steps of a line a later generation
        # gave up; it gets the step the slice resumes from a peer instead
        # (elastic.checkpoint.snapshot_transfer).
        missed = start.generation != self._snapshot_generation + 1
        self._snapshot_generation = start.generation
        if run != self._snapshot_run or missed:
            self._snapshot_run = run
            try:
                snapshot_dir.empty(self.snapshot_dir)
            except OSError as e:
                log.error("cannot empty the snapshot directory %s: %s", self.snapshot_dir, e)
                await self.supervisor.refuse(start.generation, f"elastic-agent on "
                                             f"{self.settings.host_id}: cannot empty its "
                                             f"snapshot directory {self.snapshot_dir}: {e}")
                return
        self._prestart_next = start.prestart_next
        if not start.prestart_next:
            self.supervisor.discard_prestarted()
        await self.supervisor.start(start.generation, argv, env, start.workdir)
        self._heartbeat()  # the controller learns of the new worker before its first step

    def _command_problem(self, message: pb.ControllerMessage) -> str | None:
        """Why a command from the (authenticated) controller is malformed."""
        kind = message.WhichOneof("body")
        if self.job_id and message.job_id != self.job_id:
            return f"a command for job {message.job_id[:128]!r}; this agent runs {self.job_id!r}"
        if kind == "start":
            s = message.start
            try:
                transport.parse_address(s.coordinator_address, "coordinator address")
            except ValueError as e:
                return str(e)
            if s.generation < 1 or not 0 <= s.process_id < s.num_processes <= 1_000_000:
                return (f"start of generation {s.generation} as process {s.process_id} of "
                        f"{s.num_processes}")
        elif kind == "stop":
            grace = message.stop.grace_s
            if not (math.isfinite(grace) and 0 <= grace <= config.MAX_STOP_GRACE_S):
                return f"stop with a grace of {grace} s"
        elif kind is None:
            return "a command without a body"
        return None

    def _command(self, message: pb.ControllerMessage) -> None:
        if message.term < self._term:
            log.error("ignoring a %s of term %d: a controller of term %d leads the job",
                      message.WhichOneof("body"), message.term, self._term)
            return
        problem = self._command_problem(message)
        if problem:
            log.error("ignoring a malformed command from the controller: %s", problem)
            return
        kind = message.WhichOneof("body")
        if kind == "start":
            self._spawn(self._start(message.start))
        elif kind == "stop":
            stop = message.stop
            log.info("stop generation %d (grace %.1f s): %s", stop.generation, stop.grace_s,
                     clean_text(stop.reason, 500))
            self._spawn(self.supervisor.stop(stop.generation, stop.grace_s))
        elif kind == "rejected":
            r = message.rejected
            log.warning("controller refused a report: %s", clean_text(r.reason, 500))
            if self.supervisor.status.generation < r.current_generation:
                self._spawn(self.supervisor.stop(r.current_generation - 1, 0.0))

    # --- the connection ----------------------------------------------------

    def _register_request(self) -> pb.RegisterRequest:
        s = self.settings
        return pb.RegisterRequest(
            header=self._header(), devices=self.devices.count,
            device_kind=self.devices.kind, address=s.address,
            failure_domain=s.failure_domain, agent_pid=os.getpid(),
            worker=self.supervisor.status, fenced=self._fenced,
            free_port=0 if self.supervisor.running else self.ports.probe())

    async def _session(self, channel: grpc.aio.Channel, address: str) -> None:
        """Register with the controller at `address` (one attempt) and
        serve its stream until it ends. Raises grpc.RpcError when the
        controller cannot be reached or refuses."""
        stub = pb_grpc.ControllerStub(channel)
        several = "," in self.settings.controller
        reply = await stub.Register(self._register_request(), timeout=min(
            self.settings.rpc_timeout_s, REGISTER_TIMEOUT_S) if several else
            self.settings.rpc_timeout_s)
        if reply.term < self._term:
            raise _Deposed(f"controller {address} leads term {reply.term}; a controller of "
                           f"term {self._term} has led since: not following it")
        self._term = reply.term
        self.job_id = reply.job_id
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
        # what happened while no controller listened first, in order, then
        # the state now (a heartbeat would journal a newer commit ahead of them)
        while self._undelivered:
            outbox.put_nowait(self._undelivered.popleft())
        self._heartbeat()

        async def write() -> None:
            while True:
                await call.write(await outbox.get())

        async def beat() -> None:
            while True:
                await asyncio.sleep(reply.heartbeat_interval_s)
                self._heartbeat()

        tasks = [asyncio.create_task(write()), asyncio.create_task(beat())]
        # A controller answers every heartbeat. One silent this long is
        # stopped or cut off (its connection may stay open for minutes):
        # end the session and go round the addresses (a standby may lead).
        # (Reads go through a queue: a cancelled read would end the call.)
        silence_s = max(reply.heartbeat_timeout_s, 3 * reply.heartbeat_interval_s)
        inbox: asyncio.Queue = asyncio.Queue()

        async def read() -> None:
            try:
                while (message := await call.read()) is not grpc.aio.EOF:
                    inbox.put_nowait(message)
            finally:
                inbox.put_nowait(None)

        reader = asyncio.create_task(read())
        tasks.append(reader)
        try:
            while True:
                try:
                    message = await asyncio.wait_for(inbox.get(), silence_s)
                except TimeoutError:
                    await asyncio.sleep(0.5)  # (this agent may have been stopped itself)
                    if inbox.empty():
                        log.warning("controller %s silent for %.1f s; looking for a "
                                    "controller", address, silence_s)
                        raise _Silent()
                    continue
                if message is None:
                    await asyncio.wait([reader])
                    if reader.exception() is not None:
                        raise reader.exception()
                    break
                self._heard_at = time.monotonic()
                self._command(message)
        finally:
            self._outbox = None
            for task in tasks:
                task.cancel()
            call.cancel()

    async def _connect_forever(self) -> None:
        """Keep a session with a controller: try each address of
        `settings.controller` (comma-separated: a leader and its standbys) in
        turn; when none answers, wait with jittered exponential backoff
        (0.1 s doubling to AGENT_RECONNECT_MAX_S, tenacity's
        wait_random_exponential: thousands of agents do not come back in
        step) and go round again. A session that ended starts a new round at
        once. The worker trains on meanwhile, for the controller lease."""
        addresses = [a.strip() for a in self.settings.controller.split(",") if a.strip()]

        def waiting(state: tenacity.RetryCallState) -> None:
            log.info("no controller answers at %s; retrying (round %d)",
                     ", ".join(addresses), state.attempt_number)

        while True:
            async for attempt in tenacity.AsyncRetrying(
                    retry=tenacity.retry_if_exception_type(_NoController),
                    wait=tenacity.wait_random_exponential(multiplier=0.1,
                                                          max=AGENT_RECONNECT_MAX_S),
                    before_sleep=waiting):
                with attempt:
                    await self._one_round(addresses)

    async def _one_round(self, addresses: list[str]) -> None:
        """One session with the first of `addresses` that answers; raises
        _NoController when none did. A controller that went silent is moved
        to the end of `addresses` (the list is changed in place)."""
        for address in list(addresses):
            channel = None
            try:  # certificates are read again at every connect (renewals)
                channel = transport.aio_channel(address, self.settings.tls)
                await self._session(channel, address)
                log.info("controller %s closed the stream; reconnecting", address)
                return
            except _Silent:  # tried last from now on: a standby may lead
                addresses.remove(address)
                addresses.append(address)
                return
            except (TLSError, _Deposed) as e:
                log.error("cannot follow %s: %s", address, e)
            except grpc.RpcError as e:
                log.warning("controller %s: %s: %s", address, e.code().name, e.details())
            finally:
                if channel is not None:
                    await channel.close()
        raise _NoController()

    async def _keep_lease(self, tick_s: float = 0.25) -> None:
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
                                                  2 * self._heartbeat_interval_s)
            checked_at = now
            if expired and self.supervisor.running and not self._fenced:
                generation = self.supervisor.status.generation
                self._fenced = (f"heard nothing from the controller for "
                                f"{now - self._heard_at:.1f} s (lease {self._lease_s:g} s): "
                                f"stopped its worker of generation {generation} on its own")
                log.error("self-fencing: %s", self._fenced)
                self._spawn(self.supervisor.stop(generation, 0.0))

    # --- lifecycle ---------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the worker (SIGTERM, stop_grace_s, SIGKILL) and exit."""
        self._stopping.set()

    async def run(self) -> None:
        """Serve until SIGTERM/SIGINT or `shutdown()`. Calls `prepare()`
        first if the caller did not (raises OSError as it does)."""
        if not self._prepared:
            self.prepare()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self._on_sigterm)
        loop.add_signal_handler(signal.SIGINT, self.shutdown)
        loop.add_signal_handler(signal.SIGHUP, lambda: log.info(
            "SIGHUP ignored (TLS files are re-read at every connect)"))
        receiver = progress.ProgressReceiver(self.progress_address, self._progress)
        receiver.attach(loop)
        connection = asyncio.create_task(self._connect_forever())
        self._spawn(self._keep_lease())
        if self.settings.metadata_url:
            self._spawn(watch_metadata(self.settings.metadata_url,
                                       lambda reason: self.preempt(reason, leave=False)))
        try:
            await self._stopping.wait()
            grace = 0.0 if self._hard_stop else self.settings.stop_grace_s
            log.info("agent stopping: ending the worker (grace %.1f s)", grace)
            await self.supervisor.stop(self.supervisor.status.generation, grace)
        finally:
            await self.supervisor.close()
            try:
                snapshot_dir.remove_recorded(self.settings.state_dir)
            except OSError as e:
                log.error("cannot remove the snapshot directory %s: %s", self.snapshot_dir, e)
            connection.cancel()
            for task in list(self._tasks):
                task.cancel()
            receiver.close()
