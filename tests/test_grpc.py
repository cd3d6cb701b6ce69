"""Controller and agents in one process over real gRPC on ephemeral ports."""

from __future__ import annotations

import asyncio
import sys
import threading
import time

import grpc
import pytest

from elastic import transport
from elastic.agent.agent import Agent, AgentSettings
from elastic.config import load_spec
from elastic.controller.journal import read_journal
from elastic.controller.server import ControllerServer
from elastic.protocol import PROTOCOL
from elastic.security.allow import AllowList
from elastic.security.identity import Role
from elastic.v1 import control_pb2 as pb
from elastic.v1 import control_pb2_grpc as pb_grpc
from tests.conftest import TINY_WORKER, tiny_spec

#: What the in-process agents of these tests may run: the tiny worker.
TINY_ALLOWED = AllowList.parse([f"{sys.executable} {TINY_WORKER}"])


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def agent_settings(tmp_path, pki, address: str, host_id: str) -> AgentSettings:
    return AgentSettings(controller=address, host_id=host_id, devices=1, address="127.0.0.1",
                         failure_domain=host_id, state_dir=str(tmp_path / f"agent-{host_id}"),
                         tls=pki.host(host_id), allow=TINY_ALLOWED, job_id="test")


def test_controller_and_agents_run_a_job(tmp_path, tagged, pki):
    spec = load_spec(tiny_spec(tmp_path, "--steps 20 --step-time-s 0.01", max_hosts=2))

    async def main():
        server = ControllerServer(spec, "127.0.0.1:0", tmp_path / "state", pki.controller)
        address = await server.start()
        agents = [Agent(agent_settings(tmp_path, pki, address, f"h{i}")) for i in range(2)]
        tasks = [asyncio.create_task(a.run()) for a in agents]
        code = await server.run()
        for a in agents:
            a.shutdown()
        await asyncio.gather(*tasks)
        await server.stop("test over")
        return code

    assert run(main()) == 0
    kinds = [e["kind"] for e in read_journal(tmp_path / "state")]
    assert kinds.count("worker_exited") == 2 and kinds[-2:] == ["job_succeeded", "controller_stopped"]


def header(host="h0", incarnation="inc-1", generation=0, job="test") -> pb.Header:
    return pb.Header(job_id=job, host_id=host, incarnation=incarnation, generation=generation)


def register_request(**kw) -> pb.RegisterRequest:
    return pb.RegisterRequest(header=header(**kw), devices=1, address="127.0.0.1",
                              protocol=PROTOCOL,
                              worker=pb.WorkerStatus(state=pb.WORKER_IDLE, step=-1))


def test_fencing(tmp_path, pki):
    spec = load_spec(tiny_spec(tmp_path, min_hosts=2, max_hosts=2))

    async def main():
        server = ControllerServer(spec, "127.0.0.1:0", tmp_path / "state", pki.controller)
        address = await server.start()
        loop_task = asyncio.create_task(server.run())
        async with transport.aio_channel(address, pki.host("h0")) as ch, \
                transport.aio_channel(address, pki.operator, (Role.OPERATOR,)) as operator:
            stub = pb_grpc.ControllerStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as wrong_job:
                await stub.Register(register_request(job="other"), timeout=5)
            assert wrong_job.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "job 'other'" in wrong_job.value.details()

            # a stream from an incarnation that never registered is refused
            call = stub.Connect()
            await call.write(pb.AgentMessage(header=header(incarnation="ghost"),
                                             heartbeat=pb.Heartbeat()))
            with pytest.raises(grpc.aio.AioRpcError) as ghost:
                await call.read()
            assert ghost.value.code() == grpc.StatusCode.FAILED_PRECONDITION

            reply = await stub.Register(register_request(), timeout=5)
            assert reply.job_id == "test" and reply.heartbeat_timeout_s == 1.5
            old = stub.Connect()
            await old.write(pb.AgentMessage(header=header(), heartbeat=pb.Heartbeat(seq=4)))
            ack = await old.read()  # every heartbeat is answered (the agent's lease)
            assert ack.WhichOneof("body") == "ack" and ack.ack.seq == 4
            # a report about a worker of an older generation is rejected
            server.controller.state = server.controller.state.__class__(generation=7)
            await old.write(pb.AgentMessage(header=header(generation=3),
                                            progress=pb.Progress(step=5, committed_step=-1)))
            rejected = await old.read()
            assert rejected.WhichOneof("body") == "rejected"
            assert rejected.rejected.current_generation == 7
            assert "generation 3 refused" in rejected.rejected.reason
            # the same host registers again with a new incarnation: the old stream ends
            await stub.Register(register_request(incarnation="inc-2"), timeout=5)
            with pytest.raises(grpc.aio.AioRpcError) as replaced:
                while True:
                    await old.read()
            assert replaced.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "inc-2" in replaced.value.details()
            status = await pb_grpc.ControllerStub(operator).GetStatus(pb.StatusRequest(),
                                                                      timeout=5)
            assert [h.incarnation for h in status.hosts] == ["inc-2"]
        loop_task.cancel()
        await server.stop("test over")

    run(main())


def test_a_start_lost_with_a_broken_stream_comes_again_on_the_next(tmp_path, pki):
    """h1's stream breaks with the start of generation 1 unread, and the same
    agent process (same incarnation) registers again within the reconnect
    grace: its new stream gets the start (else the slice would wait out
    hang.startup_timeout_s for a worker never started)."""
    spec = load_spec(tiny_spec(tmp_path, min_hosts=2, max_hosts=2))

    async def main():
        server = ControllerServer(spec, "127.0.0.1:0", tmp_path / "state", pki.controller)
        address = await server.start()
        loop_task = asyncio.create_task(server.run())
        async with transport.aio_channel(address, pki.host("h0")) as ch0, \
                transport.aio_channel(address, pki.host("h1")) as ch1:
            streams, beats = {}, []

            async def heartbeat(host, call):  # as an agent does, every 0.25 s
                for seq in range(1, 10_000):
                    await call.write(pb.AgentMessage(header=header(host=host),
                                                     heartbeat=pb.Heartbeat(seq=seq)))
                    await asyncio.sleep(0.25)

            def registration(host):
                request = register_request(host=host)
                request.free_port = 7000 + int(host[1])  # (the coordinator's, on h0)
                return request

            for host, ch in (("h0", ch0), ("h1", ch1)):
                await pb_grpc.ControllerStub(ch).Register(registration(host), timeout=5)
                streams[host] = pb_grpc.ControllerStub(ch).Connect()
                beats.append(asyncio.create_task(heartbeat(host, streams[host])))

            async def next_start(call):
                while True:
                    message = await call.read()
                    if message.WhichOneof("body") == "start":
                        return message

            first = await asyncio.wait_for(next_start(streams["h0"]), 20)
            assert first.start.generation == 1
            beats[1].cancel()
            streams["h1"].cancel()  # its start unread: gone with the stream
            await pb_grpc.ControllerStub(ch1).Register(registration("h1"), timeout=5)
            again = pb_grpc.ControllerStub(ch1).Connect()
            beats.append(asyncio.create_task(heartbeat("h1", again)))
            start = await asyncio.wait_for(next_start(again), 10)
            assert (start.start.generation, start.start.process_id) == (1, 1)
            assert server.controller.state.generation == 1
            for task in beats:
                task.cancel()
            again.cancel()
            streams["h0"].cancel()
        loop_task.cancel()
        await server.stop("test over")

    run(main())


def test_a_stop_decided_while_a_stream_was_broken_comes_on_the_next(tmp_path, pki):
    """h1's stream breaks while generation 1 runs on h0 and h1; h2 comes, and
    the stop to grow is decided while h1 has no stream. The same agent
    process (same incarnation) registers again within the reconnect grace:
    its new stream gets the stop at once, and its acknowledgement ends the
    stop. Before, only the last command sent (the start, no longer due) was
    sent again, and the stop waited out stop_timeout_s (3 s here) to drop h1
    (an audit of the controller found it)."""
    spec = load_spec(tiny_spec(tmp_path, min_hosts=2, max_hosts=3, extra=(
        'reconnect_grace_s = 5.0\n[restart]\ngrow = "immediately"')))
    running = {h: pb.WorkerStatus(state=pb.WORKER_IDLE, step=-1) for h in ("h0", "h1", "h2")}

    async def main():
        server = ControllerServer(spec, "127.0.0.1:0", tmp_path / "state", pki.controller)
        address = await server.start()
        loop_task = asyncio.create_task(server.run())
        c = server.controller
        async with transport.aio_channel(address, pki.host("h0")) as ch0, \
                transport.aio_channel(address, pki.host("h1")) as ch1, \
                transport.aio_channel(address, pki.host("h2")) as ch2:
            streams, beats = {}, []

            async def heartbeat(host, call):
                for seq in range(1, 10_000):
                    await call.write(pb.AgentMessage(header=header(host=host), heartbeat=(
                        pb.Heartbeat(seq=seq, worker=running[host]))))
                    await asyncio.sleep(0.25)

            async def connect(host, ch):
                request = register_request(host=host)
                request.free_port = 7000 + int(host[1])
                request.worker.CopyFrom(running[host])
                await pb_grpc.ControllerStub(ch).Register(request, timeout=5)
                streams[host] = pb_grpc.ControllerStub(ch).Connect()
                beats.append(asyncio.create_task(heartbeat(host, streams[host])))

            async def next_command(call, body):
                while True:
                    message = await call.read()
                    if message.WhichOneof("body") == body:
                        return message

            for host, ch in (("h0", ch0), ("h1", ch1)):
                await connect(host, ch)
            for host in ("h0", "h1"):
                await asyncio.wait_for(next_command(streams[host], "start"), 20)
                running[host] = pb.WorkerStatus(state=pb.WORKER_RUNNING, generation=1,
                                                pid=100 + int(host[1]), step=-1,
                                                committed_step=-1)
            beats[1].cancel()
            streams["h1"].cancel()
            while "h1" in c.executor.sessions:  # (its stream's end read)
                await asyncio.sleep(0.01)
            await connect("h2", ch2)
            await asyncio.wait_for(next_command(streams["h0"], "stop"), 10)
            assert c.state.phase.name == "STOPPING" and "h1" not in c.executor.sessions
            await connect("h1", ch1)
            stop = await asyncio.wait_for(next_command(streams["h1"], "stop"), 10)
            assert stop.stop.generation == 1
            for host in ("h0", "h1"):  # both stop their workers, as agents do
                running[host] = pb.WorkerStatus(
                    state=pb.WORKER_EXITED, generation=1, pid=100 + int(host[1]), signal=15,
                    stopped_on_request=True, step=-1, committed_step=-1)
            while not (ended := [e for e in read_journal(tmp_path / "state")
                                 if e["kind"] == "slice_stopped"]):
                await asyncio.sleep(0.05)
            # acknowledged in time: not dropped at stop_timeout_s, as it was
            # when the stop reached h1 only as a stray's, after the slice stopped
            assert ended[0]["dropped"] == [], ended
            for task in beats:
                task.cancel()
            for call in streams.values():
                call.cancel()
        loop_task.cancel()
        await server.stop("test over")

    run(main())


@pytest.mark.parametrize("body,phase,members,lost,due", [
    ("start", "starting", ("h0", "h1"), (), True),
    ("start", "running", ("h0", "h1"), (), True),
    ("start", "waiting", ("h0", "h1"), (), False),    # the generation stopped since
    ("start", "starting", ("h0",), (), False),        # h1 is no member now
    ("start", "running", ("h0", "h1"), ("h1",), False),  # h1 was lost meanwhile
    ("stop", "stopping", ("h0", "h1"), ("h1",), True),
    ("stop", "waiting", ("h0", "h1"), (), False),
])
def test_only_a_command_that_still_stands_is_sent_again(body, phase, members, lost, due):
    from elastic.controller.servicer import _still_due
    from elastic.policy.state import Phase, SliceState

    state = SliceState(phase=Phase(phase), generation=1, members=members,
                       lost=frozenset(lost))
    command = pb.ControllerMessage(job_id="test", generation=1, **{
        body: pb.StartWorker(generation=1) if body == "start" else pb.StopWorker(generation=1)})
    assert _still_due(command, state, "h1") is due
    assert _still_due(pb.ControllerMessage(job_id="test", generation=0, start=pb.StartWorker()),
                      state, "h1") is False  # of another generation


def test_a_status_call_does_not_wait_behind_streams_grpc_has_not_handed_over(tmp_path, pki):
    """Each of the controller's methods has its own queue in gRPC: with the
    controller's loop slow (10 ms a turn) and 15 streams waiting to be
    handed over (about 50 ms each), an operator's status call is answered
    before most of them; with one queue for all it came after every one (at
    10,000 agents a status call waited 123 s)."""
    spec = load_spec(tiny_spec(tmp_path, min_hosts=2, max_hosts=2))
    streams, ended = 15, []  # (an agent connection takes 16 at once: transport)

    def client(address, answered):  # in a thread with a loop of its own, not slowed
        async def streams_then_status():
            async with transport.aio_channel(address, pki.host("h0"), (Role.HOST,)) as host, \
                    transport.aio_channel(address, pki.operator, (Role.OPERATOR,)) as operator:
                await operator.channel_ready()
                calls = [pb_grpc.ControllerStub(host).Connect(timeout=30) for _ in range(streams)]
                for call in calls:
                    call.add_done_callback(ended.append)
                first = pb.AgentMessage(header=header(incarnation="ghost"),
                                        heartbeat=pb.Heartbeat())
                await asyncio.gather(*(call.write(first) for call in calls))
                await pb_grpc.ControllerStub(operator).GetStatus(pb.StatusRequest(), timeout=30)
                answered.append(len(ended))
                await asyncio.gather(*(call.code() for call in calls))

        asyncio.run(streams_then_status())

    async def main():
        server = ControllerServer(spec, "127.0.0.1:0", tmp_path / "state", pki.controller)
        address = await server.start()
        answered: list[int] = []
        thread = threading.Thread(target=client, args=(address, answered))
        thread.start()
        while thread.is_alive():
            time.sleep(0.01)  # a turn of the controller's loop takes 10 ms
            await asyncio.sleep(0)
        await server.stop("test over")
        return answered

    answered = run(main())
    assert len(ended) == streams and answered, (len(ended), answered)
    assert answered[0] < streams // 2, f"{answered[0]} of {streams} streams went first"


def test_a_controller_behind_defers_registrations_with_a_hint(tmp_path, pki):
    """Admission control: while the controller's loop runs over a second
    late, a registration is refused with RESOURCE_EXHAUSTED and a retry-after
    hint that the retry layer honours; once it has caught up it is admitted."""
    spec = load_spec(tiny_spec(tmp_path, min_hosts=2, max_hosts=2))

    async def main():
        server = ControllerServer(spec, "127.0.0.1:0", tmp_path / "state", pki.controller)
        address = await server.start()
        loop_task = asyncio.create_task(server.run())
        controller = server.controller
        async with transport.aio_channel(address, pki.host("h0")) as ch:
            stub = pb_grpc.ControllerStub(ch)
            await asyncio.sleep(0)
            time.sleep(1.3)  # the controller's loop (this one) is blocked: it falls behind
            while controller.behind_s() < 1.0:
                await asyncio.sleep(0.01)
            with pytest.raises(grpc.aio.AioRpcError) as deferred:
                await stub.Register(register_request(), timeout=5)
            assert deferred.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "behind" in deferred.value.details()
            hint_s = transport.retry_after_s(deferred.value)
            assert 1.0 <= hint_s <= 30.0
            assert transport.is_transient(deferred.value)
            assert controller.registrations_deferred == 1
            began = time.monotonic()
            async for attempt in transport.retrying(give_up_after_s=40):
                with attempt:
                    reply = await stub.Register(register_request(), timeout=5)
            assert reply.job_id == "test" and controller.view.get("h0") is not None
            # its first try comes at once, still within the lag's second: refused
            # again, it waits out that hint (at least 1 s) and is admitted
            assert controller.registrations_deferred in (1, 2)
            if controller.registrations_deferred == 2:
                assert time.monotonic() - began >= 1.0
        loop_task.cancel()
        await server.stop("test over")

    run(main())


def test_an_agent_whose_worker_runs_is_admitted_however_far_behind(tmp_path, pki):
    """Admission control never defers an agent that reports a running
    worker: a wait could outlast the controller lease and fence a worker a
    restarted controller is about to adopt. An idle one is deferred."""
    spec = load_spec(tiny_spec(tmp_path, min_hosts=2, max_hosts=2))

    async def main():
        server = ControllerServer(spec, "127.0.0.1:0", tmp_path / "state", pki.controller)
        server.controller.behind_s = lambda: 5.0  # far behind, for the whole test
        address = await server.start()
        async with transport.aio_channel(address, pki.host("h0")) as ch0, \
                transport.aio_channel(address, pki.host("h1")) as ch1:
            with pytest.raises(grpc.aio.AioRpcError) as deferred:
                await pb_grpc.ControllerStub(ch0).Register(register_request(), timeout=5)
            assert deferred.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "5.0 s behind" in deferred.value.details()
            running = register_request(host="h1")
            running.worker.CopyFrom(pb.WorkerStatus(state=pb.WORKER_RUNNING, generation=3,
                                                    pid=7, step=40))
            reply = await pb_grpc.ControllerStub(ch1).Register(running, timeout=5)
            assert reply.job_id == "test" and server.controller.view.get("h1") is not None
            assert server.controller.registrations_deferred == 1
        await server.stop("test over")

    run(main())


def test_agent_retries_until_controller_appears(tmp_path, tagged, pki):
    """The agent is a systemd unit: it dials with backoff until a controller listens."""
    spec = load_spec(tiny_spec(tmp_path, "--steps 5 --step-time-s 0.01", max_hosts=1))
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def main():
        agent = Agent(agent_settings(tmp_path, pki, f"127.0.0.1:{port}", "h0"))
        task = asyncio.create_task(agent.run())
        await asyncio.sleep(1.0)  # the agent is retrying against a closed port
        server = ControllerServer(spec, f"127.0.0.1:{port}", tmp_path / "state", pki.controller)
        await server.start()
        code = await server.run()
        agent.shutdown()
        await task
        await server.stop("test over")
        return code

    assert run(main()) == 0


def test_a_controller_ending_the_job_first_reads_what_agents_queued(tmp_path, pki):
    """A controller that ends the job (here: it came back after the workers
    had finished) reads on until each open session has delivered what its
    agent queued while no controller listened (sent first, then a
    heartbeat, elastic.agent.session): the restore and the startup phases
    reach the journal. A session that never delivers is given up on after
    the limit."""
    import dataclasses

    from elastic.policy.state import Phase

    spec = load_spec(tiny_spec(tmp_path, min_hosts=2, max_hosts=2))

    async def main():
        server = ControllerServer(spec, "127.0.0.1:0", tmp_path / "state", pki.controller)
        address = await server.start()
        controller = server.controller
        async with transport.aio_channel(address, pki.host("h0")) as ch0, \
                transport.aio_channel(address, pki.host("h1")) as ch1:
            streams = {}
            for host, ch in (("h0", ch0), ("h1", ch1)):
                stub = pb_grpc.ControllerStub(ch)
                await stub.Register(register_request(host=host), timeout=5)
                streams[host] = stub.Connect()
                # what it queued: a restore, not yet followed by a heartbeat
                await streams[host].write(pb.AgentMessage(
                    header=header(host=host), worker_event=pb.WorkerEvent(
                        kind="checkpoint_restored", reason=f"{host} restored step 20",
                        fields_json='{"step": 20}')))
            assert await controller.hear_out(0.2) == ["h0", "h1"]
            await streams["h0"].write(pb.AgentMessage(header=header(host="h0", generation=0),
                                                      heartbeat=pb.Heartbeat(seq=1)))
            assert (await streams["h0"].read()).WhichOneof("body") == "ack"
            assert controller.unheard() == ["h1"]

            controller.state = dataclasses.replace(controller.state, phase=Phase.SUCCEEDED,
                                                   exit_code=0)
            run_task = asyncio.create_task(server.run())
            done, _ = await asyncio.wait([run_task], timeout=0.5)
            assert not done, "the job ended without h1's queued report"
            await streams["h1"].write(pb.AgentMessage(header=header(host="h1"),
                                                      heartbeat=pb.Heartbeat(seq=1)))
            assert await asyncio.wait_for(run_task, 5) == 0
            assert controller.unheard() == []
            began = time.monotonic()
            assert await controller.hear_out(0.3) == []
            assert time.monotonic() - began < 0.3
        await server.stop("test over")

    run(main())
    restored = [e for e in read_journal(tmp_path / "state") if e["kind"] == "checkpoint_restored"]
    assert sorted(e["host"] for e in restored) == ["h0", "h1"], restored


def test_registrations_wait_while_their_streams_wait_to_be_taken_up(tmp_path, pki,
                                                                   monkeypatch):
    """Admission control on the streams: past the registrations admitted
    freely (2 here), one more is refused with RESOURCE_EXHAUSTED and a
    retry-after hint (its turn: none was taken up yet, so in 1 s) while the
    admitted ones' streams have not been taken up; once they are, it is
    admitted. One whose worker runs is never deferred."""
    from elastic.controller import admission as adm

    monkeypatch.setattr(adm, "STREAMS_AWAITED_FREELY", 2)
    spec = load_spec(tiny_spec(tmp_path, min_hosts=4, max_hosts=4))

    async def main():
        server = ControllerServer(spec, "127.0.0.1:0", tmp_path / "state", pki.controller)
        server.controller.behind_s = lambda: 0.0  # (a busy machine must not defer for lag)
        address = await server.start()
        loop_task = asyncio.create_task(server.run())
        hosts = ("h0", "h1", "h2", "h3")
        channels = [transport.aio_channel(address, pki.host(h)) for h in hosts]
        stubs = [pb_grpc.ControllerStub(ch) for ch in channels]
        for host, stub in zip(hosts[:3], stubs):
            await stub.Register(register_request(host=host), timeout=5)
        with pytest.raises(grpc.aio.AioRpcError) as deferred:
            await stubs[3].Register(register_request(host="h3"), timeout=5)
        assert deferred.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "the streams of 3 registrations wait to be taken up" in deferred.value.details()
        assert 1.0 <= transport.retry_after_s(deferred.value) <= 1.1  # (its turn, + jitter)
        assert server.controller.registrations_deferred == 1
        # an agent that registers again gave up on its earlier stream: that
        # one no longer counts, so it is admitted (and counts once)
        await stubs[2].Register(register_request(host="h2"), timeout=5)
        assert server.servicer.intake.awaiting(server.controller.clock.monotonic()) == 3
        # an agent whose worker runs is admitted all the same (a wait could
        # outlast the controller lease and fence its worker)
        running = register_request(host="h4")
        running.worker.CopyFrom(pb.WorkerStatus(state=pb.WORKER_RUNNING, generation=1, pid=9,
                                                step=5))
        async with transport.aio_channel(address, pki.host("h4")) as ch4:
            await pb_grpc.ControllerStub(ch4).Register(running, timeout=5)
        assert server.controller.view.get("h4") is not None
        streams = []
        for host, stub in zip(hosts[:3], stubs):
            call = stub.Connect()
            await call.write(pb.AgentMessage(header=header(host=host),
                                             heartbeat=pb.Heartbeat(seq=1)))
            assert (await call.read()).WhichOneof("body") == "ack"  # taken up
            streams.append(call)
        reply = await stubs[3].Register(register_request(host="h3"), timeout=5)
        assert reply.job_id == "test" and server.controller.view.get("h3") is not None
        for call in streams:
            call.cancel()
        for ch in channels:
            await ch.close()
        loop_task.cancel()
        await server.stop("test over")

    run(main())


def test_a_stream_taken_up_late_is_logged_with_where_its_time_went(tmp_path, pki, caplog):
    """A stream taken up more than STREAM_LATE_S after its registration is
    logged, split into the wait before gRPC handed the call over and the
    wait for its first message (at 10,000 agents some streams waited over a
    minute, and which of the two it was could not be told); another within
    LATE_STREAM_LOG_INTERVAL_S is left out (LateStreamLog's test has the
    line that counts it)."""
    from elastic.clock import FakeClock
    from elastic.controller.servicer import STREAM_LATE_S

    spec = load_spec(tiny_spec(tmp_path, min_hosts=3, max_hosts=3))
    clock = FakeClock()

    async def main():
        server = ControllerServer(spec, "127.0.0.1:0", tmp_path / "state", pki.controller,
                                  clock=clock)
        address = await server.start()
        async with transport.aio_channel(address, pki.host("h0")) as ch0, \
                transport.aio_channel(address, pki.host("h1")) as ch1, \
                transport.aio_channel(address, pki.host("h2")) as ch2:
            stubs = {"h0": pb_grpc.ControllerStub(ch0), "h1": pb_grpc.ControllerStub(ch1),
                     "h2": pb_grpc.ControllerStub(ch2)}

            async def connect(host):
                call = stubs[host].Connect()
                await call.write(pb.AgentMessage(header=header(host=host),
                                                 heartbeat=pb.Heartbeat(seq=1)))
                assert (await call.read()).WhichOneof("body") == "ack"  # taken up
                call.cancel()

            await stubs["h0"].Register(register_request(host="h0"), timeout=5)
            clock.advance(1.0)
            await connect("h0")  # in time
            for host in ("h1", "h2"):
                await stubs[host].Register(register_request(host=host), timeout=5)
            clock.advance(STREAM_LATE_S + 2.5)
            await connect("h1")  # late
            await connect("h2")  # late too, in the same interval: left out
        await server.stop("test over")

    with caplog.at_level("WARNING", logger="elasticd"):
        run(main())
    late = [r.getMessage() for r in caplog.records if "was taken up" in r.getMessage()]
    assert late == [f"the stream of host h1 was taken up {STREAM_LATE_S + 2.5:.1f} s after it "
                    f"registered: gRPC handed the call over after {STREAM_LATE_S + 2.5:.1f} s, "
                    f"its first message was read 0.0 s later"], late
