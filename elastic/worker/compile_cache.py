"""A cache of compiled executables, kept across generations, so that a
restart on a slice shape seen before loads the train step instead of
compiling it again.

Why not JAX's persistent compilation cache: on multi-process runs JAX writes
entries from process 0 only, and every process's key differs (its device ids
are in it), so the other processes compile again after every restart, and
the slowest one gates the first step. Measured on 4 local hosts x 2 CPU
devices on 2 cores: compiling the reference train step takes about 6 s per
process when all compile at once; loading it takes a fraction of a second.

The key covers the lowered program text, the JAX/jaxlib versions and the
slice (process count and every device id, in order), not the process's rank:
an SPMD executable is one program for the whole slice, and a process loads
the one another rank compiled (checked: tests/test_compile_cache.py). So
when hosts share the directory (`elastic-agent --compile-cache-dir`;
`elasticd local` gives its simulated hosts one, as they are one machine),
a shape is compiled once per slice: process 0 compiles and writes the entry,
and the others, on a miss, wait for it through the JAX coordination service
and load it. Whether the directory is shared is found out on each miss:
process 0 leaves a claim file with a fresh token in its directory and posts
the token; a process that sees the same file shares the directory, one that
does not compiles for itself at once.

Entries are written atomically (temporary file, then rename). Share a
directory only between hosts of one machine type (an executable compiled
for the CPU backend targets the compiling CPU's features) that trust each
other: deserialising an executable can run arbitrary code.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pathlib
import time
import uuid

log = logging.getLogger("elastic.compile_cache")

# how long a process waits for process 0 to compile a shared entry (seconds):
# longer than any compile, bounded so that a lost process 0 cannot hang it
SHARED_WAIT_S = 600.0


def cache_key(lowered, process_count: int, device_ids: list[int]) -> str:
    """Hex digest identifying `lowered` compiled for a slice of
    `process_count` processes over `device_ids` (all of the slice's, in
    order); the same on every process of the slice."""
    import jax
    import jaxlib

    h = hashlib.sha256()
    for part in (jax.__version__, jaxlib.__version__, str(process_count),
                 ",".join(map(str, device_ids)), lowered.as_text()):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


def _load(path: pathlib.Path, lowered):
    from jax.experimental import serialize_executable

    try:
        return serialize_executable.deserialize_and_load(path.read_bytes(), lowered.in_tree,
                                                         lowered.out_tree)
    except Exception as e:  # a stale or damaged entry: compile again
        log.warning("cannot load cached executable %s (%s); compiling", path, e)
        return None


def _compile_and_store(path: pathlib.Path, lowered):
    from jax.experimental import serialize_executable

    compiled = lowered.compile()
    try:
        payload, _, _ = serialize_executable.serialize(compiled)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(payload)
        tmp.replace(path)
    except Exception as e:  # caching is an optimisation; training goes on
        log.warning("cannot cache executable %s: %s", path, e)
    return compiled


def _kv(key: str, what: str) -> str:
    return f"elastic/compile/{key}/{what}"


def _compile_as_process_0(client, key: str, path: pathlib.Path, lowered):
    """Process 0's miss: claim the entry (a claim file with a fresh token,
    the token posted), compile and store it, then post that it is done."""
    claim, token = path.with_suffix(".claim"), uuid.uuid4().hex
    try:
        claim.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        claim.write_text(token)
    except OSError as e:
        log.warning("cannot write %s (%s): every process compiles", claim, e)
        token = "unshared"
    client.key_value_set(_kv(key, "claim"), token, allow_overwrite=True)
    try:
        return _compile_and_store(path, lowered)
    finally:
        client.key_value_set(_kv(key, "done"), "1", allow_overwrite=True)
        claim.unlink(missing_ok=True)


def _wait_for_process_0(client, key: str, path: pathlib.Path, lowered):
    """Another process's miss: process 0's entry once it is done, if this
    process sees its claim file (a shared directory); None otherwise, or if
    the entry does not load."""
    token = client.blocking_key_value_get(_kv(key, "claim"), int(SHARED_WAIT_S * 1000))
    try:
        shared = token not in ("loaded", "unshared") and \
            path.with_suffix(".claim").read_text() == token
    except OSError:  # no claim: not shared, or process 0 is already done
        shared = False
    if shared:
        client.blocking_key_value_get(_kv(key, "done"), int(SHARED_WAIT_S * 1000))
    return _load(path, lowered) if path.exists() else None


def _coordination_client():
    from jax._src import distributed

    return distributed.global_state.client


def compile_cached(lowered, cache_dir: str | None, name: str = "fn"):
    """`lowered.compile()`, or its executable loaded from `cache_dir` when a
    process compiled the same program for the same slice shape before (this
    one, or another sharing the directory: then, on a miss in a slice of
    several processes, process 0 compiles and the others load its entry).

    Returns (compiled, hit: bool, seconds); `hit` also when the entry came
    from process 0 during this call. With `cache_dir` None this is a plain
    compile. A cache entry that fails to load is compiled again and
    overwritten (never an error). Every process of the slice must call it
    for the same programs in the same order (as for any collective); a
    process other than 0 waits up to SHARED_WAIT_S seconds for process 0."""
    import jax

    t0 = time.perf_counter()
    if not cache_dir:
        return lowered.compile(), False, time.perf_counter() - t0
    key = cache_key(lowered, jax.process_count(), [d.id for d in jax.devices()])
    path = pathlib.Path(cache_dir) / f"{name}-{key}.xla"
    compiled = _load(path, lowered) if path.exists() else None
    client = _coordination_client() if jax.process_count() > 1 else None
    if client is not None and jax.process_index() == 0:
        if compiled is None:
            return _compile_as_process_0(client, key, path, lowered), False, \
                time.perf_counter() - t0
        client.key_value_set(_kv(key, "claim"), "loaded", allow_overwrite=True)
    elif client is not None and compiled is None:
        compiled = _wait_for_process_0(client, key, path, lowered)
    if compiled is not None:
        return compiled, True, time.perf_counter() - t0
    return _compile_and_store(path, lowered), False, time.perf_counter() - t0
