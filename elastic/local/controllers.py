"""The controllers of a local slice: start one (and a standby), kill one as
a crash would, start it again as systemd would, and tell from their exits
how the job ended.

A controller that exits with a code systemd's unit restarts (any but
FINAL_EXITS: stepped down, crashed, killed) is started again after
CONTROLLER_RESTART_S, with the same command line (`ControllerRestarts`),
as the unit's Restart=always would.

Two ways a standby shares the job (elastic.controller.server.serve):
- a shared state directory (checkpoints on a local disk): the standby waits
  for the lock on it, so a killed leader is replaced at once; the killed
  one comes back as the next standby;
- only the bucket (checkpoints in gs://): the standby has a state directory
  of its own (`STANDBY_DIR`) and takes the lease on the journal object once
  it has gone unrenewed for `health.leader_lease_s`. A leader started again
  on its own state directory takes its lease back at once, before the
  standby may: a killed leader restarted after CONTROLLER_RESTART_S (2 s)
  leads again, and the standby stays the standby.
"""

from __future__ import annotations

import dataclasses
import pathlib
import subprocess
import time
from collections.abc import Callable

from elastic.chaos import CONTROLLER_RESTART_S
from elastic.controller.journal import JOURNAL_NAME
from elastic.controller.server import ADDRESS_FILE, FINAL_EXITS
from elastic.local.slice import LocalSlice, child_env, write_local_file
from elastic.procs import spawn_bound
from elastic.security.files import open_private

#: The state dir of a standby controller that shares only the bucket.
STANDBY_DIR = "standby"


def _wait_for_address(state_dir: pathlib.Path, controller: subprocess.Popen,
                      timeout_s: float) -> str | None:
    path = state_dir / ADDRESS_FILE
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            return path.read_text().strip()
        if controller.poll() is not None:
            return None
        time.sleep(0.02)
    return None


def launch_controller(argv: list[str], state_dir: pathlib.Path,
                      env: dict[str, str]) -> subprocess.Popen:
    """Start a controller (bound to this process), its output appended to
    STATE_DIR/controller.log, without waiting for it to listen (a standby
    writes no address until it leads). Raises OSError when it cannot be
    started (the log cannot be opened, the program not executed)."""
    log = open_private(state_dir / "controller.log", "ab")
    proc = spawn_bound(argv, stdout=log, stderr=subprocess.STDOUT,
                       stdin=subprocess.DEVNULL, env=env)
    log.close()
    return proc


def spawn_controller(argv: list[str], state_dir: pathlib.Path,
                     env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    """Start the controller (bound to this process) and wait for the
    address it listens at. Raises RuntimeError when it exits or does not
    listen within 30 s (its log says why)."""
    (state_dir / ADDRESS_FILE).unlink(missing_ok=True)  # a killed one's is stale
    controller = launch_controller(argv, state_dir, env)
    address = _wait_for_address(state_dir, controller, 30.0)
    if address is None:
        controller.kill()
        controller.wait()
        raise RuntimeError(f"the controller did not start; see {state_dir / 'controller.log'}")
    return controller, address


def controller_running(local: LocalSlice) -> bool:
    """Whether the job still has a controller: one alive (the leader, or a
    standby that will take over), or one being started again."""
    return local.controller_away or local.standby_away or any(
        p is not None and p.poll() is None for p in (local.controller, local.standby))


def job_code(local: LocalSlice) -> int | None:
    """The job's exit code once no controller runs: the leader's, or the
    standby's when the leader was killed (a standby that takes over an ended
    job exits with its code); None while one runs."""
    codes = [p.poll() for p in (local.controller, local.standby) if p is not None]
    if any(c is None for c in codes):
        return None
    return next((c for c in codes if c in (0, 1)), codes[0])  # (3: a deposed leader)


def journal_dir(state_dir: pathlib.Path) -> pathlib.Path:
    """Where the job's journal is whole: the state dir, or a standby's own
    (when controllers share only the bucket, the one that led last holds
    all of it)."""
    dirs = [state_dir, state_dir / STANDBY_DIR]
    return max((d for d in dirs if (d / JOURNAL_NAME).exists()),
               key=lambda d: (d / JOURNAL_NAME).stat().st_size, default=state_dir)


def _leader_gone(local: LocalSlice) -> str:
    """Mark the leader's process as gone (killed, or exited for a restart)
    until `restart_controller`; returns what happens next, for the journal.
    With a live standby on the same state directory, the standby becomes
    the controller the run waits on (it takes the lock at once) and the
    gone one comes back as the new standby. Otherwise the controller is
    away until started again, and a standby that shares only the bucket
    waits on (see the module docstring)."""
    if local.standby is not None and local.standby.poll() is None and \
            local.standby_shares_state_dir:
        gone = local.controller
        local.controller, local.standby = local.standby, gone
        local.controller_argv, local.standby_argv = (
            [a for a in local.standby_argv if a != "--standby"],
            local.controller_argv + ["--standby"])
        local.address, local.standby_address = local.standby_address, local.address
        local.standby_away = True
        return (f"the standby takes over; the old leader comes back as the standby in "
                f"{CONTROLLER_RESTART_S:g} s")
    local.controller_away = True
    then = f"it starts again in {CONTROLLER_RESTART_S:g} s"
    if local.standby is not None:
        then += " and takes its bucket lease back before the standby may"
    return then


def kill_controller(local: LocalSlice) -> tuple[int, str]:
    """SIGKILL the controller (a crash, an OOM kill); returns its pid and
    what happens next (for the journal; see `_leader_gone`). The caller
    starts it again (`restart_controller`) after CONTROLLER_RESTART_S."""
    with local.controllers_lock:
        killed = local.controller
        then = _leader_gone(local) if not local.controller_away else "it starts again"
        killed.kill()
        killed.wait()
    return killed.pid, then


def restart_controller(local: LocalSlice) -> None:
    """Start every controller that is away (killed, or exited with a code
    systemd restarts) again with the same command line (spec, address,
    state directory), as systemd's Restart=always would: a leader adopts
    the running slice (elastic.policy.adopt), a leader swapped out for the
    standby waits as the new standby. Does not wait for the leader to listen
    (a controller restarted during a bucket outage waits for the bucket
    first). Nothing is done when none is away. Raises OSError when one
    cannot be started (launch_controller)."""
    env = {**child_env(), **local.extra_env}
    with local.controllers_lock:
        if local.standby_away:
            local.standby = launch_controller(local.standby_argv, local.state_dir, env)
            local.standby_away = False
        if local.controller_away:
            (local.state_dir / ADDRESS_FILE).unlink(missing_ok=True)  # the gone one's
            local.controller = launch_controller(local.controller_argv, local.state_dir, env)
            local.controller_away = False
        write_local_file(local)


def restarts_after(code: int | None) -> bool:
    """Whether a controller whose process ended with `code`
    (Popen.returncode: None while it runs, -N after signal N) is started
    again, as the unit's RestartPreventExitStatus decides: any code but
    FINAL_EXITS (0 succeeded, 1 failed, 2 refused to start)."""
    return code is not None and code not in FINAL_EXITS


@dataclasses.dataclass
class ControllerRestarts:
    """Starts the controllers of `local` again as systemd's unit would: a
    leader or standby that exits with a code `restarts_after` accepts (3
    stepped down, 70 crashed, a signal) is started again
    CONTROLLER_RESTART_S later. `poll()` is called by the launcher's loop;
    `clock`: monotonic seconds."""

    local: LocalSlice
    clock: Callable[[], float] = time.monotonic
    due: float | None = None  # when the controllers away are started again

    def poll(self) -> list[str]:
        """Notice exits and start what is due; returns what it did, one
        line each, for the launcher to print."""
        local, lines = self.local, []
        with local.controllers_lock:  # (the fault injector kills and restarts them too)
            if not local.controller_away and restarts_after(code := local.controller.poll()):
                then = _leader_gone(local)
                lines.append(f"the controller exited with code {code}; {then}, as systemd "
                             f"would")
            standby = local.standby
            if standby is not None and not local.standby_away and \
                    restarts_after(code := standby.poll()):
                local.standby_away = True
                lines.append(f"the standby controller exited with code {code}; it starts "
                             f"again in {CONTROLLER_RESTART_S:g} s, as systemd would")
            if lines and self.due is None:
                self.due = self.clock() + CONTROLLER_RESTART_S
            if self.due is not None and self.clock() >= self.due:
                self.due = None
                restart_controller(local)
        return lines


def start_next_job(local: LocalSlice, spec_path: str,
                   checkpoint_dir: str | None = None) -> LocalSlice:
    """Start the controller of another job (`spec_path`; checkpoints in
    `checkpoint_dir`, else where its spec says) at the address of `local`'s
    controller, with its certificate and state directory (its journal then
    holds both jobs, as a deployment's /var/lib/elasticd does), once that
    one has exited: `local`'s agents (started with `pin_job=False`)
    register with it as a deployment's agents do when the next job begins.
    Returns the new job's LocalSlice (same agents). Raises RuntimeError
    when `local`'s controller still runs or the new one does not start,
    ValueError when `local` has a standby (not carried over)."""
    if local.standby is not None:
        raise ValueError("the next job of a slice with a standby controller is not supported")
    if controller_running(local):
        raise RuntimeError("the previous job's controller still runs")
    argv = list(local.controller_argv)
    argv[argv.index("--config") + 1] = spec_path
    if "--checkpoint-dir" in argv:  # (the job before's)
        at = argv.index("--checkpoint-dir")
        del argv[at:at + 2]
    if checkpoint_dir:
        argv += ["--checkpoint-dir", checkpoint_dir]
    controller, address = spawn_controller(argv, local.state_dir,
                                           {**child_env(), **local.extra_env})
    following = dataclasses.replace(local, controller=controller, address=address,
                                    controller_argv=argv)
    write_local_file(following)
    return following
