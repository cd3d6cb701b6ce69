"""`elasticd logs`: the workers' and agents' output, fetched over gRPC from
the agents themselves (elastic.agent.logs), one line per line they wrote,
prefixed by host, generation and rank.

The controller's status says where each agent's own port is (its address
and `service_port`); a host whose agent is down (lost, not yet back) is
reported as unreachable. What a call brings is bounded: `tail_bytes` from
the end of each file (the agent's default 64 KiB, at most 16 MiB), then,
with `follow`, what is appended until Ctrl-C.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable

import grpc

from elastic import transport
from elastic.security.certs import host_server_name
from elastic.security.tls import TLSFiles
from elastic.v1 import control_pb2 as pb
from elastic.v1 import control_pb2_grpc as pb_grpc


def prefix(host: str, chunk: pb.LogChunk) -> str:
    """The prefix of a line: "host-1 g2 r1 | " for a worker, "host-1 agent | "."""
    if chunk.source == "agent":
        return f"{host} agent | "
    return f"{host} g{chunk.generation} r{chunk.rank} | "


async def host_logs(host: str, address: str, tls: TLSFiles | None, request: pb.LogsRequest,
                    emit: Callable[[str], None], timeout_s: float | None = 30.0) -> str | None:
    """Stream `host`'s logs from its agent at `address` ("HOST:PORT"),
    calling `emit` with each whole line, prefixed. Returns None, or why the
    host could not be read (a line for the user)."""
    partial: dict[tuple, bytes] = {}
    try:
        # (the agent must be `host`'s, not any host's: its certificate names it)
        async with transport.aio_agent_channel(address, tls,
                                               server_name=host_server_name(host)) as channel:
            call = pb_grpc.AgentStub(channel).Logs(
                request, timeout=None if request.follow else timeout_s)
            async for chunk in call:
                key = (chunk.source, chunk.generation, chunk.rank)
                data = partial.pop(key, b"") + chunk.data
                *lines, rest = data.split(b"\n")
                if rest:
                    partial[key] = rest
                for line in lines:
                    emit(prefix(host, chunk) + line.decode(errors="replace"))
    except grpc.RpcError as e:
        return f"{host}: cannot read its logs at {address}: {e.code().name}: {e.details()}"
    return None


def fetch(status: pb.JobStatus, tls: TLSFiles | None, host: str | None = None,
          generation: int = 0, follow: bool = False, tail_bytes: int = 0,
          agent: bool = True, emit: Callable[[str], None] = print) -> list[str]:
    """Print (`emit`) the logs of `host` (None: every host the status lists)
    from their agents, concurrently. Returns the problems (hosts not found,
    unreachable, or without a port), one line each. Raises ValueError for a
    host the status does not know."""
    hosts = [h for h in status.hosts if host is None or h.host_id == host]
    if host is not None and not hosts:
        raise ValueError(f"host {host!r} is not registered with the controller (hosts: "
                         f"{', '.join(h.host_id for h in status.hosts) or 'none'})")
    request = pb.LogsRequest(generation=generation, agent=agent, tail_bytes=tail_bytes,
                             follow=follow)
    problems = [f"{h.host_id}: its agent serves no port (elastic-agent --listen)"
                for h in hosts if not h.service_port]

    async def everyone() -> list[str | None]:
        return await asyncio.gather(*(
            host_logs(h.host_id, f"{h.address}:{h.service_port}", tls, request, emit)
            for h in hosts if h.service_port))

    try:
        problems += [p for p in asyncio.run(everyone()) if p]
    except KeyboardInterrupt:
        pass
    return problems


def print_line(line: str) -> None:
    """`emit` for the command line: one line, flushed (for --follow)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
