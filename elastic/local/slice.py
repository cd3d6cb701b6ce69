"""What `elasticd local` started (`LocalSlice`), the environment its
processes get, and `local.json`, the file that tells tools and tests about
them (written atomically, 0600)."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import threading

from elastic.local import leftovers
from elastic.local.network import NetworkPlan
from elastic.security.files import write_private
from elastic.security.tls import TLSFiles

LOCAL_FILE = leftovers.LOCAL_FILE


@dataclasses.dataclass
class LocalSlice:
    """What `run_local` started: controller and agents (subprocess.Popen);
    `tls`: the operator bundle for status calls (None with --insecure)."""

    state_dir: pathlib.Path
    controller: subprocess.Popen
    address: str
    agents: dict[str, subprocess.Popen]
    agent_argv: dict[str, list[str]]
    tls: TLSFiles | None
    heartbeat_timeout_s: float = 5.0
    # variables added to every process's environment (a GCS emulator's)
    extra_env: dict[str, str] = dataclasses.field(default_factory=dict)
    # isolated hosts: the network they live on (None: the root namespace)
    network: NetworkPlan | None = None
    # the controller's command line, listening at `address` (for restarts)
    controller_argv: list[str] = dataclasses.field(default_factory=list)
    # True from the controller's end (chaos: kill-controller; an exit systemd
    # would restart) until its restart (elastic.local.controllers)
    controller_away: bool = False
    # the same for the standby (a killed leader that comes back as the standby)
    standby_away: bool = False
    # held while the controllers are killed, noticed gone or started again
    # (elasticd local's loop and its fault injector's thread both do)
    controllers_lock: threading.RLock = dataclasses.field(default_factory=threading.RLock)
    # a standby controller (elasticd start --standby) and its command line
    standby: subprocess.Popen | None = None
    standby_argv: list[str] = dataclasses.field(default_factory=list)
    # the standby's address (it writes no address file until it leads)
    standby_address: str = ""
    # whether the standby waits on the leader's state directory (its lock;
    # then the two swap places when the leader goes) rather than on the
    # bucket lease, with a state directory of its own
    standby_shares_state_dir: bool = False
    # what the agents are given: the controller's address, and the standby's
    addresses: str = ""


def child_env() -> dict[str, str]:
    """The environment for agents (and so workers) of a local slice."""
    from elastic.worker_env import environ_snapshot

    env = environ_snapshot()
    # Workers run with this interpreter's environment ("python" in a job's
    # command is the one that runs elasticd).
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def write_local_file(local: LocalSlice) -> None:
    """Write `<state-dir>/local.json` atomically (0600): controller address
    and pid, each agent's pid and command line (read by `elasticd chaos` and
    tests)."""
    info = {"controller": local.address, "controller_pid": local.controller.pid,
            "launcher_pid": os.getpid(), "heartbeat_timeout_s": local.heartbeat_timeout_s,
            "extra_env": local.extra_env,
            "agents": {h: {"pid": p.pid, "argv": local.agent_argv[h]}
                       for h, p in local.agents.items()}}
    write_private(local.state_dir / LOCAL_FILE, json.dumps(info, indent=2).encode())
