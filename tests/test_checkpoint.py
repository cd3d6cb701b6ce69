"""Checkpoints across topologies, with real multi-process JAX on CPU and real
Orbax: 4 processes on a 4x2 mesh save; 3 (3x2) and 5 (5x2) restore."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

from tests.conftest import REPO

HELPER = REPO / "tests" / "helpers" / "ckpt_worker.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(n: int, args: list[str], env: dict, ckpt_dir, expect_kill: bool = False,
                  timeout_s: float = 120) -> None:
    """Run the helper as an n-process JAX slice (2 CPU devices each)."""
    port = free_port()
    procs = []
    for i in range(n):
        proc_env = dict(env, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", ELASTIC_PROCESS_ID=str(i),
                        ELASTIC_NUM_PROCESSES=str(n), ELASTIC_GENERATION="1",
                        ELASTIC_JOB_ID="test", ELASTIC_HOST_ID=f"h{i}",
                        ELASTIC_MESH="data=-1,model=2", ELASTIC_CHECKPOINT_DIR=str(ckpt_dir),
                        ELASTIC_DEVICES_PER_HOST="2")
        procs.append(subprocess.Popen([sys.executable, str(HELPER), *args], env=proc_env,
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
    if expect_kill:
        assert all(c == -9 for c in codes), (codes, outputs)
    else:
        assert codes == [0] * n, "\n".join(outputs)


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


def test_unreadable_latest_falls_back_and_is_reported(tmp_path, proc_env):
    ckpt = tmp_path / "ckpt"
    run_processes(2, ["save", str(ckpt), "1", str(tmp_path / "a.json")], proc_env, ckpt)
    run_processes(2, ["save", str(ckpt), "2", str(tmp_path / "b.json")], proc_env, ckpt)
    # damage the committed step 2: its array data is gone
    for path in (ckpt / "2" / "state").rglob("*"):
        if path.is_file() and "metadata" not in path.name:
            path.write_bytes(b"garbage")
    out = tmp_path / "restore.json"
    run_processes(2, ["restore", str(ckpt), str(out)], proc_env, ckpt)
    restored = json.loads(out.read_text())
    assert restored["step"] == 1
    kinds = [e["kind"] for e in restored["events"]]
    assert kinds == ["checkpoint_restore_failed", "checkpoint_restored"], restored["events"]
    assert (ckpt / "2").exists(), "a committed step is never deleted by a failed restore"
