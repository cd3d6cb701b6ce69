"""Job spec (TOML).

The job spec is parsed strictly into frozen dataclasses: an unknown key, a
wrong type or an impossible value raises `SpecError` naming the file and the
key. The environment a worker receives is `elastic.worker_env`.

Example (units are in the key names; all keys but `job.command` are optional)::

    [job]
    id = "lm"
    command = ["python", "train.py"]     # argv, run in `workdir` on every host
    env = { XLA_FLAGS = "" }
    min_hosts = 2
    max_hosts = 4
    hosts_per_failure_domain = 1
    device_kind = "tpu"                  # optional: only hosts reporting this kind
    checkpoint_dir = "/data/ckpt"        # default: <state-dir>/checkpoints

    [mesh]                               # named axes in order; one may be -1
    data = -1
    model = 2

    [health]
    heartbeat_interval_s = 1.0
    heartbeat_timeout_s = 5.0
    controller_lease_s = 30.0            # no controller this long: agents stop their workers

    [batch]                              # batch under resize (elastic.worker.batch)
    mode = "global"                      # "global" | "per_device"
    lr_scaling = "linear"                # with per_device: "linear" | "sqrt"

    [hang]                               # no step progress -> hang (0 learns the timeout)
    timeout_s = 0.0

    [restart]
    max_restarts = 20
    window_s = 3600.0
    crash_loop_failures = 3
    grow = "after_checkpoint"            # "never" | "after_checkpoint" | "immediately"
    waiting_timeout_s = 1800.0           # no slice could start this long: job fails
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import re
import tomllib
from collections.abc import Mapping
from typing import Any

GROW_POLICIES = ("never", "after_checkpoint", "immediately")
#: A device kind as agents report it and `job.device_kind` names it
#: ("cpu", "tpu", "NVIDIA H100 80GB HBM3"): at most 64 plain characters.
DEVICE_KIND_CHARS = "A-Za-z0-9 ._()+-"
DEVICE_KIND = re.compile(f"[{DEVICE_KIND_CHARS}]{{1,64}}")


class SpecError(ValueError):
    """A job spec that cannot run; the message names the file and the key."""


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """Named mesh axes in order, e.g. (("data", -1), ("model", 2)).

    At most one size is -1, meaning "whatever the device count leaves".
    """

    axes: tuple[tuple[str, int], ...] = (("data", -1),)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.axes)

    @property
    def fixed_product(self) -> int:
        """Product of the sizes other than -1 (devices per "remaining" unit)."""
        product = 1
        for _, size in self.axes:
            if size != -1:
                product *= size
        return product

    @property
    def has_free_axis(self) -> bool:
        return any(size == -1 for _, size in self.axes)

    def to_text(self) -> str:
        """The form passed to workers: "data=-1,model=2"."""
        return ",".join(f"{name}={size}" for name, size in self.axes)

    @classmethod
    def from_text(cls, text: str) -> "MeshSpec":
        """Parse "data=-1,model=2". Raises SpecError on a malformed axis."""
        axes = []
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, sep, size = part.partition("=")
            if not sep or not name.strip():
                raise SpecError(f"mesh spec {text!r}: axis {part!r} is not NAME=SIZE")
            try:
                axes.append((name.strip(), int(size)))
            except ValueError:
                raise SpecError(f"mesh spec {text!r}: size of {name!r} is not an integer") from None
        return _checked_mesh(tuple(axes), f"mesh spec {text!r}")


@dataclasses.dataclass(frozen=True)
class HealthSpec:
    """Health timings, in seconds.

    heartbeat_interval_s: how often agents heartbeat.
    heartbeat_timeout_s: a host silent this long is lost (> interval).
    reconnect_grace_s: a host whose stream to the controller closed (its
      agent process ended: the kernel closes a dead process's sockets at
      once) and that has not registered again within this long is lost
      without waiting for heartbeat_timeout_s. Agents retry after 0.1-0.2 s.
    stop_grace_s: SIGTERM to SIGKILL for planned stops (grow, shutdown). Stops
      after a failure send SIGKILL at once: with a peer gone no collective and
      no checkpoint commit (it needs a barrier) can finish anyway.
    stop_timeout_s: how long the controller waits for stop acknowledgements
      before dropping a host that does not answer (> stop_grace_s).
    rendezvous_settle_s: once `min_hosts` are ready but fewer than
      `max_hosts`, wait this long after the last registration or stream
      opening for more (and while a registered host's stream is still
      opening, at most elastic.policy.silence.STREAM_OPEN_S).
    expected_hosts: the first generation waits for this many hosts to
      register (at most `max_hosts`; 0: none), however far apart they come,
      for at most elastic.policy.decide.EXPECTED_WAIT_S after the controller
      started. `elasticd local` sets it to the hosts it launches: on a busy
      machine they can register seconds apart, and a first generation
      started on fewer would restart to grow moments later.
    carry_silent_hosts: a member of the running slice whose agent has been
      silent for heartbeat_timeout_s stays in the slice while the other
      members' steps prove its worker still takes part (see
      elastic.policy.silence): a frozen agent costs no restart. Sound for
      programs whose processes step in lockstep (every step has a collective
      across all processes: any multi-host JAX training step); set false for
      one whose processes step independently.
    controller_lease_s: an agent that hears from no controller this long
      stops its worker on its own (self-fencing); until then its worker
      trains on, and a controller restarted meanwhile (by systemd, or a
      standby taking over) adopts the running slice. Well above a restart of
      the controller (~1-3 s) and above heartbeat_timeout_s. A slice whose
      process 0's host was lost without being seen to stop its worker (cut
      off, frozen) is replaced only after this long: process 0 alone
      finishes a checkpoint's commit (elastic.policy.fencing).
    leader_lease_s: with checkpoints in a bucket, the controllers' lease on
      the journal object there (elastic.controller.bucket_lease): a standby
      takes over once the leader has not renewed it for this long.
    datagram_heartbeats: the controller takes agents' periodic heartbeats
      as UDP datagrams on its port number, sealed with a key per
      registration (elastic.heartbeat_datagram), instead of on their gRPC
      streams; an agent whose datagrams are not acked goes back to its
      stream (elastic.heartbeat_datagram.patience_s; agents use them only
      when heartbeat_timeout_s > ~4.7 x heartbeat_interval_s). False:
      heartbeats only on the streams.
    """

    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 5.0
    reconnect_grace_s: float = 1.0
    stop_grace_s: float = 3.0
    stop_timeout_s: float = 10.0
    rendezvous_settle_s: float = 1.0
    expected_hosts: int = 0
    carry_silent_hosts: bool = True
    controller_lease_s: float = 30.0
    leader_lease_s: float = 10.0
    datagram_heartbeats: bool = True


@dataclasses.dataclass(frozen=True)
class RestartSpec:
    """Restart budget and grow policy.

    max_restarts: failure restarts allowed within `window_s` seconds; one
      more ends the job as failed. Planned restarts (grow) do not count.
    crash_loop_failures: this many failures in a row with no step progress
      in between end the job as failed.
    grow: when a slice running below `max_hosts` restarts bigger because a
      host is waiting: "never", "after_checkpoint" (after the next committed
      checkpoint, so no work is lost) or "immediately".
    waiting_timeout_s: the longest the controller stays waiting for a slice
      it can start (too few hosts, or none whose devices fit the mesh)
      before it ends the job as failed; 0 waits forever.
    prestart_workers: keep one worker process per host pre-started (Python
      with JAX, Orbax and the program's packages imported, ~200 MB) so that a
      restart skips process start and imports (~1.9 s of a ~4 s restart with
      4 processes on 2 cores, bench/recovery.py). Needs `[job] command` to be
      `python script.py ...` or `python -m module ...` with `elastic`
      importable by that Python; other commands always start cold.
    replicate_snapshots: each host's agent also sends its worker's local
      snapshots to a buddy host's agent (elastic.agent.replicas), so that a
      lost host's shards of a state sharded across hosts are restored from
      memory rather than from the last checkpoint; costs each host a second
      snapshot's memory and the network transfer.
    compile_ahead: tell each generation's workers the slices the planner
      would start next if one failure domain were lost
      (elastic.policy.slice_plan.next_slices); process 0 then compiles the
      programs it compiles with `ctx.compile(..., lower_for=...)` for them
      in the background, after its first step, into the executable cache
      (elastic.worker.compile_ahead), so that the first restart onto such a
      slice loads its train step instead of compiling it.
    """

    max_restarts: int = 20
    window_s: float = 3600.0
    crash_loop_failures: int = 3
    grow: str = "after_checkpoint"
    prestart_workers: bool = True
    waiting_timeout_s: float = 1800.0
    replicate_snapshots: bool = True
    compile_ahead: bool = True


@dataclasses.dataclass(frozen=True)
class HangSpec:
    """When a running generation that makes no step progress is hung, in seconds.

    timeout_s: a fixed hang timeout; 0 (default) learns it as
      max(min_timeout_s, step_time_factor x the median step time the workers
      report) once steps are reported.
    startup_timeout_s: from a generation's start to its first step
      (process start, distributed init, restore, first compile).
    checkpoint_allowance_s: added to the timeout while a checkpoint save is
      in flight, and once the workers said they are finishing (after the
      last step: the last save, leaving the distributed runtime).
    suspended_timeout_s: a worker its agent reports stopped (state T or t in
      /proc: SIGSTOP, SIGTSTP, a debugger) for this long is hung at once,
      without waiting for the step timeout: a stopped process cannot step.
      0 turns this off (e.g. to debug a worker with gdb).
    """

    timeout_s: float = 0.0
    min_timeout_s: float = 10.0
    step_time_factor: float = 10.0
    startup_timeout_s: float = 300.0
    checkpoint_allowance_s: float = 60.0
    suspended_timeout_s: float = 2.0


@dataclasses.dataclass(frozen=True)
class QuarantineSpec:
    """A host with `failures` failures attributed to it within `window_s`
    seconds is set aside for `cooldown_s` seconds."""

    failures: int = 3
    window_s: float = 600.0
    cooldown_s: float = 600.0


@dataclasses.dataclass(frozen=True)
class PreemptionSpec:
    """drain_timeout_s: how long, after a host's preemption notice, the
    controller waits for the emergency checkpoint to commit before it stops
    the slice anyway (GCE gives a spot VM 30 s in all)."""

    drain_timeout_s: float = 20.0


@dataclasses.dataclass(frozen=True)
class LocalSpec:
    """How `elasticd local` simulates the hosts (ignored by `elasticd start`):
    gcs_emulator keeps the checkpoints in a bucket of a local GCS emulator;
    isolate gives every host and the controller namespaces of their own
    (elastic.local.network) and implies gcs_emulator. The command line's
    --gcs-emulator and --isolate turn them on too."""

    isolate: bool = False
    gcs_emulator: bool = False


@dataclasses.dataclass(frozen=True)
class BatchSpec:
    """Batch under resize (see elastic.worker.batch): mode "global" keeps the
    global batch fixed (padding rows with zero weight), "per_device" keeps
    each device's rows fixed and scales the learning rate ("linear"/"sqrt")."""

    mode: str = "global"
    lr_scaling: str = "linear"


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """One job: what every host runs and how the controller keeps it running.

    devices_per_host: when set, every host's worker puts exactly this many
      devices in the mesh (hosts with fewer are left out, hosts with more use
      that many); unset, the planner picks it (elastic.policy.mesh).
    device_kind: when set, only hosts reporting this device kind can join.
    """

    command: tuple[str, ...]
    job_id: str = "job"
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    workdir: str = "."
    min_hosts: int = 1
    max_hosts: int = 1
    hosts_per_failure_domain: int = 1
    devices_per_host: int | None = None
    device_kind: str = ""
    checkpoint_dir: str | None = None
    mesh: MeshSpec = MeshSpec()
    health: HealthSpec = HealthSpec()
    restart: RestartSpec = RestartSpec()
    batch: BatchSpec = BatchSpec()
    hang: HangSpec = HangSpec()
    quarantine: QuarantineSpec = QuarantineSpec()
    preemption: PreemptionSpec = PreemptionSpec()
    local: LocalSpec = LocalSpec()
    source: str = "<memory>"

    def with_checkpoint_dir(self, default: str) -> "JobSpec":
        """This spec with `checkpoint_dir` set to `default` if it was not given."""
        if self.checkpoint_dir:
            return self
        return dataclasses.replace(self, checkpoint_dir=default)


# --- parsing -----------------------------------------------------------------

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_AXIS_NAME = _ENV_NAME  # (mesh axes: names of the same shape)
#: Upper bounds that keep a typo (max_hosts = 100000000) from exhausting the
#: controller: hosts per job, devices per host, any duration in seconds.
MAX_HOSTS = 100_000
MAX_DEVICES_PER_HOST = 65_536
MAX_DURATION_S = 365 * 86_400.0
#: The longest SIGTERM -> SIGKILL grace an agent applies (seconds).
MAX_STOP_GRACE_S = 3600.0

_SECTIONS = {"job", "mesh", "health", "restart", "batch", "hang", "quarantine", "preemption",
             "local"}
_JOB_KEYS = {
    "id": str, "command": list, "env": dict, "workdir": str, "min_hosts": int,
    "max_hosts": int, "hosts_per_failure_domain": int, "devices_per_host": int,
    "device_kind": str, "checkpoint_dir": str,
}


def _type_name(kind: type) -> str:
    return {str: "a string", int: "an integer", float: "a number", list: "an array",
            dict: "a table", bool: "true or false"}[kind]


def _check_type(source: str, key: str, value: Any, kind: type) -> Any:
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is float and isinstance(value, float) and not math.isfinite(value):
        raise SpecError(f"{source}: {key} must be a finite number, got {value}")
    if not ok:
        raise SpecError(f"{source}: {key} must be {_type_name(kind)}, got {value!r}")
    return value


def _section(source: str, raw: Mapping[str, Any], name: str, cls: type) -> Any:
    table = raw.get(name, {})
    if not isinstance(table, dict):
        raise SpecError(f"{source}: [{name}] must be a table")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values = {}
    for key, value in table.items():
        if key not in fields:
            raise SpecError(f"{source}: unknown key {name}.{key} (known: {', '.join(fields)})")
        kind = {"float": float, "int": int, "str": str, "bool": bool}[fields[key].type]
        values[key] = _check_type(source, f"{name}.{key}", value, kind)
    return cls(**values)


def _checked_mesh(axes: tuple[tuple[str, int], ...], where: str) -> MeshSpec:
    if not axes:
        raise SpecError(f"{where}: the mesh needs at least one axis")
    if sum(1 for _, size in axes if size == -1) > 1:
        raise SpecError(f"{where}: at most one axis may be -1, got {dict(axes)}")
    for name, size in axes:
        if size == 0 or size < -1:
            raise SpecError(f"{where}: axis {name} has size {size}; sizes are positive or -1")
    if len({name for name, _ in axes}) != len(axes):
        raise SpecError(f"{where}: axis names repeat")
    for name, _ in axes:
        # (the workers read the mesh as NAME=SIZE,...: MeshSpec.to_text)
        if not _AXIS_NAME.fullmatch(name):
            raise SpecError(f"{where}: axis name {name[:40]!r} is not a name (letters, digits, "
                            f"_; not starting with a digit)")
    return MeshSpec(axes)


def parse_spec(raw: Mapping[str, Any], source: str = "<memory>",
               base_dir: pathlib.Path | None = None) -> JobSpec:
    """Build a JobSpec from a parsed TOML document.

    Relative `workdir` and `checkpoint_dir` are resolved against `base_dir`
    (the spec file's folder). Raises SpecError naming `source` and the key.
    """
    for name in raw:
        if name not in _SECTIONS:
            raise SpecError(f"{source}: unknown section or key {name!r} "
                            f"(known sections: {', '.join(sorted(_SECTIONS))})")
    job = raw.get("job")
    if not isinstance(job, dict):
        raise SpecError(f"{source}: missing [job] table (it needs at least job.command)")
    values: dict[str, Any] = {}
    for key, value in job.items():
        if key not in _JOB_KEYS:
            raise SpecError(f"{source}: unknown key job.{key} (known: {', '.join(_JOB_KEYS)})")
        values[key] = _check_type(source, f"job.{key}", value, _JOB_KEYS[key])
    command = values.pop("command", None)
    if not command or not all(isinstance(a, str) and a and "\0" not in a for a in command):
        raise SpecError(f"{source}: job.command must be a non-empty array of non-empty strings "
                        f"without NUL characters")
    env = values.pop("env", {})
    for key, value in env.items():
        if not _ENV_NAME.fullmatch(key):
            raise SpecError(f"{source}: job.env key {key[:40]!r} is not a variable name "
                            f"(letters, digits, _; not starting with a digit)")
        if not isinstance(value, str) or "\0" in value:
            raise SpecError(f"{source}: job.env.{key} must be a string without NUL "
                            f"characters, got {value!r}")
    base = base_dir or pathlib.Path.cwd()
    for key in ("workdir", "checkpoint_dir"):
        if key in values and not values[key].strip():
            raise SpecError(f"{source}: job.{key} is empty (leave it out for the default)")
        if key in values and "://" not in values[key]:
            values[key] = str((base / values[key]).resolve())
    values.setdefault("workdir", str(base.resolve()))
    if "id" in values:
        values["job_id"] = values.pop("id")

    mesh_table = raw.get("mesh", {"data": -1})
    if not isinstance(mesh_table, dict):
        raise SpecError(f"{source}: [mesh] must be a table of axis = size")
    axes = tuple((name, _check_type(source, f"mesh.{name}", size, int))
                 for name, size in mesh_table.items())
    spec = JobSpec(
        command=tuple(command), env=dict(env), source=source,
        mesh=_checked_mesh(axes, f"{source}: [mesh]"),
        health=_section(source, raw, "health", HealthSpec),
        restart=_section(source, raw, "restart", RestartSpec),
        batch=_section(source, raw, "batch", BatchSpec),
        hang=_section(source, raw, "hang", HangSpec),
        quarantine=_section(source, raw, "quarantine", QuarantineSpec),
        preemption=_section(source, raw, "preemption", PreemptionSpec),
        local=_section(source, raw, "local", LocalSpec),
        **values,
    )
    validate(spec)
    return spec


def validate(spec: JobSpec) -> None:
    """Raise SpecError if the spec can never run; the message names the key."""
    from elastic.security.identity import id_problem

    src, h, r = spec.source, spec.health, spec.restart
    durations = [(f"{section}.{f.name}", getattr(getattr(spec, section), f.name))
                 for section in ("health", "restart", "hang", "quarantine", "preemption")
                 for f in dataclasses.fields(getattr(spec, section)) if f.name.endswith("_s")]
    checks = [
        (id_problem(spec.job_id, "job.id") is None, id_problem(spec.job_id, "job.id")),
        (spec.max_hosts <= MAX_HOSTS, f"job.max_hosts ({spec.max_hosts}) is above the limit "
                                      f"of {MAX_HOSTS:,} hosts"),
        (spec.devices_per_host is None or spec.devices_per_host <= MAX_DEVICES_PER_HOST,
         f"job.devices_per_host is above the limit of {MAX_DEVICES_PER_HOST:,}"),
        (all(abs(size) <= MAX_HOSTS * MAX_DEVICES_PER_HOST for _, size in spec.mesh.axes),
         "[mesh] an axis size is larger than any slice can be"),
        *((value <= MAX_DURATION_S, f"{key} ({value:g} s) is above the limit of "
                                    f"{MAX_DURATION_S:g} s (a year)") for key, value in durations),
        (spec.min_hosts >= 1, "job.min_hosts must be at least 1"),
        (spec.max_hosts >= spec.min_hosts,
         f"job.min_hosts ({spec.min_hosts}) is greater than job.max_hosts ({spec.max_hosts})"),
        (spec.hosts_per_failure_domain >= 1, "job.hosts_per_failure_domain must be at least 1"),
        (spec.max_hosts >= spec.hosts_per_failure_domain,
         f"job.max_hosts ({spec.max_hosts}) is smaller than one failure domain "
         f"(job.hosts_per_failure_domain = {spec.hosts_per_failure_domain})"),
        (spec.devices_per_host is None or spec.devices_per_host >= 1,
         "job.devices_per_host must be at least 1"),
        (not spec.device_kind or DEVICE_KIND.fullmatch(spec.device_kind) is not None,
         f"job.device_kind {spec.device_kind[:80]!r} is not a device kind (1 to 64 letters, "
         f"digits, spaces and ._()+-)"),
        (r.waiting_timeout_s >= 0, "restart.waiting_timeout_s must be >= 0 (0 waits forever)"),
        (h.heartbeat_interval_s > 0, "health.heartbeat_interval_s must be > 0"),
        (h.heartbeat_timeout_s > h.heartbeat_interval_s,
         f"health.heartbeat_timeout_s ({h.heartbeat_timeout_s}) must be greater than "
         f"health.heartbeat_interval_s ({h.heartbeat_interval_s})"),
        (h.reconnect_grace_s > 0, "health.reconnect_grace_s must be > 0"),
        (h.leader_lease_s > 0, "health.leader_lease_s must be > 0"),
        (h.controller_lease_s > h.heartbeat_interval_s,
         f"health.controller_lease_s ({h.controller_lease_s}) must be greater than "
         f"health.heartbeat_interval_s ({h.heartbeat_interval_s})"),
        (0 <= h.stop_grace_s <= MAX_STOP_GRACE_S,
         f"health.stop_grace_s must be from 0 to {MAX_STOP_GRACE_S:g} s"),
        (h.stop_timeout_s > h.stop_grace_s,
         f"health.stop_timeout_s ({h.stop_timeout_s}) must be greater than "
         f"health.stop_grace_s ({h.stop_grace_s})"),
        (h.rendezvous_settle_s >= 0, "health.rendezvous_settle_s must be >= 0"),
        (h.expected_hosts >= 0, "health.expected_hosts must be >= 0"),
        (r.max_restarts >= 0, "restart.max_restarts must be >= 0"),
        (r.window_s > 0, "restart.window_s must be > 0"),
        (r.crash_loop_failures >= 1, "restart.crash_loop_failures must be at least 1"),
        (r.grow in GROW_POLICIES,
         f"restart.grow is {r.grow!r}; expected one of {', '.join(GROW_POLICIES)}"),
        (spec.hang.timeout_s >= 0, "hang.timeout_s must be >= 0 (0 learns it)"),
        (spec.hang.min_timeout_s > 0, "hang.min_timeout_s must be > 0"),
        (spec.hang.suspended_timeout_s >= 0, "hang.suspended_timeout_s must be >= 0"),
        (spec.hang.step_time_factor >= 1, "hang.step_time_factor must be >= 1"),
        (spec.hang.startup_timeout_s > 0, "hang.startup_timeout_s must be > 0"),
        (spec.hang.checkpoint_allowance_s >= 0, "hang.checkpoint_allowance_s must be >= 0"),
        (spec.quarantine.failures >= 1, "quarantine.failures must be at least 1"),
        (spec.quarantine.window_s > 0 and spec.quarantine.cooldown_s >= 0,
         "quarantine.window_s must be > 0 and quarantine.cooldown_s >= 0"),
        (spec.preemption.drain_timeout_s > 0, "preemption.drain_timeout_s must be > 0"),
        (spec.batch.mode in ("global", "per_device"),
         f"batch.mode is {spec.batch.mode!r}; expected global or per_device"),
        (spec.batch.lr_scaling in ("linear", "sqrt"),
         f"batch.lr_scaling is {spec.batch.lr_scaling!r}; expected linear or sqrt"),
    ]
    for ok, message in checks:
        if not ok:
            raise SpecError(f"{src}: {message}")
    # (policy imports config, not the reverse at import time)
    from elastic.policy.mesh import check_satisfiable

    problem = check_satisfiable(spec)
    if problem:
        raise SpecError(f"{src}: [mesh] {problem}")


def jax_heartbeat_timeout_s(spec: JobSpec) -> int:
    """The coordination-service heartbeat timeout workers pass to JAX: a
    backstop longer than the controller's own detection (hang and lost host),
    so the controller acts first. JAX's default is 100 s."""
    hang = spec.hang.timeout_s or spec.hang.min_timeout_s
    return int(2 * hang + spec.health.heartbeat_timeout_s + 5)


def load_spec(path: str | os.PathLike[str]) -> JobSpec:
    """Read and validate a job spec file. Raises SpecError (also for a missing
    file or bad TOML syntax)."""
    path = pathlib.Path(path)
    try:
        with path.open("rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise SpecError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise SpecError(f"{path}: is a directory, not a job spec file") from None
    except OSError as e:
        raise SpecError(f"{path}: cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise SpecError(f"{path}: not UTF-8 text (byte {e.start}); TOML files are UTF-8") from None
    except tomllib.TOMLDecodeError as e:
        raise SpecError(f"{path}: invalid TOML: {e}") from None
    return parse_spec(raw, source=str(path), base_dir=path.resolve().parent)
