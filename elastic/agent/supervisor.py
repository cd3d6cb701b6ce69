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
import logging
import os
import pathlib
import shutil
import signal
import sys
from collections.abc import Callable, Mapping

from elastic import config
from elastic.procs import process_state, signal_group, signal_pid
from elastic.v1 import control_pb2 as pb

log = logging.getLogger("elastic-agent")

_SETPRIV = shutil.which("setpriv")


def die_with_agent(argv: list[str]) -> list[str]:
    """`argv` wrapped so the worker gets SIGKILL when the agent dies
    (PR_SET_PDEATHSIG through util-linux `setpriv`, which then execs the
    worker). Without setpriv the leftover sweep of the next agent is the only
    guard. (A preexec_fn would do the same in-process, but calling into libc
    between fork and exec in a process with gRPC's threads is unsafe.)"""
    return [_SETPRIV, "--pdeathsig", "KILL", "--", *argv] if _SETPRIV else list(argv)


def kill_leftovers(owner: str, incarnation: str) -> list[int]:
    """SIGKILL every process marked as started by an agent with state dir
    `owner` but another incarnation (what a previous agent process left).
    Returns their pids. Reads /proc/<pid>/environ (same user or root)."""
    marker = f"{config.ENV_WORKER_OWNER}={owner}".encode()
    mine = f"{config.ENV_INCARNATION}={incarnation}".encode()
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


class WorkerSupervisor:
    """Runs at most one worker at a time.

    `status` (a pb.WorkerStatus) always describes the current or last worker.
    `on_exit(status)` is called once per worker, the moment it is reaped.
    stderr is copied to the agent's stderr; its last `tail_lines` lines go
    into the exit report.
    """

    def __init__(self, owner: str, incarnation: str,
                 on_exit: Callable[[pb.WorkerStatus], None], tail_lines: int = 20) -> None:
        self.owner = owner
        self.incarnation = incarnation
        self.on_exit = on_exit
        self.status = pb.WorkerStatus(state=pb.WORKER_IDLE, step=-1, committed_step=-1)
        self._proc: asyncio.subprocess.Process | None = None
        self._watch: asyncio.Task | None = None
        self._tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self._stop_requested = False

    @property
    def running(self) -> bool:
        return self.status.state == pb.WORKER_RUNNING

    async def start(self, generation: int, argv: list[str], env: Mapping[str, str],
                    workdir: str) -> None:
        """Start the worker of `generation` (ending any worker still running).
        A command that cannot be executed is reported as an exit with code
        127 and the OS error in the stderr tail."""
        if self.running:
            await self.stop(self.status.generation, 0.0)
        full_env = {**config.environ_snapshot(), **env,
                    config.ENV_WORKER_OWNER: self.owner,
                    config.ENV_INCARNATION: self.incarnation}
        self._tail.clear()
        self._stop_requested = False
        self.status = pb.WorkerStatus(generation=generation, state=pb.WORKER_RUNNING,
                                      step=-1, committed_step=-1)
        try:
            proc = await asyncio.create_subprocess_exec(
                *die_with_agent(argv), cwd=workdir or None, env=full_env, stdin=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE, start_new_session=True)
        except OSError as e:
            self.status.state = pb.WORKER_EXITED
            self.status.exit_code = 127
            self.status.stderr_tail = f"cannot start {argv!r} in {workdir!r}: {e}"
            log.error(self.status.stderr_tail)
            self.on_exit(self.status)
            return
        self._proc = proc
        self.status.pid = proc.pid
        log.info("worker of generation %d started, pid %d: %s", generation, proc.pid,
                 " ".join(argv))
        self._watch = asyncio.create_task(self._watch_exit(proc, generation))

    async def _pump_stderr(self, stream: asyncio.StreamReader) -> None:
        out = sys.stderr.buffer
        while line := await stream.readline():
            out.write(line)
            out.flush()
            self._tail.append(line.decode(errors="replace").rstrip("\n"))

    async def _watch_exit(self, proc: asyncio.subprocess.Process, generation: int) -> None:
        pump = asyncio.create_task(self._pump_stderr(proc.stderr))
        code = await proc.wait()
        signal_group(proc.pid)  # grandchildren in the worker's group go with it
        try:
            await asyncio.wait_for(pump, 1.0)  # a leftover may hold the pipe open
        except (TimeoutError, asyncio.CancelledError):
            pump.cancel()
        if self.status.generation != generation:
            return
        self.status.state = pb.WORKER_EXITED
        self.status.exit_code = code if code >= 0 else 0
        self.status.signal = -code if code < 0 else 0
        self.status.stopped_on_request = self._stop_requested
        self.status.stderr_tail = "\n".join(self._tail)[-4000:]
        self._proc = None
        log.info("worker of generation %d (pid %d) exited: code %d", generation, proc.pid, code)
        self.on_exit(self.status)

    async def stop(self, generation: int, grace_s: float) -> None:
        """End the worker if it belongs to `generation` or an older one:
        SIGTERM, up to `grace_s` seconds, then SIGKILL to the whole group.
        Returns once it is reaped (bounded: 5 s after SIGKILL)."""
        proc, watch = self._proc, self._watch
        if proc is None or not self.running or self.status.generation > generation:
            return
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
        """SIGKILL the worker's group at once (the agent is exiting)."""
        if self._proc is not None:
            signal_group(self._proc.pid)

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
