"""Starts and stops as sealed datagrams, their stream copies held back:
the session's choice, which copies stay due (a table), the executor on a
real event loop, and a real controller and agents over gRPC and UDP on
loopback with a command datagram lost on the way."""

from __future__ import annotations

import asyncio
import logging
import signal

import pytest

from elastic import heartbeat_datagram as hd
from elastic.config import load_spec
from elastic.controller.executor import Executor, Session
from elastic.controller.journal import JournalWriter
from elastic.policy import decide as d
from elastic.policy.view import ClusterView, HostRecord, WorkerObs, WorkerState, command_taken
from elastic.v1 import control_pb2 as pb
from tests.conftest import signal_process, tiny_spec
from tests.test_heartbeat_datagrams import _two_agents, _until
from tests.test_grpc import run

RUNNING, EXITED, IDLE = WorkerState.RUNNING, WorkerState.EXITED, WorkerState.IDLE


def _datagram_session(host: str = "h0", heard_at: float = 100.0):
    """A session whose host's latest heartbeat datagram was taken at
    `heard_at` (controller-monotonic); returns it, the datagrams it sent
    and the agent's end of its channel."""
    key, sent = hd.new_key(), []
    session = Session(host, "inc")
    session.datagrams = hd.DatagramChannel(key, host, hd.TO_AGENT)
    session.datagram_reply, session.datagram_heard_at = sent.append, heard_at
    return session, sent, hd.DatagramChannel(key, host, hd.TO_CONTROLLER)


def test_a_command_goes_as_a_datagram_with_its_stream_copy_held_back():
    session, sent, agent = _datagram_session()
    stop = pb.ControllerMessage(stop=pb.StopWorker(generation=2, reason="host h1 lost"))
    session.send(stop, datagram=True)
    assert [pb.ControllerMessage.FromString(agent.open(d)) for d in sent] == [stop]
    assert session.copy_due is stop and session.outbox.empty()
    ack = pb.ControllerMessage(ack=pb.HeartbeatAck(seq=3))
    session.send(ack)  # not a command: the copy stays due
    assert session.copy_due is stop and session.outbox.get_nowait() == ack
    start = pb.ControllerMessage(start=pb.StartWorker(generation=3, argv=["x" * 2000]))
    session.send(start, datagram=True)  # too long for a datagram: the stream, at once
    assert len(sent) == 1 and session.outbox.get_nowait() == start
    assert session.copy_due is None  # a later command supersedes the held copy
    session.send(stop)  # without `datagram`: the stream only
    assert len(sent) == 1 and session.outbox.get_nowait() == stop


def test_with_nowhere_to_answer_a_command_goes_on_the_stream():
    session, sent, _ = _datagram_session()
    session.datagram_reply = None  # no datagram came from it yet
    stop = pb.ControllerMessage(stop=pb.StopWorker(generation=2))
    session.send(stop, datagram=True)
    assert sent == [] and session.copy_due is None and session.outbox.get_nowait() == stop


@pytest.mark.parametrize("command, generation, state, reported, taken", [
    ("start", 5, RUNNING, 5, True),    # it runs the generation it was told to start
    ("start", 5, EXITED, 5, True),     # and it has ended already (crashed at once)
    ("start", 5, RUNNING, 6, True),    # a later one: long past it
    ("start", 5, EXITED, 4, False),    # still the previous generation's exit
    ("start", 5, IDLE, 0, False),      # never started anything
    ("stop", 5, RUNNING, 5, False),    # still running it
    ("stop", 5, RUNNING, 4, False),    # an older one still running is stopped too
    ("stop", 5, EXITED, 5, True),      # stopped
    ("stop", 5, IDLE, 0, True),        # nothing to stop
    ("stop", 5, RUNNING, 6, True),     # runs a newer generation: not this stop's
])
def test_command_taken(command, generation, state, reported, taken):
    assert command_taken(WorkerObs(generation=reported, state=state), command,
                         generation) is taken


def test_command_taken_names_what_it_cannot_judge():
    with pytest.raises(ValueError, match="'ack'"):
        command_taken(WorkerObs(), "ack", 1)


def test_the_executor_queues_only_the_stream_copies_still_due(tmp_path):
    """On a real event loop, a heartbeat interval (0.25 s) after the
    starts: h0 acted on its start (skipped), h1 did not (its copy is
    queued), h2's and h5's datagrams were not heard lately (never; 10 s
    ago: their starts went on the stream at once, and h5's, whose address
    is known, as a datagram too), h3
    was stopped meanwhile (the stop superseded the start's copy; the stop's
    own copy is skipped in turn, as h3 runs nothing), h4's agent restarted
    (a new incarnation: the copy is dropped), h6's registered again (the
    same incarnation: the copy goes on its new session).""" 
    spec = load_spec(tiny_spec(tmp_path))
    view = ClusterView()

    async def main():
        executor = Executor(spec, JournalWriter(tmp_path / "state"), _Clock(), view=view)
        heard = {"h2": float("-inf"), "h5": 90.0}  # the clock reads 100
        hosts = ("h0", "h1", "h2", "h3", "h4", "h5", "h6")
        datagrams = {}
        for host in hosts:
            executor.sessions[host], datagrams[host], _ = _datagram_session(
                host, heard.get(host, 99.5))
            view.hosts[host] = HostRecord(host, "inc", 1, "127.0.0.1", host, 1, 0.0, 0.0)
        executor.sessions["h2"].datagram_reply = None  # (never heard: nowhere to send)
        executor.apply(tuple(d.StartWorker(h, 7, i, 7, "127.0.0.1:1", 1)
                             for i, h in enumerate(hosts)))
        sessions = dict(executor.sessions)
        assert [sessions[h].outbox.get_nowait().start.process_id for h in ("h2", "h5")] == [2, 5]
        assert [len(datagrams[h]) for h in hosts] == [1, 1, 0, 1, 1, 1, 1]
        assert all(s.outbox.empty() for s in sessions.values())
        view.hosts["h0"].worker = WorkerObs(generation=7, state=RUNNING)  # its report came
        executor.apply((d.StopWorker("h3", 7, 1.0, "stopped before it began"),))
        executor.sessions["h4"] = Session("h4", "inc2")
        executor.sessions["h6"] = again = Session("h6", "inc")
        copy = await asyncio.wait_for(sessions["h1"].outbox.get(), 5)
        await _until(lambda: executor.copies_sent + executor.copies_skipped == 5)
        return copy, executor, sessions, again

    copy, executor, sessions, again = run(main())
    assert copy.start.generation == 7 and copy.start.process_id == 1 and copy.term == 0
    assert again.outbox.get_nowait().start.process_id == 6
    # sent: h1's and h6's starts; skipped: h0's and h4's, and h3's stop (it
    # never ran generation 7: nothing to stop)
    assert (executor.copies_sent, executor.copies_skipped) == (2, 3)
    assert all(sessions[h].outbox.empty() and sessions[h].copy_due is None
               for h in ("h0", "h2", "h3", "h4", "h5", "h6"))


def test_no_stream_copy_goes_while_the_controller_may_not_act(tmp_path):
    """Its leadership may have passed (its bucket lease is stale): like
    its decisions, the held copies wait for nothing and are dropped."""
    spec = load_spec(tiny_spec(tmp_path))

    async def main():
        executor = Executor(spec, JournalWriter(tmp_path / "state"), _Clock(),
                            view=ClusterView())
        executor.sessions["h0"], _, _ = _datagram_session("h0", 99.5)
        executor.may_act = lambda: False
        executor.apply((d.StopWorker("h0", 3, 0.0, "x"),))
        await _until(lambda: executor.copies_skipped == 1)
        return executor

    executor = run(main())
    assert executor.copies_sent == 0 and executor.sessions["h0"].outbox.empty()


class _Clock:
    def time(self) -> float:
        return 1.0e9

    def monotonic(self) -> float:
        return 100.0


def test_a_restart_goes_by_datagram_and_a_lost_command_datagram_by_the_stream(
        tmp_path, tagged, pki, caplog):
    """A real controller and two agents: h1's worker is killed, and the
    stop and the next generation's start reach h1 as datagrams while h0's
    command datagrams are lost on the way (dropped as they arrive): h0 gets
    both from its stream a heartbeat interval later, and the slice runs
    generation 2. A start of generation 2 that comes again (its other copy)
    is not acted on: the worker is not restarted."""
    async def during(server, agents):
        h0, h1 = agents
        # (h1's worker launched: the phase runs as soon as the starts are
        # sent, and a pid of 0 would have killed this test's process group)
        await _until(lambda: server.controller.state.phase.value == "running"
                     and all(a._datagrams is not None and a._datagrams.acks >= 1 for a in agents)
                     and h1.supervisor.running and h1.supervisor.status.pid > 0)
        real, dropped = h0._datagrams.inbox, []

        came = []  # what reached h1 as datagrams

        class Lossy:  # the network drops h0's command datagrams
            def put_nowait(self, message) -> None:
                if message.WhichOneof("body") in ("start", "stop"):
                    dropped.append(message.WhichOneof("body"))
                else:
                    real.put_nowait(message)

        class Seen:
            def __init__(self, inbox) -> None:
                self.inbox = inbox

            def put_nowait(self, message) -> None:
                came.append(message.WhichOneof("body"))
                self.inbox.put_nowait(message)

        h0._datagrams.inbox = Lossy()
        h1._datagrams.inbox = Seen(h1._datagrams.inbox)
        signal_process(h1.supervisor.status.pid, signal.SIGKILL)
        c = server.controller
        await _until(lambda: c.state.generation == 2 and c.state.phase.value == "running"
                     and all(a.supervisor.status.generation == 2 and a.supervisor.running
                             for a in agents))
        executor, pid = c.executor, h1.supervisor.status.pid
        again = pb.ControllerMessage(job_id="test", generation=2, term=executor.term,
                                     start=pb.StartWorker(generation=2, process_id=1,
                                                          num_processes=2,
                                                          coordinator_address="127.0.0.1:1",
                                                          argv=["true"]))
        with caplog.at_level(logging.DEBUG, logger="elastic-agent"):
            executor.sessions["h1"].queue(again)
            await _until(lambda: any("start of generation 2 (term" in r.getMessage()
                                     for r in caplog.records))
        return dropped, came, executor.copies_sent, pid, \
            (h1.supervisor.status.pid, h1.supervisor.running)

    (dropped, came, sent, pid, after), kinds = _two_agents(tmp_path, pki, "", during)
    # h0's stop came as a datagram first (it heartbeat by datagram until then),
    # was lost, and reached it by its stream copy; the next start went as a
    # datagram to h0 or h1 at least (a host whose last datagram is over three
    # intervals old, as on a loaded machine, gets it on its stream)
    assert "stop" in dropped and sent >= 1, (dropped, sent)
    assert "start" in dropped + came, (dropped, came)
    assert after == (pid, True)  # generation 2's worker was not restarted
    assert kinds.count("generation_started") == 2 and "host_lost" not in kinds


def _commanded(tmp_path, pki, commands):
    """Feed (kind, term, generation) commands to a real agent's command
    handler (not run: what it would set going is recorded instead); returns
    "start"/"stop" for each command it acted on, "-" for each it ignored."""
    from elastic.agent.agent import Agent
    from tests.test_grpc import agent_settings

    agent = Agent(agent_settings(tmp_path, pki, "127.0.0.1:1", "h0"))
    acted: list[str] = []

    def spawn(coro) -> None:
        acted.append(coro.__name__)
        coro.close()

    agent._spawn = spawn
    out = []
    for kind, term, generation in commands:
        body = {"start": pb.StartWorker(generation=generation, process_id=0, num_processes=1,
                                        coordinator_address="127.0.0.1:1", argv=["true"]),
                "stop": pb.StopWorker(generation=generation, grace_s=1.0)}[kind]
        before = len(acted)
        agent._command(pb.ControllerMessage(job_id="test", generation=generation, term=term,
                                            **{kind: body}))
        out.append(kind if len(acted) > before else "-")
    return out


@pytest.mark.parametrize("commands, acted", [
    # a start's second copy (datagram and stream) is not a second start
    ([("start", 1, 2), ("start", 1, 2)], ["start", "-"]),
    # a stop that overtook its generation's start: the start is not acted on
    ([("stop", 1, 2), ("start", 1, 2)], ["stop", "-"]),
    # the next generation starts; an older one's late copy does not
    ([("start", 1, 2), ("start", 1, 3), ("start", 1, 2)], ["start", "start", "-"]),
    # a new leader (a higher term) may start a generation number again
    ([("start", 1, 2), ("start", 2, 2)], ["start", "start"]),
])
def test_the_agent_takes_each_start_once_and_none_its_stop_overtook(tmp_path, pki, commands,
                                                                     acted):
    assert _commanded(tmp_path, pki, commands) == acted
