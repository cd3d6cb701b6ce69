"""Compiling ahead for the next slice: the controller names the slices a lost
failure domain would leave (a pure table), the agent passes them to the
worker (tests/test_compile_cache.py, with the cache directory), process 0
compiles for them in the background, and a slice of that shape loads the
executable instead of compiling it."""

from __future__ import annotations

import json
import os

import pytest

from elastic.config import JobSpec, MeshSpec, RestartSpec
from elastic.worker_env import parse_next_slices
from elastic.policy.mesh import Candidate, plan_mesh
from elastic.policy.slice_plan import next_slices
from tests.conftest import REPO
from tests.test_checkpoint import run_processes


def spec(mesh="data=-1,model=2", min_hosts=2, max_hosts=4, per_domain=1,
         grow="after_checkpoint") -> JobSpec:
    return JobSpec(command=("w",), mesh=MeshSpec.from_text(mesh), min_hosts=min_hosts,
                   max_hosts=max_hosts, hosts_per_failure_domain=per_domain,
                   restart=RestartSpec(grow=grow))


def hosts(*devices: int, per_domain: int = 1) -> list[Candidate]:
    return [Candidate(f"h{i}", f"d{i // per_domain}", n) for i, n in enumerate(devices)]


@pytest.mark.parametrize("case,job,candidates,expected", [
    ("one host fewer", spec(), hosts(2, 2, 2, 2), ((3, 2),)),
    # after a failure the survivors restart alone, the spare joins at the
    # next grow (elastic.policy.slice_plan.survivors_plan)...
    ("a spare waits for the next grow", spec(), hosts(2, 2, 2, 2, 2), ((3, 2),)),
    # ...unless the policy takes it at once: then the shape stays
    ("a spare takes the lost host's place", spec(grow="never"), hosts(2, 2, 2, 2, 2), ()),
    ("a spare takes the lost host's place", spec(grow="immediately"), hosts(2, 2, 2, 2, 2),
     ()),
    ("min_hosts: a lost host ends the slice", spec(min_hosts=4), hosts(2, 2, 2, 2), ()),
    ("two hosts to a failure domain", spec(mesh="data=-1", per_domain=2),
     hosts(2, 2, 2, 2, per_domain=2), ((2, 2),)),
    # 2 hosts x 4 devices; without one of them, 3 hosts x 2: more processes
    # than this slice has, which process 0 cannot lay out
    ("a slice of more processes", spec(max_hosts=5), hosts(4, 4, 2, 2), ()),
    # 4 hosts x 2 of a:4, b:2, c:2, d:2: without b (or c, d) the same ranks
    # keep their device counts; without a, rank 0 would have 2, not 4
    ("ranks keep their devices", spec(mesh="data=-1"), hosts(4, 2, 2, 2), ((3, 2),)),
    # one 4-device host alone is below min_hosts: the host left out would
    # join with its 1 device, as rank 1, where this slice's rank 1 has 4:
    # process 0 could not lay that slice out, so it is not named
    ("a left-out host joins", spec(mesh="data=-1"),
     [Candidate("a", "a", 4), Candidate("b", "b", 4), Candidate("c", "c", 1)], ()),
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
    ahead = _ahead_event(first[0])
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
    ahead = _ahead_event(again[0])
    assert (ahead["stored"], ahead["present"]) == (0, 1), ahead
    assert again[0]["lowered_for"] == []
    # ...and without the note it lowers it, finds the entry, and notes it
    notes[0].unlink()
    third = _run_slice(tmp_path, 3, "third", "--ahead", ELASTIC_NEXT_SLICES="2x2")
    ahead = _ahead_event(third[0])
    assert (ahead["stored"], ahead["present"]) == (0, 1), ahead
    assert third[0]["lowered_for"] == [{"data": 2, "model": 2}] and notes[0].exists()


def _ahead_event(record: dict) -> dict:
    [event] = [e for e in record["ahead"] if e["kind"] == "compiled_ahead"]
    return event


@pytest.mark.parametrize("args,next_slices,outcome", [
    ((), "3x2", "fewer processes than the slice"),
    (("--bad-lower",), "1x2", "ValueError: this program cannot be lowered"),
])
def test_what_cannot_be_compiled_ahead_is_reported_not_raised(tmp_path, args, next_slices,
                                                              outcome):
    records = _run_slice(tmp_path, 2, "two", "--ahead", *args, ELASTIC_NEXT_SLICES=next_slices)
    ahead = _ahead_event(records[0])
    assert ahead["failed"] == 1 and outcome in ahead["reason"], ahead


def test_nothing_is_compiled_ahead_where_the_others_cannot_read_it(tmp_path):
    # each process its own directory: process 1 would compile for itself
    # anyway, and the slowest process gates the first step
    records = _run_slice(tmp_path, 2, "own", "--own-dir", "--ahead", ELASTIC_NEXT_SLICES="1x2")
    ahead = _ahead_event(records[0])
    assert (ahead["stored"], ahead["skipped"]) == (0, 1), ahead
    assert "process(es) 1 do not read process 0's executable cache" in ahead["reason"]
    assert records[0]["lowered_for"] == []
    assert not list((tmp_path / "cache").rglob("ahead-probe-*"))  # the probe is removed


def test_restart_spec_turns_it_on_by_default():
    assert RestartSpec().compile_ahead is True


def test_a_compile_cut_short_twice_is_not_tried_again(tmp_path):
    import jax
    import jax.numpy as jnp

    from elastic.worker import compile_cache as cache
    from elastic.worker.compile_ahead import MAX_ATTEMPTS, ensure_cached

    tiers = cache.cache_tiers(str(tmp_path))
    lowered = jax.jit(lambda x: x * 2).lower(jax.ShapeDtypeStruct((3,), jnp.float32))
    entry = cache.entry_name("f", lowered, 1, [0])
    note = "f-current.ahead-1x1"
    cache.write_note(tiers, note + ".attempts", str(MAX_ATTEMPTS))
    assert ensure_cached(cache, tiers, note, lambda: (entry, lowered)).startswith("skipped")
    assert not cache.has_entry(tiers, entry)
    # one attempt left: compiled, stored, and noted
    cache.write_note(tiers, note + ".attempts", str(MAX_ATTEMPTS - 1))
    assert ensure_cached(cache, tiers, note, lambda: (entry, lowered)) == "stored"
    assert cache.has_entry(tiers, entry) and cache.read_note(tiers, note) == entry
    # the attempt was counted before the compile, so a compile its
    # generation cuts short counts too
    assert cache.read_note(tiers, note + ".attempts") == str(MAX_ATTEMPTS)

    def must_not_lower():
        raise AssertionError("lowered again")

    assert ensure_cached(cache, tiers, note, must_not_lower) == "present"


def test_a_compile_no_tier_takes_is_a_failure_not_stored(tmp_path):
    import jax
    import jax.numpy as jnp

    from elastic.worker import compile_cache as cache
    from elastic.worker.compile_ahead import ensure_cached

    (tmp_path / "a-file").write_text("not a directory")
    tiers = cache.cache_tiers(str(tmp_path / "a-file"))
    lowered = jax.jit(lambda x: x * 2).lower(jax.ShapeDtypeStruct((3,), jnp.float32))
    outcome = ensure_cached(cache, tiers, "f-current.ahead-1x1",
                            lambda: (cache.entry_name("f", lowered, 1, [0]), lowered))
    assert outcome.startswith("failed: compiled, but no tier took the entry"), outcome


def test_a_malformed_hint_is_ignored_not_fatal(caplog):
    from elastic.worker_env import WorkerEnv

    env = WorkerEnv.from_environ({
        "JAX_COORDINATOR_ADDRESS": "127.0.0.1:1", "ELASTIC_PROCESS_ID": "0",
        "ELASTIC_NUM_PROCESSES": "1", "ELASTIC_GENERATION": "1", "ELASTIC_JOB_ID": "j",
        "ELASTIC_HOST_ID": "h", "ELASTIC_MESH": "data=-1", "ELASTIC_CHECKPOINT_DIR": "/c",
        "ELASTIC_DEVICES_PER_HOST": "1", "ELASTIC_NEXT_SLICES": "3x"})
    assert env.next_slices == ()
    assert "ELASTIC_NEXT_SLICES" in caplog.text
