"""Leadership of a job: at most one controller acts on a state directory.

A controller takes an exclusive lock on `<state_dir>/leader.lock` (flock)
before it reads the journal. `elasticd start` fails at once when another
controller holds it; `elasticd start --standby` waits for it: the kernel
releases the lock the moment the leader's process ends (a crash, SIGKILL, an
OOM kill), and the standby takes over within its poll interval, reads the
journal the leader wrote and adopts the running slice
(elastic.policy.adopt).

Every controller that acts has a term, one more than the last one recorded
(in `<state_dir>/leader.term`, written under the lock, or in the journal);
it is sent with every registration answer and command, and agents refuse
commands of a lower term than the highest they have seen, so a deposed
controller that still runs cannot be obeyed by an agent that has met its
successor.

The lock needs a state directory both controllers reach (one host, or a
shared file system whose locks are honest, such as NFSv4). Controllers that
share only the checkpoint bucket hold a lease there as well
(elastic.controller.bucket_lease).
"""

from __future__ import annotations

import fcntl
import os
import pathlib

from elastic.security.files import private_dir, write_private

LOCK_NAME = "leader.lock"
TERM_NAME = "leader.term"


class LeadershipTaken(RuntimeError):
    """Another controller leads the job in this state directory."""


class Leadership:
    """The leader's lock on a state directory, held until `release()` or
    the process ends. `term`: this leader's term (0 until acquired)."""

    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        self.state_dir = private_dir(state_dir)
        self.term = 0
        self._file = None

    def try_acquire(self) -> bool:
        """Take the lock and the next term if no other controller holds it;
        False if one does. Raises OSError when the directory cannot be
        written."""
        handle = open_lock(self.state_dir / LOCK_NAME)
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            return False
        self._file = handle
        self.term = read_term(self.state_dir) + 1
        write_private(self.state_dir / TERM_NAME, f"{self.term}\n".encode())
        return True

    def release(self) -> None:
        """Give up the lock (idempotent)."""
        if self._file is not None:
            self._file.close()
            self._file = None


def open_lock(path: pathlib.Path):
    """The lock file, opened for flock (created 0600)."""
    return os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600), "r+b")


def read_term(state_dir: str | os.PathLike[str]) -> int:
    """The last term recorded in `state_dir` (0 if none or unreadable)."""
    try:
        return int((pathlib.Path(state_dir) / TERM_NAME).read_text().strip() or 0)
    except (OSError, ValueError):
        return 0
