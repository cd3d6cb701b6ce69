"""Signals and process state by pid: the few /proc and kill() helpers the
agent, chaos and tests share. Linux only (reads /proc/<pid>/stat)."""

from __future__ import annotations

import os
import signal


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
    """Send `sig` to `pid` (0: nobody); False if it could not be delivered."""
    if not pid:
        return False
    try:
        os.kill(pid, sig)
        return True
    except OSError:
        return False


def signal_group(pgid: int, sig: int = signal.SIGKILL) -> bool:
    """Send `sig` to process group `pgid` (0: nobody); False if the group no
    longer exists or cannot be signalled."""
    if not pgid:
        return False
    try:
        os.killpg(pgid, sig)
        return True
    except OSError:
        return False
