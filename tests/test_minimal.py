"""The README's worker is the file in workers/minimal, and it trains (with
its checkpoints in a bucket of the GCS emulator `elasticd local
--gcs-emulator` starts)."""

from __future__ import annotations

import pathlib
import re

from elastic.agent import snapshot_dir
from elastic.goodput import account
from tests.conftest import REPO


def test_readme_shows_the_minimal_worker_verbatim():
    readme = (REPO / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    script = (REPO / "workers" / "minimal" / "train.py").read_text()
    body = script.split('"""', 2)[2].lstrip("\n")  # the file without its docstring
    assert body in blocks
    spec = (REPO / "workers" / "minimal" / "job.toml").read_text()
    assert spec in re.findall(r"```toml\n(.*?)```", readme, re.S)


def test_minimal_worker_trains_through_a_worker_kill(tmp_path, local_job):
    # with its checkpoints in a bucket of a GCS emulator elasticd local starts.
    # The kill comes after the first commit, not at a step: the worker runs its
    # 200 steps in under a second here, and host-1's step reaches the
    # controller only with its heartbeats (every second), so a step trigger
    # could see the slice only once it had finished (it did once, in a full
    # test run of ca2586c).
    job = local_job(REPO / "workers" / "minimal" / "job.toml", hosts=2, devices=1,
                    faults=("kill-worker:host-1@after=checkpoint_committed",),
                    extra_args=("--gcs-emulator",))
    job.wait_for("first_progress", generation=1, timeout_s=120)
    records = [job.state_dir / "agents" / h / snapshot_dir.RECORD for h in ("host-0", "host-1")]
    snapshot_dirs = [pathlib.Path(r.read_text()) for r in records]
    assert all(d.is_dir() for d in snapshot_dirs)
    assert job.wait(180) == 0, job.output()
    journal = job.journal()
    assert [e["kind"] for e in journal].count("generation_started") == 2
    done = job.outcome()
    assert done["kind"] == "job_succeeded" and done["step"] == 199
    assert done["metrics"]["loss"] < 1e-3, done
    # the restart resumed from a local snapshot (every 10 steps), at least as
    # new as the newest committed checkpoint (every 20; on a loaded machine the
    # first save to the bucket may not have committed yet: the loop does not
    # wait for it, and the step-20 save is skipped while it is written)
    restored = next(e for e in journal if e["kind"] == "checkpoint_restored")
    committed = max((e["step"] for e in journal if e["kind"] == "checkpoint_committed"
                     and e["ts"] < restored["ts"]), default=-1)
    assert restored["source"] == "snapshot" and restored["step"] >= committed, restored
    # at most one snapshot interval is lost: 10 when the kill lands while the
    # step-60 snapshot is still being written (the restore takes step 50)
    [incident] = account(journal).incidents
    assert incident.lost_steps <= 10, incident
    started = next(e for e in journal if e["kind"] == "controller_started")
    assert started["checkpoint_dir"] == "gs://elastic-local/minimal", started
    assert "checkpoints in gs://elastic-local/minimal" in job.proc.stdout.read().decode()
    # and the agents took their snapshots with them when they stopped
    assert not any(r.exists() for r in records) and not any(d.exists() for d in snapshot_dirs)
