"""`elasticd start`: the controller of one job behind a `grpc.aio` server."""

from __future__ import annotations

import asyncio
import logging
import pathlib
import signal

from elastic import transport
from elastic.clock import Clock, SystemClock
from elastic.config import JobSpec
from elastic.controller.core import Controller
from elastic.controller.journal import JournalWriter, last_generation
from elastic.controller.servicer import ControllerServicer
from elastic.v1 import control_pb2_grpc as pb_grpc

log = logging.getLogger("elasticd")

ADDRESS_FILE = "controller.addr"


class ControllerServer:
    """A Controller served over gRPC.

    `await start()` binds `listen` ("HOST:PORT", port 0 picks one), writes the
    bound address to `<state_dir>/controller.addr` and returns it;
    `await run()` reconciles until the job ends and returns its exit code
    (0 succeeded, 1 failed); `await stop()` ends the server.
    Raises RuntimeError from start() when the address cannot be bound.
    """

    def __init__(self, spec: JobSpec, listen: str, state_dir: str | pathlib.Path,
                 clock: Clock | None = None, tick_s: float = 0.1) -> None:
        self.state_dir = pathlib.Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.spec = spec.with_checkpoint_dir(str((self.state_dir / "checkpoints").resolve()))
        self.listen = listen
        self.journal = JournalWriter(self.state_dir)
        self.controller = Controller(self.spec, self.journal, clock or SystemClock(), tick_s,
                                     initial_generation=last_generation(self.state_dir))
        self.server = transport.aio_server()
        pb_grpc.add_ControllerServicer_to_server(ControllerServicer(self.controller), self.server)
        self.address = ""

    async def start(self) -> str:
        port = transport.add_listen_port(self.server, self.listen)
        host = self.listen.rsplit(":", 1)[0] or "127.0.0.1"
        if host in ("0.0.0.0", "[::]", "::"):
            host = "127.0.0.1"
        self.address = f"{host}:{port}"
        await self.server.start()
        tmp = self.state_dir / (ADDRESS_FILE + ".tmp")
        tmp.write_text(self.address + "\n")
        tmp.replace(self.state_dir / ADDRESS_FILE)
        log.info("controller of job %s listening on %s, journal %s", self.spec.job_id,
                 self.address, self.journal.path)
        return self.address

    async def run(self) -> int:
        return await self.controller.run()

    async def stop(self, grace_s: float = 1.0) -> None:
        # Let the last commands (stops) reach the agents, then close.
        for session in list(self.controller.sessions.values()):
            session.close()
        await self.server.stop(grace_s)
        self.journal.close()


async def serve(spec: JobSpec, listen: str, state_dir: str) -> int:
    """Run the controller until the job ends or SIGTERM/SIGINT arrives.

    Returns the exit code: 0 job succeeded, 1 job failed, 143 stopped by a
    signal (agents keep their workers; a restarted controller takes over)."""
    server = ControllerServer(spec, listen, state_dir)
    await server.start()
    stopped = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopped.set)
    run = asyncio.create_task(server.run())
    stop_wait = asyncio.create_task(stopped.wait())
    await asyncio.wait([run, stop_wait], return_when=asyncio.FIRST_COMPLETED)
    if run.done():
        code = run.result()
        stop_wait.cancel()
    else:
        run.cancel()
        server.controller.executor.record("controller_stopped",
                                          server.controller.state.generation,
                                          "controller stopped by a signal")
        code = 143
    await server.stop()
    return code
