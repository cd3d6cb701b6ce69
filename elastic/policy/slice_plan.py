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
    previous = set(state.members)
    newcomers = sum(h not in previous for h in full)
    if not newcomers:
        return None
    plan = plan_mesh(spec, [c for c in candidates if c.host_id in previous])
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
