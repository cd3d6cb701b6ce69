"""A restart launched as the generation before it loads its executable
without tracing the program (elastic.worker.launch_memo), and anything that
could change the program traces it again."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import pathlib
import pickle
import shutil
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from elastic.worker import compile_cache, launch_memo
from elastic import worker_env
from elastic.worker.compile_cache import DirectoryTier, compile_launched
from elastic.worker.prestart import READY_LINE
from tests.conftest import REPO, launch_prestarted
from tests.test_checkpoint import run_processes

PER_GENERATION = ("ELASTIC_GENERATION", "ELASTIC_PROCESS_ID")
BASE = dict(name="train_step", trace_key="", argv=["train.py", "--steps", "300"],
            cwd="/work", environ={"ELASTIC_RUN_ID": "r1", "ELASTIC_GENERATION": "3",
                                  "ELASTIC_PROCESS_ID": "0", "XLA_FLAGS": ""},
            files=[("model.py", 10, 1), ("train.py", 20, 2)], versions=["0.10.2", "0.10.2", "cpu"],
            slice_='{"processes": 4}', left_out=PER_GENERATION,
            installed=[("/venv/site-packages/optax-0.2.4.dist-info/RECORD", 900, 5)])


def _key(**changes) -> str:
    return launch_memo.launch_key(**{**BASE, **changes})


@pytest.mark.parametrize("what,changes", [
    ("the program's name", dict(name="init_state")),
    ("its trace key", dict(trace_key="vocab 50257")),
    ("an argument", dict(argv=["train.py", "--steps", "301"])),
    ("the working directory", dict(cwd="/elsewhere")),
    ("a variable not left out", dict(environ={**BASE["environ"], "ELASTIC_RUN_ID": "r2"})),
    # (with left_out = PER_GENERATION only; the real list: the test after the next)
    ("a variable of the job", dict(environ={**BASE["environ"], "XLA_FLAGS": "--xla_foo"})),
    ("a new variable", dict(environ={**BASE["environ"], "LR": "1"})),
    ("a program file's size", dict(files=[("model.py", 11, 1), ("train.py", 20, 2)])),
    ("a program file's time", dict(files=[("model.py", 10, 9), ("train.py", 20, 2)])),
    ("a new program file", dict(files=[*BASE["files"], ("util.py", 1, 1)])),
    ("JAX's version", dict(versions=["0.10.3", "0.10.2", "cpu"])),
    ("an installed library", dict(installed=[
        ("/venv/site-packages/optax-0.2.5.dist-info/RECORD", 900, 5)])),
    ("a library installed again", dict(installed=[
        ("/venv/site-packages/optax-0.2.4.dist-info/RECORD", 900, 6)])),
    ("the slice", dict(slice_='{"processes": 3}')),
    ("the second program of one name", dict(ordinal=1)),
])
def test_whatever_may_change_the_program_changes_the_key(what, changes):
    assert _key(**changes) != _key(), what


def test_the_per_generation_variables_do_not_change_the_key():
    later = {**BASE["environ"], "ELASTIC_GENERATION": "4", "ELASTIC_PROCESS_ID": "2"}
    assert _key(environ=later) == _key()
    assert len(_key()) == 32


def test_the_next_job_or_agent_keys_as_the_one_before_but_for_its_settings():
    """What only names the job, its run, its checkpoints and the agent
    incarnation is left out; the job's settings that reach the program
    are not."""
    left_out = worker_env.NOT_IN_LAUNCH_KEY_ENV
    env = {**BASE["environ"], worker_env.ENV_JOB_ID: "a", worker_env.ENV_CHECKPOINT_DIR: "/a",
           worker_env.ENV_INCARNATION: "i1", worker_env.ENV_MESH: "data=-1,model=2",
           worker_env.ENV_BATCH_MODE: "global"}
    key = _key(environ=env, left_out=left_out)
    next_job = {**env, worker_env.ENV_JOB_ID: "b", worker_env.ENV_RUN_ID: "r9",
                worker_env.ENV_CHECKPOINT_DIR: "gs://b/ckpt", worker_env.ENV_INCARNATION: "i2",
                worker_env.ENV_GENERATION: "1"}
    assert _key(environ=next_job, left_out=left_out) == key
    # an agent started again (by systemd): its own variables
    restarted = {**env, worker_env.ENV_INCARNATION: "i3",
                 worker_env.ENV_PROGRESS_SOCKET: "@elastic-progress-i3",
                 worker_env.ENV_SNAPSHOT_DIR: "/dev/shm/elastic-snapshots-x1",
                 "INVOCATION_ID": "5e1f", "JOURNAL_STREAM": "8:4242"}
    assert _key(environ=restarted, left_out=left_out) == key
    for name, value in ((worker_env.ENV_MESH, "data=-1"), (worker_env.ENV_BATCH_MODE, "host"),
                        ("LEARNING_RATE", "3e-4")):
        assert _key(environ={**next_job, name: value}, left_out=left_out) != key, name


def _module(file: str | None) -> types.ModuleType:
    module = types.ModuleType("m")
    if file is not None:
        module.__file__ = file
    return module


def test_installed_code_is_every_distribution_and_each_loose_package_whole(tmp_path):
    """Installed distributions by their RECORD, whether loaded or not;
    packages from elsewhere (an editable install, PYTHONPATH, the program's
    folder) by all their files, loaded or not; a namespace package by the
    files loaded from it; a module from an archive by the archive; the
    standard library not (Python's version covers it)."""
    site, stdlib, program, src = (tmp_path / d for d in ("site", "stdlib", "program", "src"))
    for d in (site / "optax-0.2.4.dist-info", site / "bare-1.0.dist-info", site / "optax",
              stdlib, program, src / "mylib" / "sub" / "__pycache__", src / "ns" / "big"):
        d.mkdir(parents=True)
    (site / "optax-0.2.4.dist-info" / "RECORD").write_text("optax/__init__.py,,\n")
    (site / "old-1.0.egg-info").write_text("Metadata-Version: 1.0\n")
    (site / "optax" / "__init__.py").write_text("")
    (stdlib / "json.py").write_text("")
    (program / "model.py").write_text("")
    for f in ("mylib/__init__.py", "mylib/sub/__init__.py", "mylib/sub/layers.py",
              "mylib/sub/unloaded.py", "mylib/notes.txt", "mylib/sub/__pycache__/x.pyc",
              "single.py", "elsewhere.py", "ns/used.py", "ns/big/unused.py", "code.zip"):
        (src / f).write_text("x = 1\n")
    modules = {"optax": _module(str(site / "optax" / "__init__.py")),
               "json": _module(str(stdlib / "json.py")),
               "model": _module(str(program / "model.py")),
               "__main__": _module(str(program / "train.py")),
               "builtins": _module(None),
               "mylib.sub.layers": _module(str(src / "mylib" / "sub" / "layers.py")),
               "single": _module(str(src / "single.py")),
               "ns.used": _module(str(src / "ns" / "used.py")),  # a namespace package
               "zipped.mod": _module(str(src / "code.zip" / "zipped" / "mod.py")),
               # put in sys.modules under a dotted name that is not its folder's
               "alias.of.it": _module(str(src / "elsewhere.py"))}

    def code():
        return launch_memo.installed_code(modules, [str(site)], [str(stdlib)])

    found = code()
    assert [pathlib.Path(f[0]).relative_to(tmp_path).as_posix() for f in found] == [
        "program/model.py", "site/bare-1.0.dist-info", "site/old-1.0.egg-info",
        "site/optax-0.2.4.dist-info/RECORD", "src/code.zip", "src/elsewhere.py",
        "src/mylib/__init__.py", "src/mylib/sub/__init__.py", "src/mylib/sub/layers.py",
        "src/mylib/sub/unloaded.py", "src/ns/used.py", "src/single.py"]
    for changed in (src / "mylib" / "sub" / "unloaded.py", program / "model.py",
                    site / "optax-0.2.4.dist-info" / "RECORD", src / "code.zip"):
        changed.write_text(changed.read_text() + "# changed\n")
        assert code() != found, f"{changed} changed"
        found = code()
    (stdlib / "json.py").write_text("changed = True\n")
    (src / "ns" / "big" / "unused.py").write_text("changed = True\n")
    assert code() == found


def test_code_changed_after_the_imports_means_no_memo(tmp_path, monkeypatch):
    """A process whose imported code changed on disk since it imported it
    (a pre-started process, a library installed again meanwhile) neither
    reads nor writes a memo: keyed by the code on disk, the memo would name
    an executable traced with the code in memory."""
    (tmp_path / "memo_probe_lib.py").write_text("VALUE = 1\n")
    monkeypatch.setattr(launch_memo, "_loaded", None)
    monkeypatch.setattr(launch_memo, "_at_first_compile", None)
    spec = importlib.util.spec_from_file_location("memo_probe_lib",
                                                  tmp_path / "memo_probe_lib.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, "memo_probe_lib", module)  # (loaded: installed code)
    launch_memo.remember_loaded_code()
    assert launch_memo.changed_since_loaded() is None
    (tmp_path / "memo_probe_lib.py").write_text("VALUE = 22\n")
    assert launch_memo.changed_since_loaded() == str(tmp_path / "memo_probe_lib.py")
    with pytest.raises(launch_memo.CodeChanged, match="memo_probe_lib.py changed after"):
        launch_memo.current_launch("f", "", None, (), "m", 0)
    calls = []
    compile_launched(lambda: calls.append(1) or jax.jit(lambda x: x + 1).lower(1.0),
                     str(tmp_path / "cache"), "f", None)
    assert calls == [1] and not list((tmp_path / "cache").glob("*.launch"))


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
print("KEY", launch_memo.current_launch("f", "", None,
                                       elastic.worker_env.NOT_IN_LAUNCH_KEY_ENV, "m", 0))
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
    # (the launch waits in the pipe until the preloads are done)
    out, err = launch_prestarted(warm, argv, env, tmp_path)
    assert warm.returncode == 0 and READY_LINE in err, err.decode()[-2000:]
    keys = [line for line in (cold.stdout + out).decode().splitlines() if line.startswith("KEY")]
    assert len(keys) == 2 and keys[0] == keys[1], keys


def test_a_trace_key_that_is_not_a_string_is_named(tmp_path):
    with pytest.raises(TypeError, match="trace_key must be a string .* not dict"):
        compile_launched(lambda: None, str(tmp_path), "f", None, trace_key={"vocab": 1})


def _slice(tmp_path, program: pathlib.Path, cache: pathlib.Path, run_id: str = "run-1",
           *args: str, checkpoints: str = "ckpt") -> list[dict]:
    """compile_worker.py --lazy as a 2-process slice, the same argv every
    time, with tmp_path/site (a sitecustomize.py: code installed outside
    the program) on PYTHONPATH; each process's record (the helper checks
    the result)."""
    path = os.pathsep.join(p for p in (str(tmp_path / "site"), os.environ.get("PYTHONPATH"))
                           if p)
    env = dict(os.environ, PYTHONUNBUFFERED="1", ELASTIC_CACHE_DIR=str(cache),
               ELASTIC_RUN_ID=run_id, PYTHONPATH=path)
    prefix = tmp_path / "out"
    run_processes(2, [str(prefix), "--lazy", *args], env, tmp_path / checkpoints,
                  helper=program, timeout_s=90)
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
    (tmp_path / "site").mkdir()
    installed = tmp_path / "site" / "sitecustomize.py"
    installed.write_text("# code the process runs, installed outside the program\n")
    cache = tmp_path / "cache"
    # each host its own directory, as hosts that share nothing
    first = _slice(tmp_path, program, cache, "run-1", "--own-dir")
    assert [(r["traced"], r["hit"]) for r in first] == [(True, False), (True, False)]
    memos = sorted(cache.glob("h*/f-*.launch"))
    assert [m.parent.name for m in memos] == ["h0", "h1"]
    # the next generation of the same launch: nothing traced, both loaded
    again = _slice(tmp_path, program, cache, "run-1", "--own-dir")
    assert [(r["traced"], r["hit"]) for r in again] == [(False, True), (False, True)]
    # the next job of the same program (another run, other checkpoints): the same
    next_job = _slice(tmp_path, program, cache, "run-2", "--own-dir", checkpoints="ckpt-2")
    assert [(r["traced"], r["hit"]) for r in next_job] == [(False, True), (False, True)]
    # a new host (no memo, no entry) traces and compiles for itself: process
    # 0, which loaded without tracing, told it so, or it would wait for
    # process 0's compile (SHARED_WAIT_S, past this test's timeout)
    for f in memos[1].parent.iterdir():
        f.unlink()
    mixed = _slice(tmp_path, program, cache, "run-1", "--own-dir")
    assert [(r["traced"], r["hit"]) for r in mixed] == [(False, True), (True, False)]
    # changed code installed outside the program, or a changed program file:
    # traced again
    installed.write_text("# the same library, edited\nEDITED = True\n")
    assert [r["traced"] for r in _slice(tmp_path, program, cache, "run-1", "--own-dir")] == \
        [True, True]
    with program.parent.joinpath("helper_notes.py").open("w") as f:
        f.write("# a new module beside the program\n")
    changed = _slice(tmp_path, program, cache, "run-1", "--own-dir")
    assert [r["traced"] for r in changed] == [True, True]
