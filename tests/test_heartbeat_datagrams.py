"""Heartbeats as sealed UDP datagrams: the format, and a real controller and
real agents in one process over gRPC and UDP on loopback."""

from __future__ import annotations

import asyncio
import random
import socket

import pytest

from elastic import heartbeat_datagram as hd
from elastic.agent.agent import Agent
from elastic.config import load_spec
from elastic.controller.journal import read_journal
from elastic.controller.server import ControllerServer
from elastic.controller.status import job_status
from elastic.v1 import control_pb2 as pb
from tests.conftest import tiny_spec
from tests.test_grpc import agent_settings, run


def pair(host: str = "host-1"):
    key = hd.new_key()
    return (hd.DatagramChannel(key, host, hd.TO_CONTROLLER),
            hd.DatagramChannel(key, host, hd.TO_AGENT))


def test_a_datagram_opens_once_only_for_its_host_direction_and_key():
    agent, controller = pair()
    first, second = agent.seal(b"beat 1"), agent.seal(b"beat 2")
    assert hd.host_of(first) == "host-1"
    assert controller.open(second) == b"beat 2"
    with pytest.raises(hd.DatagramError, match="not newer"):
        controller.open(first)  # overtaken by a newer one
    with pytest.raises(hd.DatagramError, match="not newer"):
        controller.open(second)  # replayed
    with pytest.raises(hd.DatagramError, match="other way"):
        agent.open(agent.seal(b"x"))  # a datagram sent back at its sender
    stranger = hd.DatagramChannel(hd.new_key(), "host-1", hd.TO_AGENT)
    with pytest.raises(hd.DatagramError, match="does not open"):
        stranger.open(agent.seal(b"x"))
    other_host, _ = pair("host-2")
    with pytest.raises(hd.DatagramError, match="not for host"):
        controller.open(other_host.seal(b"x"))
    assert agent.open(controller.seal(b"ack")) == b"ack"  # and back


def test_every_altered_byte_is_refused():
    agent, _ = pair()
    datagram = agent.seal(b"heartbeat payload")
    for i in range(len(datagram)):
        altered = bytearray(datagram)
        altered[i] ^= 0x01
        controller = hd.DatagramChannel(agent.key, "host-1", hd.TO_AGENT)
        with pytest.raises(hd.DatagramError):
            controller.open(bytes(altered))


def test_garbage_is_refused_without_raising_anything_else():
    _, controller = pair()
    rng = random.Random(7)
    samples = [b"", b"EHB1", b"EHB1\x01\x06host-1", b"x" * 5000,
               hd.MAGIC + b"\x01\xff" + bytes(40)] + \
        [bytes(rng.randrange(256) for _ in range(rng.randrange(80))) for _ in range(300)] + \
        [hd.MAGIC + bytes(rng.randrange(256) for _ in range(rng.randrange(80)))
         for _ in range(300)]
    for data in samples:
        with pytest.raises(hd.DatagramError):
            controller.open(data)


def test_oversized_payloads_and_bad_keys_or_host_ids_are_errors():
    agent, _ = pair()
    with pytest.raises(ValueError, match="longer than"):
        agent.seal(bytes(hd.MAX_DATAGRAM))
    with pytest.raises(ValueError, match="16 bytes"):
        hd.DatagramChannel(b"short", "host-1", hd.TO_AGENT)
    with pytest.raises(ValueError, match="255 bytes"):
        hd.DatagramChannel(hd.new_key(), "h" * 256, hd.TO_AGENT)


@pytest.mark.parametrize("interval_s, timeout_s, patience_s", [
    (1.0, 5.0, 2.5),     # capped: 2 intervals of silence more stay 0.5 s inside the timeout
    (0.25, 1.5, 0.875),  # the tests' timings: an ack interval and two heartbeats
    (1.0, 10.0, 4.5),    # a long timeout: an ack interval (2.5 s) and two heartbeats
    (1.0, 4.0, None),    # no safe value: longer than a healthy path's wait, too long to
    (1.0, 2.0, None),    # leave the stream time -> the stream only
])
def test_patience_leaves_the_stream_time_before_the_timeout(interval_s, timeout_s, patience_s):
    got = hd.patience_s(interval_s, timeout_s)
    assert got == pytest.approx(patience_s)
    if got is not None:
        assert got > hd.ACK_EVERY * timeout_s + interval_s  # a healthy path never gives up
        assert got + 2 * interval_s <= timeout_s - interval_s / 2  # the stream in time


# --- end to end ---------------------------------------------------------------------------

def _two_agents(tmp_path, pki, spec_extra: str, during):
    """A controller and two agents (an idle job: the tiny worker, long), run
    until `during(server, agents)` returns; returns its result and the
    journal's kinds."""
    spec = load_spec(tiny_spec(tmp_path, "--steps 100000 --step-time-s 0.02", extra=spec_extra,
                               max_hosts=2))

    async def main():
        server = ControllerServer(spec, "127.0.0.1:0", tmp_path / "state", pki.controller)
        address = await server.start()
        agents = [Agent(agent_settings(tmp_path, pki, address, f"h{i}")) for i in range(2)]
        tasks = [asyncio.create_task(a.run()) for a in agents]
        controller = asyncio.create_task(server.run())
        try:
            return await during(server, agents)
        finally:  # the controller first: it would start the next generation
            controller.cancel()
            await server.stop("test over")
            for a in agents:
                a.shutdown()
            await asyncio.gather(*tasks)

    result = run(main())
    return result, [e["kind"] for e in read_journal(tmp_path / "state")]


async def _until(predicate, timeout_s: float = 20.0) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not reached")


def _paths(server) -> dict[str, str]:
    return {h.host_id: h.heartbeat_path for h in job_status(server.controller).hosts}


def test_steady_heartbeats_go_as_datagrams_and_are_acked_that_way(tmp_path, tagged, pki):
    async def during(server, agents):
        await _until(lambda: server.controller.state.phase.value == "running"
                     and all(a._datagrams is not None and a._datagrams.acks >= 3 for a in agents))
        c = server.controller
        return _paths(server), c.datagrams_received, c.datagrams_refused

    (paths, received, refused), kinds = _two_agents(tmp_path, pki, "", during)
    assert paths == {"h0": "datagram", "h1": "datagram"}
    assert received >= 6 and refused == 0
    assert "host_lost" not in kinds


def test_without_datagrams_heartbeats_stay_on_the_stream(tmp_path, tagged, pki):
    async def during(server, agents):
        await _until(lambda: server.controller.state.phase.value == "running"
                     and _paths(server) == {"h0": "stream", "h1": "stream"}
                     and all(a._seq >= 5 for a in agents))  # periodic heartbeats too
        return _paths(server), server.controller.datagrams_received, \
            [a._datagrams for a in agents]

    (paths, received, endpoints), _ = _two_agents(tmp_path, pki,
                                                  "datagram_heartbeats = false", during)
    assert paths == {"h0": "stream", "h1": "stream"} and received == 0
    assert endpoints == [None, None]


def test_an_agent_whose_datagrams_go_unacked_heartbeats_on_its_stream(tmp_path, tagged, pki):
    """UDP blocked on the way (here: the controller's endpoint closed once
    the slice runs): the agents go back to their streams within their
    patience, before the heartbeat timeout, and no host is lost."""
    async def during(server, agents):
        await _until(lambda: server.controller.state.phase.value == "running"
                     and all(a._datagrams is not None and a._datagrams.acks >= 1 for a in agents))
        server._datagrams.close()
        await _until(lambda: all(a._datagrams.given_up for a in agents), timeout_s=10)
        await asyncio.sleep(2 * 1.5)  # two heartbeat timeouts on the streams alone
        return _paths(server), server.controller.state.phase.value

    (paths, phase), kinds = _two_agents(tmp_path, pki, "", during)
    assert paths == {"h0": "stream", "h1": "stream"} and phase == "running"
    # heard in time: neither lost nor carried as silent
    assert not {"host_lost", "agent_silent"} & set(kinds), kinds
    assert kinds.count("generation_started") == 1


def test_agents_of_a_controller_behind_wait_longer_for_datagrams_and_keep_their_sessions(
        tmp_path, tagged, pki):
    """As above, but the controller runs behind by the agents' patience (its
    measured lag, told in every ack): they wait that much longer before they
    go to their streams, longer than their limit on the controller's
    silence. That limit waits for them to go, and counts from then: no
    session ends, no host is lost."""
    async def during(server, agents):
        c = server.controller
        await _until(lambda: c.state.phase.value == "running"
                     and all(a._datagrams is not None and a._datagrams.acks >= 1 for a in agents))
        lag = agents[0]._datagrams.patience_s
        c.lag.allowance_s = lambda now: lag  # (what a loop this far behind measures)
        await _until(lambda: all(a._datagrams.controller_lag_s == lag for a in agents))
        sessions = [a.sessions_opened for a in agents]
        server._datagrams.close()
        await _until(lambda: all(a._datagrams is not None and a._datagrams.given_up
                                 for a in agents), timeout_s=10)
        await asyncio.sleep(2 * 1.5)  # two heartbeat timeouts on the streams alone
        return (_paths(server), c.state.phase.value,
                [a.sessions_opened for a in agents] == sessions)

    (paths, phase, same_sessions), kinds = _two_agents(tmp_path, pki, "", during)
    assert paths == {"h0": "stream", "h1": "stream"} and phase == "running" and same_sessions
    assert not {"host_lost", "agent_silent"} & set(kinds), kinds


def test_forged_replayed_and_overtaken_datagrams_are_dropped(tmp_path, tagged, pki):
    """Anyone can send datagrams to the port: one sealed with a key of its
    own, garbage, and an agent's datagram held back on the way until a
    newer message came on the stream (overtaken), then sent twice
    (replayed): all dropped and counted, and the host's own datagrams still
    count afterwards."""
    async def during(server, agents):
        await _until(lambda: server.controller.state.phase.value == "running"
                     and all(a._datagrams is not None and a._datagrams.acks >= 1 for a in agents))
        servicer, h0 = server.servicer, agents[0]
        h0._datagrams.patience_s = 60.0  # (held below: not a reason to go back to the stream)
        transport, held = h0._datagrams.transport, []
        send = transport.sendto
        transport.sendto = lambda data, *rest: held.append(data)  # the network holds them
        await _until(lambda: held)
        h0._heartbeat()  # on the stream: newer than the held datagram
        on_stream, session = h0._message_seq, server.controller.sessions["h0"]
        await _until(lambda: session.last_seq >= on_stream)
        c = server.controller
        before, received = c.datagrams_refused, c.datagrams_received
        forged = hd.DatagramChannel(hd.new_key(), "h0", hd.TO_CONTROLLER)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for data in (forged.seal(b"x"), b"garbage", held[0], held[0]):
                s.sendto(data, ("127.0.0.1", servicer.heartbeat_port))
        await _until(lambda: c.datagrams_refused >= before + 4)
        transport.sendto = send  # the network delivers again
        # h0's own datagrams and h1's go on being taken
        await _until(lambda: c.datagrams_received >= received + 4)
        return c.datagrams_refused - before, _paths(server)

    (refused, paths), kinds = _two_agents(tmp_path, pki, "", during)
    assert (refused, paths) == (4, {"h0": "datagram", "h1": "datagram"}), (refused, paths)
    assert "host_lost" not in kinds


def test_the_agent_goes_back_to_its_stream_only_after_its_patience():
    """The agent's side on real loopback sockets, its clock faked: datagrams
    until `patience_s` passes with none acked (a gap in its own sending, as
    when the agent was stopped, restarts the wait); an ack keeps them going;
    after REPROBE_S one heartbeat is tried as a datagram again, and its ack
    brings them back. An ack that says the controller runs behind adds its
    lag to the wait, up to the patience again."""
    from elastic.agent.datagrams import WENT_TO_STREAM, HeartbeatDatagrams

    async def main():
        key, now = hd.new_key(), [100.0]
        controller = hd.DatagramChannel(key, "h0", hd.TO_AGENT)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as server:
            server.bind(("127.0.0.1", 0))
            server.settimeout(5)
            inbox: asyncio.Queue = asyncio.Queue()
            _, agent = await asyncio.get_running_loop().create_datagram_endpoint(
                lambda: HeartbeatDatagrams(key, "h0", inbox, server.getsockname(), 3.0, 1.0,
                                           clock=lambda: now[0]),
                local_addr=("127.0.0.1", 0))
            beat = pb.AgentMessage(heartbeat=pb.Heartbeat(seq=1))

            def send_at(t: float) -> bool:
                now[0] = t
                sent = agent.send(beat)
                if sent:
                    data, sender = server.recvfrom(2048)
                    assert pb.AgentMessage.FromString(controller.open(data)) == beat
                    return sender
                return sent

            sender = send_at(100.0)
            assert send_at(101.0) and send_at(103.0)   # 3 s unacked: still patient
            ack = pb.ControllerMessage(ack=pb.HeartbeatAck(seq=1))
            server.sendto(controller.seal(ack.SerializeToString()), sender)
            assert (await asyncio.wait_for(inbox.get(), 5)) == ack and agent.acks == 1
            stop = pb.ControllerMessage(stop=pb.StopWorker(generation=3))
            server.sendto(controller.seal(stop.SerializeToString()), sender)
            assert (await asyncio.wait_for(inbox.get(), 5)) == stop and agent.acks == 1
            assert send_at(104.0) and send_at(107.0)   # acked at 103: patient again
            assert send_at(112.0)                      # held up 5 s: the wait restarts
            assert send_at(115.0) and not agent.given_up and agent.going_to_stream()
            assert send_at(115.5) is False and agent.given_up  # 3.5 s unacked
            # (the session's limit on the controller's silence counts from here)
            assert inbox.get_nowait() is WENT_TO_STREAM and not agent.going_to_stream()
            assert send_at(116.0) is False and not agent.probe_due()
            now[0] = 145.5                             # REPROBE_S later: one goes both ways
            assert agent.probe_due()
            agent.probe(beat)
            data, sender = server.recvfrom(2048)
            assert pb.AgentMessage.FromString(controller.open(data)) == beat
            assert not agent.probe_due()               # the next try in another REPROBE_S
            server.sendto(controller.seal(ack.SerializeToString()), sender)
            assert (await asyncio.wait_for(inbox.get(), 5)) == ack
            assert not agent.given_up and send_at(146.0)  # acked: datagrams again
            # a controller 2 s behind (its ack says): the agent waits 2 s longer
            behind = pb.ControllerMessage(ack=pb.HeartbeatAck(seq=1, controller_lag_s=2.0))
            server.sendto(controller.seal(behind.SerializeToString()), sender)
            assert (await asyncio.wait_for(inbox.get(), 5)) == behind
            assert agent.waits_s() == 5.0
            assert all(send_at(t) for t in (147.0, 149.0, 151.0, 152.0))  # 5 s unacked
            assert send_at(152.5) is False and agent.given_up
            assert inbox.get_nowait() is WENT_TO_STREAM
            far = pb.ControllerMessage(ack=pb.HeartbeatAck(seq=1, controller_lag_s=60.0))
            server.sendto(controller.seal(far.SerializeToString()), sender)
            await asyncio.wait_for(inbox.get(), 5)
            assert agent.waits_s() == 6.0  # at most twice its patience
            long = pb.AgentMessage(heartbeat=pb.Heartbeat(worker=pb.WorkerStatus(
                stderr_tail="x" * 2000)))
            assert agent.send(long) is False           # too long: on the stream
            agent.transport.close()

    asyncio.run(asyncio.wait_for(main(), 30))


# --- the controller's batches -------------------------------------------------------------

def test_a_batch_is_grouped_by_host_highest_counter_first_hosts_by_last_arrival():
    """A host's datagrams highest counter first, whatever order they came
    in (reordered on the way, or a replay arriving last); hosts in the
    order their last datagram arrived; what names no host at the end."""
    from elastic.controller.datagrams import newest_per_host

    a, b = hd.DatagramChannel(hd.new_key(), "a", hd.TO_CONTROLLER), \
        hd.DatagramChannel(hd.new_key(), "b", hd.TO_CONTROLLER)
    a1, a2, a3 = a.seal(b"1"), a.seal(b"2"), a.seal(b"3")
    b1, b2 = b.seal(b"1"), b.seal(b"2")
    arrived = (a1, b1, a3, b2, b"junk", a2, a1)  # a2 overtaken by a3, a1 replayed last
    groups = newest_per_host([(d, ("127.0.0.1", i)) for i, d in enumerate(arrived)])
    assert [[d for d, _ in g] for g in groups] == [[b2, b1], [a3, a2, a1, a1], [b"junk"]]
    assert [hd.named(d)[1] for d in (a1, a3, b2)] == [1, 3, 2]
    assert newest_per_host([]) == []


def test_the_endpoint_counts_what_the_kernel_dropped_on_its_full_socket():
    """A real socket on loopback, its buffer made small: datagrams sent
    while the loop does not read overflow it, and the next read tells
    `on_dropped` how many the kernel dropped (what it then reads is
    handed on as usual)."""
    from elastic.controller import datagrams as dg

    async def main():
        handed: list[bytes] = []
        dropped: list[int] = []
        superseded: list[int] = []
        endpoint = dg.DatagramEndpoint("127.0.0.1", 0, lambda d, r: handed.append(d) or True,
                                       superseded.append, dropped.append)
        await endpoint.open()
        if endpoint._kernel_drops() is None:
            endpoint.close()
            pytest.skip("this kernel does not count a socket's drops (SO_MEMINFO)")
        endpoint.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        port = endpoint.sock.getsockname()[1]
        channel = hd.DatagramChannel(hd.new_key(), "one", hd.TO_CONTROLLER)
        sent = [channel.seal(b"x" * 400) for _ in range(200)]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for data in sent:  # (the loop does not run meanwhile)
                s.sendto(data, ("127.0.0.1", port))
        # every datagram is accounted for: dropped by the kernel, or read (each
        # batch's newest handed on, the others superseded by it)
        await _until(lambda: sum(dropped) + len(handed) + sum(superseded) == len(sent))
        endpoint.close()
        return sent, handed, dropped, superseded

    sent, handed, dropped, superseded = run(main())
    assert dropped and 0 < sum(dropped) < len(sent) - 1
    assert handed and set(handed) <= set(sent)


def test_the_endpoint_takes_each_hosts_newest_datagram_and_tries_older_ones_if_refused():
    """A real socket on loopback: datagrams that wait in it while the loop
    is busy are read as one batch. Of one host's five, only the newest is
    handed on when it is taken (four superseded); a host whose newest is
    refused (a forgery, say) has its next older one tried. More hosts than a
    chunk are all handled, and reading goes on afterwards."""
    from elastic.controller import datagrams as dg

    async def main():
        handed: list[bytes] = []
        superseded: list[int] = []
        refuse = set()

        def on_datagram(data, reply):
            handed.append(data)
            reply(b"ack " + data[-8:])  # (which datagram it answers)
            return data not in refuse

        endpoint = dg.DatagramEndpoint("127.0.0.1", 0, on_datagram, superseded.append)
        await endpoint.open()
        port = endpoint.sock.getsockname()[1]
        channels = {h: hd.DatagramChannel(hd.new_key(), h, hd.TO_CONTROLLER)
                    for h in ("one", "two", *(f"h{i}" for i in range(dg.CHUNK_HOSTS + 10)))}
        ones = [channels["one"].seal(b"%d" % i) for i in range(5)]
        twos = [channels["two"].seal(b"%d" % i) for i in range(3)]
        refuse.add(twos[-1])
        many = [channels[f"h{i}"].seal(b"x") for i in range(dg.CHUNK_HOSTS + 10)]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.settimeout(5)
            for data in (*ones, *twos, *many):  # (the loop does not run meanwhile)
                s.sendto(data, ("127.0.0.1", port))
            await _until(lambda: len(handed) >= 1 + 2 + len(many))
            first_batch = list(handed)
            s.setblocking(False)
            try:  # the first batch's answers, in the socket already (loopback): as
                while s.recvfrom(64):  # many as its buffer kept
                    pass
            except BlockingIOError:
                pass
            s.settimeout(5)
            later = channels["one"].seal(b"later")
            s.sendto(later, ("127.0.0.1", port))
            await _until(lambda: later in handed)
            answer = s.recvfrom(64)[0]  # the answer goes back to the sender
        endpoint.close()
        endpoint.close()  # idempotent
        return first_batch, superseded, answer, later, ones, twos

    first_batch, superseded, answer, later, ones, twos = run(main())
    assert [d for d in first_batch if hd.host_of(d) == "one"] == [ones[-1]]
    # the refused newest, then the one before it, taken
    assert [d for d in first_batch if hd.host_of(d) == "two"] == [twos[-1], twos[-2]]
    assert sorted(superseded) == [1, 4]
    assert len(first_batch) == 3 + dg.CHUNK_HOSTS + 10
    assert answer == b"ack " + later[-8:]
