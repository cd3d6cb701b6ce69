"""The Prometheus endpoint over mutual TLS (elastic.metrics.serve): a
connection that stalls holds neither the scrapes nor the shutdown."""

from __future__ import annotations

import socket
import ssl
import threading
import time

import pytest
from prometheus_client import CollectorRegistry, Counter

from elastic import metrics
from tests.conftest import wait_until


def _scrape(port: int, bundle) -> bytes:
    context = ssl.create_default_context(cafile=str(bundle.ca))
    context.load_cert_chain(str(bundle.cert), str(bundle.key))
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
            context.wrap_socket(raw, server_hostname="elastic-controller") as conn:
        conn.sendall(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        data = b""
        while chunk := conn.recv(1 << 16):
            data += chunk
    return data


@pytest.fixture
def endpoint(pki):
    registry = CollectorRegistry()
    Counter("elastic_test_scrapes", "a counter to find", registry=registry).inc(3)
    server = metrics.serve(registry, "127.0.0.1", 0, pki.controller)
    yield server
    server.shutdown()


def test_an_idle_connection_holds_neither_scrapes_nor_shutdown(endpoint, pki):
    """Before: prometheus-client's TLS server did each handshake in its
    accept loop, with no timeout; one TCP connection that sent nothing made
    every scrape time out, and shutdown() never returned (an audit found
    elasticd still running 15 s after SIGTERM)."""
    port = endpoint.server_port
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
    try:
        started = time.monotonic()
        body = _scrape(port, pki.operator)
        assert b" 200 " in body.split(b"\r\n")[0] and b"elastic_test_scrapes_total 3.0" in body
        assert time.monotonic() - started < metrics.CONNECTION_TIMEOUT_S / 2
        # without a client certificate: refused, as before
        anonymous = ssl.create_default_context(cafile=str(pki.operator.ca))
        with pytest.raises((ssl.SSLError, ConnectionError)):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
                    anonymous.wrap_socket(raw, server_hostname="elastic-controller") as conn:
                conn.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
                assert not conn.recv(1)  # (TLS 1.3: the refusal comes with the first read)
        stopped = threading.Event()
        threading.Thread(target=lambda: (endpoint.shutdown(), stopped.set()), daemon=True).start()
        assert stopped.wait(5), "shutdown() held by idle connections"
    finally:
        for s in idle:
            s.close()


def test_a_connection_that_stalls_after_its_handshake_is_cut_without_a_traceback(
        endpoint, pki, monkeypatch, capfd):
    monkeypatch.setattr(metrics, "CONNECTION_TIMEOUT_S", 0.5)
    context = ssl.create_default_context(cafile=str(pki.operator.ca))
    context.load_cert_chain(str(pki.operator.cert), str(pki.operator.key))
    with socket.create_connection(("127.0.0.1", endpoint.server_port), timeout=5) as raw, \
            context.wrap_socket(raw, server_hostname="elastic-controller") as conn:
        conn.sendall(b"GET /metr")  # ... and nothing more
        assert conn.recv(1) == b""  # closed by the server once the timeout passed
    # (the handler thread's last words, if any, come as it ends)
    wait_until(lambda: not [t for t in threading.enumerate()
                            if "process_request" in t.name], 5, "the handler thread to end")
    assert "Traceback" not in capfd.readouterr().err
    assert b"elastic_test_scrapes_total" in _scrape(endpoint.server_port, pki.operator)
