"""What `elasticd local` prints while a job runs: the journal's entries as
they are written, and a progress line from the controller's status."""

from __future__ import annotations

import pathlib
import sys
import threading
from collections.abc import Sequence

import grpc

from elastic.controller.journal import JournalTail
from elastic.controller.status import fetch_status, slice_step
from elastic.security.tls import TLSFiles


def format_entry(entry: dict, t0: float) -> str:
    """One journal entry as a console line."""
    host = f" {entry['host']}" if entry.get("host") else ""
    return (f"[{entry['ts'] - t0:7.2f}s] gen {entry.get('generation', 0):<3} "
            f"{entry['kind']}{host}: {entry.get('reason', '')}")


class JournalFollower(threading.Thread):
    """Prints the job's journal entries as they are written, until `stop()`.

    `state_dirs`: where controllers write it, the leader's first. A standby
    that takes over through the bucket (elastic.controller.bucket_lease)
    goes on with the journal in a state directory of its own, rewritten
    whole when it claims the lease: entries are printed in time order, each
    once (an entry older than the last one printed, or printed, is skipped)."""

    def __init__(self, state_dirs: Sequence[pathlib.Path], out=sys.stdout) -> None:
        super().__init__(daemon=True)
        self.state_dirs, self.out = list(state_dirs), out
        self._halt = threading.Event()
        self.t0: float | None = None

    def stop(self) -> None:
        self._halt.set()
        self.join(2.0)

    def run(self) -> None:
        tails = [JournalTail(d, from_end=True) for d in self.state_dirs]
        last, at_last = float("-inf"), []  # the last time printed, the entries of that time
        while True:
            stopping = self._halt.is_set()
            fresh = []
            for i, tail in enumerate(tails):
                path = tail.path
                if path.exists() and path.stat().st_size < tail.offset:  # rewritten whole
                    tails[i] = tail = JournalTail(self.state_dirs[i])
                fresh += tail.new()
            for entry in sorted(fresh, key=lambda e: e["ts"]):
                if entry["ts"] < last or entry in at_last:
                    continue
                if entry["ts"] > last:
                    last, at_last = entry["ts"], []
                at_last.append(entry)
                self.t0 = entry["ts"] if self.t0 is None else self.t0
                print(format_entry(entry, self.t0), file=self.out, flush=True)
            if stopping:
                return
            self._halt.wait(0.1)


def progress_line(address: str, tls: TLSFiles | None) -> str:
    """One line on the slice: phase, generation, hosts, step, loss."""
    try:
        st = fetch_status(address, tls, timeout_s=2.0)
    except grpc.RpcError as e:
        return f"[progress] controller unreachable: {e.code().name}"
    members = [h for h in st.hosts if h.state in ("member", "silent")]
    silent = sum(h.state == "silent" for h in members)
    loss = next((h.metrics["loss"] for h in members if h.rank == 0 and "loss" in h.metrics), None)
    return (f"[progress] {st.phase}, generation {st.generation}, {len(members)} hosts"
            + (f" ({silent} silent)" if silent else "") + ", "
            f"step {slice_step(st)}" + (f", loss {loss:.4f}" if loss is not None else "")
            + f", committed step {st.committed_step}, ETTR {100 * st.ettr:.1f} %")
