"""`elasticd start`: the controller of one job behind a `grpc.aio` server."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pathlib
import signal
import time

from elastic import transport
from elastic.clock import Clock, SystemClock
from elastic.config import JobSpec
from elastic.controller.core import Controller
from elastic.controller.datagrams import DatagramEndpoint
from elastic.checkpoint.gcs import split as split_gcs
from elastic.checkpoint.storage import StorageError, latest_step
from elastic.controller.journal import JournalWriter, job_sharing, recorded
from elastic.controller.bucket_lease import PROMPT_KINDS, BucketLease
from elastic.controller.leadership import Leadership, LeadershipTaken
from elastic.controller.servicer import ControllerServicer, add_servicer
from elastic.grpc_wakeups import drain_wakeups
from elastic.health import SERVING, add_health_and_reflection
from elastic.security.files import private_dir
from elastic.security.tls import TLSError, TLSFiles

log = logging.getLogger("elasticd")

ADDRESS_FILE = "controller.addr"
#: How often (seconds) a standby tries the leader's lock.
LEADERSHIP_POLL_S = 0.2
#: The exit code of a controller that stopped leading (deposed, or cut off
#: from the bucket that holds its lease).
DEPOSED_EXIT = 3
#: The exit code of a controller that crashed (an unexpected error; its log
#: has the traceback): EX_SOFTWARE of sysexits.h, not 1, which says the job
#: failed.
CRASHED_EXIT = 70
#: Exit codes after which a controller must not be started again, as the
#: unit's RestartPreventExitStatus (workers/systemd/elasticd.service):
#: 0 the job succeeded, 1 it failed, 2 a bad command line or job spec, or
#: another controller on the state directory. Any other exit (stepped down,
#: crashed, killed) is restarted, by systemd or by `elasticd local`.
FINAL_EXITS = frozenset({0, 1, 2})
#: At most one warning this often (seconds) while the bucket that holds the
#: lease does not answer a controller waiting to lead.
STORAGE_WARN_EVERY_S = 30.0
#: The controller's gRPC service (proto/elastic/v1/control.proto).
CONTROLLER_SERVICE = "elastic.v1.Controller"


class StartError(RuntimeError):
    """The controller could not start (address, TLS files, state
    directory); nothing was started. The message says why."""


class ControllerServer:
    """A Controller served over gRPC.

    `tls`: the controller's certificate bundle (mutual TLS: every agent and
    tool must present a certificate from the same CA); None serves
    plaintext to anyone who can reach the port (`--insecure`; journaled as
    `insecure_mode`).

    `await start()` binds `listen` ("HOST:PORT", port 0 picks one), writes the
    bound address to `<state_dir>/controller.addr` and returns it;
    `await run()` reconciles until the job ends and returns its exit code
    (0 succeeded, 1 failed); `await stop(reason)` journals
    `controller_stopped`, removes the address file and ends the server.
    Raises RuntimeError from start() when the address cannot be bound,
    TLSError when the TLS files cannot be used, NotADirectoryError when the
    state directory is a file.
    """

    def __init__(self, spec: JobSpec, listen: str, state_dir: str | pathlib.Path,
                 tls: TLSFiles | None, clock: Clock | None = None,
                 tick_s: float = 0.1, term: int = 0) -> None:
        self.state_dir = private_dir(state_dir)
        before = recorded(self.state_dir, spec.job_id)
        self.spec = spec.with_checkpoint_dir(str((self.state_dir / "checkpoints").resolve()))
        other = job_sharing(self.spec.checkpoint_dir, before.other_checkpoints)
        if other is not None:
            raise RuntimeError(
                f"job {other!r} kept its checkpoints in or around {self.spec.checkpoint_dir} (the "
                f"journal in {self.state_dir} says so): job {spec.job_id!r} would restore them "
                f"and write over them; give it a checkpoint_dir of its own")
        self.listen = listen
        self.tls = tls
        self.journal = JournalWriter(self.state_dir)
        self.controller = Controller(
            self.spec, self.journal, clock or SystemClock(), tick_s,
            initial_generation=before.generation,
            known_step=max(before.step, latest_step(self.spec.checkpoint_dir)),
            inherited=before.running, run_id=before.run_id, term=term,
            discover=before.running is None and before.ended is None and
            not before.after_other_job,
            failures=before.failures)
        self.ended = before.ended
        self.controller.view.committed_step = before.committed_step
        self.server = transport.aio_server()
        self.servicer = ControllerServicer(self.controller, authenticated=tls is not None)
        add_servicer(self.servicer, self.server)
        # grpc.health.v1 ("" and elastic.v1.Controller: SERVING while this
        # controller leads) and reflection, for standard probes (elastic.health)
        self.health = add_health_and_reflection(self.server, [CONTROLLER_SERVICE])
        self.metrics_server = None
        self.address = ""
        self._stopped = False
        self._datagrams: DatagramEndpoint | None = None

    async def start(self) -> str:
        port = transport.add_listen_port(self.server, self.listen, self.tls)
        host = self.listen.rsplit(":", 1)[0] or "127.0.0.1"
        if host in ("0.0.0.0", "[::]", "::"):
            host = "127.0.0.1"
        self.address = f"{host}:{port}"
        await self.server.start()
        if not drain_wakeups(asyncio.get_running_loop()):
            log.warning("gRPC's asyncio wake-ups could not be wrapped (another grpcio?): "
                        "with thousands of agents, calls may wait for the event loop's turns "
                        "(elastic.grpc_wakeups)")
        if self.spec.health.datagram_heartbeats:
            await self._take_datagrams(port)
        for name in ("", CONTROLLER_SERVICE):
            await self.health.set(name, SERVING)
        self._write_address()
        if self.tls is None:
            self.controller.executor.record(
                "insecure_mode", self.controller.state.generation,
                f"--insecure: plaintext gRPC on {self.listen} with no authentication; anyone who "
                f"can reach the port can register hosts, read the job's command and "
                f"environment, and stop the job")
            log.warning("INSECURE: no TLS, no authentication on %s", self.listen)
        log.info("controller of job %s listening on %s (%s), journal %s", self.spec.job_id,
                 self.address, "mutual TLS" if self.tls else "PLAINTEXT", self.journal.path)
        return self.address

    def _write_address(self) -> None:
        """Write the address file tools read (elasticd status, logs, chaos).
        One that cannot be written (a full disk) is logged, not raised: the
        agents have the address already, and a controller that exits 2 here
        is not started again by systemd, stopping the job."""
        path, tmp = self.state_dir / ADDRESS_FILE, self.state_dir / (ADDRESS_FILE + ".tmp")
        try:
            tmp.write_text(self.address + "\n")
            tmp.replace(path)
        except OSError as e:
            for stale in (tmp, path):  # (an older controller's address would mislead)
                try:
                    stale.unlink(missing_ok=True)
                except OSError:
                    pass
            log.error("cannot write %s (%s): elasticd status, logs and chaos will not find "
                      "this controller; it serves the agents all the same", path, e)

    async def _take_datagrams(self, port: int) -> None:
        """Take heartbeat datagrams on UDP `port` of the listen address
        (elastic.heartbeat_datagram). A port that cannot be bound is warned
        about; agents then heartbeat on their streams."""
        bind = self.listen.rsplit(":", 1)[0].strip("[]") or "0.0.0.0"
        endpoint = DatagramEndpoint(bind, port, self.servicer.datagram_received,
                                    self.controller.count_superseded,
                                    self.controller.count_dropped)
        try:
            await endpoint.open()
        except OSError as e:
            log.warning("heartbeats only on the agents' streams: cannot take datagrams on "
                        "UDP %s port %d: %s", bind, port, e)
            return
        self._datagrams = endpoint
        self.servicer.heartbeat_port = port

    def serve_metrics(self, port: int) -> int:
        """Serve the controller's Prometheus metrics (elastic.controller.metrics)
        on `port` (0: any) of the host it listens on, with its TLS files
        (client certificates of the job's CA required). Returns the port.
        Raises OSError when the port cannot be bound."""
        from elastic import metrics
        from elastic.controller.metrics import ControllerMetrics

        collected = ControllerMetrics(self.controller, asyncio.get_running_loop())
        self.journal.listeners.append(collected.on_journal)
        self.controller.on_heartbeat_latency = collected.on_heartbeat
        self.metrics_server = metrics.serve(collected.registry,
                                            self.listen.rsplit(":", 1)[0] or "127.0.0.1",
                                            port, self.tls)
        return self.metrics_server.server_port

    async def run(self) -> int:
        return await self.controller.run()

    async def stop(self, reason: str, grace_s: float = 1.0) -> None:
        """Journal `controller_stopped` with `reason`, remove the address
        file (if it is still ours), let the last commands reach the agents
        and close. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self.controller.executor.record("controller_stopped", self.controller.state.generation,
                                        reason)
        await self.health.enter_graceful_shutdown()
        if self.metrics_server is not None:
            await asyncio.to_thread(self.metrics_server.shutdown)
        path = self.state_dir / ADDRESS_FILE
        try:
            if path.read_text().strip() == self.address:
                path.unlink()
        except OSError:
            pass
        if self._datagrams is not None:
            self._datagrams.close()
        for session in list(self.controller.sessions.values()):
            session.close()
        await self.server.stop(grace_s)
        self.journal.close()


async def serve(spec: JobSpec, listen: str, state_dir: str, tls: TLSFiles | None,
                standby: bool = False, metrics_port: int | None = None) -> int:
    """Run the controller until the job ends or SIGTERM/SIGINT arrives.

    First it takes the job's leadership: the lock on the state directory
    (elastic.controller.leadership) and, with checkpoints in a bucket, the
    lease on the journal object there (elastic.controller.bucket_lease).
    Raises StartError when another controller holds the lock (two
    controllers on one state directory), or with `standby` waits until that
    one ends, then adopts what it left running. The bucket lease is always
    waited for (standby or not): its holder may be dead (it passes after
    `health.leader_lease_s` unrenewed), or a standby that took over while
    this controller was away (restarted by systemd, or deposed and
    restarted), which this one then backs up; the bucket being out of reach
    meanwhile is logged and waited through. A controller that waited and
    takes over a job whose journal says it ended returns the job's exit
    code at once.

    Returns the exit code: 0 job succeeded, 1 job failed, 3 deposed (another
    controller took the bucket lease, or it could not be renewed), 143 / 130
    stopped by SIGTERM / SIGINT (agents keep their workers; a restarted
    controller takes over). SIGHUP is journaled and ignored (certificates are
    re-read at every new connection anyway; the job spec is not reloaded).
    Every exit, an unexpected error included, journals `controller_stopped`
    (the error then propagates; `elasticd start` exits CRASHED_EXIT, 70).
    Raises StartError when the controller cannot start."""
    received: list[int] = []
    stopped = asyncio.Event()
    loop = asyncio.get_running_loop()
    leadership: Leadership | None = None
    lease = None
    # SIGTERM/SIGINT from the first moment: while waiting to lead they end
    # the wait; once leading, a clean stop with its journal line
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda s=sig: (received.append(s), stopped.set()))
    try:
        try:
            if standby and (spec.checkpoint_dir or "").startswith("gs://") and \
                    not split_gcs(spec.checkpoint_dir)[1]:
                # (with no lease, a standby on a state directory of its own led
                # at once beside the leader: two controllers of one job)
                raise StartError(f"--standby with checkpoints at a bucket's root "
                                 f"({spec.checkpoint_dir}): a standby leads through a lease "
                                 f"beside the checkpoint directory, and a bucket's root has no "
                                 f"place beside it; use gs://BUCKET/PREFIX")
            leadership = Leadership(state_dir)

            async def lock() -> bool:
                return leadership.try_acquire()

            code, _ = await _wait_to_lead(lock, f"the lock on {leadership.state_dir}", standby,
                                          LEADERSHIP_POLL_S, stopped, received)
            if code is not None:
                return code
            waited = False
            if (spec.checkpoint_dir or "").startswith("gs://"):
                if split_gcs(spec.checkpoint_dir)[1]:  # (any failure here: StartError)
                    lease = BucketLease(spec.checkpoint_dir, state_dir,
                                        spec.health.leader_lease_s, job_id=spec.job_id,
                                        standby=standby)
                else:
                    log.warning("checkpoints at a bucket's root: no lease beside them; "
                                "no standby (--standby) can take over this job")
            if lease is not None:

                async def claim() -> bool:
                    return await asyncio.to_thread(lease.try_acquire)

                # Another controller leading through the bucket (a standby that
                # took over while this one was away, or deposed it): stand by.
                code, waited = await _wait_to_lead(claim, f"the lease on {lease.url}", True,
                                                   min(1.0, lease.lease_s / 5), stopped,
                                                   received)
                if code is not None:
                    return code
            before = recorded(state_dir, spec.job_id)
            server = ControllerServer(spec, listen, state_dir, tls,
                                      term=leader_term(leadership.term, before.term))
        except (RuntimeError, TLSError, OSError, StorageError) as e:
            raise StartError(str(e)) from None
        if (standby or waited) and server.ended is not None:
            log.info("the job in %s has ended (exit %d); this standby has nothing to do",
                     state_dir, server.ended)
            server.journal.close()
            return server.ended
        return await _serve(server, stopped, received, loop, lease, metrics_port)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        if leadership is not None:
            leadership.release()


def leader_term(locked_term: int, journaled_term: int, now: float | None = None) -> int:
    """The term of a controller that has just taken the lead: above every
    term it can know of (the lock's count, the journal's highest), and at
    least the Unix time in seconds, so that a job started afresh on a new
    state directory still outranks the controllers its long-lived agents
    followed before (they refuse lower terms)."""
    return max(locked_term, journaled_term + 1, int(time.time() if now is None else now))


async def _wait_to_lead(acquire, what: str, standby: bool, poll_s: float,
                        stopped: asyncio.Event, received: list[int]) -> tuple[int | None, bool]:
    """Poll `acquire()` (async, True once held) every `poll_s` seconds
    until it succeeds or SIGTERM/SIGINT sets `stopped`. Returns (None,
    waited) once held, (128 + the signal, True) when stopped first. Without
    `standby`, raises LeadershipTaken at once when another holds it; a
    StorageError is raised without `standby`, logged and polled through with
    it, and so is a transient one (an outage: StorageError.transient)
    without it."""
    warned_at = float("-inf")  # (the last warning that the bucket does not answer)
    try:
        if await acquire():
            return None, False
    except StorageError as e:
        if not (standby or e.transient):
            raise
        log.warning("%s; trying again until it answers", e)
        warned_at = time.monotonic()
    else:
        if not standby:
            raise LeadershipTaken(f"another controller holds {what}; start this one with "
                                  f"--standby to take over when it ends")
        log.info("standby: another controller holds %s; taking over when it ends", what)
    while not stopped.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stopped.wait(), poll_s)
        if stopped.is_set():
            break
        try:
            if await acquire():
                log.info("the leader is gone; this controller holds %s", what)
                return None, True
        except StorageError as e:
            if time.monotonic() - warned_at >= STORAGE_WARN_EVERY_S:  # (polled every poll_s)
                warned_at = time.monotonic()
                log.warning("standby: %s", e)
    return 128 + received[0], True


async def _serve(server: ControllerServer, stopped: asyncio.Event, received: list[int],
                 loop, lease: BucketLease | None = None,
                 metrics_port: int | None = None) -> int:
    deposed: list[str] = []

    prompt = asyncio.Event()
    inflight: list[asyncio.Future] = []  # the one renewal under way, if any

    async def keep_lease() -> None:
        """Renew the bucket lease (and mirror the journal) every lease_s / 4,
        and at once after an entry a standby needs; one renewal at a time
        (two would race on the generation they match). Stop leading when
        deposed, or when not renewed for lease_s / 2 by this controller's
        own clock, whatever an upload is doing."""
        while True:
            try:
                await asyncio.wait_for(prompt.wait(), lease.lease_s / 4)
            except TimeoutError:
                pass
            prompt.clear()
            if not inflight:
                inflight.append(asyncio.ensure_future(asyncio.to_thread(lease.renew)))
            left = lease.renewed_at + lease.lease_s / 2 - lease.clock()
            done, _ = await asyncio.wait(inflight, timeout=max(left, 0.0))
            why = ""
            if done:
                why = inflight.pop().result()
            elif lease.clock() - lease.renewed_at >= lease.lease_s / 2:
                why = (f"could not renew the lease on {lease.url} for "
                       f"{lease.clock() - lease.renewed_at:.1f} s (health.leader_lease_s = "
                       f"{lease.lease_s:g}): a standby may take over")
            if why:
                log.error("stepping down: %s", why)
                deposed.append(why)
                stopped.set()
                return

    def on_hup() -> None:
        server.controller.executor.record(
            "sighup", server.controller.state.generation,
            "SIGHUP received and ignored: TLS files are re-read at every new connection; "
            "the job spec is not reloaded (restart the controller to change it)")

    # (SIGTERM/SIGINT are handled since serve() began, SIGHUP from here on:
    # the address file start() writes tells tools the controller is there,
    # and a signal they send must not find the default action, which ends
    # the process without a journal line)
    loop.add_signal_handler(signal.SIGHUP, on_hup)
    if lease is not None:
        # Its term (controller_started) in the bucket before any agent learns
        # it: before, agents could follow a term the bucket never had, and a
        # standby taking over with its clock behind led with a lower term,
        # which they refuse, until someone stepped in (an audit found it).
        server.controller.announce()
        why = await asyncio.to_thread(lease.renew)
        if why:
            log.error("stepping down: %s", why)
            loop.remove_signal_handler(signal.SIGHUP)
            server.controller.executor.record("controller_stopped",
                                              server.controller.state.generation,
                                              f"controller stepped down: {why}")
            server.journal.close()
            return DEPOSED_EXIT
    try:
        await server.start()
    except (RuntimeError, TLSError, OSError) as e:
        loop.remove_signal_handler(signal.SIGHUP)
        if server.controller.announced:  # (its start is journaled: so is its end)
            server.controller.executor.record("controller_stopped",
                                              server.controller.state.generation,
                                              f"cannot start: {e}")
        raise StartError(str(e)) from None
    if metrics_port is not None:
        try:
            server.serve_metrics(metrics_port)
        except OSError as e:
            loop.remove_signal_handler(signal.SIGHUP)
            await server.stop(f"cannot serve metrics on port {metrics_port}: {e}")
            raise StartError(f"--metrics-port {metrics_port}: {e}") from None
    run = asyncio.create_task(server.run())
    stop_wait = asyncio.create_task(stopped.wait())
    renewing = None
    if lease is not None:
        # a controller frozen past half its lease acts no more (a standby may lead)
        server.controller.may_act = lambda: lease.clock() - lease.renewed_at < lease.lease_s / 2
        server.journal.listeners.append(lambda entry: prompt.set()
                                        if entry["kind"] in PROMPT_KINDS else None)
        renewing = asyncio.create_task(keep_lease())
    reason, code = "controller ended unexpectedly", 1
    try:
        await asyncio.wait([run, stop_wait], return_when=asyncio.FIRST_COMPLETED)
        if run.done():
            code = run.result()
            reason = f"job {'succeeded' if code == 0 else 'failed'}"
        elif server.controller.state.phase.terminal:  # (stopped while it read on)
            code = server.controller.state.exit_code or 0
            reason = f"job {'succeeded' if code == 0 else 'failed'}"
        elif deposed:
            code, reason = DEPOSED_EXIT, f"controller stepped down: {deposed[0]}"
        else:
            name = signal.Signals(received[0]).name
            code, reason = 128 + received[0], f"controller stopped by {name}"
    except BaseException as e:
        reason = f"controller crashed: {type(e).__name__}: {e}"
        raise
    finally:
        for task in (run, stop_wait, renewing):
            if task is not None:
                task.cancel()
        await server.stop(reason)
        if lease is not None and not deposed:  # the journal's last lines, to the bucket
            if inflight:
                await asyncio.wait(inflight, timeout=lease.lease_s / 4)
            why = await asyncio.to_thread(lease.renew)
            if why:
                log.error("the journal's last lines did not reach the bucket: %s", why)
    return code
