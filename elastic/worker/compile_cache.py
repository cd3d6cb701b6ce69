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
the one another rank compiled (checked: tests/test_compile_cache.py).

Two tiers: this host's directory (`elastic-agent --compile-cache-dir`), then
optionally one its hosts share (`--shared-compile-cache`: a gs://bucket/prefix,
or a directory on a common filesystem). A lookup tries them in order; an
entry found in the shared tier is copied into the host's. On a miss
everywhere in a slice of several processes, process 0 compiles and writes
the entry to both tiers, and every process that shares a tier with it
waits for the entry through the JAX coordination service and loads it: so a
slice shape is compiled once per slice, also by hosts that share nothing
but a bucket, and a new job of the same program starts warm. Whether a tier
is shared is found out on each miss: process 0 leaves a claim (a file or
object with a fresh token) in each of its tiers and posts the token; a
process that reads the same token from one of its tiers shares that tier,
one that does not compiles for itself at once.

Entries are written atomically (a directory: temporary file, then rename; a
bucket: an object appears whole). Share a tier only between hosts of one
machine type (an executable compiled for the CPU backend targets the
compiling CPU's features) that trust each other and trust whoever can write
it: deserialising an executable can run arbitrary code. Caching is an
optimisation: a tier that cannot be read or written is warned about and
skipped, never an error.
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
# how long one bucket call retries transient errors (seconds)
BUCKET_RETRY_S = 10.0


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


class DirectoryTier:
    """Entries as files in a directory (made private on the first write)."""

    def __init__(self, path: str) -> None:
        self.path = pathlib.Path(path)

    def __str__(self) -> str:
        return str(self.path)

    def read(self, name: str) -> bytes | None:
        """The object `name`'s bytes, None if absent. Raises OSError."""
        try:
            return (self.path / name).read_bytes()
        except FileNotFoundError:
            return None

    def write(self, name: str, data: bytes) -> None:
        """Write `name` atomically. Raises OSError."""
        self.path.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = self.path / f"{name}.tmp{os.getpid()}"
        tmp.write_bytes(data)
        tmp.replace(self.path / name)

    def remove(self, name: str) -> None:
        (self.path / name).unlink(missing_ok=True)


class BucketTier:
    """Entries as objects under a gs://bucket/prefix (google-cloud-storage;
    STORAGE_EMULATOR_HOST points it at an emulator). Transient errors are
    retried for BUCKET_RETRY_S seconds (elastic.checkpoint.gcs's policy)."""

    def __init__(self, url: str) -> None:
        from elastic.checkpoint import gcs

        self.url = url
        self._bucket_name, self._prefix = gcs.split(url)
        self._retrying = gcs._retrying(BUCKET_RETRY_S)
        self._bucket = None

    def __str__(self) -> str:
        return self.url

    def _blob(self, name: str):
        if self._bucket is None:
            from elastic.checkpoint import gcs

            self._bucket = gcs.client().bucket(self._bucket_name)
        return self._bucket.blob(self._prefix + name)

    def read(self, name: str) -> bytes | None:
        from google.api_core import exceptions

        try:
            return self._retrying(lambda: self._blob(name).download_as_bytes(retry=None))
        except exceptions.NotFound:
            return None

    def write(self, name: str, data: bytes) -> None:
        self._retrying(lambda: self._blob(name).upload_from_string(data, retry=None))

    def remove(self, name: str) -> None:
        from google.api_core import exceptions

        try:
            self._retrying(lambda: self._blob(name).delete(retry=None))
        except exceptions.NotFound:
            pass


def tier(where: str | None):
    """The tier for a directory or gs:// URL; None for None or ""."""
    if not where:
        return None
    return BucketTier(where) if where.startswith("gs://") else DirectoryTier(where)


def _try(what: str, t, call, default=None):
    """`call()`, or `default` with a warning when the tier fails: a cache
    that cannot be used only means a compile."""
    try:
        return call()
    except Exception as e:  # noqa: BLE001 - storage errors of every kind
        log.warning("executable cache %s: cannot %s: %s", t, what,
                    f"{type(e).__name__}: {e}".splitlines()[0][:300])
        return default


def _load(tiers: list, entry: str, lowered):
    """The executable from the first tier that holds a loadable `entry`,
    copied into the tiers before it; None if none does."""
    from jax.experimental import serialize_executable

    for i, t in enumerate(tiers):
        payload = _try(f"read {entry}", t, lambda: t.read(entry))
        if payload is None:
            continue
        try:
            compiled = serialize_executable.deserialize_and_load(payload, lowered.in_tree,
                                                                 lowered.out_tree)
        except Exception as e:  # a stale or damaged entry: compile again
            log.warning("cannot load cached executable %s/%s (%s)", t, entry, e)
            continue
        for earlier in tiers[:i]:
            _try(f"write {entry}", earlier, lambda: earlier.write(entry, payload))
        return compiled
    return None


def _compile_and_store(tiers: list, entry: str, lowered):
    from jax.experimental import serialize_executable

    compiled = lowered.compile()
    payload = _try("serialize", "-", lambda: serialize_executable.serialize(compiled)[0])
    if payload is not None:
        for t in tiers:
            _try(f"write {entry}", t, lambda: t.write(entry, payload))
    return compiled


def _kv(key: str, what: str) -> str:
    return f"elastic/compile/{key}/{what}"


def _compile_as_process_0(client, key: str, tiers: list, entry: str, lowered):
    """Process 0's miss: claim the entry in every tier (a claim with a fresh
    token, the token posted), compile and store it, then post that it is
    done."""
    claim, token = f"{entry}.claim", uuid.uuid4().hex
    claimed = [t for t in tiers
               if _try(f"write {claim}", t, lambda: t.write(claim, token.encode()) or True)]
    client.key_value_set(_kv(key, "claim"), token if claimed else "unshared",
                         allow_overwrite=True)
    try:
        return _compile_and_store(tiers, entry, lowered)
    finally:
        client.key_value_set(_kv(key, "done"), "1", allow_overwrite=True)
        for t in claimed:
            _try(f"remove {claim}", t, lambda: t.remove(claim))


def _wait_for_process_0(client, key: str, tiers: list, entry: str, lowered):
    """Another process's miss: process 0's entry once it is done, from the
    first tier of this process where its claim is (a tier they share); None
    if there is none, or the entry does not load."""
    token = client.blocking_key_value_get(_kv(key, "claim"), int(SHARED_WAIT_S * 1000))
    if token in ("loaded", "unshared"):
        return _load(tiers, entry, lowered)  # process 0 had it: this tier may too, now
    shared = [t for t in tiers
              if _try(f"read {entry}.claim", t, lambda: t.read(f"{entry}.claim")) ==
              token.encode()]
    if shared:
        client.blocking_key_value_get(_kv(key, "done"), int(SHARED_WAIT_S * 1000))
        # (from the shared tier, copied into those before it)
        return _load(tiers[:tiers.index(shared[0]) + 1], entry, lowered)
    # no claim seen: no tier shared, or process 0 done already and removed it
    return _load(tiers, entry, lowered)


def _coordination_client():
    from jax._src import distributed

    return distributed.global_state.client


def compile_cached(lowered, cache_dir: str | None, name: str = "fn",
                   shared: str | None = None):
    """`lowered.compile()`, or its executable loaded from a cache when a
    process compiled the same program for the same slice shape before:
    this host's `cache_dir`, then the `shared` tier (a gs:// URL or a
    directory other hosts also use). On a miss in a slice of several
    processes, process 0 compiles and the processes that share a tier with
    it load its entry.

    Returns (compiled, hit: bool, seconds); `hit` also when the entry came
    from process 0 during this call. With neither tier this is a plain
    compile. An entry that fails to load is compiled again and overwritten;
    a tier that cannot be read or written is skipped with a warning (never
    an error). Every process of the slice must call it for the same
    programs in the same order (as for any collective); a process other
    than 0 waits up to SHARED_WAIT_S seconds for process 0."""
    import jax

    t0 = time.perf_counter()
    tiers = [t for t in (tier(cache_dir), tier(shared)) if t is not None]
    if not tiers:
        return lowered.compile(), False, time.perf_counter() - t0
    key = cache_key(lowered, jax.process_count(), [d.id for d in jax.devices()])
    entry = f"{name}-{key}.xla"
    compiled = _load(tiers, entry, lowered)
    client = _coordination_client() if jax.process_count() > 1 else None
    if client is not None and jax.process_index() == 0:
        if compiled is None:
            return _compile_as_process_0(client, key, tiers, entry, lowered), False, \
                time.perf_counter() - t0
        client.key_value_set(_kv(key, "claim"), "loaded", allow_overwrite=True)
    elif client is not None and compiled is None:
        compiled = _wait_for_process_0(client, key, tiers, entry, lowered)
    if compiled is not None:
        return compiled, True, time.perf_counter() - t0
    return _compile_and_store(tiers, entry, lowered), False, time.perf_counter() - t0
