"""Checkpoints on Google Cloud Storage, against fake-gcs-server on loopback
(a real GCS API server; elastic.checkpoint.emulator): the controller's view
of committed steps, the check before anything starts, and the reference
job through a preemption and a killed host with its checkpoints in a
bucket, ending where an undisturbed run ends."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from elastic.checkpoint import gcs
from elastic.checkpoint.faulty_storage import FaultProxy
from elastic.checkpoint.storage import StorageError
from tests.conftest import assert_matches_reference, lm_run_spec, lm_samples, tiny_spec

#: Added to every request to the bucket in the training test: a bucket in
#: another region (at 100 ms, chaos's storage-slow, that test took 54 s of
#: the suite and a save of the reference model 5.5 s).
BUCKET_LATENCY_S = 0.05


@pytest.mark.parametrize("objects,committed", [
    ([], []),
    (["run/1/commit_success.txt", "run/1/state/x"], [1]),
    # a save cut short: the step's directory without its marker
    (["run/1/commit_success.txt", "run/2/state/x", "run/2/meta/commit_success.txt"], [1]),
    (["run/10/commit_success.txt", "run/9/commit_success.txt"], [9, 10]),
    # not steps, or not this job's prefix
    (["run/tmp/commit_success.txt", "run2/3/commit_success.txt", "other/4/commit_success.txt",
      "run/5.orbax-checkpoint-tmp/commit_success.txt"], []),
])
def test_committed_steps_are_the_step_directories_with_a_marker(
        gcs_emulator, gcs_bucket, objects, committed):
    client = gcs_emulator.client()
    bucket = client.bucket(gcs_bucket[5:])
    for name in objects:
        bucket.blob(name).upload_from_string(b"x")
    assert gcs.committed_steps(f"{gcs_bucket}/run", gcs=client) == committed


def test_a_writable_bucket_passes_and_a_missing_one_is_named(gcs_emulator, gcs_bucket):
    client = gcs_emulator.client()
    gcs.check_writable(f"{gcs_bucket}/run", gcs=client)
    assert list(client.list_blobs(gcs_bucket[5:])) == []  # the probe is gone
    with pytest.raises(StorageError, match="bucket 'no-such-bucket' does not exist"):
        gcs.check_writable("gs://no-such-bucket/run", gcs=client, retry_s=1.0)


@pytest.mark.parametrize("url", ["gs://", "s3://b/x", "gs:///x"])
def test_malformed_urls_are_refused(url):
    with pytest.raises(StorageError):
        gcs.split(url)


def test_start_refuses_a_missing_bucket_before_anything_starts(tmp_path, proc_env,
                                                               gcs_emulator):
    spec = tiny_spec(tmp_path, job_extra='checkpoint_dir = "gs://no-such-bucket/ckpt"')
    for command in (["start", "--insecure"], ["local", "--hosts", "1"]):
        out = subprocess.run(
            [sys.executable, "-m", "elastic.cli", *command, "--config", str(spec),
             "--state-dir", str(tmp_path / "state")],
            env=dict(proc_env, **gcs_emulator.env), capture_output=True, text=True, timeout=60)
        assert out.returncode == 2, out.stderr
        assert out.stderr.strip().splitlines() == [
            "elasticd: error: checkpoint directory gs://no-such-bucket/ckpt: bucket "
            "'no-such-bucket' does not exist"], out.stderr
        assert not (tmp_path / "state" / "events.jsonl").exists()


def test_a_standby_is_refused_for_checkpoints_at_a_buckets_root(tmp_path, proc_env,
                                                                gcs_emulator, gcs_bucket):
    """A bucket's root leaves no place for the lease beside the checkpoints:
    before, a --standby on a state directory of its own (another host) then
    led at once beside the leader, two controllers of one job (an audit
    found it). Now it is a start error that names the fix."""
    spec = tiny_spec(tmp_path, job_extra=f'checkpoint_dir = "{gcs_bucket}"')
    out = subprocess.run(
        [sys.executable, "-m", "elastic.cli", "start", "--insecure", "--standby", "--config",
         str(spec), "--state-dir", str(tmp_path / "b"), "--listen", "127.0.0.1:0"],
        env=dict(proc_env, **gcs_emulator.env), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        f"elasticd: error: --standby with checkpoints at a bucket's root ({gcs_bucket}): a "
        f"standby leads through a lease beside the checkpoint directory, and a bucket's root "
        f"has no place beside it; use gs://BUCKET/PREFIX"], out.stderr
    assert not (tmp_path / "b" / "controller.addr").exists()


def test_training_with_checkpoints_in_a_bucket_survives_a_preemption_and_a_lost_host(
        tmp_path, local_job, lm_reference, gcs_emulator, gcs_bucket):
    """Every request to the bucket, the controller's and the workers', goes
    through BUCKET_LATENCY_S of added latency (a bucket in another region). Local
    snapshots are off, so that every restore reads the bucket: with them on,
    an emergency step that falls on a snapshot step is (rightly) restored
    from memory, and the bucket's restore path would go untested."""
    url = f"{gcs_bucket}/lm"
    with FaultProxy(gcs_emulator.url) as proxy:
        proxy.set(latency_s=BUCKET_LATENCY_S)
        spec = lm_run_spec(tmp_path, "gcs", checkpoint_dir=url, snapshot_every=0)
        job = local_job(spec, hosts=4, devices=2, name="gcs", env=proxy.env,
                        faults=("preempt:host-1@step=12", "kill-host:host-2@step=28"))
        assert job.wait(300) == 0, job.output()
    assert proxy.counts.requests > 100, proxy.counts
    journal = job.journal()
    # (the emulator needs no credentials: google-auth's search for them logged
    # a warning in every worker's last words)
    assert not [e for e in journal if "Authentication failed" in e.get("stderr_tail", "")]
    started = [e for e in journal if e["kind"] == "generation_started"]
    # 4 hosts; 3 without the preempted host-1; then without the killed host-2
    # (host-1, back once its agent left, joins the restart after the kill)
    assert len(started) == 3 and [len(e["hosts"]) for e in started[:2]] == [4, 3], \
        [e["reason"] for e in started]
    assert "host-1" not in started[1]["hosts"] and "host-2" not in started[2]["hosts"]
    # SIGTERM to host-1's agent: every worker saved at the same step, the
    # emergency checkpoint went to the bucket inside GCE's 30 s (at 50 ms a
    # request), and
    # generation 2 restored it into a 3 x 2 mesh from there and resumed at
    # the next step: no step computed twice
    notice = next(e for e in journal if e["kind"] == "preemption_notice")
    emergency = next(e for e in journal if e["kind"] == "checkpoint_saved"
                     and e.get("preemption"))
    step = emergency["step"]
    committed = next(e for e in journal if e["kind"] == "checkpoint_committed"
                     and e["step"] == step)
    print(f"preemption notice -> emergency checkpoint committed: "
          f"{committed['ts'] - notice['ts']:.2f} s")
    assert committed["ts"] - notice["ts"] < 30
    stopping = next(e for e in journal if e["kind"] == "slice_stopping")
    assert stopping["cause"] == "preemption", stopping
    restored = next(e for e in journal if e["kind"] == "checkpoint_restored"
                    and e["generation"] == 2)
    assert restored["step"] == step and restored.get("source") != "snapshot"
    assert started[1]["mesh_shape"] == [3, 2]
    samples = lm_samples(tmp_path / "gcs-samples.jsonl")
    assert max(s["step"] for s in samples if s["generation"] == 1) == step
    assert min(s["step"] for s in samples if s["generation"] == 2) == step + 1
    # the preempted agent left once its worker was stopped (and came back as
    # a new agent, as a host does after a preemption)
    registered = [e for e in journal if e["kind"] == "host_registered" and e["host"] == "host-1"]
    assert len(registered) == 2 and registered[1]["ts"] > notice["ts"]
    # what the controller reads from the bucket: the steps Orbax committed there
    steps = gcs.committed_steps(url, gcs=gcs_emulator.client())
    assert steps and steps[-1] == 39, steps
    assert_matches_reference(lm_samples(tmp_path / "gcs-samples.jsonl"), lm_reference)


def test_a_bucket_url_without_the_gcs_packages_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "google.cloud.storage", None)
    monkeypatch.setitem(sys.modules, "google.cloud", None)
    with pytest.raises(StorageError, match=r"pip install 'elastic\[gcs\]'"):
        gcs.client()


def test_the_emulator_environment_turns_off_google_auths_gce_probe():
    """google-auth probes the GCE metadata server before it gives up on
    credentials (~3 s where nothing answers: an isolated host's namespace)
    unless NO_GCE_CHECK is exactly "true"; the emulator's variables must
    say it in the form the installed google-auth reads."""
    from elastic.checkpoint.emulator import endpoint_env

    env = {**os.environ, **endpoint_env("http://127.0.0.1:9")}
    out = subprocess.run(
        # (without the variable honoured, is_on_gce pings the metadata server
        # with the request given, and None fails)
        [sys.executable, "-c", "from google.auth.compute_engine import _metadata; "
         "print(_metadata.is_on_gce(request=None))"],
        env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["False"], out.stdout + out.stderr
