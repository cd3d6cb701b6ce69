"""Fencing a slice the controller lost all at once (pure).

Agents keep their workers for `health.controller_lease_s` without a
controller, then stop them (elastic.agent.fence). A generation whose members
were all lost together, none seen to stop, may train on meanwhile: no new
generation starts until their leases have run out (`fence_lost_slice`), or
until one of them is seen to have stopped after all (`lift_fence`): every
step and every commit needs all processes, so the others cannot go on.
"""

from __future__ import annotations

import dataclasses

from elastic.config import JobSpec
from elastic.policy.state import Action, Journal, SliceState
from elastic.policy.view import ClusterView


def fence_lost_slice(state: SliceState, view: ClusterView, now: float, spec: JobSpec,
                      actions: list[Action], pending: list[str]) -> SliceState:
    """Agents keep their workers for `health.controller_lease_s` without a
    controller. Once one member of the stopped generation is seen to have
    stopped (its agent acknowledged the stop, or its agent's connection was
    closed: the agent process ended, and its worker with it), the others
    cannot step or commit (every step and every commit needs all
    processes). When none was (all cut off from the controller together,
    `pending` ones dropped unanswered), they may train on together, so no
    generation starts until their leases have run out."""
    seen_stopped = [h for h in state.members if h in view.disconnected or (
        h in view.hosts and h not in state.lost and h not in pending)]
    if not state.members or seen_stopped:
        return state
    # (never heard by this controller, as after an adoption that found none
    # of them: their lease may have begun just now)
    heard = max((view.hosts[h].last_heartbeat_at for h in state.members if h in view.hosts),
                default=now)
    until = heard + spec.health.controller_lease_s + spec.health.heartbeat_interval_s
    actions.append(Journal("waiting_for_fencing", state.generation,
                           f"every host of generation {state.generation} was lost; none is "
                           f"known to have stopped its worker, so no generation starts "
                           f"until their controller lease (health.controller_lease_s = "
                           f"{spec.health.controller_lease_s:g}) has run out", None,
                           {"hosts": list(state.members)}))
    return dataclasses.replace(state, fenced_until=until)


def lift_fence(state: SliceState, view: ClusterView, actions: list[Action]) -> SliceState:
    """`state` without its fence once a member of the fenced generation is
    seen stopped: its agent, heard again and not lost, reports no worker of
    that generation running (a stop acknowledgement read after the members
    were dropped, say after the controller itself was paused)."""
    for host in state.members:
        record = view.get(host)
        stopped = record is not None and host not in state.lost and not (
            record.worker.running and record.worker.generation == state.generation)
        if stopped:
            actions.append(Journal("fence_lifted", state.generation,
                                   f"host {host} of generation {state.generation} is seen to "
                                   f"have stopped its worker: the others cannot train on",
                                   host))
            return dataclasses.replace(state, fenced_until=0.0)
    return state
