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
import pytest

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


def test_the_same_program_with_other_compile_options_is_another_entry(tmp_path, monkeypatch):
    """An executable compiled with other XLA options is never loaded: the
    lowered text is the same, the options are in the key (as in JAX's own
    persistent cache)."""
    shape = jax.ShapeDtypeStruct((4, 3), jnp.float32)

    def lowered(**options):
        return jax.jit(lambda x: jnp.tanh(x) * 2.0, compiler_options=options or None).lower(shape)

    plain = lowered()
    assert plain.as_text() == lowered(xla_cpu_enable_fast_math=True).as_text()
    assert not compile_cached(plain, str(tmp_path), "f")[1]
    assert compile_cached(lowered(), str(tmp_path), "f")[1]
    assert not compile_cached(lowered(xla_cpu_enable_fast_math=True), str(tmp_path), "f")[1]
    assert compile_cached(lowered(xla_cpu_enable_fast_math=True), str(tmp_path), "f")[1]
    # the process's XLA_FLAGS too (JAX parses them once, at backend init:
    # only the key can be checked in process)
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=true")
    assert not compile_cached(lowered(), str(tmp_path), "f")[1]
    assert len(list(tmp_path.glob("f-*.xla"))) == 3


RECORD_ENV = """
import json, os, pathlib
out = pathlib.Path(os.environ["RECORD_DIR"]) / (os.environ["ELASTIC_HOST_ID"] + ".json")
out.write_text(json.dumps({"cache_dir": os.environ["ELASTIC_CACHE_DIR"],
                           "next": os.environ["ELASTIC_NEXT_SLICES"]}))
"""


@pytest.mark.parametrize("compile_ahead,next_slices", [(True, "2x1"), (False, "")])
def test_simulated_hosts_share_one_cache_directory(tmp_path, local_job, compile_cache,
                                                   compile_ahead, next_slices):
    """...and every worker is told the slices to compile for ahead
    (elastic.worker.compile_ahead): here, one host fewer."""
    script = tmp_path / "record_env.py"
    script.write_text(RECORD_ENV)
    records = tmp_path / "records"
    records.mkdir()
    spec = write_spec(tmp_path / "job.toml", f"""
        [job]
        id = "cache"
        command = {json.dumps([sys.executable, str(script)])}
        min_hosts = 2
        max_hosts = 3
        env = {{ RECORD_DIR = "{records}" }}
        [restart]
        compile_ahead = {str(compile_ahead).lower()}
        """)
    job = local_job(spec, hosts=3)
    assert job.wait(60) == 0, job.output()
    seen = {p.stem: json.loads(p.read_text()) for p in records.glob("*.json")}
    assert sorted(seen) == ["host-0", "host-1", "host-2"]
    # the session's cache (tests pass --compile-cache-dir; by default one
    # under the state dir)
    assert {r["cache_dir"] for r in seen.values()} == {str(compile_cache)}
    assert {r["next"] for r in seen.values()} == {next_slices}
    [started] = [e for e in job.journal() if e["kind"] == "generation_started"]
    assert started["next_slices"] == ([[2, 1]] if compile_ahead else [])


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
    # a program that gave its lowered program, not a function, keeps no
    # launch memo (elastic.worker.launch_memo): it did not opt in
    assert not list(cache.glob("*.launch"))
    assert [r["hit"] for r in _slice_compiles(tmp_path, cache, "again")] == [True, True]


def test_processes_that_share_no_directory_each_compile(tmp_path):
    cache = tmp_path / "cache"
    records = _slice_compiles(tmp_path, cache, "own", "--own-dir")
    assert [r["hit"] for r in records] == [False, False]
    assert len(list(cache.glob("h*/f-*.xla"))) == 2


@pytest.mark.parametrize("differs", ["--other-flags-on-1", "--no-cache-on-0"])
def test_a_process_whose_key_differs_from_process_0s_compiles_at_once(tmp_path, differs):
    # process 1 has the cache; process 0 compiles under another key (its
    # XLA_FLAGS differ) or keeps no cache: either way no entry will come,
    # and process 1 must compile at once, not wait (here 60 s, by default
    # 600 s) for it
    cache = tmp_path / "cache"
    records = _slice_compiles(tmp_path, cache, "differs", differs)
    assert [r["hit"] for r in records] == [False, False]
    [told] = records[1]["warnings"]
    assert ("under another key" if differs == "--other-flags-on-1" else
            "keeps no executable cache") in told, told
    assert "compiles for itself" in told
    assert records[0]["warnings"] == []
    # the next generation: each process with a cache loads its own entry
    again = _slice_compiles(tmp_path, cache, "again", differs)
    assert [r["hit"] for r in again] == ([True, True] if differs == "--other-flags-on-1"
                                         else [False, True])
    assert [r["warnings"] for r in again] == [[], []]


def _key_file(path: pathlib.Path, key: bytes = b"k" * 32) -> str:
    path.write_bytes(key)
    path.chmod(0o600)
    return str(path)


def _bucket_entries(gcs_emulator, bucket_url: str, prefix: str) -> list[str]:
    return sorted(b.name for b in gcs_emulator.client().list_blobs(bucket_url[5:], prefix=prefix))


def test_a_bucket_tier_is_written_read_back_into_the_host_and_mended(
        tmp_path, gcs_emulator, gcs_bucket, monkeypatch):
    for name, value in gcs_emulator.env.items():
        monkeypatch.setenv(name, value)
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    shared, key = f"{gcs_bucket}/cache", _key_file(tmp_path / "key")
    compiled, hit, _ = compile_cached(_lowered(2.0), str(tmp_path / "a"), "f", shared, key)
    assert not hit
    [entry] = _bucket_entries(gcs_emulator, gcs_bucket, "cache/")
    assert entry.startswith("cache/f-") and entry.endswith(".xla")
    # another host (an empty directory of its own) loads it from the bucket
    # and keeps a copy
    loaded, hit, _ = compile_cached(_lowered(2.0), str(tmp_path / "b"), "f", shared, key)
    assert hit
    np.testing.assert_array_equal(loaded(x), compiled(x))
    assert [p.name for p in (tmp_path / "b").glob("f-*.xla")] == [entry[len("cache/"):]]
    # an object not signed with the job's key (planted by whoever else can
    # write the bucket, or damaged) is never loaded: compiled again and replaced
    blob = gcs_emulator.client().bucket(gcs_bucket[5:]).blob(entry)
    genuine = blob.download_as_bytes()
    for planted in (b"not an executable", genuine[32:],
                    _with_other_key(genuine, entry, tmp_path)):
        blob.upload_from_string(planted)
        again, hit, _ = compile_cached(_lowered(2.0), str(tmp_path / "c"), "f", shared, key)
        assert not hit
        np.testing.assert_array_equal(again(x), compiled(x))
        assert blob.download_as_bytes() != planted
        (tmp_path / "c" / entry[len("cache/"):]).unlink()
    assert compile_cached(_lowered(2.0), str(tmp_path / "d"), "f", shared, key)[1]
    # without a usable key the shared tier is not used at all
    bare = tmp_path / "bare-key"
    assert not compile_cached(_lowered(2.0), str(tmp_path / "e"), "f", shared, None)[1]
    assert not compile_cached(_lowered(2.0), str(tmp_path / "g"), "f", shared,
                              _key_file(bare, b"short"))[1]


def _with_other_key(genuine: bytes, entry: str, tmp_path) -> bytes:
    """The same executable signed with another key."""
    import hashlib
    import hmac

    name, payload = entry[len("cache/"):], genuine[32:]
    return hmac.new(b"x" * 32, name.encode() + b"\0" + payload, hashlib.sha256).digest() + payload


def test_signing_keys_that_cannot_be_used_are_named(tmp_path):
    from elastic.worker.compile_cache import CacheKeyError, read_signing_key

    assert read_signing_key(_key_file(tmp_path / "good", b"s" * 40)) == b"s" * 40
    (tmp_path / "open").write_bytes(b"s" * 40)
    (tmp_path / "open").chmod(0o644)
    for path, text in ((_key_file(tmp_path / "short", b"s" * 31), "31 bytes; at least 32"),
                       (str(tmp_path / "open"), "mode 0644; only its owner may read it"),
                       (str(tmp_path / "missing"), "No such file")):
        with pytest.raises(CacheKeyError, match=text):
            read_signing_key(path)


def test_an_unreachable_bucket_only_means_compiling(tmp_path, monkeypatch, caplog):
    from elastic.checkpoint.emulator import endpoint_env, free_port
    from elastic.worker import compile_cache

    for name, value in endpoint_env(f"http://127.0.0.1:{free_port()}").items():
        monkeypatch.setenv(name, value)  # nothing listens there
    monkeypatch.setattr(compile_cache, "BUCKET_RETRY_S", 0.5)
    key = _key_file(tmp_path / "key")
    compiled, hit, _ = compile_cached(_lowered(2.0), str(tmp_path / "c"), "f", "gs://nowhere/cache",
                                      key)
    assert not hit
    x = np.ones((4, 3), np.float32)
    np.testing.assert_allclose(compiled(x), np.tanh(x) * 2.0, rtol=1e-6)
    assert "executable cache gs://nowhere/cache: cannot" in caplog.text
    # the host's own tier still got the entry
    assert compile_cached(_lowered(2.0), str(tmp_path / "c"), "f", "gs://nowhere/cache", key)[1]


def test_hosts_that_share_only_a_bucket_compile_once_per_slice(tmp_path, gcs_emulator,
                                                               gcs_bucket, monkeypatch):
    for name, value in gcs_emulator.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("ELASTIC_SHARED_CACHE", f"{gcs_bucket}/cache")
    monkeypatch.setenv("ELASTIC_SHARED_CACHE_KEY_FILE", _key_file(tmp_path / "key"))
    first = _slice_compiles(tmp_path, tmp_path / "disks1", "first", "--own-dir")
    # process 0 compiled into its disk and the bucket; process 1 found its
    # claim in the bucket, waited for the entry and loaded it
    assert [r["hit"] for r in first] == [False, True]
    [entry] = _bucket_entries(gcs_emulator, gcs_bucket, "cache/")  # no claim left
    assert sorted(p.parent.name for p in (tmp_path / "disks1").glob("h*/f-*.xla")) == ["h0", "h1"]
    # a new job on new disks starts warm from the bucket
    again = _slice_compiles(tmp_path, tmp_path / "disks2", "again", "--own-dir")
    assert [r["hit"] for r in again] == [True, True]
    assert _bucket_entries(gcs_emulator, gcs_bucket, "cache/") == [entry]


def test_a_planted_fifo_or_symlink_reads_as_absent_and_at_once(tmp_path):
    """Whoever can write a shared cache directory but holds no key could
    plant a FIFO (the reader waited for a writer forever) or a symlink to
    /dev/zero (it read until memory ran out), before any signature was
    checked (a security audit). Neither is read now; a regular file is."""
    from elastic.worker.compile_cache import DirectoryTier

    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "zeros").symlink_to("/dev/zero")
    (tmp_path / "entry").write_bytes(b"bytes")
    directory = DirectoryTier(str(tmp_path))
    assert directory.read("fifo") is None and directory.read("zeros") is None
    assert directory.read("entry") == b"bytes" and directory.read("absent") is None
