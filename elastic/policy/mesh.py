"""Mesh planner: which hosts a generation uses, how many devices of each,
and the mesh shape it gets.

Pure: no devices, no JAX. A TPU slice (a failure domain of several hosts)
cannot run with one host missing, so hosts are taken in whole failure
domains only; a plain GPU or CPU host is a domain of one.

Hosts differ: a chip fails, a GPU falls off the bus, a host comes back from
repair with another count, a pool mixes accelerator kinds. One mesh needs
the same device count on every process and one kind of device, so the
planner considers, for each device kind and each device count `d` some host
reports, the slice of whole failure domains whose hosts all have at least
`d` devices of that kind, each using `d` of them. It takes the option that
puts the most devices in the mesh; among equals, the one with more devices
per host (fewer hosts, so fewer devices left idle on the hosts it uses).
Hosts that fit no chosen option are left out, each with the reason. Kinetic's
multi-host guide lists this "topology mismatch" among the common failures of
multi-host JAX jobs.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import operator
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from elastic.config import JobSpec, MeshSpec


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A host that could join: its id, failure domain, device count and
    device kind ("" when its agent does not say)."""

    host_id: str
    failure_domain: str
    devices: int
    kind: str = ""


@dataclasses.dataclass(frozen=True)
class MeshPlan:
    """The outcome of planning. `hosts` is empty when no slice can start.

    hosts: host ids in rank order (rank 0 hosts the JAX coordinator).
    shape: mesh axis sizes in the spec's order, -1 resolved.
    reason: one line saying why.
    devices_per_host: devices each host's worker puts in the mesh (a host
      with more uses the first that many); 0 in an empty plan.
    kind: the device kind of the slice's hosts.
    left_out: host -> why, for candidates the plan cannot use: another
      device kind, fewer devices than the slice uses per host, or a host of
      its failure domain that does not fit. (Spares, left over only because
      the mesh or `max_hosts` needs no more, and hosts of incomplete failure
      domains are not listed; the reason counts the latter.)
    """

    hosts: tuple[str, ...]
    shape: tuple[int, ...]
    reason: str
    devices_per_host: int = 0
    kind: str = ""
    left_out: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @property
    def devices(self) -> int:
        """Devices in the mesh."""
        return len(self.hosts) * self.devices_per_host


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


_host_id = operator.attrgetter("host_id")
#: More distinct device counts than this among one kind's hosts, and counts
#: that cannot beat the best option so far are not planned.
MANY_COUNTS = 8


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _kind_text(kind: str) -> str:
    return kind or "unreported kind"


@dataclasses.dataclass(frozen=True)
class _Option:
    hosts: tuple[Candidate, ...]
    shape: tuple[int, ...]
    per_host: int
    kind: str

    @property
    def devices(self) -> int:
        return len(self.hosts) * self.per_host

    def describe(self) -> str:
        return f"{_plural(len(self.hosts), 'host')} x {_plural(self.per_host, 'device')}"


class _Domain(NamedTuple):
    """A whole failure domain, summarized once per plan: its hosts by id,
    their kind (None when they report different kinds), the fewest devices
    any of them has, and their devices in all. (A tuple: thousands are made
    per plan.)"""

    name: str
    members: Sequence[Candidate]
    kind: str | None
    fewest: int
    devices: int


def _summarize(name: str, members: list[Candidate]) -> _Domain:
    if len(members) == 1:
        c = members[0]
        return _Domain(name, members, c.kind, c.devices, c.devices)
    kinds = {c.kind for c in members}
    counts = [c.devices for c in members]
    return _Domain(name, members, kinds.pop() if len(kinds) == 1 else None, min(counts),
                   sum(counts))


def _best_slice(spec: JobSpec, whole: Sequence[_Domain], kind: str,
                per_host: int) -> _Option | None:
    """The most hosts, in whole failure domains (`whole`, by name) of `kind`
    hosts with at least `per_host` devices each, whose devices fit the mesh;
    None if none does. When not every domain is needed, those whose hosts
    have exactly `per_host` devices are taken first (no device left idle),
    then by name; the ones taken are ranked by name. O(domains) unless only
    some are needed (then a sort)."""
    size = spec.hosts_per_failure_domain
    usable = [d for d in whole if d.kind == kind and d.fewest >= per_host]
    n_domains = _most_domains(spec.mesh, per_host * size, min(len(usable), spec.max_hosts // size))
    if not n_domains or n_domains * size < spec.min_hosts:
        return None
    if n_domains < len(usable):
        usable = sorted(usable, key=lambda d: (d.devices - per_host * size, d.name))
        usable = sorted(usable[:n_domains], key=lambda d: d.name)
    return _Option(tuple(c for d in usable for c in d.members),
                   mesh_shape(spec.mesh, per_host * n_domains * size), per_host, kind)


def _most_domains(mesh: MeshSpec, per_domain: int, at_most: int) -> int:
    """The largest n <= at_most such that n domains of `per_domain` devices
    fit `mesh` (0: none). With a -1 axis n must make the fixed axes divide
    the total, i.e. be a multiple of fixed / gcd(fixed, per_domain); without
    one the total must equal their product."""
    fixed = mesh.fixed_product
    if mesh.has_free_axis:
        step = fixed // math.gcd(fixed, per_domain)
        return at_most - at_most % step
    n, rest = divmod(fixed, per_domain)
    return n if not rest and n <= at_most else 0


def _misfit(spec: JobSpec, c: Candidate, chosen: _Option | None) -> str | None:
    """Why host `c` itself cannot be in `chosen` (None: it could)."""
    if spec.device_kind and c.kind != spec.device_kind:
        return (f"reports devices of kind {_kind_text(c.kind)!r}; "
                f"job.device_kind is {spec.device_kind!r}")
    if chosen is not None and c.kind != chosen.kind:
        return (f"reports devices of kind {_kind_text(c.kind)!r}; the "
                f"slice runs on {_kind_text(chosen.kind)!r}")
    if chosen is not None and c.devices < chosen.per_host:
        return f"reports {_plural(c.devices, 'device')}; the slice's hosts use {chosen.per_host}"
    if spec.devices_per_host and c.devices < spec.devices_per_host:
        return (f"reports {_plural(c.devices, 'device')}; job.devices_per_host is "
                f"{spec.devices_per_host}")
    return None


def _left_out(spec: JobSpec, domains: Sequence[tuple[str, list[Candidate]]],
              chosen: _Option | None) -> dict[str, str]:
    """Why each candidate outside `chosen` cannot be in it: its own devices,
    a host of its failure domain that does not fit, or a domain with more
    hosts than `job.hosts_per_failure_domain` (hosts that share a failure
    domain fail together, so none of such a domain is used: a spec or an
    agent's --failure-domain is wrong). Spares, and hosts whose domain is
    incomplete (they wait for the rest of it, and arrive one by one at
    start), are not listed."""
    size = spec.hosts_per_failure_domain
    why: dict[str, str] = {}
    for name, members in domains:
        misfits = {c.host_id: m for c in members if (m := _misfit(spec, c, chosen))}
        if len(members) > size:
            why.update((c.host_id, f"its failure domain {name} has {len(members)} hosts; "
                        f"job.hosts_per_failure_domain is {size}") for c in members)
        elif len(members) != size:
            why.update(misfits)
        elif misfits:
            first = min(misfits)
            for c in members:
                why[c.host_id] = misfits.get(c.host_id) or (
                    f"{first} in its failure domain {name} does not fit")
    return why


def plan_mesh(spec: JobSpec, candidates: Sequence[Candidate]) -> MeshPlan:
    """Choose the hosts, the devices per host and the mesh shape.

    Options: for each device kind (only `spec.device_kind` when set) and each
    per-host device count (only `spec.devices_per_host` when set, else every
    count some host of that kind reports), the largest slice of whole failure
    domains (all `spec.hosts_per_failure_domain` hosts present, all of that
    kind with at least that many devices) between `spec.min_hosts` and
    `spec.max_hosts` hosts whose device total fits the mesh. The plan is the
    option with the most devices in the mesh; ties go to more devices per
    host, then to the kind first in sorted order. Ranks are dense, in domain
    order (see `_best_slice`), hosts of a domain by id. An empty plan says
    why nothing fits. O(candidates x distinct counts); past MANY_COUNTS
    distinct counts, counts that cannot win are skipped.
    """
    grouped: dict[str, list[Candidate]] = {}
    for c in candidates:
        grouped.setdefault(c.failure_domain, []).append(c)
    domains = [(name, members if len(members) == 1 else sorted(members, key=_host_id))
               for name, members in sorted(grouped.items())]
    whole = [_summarize(name, members) for name, members in domains
             if len(members) == spec.hosts_per_failure_domain]
    kinds = sorted({c.kind for c in candidates})
    if spec.device_kind:
        kinds = [k for k in kinds if k == spec.device_kind]
    options: list[_Option] = []
    for kind in kinds:
        have = sorted((c.devices for c in candidates if c.kind == kind), reverse=True)
        counts = sorted({spec.devices_per_host} if spec.devices_per_host else set(have),
                        reverse=True)
        for per_host in counts:
            # Many distinct counts (an agent may report any): skip a count
            # that cannot beat the best so far even with every host that has
            # as many devices. With few, every option is weighed, so that
            # the reason can name the runner-up.
            at_most = min(bisect.bisect_right(have, -per_host, key=operator.neg),
                          spec.max_hosts) * per_host
            if len(counts) > MANY_COUNTS and options and \
                    at_most < max(o.devices for o in options):
                continue
            option = _best_slice(spec, whole, kind, per_host)
            if option is not None:
                options.append(option)
    best = max(options, key=lambda o: (o.devices, o.per_host), default=None)
    left_out = _left_out(spec, domains, best)
    note = _domains_left_out(spec, domains)
    if best is None:
        return MeshPlan((), (), _no_fit(spec, candidates, domains) + note, left_out=left_out)
    axes = ", ".join(f"{name}={size}" for name, size in zip(spec.mesh.names, best.shape))
    reason = f"{best.describe()}, mesh ({axes})"
    partial = [c for c in best.hosts if c.devices > best.per_host]
    if partial:
        reason += (f"; {_plural(len(partial), 'host')} "
                   f"{'uses' if len(partial) == 1 else 'use'} {best.per_host} of "
                   f"{'its' if len(partial) == 1 else 'their'} devices "
                   f"({', '.join(c.host_id for c in partial[:3])}"
                   f"{', ...' if len(partial) > 3 else ''})")
    runner_up = max((o for o in options if o is not best and
                     (o.per_host, o.kind) != (best.per_host, best.kind)),
                    key=lambda o: (o.devices, o.per_host), default=None)
    if runner_up is not None:
        if runner_up.devices < best.devices:
            why = "more devices"
        elif runner_up.per_host < best.per_host:
            why = "as many devices, on fewer hosts"
        else:
            why = f"as many devices and hosts; {_kind_text(best.kind)!r} sorts first"
        other = f" of {_kind_text(runner_up.kind)!r}" if runner_up.kind != best.kind else ""
        reason += f"; chosen over {runner_up.describe()}{other} ({why})"
    if left_out:
        first = sorted(left_out)[0]
        more = f" and {len(left_out) - 1} more" if len(left_out) > 1 else ""
        reason += f"; left out: {first} ({left_out[first]}){more}"
    return MeshPlan(tuple(c.host_id for c in best.hosts), best.shape, reason + note,
                    best.per_host, best.kind, left_out)


def _domains_left_out(spec: JobSpec, domains: Sequence[tuple[str, list[Candidate]]]) -> str:
    """" (...)" naming the failure domains no plan uses, or ""."""
    size = spec.hosts_per_failure_domain
    incomplete = sum(len(members) < size for _, members in domains)
    over = [(name, len(members)) for name, members in domains if len(members) > size]
    parts = [f"{incomplete} incomplete failure domain(s) left out"] if incomplete else []
    if over:
        shown = ", ".join(f"{name} has {n}" for name, n in over[:3])
        parts.append(f"{len(over)} failure domain(s) with more hosts than "
                     f"job.hosts_per_failure_domain = {size} left out: {shown}"
                     + (", ..." if len(over) > 3 else ""))
    return f" ({'; '.join(parts)})" if parts else ""


def _no_fit(spec: JobSpec, candidates: Sequence[Candidate],
            domains: Sequence[tuple[str, list[Candidate]]]) -> str:
    """Why no option fits: too few hosts, or no device total fits the mesh."""
    size = spec.hosts_per_failure_domain
    usable = sum(len(members) for _, members in domains if len(members) == size)
    if usable < spec.min_hosts:
        return (f"waiting for hosts: {usable} usable in whole failure domains, "
                f"min_hosts is {spec.min_hosts}")
    if spec.device_kind and not any(c.kind == spec.device_kind for c in candidates):
        return (f"waiting for hosts: none of the {len(candidates)} ready reports devices "
                f"of kind {spec.device_kind!r} (job.device_kind)")
    most = max(c.devices for c in candidates)
    if spec.devices_per_host and most < spec.devices_per_host:
        return (f"waiting for hosts: none of the {len(candidates)} ready has "
                f"{spec.devices_per_host} devices (job.devices_per_host; the most is {most})")
    counts = sorted({c.devices for c in candidates})
    shown = ", ".join(str(n) for n in counts[:8]) + (", ..." if len(counts) > 8 else "")
    per_host = (f"job.devices_per_host = {spec.devices_per_host}" if spec.devices_per_host
                else f"hosts with {shown} devices")
    return (f"mesh {spec.mesh.to_text()} fits no slice of {spec.min_hosts} to "
            f"{min(usable, spec.max_hosts)} of the {len(candidates)} ready hosts "
            f"({per_host}, in whole failure domains of {size})")


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
