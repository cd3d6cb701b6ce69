"""Fencing a stopped slice whose process 0 may live on (pure).

Agents keep their workers for `health.controller_lease_s` without a
controller, then stop them (elastic.agent.fence). Every step needs all
processes, but the last act of a checkpoint needs only process 0: once
every process has written its part and passed Orbax's barrier, process 0
alone renames the step's directory (or writes its commit marker on a
bucket), and a worker that raised waits for that save
(elastic.worker.runtime). A process 0 that lives on after the others
stopped can so commit a step late, while the next generation's process 0
removes that step's unfinished directory as a leftover, or writes the same
step again: a step committed half-written. So when the host of process 0
was lost without being seen to stop its worker, no new generation starts
until its lease has run out (`fence_lost_slice`), or until it is seen to
have stopped after all (`lift_fence`). Seen to stop: its agent acknowledged
the stop, or its agent's connection was closed and a peer's worker ended by
itself, not on a stop (a killed host: its worker dies with its agent,
elastic.agent.supervisor, and its peers' collectives fail). A closed
connection alone is not enough: an agent that stops hearing the controller
closes its connection itself and keeps its worker for the lease (a host cut
off one way, or a controller stalled).
"""

from __future__ import annotations

import dataclasses

from elastic.agent.fence import fenced_by
from elastic.config import JobSpec
from elastic.policy.state import Action, Journal, SliceState
from elastic.policy.view import ClusterView


def fence_lost_slice(state: SliceState, view: ClusterView, now: float, spec: JobSpec,
                      actions: list[Action], pending: list[str]) -> SliceState:
    """`state` of a generation that just stopped, fenced until the
    controller lease of its process 0's host has run out (`fenced_until`,
    elastic.agent.fence.fenced_by) when that host is not seen to have
    stopped its worker (the module docstring): lost, or `pending` (dropped
    unanswered). Journals `waiting_for_fencing` with the seconds left
    (`lease_left_s`: a controller that takes over keeps the fence,
    elastic.policy.failure_history). Unchanged otherwise: the others
    cannot step without process 0, and only process 0 commits."""
    if not state.members:
        return state
    first = state.members[0]
    acknowledged = first in view.hosts and first not in state.lost and first not in pending
    if acknowledged or (first in view.disconnected and _a_peer_ended_by_itself(state, view)):
        return state
    # (never heard by this controller, as after an adoption that found none
    # of them: their lease may have begun just now)
    record = view.hosts.get(first)
    heard = record.last_heartbeat_at if record is not None else now
    until = fenced_by(heard, spec.health.controller_lease_s, spec.health.heartbeat_interval_s)
    lost = [h for h in state.members if h in state.lost or h in pending]
    whole = "every host" if len(lost) == len(state.members) else f"host {first}"
    actions.append(Journal("waiting_for_fencing", state.generation,
                           f"{whole} of generation {state.generation} was lost, with its "
                           f"process 0 (host {first}, the one that commits checkpoints), which "
                           f"is not known to have stopped its worker: no generation starts "
                           f"until its controller lease (health.controller_lease_s = "
                           f"{spec.health.controller_lease_s:g}) has run out", first,
                           {"hosts": lost, "lease_left_s": round(until - now, 3)}))
    return dataclasses.replace(state, fenced_until=until)


def _a_peer_ended_by_itself(state: SliceState, view: ClusterView) -> bool:
    """Whether an agent reported a worker of this generation, other than
    process 0's, ended by itself (not on a stop it was sent)."""
    for host, incarnation in zip(state.members[1:], state.incarnations[1:]):
        record = view.get(host)
        if record is not None and record.incarnation == incarnation and \
                record.worker.generation == state.generation and \
                not record.worker.running and not record.worker.stopped_on_request:
            return True
    return False


def lift_fence(state: SliceState, view: ClusterView, actions: list[Action]) -> SliceState:
    """`state` without its fence once process 0 of the fenced generation
    is seen stopped: its agent, heard again and not lost, reports no worker
    of that generation running (a stop acknowledgement read after the
    members were dropped, say after the controller itself was paused)."""
    host = state.members[0] if state.members else state.fence_host
    if not host:  # (a fence carried from a journal that did not name the host)
        return state
    record = view.get(host)
    if record is None or host in state.lost or (
            record.worker.running and record.worker.generation == state.generation):
        return state
    actions.append(Journal("fence_lifted", state.generation,
                           f"host {host}, process 0 of generation {state.generation}, is seen "
                           f"to have stopped its worker: nothing of that generation can step "
                           f"or commit", host))
    return dataclasses.replace(state, fenced_until=0.0)


def waiting(state: SliceState, now: float) -> str:
    """Why no generation starts while `state` is fenced (a sentence)."""
    left = f"waiting {state.fenced_until - now:.1f} s more for"
    host = state.members[0] if state.members else state.fence_host
    if not state.members:  # (a fence carried from the journal)
        return (f"{left} {f'host {host}' if host else 'the host of process 0'} of generation "
                f"{state.generation} to fence itself, as a previous controller journaled or "
                f"left it stopping")
    return (f"{left} host {host}, process 0 of generation {state.generation}, "
            f"to fence itself")
