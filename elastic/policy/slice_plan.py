"""Which hosts a (re)start takes, beyond what the mesh planner
(elastic.policy.mesh) chooses on its own: after a failure under
restart.grow = "after_checkpoint", the surviving members only; with
replicated snapshots, hosts that between them still hold every lost host's
last snapshot; and each host's buddy (elastic.policy.buddies) as the view
knows them. Pure functions of the slice state, the view and the spec,
called by elastic.policy.decide."""

from __future__ import annotations

import dataclasses

from elastic.config import JobSpec
from elastic.policy.buddies import buddies, keep_replicas_within
from elastic.policy.mesh import Candidate, MeshPlan, plan_mesh
from elastic.policy.state import SliceState
from elastic.policy.view import ClusterView


def survivors_plan(state: SliceState, spec: JobSpec, candidates: list[Candidate],
                   full: tuple[str, ...]) -> MeshPlan | None:
    """The restart after a failure under restart.grow = "after_checkpoint":
    the failed generation's usable members only, if leaving the newcomers
    out costs no member (a mesh that only fits fewer hosts). A newcomer holds
    no local snapshot, so restarting with it would roll everyone back to the
    persistent checkpoint, which the grow policy promised not to do; it joins
    at the next grow, after the next commit. None: plan with everyone."""
    if spec.restart.grow != "after_checkpoint" or state.stop_kind != "failure" or \
            not state.members:
        return None
    return survivors_only(spec, candidates, set(state.members), full)


def survivors_only(spec: JobSpec, candidates: list[Candidate], members: set[str],
                   full: tuple[str, ...]) -> MeshPlan | None:
    """The plan of `members` alone, if it costs none of them against
    `full` (the hosts planned with every candidate, newcomers included);
    None when `full` has no newcomer or leaving them out loses a member.
    The rule of survivors_plan and next_slices alike."""
    newcomers = sum(h not in members for h in full)
    if not newcomers:
        return None
    plan = plan_mesh(spec, [c for c in candidates if c.host_id in members])
    return plan if plan.hosts and len(plan.hosts) >= len(full) - newcomers else None


def buddy_map(view: ClusterView, hosts: tuple[str, ...]) -> dict[str, str]:
    """elastic.policy.buddies.buddies for `hosts` (rank order) as `view`
    knows them: {host: its buddy's host id}; a host it no longer knows is a
    domain of its own, unable to receive."""
    records = {h: view.get(h) for h in hosts}
    return buddies(hosts, {h: r.failure_domain if r else h for h, r in records.items()},
                   {h: bool(r and r.service_port) for h, r in records.items()})


def plan_keeping_replicas(state: SliceState, view: ClusterView, spec: JobSpec,
                          candidates: list[Candidate], plan: MeshPlan) -> MeshPlan:
    """`plan`, or one of as many hosts and devices whose hosts hold, between
    them, the last snapshot of every host of the last generation (their own
    or a buddy's replica: elastic.policy.buddies.keep_replicas_within), when
    the mesh leaves usable hosts out and `plan` would leave out a lost
    host's buddy."""
    if not spec.restart.replicate_snapshots or not state.members:
        return plan
    chosen = set(plan.hosts)
    pool = [c for c in candidates if c.host_id in chosen] + \
        [c for c in candidates if c.host_id not in chosen]
    if len(pool) == len(plan.hosts):
        return plan
    buddy_of = buddy_map(view, state.members)  # (the last generation's, derived again)
    usable = {c.host_id for c in pool}
    keep = keep_replicas_within([c.host_id for c in pool], len(plan.hosts),
                                [h for h in state.members if h not in usable], buddy_of)
    if keep is None or set(keep) == chosen:
        return plan
    better = plan_mesh(spec, [c for c in pool if c.host_id in keep])
    if len(better.hosts) != len(plan.hosts) or better.devices_per_host != plan.devices_per_host:
        return plan
    return dataclasses.replace(better, reason=better.reason + " (hosts chosen so that the "
                               "slice holds every host's last snapshot, own or replica)")


#: At most this many next slice shapes are compiled ahead per generation
#: (each costs a compile of the program on process 0's host, in the
#: background).
MAX_NEXT_SLICES = 2
#: Failure domains of at most this many distinct kinds (members' device
#: counts and kinds) are planned without; others of the same kind give the
#: same slice. Bounds the work at O(candidates x MAX_DOMAIN_KINDS).
MAX_DOMAIN_KINDS = 4


def next_slices(spec: JobSpec, candidates: list[Candidate],
                plan: MeshPlan) -> tuple[tuple[int, int], ...]:
    """The slices the planner would start next if one failure domain of
    `plan` were lost and nothing else changed: ((process count, devices per
    host), ...), at most MAX_NEXT_SLICES, the most likely first (the shape
    more of the plan's domains lead to), without `plan`'s own shape and
    slices that cannot start (fewer than `spec.min_hosts`). As after a
    failure (survivors_plan): under restart.grow = "after_checkpoint" the
    survivors alone, if leaving the spares out costs no member; otherwise a
    spare among `candidates` may take the lost domain's place, and then the
    shape is `plan`'s own: nothing.

    Only slices process 0 can compile for are named: no more processes
    than `plan`, and rank r of the next slice with as many devices as rank
    r of `plan` (a process's device ids depend on its rank and count;
    elastic.worker.compile_ahead builds the next slice's mesh from this
    slice's first ranks). Process 0 of the generation compiles its program
    for these ahead, in the background, so that the first restart onto
    such a slice loads it instead of compiling.
    O(candidates x MAX_DOMAIN_KINDS)."""
    if not plan.hosts:
        return ()
    by_host = {c.host_id: c for c in candidates}
    members = set(plan.hosts)
    domains: dict[str, list[Candidate]] = {}
    for host in plan.hosts:
        c = by_host.get(host)
        if c is not None:
            domains.setdefault(c.failure_domain, []).append(c)
    kinds: dict[tuple, list[str]] = {}  # (members' counts and kinds) -> domains
    for name, hosts in domains.items():
        kinds.setdefault(tuple(sorted((c.devices, c.kind) for c in hosts)), []).append(name)
    votes: dict[tuple[int, int], int] = {}
    for names in sorted(kinds.values(), key=len, reverse=True)[:MAX_DOMAIN_KINDS]:
        without = plan_without_domain(spec, candidates, members, names[0])
        shape = (len(without.hosts), without.devices_per_host)
        if without.hosts and shape != (len(plan.hosts), plan.devices_per_host) and \
                len(without.hosts) <= len(plan.hosts) and \
                all(by_host[h].devices == by_host[r].devices
                    for h, r in zip(without.hosts, plan.hosts)):
            votes[shape] = votes.get(shape, 0) + len(names)
    ranked = sorted(votes, key=lambda s: (-votes[s], -s[0] * s[1], -s[1]))
    return tuple(ranked[:MAX_NEXT_SLICES])


def plan_without_domain(spec: JobSpec, candidates: list[Candidate], members: set[str],
                        lost: str) -> MeshPlan:
    """The plan of the restart after failure domain `lost` of the slice of
    `members` failed: with every other candidate, or (survivors_plan's rule
    under restart.grow = "after_checkpoint") with the surviving members
    only, when that costs no member."""
    rest = [c for c in candidates if c.failure_domain != lost]
    full = plan_mesh(spec, rest)
    if spec.restart.grow != "after_checkpoint":
        return full
    return survivors_only(spec, rest, members, full.hosts) or full
