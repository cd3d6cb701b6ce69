"""Storage faults between the job and its bucket: a proxy in front of the
GCS emulator (elastic.checkpoint.faulty_storage) adds latency, answers 429
and 503, cuts connections, or refuses everything for an outage window."""

from __future__ import annotations

import json
import time
import types

import pytest

from elastic.checkpoint import gcs
from elastic.checkpoint.faulty_storage import FaultProxy
from elastic.checkpoint.storage import StorageError
from tests.conftest import tiny_spec


@pytest.fixture
def proxy(gcs_emulator):
    with FaultProxy(gcs_emulator.url, seed=5) as p:
        yield p


def put_markers(gcs_emulator, bucket_url: str, steps) -> str:
    bucket = gcs_emulator.client().bucket(bucket_url[5:])
    for step in steps:
        bucket.blob(f"run/{step}/commit_success.txt").upload_from_string(b"")
    return f"{bucket_url}/run"


def test_the_controllers_view_rides_out_errors_and_cut_connections(gcs_emulator, gcs_bucket,
                                                                   proxy):
    url = put_markers(gcs_emulator, gcs_bucket, (1, 2, 3))
    proxy.set(error_rate=0.4, drop_rate=0.2)
    for _ in range(5):
        assert gcs.committed_steps(url, gcs=proxy.client()) == [1, 2, 3]
    gcs.check_writable(url, gcs=proxy.client())
    assert proxy.counts.errors > 0 and proxy.counts.drops > 0, proxy.counts


def test_a_short_outage_is_waited_out_and_a_long_one_is_one_line(gcs_emulator, gcs_bucket,
                                                                 proxy):
    url = put_markers(gcs_emulator, gcs_bucket, (7,))
    proxy.set(outage_s=1.0)
    assert gcs.committed_steps(url, gcs=proxy.client(), retry_s=20.0) == [7]
    assert proxy.counts.outage > 0
    proxy.set(outage_s=60.0)
    t0 = time.monotonic()
    with pytest.raises(StorageError, match=r"checkpoint directory gs://\S+/run: "
                                           r"ServiceUnavailable"):
        gcs.committed_steps(url, gcs=proxy.client(), retry_s=1.5)
    assert time.monotonic() - t0 < 10.0, "the retries are bounded"


def test_a_bucket_that_answers_nothing_is_given_up_on_in_bounded_time(gcs_emulator, gcs_bucket,
                                                                      proxy):
    """Each request has a timeout: before, the client's default of 60 s
    held a restarting controller's first listing (and the start's checks)
    on a bucket that answers nothing, past the agents' controller lease."""
    url = put_markers(gcs_emulator, gcs_bucket, (3,))
    proxy.set(latency_s=30.0)
    t0 = time.monotonic()
    with pytest.raises(StorageError, match="checkpoint directory"):
        gcs.committed_steps(url, gcs=proxy.client(), retry_s=1.5)
    assert time.monotonic() - t0 < 10.0


def _objects(client, url: str) -> list[str]:
    bucket, prefix = gcs.split(url)
    return [b.name[len(prefix):] for b in client.list_blobs(bucket, prefix=prefix)]


def test_checkpoints_through_added_latency_a_killed_save_and_a_corrupt_step(
        tmp_path, proc_env, gcs_emulator, gcs_bucket, proxy):
    """The first save and the restore go through 50 ms of added latency per
    request. A save killed in flight leaves objects but no marker and is
    never restored; the next slice removes its leftovers and saves that step
    again; a committed step whose arrays are garbage fails on every process,
    all fall back together, the journal says so, nothing is deleted."""
    from tests.test_checkpoint import run_processes
    url, env = f"{gcs_bucket}/ckpt", dict(proc_env, **proxy.env)
    client = gcs_emulator.client()
    proxy.set(latency_s=0.05)  # the first save and the restore
    run_processes(2, ["save", url, "1", str(tmp_path / "a.json")], env, url)
    proxy.set()
    run_processes(2, ["save", url, "2", str(tmp_path / "b.json"), "--kill-after-save"],
                  env, url, expect_kill=True)
    # (through the latency the kill may land before any object of step 2 is out)
    assert "2/commit_success.txt" not in _objects(client, url)
    run_processes(2, ["save", url, "2", str(tmp_path / "c.json")], env, url)
    assert gcs.committed_steps(url, gcs=proxy.client()) == [1, 2]
    damaged = [n for n in _objects(client, url) if n.startswith("2/state/")
               and "metadata" not in n.lower() and not n.endswith("commit_success.txt")]
    assert damaged
    for name in damaged:
        client.bucket(gcs.split(url)[0]).blob(f"ckpt/{name}").upload_from_string(b"garbage")
    out = tmp_path / "restore.json"
    proxy.set(latency_s=0.05)
    run_processes(2, ["restore", url, str(out)], env, url)
    restored = json.loads(out.read_text())
    assert restored["step"] == 1, restored
    assert json.loads((tmp_path / "a.json").read_text())["checksums"] == restored["checksums"]
    assert [e["kind"] for e in restored["events"]] == ["checkpoint_restore_failed",
                                                       "checkpoint_restored"], restored["events"]
    assert "2/commit_success.txt" in _objects(client, url), \
        "a committed step is never deleted by a failed restore"
    assert proxy.counts.requests > 50


def test_a_failed_save_is_journaled_never_committed_and_training_goes_on(
        tmp_path, proc_env, gcs_emulator, gcs_bucket, proxy):
    """Two saves fail for good (403: permission revoked, which no client
    retries): step 4's commit marker on process 0, after every process wrote
    its arrays, and step 8's arrays of process 1 only. Each time the other
    process, waiting for its peer in the save's barriers, gives the save up
    at once (within the run's 120 s bound, not after the 600 s save
    timeout); both train on to the end, every process journals the same
    failures, and neither step ever gets a commit marker."""
    from tests.test_checkpoint import run_processes
    url, env = f"{gcs_bucket}/ckpt", dict(proc_env, **proxy.env)
    out = tmp_path / "train.json"
    proxy.set(error_rate=1.0, error_statuses=(403,), methods=("POST", "PUT"),
              match=("ckpt/4/commit_success.txt", "ckpt/8/state/ocdbt.process_1/"))
    run_processes(2, ["train", url, "12", "2", str(out), "--wait-each"], env, url)
    result = json.loads(out.read_text())
    failed = [e for e in result["events"] if e["kind"] == "checkpoint_save_failed"]
    assert [(e["step"], e["processes"]) for e in failed] == [(4, [0, 1]), (8, [0, 1])], failed
    assert all("Forbidden" in e["error"] for e in failed), failed
    assert 4 not in result["committed"] and 8 not in result["committed"], result
    assert result["committed"][-1] == 10, result
    names = _objects(gcs_emulator.client(), url)
    assert "4/commit_success.txt" not in names and "8/commit_success.txt" not in names, names
    assert "10/commit_success.txt" in names, names


#: The bucket's outage in the failover test: longer than the controller's
#: half lease and restart (it steps down, and is restarted during the
#: outage), shorter than the agents' controller lease (30 s: the workers
#: train on and the slice can be adopted).
OUTAGE_S = 15.0


def test_a_leader_cut_off_from_its_bucket_steps_down_and_its_restart_adopts_the_slice(
        tmp_path, local_job, gcs_bucket, proxy):
    """Every request to the bucket is answered 503 for OUTAGE_S (a regional
    outage), and there is no standby. The controller cannot renew its lease
    and steps down (exit 3) after half of it; `elasticd local` starts it
    again 2 s later, as systemd would. The restarted controller only warns
    that the bucket is out of reach (refusing to start, exit 2, would be
    final), waits for the bucket, takes its own lease back and adopts the
    slice, which trained on meanwhile: one generation, no step lost."""
    spec = tiny_spec(tmp_path, "--steps 800 --step-time-s 0.05 --checkpoint-every 100000",
                     min_hosts=2, max_hosts=2, extra="leader_lease_s = 2.0",
                     job_extra=f'checkpoint_dir = "{gcs_bucket}/tiny"')
    job = local_job(spec, hosts=2, env=proxy.env)
    job.wait_for("first_progress", generation=1, timeout_s=60)
    proxy.set(outage_s=OUTAGE_S)
    stepped_down = job.wait_for("controller_stopped", timeout_s=30)
    adopted = job.wait_for("slice_adopted", timeout_s=OUTAGE_S + 60)
    assert job.wait(90) == 0, job.output()
    assert proxy.counts.outage > 0, proxy.counts
    assert "controller stepped down: could not renew the lease" in stepped_down["reason"]
    journal = job.journal()
    kinds = [e["kind"] for e in journal]
    starts = [e for e in journal if e["kind"] == "controller_started"]
    assert len(starts) == 2 and starts[0]["term"] < starts[1]["term"], starts
    assert starts[1]["adopting"]["generation"] == 1 and adopted["generation"] == 1
    assert starts[1]["ts"] > stepped_down["ts"] + 2.0  # (restarted after RestartSec)
    assert kinds.count("generation_started") == 1 and "slice_stopping" not in kinds, kinds
    assert kinds[-2:] == ["job_succeeded", "controller_stopped"] and journal[-2]["step"] == 799
    out = job.proc.stdout.read().decode()
    assert "the controller exited with code 3; it starts again in 2 s, as systemd would" in out


def test_a_bucket_out_of_reach_at_start_is_a_warning_and_a_missing_one_an_error(
        gcs_bucket, proxy, monkeypatch, capsys):
    """`elasticd start`'s check of the checkpoint bucket: through an outage
    (503 to everything, past the check's retries) it warns and lets the
    controller start, which waits for the bucket before it leads; a bucket
    that does not exist is a usage error (exit 2, final for systemd)."""
    from elastic.cli import UsageError, _check_storage

    for name, value in proxy.env.items():  # (the storage client reads them)
        monkeypatch.setenv(name, value)
    proxy.set(outage_s=60.0)
    _check_storage(types.SimpleNamespace(checkpoint_dir=f"{gcs_bucket}/run"), retry_s=1.0)
    assert "elasticd: warning: checkpoint directory" in capsys.readouterr().err
    assert proxy.counts.outage > 0
    proxy.set(outage_s=0.0)
    with pytest.raises(UsageError, match="does not exist"):
        _check_storage(types.SimpleNamespace(checkpoint_dir="gs://no-such-bucket/run"),
                       retry_s=1.0)
