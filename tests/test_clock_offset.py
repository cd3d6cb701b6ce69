"""The controller's clock against an agent's (elastic.agent.clock_offset):
the estimate by table with fake clocks, and a controller whose clock runs
30 s ahead of its agents' on real gRPC: heartbeats stamped on its clock do
not read as lag; stamped on the agents' own they would."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest

from elastic.agent.agent import Agent, AgentSettings
from elastic.agent.clock_offset import WINDOW, ClockOffset
from elastic.config import load_spec
from elastic.controller.server import ControllerServer
from elastic.security.allow import AllowList
from tests.conftest import TINY_WORKER, tiny_spec, until

SKEW_S = 30.0


class Clocks:
    """An agent's wall and monotonic clocks, moved by hand."""

    def __init__(self) -> None:
        self.wall, self.mono = 1_000.0, 50.0

    def advance(self, s: float) -> None:
        self.wall += s
        self.mono += s


def exchange(c: ClockOffset, clocks: Clocks, seq: int, there_s: float, back_s: float,
             controller_ahead_s: float) -> float:
    """Heartbeat `seq` takes `there_s` to be read, its ack `back_s` to come
    back; returns the send time it was stamped with."""
    stamped = c.stamp(seq)
    clocks.advance(there_s)
    read_at = clocks.wall + controller_ahead_s
    clocks.advance(back_s)
    c.acked(seq, read_at)
    return stamped


def test_the_correction_is_the_smallest_the_bounds_allow():
    clocks = Clocks()
    c = ClockOffset(lambda: clocks.wall, lambda: clocks.mono)
    assert c.offset_s is None and c.stamp(1) == clocks.wall  # none yet: its own clock
    c.acked(1, 0.0)  # a controller that does not say: nothing learnt
    for seq, bad in ((8, float("nan")), (9, float("inf"))):  # nor from nonsense
        c.stamp(seq)
        c.acked(seq, bad)
    assert c.offset_s is None
    exchange(c, clocks, 2, 0.01, 0.01, SKEW_S)
    assert SKEW_S - 0.01 <= c.offset_s <= SKEW_S + 0.01
    stamped = c.stamp(4)
    assert stamped == pytest.approx(clocks.wall + SKEW_S, abs=0.01)  # on the controller's clock
    # an ack of an unknown or forgotten heartbeat, or one acked twice, is no sample
    before = c.offset_s
    c.acked(99, clocks.wall + SKEW_S + 5)
    c.acked(2, clocks.wall + SKEW_S + 5)
    assert c.offset_s == before


@pytest.mark.parametrize("controller_ahead_s", [0.0, SKEW_S])
def test_a_lasting_wait_in_the_controllers_queues_stays_visible(controller_ahead_s):
    """Heartbeats that wait 3.2 s before the controller reads them, for far
    longer than the window: the delay it computes stays 3.2 s (a midpoint
    estimate would have hidden half of it once the calm samples left)."""
    clocks = Clocks()
    c = ClockOffset(lambda: clocks.wall, lambda: clocks.mono)
    exchange(c, clocks, 1, 0.01, 0.01, controller_ahead_s)  # a calm start
    for seq in range(2, 4 * WINDOW):
        stamped = exchange(c, clocks, seq, 3.2, 0.01, controller_ahead_s)
        read_at = clocks.wall - 0.01 + controller_ahead_s
        assert read_at - stamped == pytest.approx(3.2, abs=0.03), seq
    if controller_ahead_s == 0.0:
        assert c.offset_s == 0.0  # clocks that agree are not corrected at all


def test_a_controller_behind_is_corrected_and_a_step_is_followed_at_once():
    clocks = Clocks()
    c = ClockOffset(lambda: clocks.wall, lambda: clocks.mono)
    exchange(c, clocks, 1, 0.01, 0.01, -5.0)
    assert -5.01 <= c.offset_s <= -4.99
    exchange(c, clocks, 2, 0.01, 0.01, SKEW_S)  # the controller's clock was stepped
    assert SKEW_S - 0.01 <= c.offset_s <= SKEW_S + 0.01
    c.reset()
    assert c.offset_s is None
    sent = c.now()
    clocks.advance(20.0)  # a registration that waited 20 s (a storm of handshakes)
    c.answered(sent, clocks.wall - 0.01 + 7.0)
    assert 7.0 - 0.01 <= c.offset_s <= 7.0 + 20.0  # the bounds it proves, nearest 0: ~7
    assert c.offset_s == pytest.approx(7.0, abs=0.02)


@pytest.mark.parametrize("corrected", [True, False])
def test_a_controller_clock_ahead_of_its_agents_is_not_read_as_lag(tmp_path, pki, corrected):
    """Two real agents whose clocks run 30 s behind the controller's. With
    their heartbeats stamped on its clock, the controller never reads the 30 s
    as lag and admits a third agent (on a loaded machine it may first defer
    it for a moment of real lag: all run on one starved loop here);
    stamped on their own (`corrected` False: the agents learn no offset), it
    reads the 30 s as its lag and defers the third."""
    spec = load_spec(tiny_spec(tmp_path, min_hosts=4, max_hosts=4))  # (it waits: idle hosts)

    def agent(address: str, host: str) -> Agent:
        a = Agent(AgentSettings(controller=address, host_id=host, devices=1,
                                address="127.0.0.1", failure_domain=host,
                                state_dir=str(tmp_path / f"agent-{host}"), tls=pki.host(host),
                                allow=AllowList.parse([f"{sys.executable} {TINY_WORKER}"]),
                                job_id="test"))
        a.clock_offset.wall = lambda: time.time() - SKEW_S
        if not corrected:
            a.clock_offset.answered = lambda sent, received_at: None
        return a

    async def main():
        server = ControllerServer(spec, "127.0.0.1:0", tmp_path / "state", pki.controller)
        address = await server.start()
        loop_task = asyncio.create_task(server.run())
        c = server.controller
        agents = [agent(address, h) for h in ("h0", "h1")]
        tasks = [asyncio.create_task(a.run()) for a in agents]
        await until(lambda: len(c.receipts.latencies()) >= 8, 30,
                    "heartbeats of both, acked")
        delays = c.receipts.latencies()[-4:]
        third = agent(address, "h2")
        tasks.append(asyncio.create_task(third.run()))
        if corrected:
            await until(lambda: third.sessions_opened, 30, "h2 to be admitted")
        else:
            await until(lambda: c.registrations_deferred, 30, "h2 to be deferred")
        lag_s, deferred, worst_s = c.measured_lag_s, c.registrations_deferred, c.lag.worst_s
        for a in agents + [third]:
            a.shutdown()
        await asyncio.gather(*tasks)
        loop_task.cancel()
        await server.stop("test over")
        return delays, lag_s, deferred, worst_s

    delays, lag_s, deferred, worst_s = asyncio.run(asyncio.wait_for(main(), 60))
    if corrected:  # (admitted: the wait above)
        assert max(delays) < 1.0 and worst_s < SKEW_S - 1, (delays, worst_s, deferred)
    else:  # (the skew is real in this test, and would be read as lag)
        assert min(delays) > SKEW_S - 1 and lag_s > SKEW_S - 1 and deferred >= 1, \
            (delays, lag_s, deferred)
