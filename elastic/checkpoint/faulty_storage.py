"""Storage faults on purpose: an HTTP proxy in front of a GCS endpoint (the
emulator of elastic.checkpoint.emulator) that adds latency, answers 429 or
503 instead of forwarding, cuts connections, or refuses everything for an
outage window. Clients point at it exactly as at the emulator (its `env`),
so google-cloud-storage, gcsfs and TensorStore all see the faults. For
tests and benchmarks only; built on aiohttp (which gcsfs brings).
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import threading
import time
import urllib.parse

from elastic.checkpoint.emulator import anonymous_client, endpoint_env, free_port

#: Headers that belong to one hop, not to the request or answer.
_HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive",
        "proxy-connection", "upgrade"}


@dataclasses.dataclass
class StorageFaults:
    """What the proxy does to each request.

    latency_s: seconds added before a request is forwarded (a round trip
      to a farther region).
    error_rate: share of requests answered 429 or 503 without forwarding.
    drop_rate: share of requests whose connection is cut without an answer.
    outage_until: until this time.monotonic() every request gets 503.
    error_statuses: the answers errors are drawn from: 429 and 503 are
      retried by every GCS client; 403 (permission revoked) is not.
    match: errors and drops only for requests whose decoded path and query
      contain one of these texts (object names, e.g. "4/commit_success.txt");
      empty: every request.
    methods: errors and drops only for these HTTP methods (("POST", "PUT"):
      writes only); empty: every method.
    """

    latency_s: float = 0.0
    error_rate: float = 0.0
    drop_rate: float = 0.0
    outage_until: float = 0.0
    error_statuses: tuple[int, ...] = (429, 503)
    match: tuple[str, ...] = ()
    methods: tuple[str, ...] = ()


@dataclasses.dataclass
class FaultCounts:
    """Requests seen, and how many got each fault."""

    requests: int = 0
    errors: int = 0
    drops: int = 0
    outage: int = 0


class FaultProxy:
    """A proxy to `upstream` ("http://host:port") on a free port of `host`
    (loopback by default), served from a thread of its own. `start()`
    returns once it listens;
    `faults` may be replaced at any time (`set(...)`); `counts` says what it
    did; `stop()` ends it. `seed` makes the random faults repeatable."""

    def __init__(self, upstream: str, seed: int = 0, host: str = "127.0.0.1") -> None:
        self.upstream = upstream.rstrip("/")
        self.host = host
        self.port = free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.faults = StorageFaults()
        self.counts = FaultCounts()
        self._rng = random.Random(seed)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stopped: asyncio.Event | None = None

    @property
    def env(self) -> dict[str, str]:
        """Variables that point google-cloud-storage, gcsfs and TensorStore here."""
        return endpoint_env(self.url)

    def client(self):
        """A google-cloud-storage client that goes through this proxy."""
        return anonymous_client(self.url)

    def set(self, **faults) -> None:
        """Replace the faults (keywords of StorageFaults; `outage_s` sets an
        outage of that many seconds from now)."""
        outage_s = faults.pop("outage_s", None)
        if outage_s is not None:
            faults["outage_until"] = time.monotonic() + outage_s
        self.faults = StorageFaults(**faults)

    def start(self, timeout_s: float = 10.0) -> "FaultProxy":
        self._thread = threading.Thread(target=self._serve, daemon=True,
                                        name="storage-fault-proxy")
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise RuntimeError(f"the storage fault proxy did not start on port {self.port}")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stopped is not None:
            self._loop.call_soon_threadsafe(self._stopped.set)
        if self._thread is not None:
            self._thread.join(10.0)

    def __enter__(self) -> "FaultProxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _serve(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        from aiohttp import ClientSession, web

        self._loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        session = ClientSession(auto_decompress=False)
        app = web.Application(client_max_size=1 << 31)
        async def route(request):
            return await self._handle(request, session)

        app.router.add_route("*", "/{tail:.*}", route)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, self.host, self.port).start()
        self._ready.set()
        try:
            await self._stopped.wait()
        finally:
            await runner.cleanup()
            await session.close()

    async def _handle(self, request, session):
        from aiohttp import web

        faults, counts = self.faults, self.counts
        counts.requests += 1
        if time.monotonic() < faults.outage_until:
            counts.outage += 1
            return web.Response(status=503, text="storage outage (injected)")
        if faults.latency_s:
            await asyncio.sleep(faults.latency_s)
        draw = self._rng.random()
        target = urllib.parse.unquote(request.path_qs)
        if (faults.match and not any(text in target for text in faults.match)) or \
                (faults.methods and request.method not in faults.methods):
            draw = 1.0  # not a request these faults are for
        if draw < faults.drop_rate:
            counts.drops += 1
            request.transport.abort()
            return web.Response(status=500)  # never delivered: the connection is gone
        if draw < faults.drop_rate + faults.error_rate:
            counts.errors += 1
            return web.Response(status=self._rng.choice(faults.error_statuses), text="injected")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        async with session.request(request.method, self.upstream + request.path_qs,
                                   headers=headers, data=await request.read(),
                                   allow_redirects=False) as answer:
            body = await answer.read()
            out = {k: v for k, v in answer.headers.items() if k.lower() not in _HOP}
            if "Location" in out:  # resumable uploads continue through the proxy
                out["Location"] = out["Location"].replace(self.upstream, self.url)
            return web.Response(status=answer.status, body=body, headers=out)
