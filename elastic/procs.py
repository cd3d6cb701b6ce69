"""Signals and process state by pid: the few /proc and kill() helpers the
agent, chaos and tests share. Linux only (reads /proc/<pid>/stat)."""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import signal
import subprocess
from collections.abc import Sequence


#: Popen arguments that give a worker a process group of its own (the agent
#: signals the whole group) inside the agent's session, not a session of its
#: own. Why: with the kernel's autogroup scheduler (sched_autogroup_enabled,
#: on by default on Debian and Ubuntu kernels) every session is one
#: scheduling group with an equal share of the CPU, and the processes of a
#: slice, which wait on each other in every collective, step slower when the
#: kernel schedules them as separate groups: 4 local hosts x 2 CPU devices on
#: 2 cores, the same plain-JAX program (bench/plain_lm.py) took 0.284 s a
#: step with each process in its own session against 0.254 s in one (the
#: gap bench/steady_state.py first showed between elastic and plain JAX).
WORKER_PROCESS_GROUP = {"process_group": 0}


def process_state(pid: int) -> str | None:
    """The state letter of `pid` from /proc (R, S, D, T, t, Z, ...), None if
    there is no such process (or it cannot be read)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie counts as gone)."""
    state = process_state(pid)
    return state is not None and state != "Z"


def signal_pid(pid: int, sig: int) -> bool:
    """Send `sig` to the one process `pid`; False if it could not be
    delivered. A pid of 0 or less (a worker not started yet reads 0) signals
    nobody: kill(2) would take 0 for the caller's own process group (under
    `make`, make and everything it runs) and -1 for every process the caller
    may signal."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, sig)
        return True
    except OSError:
        return False


def signal_group(pgid: int, sig: int = signal.SIGKILL) -> bool:
    """Send `sig` to process group `pgid`; False if the group no longer
    exists or cannot be signalled. A pgid of 1 or less signals nobody:
    killpg(0) is the caller's own group and killpg(1) is kill(-1), every
    process (no process group of ours is init's; see signal_pid)."""
    if pgid <= 1:
        return False
    try:
        os.killpg(pgid, sig)
        return True
    except OSError:
        return False


_SETPRIV = shutil.which("setpriv")
# One long-lived thread starts every child that must die with this process:
# PR_SET_PDEATHSIG fires when the *thread* that forked the child ends, so a
# child started from a short-lived thread (a fault injector's) would be
# killed with that thread.
_spawner = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="spawner")


def die_with_parent(argv: Sequence[str]) -> list[str]:
    """`argv` wrapped so the process gets SIGKILL when its parent dies
    (PR_SET_PDEATHSIG through util-linux `setpriv`, which then execs it).
    Unchanged where setpriv is missing. (A preexec_fn would do the same
    in-process, but calling into libc between fork and exec in a process
    with gRPC's threads is unsafe.)"""
    if _SETPRIV is None:
        return list(argv)
    return [_SETPRIV, "--pdeathsig", "KILL", "--", *argv]


def spawn_bound(argv: Sequence[str], **popen_kwargs) -> subprocess.Popen:
    """subprocess.Popen(die_with_parent(argv), **popen_kwargs), forked from
    one thread that lives as long as this process: the child gets SIGKILL
    when this process dies, even by SIGKILL. Raises what Popen raises."""
    return _spawner.submit(subprocess.Popen, die_with_parent(argv), **popen_kwargs).result()
