"""The README's worker is the file in workers/minimal, and it trains."""

from __future__ import annotations

import re

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
    job = local_job(REPO / "workers" / "minimal" / "job.toml", hosts=2, devices=1,
                    faults=("kill-worker:host-1@step=30",))
    assert job.wait(180) == 0, job.output()
    journal = job.journal()
    assert [e["kind"] for e in journal].count("generation_started") == 2
    done = journal[-1]
    assert done["kind"] == "job_succeeded" and done["step"] == 199
    assert done["metrics"]["loss"] < 1e-3, done
