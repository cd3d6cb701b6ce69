"""Sharded, async checkpoints over Orbax `CheckpointManager`.

Saves are asynchronous (the training step continues while arrays are
written); a step is *committed* once Orbax has finalized it (on local disk a
renamed directory, on GCS a `commit_success.txt`), and only committed steps
are ever listed, so a save cut short by a crash is never restored. Restore
takes an abstract target (`jax.ShapeDtypeStruct`s carrying the shardings of
the *current* mesh), so a checkpoint written by 4 hosts restores on 3 or 5.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import orbax.checkpoint as ocp

from elastic.checkpoint import storable, storage
from elastic.checkpoint.snapshot import LocalSnapshots, to_state
from elastic.worker.coordination import abortable_barrier, all_gather, barrier, mark

log = logging.getLogger("elastic.checkpoint")

#: Seconds the processes wait for each other in a restore's agreements: as
#: long as Orbax's own restore barrier (its default), which absorbed how much
#: longer one process takes to read a large step than another.
RESTORE_AGREEMENT_S = 300.0


#: Names the shared-directory checks of one distributed runtime apart.
_directory_checks = itertools.count()


def check_shared_directory(directory: str) -> None:
    """Raise RuntimeError unless every process sees the same local
    `directory` (one path on a file system they share): process 0 writes a
    file of random bytes there, every process reads it back, and the
    processes compare (two gathers through the coordination service, each
    waiting up to RESTORE_AGREEMENT_S for every process). Hosts that share no
    disk each get a directory of their own under the same path, and a
    checkpoint "committed" there holds only process 0's shards: it restores
    nowhere. Also raised, on every process, when process 0 cannot write
    there. No-op for one process and for gs:// (a bucket is one place for
    everyone)."""
    if jax.process_count() == 1 or storage.scheme(directory) != "":
        return
    check, own = next(_directory_checks), {"token": None, "error": None}
    if jax.process_index() == 0:
        try:
            token = secrets.token_hex(16)
            os.makedirs(directory, exist_ok=True)
            with open(os.path.join(directory, f".elastic-shared-{token}"), "w") as f:
                f.write(token)
            own["token"] = token
        except OSError as e:  # (the others hear why, rather than wait for a token)
            own["error"] = f"{type(e).__name__}: {e}"
    # (as long as a restore's agreements: a host that compiled while the
    # others loaded comes here minutes later)
    first = all_gather(f"checkpoint-directory-{check}-written", own, RESTORE_AGREEMENT_S)[0]
    if first["error"]:
        _refuse(f"checkpoint directory {directory}: process 0 cannot write there: "
                f"{first['error']}", f"checkpoint-directory-{check}-failed")
    # (each by its own path: the same text, but on another host another directory)
    path = os.path.join(directory, f".elastic-shared-{first['token']}")
    try:
        try:
            with open(path) as f:
                seen = f.read() == first["token"]
        except OSError:
            seen = False
        verdicts = all_gather(f"checkpoint-directory-{check}-seen", seen, RESTORE_AGREEMENT_S)
    finally:
        if jax.process_index() == 0:
            with contextlib.suppress(OSError):
                os.remove(path)
    blind = [i for i, ok in enumerate(verdicts) if not ok]
    if blind:
        _refuse(f"checkpoint directory {directory} is not one directory shared by every "
                f"process: process(es) {', '.join(map(str, blind))} cannot read the file "
                f"process 0 wrote there. Hosts that share no file system each write their own, "
                f"and a checkpoint there would hold one host's shards; give the job a bucket "
                f"(checkpoint_dir = \"gs://...\") or a directory on a file system every host "
                f"mounts", f"checkpoint-directory-{check}-refused")


def _refuse(message: str, barrier_name: str) -> None:
    """Raise RuntimeError(message) on every process, each having logged it
    first, at a barrier (`barrier_name`) all pass after logging. Process 0
    serves the coordination service: when it raised and exited at once, a
    peer still reading the gather, or about to print why, was cut off and
    aborted by JAX ("connection reset by peer") without saying it."""
    log.error("%s", message)
    barrier(barrier_name, RESTORE_AGREEMENT_S)
    raise RuntimeError(message)


@dataclasses.dataclass(frozen=True)
class Restored:
    """A restored checkpoint: its step, the state pytree and the JSON metadata."""

    step: int
    state: Any
    meta: dict


def use_coordination_service_barriers() -> None:
    """Make Orbax's barriers waits in the JAX coordination service instead of
    collectives (its absl flag `experimental_orbax_use_distributed_barrier`,
    process-wide). A save passes ~8 barriers; as collectives each is a
    compiled all-gather over gloo, ~6 ms on this machine, and it never times
    out when a peer is gone. Measured: blocking save time 97 -> 58 ms median
    (3 runs x 11 saves), 4 processes x 2 CPU devices on 2 cores, 12 MiB
    state. No-op on an Orbax without the flag."""
    from absl import flags

    try:
        flag = flags.FLAGS["experimental_orbax_use_distributed_barrier"]
    except KeyError:
        return
    if not flag.value:
        flag.parse(True)


def _register_array_handler(replica_parallel: bool) -> None:
    """Orbax's handler for jax.Array with `use_replica_parallel` as given,
    without absl's "overriding jax.Array" warning, which otherwise ends up
    as the last stderr line of every cleanly exiting worker."""
    absl_log = logging.getLogger("absl")
    level = absl_log.level
    absl_log.setLevel(logging.ERROR)
    try:
        ocp.type_handlers.register_type_handler(
            jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=replica_parallel),
            override=True)
    finally:
        absl_log.setLevel(level)


def _current_operation() -> str | None:
    """Orbax's id of the save just started (its peers' signal keys carry it)."""
    try:
        from orbax.checkpoint._src.futures import synchronization
        return synchronization.OperationIdGenerator.get_current_operation_id()
    except (ImportError, AttributeError):
        return None


def _release_directory_waiters(operation: str | None) -> None:
    """After a failed save: send Orbax's "directory created" signals of
    that save, so that peers waiting for process 0 to create the step's
    directories (which failed) go on, fail at the commit barrier, which
    the failure mark aborts, and give the save up at once instead of after
    Orbax's 300 s coordination timeout. Relies on Orbax internals
    (orbax.checkpoint._src.futures, 0.12); on another version the peers
    wait out the timeout, and nothing else changes."""
    if operation is None or jax.process_count() == 1:
        return
    try:
        from orbax.checkpoint._src.futures import future, synchronization
        signals = synchronization.HandlerAwaitableSignal
        future.set_signals([signals.STEP_DIRECTORY_CREATION, signals.ITEM_DIRECTORY_CREATION],
                           operation_id=operation)
    except Exception as e:  # an Orbax without these: the timeout bounds the wait
        log.warning("could not release the peers of a failed save: %s: %s",
                    type(e).__name__, e)


class Checkpoints:
    """Checkpoints of one job in `directory`.

    interval_steps: `save` writes only at steps that are multiples of this
      (unless forced or preempted), step 0 included.
    max_to_keep: committed steps kept; older ones are deleted after a newer
      one commits (never before), in a background thread.
    on_commit(step): called on every process once a step is committed (its
      save finished without error).
    on_event(kind, reason, fields): incidents for the journal
      (`checkpoint_saved` with the seconds the save blocked,
      `checkpoint_save_failed`, `checkpoint_save_skipped`,
      `checkpoint_delete_failed`, `checkpoint_restore_failed`,
      `checkpoint_restored`).
    on_preempted(step, committed): called after an emergency save (at JAX's
      preemption sync point, the same step on every process) has ended;
      `committed` says whether every process wrote its part and the step
      was committed.
    replica_parallel: split the write of each replicated shard across its
      replicas (Orbax's `use_replica_parallel`; less I/O per host for large
      data-parallel states). Off by default: it compiles a slice per array
      shape on the first save of every process, and an elastic job's every
      restart is a new process; measured 1.6-1.8 s -> 0.07-0.15 s for a first
      save of 24 arrays, 4 processes x 2 CPU devices. Process-wide setting.
    snapshots: local snapshots (elastic.checkpoint.snapshot) taken by `save`
      and preferred by `restore_latest` when the slice can use them.
    save_timeout_s: seconds a save may take from its start to its commit on
      every process (Orbax's `AsyncOptions.timeout_secs`); a process whose
      peers do not finish their part within it gives the save up.

    Making one is collective (every process, in the same order): with a
    local directory it checks that every process sees the same one, and
    raises RuntimeError when they do not (`check_shared_directory`). Saves
    are due at steps that are multiples of `interval_steps`, decided from
    the step alone; a step any process lists as committed is skipped, so a
    step below the newest listed one may be saved (after a restore fell
    back past it), and Orbax's own latest step then reads as the newest
    saved, not the highest.

    A save that fails (storage errors past the storage clients' own
    retries, a peer that never finished) is abandoned, never committed, and
    journaled as `checkpoint_save_failed`; training goes on and the next
    interval saves again. While a save is still being written on any
    process, a regular save due is skipped (journaled) rather than waited
    for, so slow storage never stalls the training loop; an emergency
    (preemption) or forced save waits. Every process of the slice must make
    the same calls (they are collective); the processes agree through the
    JAX coordination service before every save.
    """

    def __init__(self, directory: str, interval_steps: int = 100, max_to_keep: int = 3,
                 on_commit: Callable[[int], None] | None = None,
                 on_event: Callable[[str, str, dict], None] | None = None,
                 on_preempted: Callable[[int, bool], None] | None = None,
                 replica_parallel: bool = False, snapshots: LocalSnapshots | None = None,
                 save_timeout_s: float = 600.0) -> None:
        if interval_steps < 1 or max_to_keep < 1 or not save_timeout_s >= 1:
            raise ValueError(f"interval_steps ({interval_steps}) and max_to_keep "
                             f"({max_to_keep}) must be at least 1, save_timeout_s "
                             f"({save_timeout_s}) at least 1 s")
        self.directory = directory
        self.interval_steps = interval_steps
        self.max_to_keep = max_to_keep
        self.on_commit = on_commit or (lambda step: None)
        self.on_event = on_event or (lambda kind, reason, fields: None)
        self.on_preempted = on_preempted or (lambda step, committed: None)
        self.snapshots = snapshots
        self._pending: int | None = None  # the step being written, on this process
        self._last_started: int | None = None
        self._failed: list[dict] = []  # this process's failed saves, not yet shared
        self._skipped = 0  # saves skipped since the last one started
        self._journaled_failures: set[int] = set()
        self._agreements = 0  # gathers made, the same count on every process
        self._restores = 0  # restore_latest calls, the same count on every process
        self._delete_failure_reported = False
        self._emergency_step: int | None = None
        self._writing: int | None = None  # the step of the save started last
        self._barrier_uses: dict[str, int] = {}
        self._operation: str | None = None  # Orbax's id of the save in flight
        self._barrier_lock = threading.Lock()
        check_shared_directory(directory)
        use_coordination_service_barriers()
        _register_array_handler(replica_parallel)
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=interval_steps, max_to_keep=max_to_keep, create=True,
            enable_async_checkpointing=True, enable_background_delete=True,
            # no storage I/O in the training loop: the check for a leftover
            # directory of the step is skipped (a stalled check blocked the
            # loop for the ~33 s of gcsfs's retries, then raised), and
            # leftovers of saves cut short (never committed) are removed at
            # creation instead, in the background
            file_options=ocp.options.FileOptions(skip_sync_file_validations=True),
            cleanup_tmp_directories=True,
            async_options=ocp.options.AsyncOptions(timeout_secs=int(save_timeout_s),
                                                   barrier_sync_fn=self._barrier))
        self.manager = ocp.CheckpointManager(storage.resolve(directory), options=options,
                                             item_names=("state", "meta"))
        # Reads a step without Orbax's Checkpointer.restore, which ends in a
        # barrier of every process: a process that fails to read the step
        # never gets there, and the others would wait in it (300 s) instead of
        # in the agreement on whether the step restored (restore_latest).
        self._reader = ocp.CompositeCheckpointHandler(
            state=ocp.StandardCheckpointHandler(), meta=ocp.JsonCheckpointHandler())

    def poll(self) -> int | None:
        """Report a save that finished since the last call; returns its step
        when it committed. A failed save is recorded (journaled at the next
        save, once the processes have shared what failed where). Cheap: call
        it every step."""
        self._check_deleter()
        if self._pending is None or self.manager.is_saving_in_progress():
            return None
        return self._settle()

    def _settle(self) -> int | None:
        """Wait for this process's save in flight (if any) to end: its step
        if it committed; None if there was none or it failed (recorded)."""
        if self._pending is None:
            return None
        step, self._pending = self._pending, None
        try:
            self.manager.wait_until_finished()  # raises the save's error (once)
        except Exception as e:  # storage errors, a peer's timeout: the save is abandoned
            error = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            log.error("checkpoint step %s not committed: %s", step, error)
            self._failed.append({"step": step, "error": error})
            # peers still waiting in this save's barriers give it up now
            mark(f"elastic/checkpoint/failed/{step}/{jax.process_index()}",
                 f"process {jax.process_index()}: {error}")
            _release_directory_waiters(self._operation)
            return None
        self.on_commit(step)
        return step

    def _barrier(self, *, key: str, timeout_ms: int) -> None:
        """Orbax's barriers of a save (its `AsyncOptions.barrier_sync_fn`):
        given up at once when a process marked the save of the step being
        written failed (see `_settle`), instead of after the save timeout.

        The barriers around Orbax's "save in progress" flag are skipped:
        they only make the flag flip on every process together, which
        `save` agrees on by itself, and the one at the end of a save would
        hold a process whose save failed until its peers give up, so that
        it could never tell them to (a deadlock until the save timeout).
        The commit barriers, which keep a step from being committed before
        every process wrote its part, are kept."""
        if key.startswith("ThreadSaveMultiHostValueHolder"):
            return
        with self._barrier_lock:  # Orbax may use a key again: count the uses
            use = self._barrier_uses[key] = self._barrier_uses.get(key, 0) + 1
        abortable_barrier(f"elastic/checkpoint/barrier/{key}/{use}", timeout_ms / 1000,
                          f"elastic/checkpoint/failed/{self._writing}/")

    def _check_deleter(self) -> None:
        """Journal (once) when the background deletion of old steps stopped
        on an error: they stay until the next generation deletes them."""
        deleter = getattr(self.manager, "_checkpoint_deleter", None)
        error = getattr(deleter, "_exception", None)
        if error is not None and not self._delete_failure_reported:
            self._delete_failure_reported = True
            self.on_event("checkpoint_delete_failed", f"deleting checkpoints older than the "
                          f"newest {self.max_to_keep} stopped: "
                          f"{type(error).__name__}: {str(error).splitlines()[0][:300]}; they "
                          f"stay in storage until a later generation deletes them", {})

    def _removing_leftovers(self, wait: bool) -> bool:
        """Whether the removal of the leftovers of saves cut short (Orbax's
        cleanup_tmp_directories: process 0, in the background since the
        manager was made) still runs; with `wait`, wait for it first. A save
        must not start beside it (it could take the new save's directory
        for a leftover). If it failed, journal that once and forget it:
        Orbax would raise the error from every later save of process 0
        alone, after the others had agreed to save."""
        cleanup = getattr(self.manager, "_cleanup_tmp_directory_future", None)
        if cleanup is None:
            return False
        # Its thread tells a removal still running from one that timed out
        # (result() raises TimeoutError for both). Without it (another Orbax),
        # wait for the removal, as Orbax's own first save would.
        thread = getattr(cleanup, "_t", None)
        if not wait and thread is not None and thread.is_alive():
            return True
        try:
            cleanup.result()
        except Exception as e:  # noqa: BLE001 - storage errors of any kind
            self.on_event("checkpoint_delete_failed", f"removing the leftovers of saves cut "
                          f"short stopped: {type(e).__name__}: {str(e).splitlines()[0][:300]}; "
                          f"they stay in storage (never restored: not committed)", {})
        self.manager._cleanup_tmp_directory_future = None
        return False

    def _agree(self, busy: int | None, cleaning: bool = False, listed: bool = False
               ) -> list[dict]:
        """Share with every process the step of its save still being
        written (`busy`, None if none), whether it is still removing the
        leftovers of saves cut short (`cleaning`), whether it lists the step
        about to be saved as committed (`listed`), and which of its saves
        failed; journal the failures (every process learns them; process
        0's on_event writes them). Returns each process's report, in process
        order."""
        self._agreements += 1
        own = {"busy": busy, "cleaning": cleaning, "listed": listed, "failed": self._failed}
        self._failed = []
        reports = all_gather(f"checkpoint-save-{self._agreements}", own)
        failed: dict[int, dict[int, str]] = {}
        for process, report in enumerate(reports):
            for f in report["failed"]:
                failed.setdefault(f["step"], {})[process] = f["error"]
        for step, errors in sorted(failed.items()):
            if step in self._journaled_failures and all(
                    e.startswith("BarrierAborted") for e in errors.values()):
                continue  # peers giving up later, because of the failure journaled
            self._journaled_failures.add(step)
            # the cause, rather than a peer's "given up because of the cause"
            first = min(errors.items(), key=lambda e: (e[1].startswith("BarrierAborted"), e[0]))
            self.on_event("checkpoint_save_failed",
                          f"save of step {step} failed on process(es) "
                          f"{', '.join(map(str, errors))} and was not committed "
                          f"(process {first[0]}: {first[1]})",
                          {"step": step, "processes": sorted(errors), "error": first[1],
                           "preemption": step == self._emergency_step})
        return reports

    def save(self, step: int, state: Any, meta: dict | None = None, force: bool = False) -> bool:
        """Start an async save of `state` (a pytree of jax.Arrays) and `meta`
        (JSON-serialisable) at `step` if the interval says so (or `force`).
        Call it every step: it is also where a preemption is noticed. When any
        process got a preemption notice (SIGTERM, through JAX's preemption
        service), every process saves at the same step, waits for the commit
        and calls `on_preempted(step, committed)`. Returns whether a save
        started (local snapshots, taken here too on their own interval, do
        not count). A regular save is skipped (journaled
        `checkpoint_save_skipped`) while the previous one is still being
        written on any process, and when `step` already has a committed
        checkpoint (one a restore fell back past: never overwritten).
        Blocks only for the device-to-host copy and a few milliseconds of
        agreement between processes, and, on a snapshot step, for copying
        this process's shards for the snapshot's background write (~3 ms
        for workers/lm on this project's machine in isolation); a forced
        or emergency save first waits for the one in flight."""
        self.poll()
        state = storable.unwrap_keys(state)  # (typed PRNG keys as their key data)
        if self.snapshots is not None:
            self.snapshots.save(step, state, meta)
        if step == self._last_started:
            return False
        preempted = self.manager.reached_preemption(step)
        urgent = force or preempted
        # (from the step alone, the same on every process: Orbax's own
        # should_save reads this process's listing of storage, and processes
        # whose listings differ would not all come to the agreement below)
        if not (urgent or step % self.interval_steps == 0):
            return False
        t0 = time.perf_counter()
        if urgent and self._pending is not None:  # this one must not be skipped
            self.on_event("checkpoint_save_delayed", f"{'emergency' if preempted else 'forced'} "
                          f"save of step {step} waits for the save of step {self._pending} "
                          f"in flight", {"step": step, "waiting_for": self._pending,
                                         "preemption": preempted})
            self._settle()
        reports = self._agree(self._pending, self._removing_leftovers(wait=urgent),
                              step in self.manager.all_steps())
        busy = [i for i, r in enumerate(reports) if r["busy"] is not None]
        cleaning = [i for i, r in enumerate(reports) if r["cleaning"]]
        listed = [i for i, r in enumerate(reports) if r.get("listed")]
        skip = ""
        if busy:
            skip = (f"step {reports[busy[0]]['busy']} is still being written on process(es) "
                    f"{', '.join(map(str, busy))}")
        elif cleaning:
            skip = (f"process(es) {', '.join(map(str, cleaning))} still remove the leftovers "
                    f"of saves cut short")
        elif listed:  # (on any process: a listing may lag, and a bucket's save of
            # a step that exists would remove it first)
            skip = (f"the step already has a committed checkpoint (listed by process(es) "
                    f"{', '.join(map(str, listed))}), which is never overwritten")
        if skip:
            if not (busy and self._skipped):  # once per save in flight, not every interval
                self.on_event("checkpoint_save_skipped", f"save of step {step} skipped: {skip}"
                              + ("; later saves are skipped until it ends" if busy else ""),
                              {"step": step, "busy_processes": busy})
            self._skipped += 1
            if preempted:  # committed: the step is in storage already, nothing more to save
                self.on_preempted(step, not (busy or cleaning))
            return False
        self._writing = step
        started = self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(storable.without_empty(state)),
            meta=ocp.args.JsonSave(meta or {})),
            force=True)  # (decided above, together)
        if started:
            self._operation = _current_operation()
            self._pending = self._last_started = step
            blocked = time.perf_counter() - t0
            kind = "emergency save" if preempted else "save"
            skipped = f" ({self._skipped} save(s) skipped before it)" if self._skipped else ""
            self.on_event("checkpoint_saved", f"{kind} of step {step} started; blocked "
                          f"{blocked * 1000:.1f} ms{skipped}",
                          {"step": step, "blocking_s": round(blocked, 4),
                           "preemption": preempted, "skipped_saves": self._skipped})
            self._skipped = 0
        if preempted:
            self._emergency_step = step
            committed = self._settle() == step
            reports = self._agree(None)
            committed = committed and not any(r["failed"] for r in reports)
            self.on_preempted(step, committed)
        return started

    def committed_steps(self) -> list[int]:
        """Committed steps, oldest first (re-read from storage)."""
        self.manager.reload()
        return sorted(self.manager.all_steps())

    def restore_latest(self, abstract_state: Any) -> Restored | None:
        """Restore the newest committed step into `abstract_state`'s shapes and
        shardings; None when there is no checkpoint.

        Local snapshots, if any, come first: when every process can rebuild
        its shards of the current mesh from a snapshot of one step, at least
        as new as the newest committed one (its own, or one made up from the
        parts the processes hold, own and peers' replicas:
        elastic.checkpoint.snapshot_transfer), that step is restored (the
        event says `source: snapshot`, `sent_by` the sending processes and
        `replicas_of` the hosts whose replicas were used, comma-separated,
        when any). Otherwise, if a committed step
        fails to restore on any process, every process moves on to the
        previous step together (agreed through the coordination service,
        elastic.worker.coordination) and the failure is reported through
        `on_event`. Raises RuntimeError when every committed step fails, and
        the coordination service's error when a process does not reach one
        of the agreements within RESTORE_AGREEMENT_S seconds."""
        # Every process lists storage itself, and the listings can differ (a
        # deposed process 0 committing late, a stale listing of a shared file
        # system): processes that tried different steps would wait in
        # different agreements. Only the steps every process lists count.
        self._restores += 1
        listed = all_gather(f"restore-{self._restores}-steps", self.committed_steps(),
                            RESTORE_AGREEMENT_S)
        steps = sorted(set(listed[0]).intersection(*listed[1:]))
        stored = storable.unwrap_abstract(abstract_state)  # (keys as their key data)
        if self.snapshots is not None:
            t0 = time.perf_counter()
            newest = steps[-1] if steps else None
            snap = self.snapshots.restore(stored, newest)
            if snap is not None:
                state = storable.wrap_keys(to_state(snap, stored), abstract_state)
                seconds = time.perf_counter() - t0
                sent = list(snap.sent_by)
                fields = {"step": snap.step, "restore_s": round(seconds, 3),
                          "source": "snapshot", "saved_at": snap.saved_at}
                if sent:
                    fields["sent_by"] = sent
                if snap.replicas_of:  # (text: journal lists hold process ids only)
                    fields["replicas_of"] = ",".join(snap.replicas_of)
                parts = (f" (process(es) {', '.join(map(str, sent))} sent the parts the others "
                         f"lacked" + (f", from replicas of host(s) {', '.join(snap.replicas_of)}"
                                      if snap.replicas_of else "") + ")") if sent else ""
                self.on_event("checkpoint_restored", f"restored step {snap.step} from local "
                              "snapshots" + parts
                              + f" in {seconds:.2f} s (newest committed checkpoint: "
                              f"{'none' if newest is None else newest})", fields)
                return Restored(snap.step, state, dict(snap.meta))
        for step in reversed(steps):
            t0 = time.perf_counter()
            error = ""
            try:  # (the step's directory: CheckpointManager's default name for it)
                restored = self._reader.restore(self.manager.directory / str(step),
                                                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(storable.without_empty(stored)),
                    meta=ocp.args.JsonRestore()))
            except Exception as e:  # any failure to read this step: try the previous one
                error = f"{type(e).__name__}: {e}"[:500]
            if all(all_gather(f"restore-{self._restores}-{step}", not error,
                              RESTORE_AGREEMENT_S)):
                seconds = time.perf_counter() - t0
                self.on_event("checkpoint_restored", f"restored checkpoint step {step} in "
                              f"{seconds:.2f} s", {"step": step, "restore_s": round(seconds, 3)})
                state = storable.wrap_keys(storable.with_empty(restored.state, stored),
                                           abstract_state)
                return Restored(step, state, dict(restored.meta or {}))
            reason = (f"checkpoint step {step} failed to restore"
                      + (f": {error}" if error else " on another process")
                      + "; trying the previous one")
            log.error(reason)
            self.on_event("checkpoint_restore_failed", reason, {"step": step})
        if steps:
            raise RuntimeError(f"no committed checkpoint in {self.directory} restores "
                               f"(tried steps {steps})")
        return None

    def saving(self) -> int | None:
        """The step of this process's save in flight (started, not yet
        reported ended), or None."""
        return self._pending

    def wait(self) -> None:
        """Block until this process's save in flight has ended (committed and
        reported, or failed and recorded)."""
        self._settle()

    def close(self) -> None:
        """Wait for the save and the local snapshot in flight, journal what
        failed on any process (collective: every process calls it), and
        close Orbax's manager; an error of the background deletion of old
        steps is journaled, not raised (the checkpoints it kept are still
        good)."""
        self._settle()
        if self.snapshots is not None:
            self.snapshots.flush()
        self._agree(None)
        self._check_deleter()
        try:
            self.manager.close()
        except Exception as e:
            log.error("closing the checkpoint manager: %s: %s", type(e).__name__, e)
