"""The controllers of a local slice: start one (and a standby), kill one as
a crash would, start it again as systemd would, and tell from their exits
how the job ended.

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

from elastic.chaos import CONTROLLER_RESTART_S
from elastic.controller.journal import JOURNAL_NAME
from elastic.controller.server import ADDRESS_FILE
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


def spawn_controller(argv: list[str], state_dir: pathlib.Path,
                     env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    """Start the controller (bound to this process) and wait for the
    address it listens at. Raises RuntimeError when it exits or does not
    listen within 30 s (its log says why)."""
    (state_dir / ADDRESS_FILE).unlink(missing_ok=True)  # a killed one's is stale
    log = open_private(state_dir / "controller.log", "ab")
    controller = spawn_bound(argv, stdout=log, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, env=env)
    log.close()
    address = _wait_for_address(state_dir, controller, 30.0)
    if address is None:
        controller.kill()
        controller.wait()
        raise RuntimeError(f"the controller did not start; see {state_dir / 'controller.log'}")
    return controller, address


def spawn_standby(argv: list[str], state_dir: pathlib.Path,
                  env: dict[str, str]) -> subprocess.Popen:
    """Start a standby controller (it writes no address until it leads)."""
    log = open_private(state_dir / "controller.log", "ab")
    proc = spawn_bound(argv, stdout=log, stderr=subprocess.STDOUT,
                       stdin=subprocess.DEVNULL, env=env)
    log.close()
    return proc


def controller_running(local: LocalSlice) -> bool:
    """Whether the job still has a controller: one alive (the leader, or a
    standby that will take over), or one being started again."""
    return local.controller_away or any(
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


def _shares_state_dir(local: LocalSlice) -> bool:
    """Whether the standby waits on the leader's state directory (its lock)
    rather than on the bucket lease (a state directory of its own)."""
    def state_dir(argv: list[str]) -> str:
        return argv[argv.index("--state-dir") + 1]
    return state_dir(local.standby_argv) == state_dir(local.controller_argv)


def kill_controller(local: LocalSlice) -> tuple[int, str]:
    """SIGKILL the controller (a crash, an OOM kill); returns its pid and
    what happens next (for the journal).
    With a standby on the same state directory, the standby becomes the
    controller the run waits on (it takes over at once) and the killed one
    comes back as the new standby (`restart_controller`). Otherwise the
    controller is away until `restart_controller` starts it again, and a
    standby that shares only the bucket waits on (see the module
    docstring)."""
    killed = local.controller
    if local.standby is not None and local.standby.poll() is None and \
            _shares_state_dir(local):
        local.controller, local.standby = local.standby, killed
        local.controller_argv, local.standby_argv = (
            [a for a in local.standby_argv if a != "--standby"],
            local.controller_argv + ["--standby"])
        local.address, local.standby_address = local.standby_address, local.address
        then = (f"the standby takes over; the killed one comes back as the standby in "
                f"{CONTROLLER_RESTART_S:g} s")
    else:
        local.controller_away = True
        then = f"it starts again in {CONTROLLER_RESTART_S:g} s"
        if local.standby is not None:
            then += " and takes its bucket lease back before the standby may"
    killed.kill()
    killed.wait()
    return killed.pid, then


def restart_controller(local: LocalSlice) -> None:
    """Start the killed controller again with the same command line (spec,
    address, state directory), as systemd's Restart=always would; it adopts
    the running slice (elastic.policy.adopt), or, after a swap with a
    standby on the same state directory, waits as the new standby. Raises
    RuntimeError when it does not start."""
    env = {**child_env(), **local.extra_env}
    if not local.controller_away:  # (swapped: it comes back as the standby)
        local.standby = spawn_standby(local.standby_argv, local.state_dir, env)
        write_local_file(local)
        return
    try:
        local.controller, _ = spawn_controller(local.controller_argv, local.state_dir, env)
    finally:  # (if it did not start, the run ends with the dead one's code)
        local.controller_away = False
    write_local_file(local)


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
