"""Pre-started worker processes: a restart runs the worker in a process that
already imported JAX, exactly as a cold `python script.py` would run it."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from conftest import launch_prestarted, reaped, signal_process, wait_until
from elastic import worker_env
from elastic.agent.supervisor import WorkerSupervisor, launch_key
from elastic.security.allow import resolve
from elastic.worker.prestart import (READY_LINE, RUNTIME_PRELOAD, STORAGE_PRELOAD,
                                     preload_names, program_imports, set_policy)

PY = sys.executable

SCRIPT = """
import json, os, sys
import jax
import elastic.worker.prestart as prestart
with open(os.environ["RECORD"], "a") as f:
    f.write(json.dumps({
        "pid": os.getpid(), "argv": sys.argv, "cwd": os.getcwd(), "name": __name__,
        "path0": sys.path[0], "generation": os.environ.get("ELASTIC_GENERATION"),
        "launched": prestart.launched_at is not None,
        "orbax_loaded": "orbax.checkpoint" in sys.modules,
        "gcsfs_loaded": "gcsfs" in sys.modules,
        "policies": sorted({os.sched_getscheduler(int(t)) for t in os.listdir("/proc/self/task")}),
        }) + "\\n")
sys.exit(3 if os.environ["ELASTIC_GENERATION"] == "2" else 0)
"""


@pytest.mark.parametrize("argv, usable", [
    ([PY, "train.py", "--steps", "5"], True),
    ([PY, "-m", "pkg.train"], True),
    (["python3", "train.py"], True),
    ([PY, "-u", "train.py"], False),     # interpreter flags: start cold
    ([PY, "-m"], False),
    ([PY], False),
    (["bash", "run.sh"], False),
    (["./train"], False),
])
def test_launch_key_only_for_plain_python_commands(argv, usable):
    assert (launch_key(argv, {}, "/w") is not None) is usable


def test_launch_key_ignores_only_per_generation_and_job_variables():
    env = {"A": "1", worker_env.ENV_GENERATION: "3", worker_env.ENV_PROCESS_ID: "0",
           worker_env.ENV_JOB_ID: "a", worker_env.ENV_RUN_ID: "r1",
           worker_env.ENV_CHECKPOINT_DIR: "/ckpt/a"}
    same = dict(env, **{worker_env.ENV_GENERATION: "4", worker_env.ENV_PROCESS_ID: "2",
                        worker_env.ENV_COORDINATOR: "h:1", worker_env.ENV_NUM_PROCESSES: "3"})
    key = launch_key([PY, "t.py"], env, "/w")
    assert launch_key([PY, "t.py"], same, "/w") == key
    assert launch_key([PY, "t.py"], dict(env, A="2"), "/w") != key
    assert launch_key([PY, "t.py"], dict(env, JAX_PLATFORMS="cpu"), "/w") != key
    assert launch_key([PY, "t.py"], env, "/other") != key
    assert launch_key([PY, "u.py"], env, "/w") == key  # the script is given at launch
    # the next job (elastic.worker.init reads its variables after the launch)
    next_job = dict(env, **{worker_env.ENV_JOB_ID: "b", worker_env.ENV_RUN_ID: "r2",
                            worker_env.ENV_MESH: "data=-1", worker_env.ENV_CHECKPOINT_DIR: "/b"})
    assert launch_key([PY, "t.py"], next_job, "/w") == key
    # ... but checkpoints on a bucket preload its client: another process
    on_gcs = dict(env, **{worker_env.ENV_CHECKPOINT_DIR: "gs://bucket/b"})
    assert launch_key([PY, "t.py"], on_gcs, "/w") != key


def test_program_imports_leave_out_the_programs_own_modules(tmp_path):
    (tmp_path / "model.py").write_text("")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    script = tmp_path / "train.py"
    script.write_text("import os, json\nimport model\nfrom pkg import x\nimport optax.tree\n"
                      "from jax import numpy\nfrom . import y\ndef f():\n    import inner\n")
    assert program_imports(str(script)) == ["os", "json", "optax.tree", "jax"]
    assert program_imports(str(tmp_path / "missing.py")) == []


def test_program_imports_follow_the_programs_own_modules(tmp_path):
    """What a program's own modules import from elsewhere is preloaded too
    (read from their source, in order, each once), the modules themselves
    never; a cycle between them ends."""
    (tmp_path / "model.py").write_text("import jax\nimport step\nimport flax.linen\n")
    (tmp_path / "step.py").write_text("import optax\nimport model\nimport jax\n")
    script = tmp_path / "train.py"
    script.write_text("import json\nimport model\nimport jax\n")
    assert program_imports(str(script)) == ["json", "jax", "flax.linen", "optax"]


def test_jax_runtime_preloaded_only_for_programs_that_import_jax(tmp_path):
    jax_program, plain = tmp_path / "train.py", tmp_path / "tiny.py"
    jax_program.write_text("import jax\nimport optax\n")
    plain.write_text("import json\nfrom elastic.worker import ProgressReporter\n")
    assert preload_names(str(jax_program)) == [*RUNTIME_PRELOAD, "jax", "optax"]
    assert preload_names(str(plain)) == ["json", "elastic.worker"]
    assert preload_names("") == list(RUNTIME_PRELOAD)  # python -m module
    # checkpoints in a bucket: its client too, only for a program that imports JAX
    bucket = "gs://bucket/checkpoints"
    assert preload_names(str(jax_program), bucket) == \
        [*RUNTIME_PRELOAD, *STORAGE_PRELOAD["gs"], "jax", "optax"]
    assert preload_names(str(jax_program), str(tmp_path)) == [*RUNTIME_PRELOAD, "jax", "optax"]
    assert preload_names(str(plain), bucket) == ["json", "elastic.worker"]


def cold_and_warm(script: str, workdir, env) -> tuple[str, str]:
    """The output of `python script` started in `workdir` cold, and in a
    pre-started process launched so (stdout each; AssertionError with both
    stderrs if either failed)."""
    argv = [sys.executable, script]
    cold = subprocess.run(argv, cwd=workdir, env=env, capture_output=True, text=True,
                          timeout=60)
    launch = json.dumps({"argv": argv, "env": env, "cwd": str(workdir)})
    warm = subprocess.run([sys.executable, "-P", "-m", "elastic.worker.prestart",
                           os.path.join(workdir, script)], cwd=workdir, env=env,
                          input=launch + "\n", capture_output=True, text=True, timeout=60)
    assert cold.returncode == warm.returncode == 0, (cold.stderr, warm.stderr)
    return cold.stdout, warm.stdout


def test_a_launched_script_imports_beside_its_real_path_as_python_does(tmp_path, proc_env):
    # train.py in jobs/ is allowed by its real path; a symlink to it from
    # another directory must import jobs/helper.py, not the one beside the link
    jobs, other = tmp_path / "jobs", tmp_path / "other"
    jobs.mkdir()
    other.mkdir()
    (jobs / "train.py").write_text("import helper\nprint(helper.WHERE)\n")
    (jobs / "helper.py").write_text("WHERE = 'jobs'\n")
    (other / "helper.py").write_text("WHERE = 'other'\n")
    (other / "train.py").symlink_to(jobs / "train.py")
    assert cold_and_warm("train.py", other, proc_env) == ("jobs\n", "jobs\n")


def test_a_launched_script_is_the_file_the_allow_list_checked(tmp_path, proc_env):
    """`x/../train.py` with x a symlink: the kernel (a cold start, and the
    allow-list's real path) takes `..` after the link, to the link's target's
    parent; the pre-started process took it textually, and ran the train.py
    beside x instead — a file the allow-list never checked (found by a
    security audit: an allowed /srv/jobs/*/train.py ran /dev/shm/w/train.py)."""
    allowed, work = tmp_path / "jobs" / "lm", tmp_path / "w"
    allowed.mkdir(parents=True)
    work.mkdir()
    (allowed / "inner").mkdir()
    (allowed / "train.py").write_text("print('allowed')\n")
    (work / "train.py").write_text("print('unchecked')\n")
    (work / "x").symlink_to(allowed / "inner")
    checked = resolve([sys.executable, "x/../train.py"], str(work), shutil.which)
    assert checked[1] == str(allowed / "train.py")
    assert cold_and_warm("x/../train.py", work, proc_env) == ("allowed\n", "allowed\n")


def test_a_library_changed_after_the_preload_starts_the_program_afresh(tmp_path, proc_env):
    """A pre-started process whose imported library was installed again
    (here: edited on PYTHONPATH) before its launch runs the program as a
    cold start would, in the same process (exec: the pid the agent
    watches), not the code it had imported."""
    lib = tmp_path / "lib" / "mylib"
    lib.mkdir(parents=True)
    (lib / "__init__.py").write_text("VALUE = 'imported'\n")
    (tmp_path / "train.py").write_text("import os, mylib\nprint(mylib.VALUE, os.getpid())\n")
    env = dict(proc_env, PYTHONPATH=os.pathsep.join(
        p for p in (str(tmp_path / "lib"), proc_env.get("PYTHONPATH")) if p))
    argv = [sys.executable, "train.py"]
    warm = subprocess.Popen([sys.executable, "-P", "-m", "elastic.worker.prestart",
                             str(tmp_path / "train.py")], cwd=tmp_path, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with reaped(warm):
        before = b""
        while READY_LINE not in before:  # (the preloads, mylib among them, are done)
            line = warm.stderr.readline()
            assert line, f"the pre-started process ended: {before.decode()[-2000:]}"
            before += line
        (lib / "__init__.py").write_text("VALUE = 'installed again'\n")
        out, err = launch_prestarted(warm, argv, env, tmp_path)
    assert warm.returncode == 0, err.decode()[-2000:]
    assert out.decode() == f"installed again {warm.pid}\n", err.decode()[-2000:]
    assert b"starting the program afresh" in err


def test_a_program_started_afresh_measures_its_start_from_the_launch(monkeypatch):
    from elastic.worker import runtime

    monkeypatch.setenv(worker_env.ENV_LAUNCHED_AT, "1700000000.25")
    assert runtime._process_start_time() == 1700000000.25
    monkeypatch.setenv(worker_env.ENV_LAUNCHED_AT, "soon")
    assert abs(runtime._process_start_time() - 1700000000.25) > 1


class _Exits:
    def __init__(self) -> None:
        self.statuses = []
        self.event = asyncio.Event()

    def __call__(self, status) -> None:
        self.statuses.append((status.generation, status.exit_code, status.signal))
        self.event.set()

    async def wait(self) -> tuple[int, int, int]:
        await asyncio.wait_for(self.event.wait(), 60)
        self.event.clear()
        return self.statuses[-1]


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


async def _ready(sup: WorkerSupervisor, spawned: list, wait: bool = True) -> int:
    """Pre-start the next worker's process; its pid. With `wait`, once it is
    ready. It preloads at SCHED_IDLE (as root: checked here), which a
    machine kept busy may not give it for minutes, so it is raised to
    normal priority first, as a start does (`_launch_prestarted`); the
    cold-start cases need no wait (a start raises and waits by itself)."""
    await sup.prestart_next()
    proc = sup._prestarted.proc
    spawned.append(proc)
    if wait:
        if os.geteuid() == 0:  # preloading never competes with training
            await asyncio.to_thread(
                wait_until, lambda: proc.returncode is not None
                or os.sched_getscheduler(proc.pid) == os.SCHED_IDLE, 30.0,
                "the pre-started process to go to SCHED_IDLE")
            set_policy(proc.pid, os.SCHED_OTHER)
        assert await asyncio.wait_for(sup._prestarted.ready, 60)
    return proc.pid


def test_restart_runs_in_the_prestarted_process(tmp_path, proc_env):
    work = tmp_path / "work"
    work.mkdir()
    (work / "train.py").write_text(SCRIPT)
    record = tmp_path / "record.jsonl"
    argv = [PY, "train.py", "--steps", "7"]

    async def scenario():
        exits, spawned = _Exits(), []
        sup = WorkerSupervisor(str(tmp_path / "state"), "inc", exits)
        base = {"ELASTIC_TEST_TAG": proc_env["ELASTIC_TEST_TAG"], "RECORD": str(record),
                "PATH": proc_env["PATH"], "ELASTIC_CHECKPOINT_DIR": "gs://bucket/checkpoints"}
        try:
            await sup.start(1, argv, dict(base, ELASTIC_GENERATION="1"), str(work))
            assert await exits.wait() == (1, 0, 0)
            warm_pid = await _ready(sup, spawned)  # (it went to SCHED_IDLE as root)
            await sup.start(2, argv, dict(base, ELASTIC_GENERATION="2"), str(work))
            assert sup.status.pid == warm_pid
            assert await exits.wait() == (2, 3, 0)  # the program's exit code, unchanged
            # the environment changed beyond the per-generation variables: cold
            warm_pid = await _ready(sup, spawned, wait=False)
            await sup.start(3, argv, dict(base, ELASTIC_GENERATION="3", OTHER="x"), str(work))
            assert sup.status.pid != warm_pid
            assert await exits.wait() == (3, 0, 0)
            # a pre-started process that died before its launch: cold, no error
            warm_pid = await _ready(sup, spawned, wait=False)
            signal_process(warm_pid, signal.SIGKILL)
            await sup._prestarted.proc.wait()
            await sup.start(4, argv, dict(base, ELASTIC_GENERATION="4", OTHER="x"), str(work))
            assert sup.status.pid != warm_pid
            assert await exits.wait() == (4, 0, 0)
        finally:
            sup.kill_now()
            for proc in spawned:  # reaped before the loop closes
                await asyncio.wait_for(proc.wait(), 10)

    asyncio.run(scenario())
    cold, warm, changed, after_kill = _records(record)
    assert warm["argv"] == ["train.py", "--steps", "7"] == cold["argv"]
    assert warm["name"] == "__main__" and warm["cwd"] == str(work) == cold["cwd"]
    assert warm["path0"] == str(work) == cold["path0"]
    assert warm["generation"] == "2" and warm["launched"] and warm["orbax_loaded"]
    assert warm["gcsfs_loaded"]  # checkpoints in a bucket: its client imported ahead too
    assert warm["policies"] == [os.SCHED_OTHER] == cold["policies"]  # every thread
    assert not cold["launched"] and not cold["orbax_loaded"] and not cold["gcsfs_loaded"]
    assert not changed["launched"] and not after_kill["launched"]


def test_a_stop_during_a_start_stops_the_worker_it_starts(tmp_path, proc_env):
    """The stop of generation 2 arrives while its start is handing the launch
    to the pre-started process: the worker must end, not run on unseen."""
    (tmp_path / "sleep.py").write_text("import time\ntime.sleep(60)\n")
    argv = [PY, "sleep.py"]

    async def scenario():
        exits, spawned = _Exits(), []
        sup = WorkerSupervisor(str(tmp_path / "state"), "inc", exits)
        env = {"ELASTIC_TEST_TAG": proc_env["ELASTIC_TEST_TAG"]}
        try:
            await sup.start(1, argv, env, str(tmp_path))
            await _ready(sup, spawned)
            await sup.stop(1, 0.0)
            assert await exits.wait() == (1, 0, 9)
            start = asyncio.create_task(sup.start(2, argv, env, str(tmp_path)))
            await asyncio.sleep(0)  # the start is under way
            await sup.stop(2, 0.0)
            await start
            assert await exits.wait() == (2, 0, 9)
            assert not sup.running
        finally:
            sup.kill_now()
            for proc in spawned:
                await asyncio.wait_for(proc.wait(), 10)

    asyncio.run(scenario())
