"""A restart launched as the generation before it loads its executable
without tracing the program (elastic.worker.launch_memo), and anything that
could change the program traces it again."""

from __future__ import annotations

import json
import logging
import os
import pathlib
import pickle
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from elastic.worker import compile_cache, launch_memo
from elastic import worker_env
from elastic.worker.compile_cache import DirectoryTier, compile_launched
from elastic.worker.prestart import READY_LINE
from tests.conftest import REPO
from tests.test_checkpoint import run_processes

PER_GENERATION = ("ELASTIC_GENERATION", "ELASTIC_PROCESS_ID")
BASE = dict(name="train_step", trace_key="", argv=["train.py", "--steps", "300"],
            cwd="/work", environ={"ELASTIC_RUN_ID": "r1", "ELASTIC_GENERATION": "3",
                                  "ELASTIC_PROCESS_ID": "0", "XLA_FLAGS": ""},
            files=[("model.py", 10, 1), ("train.py", 20, 2)], versions=["0.10.2", "0.10.2", "cpu"],
            slice_='{"processes": 4}', per_generation=PER_GENERATION)


def _key(**changes) -> str:
    return launch_memo.launch_key(**{**BASE, **changes})


@pytest.mark.parametrize("what,changes", [
    ("the program's name", dict(name="init_state")),
    ("its trace key", dict(trace_key="vocab 50257")),
    ("an argument", dict(argv=["train.py", "--steps", "301"])),
    ("the working directory", dict(cwd="/elsewhere")),
    ("the controller run", dict(environ={**BASE["environ"], "ELASTIC_RUN_ID": "r2"})),
    ("a variable of the job", dict(environ={**BASE["environ"], "XLA_FLAGS": "--xla_foo"})),
    ("a new variable", dict(environ={**BASE["environ"], "LR": "1"})),
    ("a program file's size", dict(files=[("model.py", 11, 1), ("train.py", 20, 2)])),
    ("a program file's time", dict(files=[("model.py", 10, 9), ("train.py", 20, 2)])),
    ("a new program file", dict(files=[*BASE["files"], ("util.py", 1, 1)])),
    ("JAX's version", dict(versions=["0.10.3", "0.10.2", "cpu"])),
    ("the slice", dict(slice_='{"processes": 3}')),
    ("the second program of one name", dict(ordinal=1)),
])
def test_whatever_may_change_the_program_changes_the_key(what, changes):
    assert _key(**changes) != _key(), what


def test_the_per_generation_variables_do_not_change_the_key():
    later = {**BASE["environ"], "ELASTIC_GENERATION": "4", "ELASTIC_PROCESS_ID": "2"}
    assert _key(environ=later) == _key()
    assert len(_key()) == 32


def test_program_files_are_the_scripts_neighbours(tmp_path):
    (tmp_path / "train.py").write_text("x = 1\n")
    (tmp_path / "model.py").write_text("y = 2\n")
    (tmp_path / "notes.txt").write_text("not a module")
    (tmp_path / "lib").mkdir()  # a package beside the script, and a folder that is not one
    (tmp_path / "lib" / "__init__.py").write_text("")
    (tmp_path / "lib" / "layers.py").write_text("z = 3\n")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "gen.py").write_text("")
    files = launch_memo.program_files(str(tmp_path / "train.py"))
    assert [f[0] for f in files] == ["lib/__init__.py", "lib/layers.py", "model.py", "train.py"]
    assert files[2][1] == len("y = 2\n")
    (tmp_path / "model.py").write_text("y = 23\n")
    assert launch_memo.program_files(str(tmp_path / "train.py")) != files
    assert launch_memo.program_files(str(tmp_path / "absent.py")) == []


def test_a_damaged_memo_means_tracing_not_an_error(tmp_path, caplog):
    tier = DirectoryTier(str(tmp_path))
    assert launch_memo.read(tier, "f", "k" * 32) is None  # none: no warning
    for damaged in (b"not a pickle", pickle.dumps({"entry": "f.xla"}), pickle.dumps([1])):
        tier.write(launch_memo.memo_name("f", "k" * 32), damaged)
        with caplog.at_level(logging.WARNING, "elastic.compile_cache"):
            assert launch_memo.read(tier, "f", "k" * 32) is None
        assert "cannot read f-kkkk" in caplog.text and "tracing the program" in caplog.text
        caplog.clear()


def _program(scale: float, calls: list):
    def lower():
        calls.append(scale)
        return jax.jit(lambda x: jnp.tanh(x) * scale).lower(
            jax.ShapeDtypeStruct((4, 3), jnp.float32))
    return lower


def _new_process():
    """What a new process starts with: no programs compiled yet."""
    compile_cache._programs.clear()


def test_in_one_process_a_memo_skips_the_trace_until_its_entry_is_gone(tmp_path):
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    calls = []
    _new_process()
    first = compile_launched(_program(2.0, calls), str(tmp_path), "f", None)
    assert calls == [2.0] and not first[1] and first[4] > 0  # lowered, compiled
    _new_process()
    again = compile_launched(_program(2.0, calls), str(tmp_path), "f", None)
    assert calls == [2.0] and again[1] and again[4] == 0.0  # loaded, not lowered
    assert again[3] == first[3]  # the same entry, for compiling ahead
    np.testing.assert_allclose(again[0](x), np.tanh(x) * 2.0, rtol=1e-6)
    # a memo whose entry is gone: lowered and compiled again, never an error
    (tmp_path / first[3]).unlink()
    _new_process()
    assert not compile_launched(_program(2.0, calls), str(tmp_path), "f", None)[1]
    assert calls == [2.0, 2.0]
    # a program that gives its lowered program keeps no memo and reads none
    _new_process()
    compile_launched(_program(5.0, calls), str(tmp_path / "plain"), "f", None, memo=False)
    assert not list((tmp_path / "plain").glob("*.launch"))


def test_two_programs_of_one_name_each_load_their_own(tmp_path):
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    calls = []
    for _ in range(2):  # two generations, each compiling both in the same order
        _new_process()
        one = compile_launched(_program(2.0, calls), str(tmp_path), "step", None)[0]
        two = compile_launched(_program(3.0, calls), str(tmp_path), "step", None)[0]
        np.testing.assert_allclose(one(x), np.tanh(x) * 2.0, rtol=1e-6)
        np.testing.assert_allclose(two(x), np.tanh(x) * 3.0, rtol=1e-6)
    assert calls == [2.0, 3.0]  # the second generation lowered neither
    assert len(list(tmp_path.glob("step-*.launch"))) == 2


KEY_PROGRAM = """
import sys
import jax
import elastic.worker_env
from elastic.worker import launch_memo
print("KEY", launch_memo.current_launch("f", "", None, elastic.worker_env.PER_GENERATION_ENV, "m",
                                       0))
"""


@pytest.mark.parametrize("spawned_during", ["this job", "the job before"])
def test_a_pre_started_process_keys_its_launch_as_a_cold_one_does(tmp_path, spawned_during):
    """JAX sets TF_CPP_MIN_LOG_LEVEL when imported: after the launch in a
    pre-started process, before the key in a cold one. The key hashes the
    environment the process started with, the same for both; for a process
    pre-started during the job before (other job-level variables: the agent
    lets it serve the next job), the one its launch gave it."""
    script = tmp_path / "key_program.py"
    script.write_text(KEY_PROGRAM)
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    env.update(ELASTIC_GENERATION="7", ELASTIC_PROCESS_ID="0", ELASTIC_RUN_ID="run-1")
    argv = [sys.executable, str(script)]
    cold = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, timeout=60)
    assert cold.returncode == 0, cold.stderr.decode()[-2000:]
    spawn_env = {k: v for k, v in env.items() if k not in worker_env.PER_GENERATION_ENV}
    if spawned_during == "the job before":
        spawn_env.update(ELASTIC_RUN_ID="run-0", ELASTIC_JOB_ID="job-before",
                         ELASTIC_BATCH_MODE="other")
    warm = subprocess.Popen([sys.executable, "-P", "-m", "elastic.worker.prestart", str(script)],
                            env=spawn_env, cwd=tmp_path, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:  # (the launch waits in the pipe until the preloads are done)
        out, err = warm.communicate(json.dumps({"argv": argv, "env": env,
                                                "cwd": str(tmp_path)}).encode() + b"\n",
                                    timeout=60)
    finally:
        if warm.poll() is None:
            warm.kill()
            warm.wait()
    assert warm.returncode == 0 and READY_LINE in err, err.decode()[-2000:]
    keys = [line for line in (cold.stdout + out).decode().splitlines() if line.startswith("KEY")]
    assert len(keys) == 2 and keys[0] == keys[1], keys


def test_a_trace_key_that_is_not_a_string_is_named(tmp_path):
    with pytest.raises(TypeError, match="trace_key must be a string .* not dict"):
        compile_launched(lambda: None, str(tmp_path), "f", None, trace_key={"vocab": 1})


def _slice(tmp_path, program: pathlib.Path, cache: pathlib.Path, run_id: str = "run-1",
           *args: str) -> list[dict]:
    """compile_worker.py --lazy as a 2-process slice, the same argv every
    time; each process's record (the helper checks the result)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", ELASTIC_CACHE_DIR=str(cache),
               ELASTIC_RUN_ID=run_id)
    prefix = tmp_path / "out"
    run_processes(2, [str(prefix), "--lazy", *args], env, tmp_path / "ckpt", helper=program,
                  timeout_s=90)
    records = []
    for i in range(2):
        out = pathlib.Path(f"{prefix}.{i}.json")
        records.append(json.loads(out.read_text()))
        out.unlink()
        assert abs(records[-1]["result"] - records[-1]["expected"]) < 1e-4, records[-1]
    return records


def test_a_restart_of_the_same_launch_loads_without_tracing(tmp_path):
    program = tmp_path / "program" / "compile_worker.py"
    program.parent.mkdir()
    shutil.copy(REPO / "tests" / "helpers" / "compile_worker.py", program)
    cache = tmp_path / "cache"
    # each host its own directory, as hosts that share nothing
    first = _slice(tmp_path, program, cache, "run-1", "--own-dir")
    assert [(r["traced"], r["hit"]) for r in first] == [(True, False), (True, False)]
    memos = sorted(cache.glob("h*/f-*.launch"))
    assert [m.parent.name for m in memos] == ["h0", "h1"]
    # the next generation of the same launch: nothing traced, both loaded
    again = _slice(tmp_path, program, cache, "run-1", "--own-dir")
    assert [(r["traced"], r["hit"]) for r in again] == [(False, True), (False, True)]
    # a new host (no memo, no entry) traces and compiles for itself: process
    # 0, which loaded without tracing, told it so, or it would wait for
    # process 0's compile (SHARED_WAIT_S, past this test's timeout)
    for f in memos[1].parent.iterdir():
        f.unlink()
    mixed = _slice(tmp_path, program, cache, "run-1", "--own-dir")
    assert [(r["traced"], r["hit"]) for r in mixed] == [(False, True), (True, False)]
    # a changed program file, or another controller run: traced again
    with program.parent.joinpath("helper_notes.py").open("w") as f:
        f.write("# a new module beside the program\n")
    changed = _slice(tmp_path, program, cache, "run-1", "--own-dir")
    assert [r["traced"] for r in changed] == [True, True]
    assert [r["traced"] for r in _slice(tmp_path, program, cache, "run-2", "--own-dir")] == \
        [True, True]
