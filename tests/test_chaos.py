"""Short chaos runs: each fault kind once, seeded, on a local 4-host slice of
the tiny worker. The job must reach its last step, never restart from less
than the latest committed checkpoint, and the report must list exactly the
injected fault, with no process left behind."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from elastic.chaos import parse_chaos, schedule
from elastic.goodput import account
from tests.conftest import tiny_spec

STEPS = 250


def chaos_spec(tmp_path):
    spec = tiny_spec(tmp_path, f"--steps {STEPS} --step-time-s 0.02 --checkpoint-every 20 "
                               f"--save-time-s 0.3")
    spec.write_text(spec.read_text() + """
[hang]
min_timeout_s = 3.0

[preemption]
drain_timeout_s = 5.0

[restart]
grow = "immediately"
""")
    return spec


@pytest.mark.parametrize("kind", ["kill-worker", "kill-host", "stop-worker", "stop-agent",
                                  "preempt", "kill-during-save"])
def test_each_fault_kind(tmp_path, local_job, kind):
    job = local_job(chaos_spec(tmp_path),
                    extra_args=("--chaos", f"mtbf=1,seed=3,count=1,kinds={kind}"))
    assert job.wait(90) == 0, job.output()
    journal = job.journal()
    [fault] = [e for e in journal if e["kind"] == "fault_injected"]
    assert fault["fault"] == kind
    done = job.outcome()
    assert done["kind"] == "job_succeeded" and done["step"] == STEPS - 1

    # no committed checkpoint lost: every generation after the first resumed from
    # the latest step committed before it started
    for started in (e for e in journal if e["kind"] == "generation_started"
                    and e["generation"] > 1):
        committed = [e["step"] for e in journal if e["kind"] == "checkpoint_committed"
                     and e["ts"] < started["ts"]]
        restored = [e for e in journal if e["kind"] == "checkpoint_restored"
                    and e["generation"] == started["generation"]]
        if committed:
            assert restored and restored[0]["step"] == max(committed), (started, restored)

    goodput = account(journal)
    [incident] = goodput.incidents
    assert incident.kind == kind and incident.host == fault["host"]
    assert incident.recovered_after_s is not None
    # a stopped agent whose worker steps on with the others costs no restart
    restarts = [e for e in journal if e["kind"] == "generation_started"][1:]
    assert incident.restarted is (kind != "stop-agent"), incident
    assert bool(restarts) is incident.restarted, restarts
    assert 0.0 < goodput.ettr <= 1.0
    # the CLI report says the same
    out = subprocess.run([sys.executable, "-m", "elastic.cli", "report", "--json",
                          "--state-dir", str(job.state_dir)], capture_output=True, text=True,
                         timeout=30, env=job.env)
    report = json.loads(out.stdout)
    assert report["ettr"] == pytest.approx(goodput.ettr, abs=1e-4)
    assert [i["kind"] for i in report["incidents"]] == [kind]


def test_partition_is_skipped_with_a_message(tmp_path, local_job):
    job = local_job(chaos_spec(tmp_path),
                    extra_args=("--chaos", "mtbf=1,seed=3,count=1,kinds=partition"))
    assert job.wait(90) == 0, job.output()
    skipped = [e for e in job.journal() if e["kind"] == "fault_skipped"]
    assert skipped and "network namespace" in skipped[0]["reason"]
    assert account(job.journal()).incidents == []


def test_chaos_spec_and_schedule_are_deterministic():
    spec = parse_chaos("mtbf=60,seed=7,kinds=kill-worker+preempt,count=3")
    assert spec.kinds == ("kill-worker", "preempt") and spec.count == 3
    assert schedule(spec, 5) == schedule(spec, 5)
    assert schedule(spec, 5) != schedule(parse_chaos("mtbf=60,seed=8"), 5)
    gaps = [gap for gap, _, _ in schedule(parse_chaos("mtbf=60,seed=1"), 2000)]
    assert 55 < sum(gaps) / len(gaps) < 65  # exponential with mean mtbf
    with pytest.raises(ValueError, match="unknown fault kind"):
        parse_chaos("kinds=explode")
