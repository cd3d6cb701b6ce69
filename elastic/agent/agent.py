"""The agent: one per host. It runs the worker the controller starts
(elastic.agent.supervisor), passes on its progress, preemption notices and
exit, and carries out the controller's commands. The connection itself
(register, stream, reconnect for ever) is elastic.agent.session.

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

from elastic import config, transport

from elastic import worker_env
from elastic.agent import snapshot_dir, stacks
from elastic.agent.clock_offset import ClockOffset
from elastic.agent.datagrams import HeartbeatDatagrams
from elastic.agent.replicas import ReplicaSender, ReplicaStore
from elastic.agent.host import Devices, PortProber, discover_devices
from elastic.agent.preemption import on_sigterm, watch_metadata
from elastic.agent.session import ControllerSession
from elastic.agent.supervisor import WorkerSupervisor, kill_leftovers
from elastic.security.allow import AllowList, check_launch
from elastic.security.text import clean_text
from elastic.security.files import private_dir
from elastic.security.identity import check_id
from elastic.security.tls import TLSFiles
from elastic.worker import progress
from elastic.v1 import control_pb2 as pb

log = logging.getLogger("elastic-agent")


#: Reports kept for the next controller while none is connected (the oldest
#: are dropped past this many).
UNDELIVERED_MAX = 256


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
    hosts of one machine type may share; shared_compile_cache: a second
    executable cache the hosts share (gs://bucket/prefix or a directory),
    looked in after this host's and written to by every compile (None:
    none), its entries signed with the key in the file
    shared_compile_cache_key; listen: "HOST:PORT" of the agent's
    own gRPC port (health, reflection: elastic.agent.service; None: none);
    metrics_port: its Prometheus metrics (elastic.agent.metrics) on the
    listen host, or `address` (None: none)."""

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
    shared_compile_cache: str | None = None
    shared_compile_cache_key: str | None = None
    device_kind: str = "cpu"
    device_dir: str | None = None
    listen: str | None = None
    metrics_port: int | None = None


class Agent(ControllerSession):
    """One host's agent. `await run()` returns when SIGTERM/SIGINT arrives
    (or `shutdown()` is called), after ending the worker."""

    def __init__(self, settings: AgentSettings) -> None:
        self.settings = settings
        self.incarnation = uuid.uuid4().hex[:12]
        self.job_id = settings.job_id
        self.supervisor = WorkerSupervisor(os.path.abspath(settings.state_dir),
                                           self.incarnation, self._worker_exited,
                                           log_state_dir=settings.state_dir)
        self.ports = PortProber()
        self._prestart_next = False
        self.progress_address = f"@elastic-progress-{self.incarnation}"
        self._progress_receiver: progress.ProgressReceiver | None = None
        self._outbox: asyncio.Queue | None = None
        # the session's heartbeat datagrams (elastic.agent.datagrams), if any
        self._datagrams: HeartbeatDatagrams | None = None
        self._message_seq = 0  # every message's header.seq
        self._writing = False  # a message is being written to the stream
        self._last_stop: bytes | None = None  # the last stop acted on (see _command)
        # the highest (term, generation) a start was taken for or a stop came
        # for: a start at or below it is a copy, or was overtaken by its stop
        self._commanded = (0, 0)
        # the highest (term, generation) a stop came for: a start at or below
        # it that still waits for the start before it is not made
        self._stopped_through = (0, 0)
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
        self._replica_senders: frozenset[str] = frozenset()  # whose replicas it takes
        # buddy replication of snapshots (elastic.agent.replicas), made by prepare()
        self.replica_store: ReplicaStore | None = None
        self.replica_sender: ReplicaSender | None = None
        self._prepared = False
        self.devices = Devices(settings.devices, settings.device_kind)
        # the fencing lease: renewed by every word from the controller; none
        # until the first registration tells the controller's timeouts
        self._lease_s: float | None = None
        self._heartbeat_interval_s = 1.0
        self._heard_at = time.monotonic()
        self._fenced = ""  # why this agent stopped its worker on its own, until told
        # the highest controller term heard (elastic.controller.leadership):
        # a controller of a lower term was deposed and is not obeyed; and
        # that term for each job followed (a deposed leader of a job before
        # is not followed again; another job is not held to its clock)
        self._term = 0
        self._job_terms: dict[str, int] = {}
        self.sessions_opened = 0
        #: the controller's clock against this host's, from heartbeat acks: the
        #: heartbeats' send times are stamped on the controller's clock
        self.clock_offset = ClockOffset()
        self.worker_exits: dict[str, int] = {}  # outcome -> count (the metrics)
        self.service = None  # elastic.agent.service.AgentService, with --listen
        self.metrics_server = None
        self.service_port = self.metrics_port = 0

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
        self.replica_store = ReplicaStore(self.snapshot_dir, lambda: self._snapshot_run,
                                          lambda: self._snapshot_generation,
                                          lambda: self._replica_senders)
        self.replica_sender = ReplicaSender(self.snapshot_dir, self.settings.tls)
        private_dir(self._cache_dir())
        self._prepared = True

    def _cache_dir(self) -> str:
        return os.path.abspath(self.settings.compile_cache_dir or
                               os.path.join(self.settings.state_dir, "compile-cache"))

    # --- messages up -------------------------------------------------------

    def _header(self) -> pb.Header:
        self._message_seq += 1
        return pb.Header(job_id=self.job_id, host_id=self.settings.host_id,
                         incarnation=self.incarnation,
                         generation=self.supervisor.status.generation, seq=self._message_seq)

    def _post(self, **body) -> None:
        message = pb.AgentMessage(header=self._header(), **body)
        if self._outbox is None:
            if "heartbeat" not in body:  # (the next session starts with a fresh one)
                self._undelivered.append(message)
        elif self._outbox.qsize() < 1000:
            self._outbox.put_nowait(message)

    def _heartbeat(self, periodic: bool = False) -> None:
        """Send a heartbeat: a `periodic` one as a datagram when the
        session has them and nothing waits on the stream (it must not
        overtake it), else and every other one (something changed) on the
        stream."""
        self._seq += 1
        self._recount_devices()
        running = self.supervisor.running
        self.supervisor.status.suspended = running and self.supervisor.suspended()
        free_port = 0 if running or self.preemption else self.ports.probe()
        heartbeat = pb.Heartbeat(seq=self._seq, worker=self.supervisor.status,
                                 free_port=free_port, preemption=self.preemption,
                                 sent_at=self.clock_offset.stamp(self._seq),
                                 devices=self.devices.count,
                                 device_kind=self.devices.kind)
        idle = periodic and self._outbox is not None and self._outbox.empty() and \
            not self._writing  # (nothing on the stream for a datagram to overtake)
        datagrams = self._datagrams if idle else None
        if datagrams is not None and datagrams.send(
                pb.AgentMessage(header=self._header(), heartbeat=heartbeat)):
            return
        self._post(heartbeat=heartbeat)
        if datagrams is not None and datagrams.probe_due():  # (newer than the stream's copy)
            datagrams.probe(pb.AgentMessage(header=self._header(), heartbeat=heartbeat))

    def _worker_exited(self, status: pb.WorkerStatus) -> None:
        if self._progress_receiver is not None:
            # reports the worker sent before it exited count first (its reaping
            # and its last datagrams may be ready in the same pass of the loop)
            self._progress_receiver.receive()
        outcome = "stopped" if status.stopped_on_request else \
            "succeeded" if status.exit_code == 0 and not status.signal else "failed"
        self.worker_exits[outcome] = self.worker_exits.get(outcome, 0) + 1
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
        action = on_sigterm(self.preemption, self._leave_after_stop)
        if action == "hard":
            log.warning("second SIGTERM: stopping the worker hard")
            self._hard_stop = True
            self._stopping.set()
        elif action == "leave":  # (the shutdown a metadata notice announced)
            log.warning("SIGTERM after the %s: leaving once the worker has saved",
                        self.preemption)
            self._leave_after_stop = True
            if not self.supervisor.running:
                asyncio.get_running_loop().call_later(0.2, self._stopping.set)
        else:
            self.preempt("SIGTERM to the agent", leave=True)

    def _progress(self, data: bytes) -> None:
        try:
            report = progress.decode(data)
        except ValueError as e:
            log.warning("%s", e)
            return
        if report.event == "snapshot_written":  # for the buddy, not the journal
            # (the sender checks the generation against its own too: target()
            # names the next one before the supervisor's status moves to it)
            if report.generation == self.supervisor.status.generation and \
                    isinstance(report.fields.get("step"), int):
                self.replica_sender.offer(report.fields["step"], report.generation)
            return
        if report.failure:  # (the controller hears of it now, while the worker may wait)
            if self.supervisor.note_failure(report.generation, report.failure):
                self._heartbeat()
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
                worker_env.ENV_COORDINATOR: start.coordinator_address,
                worker_env.ENV_PROCESS_ID: str(start.process_id),
                worker_env.ENV_NUM_PROCESSES: str(start.num_processes),
                worker_env.ENV_GENERATION: str(start.generation),
                worker_env.ENV_HOST_ID: self.settings.host_id,
                worker_env.ENV_DEVICES_PER_HOST: str(start.devices_per_host or self.devices.count),
                worker_env.ENV_HOST_DEVICES: str(self.devices.count),
                worker_env.ENV_NEXT_SLICES: worker_env.format_next_slices(
                    (s.num_processes, s.devices_per_host) for s in start.next_slices),
                worker_env.ENV_PROGRESS_SOCKET: self.progress_address,
                worker_env.ENV_SNAPSHOT_DIR: self.snapshot_dir,
                worker_env.ENV_CACHE_DIR: self._cache_dir(),
                worker_env.ENV_SHARED_CACHE: self.settings.shared_compile_cache or "",
                worker_env.ENV_SHARED_CACHE_KEY_FILE: self.settings.shared_compile_cache_key or "",
                "PYTHONUNBUFFERED": "1"}

    def _vet(self, launch: pb.StartWorker) -> list[str] | str:
        """The argv this host runs for `launch` (its program the absolute
        path the allow-list checked), or why it must not run it (cleaned:
        it quotes what the controller sent)."""
        verdict = check_launch(self.settings.allow, list(launch.argv), dict(launch.env),
                               launch.workdir, shutil.which)
        return clean_text(verdict, 2000) if isinstance(verdict, str) else verdict

    async def _start(self, start: pb.StartWorker, taken: tuple[int, int]) -> None:
        """Start the worker `start` describes, `taken` its (term,
        generation): not if a stop of it came first (see _command)."""
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
        run = start.env.get(worker_env.ENV_RUN_ID, "")
        # Snapshots are of use only to the line of training the slice goes on
        # with: those of another controller run never are (a file an old
        # worker still writes has the old run id: never restored, deleted at
        # the next restore), and a host that missed a generation (lost, cut
        # off, fenced, left out) may hold steps of a line a later generation
        # gave up; it gets the step the slice resumes from a peer instead
        # (elastic.checkpoint.snapshot_transfer).
        missed = start.generation != self._snapshot_generation + 1
        self._snapshot_generation = start.generation
        self._replica_senders = frozenset(start.replica_senders)
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
        self.replica_sender.target(start.replica_host, start.replica_address, run,
                                   start.generation)
        self._prestart_next = start.prestart_next
        if not start.prestart_next:
            self.supervisor.discard_prestarted()
        await self.supervisor.start(start.generation, argv, env, start.workdir,
                                    overtaken=lambda: self._stopped_through >= taken)
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
                if s.replica_address:
                    transport.parse_address(s.replica_address, "replica address")
                    check_id(s.replica_host, "replica host")
                for sender in s.replica_senders:
                    check_id(sender, "replica sender")
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
            taken = (message.term, message.start.generation)
            if taken <= self._commanded:
                # Its other copy (datagram and stream), or a start a stop of its
                # generation overtook: a leader starts a generation once, and
                # never after stopping it. (A new leader's term is higher.)
                log.debug("start of generation %d (term %d) already taken or stopped",
                          message.start.generation, message.term)
                return
            self._commanded = taken
            self._last_stop = None  # (a new generation: stops are told apart afresh)
            self._spawn(self._start(message.start, taken))
        elif kind == "stop":
            stop = message.stop
            self._commanded = max(self._commanded, (message.term, stop.generation))
            self._stopped_through = max(self._stopped_through, (message.term, stop.generation))
            raw = message.SerializeToString()
            if raw == self._last_stop:  # its other copy (datagram and stream): one SIGTERM
                return
            self._last_stop = raw
            log.info("stop generation %d (grace %.1f s): %s", stop.generation, stop.grace_s,
                     clean_text(stop.reason, 500))
            if stop.dump_stacks:
                self._spawn(self._dump_stacks_then_stop(stop))
            else:
                self._spawn(self.supervisor.stop(stop.generation, stop.grace_s))
        elif kind == "ack":
            self.clock_offset.acked(message.ack.seq, message.ack.received_at)
        elif kind == "rejected":
            r = message.rejected
            log.warning("controller refused a report: %s", clean_text(r.reason, 500))
            if self.supervisor.status.generation < r.current_generation:
                self._spawn(self.supervisor.stop(r.current_generation - 1, 0.0))

    async def _dump_stacks_then_stop(self, stop: pb.StopWorker) -> None:
        """A hung worker: report its threads' stacks (elastic.agent.stacks,
        at most DUMP_TIMEOUT_S), then stop it."""
        w = self.supervisor.status
        if self.supervisor.running and w.generation == stop.generation and w.pid:
            stacks_, frame, error = await stacks.dump(w.pid)
            if error:
                log.warning("no stacks of the hung worker (pid %d): %s", w.pid, error)
            else:
                log.error("the hung worker (pid %d) was stuck in %s:\n%s", w.pid, frame, stacks_)
            self._post(stacks=pb.WorkerStacks(generation=w.generation,
                                              process_id=w.process_id, pid=w.pid,
                                              stacks=stacks_, frame=frame, error=error))
        await self.supervisor.stop(stop.generation, stop.grace_s)

    # --- lifecycle ---------------------------------------------------------

    def metrics_snapshot(self) -> dict:
        """What the agent's metrics read (elastic.agent.metrics), taken on
        its event loop: session, worker, counters."""
        w = self.supervisor.status
        return {"connected": self._outbox is not None, "sessions": self.sessions_opened,
                "generation": w.generation, "running": self.supervisor.running,
                "step": w.step, "committed": w.committed_step,
                "exits": dict(self.worker_exits), "devices": self.devices.count,
                "heartbeats": self._seq, "fenced": bool(self._fenced),
                "preempted": bool(self.preemption),
                "replicas_sent": self.replica_sender.sent,
                "replica_failures": self.replica_sender.failures_total,
                "replica_step": self.replica_sender.last_sent_step,
                "replica_send_s": self.replica_sender.last_send_s,
                "replicas_received": self.replica_store.received}

    async def _serve_ports(self, loop) -> None:
        """Open the agent's own gRPC port and its metrics port, if asked for
        (their numbers go to the controller with every registration).
        Raises RuntimeError / OSError when one cannot be bound, TLSError
        when the host's files cannot serve."""
        s = self.settings
        if s.listen is not None:
            from elastic.agent.service import AgentService

            self.service = AgentService(s.listen, s.tls, s.state_dir,
                                        replicas=lambda: self.replica_store)
            self.service_port = await self.service.start()
        if s.metrics_port is not None:
            from elastic import metrics
            from elastic.agent.metrics import agent_registry

            host = s.listen.rsplit(":", 1)[0] if s.listen else s.address
            self.metrics_server = metrics.serve(agent_registry(self, loop), host,
                                                s.metrics_port, s.tls)
            self.metrics_port = self.metrics_server.server_port

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
        await self._serve_ports(loop)
        receiver = progress.ProgressReceiver(self.progress_address, self._progress)
        receiver.attach(loop)
        self._progress_receiver = receiver
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
            await self.replica_sender.close()
            try:
                snapshot_dir.remove_recorded(self.settings.state_dir)
            except OSError as e:
                log.error("cannot remove the snapshot directory %s: %s", self.snapshot_dir, e)
            connection.cancel()
            for task in list(self._tasks):
                task.cancel()
            self._progress_receiver = None
            receiver.close()
            if self.service is not None:
                await self.service.stop()
            if self.metrics_server is not None:
                await asyncio.to_thread(self.metrics_server.shutdown)
