"""Mesh planner: which hosts a generation uses and the mesh shape it gets.

Pure: no devices, no JAX. A TPU slice (a failure domain of several hosts)
cannot run with one host missing, so hosts are taken in whole failure
domains only; a plain GPU or CPU host is a domain of one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from elastic.config import JobSpec, MeshSpec


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A host that could join: its id, failure domain and device count."""

    host_id: str
    failure_domain: str
    devices: int


@dataclasses.dataclass(frozen=True)
class MeshPlan:
    """The outcome of planning. `hosts` is empty when no slice can start.

    hosts: host ids in rank order (rank 0 hosts the JAX coordinator).
    shape: mesh axis sizes in the spec's order, -1 resolved.
    reason: one line saying why.
    """

    hosts: tuple[str, ...]
    shape: tuple[int, ...]
    reason: str


def mesh_shape(mesh: MeshSpec, total_devices: int) -> tuple[int, ...] | None:
    """Axis sizes for `total_devices`, or None when the spec does not fit.

    With a -1 axis the fixed axes must divide the device count; without one
    their product must equal it.
    """
    fixed = mesh.fixed_product
    if total_devices <= 0:
        return None
    if mesh.has_free_axis:
        if total_devices % fixed:
            return None
        return tuple(total_devices // fixed if size == -1 else size for _, size in mesh.axes)
    return tuple(size for _, size in mesh.axes) if fixed == total_devices else None


def plan_mesh(spec: JobSpec, candidates: Sequence[Candidate]) -> MeshPlan:
    """Choose the largest valid set of whole failure domains.

    A domain counts only when all `spec.hosts_per_failure_domain` of its hosts
    are candidates. Domains are taken in sorted order of their name; hosts in a
    domain in sorted order of their id; ranks are dense. The plan uses at most
    `spec.max_hosts` hosts and at least `spec.min_hosts`; it uses the device
    count of the fewest-device host for every host (a mesh needs the same
    count per host). An empty plan carries the reason (below min_hosts, or no
    host count that fits the mesh).
    """
    per_domain = spec.hosts_per_failure_domain
    domains: dict[str, list[Candidate]] = {}
    for c in candidates:
        domains.setdefault(c.failure_domain, []).append(c)
    whole = [sorted(members, key=lambda c: c.host_id)
             for _, members in sorted(domains.items())
             if len(members) == per_domain]
    partial = len(domains) - len(whole)
    note = f" ({partial} incomplete failure domain(s) left out)" if partial else ""
    usable = len(whole) * per_domain
    if usable < spec.min_hosts:
        return MeshPlan((), (), f"waiting for hosts: {usable} usable in whole failure domains, "
                                f"min_hosts is {spec.min_hosts}{note}")
    max_domains = min(len(whole), spec.max_hosts // per_domain)
    for n_domains in range(max_domains, 0, -1):
        hosts = [c for domain in whole[:n_domains] for c in domain]
        if len(hosts) < spec.min_hosts:
            break
        devices = min(c.devices for c in hosts)
        shape = mesh_shape(spec.mesh, devices * len(hosts))
        if shape is not None:
            axes = ", ".join(f"{name}={size}" for name, size in zip(spec.mesh.names, shape))
            return MeshPlan(tuple(c.host_id for c in hosts), shape,
                            f"{len(hosts)} hosts x {devices} devices, mesh ({axes}){note}")
    return MeshPlan((), (), f"no host count from {spec.min_hosts} to {usable} fits mesh "
                            f"{spec.mesh.to_text()}{note}")


def check_satisfiable(spec: JobSpec) -> str | None:
    """Why no device count can satisfy the mesh for this spec, or None.

    Host counts considered: whole failure domains between min_hosts and
    max_hosts. With `devices_per_host` unknown any count per host is allowed.
    """
    per_domain = spec.hosts_per_failure_domain
    counts = [n for n in range(per_domain, spec.max_hosts + 1, per_domain)
              if n >= spec.min_hosts]
    if not counts:
        return (f"no multiple of hosts_per_failure_domain ({per_domain}) lies between "
                f"min_hosts ({spec.min_hosts}) and max_hosts ({spec.max_hosts})")
    per_host = [spec.devices_per_host] if spec.devices_per_host else None
    for hosts in counts:
        if per_host is None:
            if spec.mesh.has_free_axis or spec.mesh.fixed_product % hosts == 0:
                return None
        elif mesh_shape(spec.mesh, hosts * per_host[0]) is not None:
            return None
    devices = f"{spec.devices_per_host} devices per host" if per_host else "any device count per host"
    return (f"mesh {spec.mesh.to_text()} fits no slice of {counts[0]} to {counts[-1]} hosts "
            f"with {devices}")
