"""The worker runtime: `init()` turns what the agent set into a ready JAX
process (distributed runtime, mesh, checkpoints, progress, logging).

    ctx = elastic.worker.init()
    ckpt = ctx.checkpoints(interval_steps=50)
    restored = ckpt.restore_latest(abstract_state)
    for step in range(start, steps):
        state, loss = train_step(state, batch(step))
        ctx.step_done(step, loss=float(loss))
        ckpt.save(step, state, meta)
    ctx.finish()

JAX is initialised with explicit coordinator, process id and process count:
never JAX's cluster auto-detection, which on a TPU VM describes the whole TPU
slice rather than the hosts this generation uses.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import logging
import os
import socket
import statistics
import sys
import threading
import time
from typing import Any, Callable

from elastic.config import SpecError
from elastic.worker_env import WorkerEnv
from elastic.worker import preemption_notice
from elastic.worker.failure_cause import caused_by_peer
from elastic.worker.progress import ProgressReporter


def _process_start_time() -> float:
    """Unix time this worker started: its launch, for a pre-started process
    (elastic.worker.prestart, also one that started its program afresh),
    else the process's start (from /proc; 10 ms resolution)."""
    from elastic import worker_env

    prestart = sys.modules.get("elastic.worker.prestart")
    if prestart is not None and prestart.launched_at is not None:
        return prestart.launched_at
    launched = worker_env.launched_at()
    if launched is not None:
        return launched
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, StopIteration):
        return time.time()


#: The longest `finish()` waits for a compile ahead still running (seconds).
AHEAD_JOIN_S = 60.0


@dataclasses.dataclass
class WorkerContext:
    """What a training program gets from `init()`.

    mesh: the global `jax.sharding.Mesh` of this generation, axes in the
      job's mesh spec order, -1 resolved for the devices there are now.
    process_index / process_count: this process's rank and the slice size.
    generation: the slice's generation (+1 at every restart).
    progress: reports steps, metrics and commits to the agent (non-blocking).
    log: a logger that writes on process 0 only (unless `init(log_all=True)`).
    timings: seconds per startup phase, back to back from the process's
      start (or a pre-started process's launch) to the first step_done, so
      that they add up to the whole of it: process_start (to init()),
      import_jax, distributed_init, mesh, then the program's own setup
      (model, data, lowering: whatever ran between the calls below),
      compile (ctx.compile), checkpoint_setup (ctx.checkpoints), restore
      (the restore itself), and first_step (from the last of those to the
      first step_done: state creation, any compile outside ctx.compile,
      the step itself). Phases a program does not go through are absent.
    launched_at: Unix time of the process's start or launch (seconds).
    traced: the names of the programs this process traced and lowered to
      compile them (a program given lowered, or given as a function with no
      launch memo to load by: elastic.worker.launch_memo), in order;
      process 0 journals them with its startup phases (`traced`, the names
      joined by commas; "" when it traced none).
    finished: set once `finish()` has left the distributed runtime (a
      process that exits before then exits promptly: see
      `exit_promptly_on_failure`).
    """

    env: WorkerEnv
    mesh: Any
    process_index: int
    process_count: int
    generation: int
    progress: ProgressReporter
    log: logging.Logger
    timings: dict[str, float]
    launched_at: float = 0.0
    _started: float = 0.0  # (perf_counter at the end of the latest phase)
    _first_step_done: bool = False
    _checkpoints: Any = None
    _last_step_at: float = 0.0
    _step_times: collections.deque = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=50))
    _ahead: list = dataclasses.field(default_factory=list)  # (lower_for, name, entry)
    traced: list = dataclasses.field(default_factory=list)
    ahead_thread: Any = None  # (the thread compiling ahead, on process 0)
    finished: threading.Event = dataclasses.field(default_factory=threading.Event)

    def checkpoints(self, interval_steps: int = 100, max_to_keep: int = 3,
                    snapshot_every: int = 10, save_timeout_s: float = 600.0):
        """The job's `Checkpoints` (one per process; create it once, on
        every process: it is collective). Raises RuntimeError when a local
        checkpoint directory is not one every process shares.

        Commits are reported to the controller (journal `checkpoint_committed`)
        and restores or restore failures journaled. snapshot_every: steps
        between local snapshots (elastic.checkpoint.snapshot; 0: none), kept
        where the agent says (ELASTIC_SNAPSHOT_DIR) for this controller run
        (ELASTIC_RUN_ID); without a run id there are none. save_timeout_s:
        seconds a save may take to commit on every process before it is
        given up (see Checkpoints)."""
        self._phase("setup")
        from elastic.checkpoint.manager import Checkpoints
        from elastic.checkpoint.snapshot import LocalSnapshots

        def on_commit(step: int) -> None:
            if self.process_index == 0:
                self.progress.committed(step)

        def on_event(kind: str, reason: str, fields: dict) -> None:
            if kind == "checkpoint_restored" and not self._first_step_done:
                # what ran before the restore call is the program's setup
                since = time.perf_counter() - self._started
                restore_s = min(since, float(fields.get("restore_s", 0.0)))
                self._phase("setup", since - restore_s)
                self._phase("restore")
            if kind == "checkpoint_saved" and self._step_times:
                fields = dict(fields, step_time_s=round(statistics.median(self._step_times), 4))
            if kind == "checkpoint_saved" and snapshots is not None and snapshots.seconds:
                # the median snapshot, and all that blocked the loop since the last save
                fields = dict(fields, snapshot_s=round(statistics.median(snapshots.seconds), 5),
                              snapshots_s=round(snapshots.drain_blocked_s(), 4))
            if self.process_index == 0:
                self.progress.event(kind, reason, **fields)

        snapshots = None
        if snapshot_every > 0 and self.env.run_id:  # the same on every process: all vote
            snapshots = LocalSnapshots(  # each one also goes to a buddy host (its agent sends it)
                self.env.snapshot_dir, self.env.run_id, snapshot_every,
                on_written=lambda step: self.progress.event("snapshot_written", "", step=step))
        self._checkpoints = Checkpoints(self.env.checkpoint_dir, interval_steps, max_to_keep,
                                        on_commit, on_event, self._preempted,
                                        snapshots=snapshots, save_timeout_s=save_timeout_s)
        self._phase("checkpoint_setup")
        return self._checkpoints

    def _phase(self, name: str, seconds: float | None = None) -> None:
        """Before the first step: add `seconds` (default: all since the
        latest phase ended) to startup phase `name`; the next phase starts
        where this one ended."""
        if self._first_step_done:
            return
        if seconds is None:
            seconds = time.perf_counter() - self._started
        self.timings[name] = round(self.timings.get(name, 0.0) + seconds, 3)
        self._started += seconds

    def _preempted(self, step: int, committed: bool, wait_s: float = 120.0) -> None:
        """After the emergency checkpoint of `step` ended (`committed` or
        failed, journaled either way): take no further step (this host is
        going away) and wait for the agent to end this process; the next
        generation resumes after the newest committed step. Exits with 75
        (EX_TEMPFAIL) if nobody does within `wait_s`."""
        self.log.warning("preemption: checkpoint step %d %s; waiting to be stopped", step,
                         "committed" if committed else "failed")
        # (the controller stops the slice once it hears of the commit: the
        # report, a datagram, may have been dropped; close() sends it again)
        self.progress.close()
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            time.sleep(0.5)
        os._exit(75)

    def compile(self, lowered, name: str, lower_for: Callable[[Any], Any] | None = None,
                trace_key: str = ""):
        """Compile a lowered function (`jax.jit(f).lower(*abstract_args)`),
        reusing an executable of the same slice shape from an earlier
        generation, this host's or one in the hosts' shared cache (see
        elastic.worker.compile_cache). Returns (compiled, loaded_from_cache,
        seconds).

        `lowered` may also be a function of no arguments that returns the
        lowered program: then a restart launched as the generation before
        it on this host, or the next job launched alike, loads the
        executable without calling it, saving the trace and the lowering
        (elastic.worker.launch_memo, which states what must determine the
        program: the launch but the job's and agent's own variables, the
        program's files, the installed code, the slice, and `trace_key`, a
        string naming anything else the program depends on). It is called,
        under the caller's mesh, whenever there is no such memo.

        lower_for: mesh -> the same program lowered for that mesh (same
        axis names, another size: whatever the program derives from the
        mesh, such as its batch, derived again). With it, after the first
        step, process 0 compiles the program in the background for the
        slices the controller would start next if a failure domain were
        lost (elastic.worker.compile_ahead; `[restart] compile_ahead`), so
        that such a restart loads it. Called from that background thread,
        where the caller's `jax.set_mesh` is not in effect (set it inside);
        its errors are journaled in `compiled_ahead`, never raised. Only
        programs compiled before the first step are compiled ahead."""
        from elastic.worker import compile_cache

        self._phase("setup")
        lazy = callable(lowered)
        compiled, hit, seconds, entry, lower_s = compile_cache.compile_launched(
            lowered if lazy else (lambda: lowered), self.env.cache_dir, name, self.mesh,
            trace_key, self.env.shared_cache, self.env.shared_cache_key_file, memo=lazy)
        # tracing and lowering are the program's setup, as when it lowers
        # before the call; `compile` is the compile or the load
        self._phase("setup", min(lower_s, time.perf_counter() - self._started))
        self._phase("compile")
        if not lazy or lower_s > 0.0:  # (0.0 exactly: loaded by a memo, `lowered` not called)
            self.traced.append(name)
        if lower_for is not None:
            self._ahead.append((lower_for, name, entry))
        return compiled, hit, seconds

    def _compile_ahead(self) -> None:
        """Once, after the first step: start the thread that compiles the
        programs given `lower_for` for the next slices (every process takes
        part in its probe; process 0 compiles). Programs compiled later
        are not compiled ahead."""
        import jax

        from elastic.worker import compile_ahead

        programs, self._ahead = self._ahead, []
        if not programs or not self.env.next_slices:
            return

        def report(records: list[dict]) -> None:
            def count(outcome: str) -> int:
                return sum(r["outcome"].startswith(outcome) for r in records)

            self.progress.event(
                "compiled_ahead", "for the next slices: " + "; ".join(
                    f"{r['name']} for {r['slice']} {r['outcome']} ({r['seconds']:.2f} s)"
                    for r in records),
                slices=",".join(sorted({r["slice"] for r in records})), stored=count("stored"),
                present=count("present"), skipped=count("skipped"), failed=count("failed"),
                seconds=round(sum(r["seconds"] for r in records), 3))

        self.ahead_thread = compile_ahead.start(self.env.next_slices, programs, self.env,
                                                jax.devices(), self.process_index,
                                                self.process_count, report)

    def step_done(self, step: int, **metrics: float) -> None:
        """Call after every training step (`step` counts from 0). Reports it
        (with `metrics`, and from the second step on the metric step_time_s:
        the median of the last 50 step times, seconds), checks for committed
        saves, and after the first step journals the startup phase timings.
        Costs microseconds; never blocks on the agent."""
        now = time.perf_counter()
        if self._first_step_done:
            self._step_times.append(now - self._last_step_at)
        self._last_step_at = now
        if not self._first_step_done:
            self._phase("first_step")
            self._first_step_done = True
            self._compile_ahead()
            if self.process_index == 0:
                total = round(sum(self.timings.values()), 3)
                self.progress.event("worker_phases", "startup phases of process 0: " + ", ".join(
                    f"{k} {v:.2f} s" for k, v in self.timings.items()) + f" (total {total:.2f} s)",
                    step=step, total_s=total, launched_at=round(self.launched_at, 3),
                    traced=",".join(self.traced), **{f"{k}_s": v for k, v in self.timings.items()})
        if self._step_times:
            # from the first step time measured (the second step) on, with
            # every report: it adds a field to the datagram sent anyway, not
            # a message. (Every 10th, the first came with the 11th step, and
            # a generation of steps over 10 s read as hung at its second:
            # the controller's hang timeout is 10 s while it knows none.)
            metrics["step_time_s"] = statistics.median(self._step_times)
        self.progress.step(step, **metrics)
        if self._checkpoints is not None:
            self._checkpoints.poll()

    def finish(self) -> None:
        """Wait for the save in flight, then leave the distributed runtime
        together with every other process (so none exits while a peer still
        needs it); then, on process 0, wait for a compile ahead still
        running (at most AHEAD_JOIN_S). Call once at the end of training."""
        import jax

        from elastic.worker.coordination import barrier

        if self.process_index == 0:  # not hung: the last save may take a while
            self.progress.event("worker_finishing", "training done; finishing (the last "
                                "checkpoint save, leaving the distributed runtime)")
        if self._checkpoints is not None:
            self._checkpoints.close()
        barrier("elastic-finish", timeout_s=300.0)
        jax.distributed.shutdown()
        self.finished.set()
        if self.ahead_thread is not None:
            # after the others are let go: a compile still running when the
            # interpreter exits can crash it, and at the end of training the
            # CPU is free for it
            self.ahead_thread.join(AHEAD_JOIN_S)
            if self.ahead_thread.is_alive():
                self.log.warning("a compile ahead still runs after %.0f s; exiting anyway",
                                 AHEAD_JOIN_S)
        self.progress.close()


def wait_for_coordinator(address: str, timeout_s: float, poll_s: float = 0.01) -> bool:
    """Wait until the JAX coordination service at `address` ("host:port")
    accepts TCP connections; True if it did within `timeout_s` seconds.

    Why: a process whose first connection attempt comes before process 0 has
    started the service waits out gRPC's reconnect backoff (1 s) inside
    `jax.distributed.initialize`; polling first took a 4-process init on
    this machine from ~1.1 s to ~0.01 s after process 0 is up."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=1.0).close()
            return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)


def mesh_devices(devices: list, per_process: int) -> list:
    """The devices of the mesh: the first `per_process` devices (by id) of
    every process, processes in order. The controller gives every host the
    same count, the smallest any of its hosts has or less (a host whose chip
    failed reports fewer; see elastic.policy.mesh), so on a host with more
    the others stay idle. Raises elastic.config.SpecError naming a process
    with fewer."""
    by_process: dict[int, list] = {}
    for device in devices:
        by_process.setdefault(device.process_index, []).append(device)
    chosen = []
    for process, own in sorted(by_process.items()):
        if len(own) < per_process:
            raise SpecError(f"process {process} has {len(own)} devices; the slice uses "
                            f"{per_process} per host")
        chosen += sorted(own, key=lambda d: d.id)[:per_process]
    return chosen


def build_mesh(devices: list, per_process: int, spec):
    """The mesh of a slice whose devices (every process's, all of them) are
    `devices`: `per_process` of each process's (mesh_devices), axes as
    `spec` (an elastic.config.MeshSpec) says for their number. One function
    for this generation's mesh and for the meshes a program is compiled for
    ahead (elastic.worker.compile_ahead): the two must agree device for
    device. Raises SpecError when a process has too few devices or the
    spec does not fit them."""
    import jax

    from elastic.policy.mesh import mesh_shape

    chosen = mesh_devices(devices, per_process)
    shape = mesh_shape(spec, len(chosen))
    if shape is None:
        raise SpecError(f"mesh {spec.to_text()} does not fit {len(chosen)} devices")
    axis_types = (jax.sharding.AxisType.Auto,) * len(shape)
    if len(chosen) == len(devices):
        return jax.make_mesh(shape, spec.names, axis_types=axis_types, devices=chosen)
    # Some of each host's devices: jax.make_mesh would lay the axes out by
    # the physical topology of all of them (on TPU it may refuse a partial
    # set). Take them host-major, in id order, as mesh_devices chose them:
    # the last axes run within a host.
    import numpy as np
    return jax.sharding.Mesh(np.array(chosen).reshape(shape), spec.names, axis_types=axis_types)


def allow_stack_dumps() -> None:
    """Let this process's parent (the agent) and its children (py-spy,
    elastic.agent.stacks) read its stacks when Yama restricts ptrace to
    ancestors (`kernel.yama.ptrace_scope` = 1): prctl(PR_SET_PTRACER,
    parent pid). Without Yama (or at scope 0) nothing is needed and the
    call's error is ignored."""
    import ctypes

    pr_set_ptracer = 0x59616d61  # "Yama" (linux/prctl.h)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_ptracer, os.getppid(), 0, 0, 0)
    except (OSError, AttributeError):
        pass


# how long a process that leaves without WorkerContext.finish() waits in
# JAX's distributed shutdown for its peers before it exits anyway (seconds)
UNFINISHED_EXIT_WAIT_S = 5.0
# how long a process whose exception nothing caught lets a checkpoint save in
# flight go on before it exits anyway (seconds): well inside the hang
# detection's allowance for a save (hang.min_timeout_s + checkpoint_allowance_s,
# 70 s by default), so that its peers, which wait for it meanwhile, are not
# found hung first and the crash is reported as the crash it is
FAILED_SAVE_WAIT_S = 30.0


def exit_promptly_on_failure(context: Callable[[], "WorkerContext | None"]) -> None:
    """Make a worker that fails end at once instead of waiting for its peers.

    Python's exit runs JAX's distributed shutdown, which waits at a barrier
    for every other process; they are still training, or blocked in a
    collective with this one. A worker that raised used to wait there until
    the controller's hang detection stopped the slice, and its crash was
    reported as a hang (2026-11-28: a ValueError in one of 2 processes
    stepping every 0.05 s was seen 10.5 s later, as `hang_detected`). So:

    - an exception nothing catches ends the process with exit code 1 right
      after Python's own hook has printed its traceback, once a checkpoint
      save in flight has ended or FAILED_SAVE_WAIT_S have passed (its peers,
      alive, commit it with this process; with a peer gone it cannot commit,
      and the controller's detection of that peer ends the wait); a
      KeyboardInterrupt is left to Python;
    - a process leaving otherwise before its context's `finished` is set
      (`sys.exit(3)`, or the program's end without `finish()`), once Python
      has let such a save end too, gets UNFINISHED_EXIT_WAIT_S seconds in
      JAX's shutdown, in case its peers leave as well, and then exits with
      code 1, saying so on stderr.

    Before it exits with code 1, either way, the process tells its agent it
    is failing, and whether by its own error or because a collective failed
    under it (a peer's failure: elastic.worker.failure_cause), so that the
    controller blames the right host (an exception says so before the save's
    wait, a process leaving without finish() only when its wait is over),
    and it sends its last step and committed step again
    (ProgressReporter.close).

    `context()`: the process's WorkerContext, None while `init()` has not
    made it yet (a failure then has no save to wait for). Call before
    `jax.distributed.initialize` and after importing JAX (its exit handler
    must run after this one's)."""
    previous = sys.excepthook

    def hook(kind, value, traceback) -> None:
        if issubclass(kind, KeyboardInterrupt):
            previous(kind, value, traceback)
            return
        ctx = context()
        try:
            previous(kind, value, traceback)
            if ctx is not None:
                ctx.progress.failing("peer" if _caused_by_peer(value) else "own")
            checkpoints = ctx._checkpoints if ctx is not None else None
            if checkpoints is not None and (step := checkpoints.saving()) is not None:
                print(f"elastic.worker: letting the save of checkpoint step {step} in flight "
                      f"end (at most {FAILED_SAVE_WAIT_S:g} s) before exiting",
                      file=sys.stderr, flush=True)
                waiting = threading.Thread(target=checkpoints.wait, daemon=True)
                waiting.start()
                waiting.join(FAILED_SAVE_WAIT_S)
            if ctx is not None:
                ctx.progress.close()  # (the step it ended at, and a commit the wait let end)
        finally:
            _exit_now(1)

    def give_up(ctx: "WorkerContext | None") -> None:
        try:
            if ctx is not None:
                ctx.progress.failing("own")
                ctx.progress.close()
        finally:
            _exit_now(1)

    def leaving() -> None:
        ctx = context()
        if ctx is not None and ctx.finished.is_set():
            return
        print(f"elastic.worker: leaving without finish(): waiting at most "
              f"{UNFINISHED_EXIT_WAIT_S:g} s for the other processes, then exit code 1",
              file=sys.stderr, flush=True)
        timer = threading.Timer(UNFINISHED_EXIT_WAIT_S, give_up, (ctx,))
        timer.daemon = True
        timer.start()

    sys.excepthook = hook
    atexit.register(leaving)


def _caused_by_peer(error: BaseException) -> bool:
    """caused_by_peer, "own" when it cannot tell (an exception whose str()
    raises): an excepthook must not raise."""
    try:
        return caused_by_peer(error)
    except Exception:  # noqa: BLE001
        return False


def _exit_now(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # (closed, or its reader gone)
            pass
    os._exit(code)


def init(log_all: bool = False, environ: dict[str, str] | None = None) -> WorkerContext:
    """Initialise this worker process for the current generation.

    Reads the agent's variables (raises RuntimeError naming a missing one),
    sets JAX's CPU device count to the host's device count (simulated hosts),
    calls `jax.distributed.initialize` with explicit arguments (and makes a
    SIGTERM reach its preemption sync at once: elastic.worker.preemption_notice),
    builds the mesh from the first `devices_per_host` devices of every
    process (see `mesh_devices`), and makes a failing process end at once
    (`exit_promptly_on_failure`). Raises elastic.config.SpecError when a
    process has too few devices or the mesh spec does not fit them (the
    controller's planner prevents both for slices it starts).
    """
    from elastic.worker import launch_memo

    started = _process_start_time()
    t_init, t = time.time(), time.perf_counter()
    timings = {"process_start": round(max(0.0, t_init - started), 3)}
    launch_memo.remember_loaded_code()  # (a pre-started process noted it at its imports)
    env = WorkerEnv.from_environ(environ)
    allow_stack_dumps()
    import jax

    made: list[WorkerContext] = []
    exit_promptly_on_failure(lambda: made[0] if made else None)
    jax.config.update("jax_num_cpu_devices", env.host_devices)
    timings["import_jax"] = round(time.perf_counter() - t, 3)
    t = time.perf_counter()
    if env.process_id != 0:
        wait_for_coordinator(env.coordinator_address, timeout_s=120.0)
    jax.distributed.initialize(coordinator_address=env.coordinator_address,
                               num_processes=env.num_processes, process_id=env.process_id,
                               initialization_timeout=120,
                               heartbeat_timeout_seconds=env.jax_heartbeat_timeout_s)
    timings["distributed_init"] = round(time.perf_counter() - t, 3)
    preemption_notice.hasten()
    t = time.perf_counter()

    mesh = build_mesh(jax.devices(), env.devices_per_host, env.mesh)
    log = logging.getLogger(f"elastic.worker.{env.process_id}")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter(
            f"%(asctime)s [gen {env.generation} p{env.process_id}] %(message)s", "%H:%M:%S"))
        log.addHandler(handler)
        log.propagate = False
    log.setLevel(logging.INFO if (log_all or env.process_id == 0) else logging.WARNING)
    ctx = WorkerContext(env=env, mesh=mesh, process_index=jax.process_index(),
                        process_count=jax.process_count(), generation=env.generation,
                        progress=ProgressReporter(env.progress_socket, env.generation),
                        log=log, timings=timings, launched_at=started, _started=t)
    made.append(ctx)
    ctx._phase("mesh")
    return ctx
