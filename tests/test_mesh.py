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


# --- hosts that differ: device counts and kinds ----------------------------------------

def mixed(*counts, kinds=None, per_domain: int = 1) -> list[Candidate]:
    """Hosts h0, h1, ... with these device counts (and kinds, default "cpu")."""
    kinds = kinds or ["cpu"] * len(counts)
    return [Candidate(f"h{i}", f"d{i // per_domain}", n, k)
            for i, (n, k) in enumerate(zip(counts, kinds))]


def typed(mesh: str, kind: str = "", **kw) -> JobSpec:
    import dataclasses
    return dataclasses.replace(spec(mesh, **kw), device_kind=kind)


@pytest.mark.parametrize("case,job,candidates,hosts,per_host,shape,left_out", [
    # the case: one host lost a chip; the other three run without it
    ("one degraded host left out", spec("data=-1,model=2", max_hosts=4), mixed(2, 2, 2, 1),
     ("h0", "h1", "h2"), 2, (3, 2), {"h3": "reports 1 device; the slice's hosts use 2"}),
    # 2x2 = 4 devices either way: whole hosts win (fewer hosts, none idle)
    ("a tie goes to whole hosts", spec("data=-1,model=2", max_hosts=4), mixed(2, 2, 1, 1),
     ("h0", "h1"), 2, (2, 2), {"h2": "reports 1 device; the slice's hosts use 2",
                               "h3": "reports 1 device; the slice's hosts use 2"}),
    # 4 hosts x 1 device beat 1 host x 2: the 2-device host uses one of them
    ("a subset of every host when it puts more devices in the mesh",
     spec("data=-1,model=2", max_hosts=4), mixed(2, 1, 1, 1),
     ("h0", "h1", "h2", "h3"), 1, (2, 2), {}),
    ("hosts with exactly the count are taken first", spec("data=-1", max_hosts=2, devices=2),
     mixed(4, 2, 2), ("h1", "h2"), 2, (4,), {}),
    ("fixed mesh: one 4-device host beats two 2-device ones",
     spec("data=2,model=2", max_hosts=4), mixed(4, 2, 2), ("h0",), 4, (2, 2),
     {"h1": "reports 2 devices; the slice's hosts use 4",
      "h2": "reports 2 devices; the slice's hosts use 4"}),
    ("job.devices_per_host = 1 makes every host use one", spec("data=-1", devices=1),
     mixed(2, 2, 1), ("h0", "h1", "h2"), 1, (3,), {}),
    ("job.devices_per_host = 2 leaves the 1-device host out", spec("data=-1", devices=2),
     mixed(2, 2, 1), ("h0", "h1"), 2, (4,), {"h2": "reports 1 device; the slice's hosts use 2"}),
    ("the kind with more devices", spec("data=-1"), mixed(2, 2, 2, 2, 2,
                                                          kinds=["a", "a", "b", "b", "b"]),
     ("h2", "h3", "h4"), 2, (6,),
     {"h0": "reports devices of kind 'a'; the slice runs on 'b'",
      "h1": "reports devices of kind 'a'; the slice runs on 'b'"}),
    ("job.device_kind chooses", typed("data=-1", kind="a"),
     mixed(2, 2, 2, 2, 2, kinds=["a", "a", "b", "b", "b"]), ("h0", "h1"), 2, (4,),
     {h: "reports devices of kind 'b'; job.device_kind is 'a'" for h in ("h2", "h3", "h4")}),
    # a TPU slice with one short host: the whole domain waits out, the other runs
    ("a domain with a degraded host is left out whole",
     spec("data=-1,model=2", per_domain=2, max_hosts=4), mixed(2, 2, 2, 1, per_domain=2),
     ("h0", "h1"), 2, (2, 2), {"h2": "h3 in its failure domain d1 does not fit",
                               "h3": "reports 1 device; the slice's hosts use 2"}),
])
def test_plan_with_hosts_that_differ(case, job, candidates, hosts, per_host, shape, left_out):
    plan = plan_mesh(job, candidates)
    assert (plan.hosts, plan.devices_per_host, plan.shape) == (hosts, per_host, shape), \
        (case, plan.reason)
    assert dict(plan.left_out) == left_out, case
    for host in left_out:
        assert host in plan.reason or len(left_out) > 1


def test_plan_reason_says_which_option_it_chose_and_why():
    tie = plan_mesh(spec("data=-1,model=2", max_hosts=4), mixed(2, 2, 1, 1))
    assert "chosen over 4 hosts x 1 device (as many devices, on fewer hosts)" in tie.reason
    more = plan_mesh(spec("data=-1,model=2", max_hosts=4), mixed(2, 2, 2, 1))
    assert "chosen over 4 hosts x 1 device (more devices)" in more.reason
    assert "left out: h3 (reports 1 device; the slice's hosts use 2)" in more.reason
    subset = plan_mesh(spec("data=-1,model=2", max_hosts=4), mixed(2, 1, 1, 1))
    assert "1 host uses 1 of its devices (h0)" in subset.reason


@pytest.mark.parametrize("job,candidates,expected", [
    (spec("data=-1,model=5", min_hosts=2), mixed(2, 2, 1),
     "mesh data=-1,model=5 fits no slice of 2 to 3 of the 3 ready hosts (hosts with 1, 2 "
     "devices"),
    (spec("data=4,model=2", min_hosts=1), mixed(2, 2, 1),
     "mesh data=4,model=2 fits no slice"),
    (typed("data=-1", kind="tpu"), mixed(2, 2), "none of the 2 ready reports devices of kind "
                                                "'tpu' (job.device_kind)"),
])
def test_a_spec_no_set_of_hosts_satisfies_says_why(job, candidates, expected):
    plan = plan_mesh(job, candidates)
    assert plan.hosts == () and expected in plan.reason, plan.reason


def test_planning_thousands_of_mixed_hosts_is_linear_enough():
    import time
    candidates = mixed(*([8] * 3000 + [7] * 20 + [4] * 5))
    t = time.perf_counter()
    plan = plan_mesh(spec("data=-1,model=8", max_hosts=4096), candidates)
    elapsed = time.perf_counter() - t
    assert len(plan.hosts) == 3000 and plan.devices_per_host == 8
    assert len(plan.left_out) == 25
    assert elapsed < 5.0  # generous: a pass of the controller; ~0.05 s here


@pytest.mark.parametrize("mesh", ["data=-1", "data=-1,model=2", "data=-1,model=3",
                                  "data=4,model=2", "data=3", "x=2,y=-1,z=3"])
def test_most_domains_is_the_largest_count_that_fits(mesh):
    from elastic.policy.mesh import _most_domains
    m = MeshSpec.from_text(mesh)
    for per_domain in range(1, 13):
        for at_most in range(30):
            brute = max((n for n in range(1, at_most + 1) if mesh_shape(m, per_domain * n)),
                        default=0)
            assert _most_domains(m, per_domain, at_most) == brute, (per_domain, at_most)


def test_skipping_counts_that_cannot_win_changes_no_plan(monkeypatch):
    import random
    from elastic.policy import mesh
    rng = random.Random(7)
    for trial in range(200):
        job = spec(rng.choice(["data=-1", "data=-1,model=2", "data=-1,model=4", "data=8"]),
                   max_hosts=rng.randint(1, 12), devices=None)
        candidates = mixed(*(rng.randint(1, 16) for _ in range(rng.randint(1, 14))))
        monkeypatch.setattr(mesh, "MANY_COUNTS", 0)
        pruned = plan_mesh(job, candidates)
        monkeypatch.setattr(mesh, "MANY_COUNTS", 10**9)
        full = plan_mesh(job, candidates)
        assert (pruned.hosts, pruned.devices_per_host, pruned.shape) == \
            (full.hosts, full.devices_per_host, full.shape), (trial, full.reason)


def test_a_tie_between_kinds_says_so():
    plan = plan_mesh(spec("data=-1"), mixed(2, 2, kinds=["b", "a"]))
    assert plan.hosts == ("h1",) and "chosen over 1 host x 2 devices of 'b' (as many devices " \
        "and hosts; 'a' sorts first)" in plan.reason


def test_hosts_below_job_devices_per_host_are_named_even_when_nothing_fits():
    plan = plan_mesh(spec("data=-1", devices=4), mixed(2, 2))
    assert plan.hosts == ()
    assert "none of the 2 ready has 4 devices (job.devices_per_host; the most is 2)" in plan.reason
    assert plan.left_out == {"h0": "reports 2 devices; job.devices_per_host is 4",
                             "h1": "reports 2 devices; job.devices_per_host is 4"}


def test_hosts_of_an_incomplete_domain_wait_rather_than_being_left_out():
    plan = plan_mesh(spec("data=-1", per_domain=2), mixed(2, 2, 2, per_domain=2))
    assert plan.hosts == ("h0", "h1") and plan.left_out == {}
    assert "1 incomplete failure domain(s) left out" in plan.reason


@pytest.mark.parametrize("per_domain,domains,planned", [
    # every agent says --failure-domain zone-a, the job's domains are 1 host:
    # before, nothing fit, and the reason said "incomplete", naming no host
    (1, ["zone-a"] * 3, ()),
    (1, ["zone-a", "zone-a", "zone-b"], ("h2",)),    # zone-b alone is whole
    (2, ["zone-a"] * 3 + ["zone-b"] * 2, ("h3", "h4")),
])
def test_a_failure_domain_with_too_many_hosts_is_named_and_its_hosts_left_out(
        per_domain, domains, planned):
    candidates = [Candidate(f"h{i}", d, 2) for i, d in enumerate(domains)]
    plan = plan_mesh(spec("data=-1", per_domain=per_domain), candidates)
    assert plan.hosts == planned
    crowded = [c.host_id for c in candidates if c.failure_domain == "zone-a"]
    assert plan.left_out == {h: f"its failure domain zone-a has {len(crowded)} hosts; "
                             f"job.hosts_per_failure_domain is {per_domain}" for h in crowded}
    assert (f"1 failure domain(s) with more hosts than job.hosts_per_failure_domain = "
            f"{per_domain} left out: zone-a has {len(crowded)}") in plan.reason
    assert "incomplete" not in plan.reason
