"""`elastic-agent`: the per-host agent (run it as a systemd unit)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import sys

from elastic.agent.agent import Agent, AgentSettings
from elastic.agent.host import default_address, discover_devices
from elastic.agent.logs import add_agent_log
from elastic.agent.preemption import GCE_METADATA_URL
from elastic.config import DEVICE_KIND, MAX_DEVICES_PER_HOST, MAX_STOP_GRACE_S

#: This host's certificate bundle unless told (as the systemd unit has it).
DEFAULT_TLS_DIR = "/etc/elastic/host"


def _check_shared_cache(parser: argparse.ArgumentParser, shared: str, key: str | None) -> None:
    """Exit 2 (parser.error) unless `shared` is gs://bucket[/prefix] or an
    absolute directory and `key` a usable signing key file."""
    from elastic.checkpoint.storage import StorageError
    from elastic.worker.compile_cache import CacheKeyError, read_signing_key

    if shared.startswith("gs://"):
        from elastic.checkpoint import gcs

        try:
            gcs.split(shared)
        except StorageError:
            parser.error(f"--shared-compile-cache {shared[:200]!r} names no bucket "
                         f"(gs://bucket[/prefix])")
    elif not os.path.isabs(shared):
        parser.error(f"--shared-compile-cache {shared[:200]!r} is neither a gs://bucket[/prefix] "
                     f"URL nor an absolute directory")
    if not key:
        parser.error("--shared-compile-cache needs --shared-compile-cache-key FILE: the secret "
                     "that signs its entries (e.g. head -c 32 /dev/urandom > FILE; chmod 600)")
    try:
        read_signing_key(key)
    except CacheKeyError as e:
        parser.error(str(e))


def parse_args(argv: list[str] | None = None) -> AgentSettings:
    """The agent's settings from its command line. Exits 2 with one line
    on a bad one (argparse's usage error): an invalid host id or address,
    a negative or infinite grace, a shared compile cache that is
    neither gs://bucket nor an absolute path or has no usable signing key,
    no allow-list, TLS files that cannot be
    used or whose certificate is not this host's."""
    from elastic.security.allow import AllowList
    from elastic.security.identity import Role, check_id
    from elastic.security.tls import TLSError, TLSFiles, load
    from elastic.transport import parse_address

    parser = argparse.ArgumentParser(
        prog="elastic-agent", description="Run one host of an elastic job: register with "
        "the controller, heartbeat, and run the worker it asks for (if this host's "
        "allow-list permits it). SIGTERM: preemption (emergency checkpoint, then leave; a "
        "second SIGTERM stops at once). SIGINT: stop now. SIGHUP: ignored.")
    parser.add_argument("--controller", required=True,
                        help="controller HOST:PORT; a leader and its standbys as a "
                             "comma-separated list (tried in turn)")
    parser.add_argument("--host-id", required=True,
                        help="this host's id, stable across restarts; must be the CN of its "
                             "certificate")
    parser.add_argument("--devices", type=int, default=None,
                        help="accelerator devices on this host, fixed (default: count the "
                             "device nodes under --device-dir, never opening them, again at "
                             "every heartbeat; 1 when there are none)")
    parser.add_argument("--device-dir", default="/dev",
                        help="where to count device nodes: accel<n>, vfio/<n>, nvidia<n> "
                             "(default %(default)s)")
    parser.add_argument("--device-kind", default=None,
                        help="what kind of device this host has, e.g. 'tpu-v5e' (default: "
                             "'tpu', the NVIDIA driver's model name, or 'cpu'); a slice runs "
                             "on one kind")
    parser.add_argument("--address", default=None,
                        help="address peers reach this host at (default: the hostname's)")
    parser.add_argument("--listen", default=None, metavar="HOST:PORT",
                        help="serve grpc.health.v1 and reflection on this port (mutual TLS "
                             "with this host's certificate, server name elastic-host; port 0 "
                             "picks one, reported to the controller)")
    parser.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                        help="serve Prometheus metrics on this port of the --listen host (or "
                             "--address): HTTPS with client certificates of the job's CA")
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
    parser.add_argument("--shared-compile-cache", default=None, metavar="URL",
                        help="an executable cache the job's hosts share, looked in after "
                             "--compile-cache-dir: gs://bucket/prefix (e.g. beside the "
                             "checkpoints) or a directory on a common filesystem; a slice "
                             "shape is then compiled once for all hosts, and a new job of the "
                             "same program starts warm. Only where whoever can write there is "
                             "trusted to run code on this host (default: none)")
    parser.add_argument("--shared-compile-cache-key", default=None, metavar="FILE",
                        help="the secret (a file of at least 32 bytes, mode 0600, the same on "
                             "every host of the job) that signs the shared cache's entries: "
                             "one written by anyone without it is never loaded; required with "
                             "--shared-compile-cache")
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
    parser.add_argument("--tls-dir", default=DEFAULT_TLS_DIR,
                        help="this host's certificate bundle: ca.pem, cert.pem, key.pem (or "
                             "ca.crt, tls.crt, tls.key); default %(default)s")
    parser.add_argument("--insecure", action="store_true",
                        help="plaintext gRPC: trust whatever answers at --controller")
    parser.add_argument("--allow-worker", action="append", default=[], metavar="HEAD",
                        help="a worker command this host may run: program [script | -m module] "
                             "as shell-style patterns, e.g. '/opt/venv/bin/python "
                             "/srv/jobs/*/train.py' (repeatable)")
    parser.add_argument("--allow-workdir", action="append", default=[], metavar="PATTERN",
                        help="working directories allowed for `python -m` workers (repeatable)")
    parser.add_argument("--allow-env", action="append", default=[], metavar="NAME",
                        help="a variable (pattern) the job's environment may set; it may "
                             "set no other but the controller's own ELASTIC_* job variables "
                             "(e.g. XLA_FLAGS or 'WANDB_*'; repeatable)")
    parser.add_argument("--allow-any-worker", action="store_true",
                        help="run any program the controller sends (trusted setups only)")
    args = parser.parse_args(argv)
    try:
        check_id(args.host_id, "--host-id")
        if args.job_id:
            check_id(args.job_id, "--job-id")
        if args.failure_domain:
            check_id(args.failure_domain, "--failure-domain")
        for address in args.controller.split(","):
            parse_address(address.strip(), "--controller")
        if args.listen is not None:
            parse_address(args.listen, "--listen", allow_port_zero=True)
        if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
            raise ValueError(f"--metrics-port must be from 0 to 65535, got {args.metrics_port}")
        allow = AllowList.parse(args.allow_worker, args.allow_workdir, args.allow_env,
                                args.allow_any_worker)
    except ValueError as e:
        parser.error(str(e))
    if args.devices is not None and not 1 <= args.devices <= MAX_DEVICES_PER_HOST:
        parser.error(f"--devices must be from 1 to {MAX_DEVICES_PER_HOST}, got {args.devices}")
    if args.device_kind is not None and not DEVICE_KIND.fullmatch(args.device_kind):
        parser.error(f"--device-kind {args.device_kind[:80]!r} is not a device kind (1 to 64 "
                     f"letters, digits, spaces and ._()+-)")
    if not (math.isfinite(args.stop_grace_s) and 0 <= args.stop_grace_s <= MAX_STOP_GRACE_S):
        parser.error(f"--stop-grace-s must be from 0 to {MAX_STOP_GRACE_S:g} seconds, got "
                     f"{args.stop_grace_s}")
    if not (math.isfinite(args.preemption_grace_s) and 0 < args.preemption_grace_s <= 3600):
        parser.error(f"--preemption-grace-s must be from 0 to 3600 seconds, got "
                     f"{args.preemption_grace_s}")
    shared = args.shared_compile_cache
    if shared is not None:
        _check_shared_cache(parser, shared, args.shared_compile_cache_key)
    if not allow.workers and not allow.any_worker:
        parser.error("no --allow-worker: this agent would refuse every worker; name what it "
                     "may run (--allow-worker '/opt/venv/bin/python /srv/job/train.py') or pass "
                     "--allow-any-worker")
    tls = None
    if not args.insecure:
        try:
            tls = TLSFiles.in_dir(args.tls_dir)
            identity = load(tls, (Role.HOST,)).identity
        except TLSError as e:
            parser.error(str(e))
        if identity.name != args.host_id:
            parser.error(f"the certificate in {args.tls_dir} is for host {identity.name}; "
                         f"--host-id is {args.host_id}")
    found = discover_devices(args.device_dir)
    return AgentSettings(
        controller=args.controller, host_id=args.host_id,
        devices=args.devices or found.count, device_kind=args.device_kind or found.kind,
        device_dir=None if args.devices else args.device_dir,
        address=args.address or default_address(),
        failure_domain=args.failure_domain or args.host_id, state_dir=args.state_dir, tls=tls,
        allow=allow, job_id=args.job_id, stop_grace_s=args.stop_grace_s,
        metadata_url=args.gce_metadata, preemption_grace_s=args.preemption_grace_s,
        snapshot_dir=args.snapshot_dir, compile_cache_dir=args.compile_cache_dir,
        shared_compile_cache=args.shared_compile_cache,
        shared_compile_cache_key=args.shared_compile_cache_key and
        os.path.abspath(args.shared_compile_cache_key),
        listen=args.listen, metrics_port=args.metrics_port)


def main(argv: list[str] | None = None) -> int:
    settings = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s agent[{settings.host_id}] %(levelname)s %(message)s")
    log = logging.getLogger("elastic-agent")
    if settings.tls is None:
        log.warning("INSECURE: plaintext gRPC; this agent obeys whatever answers at %s",
                    settings.controller)
    for warning in settings.allow.warnings():
        log.warning("%s", warning)
    try:
        agent = Agent(settings)
        agent.prepare()
        add_agent_log(settings.state_dir, log)  # served by elasticd logs (elastic.agent.logs)
    except OSError as e:
        print(f"elastic-agent: error: {e}", file=sys.stderr)
        return 2
    try:
        asyncio.run(agent.run())
    except (RuntimeError, OSError, ValueError) as e:  # a port that cannot be served
        print(f"elastic-agent: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
