"""Local snapshots: each host keeps the training state of its last few steps
next to it (a file in the agent's snapshot directory), so that a restart after
a crash resumes from the step the slice had reached instead of from the last
persistent checkpoint, tens of steps back.

The idea is in-memory checkpointing: GEMINI (Wang et al., SOSP 2023) keeps
every step's state in host memory, and Orbax's emergency checkpointing keeps
frequent local checkpoints on every host beside the rare persistent ones.
Here a snapshot is what a process holds: its addressable shards (each region
once), written after the step into a file (atomic by rename, so a snapshot is
whole or absent) in the agent's snapshot directory, by default on tmpfs
(/dev/shm), i.e. in host memory.

A restart can use snapshots of step S when every process of the new slice
can rebuild its shards of the new mesh from S: from its own snapshot when
every shard it needs lies inside one that it holds (always on the hosts of
the same slice), or else from the parts the processes hold between them.
Each host's agent also sends every snapshot to a buddy host's agent
(elastic.agent.replicas), which keeps it beside its own as a replica; at a
restore the processes vote with the regions they hold, own and replicas,
and when together they make up the whole state (`plan_assembly`), they send
them to each other through one collective of the new slice
(elastic.checkpoint.snapshot_transfer): a newcomer, a restarted host or one
that was cut off gets the step over the network, and a host lost with state
sharded across hosts is made up from its buddy's replica. The processes
agree through the JAX coordination service; otherwise the persistent
checkpoint is restored. A snapshot is never a committed checkpoint: it is used
only by the same controller run (run id), and the agent wipes its directory
when it starts, stops, sees a new run or missed a generation, so a host that
was really restarted (or simulated as such) has none.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import os
import pathlib
import shutil
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any, BinaryIO

import numpy as np

from elastic.security.files import open_private

log = logging.getLogger("elastic.checkpoint")

MAGIC = b"ELSNAP1\n"
SUFFIX = ".snap"
#: Replicas of peers' snapshots start with this (see replica_name).
REPLICA_PREFIX = "replica-"
# (start, stop) per dimension: the part of a global array a shard holds
Region = tuple[tuple[int, int], ...]
# by tree path (jax.tree_util.keystr): global shape, dtype name, shards held
Leaves = dict[str, tuple[tuple[int, ...], str, list[tuple[Region, np.ndarray]]]]


class SnapshotError(Exception):
    """A snapshot file that cannot be read back whole (truncated, malformed)."""


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """One process's snapshot of one step, read back.

    saved_at: Unix seconds when the step's state was written; leaves: by tree
    path (jax.tree_util.keystr), the global shape, dtype name and the shards
    (region, array) held (array None in a header read without its data)."""

    step: int
    saved_at: float
    run_id: str
    meta: dict
    leaves: Leaves
    # the processes that sent parts of this step to the processes without them
    # (empty: none lacked it), and the hosts whose replicas they sent from
    sent_by: tuple[int, ...] = ()
    replicas_of: tuple[str, ...] = ()


# a snapshot file held open at a restore: its path, the file and its header
Held = tuple[pathlib.Path, BinaryIO, Snapshot]


def region_of(index: tuple[slice, ...], shape: Sequence[int]) -> Region:
    """A shard's index (a tuple of slices, as JAX gives it) as (start, stop) pairs."""
    return tuple((s.start or 0, dim if s.stop is None else s.stop)
                 for s, dim in zip(index, shape)) + tuple((0, dim) for dim in shape[len(index):])


def inside(inner: Region, outer: Region) -> bool:
    """Whether region `inner` lies within region `outer`."""
    return all(o0 <= i0 and i1 <= o1 for (i0, i1), (o0, o1) in zip(inner, outer))


def host_shards(state: Any, copy: bool = False) -> Leaves:
    """This process's shards of every leaf of `state` (a pytree of jax.Array),
    each distinct region once, as host arrays: views of the device buffers
    where the platform allows it (CPU), so use them before the next step
    may donate those buffers — or, with `copy`, arrays of their own (on
    CPU a copy of the view; elsewhere the transfer to the host is one
    already). Raises TypeError for a leaf that is not a jax.Array."""
    import jax

    leaves = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        if not isinstance(leaf, jax.Array):
            raise TypeError(f"snapshot: leaf {jax.tree_util.keystr(path)} is a "
                            f"{type(leaf).__name__}, not a jax.Array")
        shards: dict[Region, np.ndarray] = {}
        for shard in leaf.addressable_shards:
            region = region_of(shard.index, leaf.shape)
            if region not in shards:
                own = copy and shard.device.platform == "cpu"
                shards[region] = np.array(shard.data, order="C") if own else \
                    np.asarray(shard.data)
        leaves[jax.tree_util.keystr(path)] = (tuple(leaf.shape), str(leaf.dtype),
                                              list(shards.items()))
    return leaves


def replica_adds(regions: dict[int, dict[str, set[Region]]], me: int) -> bool:
    """Whether a replica of process `me`'s snapshot on a buddy host can add
    anything: True unless every other process holds every region of every
    leaf that `me` holds (inside one of its own), as under pure data
    parallelism across hosts; True for a slice of one. Pure. regions: per
    process, per leaf, the regions its devices hold (`state_regions`).

    A region that some other process also holds is not enough: the
    controller keeps a lost host's buddy in the next slice trusting that it
    holds the lost host's snapshot (elastic.policy.buddies.
    keep_replicas_within), and the other holders may be left out. With mesh
    data=-1 x model=4 on 4 hosts of 2 devices, h0 and h2 hold model blocks
    0-1, h1 and h3 blocks 2-3: when h1 is lost and 2 hosts fit, the planner
    keeps h1's buddy h2, and {h0, h2} lack blocks 2-3 without h1's replica."""
    others = [leaves for process, leaves in regions.items() if process != me]
    return not others or any(
        not all(any(inside(region, held) for held in leaves.get(name, ())) for leaves in others)
        for name, mine in regions.get(me, {}).items() for region in mine)


def state_regions(state: Any) -> dict[int, dict[str, set[Region]]]:
    """Per process, per leaf (tree path) of `state` (jax.Arrays), the regions
    its devices hold: from the shardings, the same on every process."""
    import jax

    out: dict[int, dict[str, set[Region]]] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        name = jax.tree_util.keystr(path)
        for device, index in leaf.sharding.devices_indices_map(leaf.shape).items():
            out.setdefault(device.process_index, {}).setdefault(name, set()).add(
                region_of(index, leaf.shape))
    return out


def write(path: pathlib.Path, step: int, saved_at: float, run_id: str, meta: dict,
          leaves: Leaves) -> int:
    """Write one snapshot file atomically (a temporary name, then rename).
    Layout: MAGIC, 8-byte little-endian header length, JSON header, then every
    shard's bytes in header order. Returns the bytes written; raises OSError."""
    header: dict = {"step": step, "saved_at": saved_at, "run_id": run_id, "meta": meta,
                    "leaves": []}
    offset = 0
    arrays = []
    for name, (shape, dtype, shards) in leaves.items():
        entry = {"path": name, "shape": list(shape), "dtype": dtype, "shards": []}
        for region, data in shards:
            data = np.asarray(data, order="C")  # (ascontiguousarray makes 0-d 1-d)
            entry["shards"].append({"region": [list(r) for r in region], "offset": offset,
                                    "nbytes": data.nbytes, "shape": list(data.shape)})
            offset += data.nbytes
            arrays.append(data)
        header["leaves"].append(entry)
    header["data_bytes"] = offset
    head = json.dumps(header).encode()
    tmp = path.with_name(f".{path.name}.tmp")
    with open_private(tmp, "wb") as f:  # the model's state: its owner's only, as replicas are
        f.write(MAGIC + struct.pack("<Q", len(head)) + head)
        for data in arrays:  # (as bytes: the buffer protocol refuses ml_dtypes' bfloat16,
            f.write(data.reshape(-1).view(np.uint8))  # float8, int4: "cannot include dtype")
    os.replace(tmp, path)
    return len(MAGIC) + 8 + len(head) + offset


def read(path: pathlib.Path, data: bool = True) -> Snapshot:
    """Read a snapshot file; raises SnapshotError if it is not a whole one.
    With `data` False only its header is read (the file's size still
    checked against it): every shard's array is then None."""
    try:
        with open(path, "rb") as f:
            return read_open(f, str(path), data)
    except OSError as e:
        raise SnapshotError(f"{path}: {e}") from None


def read_open(f: BinaryIO, name: str, data: bool = True) -> Snapshot:
    """`read` from `f`, a snapshot file open for reading in binary (from its
    start, whatever its position; `name` for errors): with `data` False
    only MAGIC, the header length and the header are read. Raises
    SnapshotError, OSError."""
    import jax.numpy as jnp

    f.seek(0)
    prefix = f.read(len(MAGIC) + 8)
    if len(prefix) < len(MAGIC) + 8 or not prefix.startswith(MAGIC):
        raise SnapshotError(f"{name}: not a snapshot file")
    (head_len,) = struct.unpack("<Q", prefix[len(MAGIC):])
    size = os.fstat(f.fileno()).st_size
    start = len(MAGIC) + 8 + head_len
    if start > size:
        raise SnapshotError(f"{name}: {size} bytes, shorter than its header")
    try:
        header = json.loads(f.read(head_len))
        if size != start + header["data_bytes"]:
            raise SnapshotError(f"{name}: {size} bytes, header says "
                                f"{start + header['data_bytes']}")
        raw = f.read(header["data_bytes"]) if data else None
        if raw is not None and len(raw) != header["data_bytes"]:
            raise SnapshotError(f"{name}: cut short while read")
        leaves: Leaves = {}
        for entry in header["leaves"]:
            dtype = jnp.dtype(entry["dtype"])
            leaves[entry["path"]] = (tuple(entry["shape"]), entry["dtype"], [
                (tuple(tuple(r) for r in s["region"]),
                 None if raw is None else np.frombuffer(
                     raw, dtype, s["nbytes"] // max(dtype.itemsize, 1),
                     s["offset"]).reshape(s["shape"]))
                for s in entry["shards"]])
        return Snapshot(int(header["step"]), float(header["saved_at"]), header["run_id"],
                        header.get("meta") or {}, leaves)
    except (ValueError, KeyError, TypeError) as e:
        raise SnapshotError(f"{name}: malformed header: {e}") from None


def needed_regions(abstract_state: Any) -> dict[str, tuple[tuple[int, ...], str, list[Region]]]:
    """Per leaf of `abstract_state` (jax.ShapeDtypeStructs with shardings):
    global shape, dtype name and the regions this process's devices hold."""
    import jax

    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_state)[0]:
        regions = {region_of(index, leaf.shape)
                   for index in leaf.sharding.addressable_devices_indices_map(leaf.shape).values()}
        out[jax.tree_util.keystr(path)] = (tuple(leaf.shape), str(np.dtype(leaf.dtype)),
                                           sorted(regions))
    return out


def covers(snapshot: Snapshot, needed: dict) -> bool:
    """Whether `snapshot` alone gives every region in `needed` (from
    `needed_regions`): the same leaves, shapes and dtypes, and each needed
    region inside one held shard."""
    if set(snapshot.leaves) != set(needed):
        return False
    for name, (shape, dtype, regions) in needed.items():
        held_shape, held_dtype, shards = snapshot.leaves[name]
        if held_shape != shape or held_dtype != dtype:
            return False
        if not all(any(inside(r, held) for held, _ in shards) for r in regions):
            return False
    return True


def same_state(snapshot: Snapshot, needed: dict) -> bool:
    """Whether `snapshot`'s leaves are those of `needed` (from
    `needed_regions`): the same paths, shapes and dtypes."""
    return set(snapshot.leaves) == set(needed) and all(
        tuple(snapshot.leaves[name][0]) == tuple(shape) and snapshot.leaves[name][1] == dtype
        for name, (shape, dtype, _) in needed.items())


def _volume(region: Region) -> int:
    out = 1
    for start, stop in region:
        out *= stop - start
    return out


def _overlap(a: Region, b: Region) -> bool:
    return all(a0 < b1 and b0 < a1 for (a0, a1), (b0, b1) in zip(a, b))


def plan_assembly(held: Sequence[dict[str, list[Region]] | None],
                  shapes: dict[str, tuple[int, ...]]) -> dict[str, list[tuple[Region, int]]] | None:
    """Which process sends which region of every leaf so that together they
    make up the whole state, or None when some part of a leaf is held by
    nobody. Pure.

    held: per process (in process order), the regions it holds of each leaf
      (its own snapshot's and its peers' replicas'), None for none.
    shapes: every leaf's global shape.
    Returns per leaf [(region, process)]: the whole array from the lowest
    process holding it whole, else a partition of it (regions of one
    sharding: disjoint, filling the leaf), each region from the lowest
    process holding it. Regions that overlap without being equal (two
    shardings) are not combined: None."""
    plan: dict[str, list[tuple[Region, int]]] = {}
    for name, shape in shapes.items():
        full = tuple((0, dim) for dim in shape)
        holders: dict[Region, int] = {}
        for process, leaves in enumerate(held):
            for region in (leaves or {}).get(name, []):
                holders.setdefault(tuple(tuple(r) for r in region), process)
        if full in holders:
            plan[name] = [(full, holders[full])]
            continue
        regions = sorted(holders)
        if sum(map(_volume, regions)) != _volume(full) or any(
                _overlap(a, b) for i, a in enumerate(regions) for b in regions[i + 1:]) or \
                not all(inside(r, full) for r in regions):
            return None
        plan[name] = [(r, holders[r]) for r in regions]
    return plan


def choose_restore(votes: Sequence[dict], committed_step: int | None,
                   shapes: dict[str, tuple[int, ...]]
                   ) -> tuple[int, dict[str, list[tuple[Region, int]]] | None] | None:
    """The snapshot step the slice restores and how, or None to restore the
    persistent checkpoint. Pure.

    votes: per process, in process order, {"own": steps it can restore from
    its own snapshot, "held": {str(step): {leaf: regions held}}} (regions
    of its own snapshots and of replicas its agent keeps for peers).
    shapes: every leaf's global shape (the state being restored).
    The newest step at least as new as `committed_step` (a snapshot of the
    same step restores faster, from memory) that every process can restore
    itself -> (step, None); failing that, one whose regions, held across
    the processes, make up the whole state -> (step, plan_assembly's plan):
    the processes send them to each other (snapshot_transfer.assemble)."""
    if not votes:
        return None
    own = [set(v["own"]) for v in votes]
    held = [{int(step): regions for step, regions in v.get("held", {}).items()} for v in votes]
    for step in sorted(set().union(*own, *held), reverse=True):
        if committed_step is not None and step < committed_step:
            break
        if all(step in steps for steps in own):
            return step, None
        plan = plan_assembly([h.get(step) for h in held], shapes)
        if plan is not None:
            return step, plan
    return None


def coordination_service_agree(tag: str, timeout_s: float = 60.0) -> Callable[[dict], list[dict]]:
    """An all-gather of each process's vote through the JAX coordination
    service's key-value store (no compiled collective). `tag` must be new for
    every agreement within one distributed runtime."""

    def agree(own: dict) -> list[dict]:
        from elastic.worker.coordination import all_gather

        return all_gather(f"snapshot-vote-{tag}", own, timeout_s)

    return agree


class LocalSnapshots:
    """One process's local snapshots in `directory` (None: this host keeps
    none, but still votes, so that the slice agrees).

    every_steps: snapshot every this many steps (the same on every process).
      The training loop is blocked only while this process's shards are
      copied into host memory of its own (the next step may donate the
      device buffers): for a 7 MB state on this project's machine ~2.6 ms
      in isolation and ~10 ms with 4 processes sharing its 2 cores, where
      writing the file in the loop took ~7 ms and ~18 ms
      (bench/snapshot_overhead.py); the file is written by a
      background thread, which the next snapshot waits for if it is still
      writing. `seconds` keeps the recent blocking times, `drain_blocked_s`
      sums them; `flush()` waits for the write in flight.
      bench/snapshot_overhead.py measures what it costs a step.
    keep: snapshots kept (>= 2; 3 by default, so that processes still share
      one after a crash even when one of them was still writing its newest
      while its peers had written the next: two intervals apart).
    run_id: the controller run they belong to; others are never restored.
    agree(own_vote) -> every process's vote (see `choose_restore`): defaults
      to the coordination service; tests pass their own.
    on_written(step): called (on the writer's thread) after each snapshot
      file is in place unless every other process holds every part of the
      state this one holds (`replica_adds`: pure data parallelism across
      hosts, where a replica would cost and add nothing); the worker
      runtime then tells its agent, which sends a replica to the host's
      buddy (elastic.agent.replicas). Replicas that peers' agents sent to
      this host's agent lie in the same directory (`replica_name`) and are
      offered at every restore beside the process's own snapshots.
    """

    def __init__(self, directory: str | None, run_id: str, every_steps: int = 10, keep: int = 3,
                 agree: Callable[[dict], list[dict]] | None = None,
                 clock: Callable[[], float] = time.time,
                 on_written: Callable[[int], None] | None = None) -> None:
        if every_steps < 1 or keep < 2:
            raise ValueError(f"every_steps ({every_steps}) must be >= 1 and keep ({keep}) >= 2")
        self.directory = pathlib.Path(directory) if directory else None
        self.run_id, self.every_steps, self.keep = run_id, every_steps, keep
        self.agree = agree or coordination_service_agree("restore")
        self.clock = clock
        self.on_written = on_written
        self._replicate: bool | None = None  # (replica_adds, from the first save's state)
        self._last_saved: int | None = None
        # seconds each of the recent snapshots blocked the training loop, and
        # the sum since the last drain_blocked_s
        self.seconds: collections.deque = collections.deque(maxlen=50)
        self._blocked_s = 0.0
        self._disabled = self.directory is None
        self._warned_room = False
        self._writer: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: concurrent.futures.Future | None = None
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)

    def _path(self, step: int) -> pathlib.Path:
        return self.directory / f"step-{step:010d}{SUFFIX}"

    def steps(self) -> list[int]:
        """Steps with a whole snapshot file here, oldest first."""
        if self.directory is None:
            return []
        return sorted(int(p.name[5:-len(SUFFIX)]) for p in self.directory.glob(f"step-*{SUFFIX}"))

    def save(self, step: int, state: Any, meta: dict | None = None) -> bool:
        """Snapshot `state` after `step` if the interval says so: copy this
        process's shards (blocking) and hand them to the background writer.
        Returns whether one was taken; its file appears when the writer is
        done (`flush()` waits for it). `meta` is encoded as it is now (a
        caller may reuse its dict). Raises TypeError when `meta` cannot be
        encoded as JSON (a caller's error); otherwise never raises for the
        snapshot's sake: a write error or a directory without room for it
        (a small tmpfs) skips it with a warning; a state that is not all
        jax.Arrays turns snapshots off (logged)."""
        if self._disabled or step % self.every_steps or \
                (self._last_saved is not None and step <= self._last_saved):
            return False
        t0 = time.perf_counter()
        meta = json.loads(json.dumps(meta or {}))
        self.flush()  # (one copy of the state waiting at a time; long written by now)
        try:
            copies = host_shards(state, copy=True)
        except TypeError as e:
            log.warning("%s; local snapshots off", e)
            self._disabled = True
            return False
        if self.on_written is not None and self._replicate is None:
            import jax

            self._replicate = replica_adds(state_regions(state), jax.process_index())
        self._last_saved = step
        if self._writer is None:
            self._writer = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="elastic-snapshot")
        self._pending = self._writer.submit(self._write, step, self.clock(), meta, copies)
        blocked = time.perf_counter() - t0
        self.seconds.append(blocked)
        self._blocked_s += blocked
        return True

    def flush(self) -> None:
        """Wait until the snapshot being written, if any, is in place (or was
        given up with a warning)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()  # (_write raises nothing)

    def _write(self, step: int, saved_at: float, meta: dict, leaves: Leaves) -> None:
        """The background writer: one snapshot file, then the older ones
        beyond `keep` removed and `on_written` called. Logs, never raises."""
        path = self._path(step)
        try:
            room = shutil.disk_usage(self.directory).free
            need = sum(d.nbytes for _, _, shards in leaves.values() for _, d in shards)
            if room < need + (1 << 20):
                if not self._warned_room:
                    log.warning("no room for local snapshots in %s (%d MiB free, %d MiB needed "
                                "per step): skipping them", self.directory, room >> 20,
                                need >> 20)
                    self._warned_room = True
                return
            write(path, step, saved_at, self.run_id, meta, leaves)
        except Exception as e:  # noqa: BLE001 - a snapshot never ends training
            log.warning("local snapshot of step %d not written: %s: %s", step, type(e).__name__, e)
            path.with_name(f".{path.name}.tmp").unlink(missing_ok=True)
            return
        try:
            for old in self.steps()[:-self.keep]:
                self._path(old).unlink(missing_ok=True)
        except OSError as e:  # (the new one is in place: still announce it)
            log.warning("older local snapshots not removed: %s", e)
        if self.on_written is not None and self._replicate:
            try:
                self.on_written(step)
            except Exception:  # noqa: BLE001 - a reporting hook must not end the writer
                log.exception("snapshot_written hook failed for step %d", step)

    def drain_blocked_s(self) -> float:
        """Seconds the snapshots taken since the last call blocked the
        training loop (0.0 again afterwards)."""
        blocked, self._blocked_s = self._blocked_s, 0.0
        return blocked

    def replicas(self) -> dict[int, list[pathlib.Path]]:
        """Replica files here (peers' snapshots, `replica_name`) by step."""
        out: dict[int, list[pathlib.Path]] = {}
        if self.directory is None:
            return out
        for path in sorted(self.directory.glob(f"{REPLICA_PREFIX}*{SUFFIX}")):
            parsed = parse_replica_name(path.name)
            if parsed is not None:
                out.setdefault(parsed[1], []).append(path)
        return out

    def _open(self, path: pathlib.Path, step: int, needed: dict,
              files: contextlib.ExitStack) -> Held | None:
        """The file at `path`, open (until `files` closes), with its header
        (`read_open` without data), if it is a whole snapshot of `step`, this
        run and this state; else None (a torn or unreadable file is logged)."""
        try:
            f = files.enter_context(open(path, "rb"))
            head = read_open(f, str(path), data=False)
        except (OSError, SnapshotError) as e:
            log.warning("local snapshot ignored: %s", e)
            return None
        if head.run_id != self.run_id or head.step != step or not same_state(head, needed):
            return None
        return path, f, head

    def restore(self, abstract_state: Any, committed_step: int | None) -> Snapshot | None:
        """Agree with every other process on a step the slice can restore from
        snapshots (collective: every process calls it once per restore), if
        one is at least as new as `committed_step` (see `choose_restore`);
        return this process's snapshot of it, or one assembled from the parts
        the processes hold (their own and replicas: see `plan_assembly` and
        elastic.checkpoint.snapshot_transfer), leaves still host arrays (see
        `to_state`); or None (then restore the persistent checkpoint).
        The vote reads only the files' headers; then only the chosen step's
        files this process restores from or sends parts of are read whole
        (one step's state in memory, not every step's own and replicas).
        Snapshots and replicas of other steps are deleted once the chosen
        step is restored (a line of training that the slice is not
        resuming), all of them when none is chosen; none when the transfer
        fails, so that the next attempt may still use them. Raises what the
        transfer's collective raises, OSError when a chosen file cannot be
        read (it is held open from the vote on: a file replaced or removed
        meanwhile is still the one voted with)."""
        self.flush()  # (a snapshot this process is still writing)
        needed = needed_regions(abstract_state)
        with contextlib.ExitStack() as files:
            own: dict[int, Held] = {}
            held: dict[int, list[Held]] = {}  # own and replicas, by step (headers)
            if self.directory is not None:
                for partial in self.directory.glob(f".step-*{SUFFIX}.tmp"):  # a killed writer's
                    partial.unlink(missing_ok=True)
                for step in self.steps():
                    found = self._open(self._path(step), step, needed, files)
                    if found is not None:
                        held.setdefault(step, []).append(found)
                        if covers(found[2], needed):
                            own[step] = found
                for step, paths in self.replicas().items():
                    for path in paths:
                        found = self._open(path, step, needed, files)
                        if found is not None:
                            held.setdefault(step, []).append(found[:2] + (dataclasses.replace(
                                found[2], replicas_of=(parse_replica_name(path.name)[0],)),))
            vote = {"own": sorted(own), "held": {
                str(step): {name: sorted({r for _, _, head in heads
                                          for r, _ in head.leaves[name][2]})
                            for name in needed} for step, heads in held.items()}}
            shapes = {name: shape for name, (shape, _, _) in needed.items()}
            chosen = choose_restore(self.agree(vote), committed_step, shapes)
            if chosen is None:
                self._remove_other_steps(None)
                return None
            step, plan = chosen
            restored = self._restore_step(plan, held.get(step, []), own.get(step),
                                          abstract_state)
        self._remove_other_steps(step)
        self._last_saved = step
        return restored

    def _restore_step(self, plan: dict[str, list[tuple[Region, int]]] | None,
                      held: list[Held], own: Held | None, abstract_state: Any) -> Snapshot:
        """The chosen step, from `own` when `plan` is None; else assembled
        (snapshot_transfer.assemble) with, read whole, `own` and the files
        of `held` holding the regions `plan` gives this process to send."""
        def whole(found: Held) -> Snapshot:
            path, f, head = found
            return dataclasses.replace(read_open(f, str(path)), replicas_of=head.replicas_of)

        if plan is None:
            return whole(own)
        import jax

        from elastic.checkpoint.snapshot_transfer import assemble

        me = jax.process_index()
        sending = {next((i for i, (_, _, head) in enumerate(held)
                         if any(inside(region, r) for r, _ in head.leaves[name][2])), None)
                   for name, regions in plan.items() for region, process in regions
                   if process == me} - {None}
        loaded = {i: whole(held[i]) for i in sorted(sending)}
        mine = None
        if own is not None:
            mine = next((loaded[i] for i in loaded if held[i] is own), None) or whole(own)
        return assemble(plan, [loaded[i] for i in sorted(loaded)], abstract_state, mine)

    def _remove_other_steps(self, step: int | None) -> None:
        """Delete the snapshots and replicas here of every step but `step`
        (the chosen step's replicas stay until the agent replaces them)."""
        for old in self.steps():
            if old != step:
                self._path(old).unlink(missing_ok=True)
        for old, paths in self.replicas().items():
            if old != step:
                for path in paths:
                    path.unlink(missing_ok=True)


def replica_name(host_id: str, step: int) -> str:
    """The file name of host `host_id`'s snapshot of `step` kept by a peer."""
    return f"{REPLICA_PREFIX}{host_id}-step-{step:010d}{SUFFIX}"


def parse_replica_name(name: str) -> tuple[str, int] | None:
    """(host id, step) of a `replica_name`, None for any other name."""
    if not (name.startswith(REPLICA_PREFIX) and name.endswith(SUFFIX)):
        return None
    host, sep, step = name[len(REPLICA_PREFIX):-len(SUFFIX)].rpartition("-step-")
    if not sep or not host or not step.isdigit():
        return None
    return host, int(step)


def to_state(snapshot: Snapshot, abstract_state: Any) -> Any:
    """The pytree of jax.Arrays that `snapshot` holds, in `abstract_state`'s
    shardings (each device's shard cut from a held shard that contains it).
    Raises ValueError for a region no held shard contains (`covers` was
    false)."""
    import jax

    paths, treedef = jax.tree_util.tree_flatten_with_path(abstract_state)
    arrays = []
    for path, leaf in paths:
        _, _, shards = snapshot.leaves[jax.tree_util.keystr(path)]

        def piece(index, shards=shards, shape=leaf.shape):
            want = region_of(index, shape)
            held, data = next(((r, d) for r, d in shards if inside(want, r)), (None, None))
            if held is None:
                raise ValueError(f"snapshot of step {snapshot.step} holds no shard with "
                                 f"{want} of {jax.tree_util.keystr(path)}")
            return np.asarray(data[tuple(slice(w0 - h0, w1 - h0)
                                         for (w0, w1), (h0, _) in zip(want, held))])

        arrays.append(jax.make_array_from_callback(leaf.shape, leaf.sharding, piece))
    return jax.tree_util.tree_unflatten(treedef, arrays)
