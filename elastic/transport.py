"""gRPC channels and listening ports: the one place that opens them, with
mutual TLS from `elastic.security.tls` (plaintext only when the caller
passes no TLS files: `--insecure`). Also the one retry layer: tenacity
around client calls, retrying only UNAVAILABLE and DEADLINE_EXCEEDED, and
RESOURCE_EXHAUSTED when the server said when to come back (RETRY_AFTER_KEY).
"""

from __future__ import annotations

import grpc
import tenacity

from elastic.security import tls as tls_
from elastic.security.certs import HOST_SERVER_NAME
from elastic.security.identity import Role
from elastic.security.tls import TLSFiles

#: Every client channel's options (bench/scale.py's simulated agents use
#: them too). Keepalives notice a dead peer on an idle stream (a host that
#: vanished without closing its TCP connection) without waiting for the OS.
CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # a status of 10,000 hosts is ~2 MB
    ("grpc.max_receive_message_length", 64 << 20),
]
#: An agent's channel to the controller: the same, with keepalive pings a
#: minute apart and 20 s to answer one. A ping answered late is no sign of
#: a dead controller, only of a busy one: with pings every 10 s, closed
#: after 5 s unanswered, 10,000 agents sent one controller 1,000 pings a
#: second, and started their generation within 600 s in 2 runs of 3 on the
#: project's machine, against 3 of 3 with these (bench/scale.py,
#: 2026-11-28; README, Performance). The agent's own checks find a silent
#: controller sooner once its stream is answered (nothing heard for
#: heartbeat_timeout_s), while a worker runs (half the lease) and while it
#: registers (Register has a deadline). Only an agent without a worker that
#: waits for its stream's first answer (which a controller taking thousands
#: of streams up may give after minutes: elastic.agent.session) relies on
#: the pings to notice that the controller died meanwhile: after 60-80 s.
#: The pings also keep idle connections open through NAT and firewalls, and
#: notice a connection that died while heartbeats still go as datagrams.
CONTROLLER_CHANNEL_OPTIONS = [
    *[option for option in CHANNEL_OPTIONS if not option[0].startswith("grpc.keepalive_")],
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
]
#: Largest message the controller accepts (its largest honest one, a
#: worker's exit report with its stderr tail, is a few KiB).
MAX_REQUEST_BYTES = 1 << 20
#: Seconds a call may wait in gRPC core for the server to take it up before
#: gRPC cancels it (grpc.server_max_unrequested_time_in_server; 30 by default).
SERVER_CALL_WAIT_S = 300
_SERVER_OPTIONS = [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.so_reuseport", 0),
    ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
    # An agent uses one stream and an occasional unary call per connection.
    ("grpc.max_concurrent_streams", 16),
    # A peer that connects and never finishes the TLS handshake is dropped.
    ("grpc.server_handshake_timeout_ms", 10_000),
    # gRPC core cancels calls beyond 3,000 not yet taken up by the application
    # (a soft limit of 1,000): when thousands of agents (re)connect at once the
    # asyncio server takes them up one by one, so the limits must exceed the
    # agent count. Found with bench/scale.py: without these, streams past
    # ~2,800 failed with CANCELLED / INTERNAL.
    ("grpc.server.max_pending_requests", 1_000_000),
    ("grpc.server.max_pending_requests_hard_limit", 1_000_000),
    # ... and cancels a call (CANCELLED) that has waited there for 30 s by
    # default. The asyncio server takes calls up one at a time, each after a
    # turn of the event loop, so while the loop is busy the calls of
    # thousands of agents queue for longer: at 10,000 agents (bench/scale.py)
    # thousands of streams were cancelled so, their agents registered again,
    # and the storm fed itself. A call now waits up to SERVER_CALL_WAIT_S,
    # longer than the controller waits for a registered host's stream
    # (elastic.policy.silence.STREAM_OPEN_S), which decides first.
    ("grpc.server_max_unrequested_time_in_server", SERVER_CALL_WAIT_S),
]
TRANSIENT_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
#: Trailing metadata of a RESOURCE_EXHAUSTED answer: milliseconds to wait
#: before trying again (the controller's admission control).
RETRY_AFTER_KEY = "elastic-retry-after-ms"


def aio_server() -> grpc.aio.Server:
    """A `grpc.aio` server with the project's options."""
    return grpc.aio.server(options=_SERVER_OPTIONS)


def parse_address(address: str, what: str = "address", allow_port_zero: bool = False
                  ) -> tuple[str, int]:
    """Split "HOST:PORT" ("[v6]:PORT" too). Raises ValueError naming `what`
    when the form or the port (1-65535; 0 too with `allow_port_zero`) is wrong."""
    host, sep, port = address.rpartition(":")
    low = 0 if allow_port_zero else 1
    if not sep or not host or not port.isdigit() or not low <= int(port) <= 65535:
        raise ValueError(f"{what} {address!r} is not HOST:PORT with a port from {low} to 65535")
    return host, int(port)


def add_listen_port(server: grpc.aio.Server | grpc.Server, address: str,
                    tls: TLSFiles | None, roles: tuple[Role, ...] = (Role.CONTROLLER,)) -> int:
    """Listen on `address` ("HOST:PORT", port 0 for any): mutual TLS with
    `tls` files whose holder is one of `roles` (the controller's; a host's
    for the agent's own port), plaintext if None. Returns the port.

    Raises RuntimeError when the address cannot be bound, TLSError when the
    files cannot be used."""
    try:
        if tls is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, tls_.server_credentials(tls, roles))
    except RuntimeError as e:
        raise RuntimeError(f"cannot listen on {address}: {e}") from None
    if port == 0:
        raise RuntimeError(f"cannot listen on {address}")
    return port


def _client(tls: TLSFiles | None, roles: tuple[Role, ...],
            base: list[tuple[str, int]] = CHANNEL_OPTIONS):
    if tls is None:
        return None, list(base)
    return tls_.channel_credentials(tls, roles), [*base, *tls_.SERVER_NAME_OPTIONS]


def aio_channel(target: str, tls: TLSFiles | None,
                roles: tuple[Role, ...] = (Role.HOST,)) -> grpc.aio.Channel:
    """An asyncio channel to the controller at "HOST:PORT", as an agent's
    (CONTROLLER_CHANNEL_OPTIONS): mutual TLS with `tls` (whose certificate
    must be one of `roles`), plaintext if None. Raises TLSError when the
    files cannot be used."""
    credentials, options = _client(tls, roles, CONTROLLER_CHANNEL_OPTIONS)
    if credentials is None:
        return grpc.aio.insecure_channel(target, options=options)
    return grpc.aio.secure_channel(target, credentials, options=options)


def aio_agent_channel(target: str, tls: TLSFiles | None,
                      roles: tuple[Role, ...] = (Role.OPERATOR, Role.CONTROLLER),
                      server_name: str = HOST_SERVER_NAME) -> grpc.aio.Channel:
    """An asyncio channel to an agent's own port (elastic.agent.service) at
    "HOST:PORT": mutual TLS with `tls` (one of `roles`), the server's
    certificate checked for `server_name` (default: the name every host
    certificate carries, elastic-host; `certs.host_server_name(host)` for one
    host's); plaintext if None. Raises TLSError when the files cannot be
    used."""
    if tls is None:
        return grpc.aio.insecure_channel(target, options=list(CHANNEL_OPTIONS))
    return grpc.aio.secure_channel(
        target, tls_.channel_credentials(tls, roles),
        options=[*CHANNEL_OPTIONS, ("grpc.ssl_target_name_override", server_name)])


def channel(target: str, tls: TLSFiles | None,
            roles: tuple[Role, ...] = (Role.OPERATOR, Role.CONTROLLER)) -> grpc.Channel:
    """A blocking channel to the controller (CLI tools), as `aio_channel`."""
    credentials, options = _client(tls, roles)
    if credentials is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, credentials, options=options)


def lenient(message_class):
    """A request deserializer for `message_class` that returns None for
    bytes that do not parse (the servicer refuses those with
    INVALID_ARGUMENT) instead of raising (grpc's UNKNOWN, with a traceback
    in the log for every such message)."""
    from google.protobuf.message import DecodeError

    def deserialize(data: bytes):
        try:
            return message_class.FromString(data)
        except DecodeError:
            return None
    return deserialize


def retry_after_s(error: BaseException | None) -> float | None:
    """The seconds a RESOURCE_EXHAUSTED answer asked the caller to wait
    (RETRY_AFTER_KEY, at most an hour); None for any other error or answer."""
    if not isinstance(error, grpc.RpcError) or \
            error.code() is not grpc.StatusCode.RESOURCE_EXHAUSTED:
        return None
    for key, value in error.trailing_metadata() or ():
        if key == RETRY_AFTER_KEY:
            try:
                return min(3600.0, max(0.0, int(value) / 1000))
            except (TypeError, ValueError):
                return None
    return None


def is_transient(error: BaseException) -> bool:
    """True for gRPC errors worth retrying (UNAVAILABLE, DEADLINE_EXCEEDED,
    and RESOURCE_EXHAUSTED with a retry-after hint)."""
    return isinstance(error, grpc.RpcError) and (
        error.code() in TRANSIENT_CODES or retry_after_s(error) is not None)


class WaitHinted(tenacity.wait.wait_base):
    """A tenacity wait: `fallback`'s, or the server's retry-after hint
    (retry_after_s) when that is longer."""

    def __init__(self, fallback: tenacity.wait.wait_base) -> None:
        self.fallback = fallback

    def __call__(self, retry_state: tenacity.RetryCallState) -> float:
        outcome = retry_state.outcome
        hint = retry_after_s(outcome.exception() if outcome is not None else None)
        return max(hint or 0.0, self.fallback(retry_state))


def retrying(max_wait_s: float = 5.0, give_up_after_s: float | None = None,
             before_sleep=None) -> tenacity.AsyncRetrying:
    """Exponential backoff with jitter (0.1 s doubling to `max_wait_s`, plus up to
    0.1 s of jitter, or the server's retry-after hint when longer) on
    transient gRPC errors; never gives up unless `give_up_after_s` is set.
    Other errors pass through at once."""
    stop = tenacity.stop_never if give_up_after_s is None else \
        tenacity.stop_after_delay(give_up_after_s)
    return tenacity.AsyncRetrying(
        retry=tenacity.retry_if_exception(is_transient),
        wait=WaitHinted(tenacity.wait_exponential_jitter(multiplier=0.1, max=max_wait_s,
                                                         jitter=0.1)),
        stop=stop, reraise=True, before_sleep=before_sleep)
