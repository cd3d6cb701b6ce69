"""Checkpoints across topologies, with real multi-process JAX on CPU and real
Orbax: 4 processes on a 4x2 mesh save; 3 (3x2) and 5 (5x2) restore."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys

import pytest

from elastic.checkpoint.snapshot import replica_name
from tests.conftest import REPO

HELPER = REPO / "tests" / "helpers" / "ckpt_worker.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(n: int, args: list[str], env: dict, ckpt_dir, expect_kill: bool = False,
                  timeout_s: float = 120, snapshots=None, run_id: str = "run-1",
                  helper: pathlib.Path = HELPER, own_disks: bool = False) -> list[str]:
    """Run `helper` as an n-process JAX slice (2 CPU devices each); with
    `snapshots` (a directory), process i keeps local snapshots in
    snapshots/h{i} for controller run `run_id`; with `own_disks`, process i
    is given ckpt_dir/p{i} as the job's checkpoint directory (hosts that
    share no disk, each with its own directory under the same path), and
    every process must fail. Returns each process's output (its last 3,000
    characters)."""
    port = free_port()
    procs = []
    for i in range(n):
        if snapshots is not None:
            env = dict(env, ELASTIC_RUN_ID=run_id, ELASTIC_SNAPSHOT_DIR=str(snapshots / f"h{i}"))
        proc_env = dict(env, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", ELASTIC_PROCESS_ID=str(i),
                        ELASTIC_NUM_PROCESSES=str(n), ELASTIC_GENERATION="1",
                        ELASTIC_JOB_ID="test", ELASTIC_HOST_ID=f"h{i}",
                        ELASTIC_MESH="data=-1,model=2",
                        ELASTIC_CHECKPOINT_DIR=str(ckpt_dir / f"p{i}" if own_disks else ckpt_dir),
                        ELASTIC_DEVICES_PER_HOST="2")
        procs.append(subprocess.Popen([sys.executable, str(helper), *args], env=proc_env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout_s)
            outputs.append(out.decode(errors="replace")[-3000:])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    codes = [p.returncode for p in procs]
    if expect_kill:  # each kills itself after its save started; one still inside the
        # save's last barrier when a peer dies may fail there first
        assert -9 in codes and 0 not in codes, (codes, outputs)
    elif own_disks:  # (refused, as the tests of it expect)
        assert 0 not in codes, (codes, outputs)
    else:
        assert codes == [0] * n, "\n".join(outputs)
    return outputs


@pytest.fixture(scope="module")
def saved_by_four(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("ckpt")
    out = ckpt.parent / "save.json"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    run_processes(4, ["save", str(ckpt), "10", str(out)], env, ckpt)
    return ckpt, json.loads(out.read_text())


@pytest.mark.parametrize("processes", [3, 5])
def test_restore_on_other_topology(saved_by_four, tmp_path, proc_env, processes):
    ckpt, saved = saved_by_four
    assert saved["committed"] == [10]
    copy = tmp_path / "ckpt"
    shutil.copytree(ckpt, copy)
    out = tmp_path / "restore.json"
    run_processes(processes, ["restore", str(copy), str(out)], proc_env, copy)
    restored = json.loads(out.read_text())
    assert restored["step"] == 10 and restored["meta"] == {"data_position": 11}
    assert restored["mesh"] == {"data": processes, "model": 2}
    assert restored["checksums"] == saved["checksums"]
    assert restored["specs"] == {"w": "P('data', 'model')", "b": "P('model',)", "r": "P()",
                                 "step": "P()"}


@pytest.mark.parametrize("source", ["checkpoint", "snapshot"])
def test_a_typed_prng_key_and_an_empty_array_come_back_as_they_were(tmp_path, proc_env, source):
    """A state with a typed PRNG key (jax.random.key) and a zero-size array,
    saved by 2 processes and restored by 2 fresh ones, from the committed
    checkpoint or from the local snapshots. Before (an audit of realistic
    training states found it): Orbax refused to save the empty array, so no
    checkpoint was ever committed; it restored the key as raw uint32[2];
    and the snapshots raised on the key at every restore, so a job holding
    one never started."""
    env = dict(proc_env, CKPT_ODD_LEAVES="1")
    ckpt, snaps = tmp_path / "ckpt", tmp_path / "snaps" if source == "snapshot" else None
    run_processes(2, ["save", str(ckpt), "7", str(tmp_path / "saved.json")], env, ckpt,
                  snapshots=snaps)
    saved = json.loads((tmp_path / "saved.json").read_text())
    assert saved["committed"] == [7]
    out = tmp_path / "restored.json"
    run_processes(2, ["restore", str(ckpt), str(out)], env, ckpt, snapshots=snaps)
    restored = json.loads(out.read_text())
    assert restored["step"] == 7 and restored["checksums"] == saved["checksums"]
    assert (restored["types"]["rng"], restored["types"]["pad"]) == ("key<fry>[]", "float32[0, 4]")
    came_from = [e.get("source", "checkpoint") for e in restored["events"]
                 if e["kind"] == "checkpoint_restored"]
    assert came_from == [source], restored["events"]


def test_killed_mid_save_is_ignored(tmp_path, proc_env):
    ckpt = tmp_path / "ckpt"
    run_processes(2, ["save", str(ckpt), "1", str(tmp_path / "a.json")], proc_env, ckpt)
    run_processes(2, ["save", str(ckpt), "2", str(tmp_path / "b.json"), "--kill-after-save"],
                  proc_env, ckpt, expect_kill=True)
    partial = [p.name for p in ckpt.iterdir() if p.name.startswith("2")]
    assert partial and all("tmp" in name for name in partial), partial  # a save was cut short
    out = tmp_path / "restore.json"
    run_processes(2, ["restore", str(ckpt), str(out)], proc_env, ckpt)
    restored = json.loads(out.read_text())
    assert restored["step"] == 1
    assert json.loads((tmp_path / "a.json").read_text())["checksums"] == restored["checksums"]


def test_a_step_some_process_cannot_read_or_list_is_passed_over_by_all(tmp_path, proc_env):
    """Steps 1 and 2 committed. Process 1 alone cannot read step 2 (a
    storage fault on its host): process 0 reads it and must not wait for
    process 1 in a barrier process 1 never reaches (Orbax's
    Checkpointer.restore ends in one, 300 s); both move on to step 1
    together. Process 1 alone does not list step 2 (a stale listing): both
    restore step 1, the newest both list. Step 2 damaged for everyone: the
    same, and a failed restore never deletes a committed step."""
    ckpt = tmp_path / "ckpt"
    run_processes(2, ["save", str(ckpt), "1", str(tmp_path / "a.json")], proc_env, ckpt)
    run_processes(2, ["save", str(ckpt), "2", str(tmp_path / "b.json")], proc_env, ckpt)
    out = tmp_path / "restore.json"

    def restore(*args: str) -> tuple[int, list[str]]:
        run_processes(2, ["restore", str(ckpt), str(out), *args], proc_env, ckpt, timeout_s=90)
        restored = json.loads(out.read_text())
        return restored["step"], [e["kind"] for e in restored["events"]]

    failed_then_restored = ["checkpoint_restore_failed", "checkpoint_restored"]
    assert restore("--unreadable-on", "1:2") == (1, failed_then_restored)
    assert restore("--unlisted-on", "1:2") == (1, ["checkpoint_restored"])
    for path in (ckpt / "2" / "state").rglob("*"):  # its array data is gone
        if path.is_file() and "metadata" not in path.name:
            path.write_bytes(b"garbage")
    assert restore() == (1, failed_then_restored)
    assert (ckpt / "2").exists(), "a committed step is never deleted by a failed restore"


def test_a_checkpoint_directory_the_hosts_do_not_share_is_refused(tmp_path, proc_env):
    """Two hosts with a local directory each under the same path: before,
    step 10 "committed" holding process 0's shards only, and no process
    could restore it (a checkpoint audit); now every process refuses the
    directory before anything is saved, saying why."""
    ckpt = tmp_path / "ckpt"
    outputs = run_processes(2, ["save", str(ckpt), "10", str(tmp_path / "a.json")], proc_env,
                            ckpt, own_disks=True, timeout_s=90)
    for out in outputs:
        assert "is not one directory shared by every process: process(es) 1 cannot read" \
            in out, out
    assert not (tmp_path / "a.json").exists()
    assert not [p for p in ckpt.rglob("*") if p.name == "10" or p.name.startswith("10.")]
    assert not list(ckpt.rglob(".elastic-shared-*"))  # (the probe is removed)
    # process 0 cannot write its directory at all (here a file is in its way):
    # every process says so, rather than the others timing out on it
    (ckpt / "p0").rename(tmp_path / "gone")
    (ckpt / "p0").write_text("not a directory")
    outputs = run_processes(2, ["save", str(ckpt), "10", str(tmp_path / "a.json")], proc_env,
                            ckpt, own_disks=True, timeout_s=90)
    for out in outputs:
        assert "process 0 cannot write there: FileExistsError" in out, out


def test_a_step_one_process_does_not_list_is_skipped_by_all_not_saved_by_one(tmp_path,
                                                                            proc_env):
    """Steps 0, 10 and 20 committed; process 1's listing lacks step 20 (a
    stale listing). Both restore step 10 and train on, saving every 10
    steps: at step 20 process 0 (which lists it) skipped the save while
    process 1 went to agree on it alone, and timed out after 60 s (a
    checkpoint audit). Now both skip step 20, saying who lists it, and
    both save step 30."""
    ckpt = tmp_path / "ckpt"
    run_processes(2, ["train", str(ckpt), "21", "10", str(tmp_path / "a.json"),
                      "--wait-each"], proc_env, ckpt)
    assert json.loads((tmp_path / "a.json").read_text())["committed"] == [0, 10, 20]
    out = tmp_path / "b.json"
    run_processes(2, ["train", str(ckpt), "35", "10", str(out), "--wait-each",
                      "--resume", "--unlisted-on", "1:20"], proc_env, ckpt, timeout_s=90)
    result = json.loads(out.read_text())
    assert result["restored"] == 10, result
    skipped = [e for e in result["events"] if e["kind"] == "checkpoint_save_skipped"]
    assert [e["step"] for e in skipped] == [20], result["events"]
    assert "listed by process(es) 0" in skipped[0]["reason"]
    assert [e["step"] for e in result["events"] if e["kind"] == "checkpoint_saved"] == [30]
    assert result["committed"] == [0, 10, 20, 30]


@pytest.mark.parametrize("outcome", ["removed", "timed out"])
def test_a_removal_of_leftovers_is_running_only_while_its_thread_runs(outcome):
    """Orbax's future raises TimeoutError both while the removal runs and
    when the removal itself timed out (asyncio's and aiohttp's timeouts are
    TimeoutErrors): the second is a failure, journaled once, not a removal
    that runs for ever (every save of the generation would be skipped)."""
    import threading
    import types

    from orbax.checkpoint._src.futures import future

    from elastic.checkpoint.manager import Checkpoints

    go = threading.Event()

    async def removal():
        import asyncio
        await asyncio.to_thread(go.wait, 30)
        if outcome == "timed out":
            raise asyncio.TimeoutError("rmtree of gs://b/ckpt/7.orbax-checkpoint-tmp-3")

    events = []
    fake = types.SimpleNamespace(
        manager=types.SimpleNamespace(_cleanup_tmp_directory_future=future.CommitFuture(
            removal())),
        on_event=lambda kind, reason, fields: events.append(kind))
    removing = fake.manager._cleanup_tmp_directory_future
    assert Checkpoints._removing_leftovers(fake, wait=False) is True
    go.set()
    threading.Thread.join(removing._t, 30)  # its thread ended (Orbax's join would raise)
    assert Checkpoints._removing_leftovers(fake, wait=False) is False
    assert fake.manager._cleanup_tmp_directory_future is None
    assert events == ([] if outcome == "removed" else ["checkpoint_delete_failed"])


def test_leftovers_that_cannot_be_removed_are_journaled_and_saves_go_on(tmp_path, proc_env):
    """A save cut short left a temporary directory; removing it fails (a
    storage error). Orbax raised that error from process 0's first save,
    after process 1 had agreed to save: the slice crashed. It is journaled
    instead, and the saves go on."""
    ckpt = tmp_path / "ckpt"
    leftover = ckpt / "3.orbax-checkpoint-tmp-1700000000000000"
    (leftover / "state").mkdir(parents=True)
    out = tmp_path / "train.json"
    run_processes(2, ["train", str(ckpt), "6", "2", str(out), "--wait-each",
                      "--leftovers-stay"], proc_env, ckpt, timeout_s=90)
    result = json.loads(out.read_text())
    assert result["committed"] == [0, 2, 4], result
    failed = [e for e in result["events"] if e["kind"] == "checkpoint_delete_failed"]
    assert len(failed) == 1 and leftover.exists(), result["events"]


# --- local snapshots -------------------------------------------------------------


@pytest.fixture(scope="module")
def trained_by_three(tmp_path_factory):
    """3 processes ran steps 0..9, committing every 4th step (0, 4, 8) and
    snapshotting every step (the last three, 7, 8 and 9, kept)."""
    root = tmp_path_factory.mktemp("snap")
    ckpt, snaps = root / "ckpt", root / "snapshots"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    run_processes(3, ["train", str(ckpt), "10", "4", str(root / "train.json")], env, ckpt,
                  snapshots=snaps)
    return ckpt, snaps, json.loads((root / "train.json").read_text())


def restore_with(tmp_path, proc_env, trained, processes=3, run_id="run-1", prepare=None):
    ckpt, snaps, _ = trained
    copy, snap_copy = tmp_path / "ckpt", tmp_path / "snapshots"
    shutil.copytree(ckpt, copy)
    shutil.copytree(snaps, snap_copy)
    if prepare:
        prepare(snap_copy)
    out = tmp_path / "restore.json"
    run_processes(processes, ["restore", str(copy), str(out)], proc_env, copy,
                  snapshots=snap_copy, run_id=run_id)
    return json.loads(out.read_text()), snap_copy


def test_the_same_slice_resumes_from_its_local_snapshots(trained_by_three, tmp_path, proc_env):
    _, snaps, trained = trained_by_three
    assert trained["committed"] == [0, 4, 8]
    assert sorted(p.name for p in (snaps / "h0").iterdir()) == \
        ["step-0000000007.snap", "step-0000000008.snap", "step-0000000009.snap"]
    restored, left = restore_with(tmp_path, proc_env, trained_by_three)
    assert restored["step"] == 9 and restored["meta"] == {"data_position": 10}
    assert restored["checksums"] == trained["checksums"]  # the state after step 9, bit for bit
    [event] = restored["events"]
    assert event["kind"] == "checkpoint_restored" and event["source"] == "snapshot"
    assert event["step"] == 9 and event["saved_at"] > 0
    # the other snapshots (steps 7, 8) are gone: not the line training resumes
    assert sorted(p.name for p in (left / "h2").iterdir()) == ["step-0000000009.snap"]


def test_a_host_without_the_step_sends_every_process_to_the_checkpoint(trained_by_three,
                                                                       tmp_path, proc_env):
    def lose_host_2(snaps):  # host 2 is a new machine: no snapshots
        shutil.rmtree(snaps / "h2")

    restored, _ = restore_with(tmp_path, proc_env, trained_by_three, prepare=lose_host_2)
    assert restored["step"] == 8  # the newest committed checkpoint
    assert [e.get("source") for e in restored["events"]] == [None]


def test_hosts_without_the_step_get_it_from_a_peer_holding_the_whole_state(tmp_path, proc_env):
    """Data parallelism across hosts: every host holds the whole state, so a
    host without the step (h1: restarted, its snapshots gone; h2: new)
    receives it from process 0 through a collective of the new slice
    instead of sending every process back to the checkpoint."""
    env = dict(proc_env, CKPT_REPLICATED="1")
    root = tmp_path / "train"
    ckpt, snaps = root / "ckpt", root / "snapshots"
    run_processes(2, ["train", str(ckpt), "10", "4", str(root / "train.json")], env, ckpt,
                  snapshots=snaps)
    trained = json.loads((root / "train.json").read_text())
    shutil.rmtree(snaps / "h1")
    out = tmp_path / "restore.json"
    run_processes(3, ["restore", str(ckpt), str(out)], env, ckpt, snapshots=snaps)
    restored = json.loads(out.read_text())
    assert restored["step"] == 9 and restored["meta"] == {"data_position": 10}
    assert restored["checksums"] == trained["checksums"]  # bit for bit, on all 3 hosts
    [event] = restored["events"]
    assert event["source"] == "snapshot" and event["sent_by"] == [0], event
    assert "replicas_of" not in event
    assert restored["mesh"] == {"data": 3, "model": 2}


def keep_replica(snaps, lost: str, buddy: str) -> None:
    """What a buddy's agent holds (elastic.agent.replicas): `lost`'s snapshot
    files in `buddy`'s directory under replica names; then `lost` is gone."""
    for path in (snaps / lost).glob("step-*.snap"):
        step = int(path.name[5:-5])
        shutil.copy(path, snaps / buddy / replica_name(lost, step))
    shutil.rmtree(snaps / lost)


def test_a_lost_hosts_shards_come_from_its_buddys_replica(trained_by_three, tmp_path, proc_env):
    """'w' is split over hosts: host 2 is lost (its replacement has nothing)
    but host 1 kept a replica of its snapshots, so the slice resumes from
    step 9, bit for bit, instead of the committed step 8."""
    _, _, trained = trained_by_three
    restored, left = restore_with(tmp_path, proc_env, trained_by_three,
                                  prepare=lambda snaps: keep_replica(snaps, "h2", "h1"))
    assert restored["step"] == 9 and restored["meta"] == {"data_position": 10}
    assert restored["checksums"] == trained["checksums"]
    [event] = restored["events"]
    assert event["source"] == "snapshot" and event["replicas_of"] == "h2", event
    assert 1 in event["sent_by"], event
    # the replica of the step restored stays (a failed restore can retry); step 8's went
    assert sorted(p.name for p in (left / "h1").iterdir()) == \
        ["replica-h2-step-0000000009.snap", "step-0000000009.snap"]


def test_a_smaller_mesh_is_made_up_from_snapshots_and_replicas(trained_by_three, tmp_path,
                                                               proc_env):
    """The slice shrinks to 2 hosts on a 2x2 mesh: each needs rows that only
    the lost host 2 held, and host 0 holds them as a replica."""
    _, _, trained = trained_by_three
    restored, _ = restore_with(tmp_path, proc_env, trained_by_three, processes=2,
                               prepare=lambda snaps: keep_replica(snaps, "h2", "h0"))
    assert restored["step"] == 9 and restored["mesh"] == {"data": 2, "model": 2}
    assert restored["checksums"] == trained["checksums"]
    assert restored["events"][0]["replicas_of"] == "h2"


def test_a_replica_of_another_run_is_never_used(trained_by_three, tmp_path, proc_env):
    def foreign(snaps):
        keep_replica(snaps, "h2", "h1")
        for path in (snaps / "h1").glob("replica-*"):
            path.write_bytes(path.read_bytes().replace(b'"run-1"', b'"run-0"'))

    restored, _ = restore_with(tmp_path, proc_env, trained_by_three, prepare=foreign)
    assert restored["step"] == 8 and restored["events"][0].get("source") is None


def test_a_torn_snapshot_is_never_restored(trained_by_three, tmp_path, proc_env):
    def tear(snaps):  # host 1's step 9 cut short: only 8 is whole everywhere
        path = snaps / "h1" / "step-0000000009.snap"
        path.write_bytes(path.read_bytes()[:-100])

    restored, _ = restore_with(tmp_path, proc_env, trained_by_three, prepare=tear)
    assert restored["step"] == 8
    assert restored["events"][0]["source"] == "snapshot"  # 8: in every snapshot dir, and committed


def test_snapshots_of_another_run_are_ignored(trained_by_three, tmp_path, proc_env):
    restored, _ = restore_with(tmp_path, proc_env, trained_by_three, run_id="run-2")
    assert restored["step"] == 8 and restored["events"][0].get("source") is None


def test_a_smaller_mesh_uses_snapshots_only_if_each_host_holds_its_shards(trained_by_three,
                                                                          tmp_path, proc_env):
    # 'w' is split over 'data': on a 2x2 mesh a process needs rows that
    # another host held, so the slice restores the committed checkpoint
    restored, _ = restore_with(tmp_path, proc_env, trained_by_three, processes=2)
    assert restored["step"] == 8 and restored["events"][0].get("source") is None
    assert restored["mesh"] == {"data": 2, "model": 2}
