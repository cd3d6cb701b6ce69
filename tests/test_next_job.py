"""One job after another on the same agents, as a deployment runs them:
agents that are not pinned to a job (systemd units) and one controller
state directory (/var/lib/elasticd). Real processes: a controller per job,
an agent, workers/lm on a host of 2 CPU devices (one host: what is tested
is the agent's and the controller's, and the suite's time is short)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re

import pytest

from conftest import lm_spec, tiny_spec
from elastic.config import load_spec
from elastic.controller.journal import read_journal
from elastic.controller.server import ControllerServer
from elastic.local import start_slice, stop_slice
from elastic.local.controllers import start_next_job
from elastic.policy.state import Phase


def _since_last_start(state) -> list[dict]:
    journal = list(read_journal(state))
    last = max(i for i, e in enumerate(journal) if e["kind"] == "controller_started")
    return journal[last:]


def _ended(local) -> None:
    local.controller.wait(120)  # (raises TimeoutExpired: the job did not end)


def test_the_next_job_takes_the_agents_warm_with_a_run_of_its_own(tmp_path, tagged,
                                                                   compile_cache):
    """Before: the agents sent the next job's controller the id of the job
    they had followed and were refused for ever ("message for job 'a' sent
    to the controller of job 'b'"); once let in, job b took over job a's run
    id from the state directory's journal, under which the hosts' local
    snapshots of job a were restored into job b (its first step was a's
    snapshot step + 1). Now b starts at step 0 under a run of its own, its
    workers in the processes the agents pre-started during job a."""
    specs = tmp_path / "jobs"  # one working directory for both, as one deployment's
    specs.mkdir()
    paths = {job: lm_spec(specs / f"{job}.toml", job, ["--steps", "12"], 1, 1,
                          heartbeat_timeout_s=5.0,
                          job_extra=f'checkpoint_dir = "{tmp_path / job}-checkpoints"')
             for job in ("a", "b")}
    state = tmp_path / "state"
    local = start_slice(str(paths["a"]), load_spec(paths["a"]), 1, 2, state,
                        compile_cache_dir=compile_cache, pin_job=False)
    try:
        _ended(local)
        first = _since_last_start(state)
        assert "job_succeeded" in [e["kind"] for e in first], first[-3:]
        local = start_next_job(local, str(paths["b"]))
        _ended(local)
        second = _since_last_start(state)
    finally:
        stop_slice(local)
    kinds = [e["kind"] for e in second]
    assert "job_succeeded" in kinds and kinds.count("generation_started") == 1, kinds
    assert next(e for e in second if e["kind"] == "first_progress")["step"] == 0
    assert "checkpoint_restored" not in kinds
    assert second[0]["run_id"] != first[0]["run_id"] and second[0].get("job_id") == "b"
    # the same program on the same slice: loaded by job a's launch memos, untraced
    assert [e.get("traced") for e in second if e["kind"] == "worker_phases"] == [""], kinds
    log = (state / "hosts" / "host-0.log").read_text()
    during_a, after = log.split("following job b after job a", 1)
    warm = re.findall(r"pre-started pid (\d+)", during_a)[-1]
    assert re.search(rf"started in its pre-started process, pid {warm}\b", after), after


def test_a_job_refuses_another_jobs_checkpoints_and_seeks_no_slice_of_its_own(tmp_path):
    """Job b in job a's state directory, checkpoints where a kept its own
    (there the default directory) would restore and overwrite a's."""
    specs, state = tmp_path / "jobs", tmp_path / "state"
    specs.mkdir()
    state.mkdir(mode=0o700)
    (state / "events.jsonl").write_text(json.dumps({
        "ts": 1.0, "kind": "controller_started", "generation": 0, "host": None,
        "reason": "job a: 1 to 1 hosts", "run_id": "r1",
        "checkpoint_dir": str((state / "checkpoints").resolve())}) + "\n")
    spec = load_spec(lm_spec(specs / "b.toml", "b", [], 1, 1, heartbeat_timeout_s=5.0))
    with pytest.raises(RuntimeError, match="job 'a' kept its checkpoints in .*: job 'b' would "
                                           "restore them and write over them"):
        ControllerServer(spec, "127.0.0.1:0", state, None)
    # with checkpoints of its own it starts, and looks for no running slice
    # of its own (a's generations are a's: it would wait out the adoption window)
    spec = dataclasses.replace(spec, checkpoint_dir=str(tmp_path / "b-checkpoints"))

    async def construct() -> Phase:
        server = ControllerServer(spec, "127.0.0.1:0", state, None)
        server.journal.close()
        return server.controller.state.phase

    assert asyncio.run(construct()) is Phase.WAITING


def test_the_next_job_keeps_a_quarantine_and_releases_it_only_when_needed(tmp_path, tagged):
    """Job a sets host-2 aside (its worker crashes at every start); job b,
    on the same agents and state directory, leaves it out for the rest of
    its cooldown although it could use 3 hosts (before: b put it back at
    once, and its crashes would have to set it aside again); job c, which
    needs all 3 (min_hosts = 3), releases it early rather than wait out
    the cooldown (600 s) for want of a host."""
    specs = {}
    for job, args, low in (
            ("a", "--steps 60 --step-time-s 0.02 --crash-on-host host-2 --crash-after-steps 2",
             2), ("b", "--steps 20 --step-time-s 0.02", 2), ("c", "--steps 20 --step-time-s 0.02",
                                                           3)):
        (tmp_path / job).mkdir()
        path = tiny_spec(tmp_path / job, args, min_hosts=low, max_hosts=3,
                         job_extra=f'checkpoint_dir = "{tmp_path / job / "checkpoints"}"',
                         extra="[quarantine]\nfailures = 2\ncooldown_s = 600\n")
        text = path.read_text().replace('id = "test"', f'id = "{job}"')
        if job == "b":  # (its agents come one by one: a heartbeat timeout to arrive in)
            text = text.replace("heartbeat_timeout_s = 1.5", "heartbeat_timeout_s = 5.0")
        path.write_text(text)
        specs[job] = path
    state = tmp_path / "state"
    local = start_slice(str(specs["a"]), load_spec(specs["a"]), 3, 1, state, pin_job=False)
    runs = {}
    try:
        for job in ("a", "b", "c"):
            if job != "a":
                local = start_next_job(local, str(specs[job]))
            _ended(local)
            runs[job] = _since_last_start(state)
    finally:
        stop_slice(local)
    for job, run in runs.items():
        assert run[-2]["kind"] == "job_succeeded", (job, run[-3:])
    [set_aside] = [e for e in runs["a"] if e["kind"] == "host_quarantined"]
    assert set_aside["host"] == "host-2"
    # b: carried (controller_started says so), and left out
    carried = runs["b"][0]["carried"]["quarantined"]
    assert list(carried) == ["host-2"] and 500 < carried["host-2"] <= 600, carried
    started = [e["hosts"] for e in runs["b"] if e["kind"] == "generation_started"]
    assert started == [["host-0", "host-1"]], started
    assert not [e for e in runs["b"] if e["kind"] == "host_released"]
    # c: released, as no slice of 3 could start without it
    [released] = [e for e in runs["c"] if e["kind"] == "host_released"]
    assert released["host"] == "host-2" and "no slice can start without it" in released["reason"]
    started = [e["hosts"] for e in runs["c"] if e["kind"] == "generation_started"]
    assert started == [["host-0", "host-1", "host-2"]], started
