"""The journal: one JSON object per line in `<state-dir>/events.jsonl`.

Every decision and incident is one line with at least `ts` (Unix seconds,
float), `kind`, `generation`, `host` (null where none applies) and `reason`.
Kinds: host_registered, host_lost, host_returned, agent_silent, agent_heard,
host_dropped, worker_exited, waiting_for_hosts, generation_started,
first_progress, checkpoint_committed, slice_stopping, slice_stopped,
stray_worker_stopping, stale_message_rejected, message_refused,
job_succeeded, job_failed, controller_started, controller_stopped,
slice_adopted, generation_discovered, waiting_for_fencing, controller_paused,
worker_stacks, sighup, insecure_mode.

The journal is private (0600 in a 0700 state directory): it names hosts,
pids and the job's spec path. Readers skip what is not a journal entry (a
torn last line, binary garbage, a line that is not an object with a numeric
`ts` and a string `kind`) and count it.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import math
import os
import pathlib
import re
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, BinaryIO

from elastic.policy import failure_history
from elastic.policy.adopt import Inherited
from elastic.policy.failure_history import FailureHistory
from elastic.security.files import open_private, private_dir

log = logging.getLogger("elasticd")

JOURNAL_NAME = "events.jsonl"
#: The fields every entry has; `fields` passed to `write` cannot replace them.
RESERVED_FIELDS = ("ts", "kind", "generation", "host", "reason")
#: Seconds between two log lines about the same trouble of a journal writer
#: (a listener that raises, a disk that refuses lines): the first is logged
#: at once, the next ones counted into the line after the interval.
COMPLAINT_INTERVAL_S = 60.0


class _Complaint:
    """An error logged at most once every COMPLAINT_INTERVAL_S seconds of
    `monotonic`, each line saying how many were left out since the last."""

    def __init__(self, monotonic: Callable[[], float]) -> None:
        self.monotonic, self.logged_at, self.left_out = monotonic, None, 0

    def __call__(self, message: str, *args, exc_info: bool = False) -> None:
        now = self.monotonic()
        if self.logged_at is not None and now - self.logged_at < COMPLAINT_INTERVAL_S:
            self.left_out += 1
            return
        if self.left_out:
            message += f" ({self.left_out} more like it since the last such line)"
        log.error(message, *args, exc_info=exc_info)
        self.logged_at, self.left_out = now, 0


def _open_journal(path: pathlib.Path) -> BinaryIO:
    """The journal at `path`, unbuffered, for appending (0600, no symlink)."""
    return open_private(path, "ab", buffering=0)


class JournalWriter:
    """Appends entries, each line in one unbuffered write (a crash loses at
    most the line being written).

    A line the disk refuses (ENOSPC, EIO, a quota) is lost, never raised:
    the journal is the record of the job, not a condition of it, and a
    controller that exits on a full disk fails again at each restart while
    its agents fence their workers. The loss is logged as an error (at most
    once every COMPLAINT_INTERVAL_S seconds, counting the lines since) and
    counted in `lost_lines`; when lines go through again a warning says how
    many were lost. Whatever part of a line reached the file is ended by a
    newline before the next line, as is a torn last line found at opening
    (a power loss mid-write): a fragment stays one line readers skip and
    never swallows the next entry. (Another process appending to the same
    file, `elasticd local`'s fault injector, ends its own fragments.)

    `opener(path)` opens the journal for appending, unbuffered (a test's
    stand-in for a full disk); `monotonic` paces the error lines. Raises
    OSError when the state directory or the journal cannot be opened."""

    def __init__(self, state_dir: str | os.PathLike[str],
                 monotonic: Callable[[], float] = time.monotonic,
                 opener: Callable[[pathlib.Path], BinaryIO] = _open_journal) -> None:
        self.path = private_dir(state_dir) / JOURNAL_NAME
        self._file = opener(self.path)
        #: whether the file may end in a fragment of a line (then the next
        #: line starts with a newline)
        self._torn = self.path.is_file() and _ends_torn(self.path)
        #: lines the disk refused since this writer opened the journal
        self.lost_lines = 0
        self._lost_since_written = 0
        self._refused = _Complaint(monotonic)
        #: called with each entry once it is written (the bucket lease's
        #: mirror, the metrics); one that raises is logged and skipped: a
        #: listener never breaks the journal or its writer's caller
        self.listeners: list[Callable[[dict], None]] = []
        self._listener_failed = _Complaint(monotonic)

    def write(self, ts: float, kind: str, generation: int, reason: str,
              host: str | None = None, fields: Mapping[str, Any] | None = None) -> dict:
        """Append one entry: `ts` in Unix seconds, `kind`, `generation`,
        `reason`, `host` (None where none applies) and extra `fields` (any
        of them named like a reserved field is dropped). Returns the entry,
        also when the disk refused it (see the class: counted, logged, not
        raised); the listeners see it either way. Raises TypeError or
        ValueError for fields that are not JSON."""
        entry = {"ts": round(ts, 6), "kind": kind, "generation": generation,
                 "host": host, "reason": reason}
        for key, value in (fields or {}).items():
            if key not in RESERVED_FIELDS:
                entry[key] = value
        self._append((json.dumps(entry, sort_keys=False) + "\n").encode(), kind)
        for listener in self.listeners:
            try:
                listener(entry)
            except Exception:  # noqa: BLE001 - the entry is journaled; the listener missed it
                self._listener_failed("a journal listener (%s) failed on a %s entry: the entry "
                                      "is journaled, only that listener missed it",
                                      getattr(listener, "__qualname__", listener), kind,
                                      exc_info=True)
        return entry

    def _append(self, line: bytes, kind: str) -> None:
        """Write `line` (after a newline ending a fragment, if one may be
        there), all of it or as much as the disk takes."""
        data = (b"\n" if self._torn else b"") + line
        done = 0
        try:
            while done < len(data):
                wrote = self._file.write(data[done:])
                if not wrote:  # (a file that takes nothing and says nothing)
                    raise OSError(errno.EIO, "the journal took no bytes")
                done += wrote
        except OSError as e:
            if done:  # the file ends in a fragment now, unless it was just the newline
                self._torn = not data[:done].endswith(b"\n")
            self.lost_lines += 1
            self._lost_since_written += 1
            self._refused("journal %s refused a %s entry, which is lost (%s); the "
                          "controller goes on without it (%d line(s) lost so far)",
                          self.path, kind, e.strerror or e, self.lost_lines)
            return
        self._torn = False
        if self._lost_since_written:
            log.warning("journal %s takes lines again; %d line(s) were lost before this %s "
                        "entry", self.path, self._lost_since_written, kind)
            self._lost_since_written = 0

    def close(self) -> None:
        self._file.close()


def _ends_torn(path: pathlib.Path) -> bool:
    """Whether the file at `path` is not empty and does not end in a newline."""
    with path.open("rb") as f:
        size = f.seek(0, os.SEEK_END)
        if not size:
            return False
        f.seek(size - 1)
        return f.read(1) != b"\n"


def parse_line(line: bytes) -> dict | None:
    """A journal entry from one line, or None when the line is not one
    (not UTF-8 JSON, not an object, no finite numeric `ts` or string `kind`)."""
    try:
        entry = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(entry, dict) or not isinstance(entry.get("kind"), str):
        return None
    ts = entry.get("ts")
    try:  # (an integer too large for a float makes isfinite raise)
        if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts):
            return None
    except OverflowError:
        return None
    generation = entry.get("generation", 0)
    if isinstance(generation, bool) or not isinstance(generation, int):
        entry["generation"] = 0
    return entry


class JournalTail:
    """Reads a journal incrementally, for watching a running job: `read()`
    returns every entry so far, parsing only what was appended since the last
    call (a torn last line waits for its end). `new()` returns only those.
    Lines that are not entries are left out."""

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
            entry = parse_line(line)
            if entry is not None:
                fresh.append(entry)
        self.entries += fresh
        return fresh

    def read(self) -> list[dict]:
        """Every entry so far (the list grows; do not modify it)."""
        self.new()
        return self.entries


def load_journal(state_dir: str | os.PathLike[str]) -> tuple[list[dict], int]:
    """(entries, skipped): the entries of `<state_dir>/events.jsonl` in
    order, and how many non-empty lines were not entries (a torn last line
    included). Raises OSError when the file exists but cannot be read."""
    entries: list[dict] = []
    skipped = 0
    for entry in _lines(state_dir):
        if entry is None:
            skipped += 1
        else:
            entries.append(entry)
    return entries, skipped


def _lines(state_dir: str | os.PathLike[str]) -> Iterator[dict | None]:
    """Each non-empty line of the journal as an entry, or None for one that
    is not; read line by line (a journal may be large)."""
    path = pathlib.Path(state_dir) / JOURNAL_NAME
    if not path.exists():
        return
    with path.open("rb") as f:
        for line in f:
            if line.strip():
                yield parse_line(line)


def read_journal(state_dir: str | os.PathLike[str]) -> Iterator[dict]:
    """Entries of `<state_dir>/events.jsonl` in order, read line by line;
    lines that are not entries (a torn last line, garbage) are skipped."""
    return (e for e in _lines(state_dir) if e is not None)


@dataclasses.dataclass(frozen=True)
class Recorded:
    """What a journal tells a controller that starts on it:
    generation: the highest generation a controller of this job started
      (`generation_started`; 0 if none), so that generations never repeat
      and fencing stays sound;
    step: the highest training or checkpoint step recorded (-1 if none);
    committed_step: the newest committed checkpoint step (-1 if none);
    run_id: the run id the first controller of this job gave its workers
      ("" if none), kept by the controllers after it;
    running: the generation that was running when the journal's last
      controller stopped writing (started or adopted, and neither stopping,
      stopped nor ended), or None;
    ended: the job's exit code when its last generation ended the job
      (0 after job_succeeded, 1 after job_failed), else None;
    term: the highest leadership term a controller journaled (0 if none);
    failures: the failure accounting of the job so far (the restart budget,
      the crash loop, quarantine: elastic.policy.failure_history);
    other_checkpoints: {checkpoint directory: job} of the other jobs whose
      controllers journaled here (see `recorded`);
    after_other_job: whether the journal's last controller was another
      job's (then there is no running generation of this job to find)."""

    generation: int = 0
    step: int = -1
    committed_step: int = -1
    run_id: str = ""
    running: Inherited | None = None
    ended: int | None = None
    term: int = 0
    failures: FailureHistory = FailureHistory()
    other_checkpoints: dict[str, str] = dataclasses.field(default_factory=dict)
    after_other_job: bool = False


#: Kinds after which the latest generation no longer runs.
_ENDED = ("slice_stopping", "slice_stopped", "job_succeeded", "job_failed")


_JOB_IN_REASON = re.compile(r"job ([A-Za-z0-9][A-Za-z0-9._-]{0,127}): ")


def entry_job(entry: dict) -> str | None:
    """The job a `controller_started` entry names: its `job_id`, or in
    journals written before that field the id its reason begins with
    ("job ID: ..."); None for other entries or when it names none."""
    if entry.get("kind") != "controller_started":
        return None
    if isinstance(entry.get("job_id"), str):
        return entry["job_id"]
    found = _JOB_IN_REASON.match(entry.get("reason") or "")
    return found.group(1) if found else None


def job_entries(entries: list[dict], job_id: str | None = None) -> list[dict]:
    """The entries of the latest stretch of job `job_id` (default: the job
    of the last `controller_started` that names one) in a journal where
    several jobs ran one after another: from its first controller after
    the last one of another job; [] when another job ran after it. All of
    `entries` when no other job is named in them."""
    starts = [(i, job) for i, job in ((i, entry_job(e)) for i, e in enumerate(entries))
              if job is not None]
    if not starts:
        return entries
    job_id = job_id or starts[-1][1]
    others = [i for i, job in starts if job != job_id]
    if not others:
        return entries
    first = next((i for i, job in starts if i > others[-1]), len(entries))
    return entries[first:]


def job_sharing(checkpoint_dir: str, others: Mapping[str, str]) -> str | None:
    """The other job (of `others`: {checkpoint directory: job}) whose
    checkpoint directory is `checkpoint_dir`, or holds it, or lies in it
    (a job's step directories and its lease object sit there, and Orbax
    removes what is not a step), or None. Local paths are compared with
    their symbolic links resolved; gs:// URLs as written, without a
    trailing slash."""
    def canonical(path: str) -> str:
        return path.rstrip("/") if "://" in path else os.path.realpath(path)

    mine = canonical(checkpoint_dir)
    for path, job in others.items():
        theirs = canonical(path)
        if mine == theirs or mine.startswith(theirs + "/") or theirs.startswith(mine + "/"):
            return job
    return None


def recorded(state_dir: str | os.PathLike[str], job_id: str = "") -> Recorded:
    """Scan the journal line by line (never all of it in memory). With
    `job_id`, what controllers of other jobs journaled in the same state
    directory (`entry_job`) gives only the generation and the term, which
    stay monotonic in a state directory, and where those jobs kept their
    checkpoints, and their quarantines, which are about the hosts
    (elastic.policy.failure_history): not their run id, steps, failures, end
    or running slice (a slice of this job has ended once another job started
    a generation). A new job on the agents and in the state directory of the
    one before must not inherit that job's run id, under which the hosts'
    local snapshots of its state would be restored into it."""
    generation, step, committed, run_id = 0, -1, -1, ""
    running: Inherited | None = None
    ended: int | None = None
    term = 0
    failures = FailureHistory()
    other_job, others, other_name = False, {}, ""
    for e in read_journal(state_dir):
        kind = e["kind"]
        if kind == "controller_started" and isinstance(e.get("term"), int) and \
                not isinstance(e.get("term"), bool):
            term = max(term, e["term"])
        if kind in ("generation_started", "generation_discovered"):
            generation = max(generation, e["generation"])
            if other_job:  # (on hosts this job's slice may have run on)
                running = None
        named = entry_job(e) if job_id else None
        if named is not None:
            other_job = named != job_id
            if other_job:  # (journals before 2026-11-23 name no directory: the default)
                others[e.get("checkpoint_dir") or os.path.join(state_dir, "checkpoints")] = named
                other_name = named
        if other_job:  # (its quarantines are about hosts, and carry over)
            failures = failure_history.after_other_job(failures, e, other_name)
            continue
        failures = failure_history.after(failures, e)
        value = e.get("step")
        if isinstance(value, int) and not isinstance(value, bool):
            step = max(step, value)
            if kind == "checkpoint_committed":
                committed = max(committed, value)
        if kind in ("job_succeeded", "job_failed"):
            ended = 0 if kind == "job_succeeded" else 1
        if kind in ("generation_started", "generation_discovered"):
            running, ended = _inherited(e), None
        elif kind == "controller_started":
            if not run_id and isinstance(e.get("run_id"), str):
                run_id = e["run_id"]
        elif running is not None and e["generation"] == running.generation:
            if kind == "first_progress":
                running = dataclasses.replace(running, progressed=True)
            elif kind in _ENDED:
                running = None
    return Recorded(generation, step, committed, run_id, running, ended, term, failures,
                    others, other_job)


def _inherited(entry: dict) -> Inherited | None:
    """The generation a `generation_started` entry describes, or None when
    the entry lacks what adoption needs (hosts, a coordinator)."""
    hosts, incarnations = entry.get("hosts"), entry.get("incarnations") or []
    if not (isinstance(hosts, list) and hosts and all(isinstance(h, str) for h in hosts)):
        return None
    if not (isinstance(incarnations, list) and all(isinstance(i, str) for i in incarnations)
            and len(incarnations) in (0, len(hosts))):
        incarnations = []

    def number(key: str) -> int:
        value = entry.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else 0

    return Inherited(generation=entry["generation"], hosts=tuple(hosts),
                     incarnations=tuple(incarnations),
                     coordinator=str(entry.get("coordinator") or ""),
                     devices_per_host=number("devices_per_host"),
                     device_kind=str(entry.get("device_kind") or ""),
                     restarts=number("restarts"))
