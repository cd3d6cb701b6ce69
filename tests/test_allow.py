"""An agent's allow-list of worker programs (elastic.security.allow), by table."""

from __future__ import annotations

import dataclasses

import pytest

from elastic.security.allow import AllowList, check_launch, matches

PATH = {"python": "/opt/venv/bin/python", "python3": "/usr/bin/python3", "id": "/usr/bin/id",
        "trainer": "/opt/bin/trainer"}
ALLOW = AllowList.parse(["/opt/venv/bin/python /srv/jobs/*/train.py",
                         "/opt/venv/bin/python -m jobs.lm",
                         "/opt/bin/trainer"],
                        workdirs=["/srv/jobs/*"], env=["PYTHONPATH", "WANDB_*"])


@pytest.mark.parametrize("argv, env, workdir, refused", [
    (["python", "train.py", "--steps", "10"], {}, "/srv/jobs/lm", None),
    (["/opt/venv/bin/python", "/srv/jobs/lm/train.py"], {}, "/", None),
    (["python", "../lm/train.py"], {}, "/srv/jobs/other", None),
    (["trainer", "--anything"], {"WANDB_PROJECT": "x"}, "/tmp", None),  # allowed by pattern
    (["trainer"], {"ELASTIC_JOB_ID": "j", "ELASTIC_RUN_ID": "r", "ELASTIC_MESH": "data=-1",
                   "ELASTIC_CHECKPOINT_DIR": "gs://b/j", "ELASTIC_BATCH_MODE": "fixed",
                   "ELASTIC_JAX_HEARTBEAT_TIMEOUT_S": "10", "ELASTIC_LR_SCALING": "none"},
     "/tmp", None),  # what the controller itself sets
    (["trainer"], {"XLA_FLAGS": "x"}, "/tmp",
     "sets XLA_FLAGS, which this host does not allow (a variable can make the worker run "
     "other code); allow it with --allow-env XLA_FLAGS"),
    (["trainer"], {"ELASTIC_SNAPSHOT_DIR": "/tmp/x"}, "/tmp", "sets ELASTIC_SNAPSHOT_DIR"),
    # nothing a deny-list would have to foresee: warnings that import a module
    # that runs $BROWSER, a bash function that replaces a command
    (["python", "train.py"], {"PYTHONWARNINGS": "all:0:antigravity.x:0:0"}, "/srv/jobs/lm",
     "sets PYTHONWARNINGS"),
    (["python", "train.py"], {"BROWSER": "/bin/sh -c id #%s"}, "/srv/jobs/lm", "sets BROWSER"),
    (["trainer"], {"BASH_FUNC_echo%%": "() { id; }"}, "/tmp", "sets BASH_FUNC_echo%%"),
    (["trainer"], {"PJRT_NAMES_AND_LIBRARY_PATHS": "x:/tmp/x.so"}, "/tmp", "sets PJRT_NAMES"),
    (["python", "-m", "jobs.lm"], {}, "/srv/jobs/lm", None),
    (["id"], {}, "/srv/jobs/lm", "is not in this host's allow-list"),
    (["python", "-c", "import os"], {}, "/srv/jobs/lm",
     "`/opt/venv/bin/python -c 'import os'` is not in this host's allow-list"),
    (["python", "evil.py"], {}, "/srv/jobs/lm", "is not in this host's allow-list"),
    (["python", "train.py"], {}, "/tmp/evil", "is not in this host's allow-list"),
    (["python3", "/srv/jobs/lm/train.py"], {}, "/", "is not in this host's allow-list"),
    (["python", "-m", "jobs.lm"], {}, "/tmp/evil", "allow the directory with --allow-workdir"),
    (["python", "train.py"], {"LD_PRELOAD": "/tmp/x.so"}, "/srv/jobs/lm",
     "sets LD_PRELOAD, which this host does not allow"),
    (["python", "train.py"], {"PATH": "/tmp"}, "/srv/jobs/lm", "sets PATH"),
    (["python", "train.py"], {"PYTHONPATH": "/srv/lib"}, "/srv/jobs/lm", None),  # allowed by name
    (["nope", "train.py"], {}, "/srv/jobs/lm", "is not on this agent's PATH"),
    (["python", "train.py"], {}, "relative", "is not an absolute path"),
    (["python", "tr\0ain.py"], {}, "/srv/jobs/lm", "NUL"),
    ([], {}, "/srv/jobs/lm", "empty"),
])
def test_check_launch(argv, env, workdir, refused):
    verdict = check_launch(ALLOW, argv, env, workdir, PATH.get)
    if refused is None:
        # what runs is the program that was checked, whatever PATH the worker gets
        assert verdict == [PATH.get(argv[0], argv[0]), *argv[1:]], verdict
    else:
        assert isinstance(verdict, str) and refused in verdict, verdict


def test_any_worker_runs_anything_with_any_environment():
    # (a controller that may run any program can set any variable through it)
    anything = AllowList(any_worker=True)
    assert check_launch(anything, ["id"], {}, "/", PATH.get) == ["/usr/bin/id"]
    assert check_launch(anything, ["id"], {"LD_AUDIT": "x"}, "/", PATH.get) == ["/usr/bin/id"]


@pytest.mark.parametrize("text, pattern, expected", [
    ("/srv/jobs/lm/train.py", "/srv/jobs/*/train.py", True),
    ("/srv/jobs/lm/out/train.py", "/srv/jobs/*/train.py", False),   # * stays in a component
    ("/srv/jobs/lm/out/train.py", "/srv/jobs/**/train.py", True),
    ("/usr/bin/python3.11", "/usr/bin/python3.1?", True),
    ("/a/b*c", "/a/b[*]c", True),                                     # a literal *
    ("/a/bxc", "/a/b[*]c", False),
    ("/a/bxc", "/a/b[!x]c", False),
])
def test_patterns(text, pattern, expected):
    assert matches(text, pattern) is expected


def test_scripts_and_workdirs_are_matched_by_their_real_path(tmp_path):
    jobs, elsewhere = tmp_path / "jobs" / "lm", tmp_path / "elsewhere"
    jobs.mkdir(parents=True)
    elsewhere.mkdir()
    (elsewhere / "train.py").write_text("")
    (jobs / "data").symlink_to(elsewhere / "sub", target_is_directory=True)
    (elsewhere / "sub").mkdir()
    allow = AllowList.parse([f"/opt/venv/bin/python {tmp_path}/jobs/*/train.py"])
    # textually jobs/lm/train.py, but the kernel opens elsewhere/train.py
    verdict = check_launch(allow, ["python", "../train.py"], {}, str(jobs / "data"), PATH.get)
    assert isinstance(verdict, str) and str(elsewhere / "train.py") in verdict


def test_parse_refuses_relative_programs_and_warns_on_bare_interpreters():
    with pytest.raises(ValueError, match="must be an absolute path pattern"):
        AllowList.parse(["python train.py"])
    with pytest.raises(ValueError, match="needs a program"):
        AllowList.parse([""])
    with pytest.raises(ValueError, match="--allow-workdir 'srv'"):
        AllowList.parse(["/bin/x"], workdirs=["srv"])
    assert "allows any Python code" in AllowList.parse(["/usr/bin/python3"]).warnings()[0]
    assert AllowList.parse(["/usr/bin/python3 /srv/train.py"]).warnings() == []


@pytest.mark.parametrize("pattern, risky", [
    ("PYTHONPATH", "PYTHON*"), ("LD_PRELOAD", "LD_*"), ("*", "LD_*"), ("PY*", "PYTHON*"),
    ("BASH_FUNC_*", "BASH_FUNC_*"), ("XLA_FLAGS", None), ("WANDB_*", None),
])
def test_allowing_a_variable_that_runs_code_is_warned_about(pattern, risky):
    warnings = AllowList.parse(["/usr/bin/python3 /srv/train.py"], env=[pattern]).warnings()
    if risky is None:
        assert warnings == []
    else:
        [warning] = warnings
        assert f"--allow-env {pattern!r} allows a variable that can make the worker run" in \
            warning and f"({risky})" in warning


def test_the_variables_a_start_carries_unasked_are_the_controllers_own(tmp_path):
    """worker_env.JOB_LEVEL_ENV names what Executor.worker_env sets besides
    the job's env: a name set there and missing from it would make every
    agent refuse every start."""
    from elastic import worker_env
    from elastic.clock import FakeClock
    from elastic.controller.executor import Executor
    from elastic.controller.journal import JournalWriter
    from tests.policy_tables import spec

    job = dataclasses.replace(spec(), env={"XLA_FLAGS": ""})
    sent = Executor(job, JournalWriter(tmp_path), FakeClock()).worker_env()
    assert set(sent) - set(job.env) == set(worker_env.JOB_LEVEL_ENV)
