"""What a host said, kept on the host and served from it: `elasticd logs`
fetches it over gRPC from the agents themselves (on a real cluster host 0
has none of the other hosts' files).

Files, in `<agent state dir>/logs/` (0700):
  agent.log                          the agent's own log (rotated at
                                     AGENT_LOG_BYTES, one old file kept)
  worker-g<generation>-r<rank>.log   a worker's stdout and stderr, lines as
                                     they came, cut at WORKER_LOG_BYTES; the
                                     newest KEEP_WORKER_LOGS files are kept

`LogsServicer` serves them as the `elastic.v1.Agent` service's `Logs` call
(on the agent's own port, elastic.agent.service), to operators and the
controller only; a call reads at most `tail_bytes` from the end of each
file and, with `follow`, streams what is appended (new generations' files
too) until the client cancels.
"""

from __future__ import annotations

import asyncio
import logging
import logging.handlers
import os
import pathlib
import re

import grpc

from elastic.security.files import open_private, private_dir
from elastic.security.identity import IdentityError, Role
from elastic.security.tls import peer_identity
from elastic.v1 import control_pb2 as pb
from elastic.v1 import control_pb2_grpc as pb_grpc

LOG_DIR = "logs"
AGENT_LOG = "agent.log"
AGENT_LOG_BYTES = 8 << 20
WORKER_LOG_BYTES = 32 << 20
KEEP_WORKER_LOGS = 16
#: Bytes from the end of each file a call reads by default, and at most.
DEFAULT_TAIL_BYTES = 64 << 10
MAX_TAIL_BYTES = 16 << 20
CHUNK_BYTES = 64 << 10
FOLLOW_POLL_S = 0.25
_WORKER = re.compile(r"worker-g(\d+)-r(\d+)\.log")


def log_dir(state_dir: str | os.PathLike[str]) -> pathlib.Path:
    """The agent's log directory (made private if missing)."""
    return private_dir(pathlib.Path(state_dir) / LOG_DIR)


def add_agent_log(state_dir: str | os.PathLike[str], logger: logging.Logger) -> None:
    """Also write `logger`'s records to `logs/agent.log` (rotated)."""
    handler = logging.handlers.RotatingFileHandler(
        log_dir(state_dir) / AGENT_LOG, maxBytes=AGENT_LOG_BYTES, backupCount=1)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    logger.addHandler(handler)


class WorkerLog:
    """One worker's output file, append-only and cut at WORKER_LOG_BYTES
    (then one line says so). Opening one removes the oldest worker files
    beyond KEEP_WORKER_LOGS. Never raises: a log that cannot be written is
    logged once and dropped (the worker's output still reaches the agent's
    own stdout and stderr)."""

    def __init__(self, state_dir: str | os.PathLike[str], generation: int, rank: int) -> None:
        self._file, self._written = None, 0
        try:
            directory = log_dir(state_dir)
            worker_files = sorted(directory.glob("worker-g*-r*.log"))
            for old in worker_files[:max(0, len(worker_files) - KEEP_WORKER_LOGS + 1)]:
                old.unlink(missing_ok=True)
            self._file = open_private(directory / f"worker-g{generation:06d}-r{rank}.log", "ab")
        except OSError as e:
            logging.getLogger("elastic-agent").error("cannot keep the worker's log: %s", e)

    def write(self, line: bytes) -> None:
        if self._file is None:
            return
        try:
            if self._written + len(line) > WORKER_LOG_BYTES:
                self._file.write(f"[elastic-agent: log cut at {WORKER_LOG_BYTES} bytes]\n"
                                 .encode())
                self.close()
                return
            self._file.write(line)
            self._file.flush()
            self._written += len(line)
        except OSError:
            self.close()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _sources(directory: pathlib.Path, generation: int, agent: bool) -> list[tuple]:
    """[(path, generation, rank)] of the files a request reads, oldest
    generation first, the agent's log last."""
    files = []
    for path in directory.glob("worker-g*-r*.log"):
        m = _WORKER.fullmatch(path.name)
        if m and (generation == 0 or int(m.group(1)) == generation):
            files.append((path, int(m.group(1)), int(m.group(2))))
    files.sort(key=lambda f: (f[1], f[2]))
    if agent and (directory / AGENT_LOG).exists():
        files.append((directory / AGENT_LOG, 0, -1))
    return files


def _read_from(path: pathlib.Path, offset: int) -> tuple[bytes, int]:
    """Whole lines of `path` from `offset` (at most MAX_TAIL_BYTES), and
    the offset after them; a file cut shorter (rotated) starts again at 0."""
    try:
        size = path.stat().st_size
        if size < offset:
            offset = 0
        with path.open("rb") as f:
            f.seek(offset)
            data = f.read(min(size - offset, MAX_TAIL_BYTES))
    except OSError:
        return b"", offset
    end = data.rfind(b"\n") + 1
    return data[:end], offset + end


class LogsServicer(pb_grpc.AgentServicer):
    """The Logs call of the agent's own port (see the module docstring)."""

    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        self.directory = log_dir(state_dir)

    async def Logs(self, request: pb.LogsRequest, context):
        try:
            who = peer_identity(context)
        except IdentityError as e:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))
        if who is not None and who.role not in (Role.OPERATOR, Role.CONTROLLER):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"{who}: only operators and the controller read a host's logs")
        if request.generation < 0 or request.tail_bytes < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "generation and tail_bytes must be >= 0")
        tail = min(request.tail_bytes or DEFAULT_TAIL_BYTES, MAX_TAIL_BYTES)
        offsets: dict[pathlib.Path, int] = {}
        first = True
        while True:
            for path, generation, rank in _sources(self.directory, request.generation,
                                                   request.agent):
                if path not in offsets:
                    size = path.stat().st_size if path.exists() else 0
                    start = max(0, size - tail) if first else 0
                    if start:  # from the start of a line
                        with path.open("rb") as f:
                            f.seek(start)
                            start += len(f.readline())
                    offsets[path] = start
                data, offsets[path] = _read_from(path, offsets[path])
                for i in range(0, len(data), CHUNK_BYTES):  # (a line may span chunks)
                    yield pb.LogChunk(source="agent" if rank < 0 else "worker",
                                      generation=generation, rank=rank,
                                      data=data[i:i + CHUNK_BYTES])
            first = False
            if not request.follow:
                return
            await asyncio.sleep(FOLLOW_POLL_S)
