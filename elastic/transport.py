"""gRPC channels and listening ports: the one seam where TLS and
authentication get added (channel/server credentials and call metadata), so
no message changes when they do. Also the one retry layer: tenacity around
client calls, retrying only UNAVAILABLE and DEADLINE_EXCEEDED.
"""

from __future__ import annotations

import grpc
import tenacity

# Keepalives notice a dead peer on an idle stream (a host that vanished
# without closing its TCP connection) without waiting for the OS.
_CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
_SERVER_OPTIONS = [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.so_reuseport", 0),
    # gRPC core cancels calls beyond 3,000 not yet taken up by the application
    # (a soft limit of 1,000): when thousands of agents (re)connect at once the
    # asyncio server takes them up one by one, so the limits must exceed the
    # agent count. Found with bench/scale.py: without these, streams past
    # ~2,800 failed with CANCELLED / INTERNAL.
    ("grpc.server.max_pending_requests", 1_000_000),
    ("grpc.server.max_pending_requests_hard_limit", 1_000_000),
]
TRANSIENT_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


def aio_server() -> grpc.aio.Server:
    """A `grpc.aio` server with the project's options."""
    return grpc.aio.server(options=_SERVER_OPTIONS)


def add_listen_port(server: grpc.aio.Server | grpc.Server, address: str) -> int:
    """Listen on `address` ("HOST:PORT", port 0 for any). Returns the port.

    Raises RuntimeError when the address cannot be bound."""
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as e:
        raise RuntimeError(f"cannot listen on {address}: {e}") from None
    if port == 0:
        raise RuntimeError(f"cannot listen on {address}")
    return port


def aio_channel(target: str) -> grpc.aio.Channel:
    """An asyncio channel to "HOST:PORT"."""
    return grpc.aio.insecure_channel(target, options=_CHANNEL_OPTIONS)


def channel(target: str) -> grpc.Channel:
    """A blocking channel to "HOST:PORT" (CLI tools)."""
    return grpc.insecure_channel(target, options=_CHANNEL_OPTIONS)


def is_transient(error: BaseException) -> bool:
    """True for gRPC errors worth retrying (UNAVAILABLE, DEADLINE_EXCEEDED)."""
    return isinstance(error, grpc.RpcError) and error.code() in TRANSIENT_CODES


def retrying(max_wait_s: float = 5.0, give_up_after_s: float | None = None,
             before_sleep=None) -> tenacity.AsyncRetrying:
    """Exponential backoff with jitter (0.1 s doubling to `max_wait_s`, plus up to
    0.1 s of jitter) on
    transient gRPC errors; never gives up unless `give_up_after_s` is set.
    Other errors pass through at once."""
    stop = tenacity.stop_never if give_up_after_s is None else \
        tenacity.stop_after_delay(give_up_after_s)
    return tenacity.AsyncRetrying(
        retry=tenacity.retry_if_exception(is_transient),
        wait=tenacity.wait_exponential_jitter(multiplier=0.1, max=max_wait_s, jitter=0.1),
        stop=stop, reraise=True, before_sleep=before_sleep)
