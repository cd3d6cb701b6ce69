"""Storage faults between the job and its bucket: a proxy in front of the
GCS emulator (elastic.checkpoint.faulty_storage) adds latency, answers 429
and 503, cuts connections, or refuses everything for an outage window."""

from __future__ import annotations

import json
import time

import pytest

from elastic.checkpoint import gcs
from elastic.checkpoint.faulty_storage import FaultProxy
from elastic.checkpoint.storage import StorageError


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


def test_a_checkpoint_saves_and_restores_through_added_latency(tmp_path, proc_env, gcs_bucket,
                                                               proxy):
    from tests.test_checkpoint import run_processes
    url, env = f"{gcs_bucket}/ckpt", dict(proc_env, **proxy.env)
    proxy.set(latency_s=0.05)
    run_processes(2, ["save", url, "1", str(tmp_path / "a.json")], env, url)
    out = tmp_path / "restore.json"
    run_processes(2, ["restore", url, str(out)], env, url)
    restored = json.loads(out.read_text())
    assert restored["step"] == 1
    assert json.loads((tmp_path / "a.json").read_text())["checksums"] == restored["checksums"]
    assert proxy.counts.requests > 10
