"""`elastic-agent`: the per-host agent (run it as a systemd unit)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from elastic.agent.agent import Agent, AgentSettings
from elastic.agent.host import default_address, discover_devices
from elastic.agent.preemption import GCE_METADATA_URL


def parse_args(argv: list[str] | None = None) -> AgentSettings:
    """The agent's settings from its command line (argparse exits 2 on a
    bad one, e.g. --devices 0)."""
    parser = argparse.ArgumentParser(
        prog="elastic-agent", description="Run one host of an elastic job: register with "
        "the controller, heartbeat, and run the worker it asks for. SIGTERM: preemption "
        "(emergency checkpoint, then leave; a second SIGTERM stops at once). SIGINT: stop "
        "now.")
    parser.add_argument("--controller", required=True, help="controller HOST:PORT")
    parser.add_argument("--host-id", required=True, help="this host's id, stable across restarts")
    parser.add_argument("--devices", type=int, default=None,
                        help="accelerator devices on this host (default: count device nodes, "
                             "never opening them; 1 when there are none)")
    parser.add_argument("--address", default=None,
                        help="address peers reach this host at (default: the hostname's)")
    parser.add_argument("--failure-domain", default=None,
                        help="hosts sharing a failure domain fail together (default: host id)")
    parser.add_argument("--state-dir", default="/var/lib/elastic-agent",
                        help="directory of this agent's state (default %(default)s)")
    parser.add_argument("--snapshot-dir", default=None,
                        help="where the worker keeps local snapshots of its last steps; wiped "
                             "when the agent starts and stops (default: a directory in "
                             "/dev/shm, i.e. host memory, else STATE_DIR/snapshots)")
    parser.add_argument("--compile-cache-dir", default=None,
                        help="where workers keep compiled executables across restarts; hosts "
                             "of one machine type (same CPU, same software) may share one "
                             "directory, and only ones that trust each other: loading an "
                             "entry runs its code (default: STATE_DIR/compile-cache)")
    parser.add_argument("--job-id", default="", help="refuse a controller of another job")
    parser.add_argument("--stop-grace-s", type=float, default=5.0,
                        help="seconds between SIGTERM and SIGKILL of the worker when the "
                             "agent stops (default %(default)s)")
    parser.add_argument("--gce-metadata", nargs="?", const=GCE_METADATA_URL, default=None,
                        metavar="URL", help="watch the GCE metadata server for preemption and "
                        f"maintenance notices (default URL {GCE_METADATA_URL})")
    parser.add_argument("--preemption-grace-s", type=float, default=25.0,
                        help="after a preemption notice, stop the worker hard after this "
                             "long (default %(default)s; GCE gives spot VMs 30 s)")
    args = parser.parse_args(argv)
    if args.devices is not None and args.devices < 1:
        parser.error(f"--devices must be at least 1, got {args.devices}")
    return AgentSettings(
        controller=args.controller, host_id=args.host_id,
        devices=args.devices or discover_devices(), address=args.address or default_address(),
        failure_domain=args.failure_domain or args.host_id, state_dir=args.state_dir,
        job_id=args.job_id, stop_grace_s=args.stop_grace_s, metadata_url=args.gce_metadata,
        preemption_grace_s=args.preemption_grace_s, snapshot_dir=args.snapshot_dir,
        compile_cache_dir=args.compile_cache_dir)


def main(argv: list[str] | None = None) -> int:
    settings = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s agent[{settings.host_id}] %(levelname)s %(message)s")
    import os
    os.makedirs(settings.state_dir, exist_ok=True)
    asyncio.run(Agent(settings).run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
