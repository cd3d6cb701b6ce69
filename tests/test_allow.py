"""An agent's allow-list of worker programs (elastic.security.allow), by table."""

from __future__ import annotations

import dataclasses
import os

import pytest

from elastic.security.allow import AllowList, check_launch, matches, real_path

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
    ("/a/b/c", "/a/b[!x]c", False),                                   # [!...] is never a /
    ("/a/byc", "/a/b[!x]c", True),
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


def test_an_option_matches_only_an_options_pattern():
    """python's `-c` code ending in /train.py matched `**/train.py` (an audit
    found it; python ran the code)."""
    allow = AllowList.parse(["/opt/venv/bin/python **/train.py",
                             "/opt/venv/bin/python -X importtime /srv/jobs/*/train.py"])
    code = "-cimport os;os.system('id')#/train.py"
    verdict = check_launch(allow, ["python", code], {}, "/srv/jobs/lm", PATH.get)
    assert isinstance(verdict, str) and "is not in this host's allow-list" in verdict
    assert check_launch(allow, ["python", "-X", "importtime", "train.py"], {}, "/srv/jobs/lm",
                        PATH.get) == ["/opt/venv/bin/python", "-X", "importtime", "train.py"]


def test_a_path_through_proc_is_refused(tmp_path):
    """/proc/self is the agent when it checks and the worker when it runs:
    `/proc/self/cwd/train.py` checked as the agent's directory's train.py
    but ran the working directory's."""
    jobs = tmp_path / "jobs" / "lm"
    jobs.mkdir(parents=True)
    (jobs / "train.py").write_text("")
    (jobs / "cwd").symlink_to("/proc/self/cwd")
    (jobs / "fd").symlink_to("/dev/fd")
    allow = AllowList.parse([f"/opt/venv/bin/python {tmp_path}/**/train.py",
                             "/proc/**/python /srv/jobs/*/train.py"])
    for script in ("/proc/self/cwd/train.py", "cwd/train.py", "fd/../lm/train.py",
                   "/dev/stdin"):
        verdict = check_launch(allow, ["python", script], {}, str(jobs), PATH.get)
        assert isinstance(verdict, str) and f"{script!r} passes through /proc" in verdict, \
            (script, verdict)
    verdict = check_launch(allow, ["/proc/self/cwd/python", "/srv/jobs/lm/train.py"], {},
                           "/srv/jobs/lm", PATH.get)
    assert isinstance(verdict, str) and "'/proc/self/cwd/python' passes through /proc" in verdict
    # the same file by a path that does not: allowed, with the program's own
    # arguments free, /dev/stdout among them (past the patterns: not judged)
    assert check_launch(allow, ["python", "train.py", "--log", "/dev/stdout"], {}, str(jobs),
                        PATH.get) == ["/opt/venv/bin/python", "train.py", "--log", "/dev/stdout"]
    # and an agent that allows anything runs anything
    assert check_launch(AllowList(any_worker=True), ["python", "/proc/self/cwd/train.py"], {},
                        str(jobs), PATH.get) == ["/opt/venv/bin/python", "/proc/self/cwd/train.py"]


def test_real_path_resolves_as_os_path_realpath(tmp_path, monkeypatch):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "l").symlink_to(tmp_path / "a" / "b")
    (tmp_path / "rel").symlink_to("a")
    (tmp_path / "loop").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop")
    for path in ("l/../x.py", "rel/b/../../l/y", "a/./b/missing/z", "l", "../q", "a//b/"):
        full = os.path.join(str(tmp_path), path)
        assert real_path(full) == os.path.realpath(full), path
    assert real_path(str(tmp_path / "loop" / "x")) is None
    monkeypatch.chdir(tmp_path)  # (a relative path: against the current directory)
    assert real_path("l/../x.py") == os.path.realpath("l/../x.py")


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
