"""Bad input on the command line gets one line and the documented exit code,
never a traceback; the controller journals every way it ends."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys

import pytest

from tests.conftest import reaped, stop, tiny_spec, wait_until, write_spec


def elasticd(env, *args, timeout=60):
    return subprocess.run([sys.executable, "-m", "elastic.cli", *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


def one_line_error(out, code: int, text: str) -> None:
    assert out.returncode == code, (out.returncode, out.stderr)
    assert "Traceback" not in out.stderr and text in out.stderr, out.stderr
    assert out.stderr.strip().count("\n") == 0, out.stderr


@pytest.fixture
def spec(tmp_path):
    return tiny_spec(tmp_path)


def test_bad_inputs_to_start(tmp_path, proc_env, spec):
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "dir.toml").mkdir()
    (tmp_path / "latin1.toml").write_bytes(b'[job]\ncommand = ["\xff"]\n')
    inf = write_spec(tmp_path / "inf.toml", '[job]\ncommand = ["x"]\n[health]\n'
                                            'heartbeat_timeout_s = inf\n')
    huge = write_spec(tmp_path / "huge.toml", '[job]\ncommand = ["x"]\nmax_hosts = 100000000\n')
    start = ("start", "--insecure", "--state-dir")
    cases = [
        ((*start, str(tmp_path / "a-file"), "--config", str(spec)), "is not a directory"),
        ((*start, str(tmp_path / "s"), "--config", str(tmp_path / "dir.toml")),
         "is a directory, not a job spec file"),
        ((*start, str(tmp_path / "s"), "--config", str(tmp_path / "latin1.toml")),
         "not UTF-8 text"),
        ((*start, str(tmp_path / "s"), "--config", str(inf)), "must be a finite number, got inf"),
        ((*start, str(tmp_path / "s"), "--config", str(huge)), "above the limit of 100,000"),
        ((*start, str(tmp_path / "s"), "--config", str(spec), "--listen", "127.0.0.1:99999"),
         "port from 0 to 65535"),
        ((*start, str(tmp_path / "s"), "--config", str(spec), "--checkpoint-dir", ""),
         "--checkpoint-dir is empty"),
        (("start", "--state-dir", str(tmp_path / "s"), "--config", str(spec),
          "--tls-dir", str(tmp_path / "no-tls")), "pass --insecure to run without TLS"),
        (("local", "--config", str(spec), "--chaos", "mtbf=nan", "--state-dir",
          str(tmp_path / "s")), "mtbf must be a finite number > 0"),
        # (before, accepted: it never fired, nor did any `after` fault behind it)
        (("local", "--config", str(spec), "--hosts", "2", "--fault", "kill-worker:host-9@step=5",
          "--state-dir", str(tmp_path / "s")), "--fault names no host of this slice: host-9"),
        (("chaos", "--chaos", "mtbf=5", "--state-dir", str(tmp_path / "missing")),
         "no running `elasticd local` slice"),
    ]
    for args, text in cases:
        one_line_error(elasticd(proc_env, *args), 2, text)


def test_status_and_report_on_bad_state(tmp_path, proc_env):
    state = tmp_path / "state"
    state.mkdir()
    (state / "controller.addr").write_bytes(b"\xff\xfe\x00garbage")
    one_line_error(elasticd(proc_env, "status", "--state-dir", str(state), "--insecure"), 2,
                   "does not hold a controller address")
    (state / "events.jsonl").write_bytes(
        b'{"ts": 1.0, "kind": "controller_started", "generation": 0}\n'
        b'\x00\xff\xfe binary\n[1, 2, 3]\n{"kind": "no ts"}\n"a string"\n'
        b'{"ts": 5.0, "kind": "job_succeeded", "generation": 0}\n')
    out = elasticd(proc_env, "report", "--state-dir", str(state))
    assert out.returncode == 0 and "Traceback" not in out.stderr
    assert "4 line(s)" in out.stderr and "ETTR" in out.stdout


def test_report_without_a_journal_or_on_one_it_cannot_read(tmp_path, proc_env):
    """README's exit codes: `report` found no journal: 1; a journal it cannot
    read is a bad state directory: 2, one line naming the file (README said
    only the first, and the audit took the second for a mismatch)."""
    state = tmp_path / "state"
    state.mkdir()
    one_line_error(elasticd(proc_env, "report", "--state-dir", str(state)), 1, "no journal at")
    (state / "events.jsonl").symlink_to("/proc/self/mem")  # (reading it fails: EIO, even as root)
    one_line_error(elasticd(proc_env, "report", "--state-dir", str(state)), 2,
                   f"cannot read {state / 'events.jsonl'}: Input/output error")


def test_report_into_a_closed_pipe_ends_quietly(tmp_path, proc_env):
    state = tmp_path / "state"
    state.mkdir()
    lines = [{"ts": 0.0, "kind": "controller_started", "generation": 0}]
    for g in range(1, 3000):  # one incident per generation: a long report
        t = 10.0 * g
        lines += [{"ts": t, "kind": "generation_started", "generation": g, "hosts": ["h"]},
                  {"ts": t + 1, "kind": "first_progress", "generation": g, "step": g},
                  {"ts": t + 5, "kind": "worker_exited", "generation": g, "host": "h",
                   "reason": "crash", "step": g + 4},
                  {"ts": t + 6, "kind": "slice_stopping", "generation": g, "reason": "crash"},
                  {"ts": t + 7, "kind": "slice_stopped", "generation": g}]
    (state / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    out = subprocess.run(f"{sys.executable} -m elastic.cli report --state-dir {state} | head -1",
                         shell=True, env=proc_env, capture_output=True, text=True, timeout=60)
    assert out.stdout.startswith("wall time") and out.stderr == "", out.stderr


def test_agent_bad_inputs(tmp_path, proc_env, pki):
    base = [sys.executable, "-m", "elastic.agent.main", "--controller", "127.0.0.1:7470",
            "--state-dir", str(tmp_path / "agent")]
    allow = ["--allow-any-worker"]
    h0 = str(pki.host("h0").cert.parent)
    cases = [
        (["--host-id", "h0", "--stop-grace-s", "-1", *allow, "--insecure"],
         "--stop-grace-s must be from 0 to 3600"),
        (["--host-id", "h0", "--stop-grace-s", "inf", *allow, "--insecure"],
         "--stop-grace-s must be from 0 to 3600"),
        (["--host-id", "../h0", *allow, "--insecure"], "--host-id '../h0' is not valid"),
        (["--host-id", "h0", "--insecure"], "no --allow-worker"),
        (["--host-id", "h0", "--shared-compile-cache", "cache", *allow, "--insecure"],
         "--shared-compile-cache 'cache' is neither a gs://bucket[/prefix] URL nor an absolute"),
        (["--host-id", "h0", "--shared-compile-cache", "gs:///x", *allow, "--insecure"],
         "--shared-compile-cache 'gs:///x' names no bucket"),
        (["--host-id", "h0", "--shared-compile-cache", "gs://b/c", *allow, "--insecure"],
         "--shared-compile-cache needs --shared-compile-cache-key FILE"),
        (["--host-id", "h0", "--shared-compile-cache", "gs://b/c", "--shared-compile-cache-key",
          str(tmp_path / "no-key"), *allow, "--insecure"], "no-key: No such file"),
        (["--host-id", "h1", "--tls-dir", h0, *allow], "is for host h0; --host-id is h1"),
        (["--host-id", "h0", "--tls-dir", str(tmp_path / "none"), *allow], "no TLS directory"),
    ]
    for args, text in cases:
        out = subprocess.run([*base, *args], env=proc_env, capture_output=True, text=True,
                             timeout=30)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert text in out.stderr.splitlines()[-1], out.stderr
    controller_cert = str(pki.controller.cert.parent)
    out = subprocess.run([*base, "--host-id", "controller", "--tls-dir", controller_cert, *allow],
                         env=proc_env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "is a controller certificate" in out.stderr


def test_the_controller_journals_how_it_ends_and_ignores_sighup(tmp_path, proc_env, pki):
    state = tmp_path / "state"
    with reaped(subprocess.Popen(
            [sys.executable, "-m", "elastic.cli", "start", "--config", str(tiny_spec(tmp_path)),
             "--listen", "127.0.0.1:0", "--state-dir", str(state),
             "--tls-dir", str(pki.controller.cert.parent)],
            env=proc_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)) as proc:
        wait_until(lambda: (state / "controller.addr").exists(), 30, "the controller's address")
        proc.send_signal(signal.SIGHUP)

        def kinds():
            return [json.loads(line)["kind"] for line in
                    (state / "events.jsonl").read_text().splitlines()]
        wait_until(lambda: "sighup" in kinds(), 10, "the SIGHUP journal line")
        status = elasticd(proc_env, "status", "--state-dir", str(state), "--json",
                          "--tls-dir", str(pki.operator.cert.parent))
        assert status.returncode == 0 and json.loads(status.stdout)["jobId"] == "test"
        assert proc.poll() is None
        assert stop(proc, signal.SIGTERM) == 143
    assert kinds()[-1] == "controller_stopped"
    assert not (state / "controller.addr").exists()
    assert stat.S_IMODE(os.stat(state).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(state / "events.jsonl").st_mode) == 0o600


def test_a_controller_that_cannot_write_its_address_file_serves_all_the_same(
        tmp_path, proc_env, pki):
    """The address file only helps tools find the controller: one that
    cannot be written (a full disk; here a directory in its place) is an
    error in the log, not a start error. Before, the controller exited 2,
    which systemd does not restart: a full disk on host 0 ended the job at
    the controller's next restart (an audit found it)."""
    state = tmp_path / "state"
    (state / "controller.addr" / "x").mkdir(parents=True)
    log = tmp_path / "controller.log"
    with reaped(subprocess.Popen(
            [sys.executable, "-m", "elastic.cli", "start", "--config", str(tiny_spec(tmp_path)),
             "--listen", "127.0.0.1:0", "--state-dir", str(state),
             "--tls-dir", str(pki.controller.cert.parent)],
            env=proc_env, stdout=subprocess.DEVNULL, stderr=log.open("wb"))) as proc:
        def started():
            assert proc.poll() is None, log.read_text()[-2000:]
            journal = state / "events.jsonl"
            return journal.exists() and "controller_started" in journal.read_text()
        wait_until(started, 30, "controller_started")
        wait_until(lambda: "cannot write" in log.read_text(), 10, "the error line")
        assert stop(proc, signal.SIGTERM) == 143
    assert "will not find this controller" in log.read_text()


def test_insecure_mode_is_journaled(tmp_path, proc_env):
    state = tmp_path / "state"
    def journal():
        path = state / "events.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] \
            if path.exists() else []
    with reaped(subprocess.Popen(
            [sys.executable, "-m", "elastic.cli", "start", "--config", str(tiny_spec(tmp_path)),
             "--listen", "127.0.0.1:0", "--state-dir", str(state), "--insecure"],
            env=proc_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)) as proc:
        wait_until(lambda: any(e["kind"] == "waiting_for_hosts" for e in journal()), 30,
                   "the controller to wait for hosts")
        assert stop(proc, signal.SIGINT) == 130
    entries = journal()
    assert [e["kind"] for e in entries] == ["insecure_mode", "controller_started",
                                            "waiting_for_hosts", "controller_stopped"]
    assert "anyone who can reach the port" in entries[0]["reason"]


def test_a_crashed_controller_exits_70_not_the_failed_jobs_1(tmp_path, monkeypatch, caplog):
    """An unexpected error in the controller (a bug) exits CRASHED_EXIT, 70,
    which systemd and `elasticd local` restart; exit 1 says the job failed,
    which is final. (serve() journals the crash itself; this is the mapping
    to the exit code, so serve is replaced by one that raises.)"""
    from elastic import cli
    from elastic.controller import server

    async def crash(*args, **kwargs):
        raise KeyError("a bug")

    monkeypatch.setattr(server, "serve", crash)
    code = cli.main(["start", "--config", str(tiny_spec(tmp_path)), "--listen", "127.0.0.1:0",
                     "--state-dir", str(tmp_path / "state"), "--insecure"])
    assert code == server.CRASHED_EXIT == 70
    assert "the controller crashed" in caplog.text and "KeyError: 'a bug'" in caplog.text
