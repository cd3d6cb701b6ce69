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
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import Metric
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


def serve(registry: CollectorRegistry, host: str, port: int, tls: TLSFiles | None):
    """Serve `registry` at http(s)://host:port/metrics from a daemon thread.
    Returns the server (`.server_port`: the port, `.shutdown()` to stop).
    With `tls`, HTTPS with that bundle's certificate, and a client
    certificate from its CA required. Raises OSError when the port cannot
    be bound."""
    if tls is None:
        server, _ = start_http_server(port, host, registry)
    else:
        server, _ = start_http_server(port, host, registry, certfile=str(tls.cert),
                                      keyfile=str(tls.key), client_cafile=str(tls.ca),
                                      client_auth_required=True)
    log.info("metrics at %s://%s:%d/metrics", "https" if tls else "http", host,
             server.server_port)
    return server
