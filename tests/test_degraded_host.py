"""Hosts that differ, end to end: a job whose hosts report different device
counts trains on the hosts that fit and says why the other is left out, and
a member that loses a device mid-run costs one restart, not the job; the
loss matches the undisturbed run (tolerance: conftest.LM_TOLERANCE_NATS)."""

from __future__ import annotations

from tests.conftest import REPO, assert_matches_reference, lm_run_spec, lm_samples


def test_a_degraded_host_is_left_out_and_a_lost_device_costs_one_restart(
        tmp_path, local_job, lm_reference):
    # host-3 has one chip fewer from the start; host-1 loses one at step 25
    job = local_job(lm_run_spec(tmp_path, "degraded"), hosts=4, devices="2,2,2,1",
                    name="degraded", faults=("lose-device:host-1@step=25",))
    job.wait_for("first_progress", timeout_s=120, generation=1)
    host3 = job.host("host-3")
    assert host3["state"] == "left out", host3
    assert host3["note"] == "reports 1 device; the slice's hosts use 2"
    assert job.wait(240) == 0, job.output()

    journal = job.journal()
    started = [e for e in journal if e["kind"] == "generation_started"]
    # generation 1: the three 2-device hosts, mesh 3x2
    assert started[0]["hosts"] == ["host-0", "host-1", "host-2"]
    assert started[0]["mesh_shape"] == [3, 2] and started[0]["devices_per_host"] == 2
    left = [e for e in journal if e["kind"] == "host_left_out"]
    assert (left[0]["host"], left[0]["generation"]) == ("host-3", 1)
    # host-1 drops to 1 device: one restart, on the two hosts still whole
    # (2 x 2 devices rather than 4 x 1: as many devices, on fewer hosts)
    changed = next(e for e in journal if e["kind"] == "host_devices_changed")
    assert changed["host"] == "host-1" and changed["devices"] == 1
    stops = [e for e in journal if e["kind"] == "slice_stopping"]
    assert len(stops) == 1 and "host host-1 now reports 1 device(s)" in stops[0]["reason"]
    assert len(started) == 2, [e["reason"] for e in started]
    assert started[1]["hosts"] == ["host-0", "host-2"] and started[1]["mesh_shape"] == [2, 2]
    assert "chosen over 4 hosts x 1 device (as many devices, on fewer hosts)" in \
        started[1]["reason"]
    assert {e["host"] for e in left if e["generation"] == 2} == {"host-1"}
    assert not [e for e in journal if e["kind"] in ("job_failed", "host_quarantined")]
    assert job.outcome()["kind"] == "job_succeeded"

    assert_matches_reference(lm_samples(tmp_path / "degraded-samples.jsonl"), lm_reference)


def test_a_host_with_more_devices_puts_only_the_plans_count_in_the_mesh(tmp_path, local_job):
    # 4 x 1 devices beat 1 x 2: host-0 uses one of its two
    spec = (REPO / "workers" / "minimal" / "job.toml").read_text().replace(
        "max_hosts = 2", "max_hosts = 4")
    (tmp_path / "train.py").symlink_to(REPO / "workers" / "minimal" / "train.py")
    (tmp_path / "job.toml").write_text(spec)
    job = local_job(tmp_path / "job.toml", hosts=4, devices="2,1,1,1")
    assert job.wait(180) == 0, job.output()
    [started] = [e for e in job.journal() if e["kind"] == "generation_started"]
    assert started["hosts"] == ["host-0", "host-1", "host-2", "host-3"]
    assert (started["devices_per_host"], started["mesh_shape"]) == (1, [4])
    assert "1 host uses 1 of its devices (host-0)" in started["reason"]
    done = job.outcome()
    assert done["kind"] == "job_succeeded" and done["metrics"]["loss"] < 1e-3, done
    # (the example commits its final state: before, its last save was of step 160)
    assert max(e["step"] for e in job.journal() if e["kind"] == "checkpoint_committed") == 199
