"""The journal writer (elastic.controller.journal): what reaches the file when
a write is cut short, and what the next controller reads back."""

from __future__ import annotations

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
