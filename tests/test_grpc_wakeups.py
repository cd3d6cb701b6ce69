"""gRPC's asyncio completions keep up with a slow event loop
(elastic.grpc_wakeups), over real gRPC with mutual TLS on loopback."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

from grpc_health.v1 import health_pb2, health_pb2_grpc

from elastic import transport
from elastic.grpc_wakeups import drain_wakeups
from elastic.security.identity import Role
from tests.conftest import reaped

CALLS = 600
#: A health server in a process of its own (its loop is not slowed): it
#: prints its port, then serves until killed.
SERVER = """
import asyncio, sys
import grpc
from elastic import transport
from elastic.health import add_health_and_reflection
from elastic.security.tls import TLSFiles

async def main():
    server = grpc.aio.server()
    add_health_and_reflection(server, [])
    port = transport.add_listen_port(server, "127.0.0.1:0", TLSFiles.in_dir(sys.argv[1]))
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()

asyncio.run(main())
"""


def turns_to_answer(port: int, pki, drained: bool) -> int:
    """Turns of a loop that takes 5 ms a turn until CALLS health checks to
    `port`, started at once, are all answered."""

    async def main() -> int:
        async with transport.aio_channel(f"127.0.0.1:{port}", pki.operator,
                                         (Role.OPERATOR,)) as channel:
            await channel.channel_ready()
            if drained:
                assert drain_wakeups(asyncio.get_running_loop())
            check = health_pb2_grpc.HealthStub(channel).Check
            calls = asyncio.gather(*(check(health_pb2.HealthCheckRequest(), timeout=120)
                                     for _ in range(CALLS)))
            turns = 0
            while not calls.done():
                time.sleep(0.005)  # a loop with work to do: 5 ms a turn
                await asyncio.sleep(0)
                turns += 1
            assert all(r.status == health_pb2.HealthCheckResponse.SERVING
                       for r in calls.result())
        return turns

    return asyncio.run(main())


def test_completions_are_not_let_through_one_per_turn_of_a_busy_loop(pki, proc_env):
    """600 calls make thousands of completions in the calling process.
    Without the drain, once ~277 wake-up bytes are unread gRPC's poller
    thread blocks and one completion passes per turn; with it, all that are
    ready pass every turn (measured: 18-41 turns drained, 429-437 not)."""
    directory = pki.controller.cert.parent
    with reaped(subprocess.Popen([sys.executable, "-c", SERVER, str(directory)], env=proc_env,
                                 stdout=subprocess.PIPE, text=True)) as server:
        port = int(server.stdout.readline())
        drained = turns_to_answer(port, pki, drained=True)
        undrained = turns_to_answer(port, pki, drained=False)
    assert drained * 2 < undrained, (drained, undrained)


def test_drain_wakeups_wraps_once_and_leaves_a_loop_without_grpc_alone():
    async def without_grpc() -> bool:
        return drain_wakeups(asyncio.get_running_loop())

    assert asyncio.run(without_grpc()) is False

    async def twice() -> tuple[bool, bool]:
        server = transport.aio_server()  # starts gRPC's asyncio stack on this loop
        loop = asyncio.get_running_loop()
        first, second = drain_wakeups(loop), drain_wakeups(loop)
        await server.stop(None)
        return first, second

    assert asyncio.run(twice()) == (True, True)
