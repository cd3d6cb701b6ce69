"""Shared test helpers: a process guard and a driver for `elasticd local`.

Every process a test starts carries ELASTIC_TEST_TAG=<unique id> in its
environment, and so does everything they start (agents pass their environment
to workers). After the test no process with that tag may be alive; the guard
kills leftovers and fails the test if it finds any.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from elastic.procs import alive, signal_pid
from elastic.worker.prestart import set_policy

REPO = pathlib.Path(__file__).resolve().parent.parent
TINY_WORKER = REPO / "workers" / "tiny" / "worker.py"


def tagged_pids(tag: str) -> list[int]:
    """Live (non-zombie) processes whose environment holds ELASTIC_TEST_TAG=tag."""
    needle = f"ELASTIC_TEST_TAG={tag}".encode()
    found = []
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0") and alive(int(entry.name)):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


class PKI:
    """A test CA (made once per session) and bundles issued from it:
    `controller`, `operator`, and `host(host_id)` (issued on first use)."""

    def __init__(self, root: pathlib.Path) -> None:
        from elastic.security import certs
        from elastic.security.identity import Role
        from elastic.security.tls import TLSFiles

        self.root, self._certs, self._role, self._files = root, certs, Role, TLSFiles
        certs.create_ca(root, "elastic test CA")
        self.controller = self.bundle(Role.CONTROLLER, "controller")
        self.operator = self.bundle(Role.OPERATOR, "tester")

    def bundle(self, role, name: str, **kw):
        """Issue (again) and return the TLSFiles of `name` in `role`."""
        return self._files.in_dir(self._certs.issue(self.root, role, name, **kw).directory)

    def host(self, host_id: str):
        """The host bundle of `host_id` (issued once)."""
        directory = self._certs.bundle_dir(self.root, self._role.HOST, host_id)
        if not directory.exists():
            return self.bundle(self._role.HOST, host_id)
        return self._files.in_dir(directory)


@pytest.fixture(scope="session")
def pki(tmp_path_factory) -> PKI:
    """One test CA for the session (see PKI)."""
    return PKI(tmp_path_factory.mktemp("pki"))


@contextlib.contextmanager
def guarded_env():
    """Yield an environment for processes to start; on the way out, fail
    (AssertionError) if any of them (or their descendants) is still alive
    10 s later, after killing them."""
    tag = uuid.uuid4().hex
    env = dict(os.environ, ELASTIC_TEST_TAG=tag, PYTHONUNBUFFERED="1")
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    yield env
    deadline = time.monotonic() + 10.0
    while (left := tagged_pids(tag)) and time.monotonic() < deadline:
        time.sleep(0.05)
    names = []  # what they are, for the message
    for pid in left:
        try:
            names.append(pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
                         .replace(b"\0", b" ").decode(errors="replace")[:200])
        except OSError:
            pass
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    assert not left, f"processes left behind by the test: {left} {names}"


def signal_process(pid: int, sig: int) -> None:
    """Send `sig` to a pid a test read from a status or an agent, through
    elastic.procs.signal_pid, which refuses a pid of 0 or less (a worker not
    reported or not started yet: os.kill would take it for this process's
    own group, under `make test` make, pytest and both its workers, or for
    every process). Raises AssertionError when the signal was not sent."""
    assert signal_pid(pid, sig), f"could not signal pid {pid} (0 or less, or gone)"


@pytest.fixture
def proc_env():
    """Environment for processes a test starts; fails the test if any of
    them (or their descendants) is still alive 10 s after the test."""
    with guarded_env() as env:
        yield env


@pytest.fixture
def tagged(proc_env, monkeypatch):
    """Workers started by in-process agents (tests/test_grpc.py) carry the
    test tag too, so that the check for processes left behind sees them."""
    monkeypatch.setenv("ELASTIC_TEST_TAG", proc_env["ELASTIC_TEST_TAG"])
    monkeypatch.setenv("PATH", proc_env["PATH"])


@contextlib.contextmanager
def reaped(proc: subprocess.Popen):
    """Yield `proc`; on the way out, SIGKILL it if it still runs, and reap it."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def launch_prestarted(warm: subprocess.Popen, argv: list[str], env: dict,
                      cwd) -> tuple[bytes, bytes]:
    """Send a pre-started process (`python -m elastic.worker.prestart`,
    stdin, stdout and stderr piped) its launch as the agent does, and
    return its (stdout, stderr) once it has ended (subprocess.TimeoutExpired
    after 60 s); it is killed, if need be, and reaped on the way out.
    As root, the process preloads at SCHED_IDLE, which a busy machine may
    not give it for minutes: like the agent, this raises it to normal
    priority first (once it has gone idle, so that it cannot go idle after)."""
    with reaped(warm):
        if os.geteuid() == 0:
            wait_until(lambda: warm.poll() is not None
                       or os.sched_getscheduler(warm.pid) == os.SCHED_IDLE, 30.0,
                       "the pre-started process to go to SCHED_IDLE")
            set_policy(warm.pid, os.SCHED_OTHER)
        return warm.communicate(json.dumps({"argv": argv, "env": env, "cwd": str(cwd)}).encode()
                                + b"\n", timeout=60)


def stop(proc: subprocess.Popen, sig: int, timeout_s: float = 30.0) -> int:
    """Send `sig` to `proc` and return its exit code (subprocess.TimeoutExpired
    after `timeout_s` seconds)."""
    proc.send_signal(sig)
    return proc.wait(timeout_s)


def wait_until(predicate, timeout_s: float, what: str, interval_s: float = 0.02):
    """Poll `predicate` until it returns something truthy; fail after timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def write_spec(path: pathlib.Path, body: str) -> pathlib.Path:
    path.write_text(textwrap.dedent(body))
    return path


async def until(predicate, timeout_s: float = 20.0, what: str = "the condition") -> None:
    """Return once `predicate()` is true, checking every 20 ms on the running
    event loop (what an in-process controller or agent changes has no event
    to await); fail the test after `timeout_s` seconds naming `what`."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def tiny_spec(tmp_path: pathlib.Path, args: str = "--steps 2000 --step-time-s 0.02",
              extra: str = "", min_hosts: int = 1, max_hosts: int = 4,
              job_extra: str = "") -> pathlib.Path:
    """A job spec running the tiny worker with fast health timings."""
    argv = json.dumps([sys.executable, str(TINY_WORKER), *args.split()])
    return write_spec(tmp_path / "job.toml", f"""
        [job]
        id = "test"
        command = {argv}
        min_hosts = {min_hosts}
        max_hosts = {max_hosts}
        {job_extra}

        [health]
        heartbeat_interval_s = 0.25
        heartbeat_timeout_s = 1.5
        stop_grace_s = 1.0
        stop_timeout_s = 3.0
        rendezvous_settle_s = 0.5
        {extra}
        """)


LM_TRAIN = REPO / "workers" / "lm" / "train.py"


def lm_spec(path: pathlib.Path, job_id: str, args: list[str], min_hosts: int, max_hosts: int,
            heartbeat_timeout_s: float, job_extra: str = "",
            grow: str = "", controller_lease_s: float | None = None,
            mesh: str = "data = -1\nmodel = 2", hang_min_timeout_s: float | None = None,
            ) -> pathlib.Path:
    """Write to `path` a job spec running the reference model small (one
    layer, d_model 64, sequence 64 bytes: it compiles in half the time of
    two; `args` added) on `mesh` ([mesh] lines; default data=-1 x model=2), with
    heartbeats every 0.5 s and the given timeout (seconds). `job_extra`: more
    [job] lines (e.g. checkpoint_dir); `grow`: restart.grow if not the default;
    `controller_lease_s`: health.controller_lease_s if not the default;
    `hang_min_timeout_s`: hang.min_timeout_s if not the default (seconds)."""
    argv = [sys.executable, str(LM_TRAIN), "--layers", "1", "--d-model", "64", "--seq-len", "64",
            *args]
    sections = f'[restart]\ngrow = "{grow}"\n' if grow else ""
    if hang_min_timeout_s is not None:
        sections += f"[hang]\nmin_timeout_s = {hang_min_timeout_s}\n"
    lease = f"controller_lease_s = {controller_lease_s}" if controller_lease_s else ""
    return write_spec(path, f"""
        [job]
        id = "{job_id}"
        command = {json.dumps(argv)}
        min_hosts = {min_hosts}
        max_hosts = {max_hosts}
        {job_extra}

        [mesh]
        {mesh}

        [health]
        heartbeat_interval_s = 0.5
        heartbeat_timeout_s = {heartbeat_timeout_s}
        {lease}
        """ + sections)


class LocalJob:
    """`elasticd local` in its own process group, driven by a test."""

    def __init__(self, spec: pathlib.Path, state_dir: pathlib.Path, env: dict,
                 hosts: int = 4, devices: int = 1, faults: tuple[str, ...] = (),
                 extra_args: tuple[str, ...] = (),
                 compile_cache: pathlib.Path | None = None) -> None:
        self.state_dir = state_dir
        self.env = env
        self.extra_procs: list[subprocess.Popen] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "elastic.cli", "local", "--config", str(spec),
             "--hosts", str(hosts), "--devices-per-host", str(devices),
             "--state-dir", str(state_dir), "--quiet",
             *[arg for fault in faults for arg in ("--fault", fault)], *extra_args,
             *(["--compile-cache-dir", str(compile_cache)] if compile_cache else [])],
            env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def journal(self) -> list[dict]:
        """The job's journal (a standby's own, once it holds more of it)."""
        from elastic.local import journal_dir

        path = journal_dir(self.state_dir) / "events.jsonl"
        if not path.exists():
            return []
        entries = []
        for line in path.read_text().splitlines():
            try:
                entries.append(json.loads(line))
            except ValueError:
                pass
        return entries

    def wait_for(self, kind: str, timeout_s: float = 30.0, **match) -> dict:
        """The first journal entry of `kind` whose fields equal `match`."""
        def find():
            for e in self.journal():
                if e["kind"] == kind and all(e.get(k) == v for k, v in match.items()):
                    return e
            if self.proc.poll() is not None:
                raise AssertionError(f"elasticd local exited ({self.proc.returncode}) before "
                                     f"{kind} {match}:\n{self.output()}")
            return None
        return wait_until(find, timeout_s, f"journal entry {kind} {match}")

    def outcome(self) -> dict:
        """The journal's job_succeeded / job_failed entry, checking that the
        controller journaled its own end right after it."""
        entries = self.journal()
        assert entries[-1]["kind"] == "controller_stopped", entries[-3:]
        return next(e for e in reversed(entries) if e["kind"] in ("job_succeeded", "job_failed"))

    def local_info(self) -> dict:
        path = self.state_dir / "local.json"
        wait_until(path.exists, 30.0, "local.json")
        return json.loads(path.read_text())

    def status(self) -> dict:
        out = subprocess.run(
            [sys.executable, "-m", "elastic.cli", "status", "--json",
             "--state-dir", str(self.state_dir)],
            env=self.env, capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    def host(self, host_id: str) -> dict:
        return next(h for h in self.status()["hosts"] if h["hostId"] == host_id)

    def running_host(self, host_id: str, timeout_s: float = 30.0) -> dict:
        """`host(host_id)` once its agent has reported its worker's pid (the
        tiny workers step each on their own: `first_progress` may come
        before another host's agent has; a pid of 0 would have the test
        signal its own process group, or find "no such process" at once)."""
        return wait_until(lambda: (h := self.host(host_id)).get("workerPid") and h, timeout_s,
                          f"{host_id}'s worker pid")

    def worker_pids(self, timeout_s: float = 30.0) -> dict[str, int]:
        """Every member's worker pid (host id -> pid), once each is known
        (see `running_host`)."""
        def known():
            hosts = [h for h in self.status()["hosts"] if h["state"] == "member"]
            return hosts and all(h.get("workerPid") for h in hosts) and \
                {h["hostId"]: h["workerPid"] for h in hosts}
        return wait_until(known, timeout_s, "every member's worker pid")

    def wait(self, timeout_s: float = 60.0) -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"elasticd local still running after {timeout_s} s:\n"
                                 f"{self.output()}") from None

    def output(self) -> str:
        logs = [self.state_dir / "controller.log", *sorted((self.state_dir / "hosts").glob("*.log"))]
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in logs if p.exists())

    def close(self) -> None:
        """Stop everything this job started; the process group must be empty.
        Agents the test started itself get SIGINT (stop now: SIGTERM would be
        a preemption, which waits for a controller that is going away)."""
        for p in self.extra_procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for p in self.extra_procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self.proc.stdout:
            self.proc.stdout.close()
        group_alive = True
        deadline = time.monotonic() + 10
        while group_alive and time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
                time.sleep(0.05)
            except ProcessLookupError:
                group_alive = False
        assert not group_alive, f"process group {self.proc.pid} still has processes"


#: Fixtures of tests that start processes: their files run first (see
#: pytest_collection_modifyitems).
SPAWNING = frozenset({"proc_env", "tagged", "local_job", "lm_reference"})


def pytest_collection_modifyitems(config, items) -> None:
    """Put the files whose tests start processes (seconds to a minute each)
    before those of pure functions (milliseconds), keeping the order within
    each group: `make test` runs two pytest workers that take whole files in
    this order (`--dist loadfile --no-loadscope-reorder`), and a long file
    taken last would leave one worker running it alone."""
    spawning = {item.path for item in items if SPAWNING & set(getattr(item, "fixturenames", ()))}
    items.sort(key=lambda item: item.path not in spawning)


def shared_root(tmp_path_factory) -> pathlib.Path:
    """The session's temporary root, shared by all pytest workers of a run
    (pytest-xdist gives each worker a directory of its own under it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextlib.contextmanager
def shared_lock(tmp_path_factory, name: str):
    """Hold an exclusive lock (flock) shared by all pytest workers of a run."""
    with open(shared_root(tmp_path_factory) / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@pytest.fixture(scope="session")
def compile_cache(tmp_path_factory) -> pathlib.Path:
    """One executable cache for every local job of the run, shared by the
    pytest workers: a program and slice shape an earlier test compiled loads
    from it (as a host's cache persists across runs, or hosts share one in a
    bucket), so each test pays for its own new shapes only. Entries are
    written atomically (elastic.worker.compile_cache)."""
    path = shared_root(tmp_path_factory) / "compile-cache"
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture
def local_job(tmp_path, proc_env, compile_cache):
    """Factory: local_job(spec, hosts=4, devices=1, faults=(), name="state",
    extra_args=(), env=None) -> a started LocalJob (state in tmp_path / name;
    `env` added to its environment, e.g. a GCS emulator's)."""
    jobs = []

    def start(spec: pathlib.Path, hosts: int = 4, devices: int = 1, faults: tuple = (),
              name: str = "state", extra_args: tuple = (), env: dict | None = None) -> LocalJob:
        job = LocalJob(spec, tmp_path / name, dict(proc_env, **(env or {})), hosts, devices,
                       faults, extra_args, compile_cache)
        jobs.append(job)
        return job
    yield start
    for job in jobs:
        job.close()


def lm_samples(path: pathlib.Path) -> list[dict]:
    """The per-step lines a reference-model run wrote with --sample-log."""
    return [json.loads(line) for line in path.read_text().splitlines()]


#: How far a disturbed run's final loss may be from the undisturbed run's
#: (why 1e-3 nats: tests/test_training.py's docstring).
LM_TOLERANCE_NATS = 1e-3


def assert_matches_reference(samples: list[dict], reference: dict[int, dict]) -> float:
    """Check a disturbed run against `lm_reference`: every step drew the
    same samples, every step of the reference was trained, and the final
    loss is within LM_TOLERANCE_NATS. Returns the largest per-step loss
    difference (nats)."""
    seen = set()
    worst = 0.0
    for line in samples:
        step = line["step"]
        assert line["ids"] == reference[step]["ids"], f"step {step} drew other samples"
        worst = max(worst, abs(line["loss"] - reference[step]["loss"]))
        seen.add(step)
    assert seen == set(reference)
    final, final_ref = samples[-1]["loss"], reference[max(reference)]["loss"]
    assert abs(final - final_ref) <= LM_TOLERANCE_NATS, (final_ref, final)
    return worst


def lm_run_spec(tmp_path: pathlib.Path, name: str, grow: str = "never",
                checkpoint_dir: str | None = None, snapshot_every: int = 10,
                checkpoint_every: int = 10, **spec) -> pathlib.Path:
    """The reference model for 40 steps (checkpoints every `checkpoint_every`),
    logging its samples and loss per step to tmp_path/NAME-samples.jsonl; 2
    to 4 hosts; checkpoints in `checkpoint_dir` (default tmp_path/NAME-ckpt);
    local snapshots every `snapshot_every` steps (0: none, every restore
    reads the checkpoint directory); `spec`: more lm_spec arguments (mesh)."""
    return lm_spec(tmp_path / f"{name}.toml", "lm-test",
                   ["--steps", "40", "--checkpoint-every", str(checkpoint_every),
                    "--eval-every", "1000",
                    "--sample-log", str(tmp_path / f"{name}-samples.jsonl"),
                    "--snapshot-every", str(snapshot_every)],
                   min_hosts=2, max_hosts=4, heartbeat_timeout_s=2.0,
                   job_extra=f'checkpoint_dir = "{checkpoint_dir or tmp_path / (name + "-ckpt")}"',
                   grow=grow, **spec)


@pytest.fixture(scope="session")
def lm_reference(tmp_path_factory, compile_cache) -> dict[int, dict]:
    """step -> sample line of an undisturbed run of `lm_run_spec` on 4 hosts
    x 2 devices, run once per test run (by the first pytest worker that needs
    it, the others waiting for it) for the tests that compare a disturbed run
    with it."""
    tmp = shared_root(tmp_path_factory) / "lm-reference"
    with shared_lock(tmp_path_factory, "lm-reference"):  # one run for all pytest workers
        if not (tmp / "ref-samples.done").exists():
            shutil.rmtree(tmp, ignore_errors=True)  # (a run of another worker that failed)
            tmp.mkdir()
            with guarded_env() as env:
                job = LocalJob(lm_run_spec(tmp, "ref"), tmp / "state", env, hosts=4,
                               devices=2, compile_cache=compile_cache)
                try:
                    assert job.wait(240) == 0, job.output()
                finally:
                    job.close()
            (tmp / "ref-samples.done").touch()
    reference = {s["step"]: s for s in lm_samples(tmp / "ref-samples.jsonl")}
    assert sorted(reference) == list(range(40))
    return reference


@pytest.fixture(scope="session")
def gcs_emulator():
    """fake-gcs-server on a free loopback port for the session
    (elastic.checkpoint.emulator.GCSEmulator)."""
    from elastic.checkpoint.emulator import GCSEmulator

    with GCSEmulator() as emulator:
        yield emulator


@pytest.fixture
def gcs_bucket(gcs_emulator) -> str:
    """A new, empty bucket on the emulator: "gs://<name>"."""
    return gcs_emulator.create_bucket(f"test-{uuid.uuid4().hex[:12]}")
