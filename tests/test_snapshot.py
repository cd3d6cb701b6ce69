"""Local snapshot decisions and file format, without JAX processes (the
multi-process restores are in tests/test_checkpoint.py)."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest

from elastic.checkpoint.snapshot import (SnapshotError, Snapshot, choose_restore, covers,
                                         parse_replica_name, plan_assembly, read, region_of,
                                         replica_adds, replica_name, write)


FULL = ((0, 4), (0, 4))
TOP, BOTTOM = ((0, 2), (0, 4)), ((2, 4), (0, 4))
SHAPES = {"['w']": (4, 4)}


def vote(own, held=None):
    """A process's vote: steps it restores itself, and {step: regions of 'w'}
    it holds (default: the whole array at every `own` step)."""
    held = {step: [FULL] for step in own} if held is None else held
    return {"own": list(own), "held": {str(k): {"['w']": v} for k, v in held.items()}}


@pytest.mark.parametrize("votes, committed, expected", [
    ([vote([8, 9])] * 3, 8, (9, None)),                        # everyone at 9
    ([vote([8, 9], {}), vote([7, 8], {}), vote([8, 9], {})], 5, (8, None)),  # one a step behind
    ([vote([8, 9]), vote([7, 8]), vote([8, 9])], 5, (9, {"['w']": [(FULL, 0)]})),  # ... sent 9
    ([vote([8, 9], {}), vote([]), vote([8, 9], {})], 5, None),  # a host without the step, and
    ([vote([8, 9]), vote([]), vote([8, 9])], 5, (9, {"['w']": [(FULL, 0)]})),  # ... the whole
    ([vote([8, 9], {}), vote([]), vote([8, 9], {9: [FULL]})], 5,  # the lowest whole holder sends
     (9, {"['w']": [(FULL, 2)]})),
    ([vote([9]), vote([7])], None, (9, {"['w']": [(FULL, 0)]})),  # the newest step wins
    ([vote([8, 9]), vote([8, 9])], 9, (9, None)),               # as new as the checkpoint
    ([vote([8, 9]), vote([])], 10, None),                       # older than the newest committed
    ([vote([3]), vote([3])], None, (3, None)),                  # nothing committed yet
    ([vote([5, 6], {}), vote([7, 8], {})], None, None),         # no step in common
    # state sharded across hosts: host 1 lost, its rows in host 0's replica
    ([vote([], {9: [TOP, BOTTOM]}), vote([])], 5, (9, {"['w']": [(TOP, 0), (BOTTOM, 0)]})),
    # ... in host 2's, the rows each from the lowest holder
    ([vote([], {9: [TOP]}), vote([]), vote([], {9: [TOP, BOTTOM]})], 5,
     (9, {"['w']": [(TOP, 0), (BOTTOM, 2)]})),
    ([vote([], {9: [TOP]}), vote([])], 5, None),                # ... nobody kept the bottom rows
    ([], None, None),
])
def test_choose_restore(votes, committed, expected):
    assert choose_restore(votes, committed, SHAPES) == expected


@pytest.mark.parametrize("held, expected", [
    ([[FULL]], {"['w']": [(FULL, 0)]}),                          # one shard: the whole array
    ([[TOP], [BOTTOM]], {"['w']": [(TOP, 0), (BOTTOM, 1)]}),     # tiles that make it up
    ([[TOP], None, [TOP, FULL]], {"['w']": [(FULL, 2)]}),        # a whole one beats tiles
    ([[TOP], [((3, 4), (0, 4))]], None),                         # row 2 held by nobody
    ([[TOP], [((1, 4), (0, 4))]], None),                         # two shardings overlap
    ([[TOP, ((2, 5), (0, 4))]], None),                           # beyond the array
    ([[TOP, BOTTOM]], {"['w']": [(TOP, 0), (BOTTOM, 0)]}),
])
def test_plan_assembly_takes_each_region_once_or_refuses_gaps(held, expected):
    held = [None if h is None else {"['w']": h} for h in held]
    assert plan_assembly(held, SHAPES) == expected
    assert plan_assembly(held, {**SHAPES, "['b']": (3,)}) is None  # a leaf nobody holds


def test_replica_names_round_trip_and_refuse_others():
    assert parse_replica_name(replica_name("host-2.a", 40)) == ("host-2.a", 40)
    assert replica_name("h1", 7) == "replica-h1-step-0000000007.snap"
    for other in ("step-0000000007.snap", "replica--step-1.snap", "replica-h1-step-x.snap",
                  ".replica-h1-step-0000000007.snap.tmp"):
        assert parse_replica_name(other) is None, other


def test_region_of_fills_open_slices():
    assert region_of((slice(None), slice(4, 8)), (10, 8)) == ((0, 10), (4, 8))
    assert region_of((), ()) == ()


def needed(regions, shape=(4, 4), dtype="float32"):
    return {"['w']": (shape, dtype, regions)}


def snapshot(shards, shape=(4, 4), dtype="float32"):
    return Snapshot(1, 0.0, "run", {}, {"['w']": (shape, dtype, shards)})


@pytest.mark.parametrize("held, wanted, expected", [
    ([((0, 4), (0, 4))], [((0, 2), (0, 4)), ((2, 4), (0, 4))], True),   # full copy: any cut
    ([((0, 2), (0, 4))], [((0, 2), (0, 4))], True),                    # the same shard
    ([((0, 2), (0, 4))], [((0, 3), (0, 4))], False),                   # rows held elsewhere
    ([((0, 2), (0, 4)), ((2, 4), (0, 4))], [((1, 3), (0, 4))], False),  # spans two shards
])
def test_covers(held, wanted, expected):
    snap = snapshot([(r, np.zeros([b - a for a, b in r], np.float32)) for r in held])
    assert covers(snap, needed(wanted)) is expected


def test_covers_refuses_another_shape_or_tree():
    snap = snapshot([(((0, 4), (0, 4)), np.zeros((4, 4), np.float32))])
    assert not covers(snap, needed([((0, 4), (0, 4))], shape=(4, 5)))
    assert not covers(snap, needed([((0, 4), (0, 4))], dtype="int32"))
    assert not covers(snap, {"['v']": ((4, 4), "float32", [((0, 4), (0, 4))])})


def test_write_read_round_trip_and_torn_files(tmp_path):
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    leaves = {"['w']": ((6, 4), "float32", [(((0, 3), (0, 4)), w)]),
              "['step']": ((), "int32", [((), np.array(7, np.int32))])}
    path = tmp_path / "step-0000000007.snap"
    size = write(path, 7, 123.5, "run", {"data_position": 8}, leaves)
    assert path.stat().st_size == size and not list(tmp_path.glob(".*tmp"))
    assert path.stat().st_mode & 0o777 == 0o600  # the model's state: its owner's only
    snap = read(path)
    assert (snap.step, snap.saved_at, snap.run_id, snap.meta) == (7, 123.5, "run",
                                                                   {"data_position": 8})
    [(region, data)] = snap.leaves["['w']"][2]
    assert region == ((0, 3), (0, 4)) and np.array_equal(data, w)
    assert snap.leaves["['step']"][2][0][1].shape == ()
    raw = path.read_bytes()
    for torn in (raw[:-1], raw[:20], b"", b"x" * 100):
        path.write_bytes(torn)
        with pytest.raises(SnapshotError):
            read(path)


def test_agents_keep_snapshots_in_memory_under_names_nobody_can_take_first(tmp_path):
    from elastic.agent import snapshot_dir

    shm = tmp_path / "shm"
    shm.mkdir()
    a, b = (snapshot_dir.make(tmp_path / h, shm=str(shm)) for h in ("h0", "h1"))
    assert a.parent == shm and b.parent == shm and a != b
    assert stat.S_IMODE(os.stat(a).st_mode) == 0o700
    (a / "step-1.snap").write_text("x")
    again = snapshot_dir.make(tmp_path / "h0", shm=str(shm))  # a restarted agent
    assert not a.exists() and again != a and again.parent == shm
    snapshot_dir.empty(again)  # a new controller run: same directory, nothing in it
    assert again.is_dir() and not any(again.iterdir())
    assert snapshot_dir.make(tmp_path / "h2", shm=str(tmp_path / "none")) == \
        tmp_path / "h2" / "snapshots"
    snapshot_dir.remove_recorded(tmp_path / "h0")
    assert not again.exists() and not (tmp_path / "h0" / snapshot_dir.RECORD).exists()


def test_snapshots_outlive_donated_buffers_and_keep_the_last_two(tmp_path):
    """Single-process JAX: the training loop hands the state to a step that
    donates its buffers right after the snapshot; the file must hold the
    values of the step it snapshot, not whatever reuses the memory."""
    import jax
    import jax.numpy as jnp

    from elastic.checkpoint.snapshot import LocalSnapshots, to_state

    snaps = LocalSnapshots(str(tmp_path), "run-1", every_steps=2, agree=lambda own: [own])
    step_fn = jax.jit(lambda s: {"w": s["w"] + 1.0, "n": s["n"] + 1}, donate_argnums=0)
    state = {"w": jnp.zeros((256, 64), jnp.float32), "n": jnp.zeros((), jnp.int32)}
    for step in range(7):
        state = step_fn(state)  # after step k, w == n == k + 1
        assert snaps.save(step, state, {"data_position": step + 1}) is (step % 2 == 0)
    assert not snaps.save(6, state)  # the same step twice: once
    snaps.flush()  # (files are written in the background, from copies taken in save)
    assert snaps.steps() == [2, 4, 6]  # keep=3
    assert len(snaps.seconds) == 4 and snaps.drain_blocked_s() >= sum(snaps.seconds) > 0
    assert snaps.drain_blocked_s() == 0.0
    (tmp_path / ".step-0000000008.snap.tmp").write_bytes(b"a killed writer's")
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                            state)
    snap = snaps.restore(abstract, committed_step=None)
    assert snap.step == 6 and snap.meta == {"data_position": 7}
    restored = to_state(snap, abstract)
    np.testing.assert_array_equal(restored["w"], np.full((256, 64), 7.0, np.float32))
    assert int(restored["n"]) == 7
    assert not list(tmp_path.glob(".*tmp"))
    assert snaps.steps() == [6]  # snapshots of other steps go at a restore


@pytest.mark.parametrize("regions, expected", [
    ({0: {"w": {FULL}}, 1: {"w": {FULL}}}, False),              # data parallel: both whole
    ({0: {"w": {TOP, BOTTOM}}, 1: {"w": {FULL}}}, False),        # tiles of what 1 holds whole
    ({0: {"w": {TOP}}, 1: {"w": {FULL}}, 2: {"w": {FULL}}}, False),  # everyone holds 0's rows
    ({0: {"w": {TOP}}, 1: {"w": {BOTTOM}}}, True),               # sharded across the two
    ({0: {"w": {FULL}}, 1: {"w": {TOP}}}, True),                 # 1 lacks the bottom rows
    ({0: {"w": {FULL}, "b": {((0, 3),)}}, 1: {"w": {FULL}}}, True),  # a leaf only 0 holds
    ({0: {"w": {FULL}}}, True),                                  # a slice of one
    # 2 holds 0's rows too, but the next slice may be 0's buddy and 1 alone
    ({0: {"w": {TOP}}, 1: {"w": {BOTTOM}}, 2: {"w": {TOP}}}, True),
    # mesh data=2 x model=4 on 4 hosts: 0 and 2 hold blocks 0-1, 1 and 3 blocks 2-3
    ({0: {"w": {TOP}}, 1: {"w": {BOTTOM}}, 2: {"w": {TOP}}, 3: {"w": {BOTTOM}}}, True),
])
def test_replica_adds_unless_every_other_process_holds_all_this_one_holds(regions, expected):
    """It used to ask only when this process held a region no other one
    held: a state sharded across hosts and replicated across others
    (the last two rows) sent no replica, though the slice the controller
    restarts, keeping a lost host's buddy, may lack the other holders
    (tests/test_replicas.py: the slice the planner keeps)."""
    assert replica_adds(regions, 0) is expected


def test_a_snapshot_written_after_the_next_steps_holds_its_own_step(tmp_path, monkeypatch):
    """The file is written in the background, after later steps have
    donated (and overwritten) the buffers the snapshot was taken from: it
    must hold the snapshot step's values, from the copy `save` took."""
    import threading

    import jax
    import jax.numpy as jnp

    from elastic.checkpoint import snapshot

    release = threading.Event()
    real_write = snapshot.write
    written_from: list[int] = []

    def late_write(path, step, saved_at, run_id, meta, leaves):
        assert release.wait(60)
        written_from.extend(data.__array_interface__["data"][0]
                            for _, _, shards in leaves.values() for _, data in shards)
        return real_write(path, step, saved_at, run_id, meta, leaves)

    monkeypatch.setattr(snapshot, "write", late_write)
    snaps = snapshot.LocalSnapshots(str(tmp_path), "run-1", every_steps=1,
                                    agree=lambda own: [own])
    step_fn = jax.jit(lambda s: {"w": s["w"] + 1.0}, donate_argnums=0)
    state = step_fn({"w": jnp.zeros((256, 64), jnp.float32)})  # after step 0: w == 1
    device_buffer = state["w"].addressable_shards[0].data.unsafe_buffer_pointer()
    meta = {"data_position": 1}
    try:
        assert snaps.save(0, state, meta)
        meta["data_position"] = 4  # a caller reusing its dict: the snapshot keeps 1
        for _ in range(3):
            state = step_fn(state)  # may reuse the buffers snapshot 0 was taken from
        jax.block_until_ready(state)
        assert snaps.steps() == []  # still being written
    finally:
        release.set()
    snaps.flush()
    assert written_from and device_buffer not in written_from  # a copy, not a view
    assert snaps.steps() == [0]
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                            state)
    snap = snaps.restore(abstract, committed_step=None)
    assert snap.step == 0 and snap.meta == {"data_position": 1}
    np.testing.assert_array_equal(snapshot.to_state(snap, abstract)["w"],
                                  np.full((256, 64), 1.0, np.float32))


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "int4", "float32", "int32",
                                   "bool"])
def test_a_snapshot_of_every_dtype_jax_trains_in_comes_back_bit_for_bit(tmp_path, caplog, dtype):
    """Single-process JAX. The file writer handed each shard to Python's
    buffer protocol, which refuses ml_dtypes' types ("cannot include dtype
    'E' in a buffer"): every snapshot of a bfloat16, float8 or int4 state
    was given up with a warning, and every restart went back to the
    committed checkpoint."""
    import jax
    import jax.numpy as jnp

    from elastic.checkpoint.snapshot import LocalSnapshots, to_state

    values = jnp.arange(-8, 8, dtype=jnp.int32).reshape(4, 4)
    state = {"w": values.astype(dtype), "scalar": values[1, 1].astype(dtype),
             "none": jnp.zeros((0, 3), dtype)}
    snaps = LocalSnapshots(str(tmp_path), "run-1", every_steps=1, agree=lambda own: [own])
    with caplog.at_level("WARNING", "elastic.checkpoint"):
        assert snaps.save(3, state, {"data_position": 4})
        snaps.flush()
    assert snaps.steps() == [3], caplog.text
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                            state)
    snap = snaps.restore(abstract, committed_step=None)
    assert snap is not None and snap.step == 3 and snap.meta == {"data_position": 4}
    restored = to_state(snap, abstract)
    for name, value in state.items():
        assert restored[name].dtype == value.dtype and restored[name].shape == value.shape
        assert np.asarray(restored[name]).tobytes() == np.asarray(value).tobytes(), name


SHAPE = (512, 1024)  # float32: 2 MiB, a half 1 MiB
WHOLE, UPPER, LOWER = ((0, 512), (0, 1024)), ((0, 256), (0, 1024)), ((256, 512), (0, 1024))


def lay_out_steps(directory) -> dict[str, int]:
    """Own snapshots of steps 7 and 8 (whole) and 9 (the upper rows only),
    and replicas of host hX's snapshots 7, 8 and 9 (the lower rows), as
    when hX held the lower rows of a state sharded across hosts and this
    host took over its part; the state of step s is arange * s. Returns
    every file's size by name."""
    def values(step, region):
        full = np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE) * step
        return full[tuple(slice(a, b) for a, b in region)]

    def put(name, step, region):
        leaves = {"['w']": (SHAPE, "float32", [(region, values(step, region))])}
        write(directory / name, step, 100.0 + step, "run-1", {"data_position": step + 1}, leaves)

    for step in (7, 8, 9):
        put(f"step-{step:010d}.snap", step, WHOLE if step < 9 else UPPER)
        put(replica_name("hX", step), step, LOWER)
    return {p.name: p.stat().st_size for p in directory.iterdir()}


def abstract_w():
    import jax
    import jax.numpy as jnp

    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return {"w": jax.ShapeDtypeStruct(SHAPE, jnp.float32, sharding=one)}


def bytes_read() -> int:
    """Bytes this process has read through read(2) and its kin (Linux)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def test_a_restore_votes_from_headers_and_reads_only_the_files_of_the_step_it_takes(tmp_path):
    """Single-process JAX; step 9 is made up from the own upper rows and
    hX's replica of the lower rows (snapshot_transfer.assemble). restore()
    read every own snapshot and every replica whole to vote, and held them
    all until it returned: with 3 own steps and 3 per sender up to ~7x the
    state in memory (a 64 MiB state: peak RSS 202 -> 650 MiB). Now it reads
    the headers, then the chosen step's files: measured here in bytes read
    (steps 7 and 8 are 6 MiB of files, step 9's 2 MiB)."""
    from elastic.checkpoint.snapshot import LocalSnapshots, to_state

    sizes = lay_out_steps(tmp_path)
    chosen = sizes["step-0000000009.snap"] + sizes[replica_name("hX", 9)]
    snaps = LocalSnapshots(str(tmp_path), "run-1", every_steps=1, agree=lambda own: [own])
    abstract = abstract_w()
    before = bytes_read()
    snap = snaps.restore(abstract, committed_step=None)
    read_bytes = bytes_read() - before
    assert snap.step == 9 and snap.replicas_of == ("hX",) and snap.meta == {"data_position": 10}
    np.testing.assert_array_equal(
        to_state(snap, abstract)["w"],
        np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE) * 9)
    assert chosen <= read_bytes < chosen + (1 << 20), (read_bytes, sizes)
    assert sorted(p.name for p in tmp_path.iterdir()) == [replica_name("hX", 9),
                                                         "step-0000000009.snap"]


def test_snapshots_of_other_steps_stay_until_the_chosen_step_is_restored(tmp_path, monkeypatch):
    """restore() deleted the snapshots and replicas of every other step as
    soon as the processes agreed on one, before the transfer that makes it
    up ran: when the transfer failed (a peer died in the collective), the
    older complete steps were gone too, and the next attempt went back to
    the committed checkpoint."""
    from elastic.checkpoint import snapshot_transfer
    from elastic.checkpoint.snapshot import LocalSnapshots

    sizes = lay_out_steps(tmp_path)
    snaps = LocalSnapshots(str(tmp_path), "run-1", every_steps=1, agree=lambda own: [own])

    def peer_gone(*args, **kwargs):
        raise RuntimeError("a process of the collective is gone")

    monkeypatch.setattr(snapshot_transfer, "assemble", peer_gone)
    with pytest.raises(RuntimeError, match="is gone"):
        snaps.restore(abstract_w(), committed_step=None)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(sizes)
    monkeypatch.undo()  # the next attempt: step 9 again, and then the others go
    assert snaps.restore(abstract_w(), committed_step=None).step == 9
    assert snaps.steps() == [9]
