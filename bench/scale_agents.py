"""The simulated agents of bench/scale.py: many `grpc.aio` agents in one
client process (`client_main`), each with a connection and, with TLS, a host
certificate of its own; each registers, opens its stream, heartbeats once a
second as datagrams with the agent's own code (elastic.agent.datagrams) and
answers start/stop commands as a real agent would. They must behave as real
agents do: one that stops heartbeating is a host the controller rightly
declares lost, and the benchmark would count it as the controller's false
loss (tests/test_bench_scale.py).
"""

from __future__ import annotations

import asyncio
import fcntl
import itertools
import json
import os
import pathlib
import random
import signal
import struct
import sys
import time
import uuid

REPO = pathlib.Path(__file__).resolve().parent.parent
#: A simulated agent's heartbeats handed over further apart than this
#: (seconds; they are due every second) are recorded as a gap of its own
#: sending, when its client process was behind.
SEND_GAP_S = 2.0
#: ioctl: the receive timestamp of the last packet a socket read (Linux, asm-generic/sockios.h)
SIOCGSTAMP = 0x8906


class ArrivalStamps:
    """Stands for a datagram endpoint's inbox: notes the kernel's receive
    timestamp (wall-clock seconds) of each start and stop datagram in
    received[kind + "_arrived"][host] (the first), then queues it."""

    def __init__(self, queue: asyncio.Queue, transport, host_id: str, received: dict) -> None:
        self.queue, self.host_id, self.received = queue, host_id, received
        self.fd = transport.get_extra_info("socket").fileno()
        try:
            fcntl.ioctl(self.fd, SIOCGSTAMP, bytes(16))  # the first call turns stamping on
        except OSError:
            pass  # (ENOENT: nothing read yet)

    def put_nowait(self, message) -> None:
        # (not every item is a message: elastic.agent.datagrams.WENT_TO_STREAM)
        kind = message.WhichOneof("body") if hasattr(message, "WhichOneof") else None
        try:
            if kind in ("start", "stop"):  # (called right after the datagram was read)
                sec, usec = struct.unpack("@ll", fcntl.ioctl(self.fd, SIOCGSTAMP, bytes(16)))
                self.received.setdefault(f"{kind}_arrived", {}).setdefault(self.host_id,
                                                                          sec + usec / 1e6)
        except OSError:
            pass  # (no timestamp: its handling time counts)
        finally:
            self.queue.put_nowait(message)



# --- the client side: many simulated agents in one process ------------------------------

async def simulated_agent(stub, pb, address: str, host_id: str, job_id: str, received: dict,
                          silence: asyncio.Event | None) -> None:
    """One agent: registers, streams, heartbeats (as datagrams when the
    controller offers them, with the real agent's elastic.agent.datagrams);
    like a real agent it registers again whenever its session ends (counted
    by status code in received["session_ended"]), and when its stream has
    no first answer for as long as a real agent waits (counted in
    received["streams_given_up"])."""
    import grpc

    from elastic import transport
    from elastic.protocol import PROTOCOL

    incarnation = uuid.uuid4().hex[:12]
    status = pb.WorkerStatus(state=pb.WORKER_IDLE, step=-1, committed_step=-1)
    seq = itertools.count(1)

    def header():
        return pb.Header(job_id=job_id, host_id=host_id, incarnation=incarnation,
                         generation=status.generation, seq=next(seq))

    def deferred(state) -> None:  # refused while the controller was behind
        if transport.retry_after_s(state.outcome.exception()) is not None:
            counts = received.setdefault("deferred", {})
            counts[host_id] = counts.get(host_id, 0) + 1

    while silence is None or not silence.is_set():
        stage = "register"
        try:
            async for attempt in transport.retrying(before_sleep=deferred):  # as agents do
                with attempt:
                    reply = await stub.Register(pb.RegisterRequest(
                        header=header(), devices=1, address="127.0.0.1", failure_domain=host_id,
                        protocol=PROTOCOL, worker=status, free_port=20000 + random.randrange(20000)), timeout=30)
            stage = "stream"
            await session(stub, pb, address, reply, header, status, host_id, received, silence)
            code = "OK"
        except grpc.aio.AioRpcError as e:
            code = e.code().name
            if code not in ("OK", "CANCELLED"):
                first = received.setdefault("first_details", {})
                first.setdefault(f"{stage}:{code}", (e.details() or "")[:200])
        ended = received.setdefault("session_ended", {})
        key = f"{stage}:{code}"
        ended[key] = ended.get(key, 0) + 1
        await asyncio.sleep(random.uniform(0.1, 1.0))  # (real agents back off too)


def task_failed(received: dict, host_id: str, task: asyncio.Task) -> None:
    """A simulated agent's heartbeat or inbox task failed: counted in
    received["tasks_failed"], the first one printed (it would leave the
    agent silent, a host lost by the benchmark's own fault)."""
    failed = received.setdefault("tasks_failed", {})
    if not failed:
        print(f"simulated agent {host_id}: {task.get_coro().__name__} failed: "
              f"{task.exception()!r}", file=sys.stderr, flush=True)
    failed[host_id] = failed.get(host_id, 0) + 1


async def session(stub, pb, address: str, reply, header, status, host_id: str, received: dict,
                  silence: asyncio.Event | None) -> None:
    from elastic.agent.datagrams import open_datagrams
    from elastic.agent.session import first_answer_wait_s

    call = stub.Connect()
    acks: asyncio.Queue = asyncio.Queue()
    datagrams = await open_datagrams(address, reply, host_id, acks)
    if datagrams is not None:
        datagrams.inbox = ArrivalStamps(acks, datagrams.transport, host_id, received)
    streamed = False
    writing = asyncio.Lock()  # one write at a time on a call (the real agent has one writer)

    async def write(message) -> None:
        async with writing:
            await call.write(message)

    await write(pb.AgentMessage(header=header(), heartbeat=pb.Heartbeat(worker=status)))
    received.setdefault("stream_opened", {}).setdefault(host_id, time.time())  # the first

    async def beat():
        await asyncio.sleep(random.random())  # spread the heartbeats over the second
        seq = 0
        # when this host's last heartbeat was handed to the kernel or gRPC
        # (across its sessions: re-registering is silence too)
        handed_at = received.setdefault("last_handed", {})
        while silence is None or not silence.is_set():
            seq += 1
            if status.state == pb.WORKER_RUNNING:
                status.step += 1  # a training step per heartbeat
            message = pb.AgentMessage(header=header(), heartbeat=pb.Heartbeat(
                seq=seq, worker=status, free_port=30000 + seq % 1000, sent_at=time.time()))
            if not streamed or not datagrams.send(message):  # (as the agent does)
                await write(message)
                if streamed and datagrams.probe_due():  # (agent._heartbeat)
                    datagrams.probe(pb.AgentMessage(header=header(), heartbeat=message.heartbeat))
            now, handed = time.time(), handed_at.get(host_id)
            if handed is not None and now - handed > SEND_GAP_S:  # this client was behind
                received.setdefault("send_gaps", {}).setdefault(host_id, []).append(
                    (round(handed, 3), round(now, 3)))
            handed_at[host_id] = now
            await asyncio.sleep(1.0)

    async def command(message) -> None:
        """A command from the stream or a datagram (a start or a stop may
        come both ways: its first receipt counts, and is acted on, as the
        agent does)."""
        if not hasattr(message, "WhichOneof"):
            return  # elastic.agent.datagrams.WENT_TO_STREAM: heartbeats go on the stream now
        kind = message.WhichOneof("body")
        if kind == "start" and message.start.generation <= status.generation:
            return  # its other copy
        if kind in ("start", "stop"):
            received.setdefault(kind, {}).setdefault(host_id, time.time())
        if kind == "start":
            status.generation = message.start.generation
            status.state, status.step, status.pid = pb.WORKER_RUNNING, 0, 1
        elif kind == "stop" and status.state == pb.WORKER_RUNNING:
            status.state, status.signal, status.stopped_on_request = pb.WORKER_EXITED, 9, True
            if silence is None or not silence.is_set():
                await write(pb.AgentMessage(header=header(), worker_exited=status))

    async def drain() -> None:  # what came as datagrams: acks, and copies of stops
        while True:
            await command(await acks.get())

    task, drainer = asyncio.create_task(beat()), asyncio.create_task(drain())
    for t in (task, drainer):  # (a simulated agent that silently stopped beating looked,
        t.add_done_callback(lambda t: t.cancelled() or t.exception() is None or  # to the
                            task_failed(received, host_id, t))  # benchmark, like a lost host)
    # like the real agent, no first answer on the stream this long: register again
    first_answer_s = first_answer_wait_s(reply.heartbeat_timeout_s, reply.stream_wait_s, None)
    answered = False
    try:
        while True:
            try:
                message = await (call.read() if answered else
                                 asyncio.wait_for(call.read(), first_answer_s))
            except TimeoutError:
                gave_up = received.setdefault("streams_given_up", {})
                gave_up[host_id] = gave_up.get(host_id, 0) + 1
                return
            if message is None or not hasattr(message, "WhichOneof"):
                return
            answered, streamed = True, datagrams is not None  # it has taken the stream up
            await command(message)
    finally:
        task.cancel()
        drainer.cancel()
        call.cancel()
        if datagrams is not None:
            datagrams.transport.close()
            received.setdefault("datagrams_given_up", {})[host_id] = datagrams.given_up


async def client_main(address: str, job_id: str, first: int, count: int, out: str,
                      ca_dir: str) -> None:
    sys.path.insert(0, str(REPO))
    from elastic.security import tls
    from elastic.security.certs import Authority
    from elastic.security.identity import Role
    from elastic.v1 import control_pb2 as pb
    from elastic.v1 import control_pb2_grpc as pb_grpc

    received: dict = {}
    silence = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, silence.set)
    done = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, done.set)
    # a connection of its own per agent (grpc shares one between channels of
    # equal arguments), as real agents on separate hosts have: with TLS each
    # holds its own host certificate (the controller binds a host id to the
    # certificate of the connection), issued here from the benchmark's CA
    import grpc
    from elastic.transport import CONTROLLER_CHANNEL_OPTIONS
    hosts = [f"sim-{first + i:05d}" for i in range(count)]
    # (and the real agents' options: their keepalive pings, which close a
    # connection whose pings go unanswered, are part of the load)
    options = [("grpc.use_local_subchannel_pool", 1), *CONTROLLER_CHANNEL_OPTIONS]
    if ca_dir == "-":
        channels = [grpc.aio.insecure_channel(address, options=options) for _ in hosts]
    else:
        authority = Authority(ca_dir)
        channels = []
        for host in hosts:
            cert, key, _ = authority.issue_pem(Role.HOST, host)
            channels.append(grpc.aio.secure_channel(
                address, grpc.ssl_channel_credentials(authority.ca_pem, key, cert),
                options=[*options, *tls.SERVER_NAME_OPTIONS]))
    # (thousands of calls in one process: gRPC's wake-ups must keep up, as in
    # the controller; a real agent has one connection)
    from elastic.grpc_wakeups import drain_wakeups
    drain_wakeups(loop)
    worst = [0.0]  # this process's own loop lag: are the simulated agents behind?

    async def probe() -> None:
        recent, reported = 0.0, time.monotonic()
        while True:
            due = time.monotonic() + 0.1
            await asyncio.sleep(0.1)
            late = time.monotonic() - due
            worst[0], recent = max(worst[0], late), max(recent, late)
            if time.monotonic() - reported > 5:  # (to the client's log)
                print(f"{time.strftime('%H:%M:%S')} loop lag over 5 s: {recent:.2f} s; "
                      f"sessions ended: {received.get('session_ended', {})}",
                      file=sys.stderr, flush=True)
                recent, reported = 0.0, time.monotonic()

    lag = asyncio.create_task(probe())
    tasks = []
    for i, host in enumerate(hosts):
        stub = pb_grpc.ControllerStub(channels[i])
        task = asyncio.create_task(simulated_agent(
            stub, pb, address, host, job_id, received, silence if first + i == 0 else None))
        task.add_done_callback(lambda t: t.cancelled() or t.exception() is None or print(
            f"simulated agent failed: {t.exception()!r}", file=sys.stderr, flush=True))
        tasks.append(task)
        if i % 100 == 99:
            await asyncio.sleep(0.05)  # do not register all at the same instant
    await done.wait()
    for t in tasks:
        t.cancel()
    await asyncio.wait(tasks, timeout=10)  # (their sessions record how they ended)
    lag.cancel()
    received["client_max_lag_s"] = {str(first): worst[0]}
    now = time.time()  # (a gap still open at the end: sim-00000's silence among them)
    for host, handed in received.pop("last_handed", {}).items():
        if now - handed > SEND_GAP_S:
            received.setdefault("send_gaps", {}).setdefault(host, []).append(
                (round(handed, 3), round(now, 3)))
    received["session_ended"] = {f"{k}#{first}": v for k, v in received.get("session_ended", {}).items()}
    pathlib.Path(out).write_text(json.dumps(received))
    os._exit(0)  # skip channel teardown of thousands of streams
