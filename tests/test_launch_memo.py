"""A restart launched as the generation before it loads its executable
without tracing the program (elastic.worker.launch_memo), and anything that
could change the program traces it again."""

from __future__ import annotations

import json
import logging
import os
import pathlib
import shutil

import pytest

from elastic.worker import launch_memo
from elastic.worker.compile_cache import DirectoryTier
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
    files = launch_memo.program_files(str(tmp_path / "train.py"))
    assert [f[0] for f in files] == ["model.py", "train.py"]
    assert files[0][1] == len("y = 2\n")
    (tmp_path / "model.py").write_text("y = 23\n")
    assert launch_memo.program_files(str(tmp_path / "train.py")) != files
    assert launch_memo.program_files(str(tmp_path / "absent.py")) == []


def test_a_damaged_memo_means_tracing_not_an_error(tmp_path, caplog):
    tier = DirectoryTier(str(tmp_path))
    assert launch_memo.read(tier, "f", "k" * 32) is None  # none: no warning
    for damaged in (b"not a pickle", json.dumps({"entry": "f.xla"}).encode()):
        tier.write(launch_memo.memo_name("f", "k" * 32), damaged)
        with caplog.at_level(logging.WARNING, "elastic.compile_cache"):
            assert launch_memo.read(tier, "f", "k" * 32) is None
        assert "cannot read f-kkkk" in caplog.text and "tracing the program" in caplog.text
        caplog.clear()


def test_a_trace_key_that_is_not_a_string_is_named(tmp_path):
    from elastic.worker.compile_cache import compile_launched

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
