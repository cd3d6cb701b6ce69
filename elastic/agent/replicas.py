"""Replicas of local snapshots between agents (buddy replication).

A host's local snapshots (elastic.checkpoint.snapshot) live in its own
memory: lost with the host. When the state is sharded across hosts, the
rest of the slice cannot make up the lost host's shards, and every process
goes back to the last committed checkpoint. So every agent also sends each
of its worker's snapshots to one peer, its buddy (chosen by the controller
in another failure domain where there is one: elastic.policy.buddies), and
keeps its peers' snapshots beside its own as replica files
(snapshot.replica_name). At a restore the processes vote with what they
hold, own and replicas, and make the step up between them
(elastic.checkpoint.snapshot_transfer). The idea is GEMINI's (Wang et al.,
SOSP 2023: checkpoints in the CPU memory of peer machines, placed across
failure domains) and ByteRobust's in-memory backups on peers.

Off the training loop: the worker only tells its agent that a snapshot is
written (one datagram); the agent reads the file and streams it to the
buddy's agent (`PutReplica` on the agents' own port, mutual TLS, the
receiver's certificate checked for the buddy's name,
certs.host_server_name), one at a time; a newer snapshot waiting replaces
an older one not yet sent. The
receiving agent names a replica after the caller's certificate (a host can
only ever write its own replicas), takes replicas only from the hosts the
controller made it the buddy of in its worker's generation (any other host
of the job could otherwise plant a "replica" the next restore would take),
of the controller run it works for and of that generation (a send that
outlived its generation may carry a step of a line of training given up
since: checked again before the replica is put in place), one stream per
sender at a time, refuses what does not fit its directory, writes it
atomically (a temporary name, then rename) and keeps the newest KEEP per
host. A sender abandons a send in flight when its own generation changes,
and drops a snapshot reported late by the worker of the generation before.

Cost: a host holds its buddy's snapshots besides its own (twice the
snapshot memory, in /dev/shm by default) and sends each snapshot's bytes
over the network once, from the agent's process.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pathlib
import secrets
import shutil
import time
from collections.abc import Callable

import grpc

from elastic import transport
from elastic.checkpoint.snapshot import (REPLICA_PREFIX, SUFFIX, parse_replica_name,
                                         replica_name)
from elastic.security.certs import host_server_name
from elastic.security.files import open_private
from elastic.security.identity import IdentityError, Role
from elastic.security.tls import TLSFiles, peer_identity
from elastic.v1 import control_pb2 as pb
from elastic.v1 import control_pb2_grpc as pb_grpc

log = logging.getLogger("elastic-agent")

#: Replicas kept per peer host (as many as a host keeps of its own snapshots).
KEEP = 3
#: Bytes per chunk of a replica on the wire (under the servers' 1 MiB message limit).
CHUNK_BYTES = 1 << 19
#: Free bytes a replica must leave in the directory.
HEADROOM_BYTES = 1 << 20


class ReplicaStore:
    """Peers' replicas in `directory` (the agent's snapshot directory).
    `run_id()` -> the controller run this agent works for ("" before its
    first start: then nothing is accepted); `generation()` -> the
    generation of its current worker; `senders()` -> the hosts that send
    it replicas in that generation."""

    def __init__(self, directory: str | os.PathLike[str], run_id: Callable[[], str],
                 generation: Callable[[], int], senders: Callable[[], frozenset[str]],
                 keep: int = KEEP) -> None:
        self.directory = pathlib.Path(directory)
        self.run_id, self.generation, self.senders = run_id, generation, senders
        self.keep = keep
        self.received = 0
        self.receiving: set[str] = set()  # senders with a stream in progress

    def refusal(self, host: str, run_id: str, generation: int, step: int, size: int
                ) -> str | None:
        """Why a replica of `host`'s step `step` (`size` bytes, written in
        `generation` of run `run_id`) is not kept, or None."""
        unwanted = self.unwanted(host, run_id, generation)
        if unwanted:
            return unwanted
        if step < 0 or size <= 0:
            return f"step {step} and size {size} must be >= 0 and > 0"
        free = shutil.disk_usage(self.directory).free
        if size + HEADROOM_BYTES > free:
            return f"{size} bytes do not fit in {self.directory} ({free} bytes free)"
        return None

    def unwanted(self, host: str, run_id: str, generation: int) -> str | None:
        """Why this host takes no replica from `host` written in `generation`
        of run `run_id` (now), or None."""
        ours = self.run_id()
        if not ours or run_id != ours:
            return (f"the replica is of controller run {run_id[:64]!r}; this agent works for "
                    f"{ours or 'none yet'}")
        if generation != self.generation():
            return (f"the replica was written in generation {generation}; this host's worker "
                    f"is of generation {self.generation()}")
        if host not in self.senders():
            return (f"host {host} does not send replicas to this host in generation "
                    f"{generation}")
        return None

    def begin(self, host: str, step: int) -> "ReplicaFile":
        """A file to write `host`'s replica of `step` into, under a temporary
        name of its own (0600; no other write can interleave). Raises OSError,
        BlockingIOError while `host` has another stream in progress (its
        ReplicaFile's commit or discard ends it)."""
        if host in self.receiving:
            raise BlockingIOError(f"host {host} is already sending a replica")
        replica = ReplicaFile(self, host, step)
        self.receiving.add(host)
        return replica

    def kept(self, host: str, step: int) -> None:
        """`host`'s replica of `step` is in place: drop its older ones beyond `keep`."""
        mine = sorted((parsed[1], p) for p in self.directory.glob(f"{REPLICA_PREFIX}*{SUFFIX}")
                      if (parsed := parse_replica_name(p.name)) and parsed[0] == host)
        for _, old in mine[:-self.keep]:
            old.unlink(missing_ok=True)
        self.received += 1


class ReplicaFile:
    """One replica being received: `write(data)` as chunks come, then
    `commit()` (renamed into place) or `discard()`. Raises OSError."""

    def __init__(self, store: ReplicaStore, host: str, step: int) -> None:
        self.store, self.host, self.step = store, host, step
        self.path = store.directory / replica_name(host, step)
        self.tmp = self.path.with_name(f".{self.path.name}.{secrets.token_hex(4)}.tmp")
        self.size = 0
        self._file = open_private(self.tmp, "wb")

    def write(self, data: bytes) -> None:
        """Append a chunk (bytes) to the temporary file. Raises OSError."""
        self._file.write(data)
        self.size += len(data)

    def commit(self) -> int:
        """Put the replica in place (atomically); returns its bytes."""
        try:
            self._file.close()
            os.replace(self.tmp, self.path)
        except OSError:
            self.discard()
            raise
        self.store.receiving.discard(self.host)
        self.store.kept(self.host, self.step)
        return self.size

    def discard(self) -> None:
        """Close and remove the temporary file (nothing is kept)."""
        self.store.receiving.discard(self.host)
        self._file.close()
        self.tmp.unlink(missing_ok=True)


class ReplicaReceiver(pb_grpc.AgentServicer):
    """The PutReplica call of the agent's own port (module docstring).
    `store()` -> the ReplicaStore, None while the agent keeps none."""

    def __init__(self, store: Callable[[], ReplicaStore | None]) -> None:
        self.store = store

    async def PutReplica(self, request_iterator, context):
        try:
            who = peer_identity(context)
        except IdentityError as e:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))
        if who is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "replicas need mutual TLS: the sender is named by its certificate")
        if who.role is not Role.HOST:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"{who}: only the job's hosts send replicas")
        store = self.store()
        if store is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this agent keeps no snapshots")
        head, replica = None, None
        try:
            async for chunk in request_iterator:
                if head is None:
                    head = chunk
                    problem = store.refusal(who.name, chunk.run_id, chunk.generation,
                                            chunk.step, chunk.size)
                    if problem:
                        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)
                    replica = store.begin(who.name, chunk.step)
                replica.write(chunk.data)
                if replica.size > head.size:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                        f"more than the {head.size} bytes announced")
            if head is None or replica.size != head.size:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    "the replica ended before the bytes announced")
            # (again: this host's worker may have moved to another generation,
            # and restored, while the bytes came)
            problem = store.unwanted(who.name, head.run_id, head.generation)
            if problem:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)
            size, replica = replica.commit(), None
        except OSError as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"not kept: {e}")
        finally:
            if replica is not None:  # refused, cut short, cancelled
                replica.discard()
        return pb.ReplicaAck(size=size)


class ReplicaSender:
    """Sends this host's snapshots (files `step-N.snap` in `directory`) to
    its buddy's agent, one at a time, newest first: `target()` at every
    start, `offer(step)` as each snapshot is written. Failures are logged
    (the first of a run of them, then every 100th) and counted (`failed`:
    in a row, since the last replica sent; `failures_total`: all); training
    never waits for a replica. `sent`, `last_sent_step` and `last_send_s`
    (seconds) tell how it goes."""

    def __init__(self, directory: str | os.PathLike[str], tls: TLSFiles | None,
                 timeout_s: float = 120.0) -> None:
        self.directory = pathlib.Path(directory)
        self.tls = tls
        self.timeout_s = timeout_s
        self.host = self.address = self.run_id = ""
        self.generation = 0
        self.sent = self.failed = self.failures_total = 0
        self.last_sent_step = -1
        self.last_send_s = 0.0
        self._channel: grpc.aio.Channel | None = None
        self._pending: int | None = None
        self._task: asyncio.Task | None = None

    def target(self, host: str, address: str, run_id: str, generation: int) -> None:
        """Send to `host`'s agent at `address` ("host:port"; "" for none)
        from now on, replicas of controller run `run_id` written by the
        worker of `generation`."""
        if (address, host) != (self.address, self.host) and self._channel is not None:
            # (the channel checks the receiver's name: another host, another channel)
            channel, self._channel = self._channel, None
            asyncio.get_running_loop().create_task(channel.close())
        if generation != self.generation and self._task is not None:
            self._task.cancel()  # a send of the generation before: of no use now
        self.host, self.address, self.run_id = host, address, run_id
        self.generation = generation
        self._pending = None

    def offer(self, step: int, generation: int) -> None:
        """Snapshot `step` is written by the worker of `generation`: send it
        when the one in flight is done (replacing any older one still
        waiting); dropped when `generation` is not the one `target()` last
        named (a late report of the worker before: its step belongs to a
        line of training the next generation may have given up, and would
        be tagged with the new generation, which its buddy accepts)."""
        if not self.address or self.tls is None or generation != self.generation:
            return
        self._pending = step
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        while self._pending is not None:
            step, self._pending = self._pending, None
            try:
                await self._send(step)
            except FileNotFoundError:
                pass  # already replaced by a newer one (the worker keeps two)
            except (grpc.RpcError, OSError) as e:
                self.failed += 1
                self.failures_total += 1
                if self.failed == 1 or self.failed % 100 == 0:
                    detail = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
                    if "not in peer certificate" in detail:
                        detail += (f" (the agent at {self.address} is not host {self.host} by its "
                                   f"certificate, or its certificate was issued before host "
                                   f"certificates named their hosts: issue it again)")
                    log.warning("replica of step %d to host %s (%s) not sent (%d failed so "
                                "far): %s", step, self.host, self.address, self.failed, detail)

    async def _send(self, step: int) -> None:
        path = self.directory / f"step-{step:010d}{SUFFIX}"
        generation = self.generation
        f = await asyncio.to_thread(open, path, "rb")  # (kept open: the file may be replaced)
        try:
            size = os.fstat(f.fileno()).st_size

            async def chunks():
                first = True
                while True:
                    data = await asyncio.to_thread(f.read, CHUNK_BYTES)
                    if not data and not first:
                        return
                    yield (pb.ReplicaChunk(run_id=self.run_id, generation=generation, step=step,
                                           size=size, data=data)
                           if first else pb.ReplicaChunk(data=data))
                    first = False

            if self._channel is None:  # (the receiver must be the buddy, by its certificate)
                self._channel = transport.aio_agent_channel(
                    self.address, self.tls, roles=(Role.HOST,),
                    server_name=host_server_name(self.host))
            t0 = time.monotonic()
            await pb_grpc.AgentStub(self._channel).PutReplica(chunks(), timeout=self.timeout_s)
        finally:
            f.close()
        self.sent += 1
        self.last_sent_step, self.last_send_s = step, time.monotonic() - t0
        if self.failed:
            log.info("replicas to host %s flow again (step %d)", self.host, step)
            self.failed = 0

    async def close(self) -> None:
        """Stop sending (a replica in flight is abandoned) and close the channel."""
        if self._task is not None:
            self._task.cancel()
        if self._channel is not None:
            await self._channel.close()
