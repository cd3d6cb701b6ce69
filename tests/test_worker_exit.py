"""A worker that fails ends at once (elastic.worker.runtime's
exit_promptly_on_failure), once a checkpoint save in flight has ended, not
in JAX's distributed shutdown waiting for peers that are still training;
and its host, not the peer whose collective failed with it, is blamed:
real 2-process JAX jobs under `elasticd local`."""

from __future__ import annotations

import json
import re
import sys

from conftest import REPO, write_spec

FAILING_WORKER = REPO / "tests" / "helpers" / "failing_worker.py"


def test_a_raising_worker_is_a_crash_at_once_and_an_early_exit_within_the_wait(tmp_path,
                                                                               local_job):
    # The hang timeout is 60 s: a failure seen in seconds was seen as a crash.
    spec = write_spec(tmp_path / "job.toml", f"""
        [job]
        id = "exit"
        command = {json.dumps([sys.executable, str(FAILING_WORKER)])}
        min_hosts = 2
        max_hosts = 2

        [mesh]
        data = -1

        [restart]
        max_restarts = 1

        [health]
        heartbeat_interval_s = 0.5

        [hang]
        min_timeout_s = 60
        """)
    job = local_job(spec, hosts=2)
    assert job.wait(180.0) != 0
    assert "restart budget exhausted" in job.outcome()["reason"]
    events = job.journal()
    assert not [e for e in events if e["kind"] == "hang_detected"]
    stops = [e for e in events if e["kind"] == "slice_stopping"]
    assert [s["generation"] for s in stops] == [1, 2]
    # host-1 is blamed, though its peer's all-reduce fails with it and the
    # peer's exit may be heard first (2026-11-29, CI): each worker says why it
    # fails, its own error or a collective's
    for stop in stops:
        assert stop["blamed"] == ["host-1"] and "exited with exit code 1" in stop["reason"], stop
    exits = {e["generation"]: e for e in events
             if e["kind"] == "worker_exited" and e["host"] == "host-1"}
    assert [e["failure_cause"] for e in exits.values()] == ["own", "own"], exits
    echoes = [e for e in events if e["kind"] == "worker_exited" and e["host"] == "host-0"
              and not e["stopped_on_request"]]
    assert all(e["failure_cause"] == "peer" for e in echoes), echoes
    failed_at = {g: float(re.search(r"failing at ([0-9.]+)", e["stderr_tail"]).group(1))
                 for g, e in exits.items()}
    # generation 1 raised right after every process started saving step 10:
    # its traceback, the save committed with its peer's before it exited (the
    # next generation restores it), and the stop well before its 5 s wait for peers
    assert "ValueError: failing on purpose" in exits[1]["stderr_tail"]
    assert "letting the save of checkpoint step 10 in flight end" in exits[1]["stderr_tail"]
    restored = next(e for e in events if e["kind"] == "checkpoint_restored")
    assert restored["generation"] == 2 and restored["step"] == 10, restored
    # (not the 5 s wait for peers below: a bound between the two, for a loaded machine)
    assert stops[0]["ts"] - failed_at[1] < 4.5, (stops[0]["ts"], failed_at[1])
    # generation 2 left by sys.exit(3) before finish(): it waited its 5 s for
    # peers that did not leave with it, then exited with code 1, saying so
    assert "leaving without finish()" in exits[2]["stderr_tail"]
    assert 4.5 < stops[1]["ts"] - failed_at[2] < 15.0, (stops[1]["ts"], failed_at[2])
