"""Mesh planner tables: whole failure domains, the largest valid slice,
impossible specs."""

from __future__ import annotations

import pytest

from elastic.config import JobSpec, MeshSpec
from elastic.policy.mesh import Candidate, check_satisfiable, mesh_shape, plan_mesh


def spec(mesh: str, min_hosts=1, max_hosts=8, per_domain=1, devices=None) -> JobSpec:
    return JobSpec(command=("w",), mesh=MeshSpec.from_text(mesh), min_hosts=min_hosts,
                   max_hosts=max_hosts, hosts_per_failure_domain=per_domain,
                   devices_per_host=devices)


def hosts(n: int, devices: int = 2, per_domain: int = 1, skip=()) -> list[Candidate]:
    return [Candidate(f"h{i}", f"d{i // per_domain}", devices) for i in range(n) if i not in skip]


@pytest.mark.parametrize("mesh,devices,shape", [
    ("data=-1,model=2", 8, (4, 2)),
    ("data=-1,model=2", 6, (3, 2)),
    ("data=-1,model=2", 5, None),
    ("data=4,model=2", 8, (4, 2)),
    ("data=4,model=2", 6, None),
    ("data=-1", 1, (1,)),
])
def test_mesh_shape(mesh, devices, shape):
    assert mesh_shape(MeshSpec.from_text(mesh), devices) == shape


@pytest.mark.parametrize("case,job,candidates,expected_hosts,expected_shape", [
    ("all fit", spec("data=-1,model=2", max_hosts=4), hosts(4), 4, (4, 2)),
    ("capped at max_hosts", spec("data=-1,model=2", max_hosts=3), hosts(5), 3, (3, 2)),
    ("one host gone", spec("data=-1,model=2"), hosts(4, skip={1}), 3, (3, 2)),
    ("fixed mesh takes fewer hosts", spec("data=2,model=2", max_hosts=4), hosts(3), 2, (2, 2)),
    ("model=4 on 2-device hosts: an even host count", spec("data=-1,model=4"), hosts(3), 2,
     (1, 4)),
    ("whole domains only", spec("data=-1", per_domain=2), hosts(4, per_domain=2, skip={3}), 2,
     (4,)),
    ("two whole domains", spec("data=-1", per_domain=2), hosts(5, per_domain=2), 4, (8,)),
    ("below min_hosts", spec("data=-1", min_hosts=3), hosts(2), 0, ()),
    ("no count fits", spec("data=-1,model=3", min_hosts=2), hosts(2, devices=2), 0, ()),
])
def test_plan_mesh(case, job, candidates, expected_hosts, expected_shape):
    plan = plan_mesh(job, candidates)
    assert len(plan.hosts) == expected_hosts, (case, plan.reason)
    assert plan.shape == expected_shape
    assert plan.reason


def test_plan_is_deterministic_and_dense():
    plan = plan_mesh(spec("data=-1"), list(reversed(hosts(3))))
    assert plan.hosts == ("h0", "h1", "h2")


def test_plan_reason_mentions_incomplete_domains():
    plan = plan_mesh(spec("data=-1", per_domain=2), hosts(3, per_domain=2))
    assert "incomplete failure domain" in plan.reason


@pytest.mark.parametrize("job,problem", [
    (spec("data=-1,model=2"), None),
    (spec("data=3", min_hosts=2, max_hosts=2), "fits no slice"),
    (spec("data=4", min_hosts=2, max_hosts=2), None),
    (spec("data=-1,model=2", devices=3, min_hosts=1, max_hosts=1), "fits no slice"),
    (spec("data=-1,model=2", devices=3, min_hosts=1, max_hosts=2), None),
    (spec("data=-1", per_domain=4, min_hosts=5, max_hosts=7), "no multiple"),
])
def test_check_satisfiable(job, problem):
    found = check_satisfiable(job)
    assert (found is None) if problem is None else (problem in found)
