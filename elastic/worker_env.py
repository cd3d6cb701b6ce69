"""The environment a worker receives from its agent, and the one place in
`elastic` that reads or sets environment variables (`WorkerEnv.from_environ`,
`environ_snapshot`, `started_environ`, `replace_environ`, `xla_flags`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Mapping

from elastic.config import BatchSpec, MeshSpec

# Variables the agent sets for a worker. JAX's own name where one exists.
ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_PROCESS_ID = "ELASTIC_PROCESS_ID"
ENV_NUM_PROCESSES = "ELASTIC_NUM_PROCESSES"
ENV_GENERATION = "ELASTIC_GENERATION"
ENV_JOB_ID = "ELASTIC_JOB_ID"
ENV_HOST_ID = "ELASTIC_HOST_ID"
ENV_MESH = "ELASTIC_MESH"
ENV_CHECKPOINT_DIR = "ELASTIC_CHECKPOINT_DIR"
# Devices each process puts in the mesh (the plan's count, the same on every
# host), and the devices this host has (it may have more than the mesh uses).
ENV_DEVICES_PER_HOST = "ELASTIC_DEVICES_PER_HOST"
ENV_HOST_DEVICES = "ELASTIC_HOST_DEVICES"
ENV_PROGRESS_SOCKET = "ELASTIC_PROGRESS_SOCKET"
ENV_CACHE_DIR = "ELASTIC_CACHE_DIR"
# An executable cache the hosts share (gs://bucket/prefix or a common
# directory), looked in after this host's (elastic.worker.compile_cache).
ENV_SHARED_CACHE = "ELASTIC_SHARED_CACHE"
# The file holding the key that signs the shared cache's entries.
ENV_SHARED_CACHE_KEY_FILE = "ELASTIC_SHARED_CACHE_KEY_FILE"
ENV_JAX_HEARTBEAT_TIMEOUT_S = "ELASTIC_JAX_HEARTBEAT_TIMEOUT_S"
ENV_BATCH_MODE = "ELASTIC_BATCH_MODE"
ENV_LR_SCALING = "ELASTIC_LR_SCALING"
# The controller run (one per controller process): local snapshots of another
# run are never restored.
ENV_RUN_ID = "ELASTIC_RUN_ID"
# Where this host's worker keeps local snapshots (the agent owns and wipes it).
ENV_SNAPSHOT_DIR = "ELASTIC_SNAPSHOT_DIR"
# Marks every process an agent starts, so that a restarted agent can find the
# leftovers of its previous incarnation (value: the agent's state directory).
ENV_WORKER_OWNER = "ELASTIC_WORKER_OWNER"
ENV_INCARNATION = "ELASTIC_AGENT_INCARNATION"
# The slices the controller would start next if a failure domain were lost,
# "PxD,PxD" (process count x devices per host); process 0 compiles for them
# ahead (elastic.worker.compile_ahead).
ENV_NEXT_SLICES = "ELASTIC_NEXT_SLICES"
# Set only by a pre-started process that starts its program afresh
# (elastic.worker.prestart.start_afresh): the Unix time of its launch.
ENV_LAUNCHED_AT = "ELASTIC_LAUNCHED_AT"
# The variables the controller sets for every worker of the job
# (Executor.worker_env): an agent lets a start carry them without an
# --allow-env of its own (elastic.security.allow).
JOB_LEVEL_ENV = (ENV_JOB_ID, ENV_RUN_ID, ENV_MESH, ENV_CHECKPOINT_DIR,
                 ENV_JAX_HEARTBEAT_TIMEOUT_S, ENV_BATCH_MODE, ENV_LR_SCALING)
# The only variables that differ between two generations' workers on a host;
# a pre-started worker process (elastic.worker.prestart) may have been spawned
# before their values were known, every other variable must match its launch.
PER_GENERATION_ENV = (ENV_COORDINATOR, ENV_PROCESS_ID, ENV_NUM_PROCESSES, ENV_GENERATION,
                      ENV_DEVICES_PER_HOST, ENV_HOST_DEVICES, ENV_NEXT_SLICES)

# What a launch memo's key leaves out (elastic.worker.launch_memo): the
# per-generation variables, and those that only name the job, its run, where
# its checkpoints go, the agent's incarnation and what differs with it (its
# progress socket and snapshot directory; systemd's INVOCATION_ID and
# JOURNAL_STREAM, which change with every start of the unit), so that the
# next job or a restarted agent launching the same program on the same slice
# loads its executable without tracing (the installed code is hashed instead).
NOT_IN_LAUNCH_KEY_ENV = PER_GENERATION_ENV + (
    ENV_JOB_ID, ENV_RUN_ID, ENV_CHECKPOINT_DIR, ENV_INCARNATION, ENV_PROGRESS_SOCKET,
    ENV_SNAPSHOT_DIR, ENV_LAUNCHED_AT, "INVOCATION_ID", "JOURNAL_STREAM")


@dataclasses.dataclass(frozen=True)
class WorkerEnv:
    """What the agent told this worker process. Built by `from_environ`.

    devices_per_host: devices this process puts in the mesh; host_devices:
    devices this host has (>= devices_per_host; the CPU device count of a
    simulated host). next_slices: ((process count, devices per host), ...)
    the controller would start next if a failure domain were lost.
    """

    coordinator_address: str
    process_id: int
    num_processes: int
    generation: int
    job_id: str
    host_id: str
    mesh: MeshSpec
    checkpoint_dir: str
    devices_per_host: int
    host_devices: int
    progress_socket: str | None
    batch: BatchSpec = BatchSpec()
    cache_dir: str | None = None
    shared_cache: str | None = None
    shared_cache_key_file: str | None = None
    jax_heartbeat_timeout_s: int = 100
    run_id: str | None = None
    snapshot_dir: str | None = None
    next_slices: tuple[tuple[int, int], ...] = ()

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> "WorkerEnv":
        """Read the worker variables (default: this process's environment).

        Raises RuntimeError naming the missing variable when the process was
        not started by an elastic agent. A malformed ELASTIC_NEXT_SLICES is
        warned about and read as none.
        """
        env = os.environ if environ is None else environ

        def need(name: str) -> str:
            if name not in env:
                raise RuntimeError(f"{name} is not set: run this program under elastic-agent "
                                   f"(e.g. `elasticd local`)")
            return env[name]

        return cls(
            coordinator_address=need(ENV_COORDINATOR),
            process_id=int(need(ENV_PROCESS_ID)),
            num_processes=int(need(ENV_NUM_PROCESSES)),
            generation=int(need(ENV_GENERATION)),
            job_id=need(ENV_JOB_ID),
            host_id=need(ENV_HOST_ID),
            mesh=MeshSpec.from_text(need(ENV_MESH)),
            checkpoint_dir=need(ENV_CHECKPOINT_DIR),
            devices_per_host=int(need(ENV_DEVICES_PER_HOST)),
            host_devices=int(env.get(ENV_HOST_DEVICES) or need(ENV_DEVICES_PER_HOST)),
            progress_socket=env.get(ENV_PROGRESS_SOCKET) or None,
            batch=BatchSpec(env.get(ENV_BATCH_MODE, "global"), env.get(ENV_LR_SCALING, "linear")),
            cache_dir=env.get(ENV_CACHE_DIR) or None,
            shared_cache=env.get(ENV_SHARED_CACHE) or None,
            shared_cache_key_file=env.get(ENV_SHARED_CACHE_KEY_FILE) or None,
            jax_heartbeat_timeout_s=int(env.get(ENV_JAX_HEARTBEAT_TIMEOUT_S, "100")),
            run_id=env.get(ENV_RUN_ID) or None,
            snapshot_dir=env.get(ENV_SNAPSHOT_DIR) or None,
            next_slices=_next_slices_hint(env.get(ENV_NEXT_SLICES, "")),
        )


def _next_slices_hint(text: str) -> tuple[tuple[int, int], ...]:
    """parse_next_slices, but a malformed value (an agent's bug) is warned
    about and ignored: a hint must not fail the worker."""
    try:
        return parse_next_slices(text)
    except ValueError as e:
        logging.getLogger("elastic.worker_env").warning("%s; not compiling ahead", e)
        return ()


def format_next_slices(slices) -> str:
    """((3, 2), (2, 2)) -> "3x2,2x2" (the value of ELASTIC_NEXT_SLICES)."""
    return ",".join(f"{p}x{d}" for p, d in slices)


def parse_next_slices(text: str) -> tuple[tuple[int, int], ...]:
    """The inverse of format_next_slices ("" -> ()). Raises ValueError naming
    ELASTIC_NEXT_SLICES and the item when an item is not PxD with positive
    integers."""
    slices = []
    for item in filter(None, text.split(",")):
        parts = item.split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"{ENV_NEXT_SLICES}: {item[:40]!r} is not PROCESSESxDEVICES "
                             f"(e.g. 3x2)")
        slices.append((int(parts[0]), int(parts[1])))
    return tuple(slices)


def environ_snapshot() -> dict[str, str]:
    """A copy of this process's environment (the base of a worker's)."""
    return dict(os.environ)


def launched_at() -> float | None:
    """ELASTIC_LAUNCHED_AT as a Unix time in seconds: the launch of a
    pre-started process that started its program afresh; None when unset
    or not a finite number."""
    try:
        value = float(os.environ.get(ENV_LAUNCHED_AT, ""))
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def checkpoint_dir() -> str:
    """This process's ELASTIC_CHECKPOINT_DIR ("" when unset): where the
    worker it becomes will keep its checkpoints (a pre-started process,
    elastic.worker.prestart, preloads the client of that storage)."""
    return os.environ.get(ENV_CHECKPOINT_DIR, "")


def xla_flags() -> str:
    """This process's XLA_FLAGS ("" when unset): the flags XLA compiles with."""
    return os.environ.get("XLA_FLAGS", "")


#: The environment a pre-started process's launch gave it (replace_environ);
#: None in any other process.
_launch_environ: dict[str, str] | None = None


def started_environ() -> dict[str, str]:
    """The environment this process was started with (/proc/self/environ;
    a copy of os.environ where there is none), or for a pre-started one
    (elastic.worker.prestart) the one its launch gave it: the same for a
    cold worker and a pre-started one launched alike, even one started
    during another job, unlike os.environ after imports that set variables
    (JAX sets TF_CPP_MIN_LOG_LEVEL)."""
    if _launch_environ is not None:
        return dict(_launch_environ)
    try:
        with open("/proc/self/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return dict(os.environ)
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="surrogateescape"): v.decode(errors="surrogateescape")
            for k, v in pairs}


def replace_environ(environ: Mapping[str, str]) -> None:
    """Make `environ` this process's whole environment (a pre-started
    worker taking its launch's, elastic.worker.prestart); `started_environ`
    returns it from now on."""
    global _launch_environ
    _launch_environ = dict(environ)
    os.environ.clear()
    os.environ.update(environ)
