"""Worker processes whose end the agent hears of the moment it happens.

asyncio's `Process.wait()` (Python 3.11) returns only once the process has
ended and every one of its pipes has closed. A process the worker started
that outlives it (a data loader's child, anything in another session)
inherits its stdout and stderr and keeps them open: the agent would report
the worker's exit only when that process ends, if ever, and meanwhile the
controller would wait for a hang to be detected (measured 2026-11-29: a
worker exiting with code 1 beside a `sleep 30` that kept its stderr was
reported 30 s late). `spawn` starts a process whose `ended` future holds its
exit status as soon as the child watcher has reaped it, pipes open or not.
"""

from __future__ import annotations

import asyncio

#: asyncio's default buffer limit for a subprocess's stream readers (bytes).
STREAM_LIMIT = 2 ** 16


class _ExitProtocol(asyncio.subprocess.SubprocessStreamProtocol):
    """asyncio's protocol for a subprocess with stream pipes, which also
    resolves `ended` with the exit status when the process ends."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(limit=STREAM_LIMIT, loop=loop)
        self.ended: asyncio.Future[int] = loop.create_future()
        self._process_transport: asyncio.SubprocessTransport | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._process_transport = transport

    def process_exited(self) -> None:
        super().process_exited()
        if not self.ended.done():
            self.ended.set_result(self._process_transport.get_returncode())


class WorkerProcess(asyncio.subprocess.Process):
    """An asyncio Process with `ended` (a future of its exit status: the
    code, or minus the signal that ended it, set once it has ended, whether
    or not its pipes are still open) and `transport` (its subprocess
    transport: `transport.close()` lets go of pipes a leftover holds)."""

    def __init__(self, transport: asyncio.SubprocessTransport, protocol: _ExitProtocol,
                 loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(transport, protocol, loop)
        self.ended = protocol.ended
        self.transport = transport


async def spawn(argv: list[str], **kwargs) -> WorkerProcess:
    """Start `argv` as `asyncio.create_subprocess_exec(*argv, **kwargs)`
    does, as a WorkerProcess. Raises OSError as it does (no such program,
    no such working directory, no permission)."""
    loop = asyncio.get_running_loop()
    transport, protocol = await loop.subprocess_exec(lambda: _ExitProtocol(loop), *argv,
                                                     **kwargs)
    return WorkerProcess(transport, protocol, loop)
