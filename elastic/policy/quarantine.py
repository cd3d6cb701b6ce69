"""Quarantine: a host that fails again and again is set aside for a while.

Pure functions over two maps kept in the SliceState:
failures (host -> times of failures attributed to it) and
quarantined (host -> (until, reason)).

A quarantine is a preference, never a stall: a host is set aside only while
the others make `job.min_hosts` (record_failures), and released before its
cooldown ends when a slice cannot start without it (release_needed), as
after later host losses, or at the start of the next job, which inherits
the quarantines of the jobs before it (elastic.policy.failure_history).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence, Set

from elastic.config import JobSpec
from elastic.policy import usable as usable_hosts
from elastic.policy.mesh import Candidate, MeshPlan, plan_mesh
from elastic.policy.state import Action, Journal, SliceState
from elastic.policy.view import ClusterView


def record_failures(failures: Mapping[str, tuple[float, ...]],
                    quarantined: Mapping[str, tuple[float, str]], hosts: Iterable[str],
                    now: float, spec: JobSpec, why: str, usable: Set[str]
                    ) -> tuple[dict, dict, list[tuple[str, str]]]:
    """Attribute a failure at `now` to `hosts`. Returns the new failures and
    quarantined maps and the (host, reason) pairs newly quarantined: those
    with `quarantine.failures` failures within `quarantine.window_s` — unless
    that would leave fewer than `job.min_hosts` of the `usable` hosts (those
    the controller knows and has not lost) outside quarantine (when every
    host fails, setting them all aside only stops the job; the restart
    budget and crash loop bound that case)."""
    q = spec.quarantine
    failures, quarantined, newly = dict(failures), dict(quarantined), []
    for host in hosts:
        times = tuple(t for t in failures.get(host, ()) if t > now - q.window_s) + (now,)
        failures[host] = times
        if len(times) >= q.failures and host not in quarantined and \
                len(usable - quarantined.keys() - {host}) >= spec.min_hosts:
            reason = (f"{len(times)} failures within {q.window_s:g} s "
                      f"(quarantine.failures = {q.failures}), last: {why}; "
                      f"set aside for {q.cooldown_s:g} s")
            quarantined[host] = (now + q.cooldown_s, reason)
            failures[host] = ()
            newly.append((host, reason))
    return failures, quarantined, newly


def release(quarantined: Mapping[str, tuple[float, str]], now: float
            ) -> tuple[dict, list[str]]:
    """Drop quarantines whose cooldown is over; returns (map, released hosts)."""
    done = [h for h, (until, _) in quarantined.items() if until <= now]
    return {h: v for h, v in quarantined.items() if h not in done}, done


def release_needed(quarantined: Mapping[str, tuple[float, str]],
                   spares: Mapping[str, Candidate], candidates: Sequence[Candidate],
                   plan: Callable[[list[Candidate]], MeshPlan]
                   ) -> tuple[list[str], MeshPlan | None]:
    """Which quarantined hosts to release early so that a slice can start,
    when none can without them. `spares` (host -> its planner candidate) are
    the quarantined hosts that are otherwise usable; taken in the order
    their cooldowns end (ties by host id), the shortest run of them that,
    added to `candidates`, lets `plan` give a plan with hosts, found by
    bisection (which assumes that more candidates never make a slice
    impossible). That is not always the fewest: with failure domains, one
    later in the order may have done alone. Returns (the spares that plan
    uses, in that order, and the plan), or ([], None) when not even all of
    them make a slice. Plans once when none helps, about log2(spares) + 1
    times when some do."""
    order = sorted(spares, key=lambda h: (quarantined[h][0], h))

    def with_first(count: int) -> MeshPlan:
        return plan([*candidates, *(spares[h] for h in order[:count])])

    found = with_first(len(order)) if order else None
    if found is None or not found.hosts:
        return [], None
    low, high = 0, len(order)  # (none: no slice, the caller's plan; all: found)
    while high - low > 1:
        middle = (low + high) // 2
        attempt = with_first(middle)
        if attempt.hosts:
            high, found = middle, attempt
        else:
            low = middle
    return [h for h in order[:high] if h in found.hosts], found


def settled(state: SliceState, view: ClusterView, now: float, spec: JobSpec) -> bool:
    """Whether the hosts on their way have arrived: no host registered or
    opened its stream for `health.heartbeat_timeout_s` (at least
    `health.rendezvous_settle_s`), and every host neither lost, quarantined
    nor being taken away is usable now: none is still opening its stream,
    stopping a worker, or within `health.reconnect_grace_s` of its stream
    closing. A host that is up but not heard from for less than a heartbeat
    timeout is alive everywhere else in the controller; before then a
    quarantined host is not released for want of hosts that are on their way
    (at a next job's start the agents come one by one, each once its worker
    of the job before has ended: over 1.2 s in tests/test_next_job.py).
    O(hosts)."""
    last = max(view.last_registration_at, view.last_stream_opened_at)
    quiet_s = max(spec.health.heartbeat_timeout_s, spec.health.rendezvous_settle_s)
    if now - last < quiet_s:
        return False
    return not any(h not in state.lost and h not in state.quarantined and not r.preemption
                   and not usable_hosts.usable(r, state, view) for h, r in view.hosts.items())


def release_for_start(state: SliceState, view: ClusterView, spec: JobSpec,
                      candidates: list[Candidate], plan: MeshPlan, actions: list[Action]
                      ) -> tuple[SliceState, list[Candidate], MeshPlan]:
    """For a slice that cannot start (`plan` has no hosts): release early the
    quarantined hosts it cannot start without (release_needed), each with a
    `host_released` in `actions`. Returns the state, the candidates and the
    plan: with those hosts, or as given when releasing none helps."""
    free = dataclasses.replace(state, quarantined={})
    spares = {h: usable_hosts.candidate(r) for h, r in view.hosts.items()
              if h in state.quarantined and usable_hosts.usable(r, free, view)}
    released, needed = release_needed(state.quarantined, spares, candidates,
                                      lambda c: plan_mesh(spec, c))
    if not released:
        return state, candidates, plan
    for host in released:
        actions.append(Journal("host_released", state.generation, "released before its "
                               f"cooldown ends: no slice can start without it ({plan.reason})",
                               host))
    kept = {h: q for h, q in state.quarantined.items() if h not in released}
    return (dataclasses.replace(state, quarantined=kept),
            [*candidates, *(spares[h] for h in released)], needed)
