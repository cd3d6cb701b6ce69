"""The executable cache: a restart on a slice shape seen before loads the
compiled train step instead of compiling it, whichever host compiled it."""

from __future__ import annotations

import json
import os
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

from elastic.worker.compile_cache import compile_cached
from tests.conftest import REPO, write_spec
from tests.test_checkpoint import run_processes


def _lowered(scale: float):
    return jax.jit(lambda x: jnp.tanh(x) * scale).lower(jax.ShapeDtypeStruct((4, 3), jnp.float32))


def test_compiled_once_then_loaded_and_a_damaged_entry_compiled_again(tmp_path):
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    compiled, hit, _ = compile_cached(_lowered(2.0), str(tmp_path), "f")
    assert not hit
    entries = list(tmp_path.glob("f-*.xla"))
    assert len(entries) == 1
    loaded, hit, _ = compile_cached(_lowered(2.0), str(tmp_path), "f")
    assert hit
    np.testing.assert_array_equal(loaded(x), compiled(x))
    # another program is another entry, never the cached one
    other, hit, _ = compile_cached(_lowered(3.0), str(tmp_path), "f")
    assert not hit and len(list(tmp_path.glob("f-*.xla"))) == 2
    np.testing.assert_allclose(other(x), np.tanh(x) * 3.0, rtol=1e-6)
    # a truncated entry is compiled again and rewritten, never an error
    entries[0].write_bytes(entries[0].read_bytes()[:100])
    again, hit, _ = compile_cached(_lowered(2.0), str(tmp_path), "f")
    assert not hit
    np.testing.assert_array_equal(again(x), compiled(x))
    assert compile_cached(_lowered(2.0), str(tmp_path), "f")[1]


RECORD_ENV = """
import json, os, pathlib
out = pathlib.Path(os.environ["RECORD_DIR"]) / (os.environ["ELASTIC_HOST_ID"] + ".json")
out.write_text(json.dumps({"cache_dir": os.environ["ELASTIC_CACHE_DIR"]}))
"""


def test_simulated_hosts_share_one_cache_directory(tmp_path, local_job, compile_cache):
    script = tmp_path / "record_env.py"
    script.write_text(RECORD_ENV)
    records = tmp_path / "records"
    records.mkdir()
    spec = write_spec(tmp_path / "job.toml", f"""
        [job]
        id = "cache"
        command = {json.dumps([sys.executable, str(script)])}
        min_hosts = 3
        max_hosts = 3
        env = {{ RECORD_DIR = "{records}" }}
        """)
    job = local_job(spec, hosts=3)
    assert job.wait(60) == 0, job.output()
    seen = {p.stem: json.loads(p.read_text())["cache_dir"] for p in records.glob("*.json")}
    assert sorted(seen) == ["host-0", "host-1", "host-2"]
    # the session's cache (tests pass --compile-cache-dir; by default one
    # under the state dir)
    assert set(seen.values()) == {str(compile_cache)}


COMPILE_WORKER = REPO / "tests" / "helpers" / "compile_worker.py"


def _slice_compiles(tmp_path, cache: pathlib.Path, tag: str, *args: str) -> list[dict]:
    """Run compile_worker.py as a 2-process slice; each process's record."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", ELASTIC_CACHE_DIR=str(cache))
    run_processes(2, [str(tmp_path / tag), *args], env, tmp_path / "ckpt",
                  helper=COMPILE_WORKER, timeout_s=90)
    records = [json.loads((tmp_path / f"{tag}.{i}.json").read_text()) for i in range(2)]
    for r in records:
        assert abs(r["result"] - r["expected"]) < 1e-4, r
    return records


def test_a_shared_directory_compiles_once_per_slice(tmp_path):
    cache = tmp_path / "cache"
    first = _slice_compiles(tmp_path, cache, "first")
    # process 0 compiled; process 1 waited for its entry and ran it
    assert [r["hit"] for r in first] == [False, True]
    assert len(list(cache.glob("f-*.xla"))) == 1 and not list(cache.glob("*.claim"))
    assert [r["hit"] for r in _slice_compiles(tmp_path, cache, "again")] == [True, True]


def test_processes_that_share_no_directory_each_compile(tmp_path):
    cache = tmp_path / "cache"
    records = _slice_compiles(tmp_path, cache, "own", "--own-dir")
    assert [r["hit"] for r in records] == [False, False]
    assert len(list(cache.glob("h*/f-*.xla"))) == 2
