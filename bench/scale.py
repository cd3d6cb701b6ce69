"""Benchmark: one `elasticd` against 1,000 / 5,000 / 10,000 simulated agents.

Simulated agents are `grpc.aio` clients (many per process, no workers), each
with a connection of its own (with the real agents' channel options, their
keepalive pings too) and, with TLS (the default), a host certificate of its
own from the benchmark's CA: each registers, opens its stream,
heartbeats once a second (with its send time) and answers start/stop
commands as a real agent would (a stop is acknowledged with a worker exit
report at once). `--insecure` runs the same in plaintext, to measure what
mutual TLS costs. For each size:

- controller CPU share over 20 s of steady heartbeats (its process's
  user+system time / wall time; 100 % = one core);
- heartbeat latency p50/p99 (controller receipt - agent send, from status),
  and how long the status call took two ways, one after the other: on the
  probe's connection, open since the start, and on a new connection (as
  `elasticd status` makes), both taken up behind the agents' traffic (a
  call that fails is recorded with its status code; the run goes on);
- detection: one agent goes silent -> `host_lost`, minus the silence start
  (target: within heartbeat_timeout_s + 1 s = 6 s);
- fan-out: `generation_started` -> the last agent received its start, and
  `slice_stopping` -> the last agent received its stop, two ways: when the
  command arrived (the kernel's receive timestamp of its datagram at the
  agent's socket, SIOCGSTAMP; a copy on the stream: when the client read
  it), and when the client processes got to it (they share the two cores
  with the controller, and every simulated agent answers a stop with a
  stream write, so this one measures the clients too); the silenced agent,
  declared lost, is left out of the stop's;
- overload: seconds from the controller's start to the generation's start
  (every agent registered and its stream open; how many streams had sent
  their first message by then), registrations deferred by admission control,
  and hosts declared lost that were never silent (the silenced one aside:
  should be 0; elastic.controller.lag), split by whether their simulated
  agent had in fact sent nothing for the heartbeat timeout (its client
  process behind: the benchmark's doing, not the controller's); datagrams
  the kernel dropped for full buffers, on the machine and on the
  controller's socket.

    .venv/bin/python bench/scale.py --agents 1000 5000 10000 [--insecure]
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import itertools
import json
import os
import pathlib
import random
import signal
import struct
import subprocess
import sys
import time
import uuid

from common import add_keep_flag, machine, wait_entry, work_dir, write_result

REPO = pathlib.Path(__file__).resolve().parent.parent
CLIENT_PROCESSES = 4
#: How long (seconds) the benchmark's status calls may take: at 10,000
#: agents one was not answered within 30 s (2026-11-26); the time it takes
#: is a figure of its own.
STATUS_TIMEOUT_S = 180.0
#: The job's heartbeat timeout (seconds).
HEARTBEAT_TIMEOUT_S = 5.0
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


# --- the benchmark driver ------------------------------------------------------------------

class IntakeProbe:
    """How long a new call waits before the controller answers it, once a
    second, from the benchmark's driver (a process of its own): a
    grpc.health.v1 Check on one connection, each call started whether or not
    the one before was answered, so a stall of gRPC's intake shows as a run
    of slow answers rather than one. `samples`: (start, seconds to answer,
    or the status code's name if it failed: CANCELLED for calls still
    waiting at close), wall-clock starts."""

    EVERY_S = 1.0

    def __init__(self, address: str, tls) -> None:
        import threading

        from elastic import transport
        self.samples: list[tuple[float, float | str | None]] = []
        self._channel = transport.channel(address, tls)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        check = health_pb2_grpc.HealthStub(self._channel).Check
        while not self._stop.wait(self.EVERY_S):
            started, index = time.time(), len(self.samples)
            self.samples.append((started, None))

            def done(future, started=started, index=index) -> None:
                failed = future.exception()
                self.samples[index] = (started, time.time() - started if failed is None
                                       else failed.code().name)
            check.future(health_pb2.HealthCheckRequest(), timeout=STATUS_TIMEOUT_S
                         ).add_done_callback(done)

    def status_call(self) -> tuple[float | str, object]:
        """A GetStatus on this probe's connection, open since the start:
        (seconds it took or the status code's name, the JobStatus or None)."""
        from elastic.controller.status import status_on
        return timed_status_call(lambda: status_on(self._channel, STATUS_TIMEOUT_S))

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._channel.close()

    def summary(self, since: float) -> dict:
        """Median and largest wait (seconds), and the calls that waited over
        2 s or failed: [start - `since`, wait or status code]."""
        answered = sorted(w for _, w in self.samples if isinstance(w, float))
        return {"calls": len(self.samples),
                "p50_s": round(answered[len(answered) // 2], 3) if answered else None,
                "max_s": round(answered[-1], 3) if answered else None,
                "slow": [[round(t - since, 1), round(w, 2) if isinstance(w, float) else w]
                         for t, w in self.samples if not isinstance(w, float) or w > 2.0]}


def timed_status_call(call) -> tuple[float | str, object]:
    """(seconds `call()` took, its result), or (the status code's name,
    None) if it failed with a gRPC error."""
    import grpc
    asked = time.monotonic()
    try:
        status = call()
    except grpc.RpcError as e:
        return e.code().name, None
    return round(time.monotonic() - asked, 3), status


def _ms(seconds: float | None) -> str:
    """Seconds as milliseconds for the table ("-": not measured)."""
    return "-" if seconds is None else f"{1000 * seconds:.1f}ms"


def _last(times: dict, since: float) -> float | None:
    """Seconds from `since` to the latest of `times` (None if empty)."""
    return round(max(times.values()) - since, 3) if times else None


def _by_code(ended: dict) -> dict:
    """{"stage:CODE#client": n} summed over the client processes."""
    total: dict = {}
    for key, n in ended.items():
        code = key.partition("#")[0]
        total[code] = total.get(code, 0) + n
    return total


def udp_receive_buffer_errors() -> int:
    """The kernel's count of UDP datagrams dropped for a full receive buffer
    (all sockets of the machine: /proc/net/snmp, Udp RcvbufErrors)."""
    with open("/proc/net/snmp") as f:
        rows = [line.split() for line in f if line.startswith("Udp:")]
    return int(rows[1][rows[0].index("RcvbufErrors")])


def socket_drops(port: int) -> int | None:
    """Datagrams the kernel dropped on the IPv4 UDP socket bound to `port`
    (the controller's heartbeat socket: the `drops` column of
    /proc/net/udp); None if none is bound to it or the table cannot be
    read."""
    try:
        with open("/proc/net/udp") as f:
            next(f)
            for line in f:
                fields = line.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port:
                    return int(fields[-1])
    except (OSError, ValueError, IndexError, StopIteration):
        pass
    return None


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def split_losses(losses: list[dict], send_gaps: dict, timeout_s: float
                 ) -> tuple[list[dict], list[tuple[dict, float]]]:
    """Split `losses` (host_lost journal entries of hosts never silenced)
    by their senders: (those whose simulated agent had handed over no
    heartbeat for at least `timeout_s` seconds up to the entry's time, by
    `send_gaps` ({host: [(last handed, next handed)]}, wall-clock seconds,
    gaps over SEND_GAP_S); [(each other entry, the seconds its agent had
    sent nothing by then: under SEND_GAP_S when no gap spans it)])."""
    unsent, unread = [], []
    for e in losses:
        quiet_s = max((e["ts"] - a for a, b in send_gaps.get(e["host"], ())
                       if a <= e["ts"] <= b), default=0.0)
        if quiet_s >= timeout_s:
            unsent.append(e)
        else:
            unread.append((e, round(quiet_s, 3)))
    return unsent, unread


def run_size(n: int, steady_s: float, insecure: bool, stream_heartbeats: bool = False,
             keep: bool = False) -> dict:
    from elastic.controller.journal import read_journal
    from elastic.controller.status import fetch_status
    from elastic.security import certs
    from elastic.security.identity import Role
    from elastic.security.tls import TLSFiles

    with work_dir(f"elastic-scale-{n}-", keep) as work:
        pki = work / "pki"
        if insecure:
            security, operator, ca_dir = ["--insecure"], None, "-"
        else:
            certs.create_ca(pki)
            security = ["--tls-dir", str(certs.issue(pki, Role.CONTROLLER, "bench").directory)]
            operator = TLSFiles.in_dir(certs.issue(pki, Role.OPERATOR, "bench").directory)
            ca_dir = str(pki)
        spec = work / "job.toml"
        spec.write_text(f"""
[job]
id = "scale"
command = ["true"]
min_hosts = {n}
max_hosts = {n}

[health]
heartbeat_interval_s = 1.0
heartbeat_timeout_s = {HEARTBEAT_TIMEOUT_S}
stop_timeout_s = 30.0
# the silent agent stands for a lost host: its simulated peers keep
# stepping, which would otherwise carry it as a frozen agent
carry_silent_hosts = false
datagram_heartbeats = {"false" if stream_heartbeats else "true"}

[hang]
startup_timeout_s = 600.0
""")
        state = work / "state"
        dropped_before = udp_receive_buffer_errors()
        ctl = subprocess.Popen([sys.executable, "-m", "elastic.cli", "start", "--config", str(spec),
                                "--listen", "127.0.0.1:0", "--state-dir", str(state), *security],
                               stdout=subprocess.DEVNULL, stderr=open(work / "controller.log", "w"))
        clients, address, port, probe = [], "", 0, None
        try:
            deadline = time.monotonic() + 30
            while not (state / "controller.addr").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            address = (state / "controller.addr").read_text().strip()
            port = int(address.rsplit(":", 1)[1])  # (its heartbeat socket's too)
            probe = IntakeProbe(address, operator)
            per = -(-n // CLIENT_PROCESSES)
            for k in range(CLIENT_PROCESSES):
                count = min(per, n - k * per)
                clients.append((subprocess.Popen(
                    [sys.executable, __file__, "client", address, str(k * per), str(count),
                     str(work / f"client{k}.json"), ca_dir],
                    stderr=open(work / f"client{k}.log", "w")),
                    work / f"client{k}.json"))
            started = wait_entry(state, "generation_started", generation=1, timeout_s=600)
            time.sleep(3.0)  # let every start arrive and the heartbeats settle
            c0, t0 = cpu_seconds(ctl.pid), time.monotonic()
            time.sleep(steady_s)
            cpu_share = (cpu_seconds(ctl.pid) - c0) / (time.monotonic() - t0)
            # an operator's call behind the agents' traffic, on an open
            # connection, then on a new one
            status_call_s, status = probe.status_call()
            new_status_call_s, new_status = timed_status_call(
                lambda: fetch_status(address, operator, timeout_s=STATUS_TIMEOUT_S))
            status = status or new_status
            stopped_early = any(e["kind"] == "slice_stopping" and e.get("generation") == 1
                                for e in read_journal(state))
            silent_at = time.time()
            clients[0][0].send_signal(signal.SIGUSR1)  # sim-00000 stops heartbeating
            try:
                lost = wait_entry(state, "host_lost", host="sim-00000", timeout_s=60,
                                  after_ts=silent_at)
            except TimeoutError:  # what the controller sees then, for the reader
                seen = fetch_status(address, operator, timeout_s=STATUS_TIMEOUT_S)
                silent = next((h for h in seen.hosts if h.host_id == "sim-00000"), None)
                print(f"sim-00000 not declared lost 60 s after it went silent: the "
                      f"controller says {silent.state if silent else 'nothing'} of it, last "
                      f"heartbeat {silent.heartbeat_age_s if silent else float('nan'):.1f} s "
                      f"ago ({silent.heartbeat_path if silent else '-'}); heartbeat latency "
                      f"p50 {seen.heartbeat_latency_p50_s:.2f} s, p99 "
                      f"{seen.heartbeat_latency_p99_s:.2f} s; the kernel dropped "
                      f"{socket_drops(port)} datagrams on its "
                      f"socket", flush=True)
                raise
            stopping = wait_entry(state, "slice_stopping", generation=1, timeout_s=60)
            wait_entry(state, "slice_stopped", generation=1, timeout_s=120)
            time.sleep(3.0)  # the last stops arrive
        finally:
            controller_drops = socket_drops(port) if port else None  # (before it closes)
            if probe is not None:
                probe.close()
            for proc, _ in clients:
                proc.send_signal(signal.SIGTERM)
            for proc, _ in clients:
                proc.wait(60)
            ctl.send_signal(signal.SIGTERM)
            ctl.wait(30)
        received: dict = {}
        for _, path in clients:
            for kind, by_host in json.loads(path.read_text()).items():
                received.setdefault(kind, {}).update(by_host)
        starts, stops = received.get("start", {}), received.get("stop", {})
        stops.pop("sim-00000", None)  # the silenced agent: lost, its stop need not arrive
        # when each command arrived: its datagram's kernel timestamp, or its
        # receipt on the stream when that came first or no datagram came
        arrived = {kind: {h: min(t, received.get(f"{kind}_arrived", {}).get(h, t))
                          for h, t in handled.items()}
                   for kind, handled in (("start", starts), ("stop", stops))}
        journal = list(read_journal(state))
        first_ts = journal[0]["ts"]
        per = -(-n // CLIENT_PROCESSES)
        # (the silenced agent too, if it was declared lost before its silence)
        falsely_lost = [e for e in journal if e["kind"] == "host_lost"
                        and not (e.get("host") == "sim-00000" and e["ts"] >= silent_at)]
        by_client: dict[str, int] = {}
        for e in falsely_lost:
            k = str(int(e["host"].removeprefix("sim-")) // per)
            by_client[k] = by_client.get(k, 0) + 1
        unsent, unread = split_losses(falsely_lost, received.get("send_gaps", {}),
                                      HEARTBEAT_TIMEOUT_S)
        return {
            "agents": n,
            "tls": not insecure,
            "heartbeats": "stream" if stream_heartbeats else "datagram",
            "datagrams_given_up": sum(received.get("datagrams_given_up", {}).values()),
            # datagrams the kernel dropped meanwhile, for full receive buffers
            "udp_receive_buffer_drops": udp_receive_buffer_errors() - dropped_before,
            # ... of which on the controller's heartbeat socket, in the whole run
            "controller_socket_drops": controller_drops,
            "controller_cpu_share": round(cpu_share, 3),
            "status_call_s": status_call_s,
            "status_call_new_connection_s": new_status_call_s,
            "heartbeat_latency_p50_s": round(status.heartbeat_latency_p50_s, 4) if status else None,
            "heartbeat_latency_p99_s": round(status.heartbeat_latency_p99_s, 4) if status else None,
            # generation 1 stopped (a host lost) before the benchmark silenced
            # its agent: the stop fan-out below is that stop's
            "stopped_before_silence": stopped_early,
            "detection_s": round(lost["ts"] - silent_at, 3),
            "start_fanout_s": _last(arrived["start"], started["ts"]),
            "start_fanout_handled_s": _last(starts, started["ts"]),
            "starts_received": len(starts),
            "starts_by_datagram": len(received.get("start_arrived", {})),
            "stop_fanout_s": _last(arrived["stop"], stopping["ts"]),
            "stop_fanout_handled_s": _last(stops, stopping["ts"]),
            "stops_received": len(stops),
            "stops_by_datagram": len(received.get("stop_arrived", {})),
            "all_registered_s": round(started["ts"] - first_ts, 3),
            # agents whose first stream had sent its first message when the
            # generation started, by the clients' clocks (a start for any other
            # would wait in its outbox)
            "streams_open_at_start": sum(t <= started["ts"]
                                         for t in received.get("stream_opened", {}).values()),
            "registrations_deferred": sum(received.get("deferred", {}).values()),
            # streams without a first answer for as long as a real agent waits
            # (elastic.agent.session.first_answer_wait_s): registered again
            "streams_given_up": sum(received.get("streams_given_up", {}).values()),
            "sessions_ended": _by_code(received.get("session_ended", {})),
            "session_end_details": received.get("first_details", {}),
            "client_max_lag_s": round(max(received.get("client_max_lag_s", {"": 0.0}).values()), 3),
            "false_host_lost": len(falsely_lost),
            # ... by the client process that simulated them (is one client stalled?)
            "false_host_lost_by_client": by_client,
            # ... of which the simulated agent had sent nothing for the
            # heartbeat timeout (its client process was behind: no fault of
            # the controller's), and the others: each host's silence as the
            # controller judged it and as its sender did (seconds; at most 20)
            "false_host_lost_unsent": len(unsent),
            # simulated agents whose heartbeat or inbox task failed (must be 0)
            "agent_tasks_failed": sum(received.get("tasks_failed", {}).values()),
            "false_host_lost_unread": [[e["host"], round(e["ts"] - first_ts, 1), e["silent_s"],
                                        unsent_s, e.get("controller_lag_s")]
                                       for e, unsent_s in unread[:20]],
            "false_host_lost_unread_count": len(unread),
            # gaps in the simulated agents' sending (the silenced one aside)
            "send_gaps": sum(len(g) for h, g in received.get("send_gaps", {}).items()
                             if h != "sim-00000"),
            "longest_send_gap_s": max((b - a for h, g in received.get("send_gaps", {}).items()
                                       if h != "sim-00000" for a, b in g), default=0.0),
            # a new call once a second from a third process (is gRPC's intake stalled?)
            "intake_probe": probe.summary(first_ts),
            "max_controller_lag_s": max((e.get("controller_lag_s", 0.0) for e in journal
                                         if e["kind"] == "host_lost"), default=0.0),
        }


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "client":
        _, _, address, first, count, out, ca_dir = sys.argv
        asyncio.run(client_main(address, "scale", int(first), int(count), out, ca_dir))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, nargs="+", default=[1000, 5000, 10000])
    parser.add_argument("--steady-s", type=float, default=20.0)
    parser.add_argument("--insecure", action="store_true",
                        help="plaintext gRPC (to measure what mutual TLS costs)")
    parser.add_argument("--stream-heartbeats", action="store_true",
                        help="heartbeats on the agents' gRPC streams only (datagram_heartbeats = "
                             "false), to compare with datagrams")
    parser.add_argument("--out", default=None,
                        help="default bench/results/scale[_insecure].json")
    add_keep_flag(parser)
    args = parser.parse_args()
    args.out = args.out or str(REPO / "bench" / "results" /
                               f"scale{'_insecure' if args.insecure else ''}.json")
    rows = []
    for n in args.agents:
        row = run_size(n, args.steady_s, args.insecure, args.stream_heartbeats, args.keep)
        print(json.dumps(row), flush=True)
        rows.append(row)
    print(f"\n{'TLS' if not args.insecure else 'plaintext'}, heartbeats "
          f"{'on the streams' if args.stream_heartbeats else 'as datagrams'}:")
    print(f"{'agents':>7} {'ctl CPU':>8} {'hb p50':>8} {'hb p99':>8} {'detect':>8} "
          f"{'start fan-out':>14} {'stop fan-out':>13} {'registered':>11} {'deferred':>9} "
          f"{'false lost':>11}   (fan-out: arrived / handled by the clients)")
    for r in rows:
        print(f"{r['agents']:>7} {100 * r['controller_cpu_share']:7.1f}% "
              f"{_ms(r['heartbeat_latency_p50_s']):>8} {_ms(r['heartbeat_latency_p99_s']):>8} "
              f"{r['detection_s']:7.2f}s {r['start_fanout_s']:5.2f} / {r['start_fanout_handled_s']:5.2f}s "
              f"{r['stop_fanout_s']:4.2f} / {r['stop_fanout_handled_s']:4.2f}s "
              f"{r['all_registered_s']:10.1f}s {r['registrations_deferred']:9d} "
              f"{r['false_host_lost']:11d}")
    write_result(args.out, {"date": time.strftime("%Y-%m-%d"), "machine": machine(),
                            "client_processes": CLIENT_PROCESSES, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
