"""Compiling ahead for the next slice: the controller names the slices a lost
failure domain would leave (a pure table), the agent passes them to the
worker (tests/test_compile_cache.py, with the cache directory), process 0
compiles for them in the background, and a slice of that shape loads the
executable instead of compiling it."""

from __future__ import annotations

import json
import os

import pytest

from elastic.config import JobSpec, MeshSpec, RestartSpec, parse_next_slices
from elastic.policy.mesh import Candidate, plan_mesh
from elastic.policy.slice_plan import next_slices
from tests.conftest import REPO
from tests.test_checkpoint import run_processes


def spec(mesh="data=-1,model=2", min_hosts=2, max_hosts=4, per_domain=1) -> JobSpec:
    return JobSpec(command=("w",), mesh=MeshSpec.from_text(mesh), min_hosts=min_hosts,
                   max_hosts=max_hosts, hosts_per_failure_domain=per_domain)


def hosts(*devices: int, per_domain: int = 1) -> list[Candidate]:
    return [Candidate(f"h{i}", f"d{i // per_domain}", n) for i, n in enumerate(devices)]


@pytest.mark.parametrize("case,job,candidates,expected", [
    ("one host fewer", spec(), hosts(2, 2, 2, 2), ((3, 2),)),
    ("a spare takes the lost host's place", spec(), hosts(2, 2, 2, 2, 2), ()),
    ("min_hosts: a lost host ends the slice", spec(min_hosts=4), hosts(2, 2, 2, 2), ()),
    ("two hosts to a failure domain", spec(mesh="data=-1", per_domain=2),
     hosts(2, 2, 2, 2, per_domain=2), ((2, 2),)),
    # model=2 needs an even device total: 3 hosts x 2 fit, so does 2 x 2 (the
    # slice of the 1-device host lost fits 3 x 2 and is the same shape)
    ("a mixed slice, by votes", spec(mesh="data=-1,model=2", max_hosts=5),
     hosts(4, 4, 2, 2), ((3, 2),)),
    # one 4-device host alone is below min_hosts: the host left out now
    # joins, and each uses 1 device
    ("a left-out host joins", spec(mesh="data=-1"),
     [Candidate("a", "a", 4), Candidate("b", "b", 4), Candidate("c", "c", 1)], ((2, 1),)),
    ("a single host", spec(min_hosts=1), hosts(2), ()),
])
def test_next_slices(case, job, candidates, expected):
    plan = plan_mesh(job, candidates)
    assert plan.hosts, plan.reason
    assert next_slices(job, candidates, plan) == expected, (case, plan.reason)


def test_next_slices_at_ten_thousand_hosts_plans_once_per_kind_of_domain(monkeypatch):
    import elastic.policy.slice_plan as slice_plan

    job = spec(mesh="data=-1", min_hosts=2, max_hosts=10_000)
    candidates = hosts(*[1] * 10_000)
    plan = plan_mesh(job, candidates)
    calls = []
    monkeypatch.setattr(slice_plan, "plan_mesh",
                        lambda *a: calls.append(1) or plan_mesh(*a))
    assert next_slices(job, candidates, plan) == ((9_999, 1),)
    assert len(calls) == 1


@pytest.mark.parametrize("text,expected", [("", ()), ("3x2", ((3, 2),)),
                                           ("3x2,2x4", ((3, 2), (2, 4)))])
def test_next_slices_variable(text, expected):
    assert parse_next_slices(text) == expected


@pytest.mark.parametrize("text", ["3", "3x", "0x2", "ax2", "3x2x1", "-1x2"])
def test_a_bad_next_slices_variable_is_named(text):
    with pytest.raises(ValueError, match="ELASTIC_NEXT_SLICES"):
        parse_next_slices(text)


COMPILE_WORKER = REPO / "tests" / "helpers" / "compile_worker.py"


def _run_slice(tmp_path, n: int, tag: str, *args: str, **env) -> list[dict]:
    """compile_worker.py as an n-process slice sharing tmp_path/cache; each
    process's record, its result checked."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", ELASTIC_CACHE_DIR=str(tmp_path / "cache"),
               **env)
    run_processes(n, [str(tmp_path / tag), *args], env, tmp_path / "ckpt",
                  helper=COMPILE_WORKER, timeout_s=120)
    records = [json.loads((tmp_path / f"{tag}.{i}.json").read_text()) for i in range(n)]
    for r in records:
        assert abs(r["result"] - r["expected"]) < 1e-4, r
    return records


def test_a_slice_of_the_next_shape_loads_what_process_0_compiled_ahead(tmp_path):
    first = _run_slice(tmp_path, 3, "three", "--ahead", ELASTIC_NEXT_SLICES="2x2")
    [ahead] = [e for e in first[0]["ahead"] if e["kind"] == "compiled_ahead"]
    assert (ahead["slices"], ahead["stored"], ahead["failed"]) == ("2x2", 1, 0), ahead
    assert not any(r["ahead"] for r in first[1:])  # process 0 only
    assert len(list((tmp_path / "cache").glob("f-*.xla"))) == 2  # 3 x 2 and 2 x 2
    # the slice of two processes, its first time: both load, none compiles,
    # and the loaded executable computes what the function does (checked in
    # _run_slice against numpy)
    assert [r["hit"] for r in _run_slice(tmp_path, 2, "two")] == [True, True]
    assert first[0]["lowered_for"] == [{"data": 2, "model": 2}]
    # a slice that compiled it ahead before neither compiles nor lowers it
    # again (its note in the cache names the entry)...
    notes = list((tmp_path / "cache").glob("f-*.ahead-2x2"))
    assert len(notes) == 1
    again = _run_slice(tmp_path, 3, "again", "--ahead", ELASTIC_NEXT_SLICES="2x2")
    [ahead] = [e for e in again[0]["ahead"] if e["kind"] == "compiled_ahead"]
    assert (ahead["stored"], ahead["present"]) == (0, 1), ahead
    assert again[0]["lowered_for"] == []
    # ...and without the note it lowers it, finds the entry, and notes it
    notes[0].unlink()
    third = _run_slice(tmp_path, 3, "third", "--ahead", ELASTIC_NEXT_SLICES="2x2")
    [ahead] = [e for e in third[0]["ahead"] if e["kind"] == "compiled_ahead"]
    assert (ahead["stored"], ahead["present"]) == (0, 1), ahead
    assert third[0]["lowered_for"] == [{"data": 2, "model": 2}] and notes[0].exists()


def test_a_slice_it_cannot_lay_out_is_reported_not_raised(tmp_path):
    records = _run_slice(tmp_path, 2, "two", "--ahead", ELASTIC_NEXT_SLICES="3x2")
    [ahead] = [e for e in records[0]["ahead"] if e["kind"] == "compiled_ahead"]
    assert ahead["failed"] == 1 and "fewer processes" in ahead["reason"], ahead


def test_restart_spec_turns_it_on_by_default():
    assert RestartSpec().compile_ahead is True


def test_a_compile_cut_short_twice_is_not_tried_again(tmp_path):
    import jax
    import jax.numpy as jnp

    from elastic.worker import compile_cache as cache
    from elastic.worker.compile_ahead import MAX_ATTEMPTS, _ensure

    tiers = cache.cache_tiers(str(tmp_path))
    lowered = jax.jit(lambda x: x * 2).lower(jax.ShapeDtypeStruct((3,), jnp.float32))
    entry = cache.entry_name("f", lowered, 1, [0])
    note = "f-current.ahead-1x1"
    cache.write_note(tiers, note + ".attempts", str(MAX_ATTEMPTS))
    assert _ensure(cache, tiers, note, lambda: (entry, lowered)).startswith("skipped")
    assert not cache.holds(tiers, entry)
    # one attempt left: compiled, stored, and noted
    cache.write_note(tiers, note + ".attempts", str(MAX_ATTEMPTS - 1))
    assert _ensure(cache, tiers, note, lambda: (entry, lowered)) == "stored"
    assert cache.holds(tiers, entry) and cache.read_note(tiers, note) == entry

    def must_not_lower():
        raise AssertionError("lowered again")

    assert _ensure(cache, tiers, note, must_not_lower) == "present"
