"""The journal writer (elastic.controller.journal): what reaches the file when
a write is cut short, and what the next controller reads back."""

from __future__ import annotations

import asyncio
import errno
import os

from elastic.controller.journal import JOURNAL_NAME, JournalWriter, load_journal, recorded


def test_a_torn_last_line_does_not_swallow_the_next_controllers_first_entry(tmp_path):
    """A power loss (or a full disk) mid-write leaves the journal's last line
    cut. The next writer appended straight onto the fragment, so the next
    controller's `controller_started` was glued to it and both were lost; a
    new job B in the same state directory then read B's entries as the
    previous job's (run id "", no running generation to adopt)."""
    writer = JournalWriter(tmp_path)
    writer.write(1.0, "controller_started", 0, "job A: start",
                 fields={"job_id": "A", "run_id": "ra"})
    writer.close()
    with open(tmp_path / JOURNAL_NAME, "ab") as f:
        f.write(b'{"ts": 3.0, "kind": "checkpoint_comm')  # cut mid-line
    writer = JournalWriter(tmp_path)
    writer.write(4.0, "controller_started", 0, "job B: start",
                 fields={"job_id": "B", "run_id": "rb"})
    writer.write(5.0, "generation_started", 1, "go", fields={"hosts": ["h0"]})
    writer.close()
    entries, skipped = load_journal(tmp_path)
    assert [(e["kind"], e.get("job_id")) for e in entries] == [
        ("controller_started", "A"), ("controller_started", "B"), ("generation_started", None)]
    assert skipped == 1  # the fragment, alone on its line
    r = recorded(tmp_path, "B")
    assert r.run_id == "rb" and not r.after_other_job
    assert r.running is not None and r.running.generation == 1


def test_a_writer_on_a_whole_journal_adds_no_empty_line(tmp_path):
    """Reopening a journal that ends with a newline (the usual case) and an
    empty one appends nothing of its own."""
    JournalWriter(tmp_path).close()
    assert (tmp_path / JOURNAL_NAME).read_bytes() == b""
    writer = JournalWriter(tmp_path)
    writer.write(1.0, "controller_started", 0, "start")
    writer.close()
    JournalWriter(tmp_path).close()
    assert (tmp_path / JOURNAL_NAME).read_bytes().count(b"\n") == 1


class Ticks:
    """A monotonic clock that moves only when told (seconds)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_listener_that_raises_breaks_neither_the_journal_nor_its_caller(tmp_path, caplog):
    """A listener's exception went out of `write` to whoever journaled: with
    --metrics-port, the metrics' listener raising on one odd entry made the
    controller exit 70 at its next journal line. It is now logged (once a
    minute at most, counting those left out) and the other listeners run."""
    ticks, seen = Ticks(), []

    def broken(entry: dict) -> None:
        raise TypeError("unsupported operand type(s) for +=: 'float' and 'NoneType'")

    writer = JournalWriter(tmp_path, monotonic=ticks)
    writer.listeners += [broken, seen.append]
    for ts in (1.0, 2.0, 3.0):
        assert writer.write(ts, "first_progress", 1, "step")["ts"] == ts
    ticks.now = 60.0
    writer.write(4.0, "first_progress", 1, "step")
    writer.close()
    assert [e["ts"] for e in load_journal(tmp_path)[0]] == [1.0, 2.0, 3.0, 4.0]
    assert [e["ts"] for e in seen] == [1.0, 2.0, 3.0, 4.0]
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 2 and "broken" in errors[0].getMessage()
    assert errors[0].exc_info and "2 more like it" in errors[1].getMessage()


class FillingDisk:
    """The journal's file on a disk with `room` bytes left: a write takes
    what fits and the next one raises ENOSPC, as a filling disk does."""

    def __init__(self, path, room: int) -> None:
        self.file, self.room = open(path, "ab", buffering=0), room

    def write(self, data: bytes) -> int:
        if self.room <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        wrote = self.file.write(data[:self.room])
        self.room -= wrote
        return wrote

    def close(self) -> None:
        self.file.close()


def test_a_full_disk_loses_lines_without_raising_or_leaving_a_half_line(tmp_path, caplog):
    """ENOSPC went out of `write` (and `Executor.record`): the controller
    exited 70, and systemd's restarts failed at their first line, while the
    agents fenced their workers. Now the line is lost, counted and logged
    once a minute at most; the fragment a cut write left is ended before
    the next line, so that line is whole once the disk has room again."""
    ticks, disks = Ticks(), []

    def opener(path):
        disks.append(FillingDisk(path, room=len(first) + 20))
        return disks[-1]

    first = b'{"ts": 1.0, "kind": "controller_started", "generation": 0, "host": null, ' \
            b'"reason": "start"}\n'
    writer = JournalWriter(tmp_path, monotonic=ticks, opener=opener)
    writer.write(1.0, "controller_started", 0, "start")  # fits
    writer.write(2.0, "host_registered", 0, "1 device", "h0")  # cut after 20 bytes
    writer.write(3.0, "host_registered", 0, "1 device", "h1")  # refused
    assert writer.lost_lines == 2
    disks[0].room = 10_000  # some room again
    writer.write(4.0, "generation_started", 1, "go", fields={"hosts": ["h0", "h1"]})
    writer.close()
    lines = (tmp_path / JOURNAL_NAME).read_bytes().split(b"\n")
    assert lines[0] + b"\n" == first and len(lines[1]) == 20 and lines[3] == b""
    entries, skipped = load_journal(tmp_path)
    assert [e["ts"] for e in entries] == [1.0, 4.0] and skipped == 1
    assert recorded(tmp_path).generation == 1
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "No space left on device" in errors[0], errors
    assert "2 line(s) were lost" in caplog.records[-1].getMessage()


def test_a_controller_whose_disk_is_full_keeps_running(tmp_path):
    """A real controller on a journal that refuses every line (/dev/full,
    ENOSPC from the kernel) registers a host instead of exiting at its
    first journal line, counting the lines lost."""
    from elastic.clock import FakeClock
    from elastic.config import load_spec
    from elastic.controller.core import Controller
    from elastic.policy.view import Registered, WorkerObs
    from tests.conftest import tiny_spec

    writer = JournalWriter(tmp_path / "state",
                           opener=lambda path: open("/dev/full", "wb", buffering=0))
    controller = Controller(load_spec(tiny_spec(tmp_path, min_hosts=2, max_hosts=2)), writer,
                            FakeClock())

    async def main() -> None:
        registered = asyncio.Event()
        writer.listeners.append(lambda e: e["kind"] == "host_registered" and registered.set())
        running = asyncio.create_task(controller.run())
        controller.submit(Registered("h0", "inc", 1, "127.0.0.1", "h0", 1, 0, WorkerObs()))
        waited = asyncio.create_task(registered.wait())
        await asyncio.wait([running, waited], timeout=10,
                           return_when=asyncio.FIRST_COMPLETED)
        assert waited.done() and not running.done(), running.exception() \
            if running.done() else "no host_registered"
        running.cancel()

    asyncio.run(main())
    assert writer.lost_lines >= 2  # controller_started, host_registered
    assert "h0" in controller.view.hosts
