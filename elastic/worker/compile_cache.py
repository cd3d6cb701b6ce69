"""A cache of compiled executables, kept across generations, so that a
restart on a slice shape seen before loads the train step instead of
compiling it again.

Why not JAX's persistent compilation cache: on multi-process runs JAX writes
entries from process 0 only, and every process's key differs (its device ids
are in it), so the other processes compile again after every restart, and
the slowest one gates the first step. Measured on 4 local hosts x 2 CPU
devices on 2 cores: compiling the reference train step takes about 6 s per
process when all compile at once; loading it takes a fraction of a second.

The key covers the lowered program text, the JAX/jaxlib versions, the
options XLA compiles it with (the process's XLA_FLAGS and the program's own
`compiler_options`, as JAX's persistent cache keys them) and the slice
(process count and every device id, in order), not the process's rank:
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
one that does not compiles for itself at once. Process 0 also posts its key
for each program it compiles (counted per name: the Nth program of a name
is the same program on every process), so a process whose key differs
(other XLA_FLAGS, another JAX or machine type) or whose process 0 keeps no
cache compiles for itself at once instead of waiting for an entry that
will never come. Everything in the shared tier is signed (HMAC-SHA256)
with a key the job's hosts hold in a file (`elastic-agent
--shared-compile-cache-key`): writing to the bucket is not enough to have a
host run an executable.

Beside the entries, compiling ahead (elastic.worker.compile_ahead) keeps
small text objects: `<entry>.ahead-PxD` (the entry stored for the next slice
PxD), `<entry>.ahead-PxD.attempts` (this host's tier only) and, while a
generation checks that its processes share a tier, `ahead-probe-<token>`.

Entries are written atomically (a directory: temporary file, then rename; a
bucket: an object appears whole). Share a tier only between hosts of one
machine type (an executable compiled for the CPU backend targets the
compiling CPU's features) that trust each other and trust whoever can write
it: deserialising an executable can run arbitrary code. Caching is an
optimisation: a tier that cannot be read or written is warned about and
skipped, never an error.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import logging
import os
import pathlib
import re
import stat
import tempfile
import time
import uuid
from collections import Counter

log = logging.getLogger("elastic.compile_cache")

# how long a process waits for process 0 to compile a shared entry (seconds):
# longer than any compile, bounded so that a lost process 0 cannot hang it
SHARED_WAIT_S = 600.0
# what process 0 posts as its key for a program when it keeps no cache
UNCACHED = "uncached"
# how long one bucket call retries transient errors (seconds), and each
# request's (connect, read) timeouts (seconds; the library's default is 60)
BUCKET_RETRY_S = 10.0
BUCKET_TIMEOUT = (5.0, 30.0)


def machine_type() -> str:
    """What an executable is compiled for beyond the program: the device
    kind and the backend's platform version, and on CPU this CPU's feature
    flags (an executable compiled where AVX-512 exists dies of SIGILL
    elsewhere, which no exception handler catches). The same on every
    host of one machine type."""
    import jax

    device = jax.devices()[0]
    parts = [device.platform, device.device_kind,
             getattr(device.client, "platform_version", "")]
    if device.platform == "cpu":
        try:
            with open("/proc/cpuinfo") as f:
                flags = next((line for line in f if line.startswith("flags")), "")
        except OSError:
            flags = ""
        parts.append(hashlib.sha256(" ".join(sorted(flags.split())).encode()).hexdigest())
    return "|".join(parts)


def compile_options_text(lowered) -> str:
    """The options XLA compiles `lowered` with, as text: this process's
    XLA_FLAGS, sorted, and the `compiler_options` given to `jax.jit` (kept by
    JAX on the lowering; none if a JAX version keeps them elsewhere)."""
    from elastic import worker_env

    kvs = getattr(getattr(lowered, "_lowering", None), "_compiler_options_kvs", ()) or ()
    return repr((sorted(worker_env.xla_flags().split()), sorted((str(k), repr(v)) for k, v in kvs)))


def cache_key(lowered, process_count: int, device_ids: list[int]) -> str:
    """Hex digest identifying `lowered` compiled with its options
    (`compile_options_text`) for a slice of `process_count` processes over
    `device_ids` (all of the slice's, in order) on this machine type
    (`machine_type`); the same on every process of the slice."""
    import jax
    import jaxlib

    h = hashlib.sha256()
    for part in (jax.__version__, jaxlib.__version__, machine_type(), str(process_count),
                 ",".join(map(str, device_ids)), compile_options_text(lowered),
                 lowered.as_text()):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


class DirectoryTier:
    """Entries as files in a directory (created 0700 if it does not exist;
    an existing one is used as it is)."""

    def __init__(self, path: str) -> None:
        self.path = pathlib.Path(path)

    def __str__(self) -> str:
        return str(self.path)

    def read(self, name: str) -> bytes | None:
        """The object `name`'s bytes, None if absent or not a regular file
        (a symlink, which is not followed, a FIFO, a device: what someone
        who can write a shared directory may plant to hang or flood the
        reader before any signature is checked). Raises OSError."""
        try:
            fd = os.open(self.path / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno == errno.ELOOP:  # (a symlink)
                log.warning("executable cache %s: %s is a symlink; ignored", self, name)
                return None
            raise
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                log.warning("executable cache %s: %s is not a regular file; ignored",
                            self, name)
                return None
            return f.read()

    def write(self, name: str, data: bytes) -> None:
        """Write `name` atomically. Raises OSError."""
        self.path.mkdir(parents=True, exist_ok=True, mode=0o700)
        # a fresh name (O_EXCL): hosts sharing the directory never write
        # into one temporary file, and nothing planted there is followed
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=self.path)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self.path / name)
        except BaseException:
            pathlib.Path(tmp).unlink(missing_ok=True)
            raise

    def remove(self, name: str) -> None:
        """Remove `name` if it is there. Raises OSError."""
        (self.path / name).unlink(missing_ok=True)

    def exists(self, name: str) -> bool:
        """Whether `name` is there (not read). Raises OSError."""
        return (self.path / name).is_file()


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
        """The object `name`'s bytes, None if absent. Raises what
        google-cloud-storage raises once transient errors have been retried
        for BUCKET_RETRY_S seconds."""
        from google.api_core import exceptions

        try:
            return self._retrying(lambda: self._blob(name).download_as_bytes(
                retry=None, timeout=BUCKET_TIMEOUT))
        except exceptions.NotFound:
            return None

    def write(self, name: str, data: bytes) -> None:
        """Upload `name` (an object appears whole). Raises as `read`."""
        self._retrying(lambda: self._blob(name).upload_from_string(data, retry=None,
                                                                   timeout=BUCKET_TIMEOUT))

    def remove(self, name: str) -> None:
        """Delete `name` if it is there. Raises as `read`."""
        from google.api_core import exceptions

        try:
            self._retrying(lambda: self._blob(name).delete(retry=None, timeout=BUCKET_TIMEOUT))
        except exceptions.NotFound:
            pass

    def exists(self, name: str) -> bool:
        """Whether the object `name` is there (not downloaded). Raises as `read`."""
        return self._retrying(lambda: self._blob(name).exists(retry=None,
                                                               timeout=BUCKET_TIMEOUT))


class CacheKeyError(ValueError):
    """A shared-cache signing key that cannot be used; the message says why."""


#: The shortest signing key accepted (bytes).
MIN_KEY_BYTES = 32


def read_signing_key(path: str) -> bytes:
    """The secret in the file `path` (its bytes as they are). Raises
    CacheKeyError when it cannot be read, holds fewer than MIN_KEY_BYTES
    bytes, or others than its owner may read or write it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            key = f.read(4096)
    except OSError as e:
        raise CacheKeyError(f"shared compile cache key {path}: {e.strerror or e}") from None
    if mode & 0o077:
        raise CacheKeyError(f"shared compile cache key {path}: mode {mode & 0o777:04o}; "
                            f"only its owner may read it (chmod 600)")
    if len(key) < MIN_KEY_BYTES:
        raise CacheKeyError(f"shared compile cache key {path}: {len(key)} bytes; at least "
                            f"{MIN_KEY_BYTES} (e.g. head -c 32 /dev/urandom > {path})")
    return key


class SignedTier:
    """A tier whose objects carry an HMAC-SHA256 of their name and bytes
    under a key the job's hosts hold (32 bytes, then the payload): an object
    written by anyone without the key — whoever else can write the bucket
    or the directory — reads as absent, is never deserialised, and is
    overwritten by the next compile."""

    def __init__(self, inner, key: bytes) -> None:
        self.inner, self._key = inner, key

    def __str__(self) -> str:
        return str(self.inner)

    def _mac(self, name: str, data: bytes) -> bytes:
        return hmac.new(self._key, name.encode() + b"\0" + data, hashlib.sha256).digest()

    def read(self, name: str) -> bytes | None:
        """`name`'s payload if its signature holds; None if absent or not
        signed with this key (warned). Raises what the inner tier raises."""
        signed = self.inner.read(name)
        if signed is None:
            return None
        mac, data = signed[:32], signed[32:]
        if len(signed) < 32 or not hmac.compare_digest(mac, self._mac(name, data)):
            log.warning("executable cache %s: %s is not signed with this job's key; ignored",
                        self, name)
            return None
        return data

    def write(self, name: str, data: bytes) -> None:
        """Write `data` signed (32 bytes of HMAC first). Raises as the inner tier."""
        self.inner.write(name, self._mac(name, data) + data)

    def remove(self, name: str) -> None:
        """Remove `name`. Raises as the inner tier."""
        self.inner.remove(name)

    def exists(self, name: str) -> bool:
        """Whether `name` is there; its signature is checked only when it
        is read (a planted object fails then, and is compiled again)."""
        return self.inner.exists(name)


def tier(where: str | None):
    """The tier for a directory or gs:// URL; None for None or "", or (with
    a warning) for a URL that names no bucket."""
    if not where:
        return None
    return _try("use it", where, lambda: BucketTier(where) if where.startswith("gs://")
                else DirectoryTier(where))


def _signed_tier(shared: str | None, key_file: str | None):
    """The shared tier at `shared`, signed with the key in `key_file`
    (SignedTier); None for no `shared`, and (warned) for no usable key."""
    shared_tier = tier(shared)
    if shared_tier is None:
        return None
    if not key_file:
        log.warning("executable cache %s: no signing key (ELASTIC_SHARED_CACHE_KEY_FILE); "
                    "not used", shared_tier)
        return None
    key = _try("read its signing key", shared_tier, lambda: read_signing_key(key_file))
    return None if key is None else SignedTier(shared_tier, key)


def _try(what: str, t, call, default=None):
    """`call()`, or `default` with a warning when the tier fails: a cache
    that cannot be used only means a compile."""
    try:
        return call()
    except Exception as e:  # noqa: BLE001 - storage errors of every kind
        log.warning("executable cache %s: cannot %s: %s", t, what,
                    f"{type(e).__name__}: {e}".splitlines()[0][:300])
        return default


def _load(tiers: list, entry: str, trees):
    """The executable from the first tier that holds a loadable `entry`,
    copied into the tiers before it; None if none does. `trees`: its
    (in_tree, out_tree), a lowered program's or a launch memo's."""
    from jax.experimental import serialize_executable

    in_tree, out_tree = trees
    for i, t in enumerate(tiers):
        payload = _try(f"read {entry}", t, lambda: t.read(entry))
        if payload is None:
            continue
        try:
            compiled = serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
        except Exception as e:  # a stale or damaged entry: compile again
            log.warning("cannot load cached executable %s/%s (%s)", t, entry, e)
            continue
        for earlier in tiers[:i]:
            _try(f"write {entry}", earlier, lambda: earlier.write(entry, payload))
        return compiled
    return None


def _trees(lowered) -> tuple:
    return lowered.in_tree, lowered.out_tree


def compile_and_store(tiers: list, entry: str, lowered):
    """Compile `lowered` and write its executable as `entry` into every
    tier (a tier that fails is warned about); returns the compiled
    executable. Raises what compiling raises."""
    from jax.experimental import serialize_executable

    compiled = lowered.compile()
    payload = _try("serialize", "-", lambda: serialize_executable.serialize(compiled)[0])
    if payload is not None:
        for t in tiers:
            _try(f"write {entry}", t, lambda: t.write(entry, payload))
    return compiled


def _kv(key: str, what: str) -> str:
    return f"elastic/compile/{key}/{what}"


# how many programs of each name this process has compiled or loaded through
# compile_cached and compile_launched: the same count on every process of a
# slice (they call them for the same programs in the same order), and across
# generations of one launch (the launch memo's key has it)
_programs: Counter = Counter()


def _next_ordinal(name: str) -> int:
    """This process's count of programs named `name` so far (from 0),
    counting this one: call once per program."""
    ordinal = _programs[name]
    _programs[name] += 1
    return ordinal


def _program_slot(name: str, ordinal: int) -> str:
    """The coordination key under which process 0 posts its cache key for
    its `ordinal`-th program named `name`."""
    return f"elastic/compile/program/{name}/{ordinal}"


def _post_loaded(client, slot: str, key: str) -> None:
    """Process 0 has its executable of a program without compiling it: post
    its cache key under `slot` (_program_slot) and a claim of "loaded" (the
    other processes load their own entries, elastic.worker.compile_cache)."""
    _post(client, slot, key)
    _post(client, _kv(key, "claim"), "loaded")


def _compile_as_process_0(client, key: str, tiers: list, entry: str, lowered):
    """Process 0's miss: claim the entry in every tier (a claim with a fresh
    token, the token posted), compile and store it, then post that it is
    done."""
    claim, token = f"{entry}.claim", uuid.uuid4().hex
    claimed = [t for t in tiers
               if _try(f"write {claim}", t, lambda: t.write(claim, token.encode()) or True)]
    _post(client, _kv(key, "claim"), token if claimed else "unshared")
    try:
        return compile_and_store(tiers, entry, lowered)
    finally:
        _post(client, _kv(key, "done"), "1")
        for t in claimed:
            _try(f"remove {claim}", t, lambda: t.remove(claim))


def _wait_for_process_0(client, key: str, slot: str, tiers: list, entry: str, lowered):
    """Another process's miss: process 0's entry once it is done, from the
    first tier of this process where its claim is (a tier they share); None
    if there is none, if process 0's key for this program (posted under
    `slot`) is another one or it keeps no cache (warned), or if the entry
    does not load."""
    theirs = _wait(client, slot, f"executable {key}'s key")
    if theirs is None:
        return None
    if theirs != key:
        log.warning("executable %s: %s; this process compiles for itself (give every host "
                    "of a job the same XLA_FLAGS, JAX and machine type)", entry,
                    "process 0 keeps no executable cache" if theirs == UNCACHED else
                    f"process 0 compiles this program under another key ({theirs})")
        return None
    token = _wait(client, _kv(key, "claim"), f"executable {key}'s claim")
    if token is None:
        return None
    if token in ("loaded", "unshared"):
        return _load(tiers, entry, _trees(lowered))  # process 0 had it: this tier may too
    shared = [t for t in tiers
              if _try(f"read {entry}.claim", t, lambda: t.read(f"{entry}.claim")) ==
              token.encode()]
    if shared:
        if _wait(client, _kv(key, "done"), f"executable {key}") is None:
            return None
        # (from the shared tier, copied into those before it)
        return _load(tiers[:tiers.index(shared[0]) + 1], entry, _trees(lowered))
    # no claim seen: no tier shared, or process 0 done already and removed it
    return _load(tiers, entry, _trees(lowered))


def _wait(client, name: str, what: str) -> str | None:
    """The value process 0 posts under the coordination key `name` (`what`
    names it in the warning), waited for up to SHARED_WAIT_S; None (with a
    warning: this process then compiles for itself) when it does not come
    or the coordination service fails."""
    try:
        return client.blocking_key_value_get(name, int(SHARED_WAIT_S * 1000))
    except Exception as e:  # noqa: BLE001 - a timeout, a lost coordinator
        log.warning("no %s from process 0 within %.0f s (%s); compiling", what, SHARED_WAIT_S,
                    f"{type(e).__name__}: {e}".splitlines()[0][:200])
        return None


def _post(client, name: str, value: str) -> None:
    """Post `value` under the coordination key `name`; a failure is warned
    about (the others then time out and compile for themselves)."""
    try:
        client.key_value_set(name, value, allow_overwrite=True)
    except Exception as e:  # noqa: BLE001
        log.warning("cannot post %s: %s", name, f"{type(e).__name__}: {e}".splitlines()[0][:200])


def _coordination_client():
    from jax._src import distributed

    return distributed.global_state.client


def compile_cached(lowered, cache_dir: str | None, name: str = "fn",
                   shared: str | None = None, shared_key: str | None = None):
    """`lowered.compile()`, or its executable loaded from a cache when a
    process compiled the same program for the same slice shape before:
    this host's `cache_dir`, then the `shared` tier (a gs:// URL or a
    directory other hosts also use), whose objects are signed with the key
    in the file `shared_key` (SignedTier; without one the shared tier is
    not used, with a warning). On a miss in a slice of several
    processes, process 0 compiles and the processes that share a tier with
    it load its entry.

    Returns (compiled, hit: bool, seconds); `hit` also when the entry came
    from process 0 during this call. With neither tier this is a plain
    compile. An entry that fails to load is compiled again and overwritten;
    a tier that cannot be read or written is skipped with a warning (never
    an error). Every process of the slice must call it for the same
    programs in the same order (as for any collective); a process other
    than 0 waits up to SHARED_WAIT_S seconds for process 0, then compiles
    for itself, and compiles at once (warned) when process 0's key for the
    program differs from its own or process 0 keeps no cache. Raises
    ValueError for a `name` that is not 1 to 100 of [A-Za-z0-9_.-] (it
    names files and objects)."""
    t0 = time.perf_counter()
    name = _checked_name(name)
    compiled, hit, _, _ = _compile_cached(lowered, cache_tiers(cache_dir, shared, shared_key),
                                          name, _program_slot(name, _next_ordinal(name)))
    return compiled, hit, time.perf_counter() - t0


def _checked_name(name: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,100}", name):
        raise ValueError(f"executable name {name[:100]!r}: use 1 to 100 letters, digits, "
                         f"'_', '.' or '-'")
    return name


def _compile_cached(lowered, tiers: list, name: str, slot: str):
    """compile_cached's work: (compiled, hit, entry, key); entry and key
    are None without tiers. `slot`: where process 0 posts its key
    (_program_slot)."""
    import jax

    client = _coordination_client() if jax.process_count() > 1 else None
    process_0 = client is not None and jax.process_index() == 0
    if not tiers:
        if process_0:
            _post(client, slot, UNCACHED)
        return lowered.compile(), False, None, None
    key = cache_key(lowered, jax.process_count(), [d.id for d in jax.devices()])
    entry = f"{name}-{key}.xla"
    compiled = _load(tiers, entry, _trees(lowered))
    if process_0:
        if compiled is None:
            _post(client, slot, key)
            return _compile_as_process_0(client, key, tiers, entry, lowered), False, entry, key
        _post_loaded(client, slot, key)
    elif client is not None and compiled is None:
        compiled = _wait_for_process_0(client, key, slot, tiers, entry, lowered)
    if compiled is not None:
        return compiled, True, entry, key
    return compile_and_store(tiers, entry, lowered), False, entry, key


def compile_launched(lower, cache_dir: str | None, name: str, mesh, trace_key: str = "",
                     shared: str | None = None, shared_key: str | None = None,
                     memo: bool = True):
    """As `compile_cached(lower(), ...)`, without calling `lower` when this
    host's `cache_dir` keeps a memo of the same launch
    (elastic.worker.launch_memo: the same argv, working directory,
    environment but the variables of NOT_IN_LAUNCH_KEY_ENV, program files,
    installed code, slice of `mesh`, `trace_key`, and count of programs of
    this name compiled so before in this process) whose entry loads; after
    a compile or a load through `lower()`, the memo is written for the
    next generation and the next job. With `memo` False (a program that
    gave its lowered program, not a function: it did not agree to the
    memo's contract), no memo is read or written.

    Returns (compiled, hit, seconds, entry, lower_seconds): `entry` the
    executable's name in the cache (None without tiers), for compiling
    ahead; `lower_seconds` the part of `seconds` spent in `lower()` (0.0
    when it was not called). Process 0 posts that it loaded the entry, as
    compile_cached does, so that a process without the memo that lowers
    does not wait for a compile. A memo that cannot be keyed, read or
    written is warned about and the program lowered, never an error.
    Raises ValueError for a bad `name` (compile_cached), TypeError for a
    `trace_key` that is not a string, and what `lower` or compiling
    raises."""
    from elastic import worker_env
    from elastic.worker import launch_memo

    t0 = time.perf_counter()
    name = _checked_name(name)
    ordinal = _next_ordinal(name)
    slot = _program_slot(name, ordinal)
    if not isinstance(trace_key, str):
        raise TypeError(f"trace_key must be a string (it is hashed into the launch memo's "
                        f"key), not {type(trace_key).__name__}")
    tiers = cache_tiers(cache_dir, shared, shared_key)
    # only the host's own directory: never a bucket, where nothing is signed
    own = tier(cache_dir) if memo else None
    launch = None
    if isinstance(own, DirectoryTier):
        launch = _try("key a launch memo", own, lambda: launch_memo.current_launch(
            name, trace_key, mesh, worker_env.NOT_IN_LAUNCH_KEY_ENV, machine_type(), ordinal))
    if launch is not None:
        known = launch_memo.read(own, name, launch)
        if known is not None:
            compiled = _load(tiers, known["entry"], (known["in_tree"], known["out_tree"]))
            if compiled is not None:
                import jax

                if jax.process_count() > 1 and jax.process_index() == 0:
                    _post_loaded(_coordination_client(), slot, known["cache_key"])
                return compiled, True, time.perf_counter() - t0, known["entry"], 0.0
    t_lower = time.perf_counter()
    lowered = lower()
    lower_s = time.perf_counter() - t_lower
    compiled, hit, entry, key = _compile_cached(lowered, tiers, name, slot)
    if launch is not None and entry is not None and has_entry(tiers[:1], entry):
        launch_memo.write(own, name, launch, entry, key, lowered)
    return compiled, hit, time.perf_counter() - t0, entry, lower_s


def cache_tiers(cache_dir: str | None, shared: str | None = None,
                shared_key: str | None = None) -> list:
    """The tiers `compile_cached` uses: this host's directory, then the
    shared tier signed with the key in the file `shared_key` (none that
    cannot be used, with a warning)."""
    return [t for t in (tier(cache_dir), _signed_tier(shared, shared_key)) if t is not None]


def entry_name(name: str, lowered, process_count: int, device_ids: list[int]) -> str:
    """The name of `lowered`'s entry for a slice of `process_count`
    processes whose devices are `device_ids` (all, in order): where
    `compile_cached` in that slice looks."""
    return f"{name}-{cache_key(lowered, process_count, device_ids)}.xla"


def has_entry(tiers: list, entry: str) -> bool:
    """Whether a tier has an object `entry` (not read: a signed tier checks
    the signature when the entry is loaded)."""
    return any(_try(f"look for {entry}", t, lambda: t.exists(entry), False) for t in tiers)


def read_note(tiers: list, note: str) -> str | None:
    """A short text object `note` from the first tier that has it."""
    for t in tiers:
        data = _try(f"read {note}", t, lambda: t.read(note))
        if data is not None:
            return data.decode(errors="replace")
    return None


def write_note(tiers: list, note: str, text: str) -> None:
    """Write the short text object `note` into every tier (failures warned)."""
    for t in tiers:
        _try(f"write {note}", t, lambda: t.write(note, text.encode()))


def remove_note(tiers: list, note: str) -> None:
    """Remove `note` from every tier (failures warned)."""
    for t in tiers:
        _try(f"remove {note}", t, lambda: t.remove(note))
