"""Preemption: an agent told its host is going away (a GCE metadata notice
from a fake metadata server on loopback) -> every worker saves at the next
common step, the slice restarts without the host and resumes at the saved
step + 1: no step is computed twice. (SIGTERM to an agent, the other way a
host hears of its preemption, is tested in test_gcs.py, with the emergency
checkpoint in a bucket.) The drain's decisions by table, with a fake clock,
at the end (more in test_decide.py), and how the drain and the hang check meet."""

from __future__ import annotations

import dataclasses
import http.server
import json
import threading

import pytest

from elastic.policy import decide as d
from elastic.policy.decide import Phase, decide
from elastic.policy.view import (HeartbeatReceived, ProgressReported, WorkerReported,
                                 WorkerState, observe)
from tests.conftest import lm_spec, wait_until
from tests.policy_tables import T0, heartbeat_all, kinds, running_slice, worker
from tests.policy_tables import spec as table_spec
from tests.test_decide import preempted_slice


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


@pytest.mark.parametrize("step_time_s, quiet_for_s, ends", [
    (None, 2.0, True),   # no step time reported yet: two heartbeat intervals, as before
    (0.1, 2.0, True),    # steps shorter than a heartbeat interval: the same
    (5.0, 3.6, False),   # 5 s steps: the sync step is still being computed
    (5.0, 9.9, False),
    (5.0, 10.0, True),   # two steps' time without one: the slice stands at the commit
])
def test_a_drain_waits_two_steps_before_taking_the_committed_step_for_the_last(
        step_time_s, quiet_for_s, ends):
    """Steps of `step_time_s`; the slice made step 5, a save step, at T0,
    and h2's notice at T0 + 1 makes JAX's sync point step 6; the save of
    step 5 commits at T0 + 1.5, and no emergency save is seen. Before, the
    drain ended two heartbeat intervals after step 5 whatever the step
    time, "checkpoint step 5, the step the slice reached, committed", and
    SIGKILLed step 6 while it was computing, with its emergency save: one
    step computed twice. The quiet it needs is now also two of rank 0's
    steps (its step_time_s metric)."""
    s = table_spec()
    state, view = preempted_slice()
    if step_time_s is not None:
        for h in ("h0", "h1", "h2"):
            view.hosts[h].worker.metrics["step_time_s"] = step_time_s
    draining = decide(state, view, T0 + 1, s)
    assert "draining" in draining.reason
    observe(view, ProgressReported("h0", "inc-h0", 1, 5, 5), T0 + 1.5)
    heartbeat_all(view, T0 + quiet_for_s)
    after = decide(draining.state, view, T0 + quiet_for_s, s)
    if ends:
        assert after.state.phase is Phase.STOPPING and after.state.stop_kind == "preemption"
        assert "checkpoint step 5, the step the slice reached, committed" in after.reason
    else:
        assert after.state.phase is Phase.RUNNING and "draining" in after.reason, after.reason


def test_a_drain_weighs_the_step_time_reported_last_before_rank_0_reports_its_own():
    """As above with 5 s steps, but the generation's rank 0 has reported no
    step time yet (it measures one at its second step): the job's last one
    counts (ClusterView.step_time), not two heartbeat intervals alone."""
    s = table_spec()
    state, view = preempted_slice()
    view.step_time_s = 5.0  # (an earlier generation's)
    draining = decide(state, view, T0 + 1, s)
    observe(view, ProgressReported("h0", "inc-h0", 1, 5, 5), T0 + 1.5)
    heartbeat_all(view, T0 + 3.6)
    after = decide(draining.state, view, T0 + 3.6, s)
    assert after.state.phase is Phase.RUNNING and "draining" in after.reason, after.reason


@pytest.mark.parametrize("how", ["sigterm_before_init", "grace_over", "host_lost"])
def test_a_preempted_members_exit_is_a_preemption_not_a_failure(how):
    """h2's host is being taken away and its worker ends before the drain
    does: a SIGTERM that came before the worker installed its handler (exit
    by signal 15, before the first step), the agent's --preemption-grace-s
    running out (SIGKILL), or the leaving host's agent going silent. Before,
    the stop had cause "failure": it counted towards the restart budget and
    the crash loop, and towards h2's quarantine, although h2 was leaving
    anyway. Now it is a preemption, and the next generation starts without
    h2."""
    s = table_spec()
    if how == "sigterm_before_init":
        from elastic.policy.view import ClusterView
        from tests.policy_tables import register
        view = ClusterView()
        for h in ("h0", "h1", "h2"):
            register(view, h)
        state = running_slice(view, ["h0", "h1", "h2"], progressed=False,
                              failures_without_progress=1)
        observe(view, HeartbeatReceived("h2", "inc-h2", view.hosts["h2"].worker, 0,
                                        "SIGTERM to the agent"), T0 + 1)
        worker(view, "h2", T0 + 1.1, 1, WorkerState.EXITED, sig=15)
        at = T0 + 1.1
    else:
        state, view = preempted_slice()
        state = dataclasses.replace(state, failures_without_progress=1)
        state = decide(state, view, T0 + 1, s).state  # draining
        if how == "grace_over":
            heartbeat_all(view, T0 + 5)
            worker(view, "h2", T0 + 5.1, 1, WorkerState.EXITED, sig=9)
            at = T0 + 5.1
        else:
            for h in ("h0", "h1"):
                observe(view, ProgressReported(h, f"inc-{h}", 1, 6, -1), T0 + 6.2)
            at = T0 + 6.2  # h2 silent since T0 + 1: lost after heartbeat_timeout_s (5 s)
    stopping = decide(state, view, at, s)
    entry = next(a for a in stopping.actions if getattr(a, "kind", "") == "slice_stopping")
    assert (entry.fields["cause"], entry.fields["blamed"]) == ("preemption", []), entry
    assert entry.reason.startswith("preemption of h2 (SIGTERM to the agent): "), entry.reason
    # (not one more for the crash loop; a generation that made a step ends its count)
    assert stopping.state.host_failures == {}
    assert stopping.state.failures_without_progress == (1 if how == "sigterm_before_init" else 0)
    for h in ("h0", "h1"):
        worker(view, h, at + 0.1, 1, WorkerState.EXITED, sig=9)
    end = decide(stopping.state, view, at + 0.2, s)
    assert end.state.phase is Phase.WAITING and end.state.failure_restarts == (), end.reason
    for r in view.hosts.values():
        r.free_port += 100
    heartbeat_all(view, at + 1)
    restart = decide(end.state, view, at + 1, s)
    assert [a.host for a in restart.actions if isinstance(a, d.StartWorker)] == ["h0", "h1"]


def test_a_crash_of_a_member_not_leaving_is_still_a_failure():
    """(The other side of the test above: h2 is leaving, h1 crashes by
    itself, and h1 is blamed.)"""
    s = table_spec()
    state, view = preempted_slice()
    state = decide(state, view, T0 + 1, s).state
    worker(view, "h1", T0 + 2, 1, WorkerState.EXITED, exit_code=3)
    stopping = decide(state, view, T0 + 2, s)
    assert stopping.state.stop_kind == "failure" and "h1" in stopping.state.host_failures


# --- the drain and the hang check (table tests, fake clock) ---------------------------------

@pytest.mark.parametrize("delayed,hung", [
    (True, False),   # the emergency save said it waits: a save in flight, not a hang
    (False, True),   # no word of one: nothing is being saved, the slice stopped stepping
])
def test_an_emergency_save_waiting_for_a_long_regular_save_is_no_hang(delayed, hung):
    """Members made step 5 at T0; the regular save of step 4 (started at
    T0 - 1) is still being written when h2 is preempted (T0 + 1). The
    workers stop at the sync point and their emergency save waits for step
    4's save (checkpoint_save_delayed). Step 4 commits at T0 + 12, 12 s
    after the last step, and only then can the emergency save start. Before,
    the pass that saw that commit found no save in flight and declared a
    hang: SIGKILL mid emergency save, the steps since step 4 redone, a
    failure counted."""
    s = table_spec()
    state, view = preempted_slice()
    observe(view, WorkerReported("h0", "inc-h0", 1, "checkpoint_saved", "save of step 4",
                                 {"step": 4, "preemption": False}), T0 - 1)
    draining = decide(state, view, T0 + 1, s)
    assert "draining" in draining.reason
    if delayed:
        observe(view, WorkerReported("h0", "inc-h0", 1, "checkpoint_save_delayed",
                                     "emergency save of step 5 waits for step 4",
                                     {"step": 5, "waiting_for": 4, "preemption": True}), T0 + 1.5)
    heartbeat_all(view, T0 + 11.9)
    waiting = decide(draining.state, view, T0 + 11.9, s)
    assert waiting.state.phase is Phase.RUNNING, waiting.reason  # (step 4's save in flight)
    observe(view, ProgressReported("h0", "inc-h0", 1, 5, 4), T0 + 12)  # step 4 commits
    heartbeat_all(view, T0 + 12)
    after = decide(waiting.state, view, T0 + 12, s)
    assert ("hang_detected" in kinds(after)) is hung, after.reason
    if not hung:
        assert after.state.phase is Phase.RUNNING and "draining" in after.reason, after.reason
        # the emergency save starts and commits: a preemption, nothing lost
        observe(view, WorkerReported("h0", "inc-h0", 1, "checkpoint_saved", "emergency save",
                                     {"step": 5, "preemption": True}), T0 + 13)
        observe(view, ProgressReported("h0", "inc-h0", 1, 5, 5), T0 + 14)
        heartbeat_all(view, T0 + 14)
        done = decide(after.state, view, T0 + 14, s)
        assert done.state.phase is Phase.STOPPING and done.state.stop_kind == "preemption"
