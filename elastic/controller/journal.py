"""The journal: one JSON object per line in `<state-dir>/events.jsonl`.

Every decision and incident is one line with at least `ts` (Unix seconds,
float), `kind`, `generation`, `host` (null where none applies) and `reason`.
Kinds: host_registered, host_lost, host_returned, agent_silent, agent_heard,
host_dropped, worker_exited, waiting_for_hosts, generation_started,
first_progress, checkpoint_committed, slice_stopping, slice_stopped,
stray_worker_stopping, stale_message_rejected, job_succeeded, job_failed,
controller_started, controller_stopped.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Iterator, Mapping
from typing import Any

JOURNAL_NAME = "events.jsonl"


class JournalWriter:
    """Appends entries and flushes each one (a crash loses at most the line
    being written). Raises OSError when the state directory is not writable."""

    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        self.path = pathlib.Path(state_dir) / JOURNAL_NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")

    def write(self, ts: float, kind: str, generation: int, reason: str,
              host: str | None = None, fields: Mapping[str, Any] | None = None) -> dict:
        """Append one entry: `ts` in Unix seconds, `kind`, `generation`,
        `reason`, `host` (None where none applies) and extra `fields`. Returns
        the entry written. Raises OSError when the disk refuses it."""
        entry = {"ts": round(ts, 6), "kind": kind, "generation": generation,
                 "host": host, "reason": reason, **(fields or {})}
        self._file.write(json.dumps(entry, sort_keys=False) + "\n")
        self._file.flush()
        return entry

    def close(self) -> None:
        self._file.close()


class JournalTail:
    """Reads a journal incrementally, for watching a running job: `read()`
    returns every entry so far, parsing only what was appended since the last
    call (a torn last line waits for its end). `new()` returns only those."""

    def __init__(self, state_dir: str | os.PathLike[str], from_end: bool = False) -> None:
        self.path = pathlib.Path(state_dir) / JOURNAL_NAME
        self.offset = self.path.stat().st_size if from_end and self.path.exists() else 0
        self.entries: list[dict] = []
        self._partial = b""

    def new(self) -> list[dict]:
        """The entries appended since the last call."""
        if not self.path.exists():
            return []
        with self.path.open("rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        self.offset += len(chunk)
        *lines, self._partial = (self._partial + chunk).split(b"\n")
        fresh = []
        for line in lines:
            try:
                fresh.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        self.entries += fresh
        return fresh

    def read(self) -> list[dict]:
        """Every entry so far (the list grows; do not modify it)."""
        self.new()
        return self.entries


def read_journal(state_dir: str | os.PathLike[str]) -> Iterator[dict]:
    """Entries of `<state_dir>/events.jsonl` in order; a torn last line is skipped."""
    path = pathlib.Path(state_dir) / JOURNAL_NAME
    if not path.exists():
        return
    with path.open(encoding="utf-8") as f:
        for line in f:
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def last_generation(state_dir: str | os.PathLike[str]) -> int:
    """The highest generation in the journal (0 if none), so that a restarted
    controller never reuses a generation number (fencing stays sound)."""
    return max((int(e.get("generation") or 0) for e in read_journal(state_dir)), default=0)
