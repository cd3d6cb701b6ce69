"""Preemption: an agent told its host is going away (a GCE metadata notice
from a fake metadata server on loopback) -> every worker saves at the next
common step, the slice restarts without the host and resumes at the saved
step + 1: no step is computed twice. (SIGTERM to an agent, the other way a
host hears of its preemption, is tested in test_gcs.py, with the emergency
checkpoint in a bucket.)"""

from __future__ import annotations

import http.server
import json
import threading

import pytest

from tests.conftest import lm_spec, wait_until

def spec(tmp_path):
    return lm_spec(tmp_path / "job.toml", "preempt-test",
                   ["--steps", "100000", "--checkpoint-every", "100000", "--eval-every", "100000",
                    "--sample-log", str(tmp_path / "samples.jsonl")],
                   min_hosts=1, max_hosts=3, heartbeat_timeout_s=3.0)


def check_resumed_without_loss(job, tmp_path, leaving: str) -> dict:
    notice = job.wait_for("preemption_notice", host=leaving, timeout_s=60)
    saved = job.wait_for("checkpoint_saved", generation=1, preemption=True)
    step = saved["step"]
    committed = job.wait_for("checkpoint_committed", step=step)
    stopping = job.wait_for("slice_stopping", generation=1)
    assert stopping["cause"] == "preemption", stopping
    started = job.wait_for("generation_started", generation=2)
    assert leaving not in started["hosts"] and len(started["hosts"]) == 2
    restored = job.wait_for("checkpoint_restored", generation=2, timeout_s=120)
    assert restored["step"] == step
    first = job.wait_for("first_progress", generation=2, timeout_s=120)
    assert first["step"] == step + 1
    # no step computed twice: generation 1 stopped at the saved step
    def steps(generation):
        lines = [json.loads(s) for s in (tmp_path / "samples.jsonl").read_text().splitlines()]
        return [s["step"] for s in lines if s["generation"] == generation]
    gen2 = wait_until(lambda: steps(2), 30, "generation 2 in the sample log")
    gen1 = steps(1)
    assert max(gen1) == step and min(gen2) == step + 1
    assert committed["ts"] - notice["ts"] < 30, "well inside GCE's 30 s spot window"
    return {"notice": notice, "committed": committed, "first": first}


@pytest.fixture
def lm_job(tmp_path, local_job):
    def start(**kw):
        job = local_job(spec(tmp_path), hosts=3, devices=2, **kw)
        job.wait_for("first_progress", generation=1, timeout_s=120)
        return job
    return start


class FakeMetadata(http.server.BaseHTTPRequestHandler):
    """GCE metadata on loopback: /<host>/instance/preempted and
    /<host>/instance/maintenance-event; hosts in `preempted` answer TRUE."""

    preempted: set[str] = set()

    def do_GET(self):
        if self.headers.get("Metadata-Flavor") != "Google":
            self.send_error(403)
            return
        _, host, _, key = self.path.split("/", 3)
        body = {"preempted": "TRUE" if host in self.preempted else "FALSE",
                "maintenance-event": "NONE"}.get(key)
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args):
        pass


def test_gce_preemption_notice(tmp_path, lm_job):
    FakeMetadata.preempted = set()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeMetadata)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/{{host}}/instance"
        job = lm_job(extra_args=("--gce-metadata", url))
        FakeMetadata.preempted.add("host-1")
        result = check_resumed_without_loss(job, tmp_path, "host-1")
        assert "GCE preemption notice" in result["notice"]["reason"]
        assert job.host("host-1")["state"] == "leaving"
    finally:
        server.shutdown()
        server.server_close()
