"""The agent's reading of GCE's metadata server (elastic.agent.preemption):
which values mean the VM goes away, what a SIGTERM means after a notice,
and a watcher that outlives a bad reply (a fake server on loopback)."""

from __future__ import annotations

import asyncio
import http.server
import threading

import pytest

from elastic.agent.preemption import notice, on_sigterm, watch_metadata


@pytest.mark.parametrize("preempted,maintenance,leaving", [
    ("TRUE", "NONE", True),
    ("FALSE", "TERMINATE_ON_HOST_MAINTENANCE", True),
    ("FALSE", "SOMETHING_NEW", True),                  # unknown: assume it goes away
    # a live migration: the VM pauses and stays. Before, it was a preemption
    # the agent reported in every heartbeat until restarted (an audit)
    ("FALSE", "MIGRATE_ON_HOST_MAINTENANCE", False),
    ("FALSE", "NONE", False),
    (None, None, False),                               # unreadable
])
def test_which_notices_mean_the_vm_goes_away(preempted, maintenance, leaving):
    assert (notice(preempted, maintenance) is not None) is leaving


@pytest.mark.parametrize("preemption,leaving,action", [
    ("", False, "preempt"),                          # the first word of it
    ("SIGTERM to the agent", True, "hard"),          # a second SIGTERM
    # systemd stopping the VM right after GCE's notice: before, the worker was
    # SIGKILLed mid-save as at a second SIGTERM, and no checkpoint was taken
    ("GCE preemption notice (instance/preempted = TRUE)", False, "leave"),
])
def test_what_a_sigterm_means(preemption, leaving, action):
    assert on_sigterm(preemption, leaving) == action


class _Flaky(http.server.BaseHTTPRequestHandler):
    """The first reply cut short (a truncated body), then a preemption."""

    served = 0

    def do_GET(self):  # noqa: N802 - http.server's name
        type(self).served += 1
        body = b"TRUE" if self.path.endswith("/preempted") else b"NONE"
        self.send_response(200)
        if type(self).served <= 2:  # (both values of the first poll)
            self.send_header("Content-Length", "100")
            self.end_headers()
            self.wfile.write(body)
            self.wfile.flush()
            self.connection.shutdown(2)
            return
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_a_reply_cut_short_does_not_end_the_watch():
    """Before, http.client's IncompleteRead escaped the watcher, which ended
    quietly: every later notice was missed (an audit found it)."""
    _Flaky.served = 0
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Flaky)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    notices: list[str] = []
    try:
        asyncio.run(asyncio.wait_for(watch_metadata(
            f"http://127.0.0.1:{server.server_address[1]}/instance", notices.append,
            interval_s=0.05, timeout_s=2.0), 10))
    finally:
        server.shutdown()
        server.server_close()
    assert notices == ["GCE preemption notice (instance/preempted = TRUE)"]
    assert _Flaky.served >= 4
