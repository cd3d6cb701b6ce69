"""What an operator watches, on a live local slice over the job's mutual
TLS: the controller's Prometheus metrics scraped and parsed with
prometheus-client's own parser during a run with a fault, the standard
gRPC health and reflection services, and the failing host's traceback in
`elasticd status` and the report."""

from __future__ import annotations

import json
import pathlib
import socket
import ssl
import subprocess
import sys
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from elastic import transport
from elastic.checkpoint.emulator import free_port
from elastic.cli import LOCAL_OPERATOR_BUNDLE
from elastic.security.tls import TLSFiles
from elastic.v1 import control_pb2 as pb
from elastic.v1 import control_pb2_grpc as pb_grpc
from tests.conftest import TINY_WORKER, tiny_spec, wait_until


def scrape(port: int, tls: TLSFiles, server_name: str = "elastic-controller"
           ) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} from https://127.0.0.1:port/metrics,
    verifying the server's certificate under `server_name`."""
    context = ssl.create_default_context(cafile=str(tls.ca))
    context.load_cert_chain(str(tls.cert), str(tls.key))
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
            context.wrap_socket(raw, server_hostname=server_name) as conn:
        conn.sendall(f"GET /metrics HTTP/1.0\r\nHost: {server_name}\r\n\r\n".encode())
        data = b""
        while chunk := conn.recv(1 << 16):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert b" 200 " in head.split(b"\r\n")[0], head
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body.decode()) for s in family.samples}


def elasticd(*args: str, env: dict) -> str:
    out = subprocess.run([sys.executable, "-m", "elastic.cli", *args], env=env,
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_metrics_health_reflection_and_last_words_of_a_live_job(tmp_path, local_job,
                                                                  proc_env):
    """A worker raises on host-1 at step 40 (a real traceback on stderr).
    Generation 2 trains until the test has looked at it (a cue file): with
    a fixed 250 steps it had ~6.5 s, which a loaded machine can spend on
    the status subprocess and the scrapes alone."""
    port = free_port()
    finish = tmp_path / "finish"
    spec = tiny_spec(tmp_path, "--steps 100000 --step-time-s 0.03 --checkpoint-every 20 "
                     f"--raise-on-host host-1 --crash-after-steps 40 --finish-when-file {finish}",
                     min_hosts=2, max_hosts=2)
    job = local_job(spec, hosts=2, extra_args=("--metrics-port", str(port)))
    job.wait_for("first_progress", generation=2, timeout_s=60)
    operator = TLSFiles.in_dir(job.state_dir / LOCAL_OPERATOR_BUNDLE)
    # the failing host's own words, in status while the next generation runs
    raised = "RuntimeError: tiny worker: raised on purpose at step 40"
    status = elasticd("status", "--state-dir", str(job.state_dir), env=proc_env)
    failure = status[status.index("last failure: generation 1, worker_exited on host-1"):]
    assert "| Traceback (most recent call last):" in failure and raised in failure, status

    def recovered():  # the incident is observed once the next generation steps
        m = scrape(port, operator)
        return m if m[("elastic_recovery_latency_seconds_count", ())] >= 1 else None

    m = wait_until(recovered, 15.0, "the recovery observed in the metrics")
    assert m[("elastic_job_phase", (("phase", "running"),))] == 1.0
    assert m[("elastic_job_phase", (("phase", "stopping"),))] == 0.0
    assert m[("elastic_generation", ())] == 2.0
    assert m[("elastic_hosts_alive", ())] == m[("elastic_slice_hosts", ())] == 2.0
    assert m[("elastic_hosts_expected", ())] == 2.0
    assert m[("elastic_incidents_total", (("kind", "worker_failed"),))] >= 1.0
    assert m[("elastic_slice_stops_total", (("cause", "failure"),))] == 1.0
    assert m[("elastic_slice_restarts_total", ())] == 1.0
    assert m[("elastic_detection_latency_seconds_count", ())] >= 1.0
    assert 0 < m[("elastic_recovery_latency_seconds_sum", ())] < 30.0
    assert m[("elastic_heartbeat_latency_seconds_count", ())] > 0
    # steady heartbeats come as datagrams (some, after a change, on the stream)
    assert m[("elastic_heartbeat_datagrams_total", (("outcome", "taken"),))] > 0
    assert ("elastic_heartbeat_datagrams_total", (("outcome", "superseded"),)) in m
    assert {("elastic_command_stream_copies_total", (("outcome", o),))
            for o in ("sent", "skipped")} <= m.keys()
    assert m[("elastic_hosts_heartbeating", (("path", "datagram"),))] + \
        m[("elastic_hosts_heartbeating", (("path", "stream"),))] == 2.0
    assert m[("elastic_step", ())] >= 20  # (resumed after a commit: 19 or 39)
    later = wait_until(lambda: (x := scrape(port, operator))[("elastic_step", ())] >
                       m[("elastic_step", ())] and x, 10.0, "a later step")
    assert later[("elastic_steps_per_second", ())] > 0  # (steps since the last scrape)
    assert m[("elastic_checkpoint_save_blocking_seconds_count", ())] >= 1
    assert m[("elastic_checkpoint_commit_seconds_count", ())] >= 1
    assert 0.0 < m[("elastic_ettr_ratio", ())] <= 1.0
    assert m[("elastic_journal_lines_lost_total", ())] == 0.0
    # secure by default: no client certificate, no metrics
    anonymous = ssl.create_default_context(cafile=str(operator.ca))
    with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(f"https://127.0.0.1:{port}/metrics", context=anonymous,
                               timeout=10).read()

    address = job.local_info()["controller"]
    with transport.channel(address, operator) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check
        for service in ("", "elastic.v1.Controller"):
            assert check(health_pb2.HealthCheckRequest(service=service), timeout=10).status \
                == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as unknown:
            check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
        assert unknown.value.code() is grpc.StatusCode.NOT_FOUND
        listed = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
        names = {s.name for reply in listed for s in reply.list_services_response.service}
        assert {"elastic.v1.Controller", "grpc.health.v1.Health"} <= names, names
    # every agent serves health (and reflection) on a port of its own, under
    # the name elastic-host; with --metrics-port, its metrics too
    host = job.host("host-0")
    agent = f"127.0.0.1:{host['servicePort']}"
    credentials = grpc.ssl_channel_credentials(operator.ca.read_bytes(),
                                               operator.key.read_bytes(),
                                               operator.cert.read_bytes())
    with grpc.secure_channel(agent, credentials, options=[
            ("grpc.ssl_target_name_override", "elastic-host")]) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check
        for service in ("", "elastic.agent.Controller"):
            assert check(health_pb2.HealthCheckRequest(service=service), timeout=10).status \
                == health_pb2.HealthCheckResponse.SERVING
    # its logs are for operators (and the controller), not for other hosts
    peer = TLSFiles.in_dir(job.state_dir / "tls" / "hosts" / "host-1")
    peer_credentials = grpc.ssl_channel_credentials(peer.ca.read_bytes(), peer.key.read_bytes(),
                                                    peer.cert.read_bytes())
    with grpc.secure_channel(agent, peer_credentials, options=[
            ("grpc.ssl_target_name_override", "elastic-host")]) as channel:
        with pytest.raises(grpc.RpcError) as denied:
            list(pb_grpc.AgentStub(channel).Logs(pb.LogsRequest(), timeout=10))
        assert denied.value.code() is grpc.StatusCode.PERMISSION_DENIED
    a = scrape(host["metricsPort"], operator, "elastic-host")
    assert a[("elastic_agent_controller_connected", ())] == 1.0
    assert a[("elastic_agent_generation", ())] == 2.0
    assert a[("elastic_agent_worker_running", ())] == 1.0
    assert a[("elastic_agent_sessions_total", ())] >= 1.0
    assert a[("elastic_agent_heartbeats_total", ())] > 0
    assert a[("elastic_agent_replica_failures_total", ())] == 0.0  # (this worker keeps none)
    assert a[("elastic_agent_replicas_sent_total", ())] == 0.0
    finish.touch()
    assert job.wait(60) == 0, job.output()
    # ... and in the report (the final summary of elasticd local is the same)
    report = elasticd("report", "--state-dir", str(job.state_dir), env=proc_env)
    words = report[report.index("generation 1, worker_exited on host-1: its last words"):]
    assert "| Traceback (most recent call last):" in words and raised in words, report
    # the timeline as a picture: a real PNG, with the panels drawn in colour
    png = tmp_path / "timeline.png"
    elasticd("report", "--state-dir", str(job.state_dir), "--plot", str(png), env=proc_env)
    from PIL import Image

    with Image.open(png) as image:
        assert image.format == "PNG" and image.size == (1600, 1100)
        colours = image.convert("RGB").getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 50, "a blank or near-blank picture"


def test_a_worker_event_with_a_duration_that_is_no_number_breaks_nothing(tmp_path, local_job,
                                                                         proc_env):
    """A worker reported `"restore_s": null` and `"blocking_s": "0.5"`:
    admission let them into the journal, where `account()` raised TypeError.
    With --metrics-port the metrics' journal listener raised out of the
    journal write at the next first_progress and the controller exited 70
    (and again after each restart); `elasticd report` and `status` failed
    too. Now the events are refused and the job runs to its end."""
    helper = pathlib.Path(__file__).parent / "helpers" / "odd_event_worker.py"
    spec = tiny_spec(tmp_path, "--steps 30", min_hosts=1, max_hosts=1)
    spec.write_text(spec.read_text().replace(str(TINY_WORKER), str(helper)))
    job = local_job(spec, hosts=1, extra_args=("--metrics-port", str(free_port())))
    assert job.wait(60) == 0, job.output()
    entries = job.journal()
    assert job.outcome()["kind"] == "job_succeeded"
    assert [e["kind"] for e in entries].count("controller_started") == 1  # never restarted
    refused = " ".join(e["reason"] for e in entries if e["kind"] == "message_refused")
    assert "restore_s = null is not a duration" in refused, refused
    assert not any(e["kind"] in ("checkpoint_restored", "checkpoint_saved") for e in entries)
    report = elasticd("report", "--json", "--state-dir", str(job.state_dir), env=proc_env)
    assert json.loads(report)["steps"] == 30
