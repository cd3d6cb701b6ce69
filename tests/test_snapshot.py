"""Local snapshot decisions and file format, without JAX processes (the
multi-process restores are in tests/test_checkpoint.py)."""

from __future__ import annotations

import numpy as np
import pytest

from elastic.checkpoint.snapshot import (SnapshotError, Snapshot, choose_step, covers, read,
                                         region_of, write)


@pytest.mark.parametrize("votes, committed, expected", [
    ([[8, 9], [8, 9], [8, 9]], 8, 9),          # everyone at 9
    ([[8, 9], [7, 8], [8, 9]], 5, 8),          # one process a step behind (hang, stop)
    ([[8, 9], [], [8, 9]], 5, None),           # a host without snapshots (new, restarted)
    ([[8, 9], [8, 9]], 9, 9),                  # as new as the checkpoint: memory is faster
    ([[8, 9], [8, 9]], 10, None),              # older than the newest committed step
    ([[3], [3]], None, 3),                     # nothing committed yet
    ([[5, 6], [7, 8]], None, None),            # no step in common
    ([], None, None),
])
def test_choose_step(votes, committed, expected):
    assert choose_step(votes, committed) == expected


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


def test_agents_keep_snapshots_in_memory_when_they_can(tmp_path):
    from elastic.agent.agent import default_snapshot_dir

    shm = tmp_path / "shm"
    shm.mkdir()
    a, b = (default_snapshot_dir(str(tmp_path / h), shm=str(shm)) for h in ("h0", "h1"))
    assert a.startswith(str(shm)) and b.startswith(str(shm)) and a != b
    assert default_snapshot_dir(str(tmp_path / "h0"), shm=str(tmp_path / "none")) == \
        str(tmp_path / "h0" / "snapshots")
