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
