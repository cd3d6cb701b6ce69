"""Worker process supervision: start in its own process group, report the
exit at once, stop with SIGTERM -> grace -> SIGKILL, never outlive the agent.

Workers die with their agent: each worker gets PR_SET_PDEATHSIG(SIGKILL) and
its whole process group is killed whenever the worker ends; a restarted agent
kills what an earlier incarnation left (`kill_leftovers`), found by the
marker variable every worker inherits.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import os
import pathlib
import signal
import sys
from collections.abc import Callable, Mapping

from elastic import worker_env
from elastic.agent.child import WorkerProcess, spawn
from elastic.agent.logs import WorkerLog
from elastic.checkpoint import storage
from elastic.procs import (WORKER_PROCESS_GROUP, die_with_parent, process_state, signal_group,
                           signal_pid)
from elastic.worker.prestart import READY_LINE, set_policy
from elastic.v1 import control_pb2 as pb

log = logging.getLogger("elastic-agent")

_FAILURE_CAUSES = {"own": pb.FAILURE_CAUSE_OWN, "peer": pb.FAILURE_CAUSE_PEER}

#: How long (seconds) the agent goes on reading a worker's stdout and stderr
#: after it ended, before it reports the exit: what it wrote is in the pipes
#: already, and only a process it left behind, outside its process group, can
#: keep them open. Well under the controller's wait for the cause of a failure
#: (elastic.policy.blame.ECHO_WAIT_S, 1 s): a cause reported this much late is
#: still blamed before its echoes.
PIPES_AFTER_EXIT_S = 0.25


def kill_leftovers(owner: str, incarnation: str) -> list[int]:
    """SIGKILL every process marked as started by an agent with state dir
    `owner` but another incarnation (what a previous agent process left).
    Returns their pids. Reads /proc/<pid>/environ (same user or root)."""
    marker = f"{worker_env.ENV_WORKER_OWNER}={owner}".encode()
    mine = f"{worker_env.ENV_INCARNATION}={incarnation}".encode()
    killed = []
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if marker in environ and mine not in environ and \
                signal_pid(int(entry.name), signal.SIGKILL):
            killed.append(int(entry.name))
    return killed


def launch_key(argv: list[str], full_env: Mapping[str, str], workdir: str) -> tuple | None:
    """What must be equal for a pre-started process to run a worker: the
    interpreter, the working directory and every environment variable (JAX
    reads `JAX_*` defaults at import) but the per-generation ones and the
    job's own (worker_env.JOB_LEVEL_ENV: read by `elastic.worker.init()`
    after the launch, never at import), of which only the checkpoint
    directory's scheme counts (it chooses what is preloaded). So a process
    pre-started during one job serves the next job's first start. None if
    `argv` is not `python script.py ...` or `python -m module ...`."""
    if len(argv) < 2 or not os.path.basename(argv[0]).startswith("python") or \
            (argv[1].startswith("-") and argv[1] != "-m") or (argv[1] == "-m" and len(argv) < 3):
        return None
    env = tuple(sorted((k, v) for k, v in full_env.items()
                       if k not in worker_env.PER_GENERATION_ENV + worker_env.JOB_LEVEL_ENV))
    return (argv[0], workdir, env, storage.scheme(full_env.get(worker_env.ENV_CHECKPOINT_DIR, "")))


def _ended(pid: int) -> bool:
    """Whether child `pid` has exited, reaped or not (asyncio's child watcher
    reaps in a thread before the loop hears of it)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # (reaped already)
        return True


@dataclasses.dataclass
class Prestarted:
    """A pre-started worker process (elastic.worker.prestart): `ready`
    resolves True once it has imported what it preloads and waits for its
    launch, False if it exited first."""

    proc: WorkerProcess
    key: tuple
    ready: asyncio.Task


async def _ready(proc: WorkerProcess) -> bool:
    while line := await proc.stderr.readline():
        if line.rstrip() == READY_LINE:
            return True
        sys.stderr.buffer.write(line)
    return False


def _discard(warm: Prestarted) -> None:
    warm.ready.cancel()
    warm.proc.stdin.close()  # end of input: it would exit by itself
    if warm.proc.returncode is None:
        signal_group(warm.proc.pid)


class WorkerSupervisor:
    """Runs at most one worker at a time.

    `status` (a pb.WorkerStatus) always describes the current or last worker.
    `on_exit(status)` is called once per worker, the moment it is reaped.
    stdout and stderr are copied to the agent's, and with `log_state_dir`
    into the worker's log file there (elastic.agent.logs.WorkerLog); the
    last `tail_lines` lines of stderr go into the exit report.
    """

    def __init__(self, owner: str, incarnation: str,
                 on_exit: Callable[[pb.WorkerStatus], None], tail_lines: int = 20,
                 log_state_dir: str | None = None) -> None:
        self.log_state_dir = log_state_dir
        self.owner = owner
        self.incarnation = incarnation
        self.on_exit = on_exit
        self.status = pb.WorkerStatus(state=pb.WORKER_IDLE, step=-1, committed_step=-1)
        self._proc: WorkerProcess | None = None
        self._watch: asyncio.Task | None = None
        self._tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self._stop_requested = False
        self._last_launch: tuple[list[str], dict[str, str], str] | None = None
        self._prestarted: Prestarted | None = None
        self._start_lock = asyncio.Lock()
        self._start_done = asyncio.Event()
        self._start_done.set()

    @property
    def running(self) -> bool:
        return self.status.state == pb.WORKER_RUNNING

    def _full_env(self, env: Mapping[str, str]) -> dict[str, str]:
        return {**worker_env.environ_snapshot(), **env,
                worker_env.ENV_WORKER_OWNER: self.owner,
                worker_env.ENV_INCARNATION: self.incarnation}

    async def start(self, generation: int, argv: list[str], env: Mapping[str, str],
                    workdir: str, overtaken: Callable[[], bool] | None = None) -> None:
        """Start the worker of `generation` (ending any worker still running),
        in the pre-started process if one is ready for this very command and
        environment, else in a new process. A command that cannot be
        executed is reported as an exit with code 127 and the OS error in the
        stderr tail. Starts and stops are serialised: a stop that arrives
        while a start is under way applies to the worker it starts; a start
        that waited for another (a stop of its generation may have come
        meanwhile, and found only the older worker) starts nothing when
        `overtaken()` says that stop came."""
        async with self._start_lock:
            if overtaken is not None and overtaken():
                log.info("start of generation %d not made: its stop came while it waited "
                         "for the start before it", generation)
                return
            self._start_done.clear()
            try:
                await self._start(generation, argv, env, workdir)
            finally:
                self._start_done.set()

    async def refuse(self, generation: int, reason: str) -> None:
        """A start of `generation` that this host will not run: end the
        worker still running (as a start would) and report the new one as
        exited with code 126 (as a shell reports a command it cannot
        execute), `reason` as its stderr tail."""
        async with self._start_lock:
            if self.running:
                await self._stop(self.status.generation, 0.0)
            self.status = pb.WorkerStatus(generation=generation, state=pb.WORKER_EXITED,
                                          exit_code=126, stderr_tail=reason[-4000:], step=-1,
                                          committed_step=-1)
            self.on_exit(self.status)

    async def _start(self, generation: int, argv: list[str], env: Mapping[str, str],
                     workdir: str) -> None:
        if self.running:
            await self._stop(self.status.generation, 0.0)
        full_env = self._full_env(env)
        self._tail.clear()
        self._stop_requested = False
        self._last_launch = (list(argv), dict(env), workdir)
        self.status = pb.WorkerStatus(
            generation=generation, state=pb.WORKER_RUNNING, step=-1, committed_step=-1,
            process_id=int(env.get(worker_env.ENV_PROCESS_ID) or 0),
            num_processes=int(env.get(worker_env.ENV_NUM_PROCESSES) or 0))
        proc = await self._launch_prestarted(argv, full_env, workdir)
        how = "in its pre-started process" if proc else "cold"
        if proc is None:
            try:
                proc = await spawn(
                    die_with_parent(argv), cwd=workdir or None, env=full_env,
                    stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE, **WORKER_PROCESS_GROUP)
            except OSError as e:
                self.status.state = pb.WORKER_EXITED
                self.status.exit_code = 127
                self.status.stderr_tail = f"cannot start {argv!r} in {workdir!r}: {e}"
                log.error(self.status.stderr_tail)
                self.on_exit(self.status)
                return
        self._proc = proc
        self.status.pid = proc.pid
        log.info("worker of generation %d started %s, pid %d: %s", generation, how, proc.pid,
                 " ".join(argv))
        self._watch = asyncio.create_task(self._watch_exit(proc, generation))

    def forget_last_worker(self) -> None:
        """The agent moves on to another job: no worker of the last one is
        reported any more (idle, as a new agent), and no pre-start follows
        its command. A process pre-started already stays: a start of the
        next job takes it if its launch matches (`launch_key`). For an agent
        without a running worker (one that runs is its job's)."""
        self.status = pb.WorkerStatus(state=pb.WORKER_IDLE, step=-1, committed_step=-1)
        self._last_launch = None

    # --- the pre-started process ----------------------------------------------

    async def prestart_next(self, launch: tuple[list[str], dict[str, str], str] | None = None
                            ) -> None:
        """Pre-start a process for the next worker, with the command,
        environment and directory of `launch` (argv, env, workdir), by default
        those of the last start (per-generation variables left out). No-op if
        one is already up for them, if there is neither, or if the command is
        not `python script.py ...` / `python -m module ...`. Never raises: a
        pre-start that fails only means the next start is cold."""
        launch = launch or self._last_launch
        if launch is None:
            return
        argv, env, workdir = launch
        full_env = self._full_env(env)
        key = launch_key(argv, full_env, workdir)
        if key is None:
            return
        if self._prestarted is not None:
            if self._prestarted.key == key and self._prestarted.proc.returncode is None:
                return
            self.discard_prestarted()
        spawn_env = {k: v for k, v in full_env.items() if k not in worker_env.PER_GENERATION_ENV}
        script = [] if argv[1] == "-m" else [argv[1]]
        try:
            proc = await spawn(
                # -P: the working directory is not put on the import path
                die_with_parent([argv[0], "-P", "-m", "elastic.worker.prestart", *script]),
                cwd=workdir or None, env=spawn_env, stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                **WORKER_PROCESS_GROUP)
        except OSError as e:
            log.warning("cannot pre-start a worker process: %s", e)
            return
        self._prestarted = Prestarted(proc, key, asyncio.create_task(_ready(proc)))
        log.info("pre-started pid %d for the next worker", proc.pid)

    async def _launch_prestarted(self, argv: list[str], full_env: dict[str, str],
                                 workdir: str) -> WorkerProcess | None:
        warm, self._prestarted = self._prestarted, None
        if warm is None:
            return None
        if warm.key != launch_key(argv, full_env, workdir) or warm.proc.returncode is not None:
            log.info("pre-started pid %d not usable for this start (%s); starting cold",
                     warm.proc.pid, "other command or environment"
                     if warm.proc.returncode is None else "it exited")
            _discard(warm)
            return None
        # Back to normal priority (it preloads at SCHED_IDLE, see prestart.py);
        # one still importing finishes now, still sooner than a cold start.
        set_policy(warm.proc.pid, os.SCHED_OTHER)
        try:
            ready = await asyncio.wait_for(asyncio.shield(warm.ready), 60.0)
        except TimeoutError:
            ready = False
        if not ready:
            log.warning("pre-started pid %d never got ready; starting cold", warm.proc.pid)
            _discard(warm)
            return None
        message = json.dumps({"argv": argv, "env": full_env, "cwd": workdir}) + "\n"
        try:
            warm.proc.stdin.write(message.encode())
            await warm.proc.stdin.drain()
            warm.proc.stdin.close()
        except (BrokenPipeError, ConnectionResetError) as e:
            log.warning("pre-started pid %d gone (%s); starting cold", warm.proc.pid, e)
            _discard(warm)
            return None
        return warm.proc

    def discard_prestarted(self) -> WorkerProcess | None:
        """Kill the pre-started process, if any; returns it (to await)."""
        warm, self._prestarted = self._prestarted, None
        if warm is not None:
            _discard(warm)
            return warm.proc
        return None

    async def close(self) -> None:
        """The agent is exiting: SIGKILL the worker's group and the
        pre-started process, and reap the latter (bounded: 5 s)."""
        proc = self.discard_prestarted()
        self.kill_now()
        if proc is not None:
            try:
                await asyncio.wait_for(proc.ended, 5.0)
            except TimeoutError:
                log.error("pre-started pid %d not reaped 5 s after SIGKILL", proc.pid)

    async def _pump(self, stream: asyncio.StreamReader | None, out, keep: WorkerLog | None,
                    tail: bool) -> None:
        if stream is None:
            return
        while True:
            try:
                line = await stream.readline()
            except ValueError:  # (a line over STREAM_LIMIT: asyncio drops it)
                line = b"[elastic-agent: a line of over 64 KiB was left out]\n"
            if not line:
                return
            out.write(line)
            out.flush()
            if keep is not None:
                keep.write(line)
            if tail:
                self._tail.append(line.decode(errors="replace").rstrip("\n"))

    async def _watch_exit(self, proc: WorkerProcess, generation: int) -> None:
        keep = None if self.log_state_dir is None else \
            WorkerLog(self.log_state_dir, generation, self.status.process_id)
        pumps = asyncio.gather(self._pump(proc.stdout, sys.stdout.buffer, keep, False),
                               self._pump(proc.stderr, sys.stderr.buffer, keep, True))
        code = await proc.ended  # (not proc.wait(): it waits for the pipes too)
        on_request = self._stop_requested  # (a stop from here on found it ended by itself)
        signal_group(proc.pid)  # grandchildren in the worker's group go with it
        try:
            await asyncio.wait_for(pumps, PIPES_AFTER_EXIT_S)  # (a leftover may hold them)
        except (TimeoutError, asyncio.CancelledError):
            pumps.cancel()
            proc.transport.close()  # (lets go of them)
        finally:
            if keep is not None:
                keep.close()
        if self.status.generation != generation:
            return
        self.status.state = pb.WORKER_EXITED
        self.status.exit_code = code if code >= 0 else 0
        self.status.signal = -code if code < 0 else 0
        self.status.stopped_on_request = on_request
        self.status.stderr_tail = "\n".join(self._tail)[-4000:]
        self._proc = None
        log.info("worker of generation %d (pid %d) exited: code %d", generation, proc.pid, code)
        self.on_exit(self.status)

    async def stop(self, generation: int, grace_s: float) -> None:
        """End the worker if it belongs to `generation` or an older one:
        SIGTERM, up to `grace_s` seconds, then SIGKILL to the whole group.
        Returns once it is reaped (bounded: 5 s after SIGKILL). A start
        under way is let finish first, so that its worker is the one stopped
        (stops themselves do not wait for each other: a SIGKILL overtakes a
        grace period)."""
        await self._start_done.wait()
        await self._stop(generation, grace_s)

    async def _stop(self, generation: int, grace_s: float) -> None:
        proc, watch = self._proc, self._watch
        if proc is None or not self.running or self.status.generation > generation:
            return
        if not _ended(proc.pid):  # (one that ended by itself first was not stopped)
            self._stop_requested = True
            if grace_s > 0:
                signal_group(proc.pid, signal.SIGTERM)
                try:
                    await asyncio.wait_for(asyncio.shield(watch), grace_s)
                    return
                except TimeoutError:
                    log.warning("worker pid %d still running %.1f s after SIGTERM; SIGKILL",
                                proc.pid, grace_s)
            signal_group(proc.pid, signal.SIGKILL)
        try:
            await asyncio.wait_for(asyncio.shield(watch), 5.0)
        except TimeoutError:
            log.error("worker pid %d not reaped 5 s after SIGKILL", proc.pid)

    def suspended(self) -> bool:
        """Whether the worker's main process is stopped (SIGSTOP): it will
        not step again until SIGCONT."""
        return self._proc is not None and process_state(self._proc.pid) in ("T", "t")

    def signal_main(self, sig: int) -> None:
        """Send `sig` to the worker's main process only (not its group)."""
        if self._proc is not None and self.running:
            signal_pid(self._proc.pid, sig)

    def kill_now(self) -> None:
        """SIGKILL the worker's group and the pre-started process at once
        (the agent is exiting)."""
        self.discard_prestarted()
        if self._proc is not None:
            signal_group(self._proc.pid)

    def note_failure(self, generation: int, cause: str) -> bool:
        """Record the worker's word that it is failing, and why (`cause`:
        "own" or "peer", elastic.worker.progress.FAILURES); returns whether
        the status changed. A report of another generation is ignored."""
        value = _FAILURE_CAUSES.get(cause, pb.FAILURE_CAUSE_UNSPECIFIED)
        if generation != self.status.generation or self.status.failure_cause == value:
            return False
        self.status.failure_cause = value
        return True

    def note_progress(self, generation: int, step: int | None, committed_step: int | None,
                      metrics: Mapping[str, float] | None = None) -> tuple[bool, bool]:
        """Record a progress report; returns (first step of this worker,
        newer committed step). Reports of another generation are ignored."""
        if generation != self.status.generation:
            return False, False
        first = newer = False
        if step is not None and step > self.status.step:
            first = self.status.step < 0
            self.status.step = step
            if metrics:  # merged: a metric reported every n steps stays visible
                self.status.metrics.update(metrics)
        if committed_step is not None and committed_step > self.status.committed_step:
            self.status.committed_step = committed_step
            newer = True
        return first, newer
