"""Prometheus metrics endpoints (prometheus-client) for the controller and
the agents: `serve` runs one in a thread, `LoopCollector` turns a snapshot
taken on the process's asyncio loop into metric families at each scrape.

The endpoint speaks HTTPS with client certificates required, from the
job's CA (the holder's own bundle: controller or host), as every channel of
the job does; plaintext only with `--insecure`. A Prometheus scrape job
gives `tls_config: {ca_file, cert_file, key_file}` with an operator bundle
(`elasticd certs issue --role operator`).

Names follow Prometheus's conventions (https://prometheus.io/docs/practices/naming/):
an `elastic_` prefix, base units in the name (`_seconds`, `_ratio`),
counters ending in `_total`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import socket
import ssl
import threading
from collections.abc import Callable, Iterable
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app, start_http_server
from prometheus_client.core import Metric
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector

from elastic.security.tls import TLSFiles

log = logging.getLogger("elastic.metrics")

#: Seconds a scrape waits for the event loop to take its snapshot.
SNAPSHOT_TIMEOUT_S = 2.0


class LoopCollector(Collector):
    """Metric families built at each scrape by `build()` from what
    `snapshot()` returns; `snapshot` runs on `loop` (the process's asyncio
    loop, which owns the state), `build` in the scraping thread. A scrape
    when the loop does not answer within SNAPSHOT_TIMEOUT_S yields none of
    these families (the event-fed ones still come)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, snapshot: Callable[[], object],
                 build: Callable[[object], Iterable[Metric]]) -> None:
        self.loop, self.snapshot, self.build = loop, snapshot, build

    def collect(self) -> Iterable[Metric]:
        done: concurrent.futures.Future = concurrent.futures.Future()

        def take() -> None:
            try:
                done.set_result(self.snapshot())
            except Exception as e:  # noqa: BLE001 - the scrape reports it, the loop goes on
                done.set_exception(e)

        try:
            self.loop.call_soon_threadsafe(take)
            state = done.result(SNAPSHOT_TIMEOUT_S)
        except (RuntimeError, concurrent.futures.TimeoutError) as e:
            log.warning("metrics: no snapshot from the event loop: %s", e or "timed out")
            return []
        return list(self.build(state))


#: Seconds a connection to the HTTPS endpoint may take for its TLS handshake,
#: and then for each read or write of its request and answer.
CONNECTION_TIMEOUT_S = 10.0


class _Quiet(WSGIRequestHandler):
    def log_message(self, format, *args) -> None:  # noqa: A002 - the base class's name
        """Nothing: a scrape is not news."""


class _HTTPSServer(ThreadingWSGIServer):
    """prometheus-client's threading server with the TLS handshake done in
    each connection's own thread, under CONNECTION_TIMEOUT_S. Its own
    `start_http_server(certfile=...)` wraps the listening socket, so the
    handshake runs in the accept loop, without a timeout: one TCP connection
    that sends nothing held every scrape, and `shutdown()` with them (a
    controller told to stop never exited)."""

    tls_context: ssl.SSLContext

    def handle_error(self, request, client_address) -> None:
        """A connection that failed (stalled past the timeout, reset): a
        line at debug level, not socketserver's traceback on stderr."""
        log.debug("metrics: connection from %s failed", client_address, exc_info=True)

    def finish_request(self, request: socket.socket, client_address) -> None:
        request.settimeout(CONNECTION_TIMEOUT_S)
        try:
            conn = self.tls_context.wrap_socket(request, server_side=True)
        except (OSError, ValueError):  # (ssl.SSLError, a timeout, a reset, a closed socket)
            return
        try:
            super().finish_request(conn, client_address)
        finally:
            conn.close()


def _tls_context(tls: TLSFiles) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(tls.ca))
    context.load_cert_chain(str(tls.cert), str(tls.key))
    context.verify_mode = ssl.CERT_REQUIRED
    return context


def serve(registry: CollectorRegistry, host: str, port: int, tls: TLSFiles | None):
    """Serve `registry` at http(s)://host:port/metrics from a daemon thread.
    Returns the server (`.server_port`: the port, `.shutdown()` to stop).
    With `tls`, HTTPS with that bundle's certificate, and a client
    certificate from its CA required; each connection gets
    CONNECTION_TIMEOUT_S for its handshake and each read, in a thread of its
    own, so that a connection that stalls holds no other. Raises OSError
    when the port cannot be bound, ssl.SSLError when the bundle cannot be
    used."""
    if tls is None:
        server, _ = start_http_server(port, host, registry)
    else:
        context = _tls_context(tls)
        # (as prometheus-client picks it: a name may resolve to IPv6 only)
        family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                    flags=socket.AI_PASSIVE)[0][0]
        server_class = type("_Server", (_HTTPSServer,), {"address_family": family,
                                                          "tls_context": context})
        server = make_server(host, port, make_wsgi_app(registry), server_class,
                             handler_class=_Quiet)
        threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    log.info("metrics at %s://%s:%d/metrics", "https" if tls else "http", host,
             server.server_port)
    return server
