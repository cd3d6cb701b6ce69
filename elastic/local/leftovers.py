"""What a local run leaves if its runner is killed, and its removal.

The runner's children die with it (PR_SET_PDEATHSIG, elastic.procs), and so
do their workers (the agents set the same on them). What cannot die with a
process is recorded in `<state-dir>/leftovers.json` before it is made: the
network of an isolated run (namespaces, bridge, links; elastic.local.network)
and the runner's pid. `cleanup` removes all of it, and whatever processes of
the run still live (an agent `elasticd chaos` started again, in a session
of its own); `elasticd local` calls it before every run in the same state
directory and `elasticd local --cleanup` on its own.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal

from elastic.agent import snapshot_dir
from elastic.agent.supervisor import kill_leftovers
from elastic.local import network
from elastic.procs import alive, signal_pid
from elastic.security.files import write_private

RECORD = "leftovers.json"
LOCAL_FILE = "local.json"


class StillRunning(RuntimeError):
    """The run recorded in the state directory is still alive."""


def record(state_dir: pathlib.Path, plan: network.NetworkPlan | None) -> None:
    """Record this process as the run's runner, and `plan`'s network (None:
    not isolated), in STATE_DIR/leftovers.json (0600). Raises OSError when
    it cannot be written."""
    data = {"runner_pid": os.getpid(), "network": plan.to_json() if plan else None}
    write_private(state_dir / RECORD, json.dumps(data, indent=2).encode())


def _is_ours(pid: int) -> bool:
    try:
        cmdline = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"elastic" in cmdline and alive(pid)


def _run_pids(state_dir: pathlib.Path) -> list[int]:
    try:
        info = json.loads((state_dir / LOCAL_FILE).read_text())
    except (OSError, ValueError):
        return []
    pids = [info.get("controller_pid")] + [a.get("pid") for a in info.get("agents", {}).values()]
    return [p for p in pids if isinstance(p, int) and p > 0]


def agent_state_dirs(state_dir: pathlib.Path) -> list[pathlib.Path]:
    """Every agent state directory a local run in `state_dir` may have used
    (shared: agents/<host>; isolated: hosts/<host>/agent)."""
    return sorted(state_dir.glob("agents/*")) + sorted(state_dir.glob("hosts/*/agent"))


def remove_snapshot_dirs(state_dir: pathlib.Path) -> list[str]:
    """Remove the snapshot directories that the agents of a run in
    `state_dir` recorded and did not remove (killed, or not started again):
    shared hosts keep them in the machine's /dev/shm; an isolated host's
    went with its mount namespace. Returns the hosts whose directory went;
    one that cannot be removed is skipped."""
    removed = []
    for agent_dir in sorted(state_dir.glob("agents/*")):
        if (agent_dir / snapshot_dir.RECORD).exists():
            try:
                snapshot_dir.remove_recorded(agent_dir)
            except OSError:
                continue
            removed.append(agent_dir.name)
    return removed


def cleanup(state_dir: pathlib.Path) -> list[str]:
    """Remove what a run in `state_dir` left: its processes (SIGKILL), the
    processes inside its namespaces, its network, the snapshot directories
    its agents recorded. Returns one line per thing removed. Raises
    StillRunning when the recorded runner is alive (and is not this process)."""
    state_dir = pathlib.Path(state_dir).resolve()
    try:
        data = json.loads((state_dir / RECORD).read_text())
    except (OSError, ValueError):
        data = {}
    runner = data.get("runner_pid")
    if isinstance(runner, int) and runner != os.getpid() and _is_ours(runner):
        raise StillRunning(f"elasticd local (pid {runner}) is still running in {state_dir}; "
                           f"stop it first")
    removed = []
    for pid in _run_pids(state_dir):
        if _is_ours(pid) and signal_pid(pid, signal.SIGKILL):
            removed.append(f"process {pid}")
    for agent_dir in agent_state_dirs(state_dir):
        removed += [f"worker process {pid}" for pid in kill_leftovers(str(agent_dir), "")]
    plan = network.NetworkPlan.from_json(data["network"]) if data.get("network") else None
    if plan is not None:
        for pid in network.namespace_pids(plan):
            if signal_pid(pid, signal.SIGKILL):
                removed.append(f"process {pid} in a namespace of the run")
        if network.exists(plan):
            left = network.destroy(plan)
            if left:
                raise network.IsolationError(f"could not remove {', '.join(left)}")
            removed.append(f"network {plan.prefix}.0/24 (bridge {plan.bridge}, "
                           f"{len(plan.nodes)} namespaces)")
    removed += [f"snapshot directory of {host}" for host in remove_snapshot_dirs(state_dir)]
    (state_dir / RECORD).unlink(missing_ok=True)
    return removed
