"""Members a stop waits for whose agents' connections closed (pure): once
another member's worker of the generation has ended, the slice cannot step
or commit on, and they are lost at once instead of after
`health.reconnect_grace_s` (elastic.policy.decide's STOPPING phase)."""

from __future__ import annotations

import dataclasses

from elastic.policy.state import Action, Journal, SliceState
from elastic.policy.view import ClusterView


def after_a_peer_ended(state: SliceState, view: ClusterView, now: float,
                       pending: list[str]) -> str | None:
    """A member whose worker of this generation has ended (its agent said
    so), when every member the stop still waits for is a host whose
    agent's connection closed at least the controller's lag ago (a closed
    connection an agent reopens at once is read by then); else None."""
    if not all(h in view.disconnected and now - view.disconnected[h] >= view.lag_s
               for h in pending):
        return None
    return next((h for h, inc in zip(state.members, state.incarnations)
                 if h not in pending and h not in state.lost and (r := view.get(h)) is not None
                 and r.incarnation == inc and r.worker.generation == state.generation
                 and not r.worker.running), None)


def lose(state: SliceState, view: ClusterView, now: float, actions: list[Action],
         closed: list[str], ended: str) -> SliceState:
    """The members a stop still waits for are hosts whose agents'
    connections closed, and the worker of another member (`ended`) has
    ended: they are lost now, not after reconnect_grace_s. With one process
    of the generation gone, the others cannot step, whatever they do; a
    closed connection is most often the agent ended, and its worker with it
    (so elastic.policy.fencing takes a process 0 among them as stopped, and
    commits nothing late); the stop could not reach
    them before they reconnect, and the grace would only delay the next
    generation, which starts without them (one that reconnects returns as
    any lost host does, its old worker stopped as a stray, and a grow may
    take it back)."""
    for host in closed:
        closed_s = now - view.disconnected[host]
        actions.append(Journal(
            "host_lost", state.generation,
            f"connection closed {closed_s:.1f} s ago, and host {ended}'s worker of this "
            f"generation has ended, so the slice cannot step on: not waiting out "
            f"reconnect_grace_s", host, {"disconnected_s": round(closed_s, 3)}))
    return dataclasses.replace(state, lost=state.lost | frozenset(closed))
