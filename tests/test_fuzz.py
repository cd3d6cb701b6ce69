"""Fuzzing the RPC surface with Hypothesis: random and mutated protobuf
messages against a live controller (from a host's certificate, as a rogue
host would) and from a live but hostile controller to a real agent process.

Asserts that the daemons stay up, that no handler fails (gRPC's UNKNOWN is
an exception escaping a handler), that the journal stays valid, and that
the agent executes nothing outside its allow-list. Derandomized (the same
examples on every run, so CI is reproducible) and bounded: about a minute.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import uuid

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elastic import transport
from elastic.config import load_spec
from elastic.controller.journal import load_journal
from elastic.controller.server import ControllerServer
from elastic.policy.view import WORKER_EVENT_KINDS
from elastic.protocol import PROTOCOL
from elastic.security.identity import Role, id_problem
from elastic.v1 import control_pb2 as pb
from elastic.v1 import control_pb2_grpc as pb_grpc
from tests.conftest import TINY_WORKER, tagged_pids, tiny_spec, wait_until

FUZZ = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))


class LoopThread:
    """An asyncio loop in a thread, for daemons the sync fuzz talks to."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, coro, timeout_s: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


# --- strategies -----------------------------------------------------------------

any_int64 = st.one_of(st.integers(-3, 1_000), st.integers(-2**63, 2**63 - 1))
int32 = st.integers(-2**31, 2**31 - 1)
text = st.text(max_size=200)
floats = st.floats(allow_nan=True, allow_infinity=True)
host_ids = st.one_of(st.sampled_from(["h0", "h1", "h2"]), text)
incarnations = st.one_of(st.sampled_from(["i1", "i2"]), text)
metrics = st.dictionaries(st.text(max_size=70), floats, max_size=70)
workers = st.builds(pb.WorkerStatus, generation=any_int64, state=st.integers(0, 4), pid=int32,
                    exit_code=int32, signal=int32, stderr_tail=st.text(max_size=9_000),
                    stopped_on_request=st.booleans(), step=any_int64, committed_step=any_int64,
                    metrics=metrics, suspended=st.booleans())
headers = st.builds(pb.Header, job_id=st.one_of(st.just("test"), text), host_id=host_ids,
                    incarnation=incarnations, generation=any_int64)
event_fields = st.one_of(
    text,
    st.dictionaries(st.one_of(st.sampled_from(["kind", "ts", "generation", "host", "reason",
                                               "step", "restore_s", "blocking_s", "saved_at"]),
                              text),
                    st.one_of(st.none(), st.booleans(), any_int64, floats, text), max_size=40
                    ).map(json.dumps))
bodies = st.one_of(
    st.builds(lambda hb: {"heartbeat": hb},
              st.builds(pb.Heartbeat, seq=any_int64, worker=workers, free_port=int32,
                        preemption=text, sent_at=floats)),
    st.builds(lambda w: {"worker_exited": w}, workers),
    st.builds(lambda p: {"progress": p},
              st.builds(pb.Progress, step=any_int64, committed_step=any_int64, metrics=metrics)),
    st.builds(lambda e: {"worker_event": e},
              st.builds(pb.WorkerEvent, kind=st.one_of(st.sampled_from(sorted(WORKER_EVENT_KINDS)),
                                                       text),
                        reason=text, fields_json=event_fields)),
    st.just({}))
messages = st.builds(lambda h, body: pb.AgentMessage(header=h, **body), headers, bodies)
registers = st.builds(pb.RegisterRequest, header=headers, devices=int32, address=text,
                      failure_domain=text, agent_pid=int32, worker=workers, free_port=int32)


def mutated(message_strategy):
    """Serialized messages with bytes flipped, cut or inserted."""
    def mutate(raw: bytes, edits):
        data = bytearray(raw)
        for position, value, how in edits:
            if not data:
                data.append(value)
                continue
            i = position % len(data)
            if how == 0:
                data[i] ^= value or 1
            elif how == 1:
                del data[i:]
            else:
                data.insert(i, value)
        return bytes(data)
    return st.builds(mutate, message_strategy.map(lambda m: m.SerializeToString()),
                     st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255),
                                        st.integers(0, 2)), min_size=1, max_size=8))


# --- the controller -------------------------------------------------------------

ALLOWED_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED,
                 grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED,
                 grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}


@pytest.fixture(scope="module")
def live_controller(tmp_path_factory, pki):
    """A controller of job "test" (2 hosts) with its reconcile loop running,
    and sync channels holding the certificates of hosts h0 and h1."""
    tmp = tmp_path_factory.mktemp("fuzz-controller")
    loop = LoopThread()
    spec = load_spec(tiny_spec(tmp, min_hosts=2, max_hosts=2))

    async def start():  # a grpc.aio server belongs to the loop it is made in
        server = ControllerServer(spec, "127.0.0.1:0", tmp / "state", pki.controller)
        return server, await server.start()
    server, address = loop.call(start())
    server.servicer.first_message_timeout_s = 0.5
    task = asyncio.run_coroutine_threadsafe(server.run(), loop.loop)
    channels = {h: transport.channel(address, pki.host(h), (Role.HOST,)) for h in ("h0", "h1")}
    operator = transport.channel(address, pki.operator)
    yield server, task, channels, operator, tmp / "state"
    for ch in [*channels.values(), operator]:
        ch.close()
    task.cancel()
    loop.call(server.stop("fuzz over"))
    loop.close()


def expect_refused_or_ok(call) -> None:
    """Run `call`; a gRPC error it raises must be a refusal, never UNKNOWN
    (an exception escaping a handler) or INTERNAL."""
    try:
        call()
    except grpc.RpcError as e:
        assert e.code() in ALLOWED_CODES, (e.code(), e.details())


@FUZZ
@given(host=st.sampled_from(["h0", "h1"]), register=registers,
       stream=st.lists(messages, max_size=6), valid_start=st.booleans())
def test_controller_survives_random_messages(live_controller, host, register, stream,
                                             valid_start):
    server, task, channels, _, _ = live_controller
    stub = pb_grpc.ControllerStub(channels[host])
    expect_refused_or_ok(lambda: stub.Register(register, timeout=5))
    if valid_start:  # get past registration so the random messages reach the handlers
        header = pb.Header(job_id="test", host_id=host, incarnation="i1")
        stub.Register(pb.RegisterRequest(header=header, devices=1, address="127.0.0.1",
                                         protocol=PROTOCOL,
                                         worker=pb.WorkerStatus(step=-1, committed_step=-1)),
                      timeout=5)
        first = pb.AgentMessage(header=header, heartbeat=pb.Heartbeat(
            worker=pb.WorkerStatus(step=-1, committed_step=-1)))
        stream = [first, *stream]
    expect_refused_or_ok(lambda: list(stub.Connect(iter(stream), timeout=5)))
    assert not task.done(), task.exception()


@FUZZ
@given(host=st.sampled_from(["h0", "h1"]), raw=st.one_of(mutated(registers), st.binary(
       max_size=512)), raw_stream=st.lists(st.one_of(mutated(messages), st.binary(max_size=256)),
                                           max_size=4))
def test_controller_survives_mutated_bytes(live_controller, host, raw, raw_stream):
    server, task, channels, _, _ = live_controller
    channel = channels[host]
    register = channel.unary_unary("/elastic.v1.Controller/Register",
                                   request_serializer=None, response_deserializer=None)
    connect = channel.stream_stream("/elastic.v1.Controller/Connect",
                                    request_serializer=None, response_deserializer=None)
    for call in (lambda: register(raw, timeout=5), lambda: connect(iter(raw_stream), timeout=5)):
        try:
            result = call()
            if not isinstance(result, bytes):
                list(result)
        except grpc.RpcError as e:
            assert e.code() in ALLOWED_CODES, (e.code(), e.details())
    assert not task.done(), task.exception()


def test_controller_is_up_and_its_journal_valid_after_fuzzing(live_controller):
    server, task, _, operator, state = live_controller
    assert not task.done()
    status = pb_grpc.ControllerStub(operator).GetStatus(pb.StatusRequest(), timeout=10)
    assert status.job_id == "test" and {h.host_id for h in status.hosts} <= {"h0", "h1"}
    entries, skipped = load_journal(state)
    assert skipped == 0
    generation = server.controller.state.generation
    for e in entries:
        assert isinstance(e["ts"], float) and isinstance(e["kind"], str)
        assert isinstance(e["generation"], int) and 0 <= e["generation"] <= generation, e
        assert e["host"] is None or id_problem(e["host"]) is None, e
        assert "\n" not in e["reason"] and e["kind"] not in ("job_succeeded", "job_failed"), e
    assert any(e["kind"] == "message_refused" for e in entries)


# --- the agent ------------------------------------------------------------------

class HostileController(pb_grpc.ControllerServicer):
    """Sends every connected agent what the fuzz queues; counts heartbeats."""

    def __init__(self) -> None:
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.heartbeats = 0
        self.exits: list[pb.WorkerStatus] = []

    async def Register(self, request, context):
        return pb.RegisterResponse(job_id="test", protocol=PROTOCOL, heartbeat_interval_s=0.1,
                                   heartbeat_timeout_s=2.0)

    async def Connect(self, request_iterator, context):
        async def read():
            async for message in request_iterator:
                kind = message.WhichOneof("body")
                self.heartbeats += kind == "heartbeat"
                if kind == "worker_exited":
                    self.exits.append(message.worker_exited)
        reader = asyncio.create_task(read())
        try:
            while not reader.done():
                try:
                    message = await asyncio.wait_for(self.outbox.get(), 0.2)
                except TimeoutError:
                    continue
                await context.write(message)
        finally:
            reader.cancel()


@pytest.fixture(scope="module")
def live_agent(tmp_path_factory, pki):
    tmp = tmp_path_factory.mktemp("fuzz-agent")
    tag = uuid.uuid4().hex
    env = dict(os.environ, ELASTIC_TEST_TAG=tag, PYTHONUNBUFFERED="1")
    loop = LoopThread()
    hostile = HostileController()

    async def serve():
        server = transport.aio_server()
        pb_grpc.add_ControllerServicer_to_server(hostile, server)
        port = transport.add_listen_port(server, "127.0.0.1:0", pki.controller)
        await server.start()
        return server, f"127.0.0.1:{port}"
    server, address = loop.call(serve())
    log = open(tmp / "agent.log", "wb")
    agent = subprocess.Popen(
        [sys.executable, "-m", "elastic.agent.main", "--controller", address, "--host-id", "h0",
         "--devices", "1", "--address", "127.0.0.1", "--state-dir", str(tmp / "agent"),
         "--tls-dir", str(pki.host("h0").cert.parent), "--stop-grace-s", "1",
         "--allow-worker", f"{sys.executable} {TINY_WORKER}"],
        env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: hostile.heartbeats > 0, 30, "the agent's first heartbeat")
        yield loop, hostile, agent, tmp
    finally:
        if agent.poll() is None:
            agent.send_signal(signal.SIGINT)
            try:
                agent.wait(20)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait()
        log.close()
        loop.call(server.stop(0))
        loop.close()
        wait_until(lambda: not tagged_pids(tag), 10, "the agent's workers to be gone")


def commands(marker: str, checkpoints: str):
    hostile_argv = st.sampled_from([
        ["/bin/sh", "-c", f"touch {marker}"], [sys.executable, "-c", f"open({marker!r}, 'w')"],
        ["touch", marker], [sys.executable, str(TINY_WORKER) + "x"], [sys.executable, "-m",
                                                                      "http.server"]])
    allowed_argv = st.just([sys.executable, str(TINY_WORKER), "--steps", "2",
                            "--step-time-s", "0.01"])
    argv = st.one_of(hostile_argv, allowed_argv, st.lists(text, max_size=3))
    env = st.one_of(st.just({"ELASTIC_CHECKPOINT_DIR": checkpoints}),
                    st.just({"LD_PRELOAD": marker, "ELASTIC_CHECKPOINT_DIR": checkpoints}),
                    st.just({"PYTHONWARNINGS": "all:0:antigravity.x:0:0",
                             "BROWSER": f"/bin/sh -c 'touch {marker}' #%s"}),
                    st.dictionaries(text, text, max_size=3))
    start = st.builds(pb.StartWorker, generation=any_int64, process_id=int32,
                      num_processes=int32,
                      coordinator_address=st.one_of(st.just("127.0.0.1:1"), text),
                      argv=argv, env=env, workdir=st.one_of(st.just("/tmp"), text),
                      prestart_next=st.booleans())
    # well formed but hostile: only the allow-list stands between it and a process
    hostile_start = st.builds(pb.StartWorker, generation=st.integers(1, 50), process_id=st.just(0),
                              num_processes=st.just(1),
                              coordinator_address=st.just("127.0.0.1:1"), argv=argv, env=env,
                              workdir=st.just(str(pathlib.Path(checkpoints).parent)),
                              prestart_next=st.booleans())
    stop = st.builds(pb.StopWorker, generation=any_int64, grace_s=floats, reason=text)
    rejected = st.builds(pb.Rejected, reason=text, current_generation=any_int64)
    body = st.one_of(hostile_start.map(lambda s: {"start": s}), start.map(lambda s: {"start": s}),
                     stop.map(lambda s: {"stop": s}),
                     rejected.map(lambda r: {"rejected": r}), st.just({}))
    return st.builds(lambda job, generation, b: pb.ControllerMessage(job_id=job,
                                                                      generation=generation, **b),
                     st.one_of(st.just("test"), st.just("test"), text), any_int64, body)


def test_agent_survives_a_hostile_controller_and_runs_nothing_it_does_not_allow(live_agent):
    loop, hostile, agent, tmp = live_agent
    marker = str(tmp / "pwned")

    @settings(max_examples=60, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(batch=st.lists(commands(marker, str(tmp / "ckpt")), min_size=1, max_size=4))
    def fuzz(batch):
        for message in batch:
            loop.loop.call_soon_threadsafe(hostile.outbox.put_nowait, message)
        seen = hostile.heartbeats
        wait_until(lambda: hostile.heartbeats >= seen + 2 or agent.poll() is not None, 20,
                   "the agent to heartbeat after the commands")
        assert agent.poll() is None, (tmp / "agent.log").read_text()[-3000:]

    fuzz()
    assert not os.path.exists(marker)
    assert agent.poll() is None
    refused = [e for e in hostile.exits if e.exit_code == 126]
    assert refused and all("refused to start the worker" in e.stderr_tail for e in refused)
