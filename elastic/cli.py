"""`elasticd`: start | status | report | local | chaos | certs.

Exit codes: 0 job succeeded, 1 job failed (or status could not reach the
controller), 2 bad command line, job spec or TLS files (nothing was
started), 128 + N stopped by signal N (130 SIGINT, 143 SIGTERM).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import math
import os
import pathlib
import signal
import sys

import grpc

from elastic.config import SpecError, load_spec

DEFAULT_STATE_DIR = "elastic-state"
#: Where elasticd looks for its certificate bundle unless told: the
#: controller's (start) and an operator's (status), as the systemd units and
#: `elasticd certs` lay them out.
CONTROLLER_TLS_DIR = "/etc/elastic/controller"
OPERATOR_TLS_DIR = "/etc/elastic/operator"
#: The bundle `elasticd local` issues for its own status calls.
LOCAL_OPERATOR_BUNDLE = pathlib.Path("tls") / "operators" / "local"


class UsageError(Exception):
    """A bad command line; main() prints it on one line and exits 2."""


def _tls_args(parser: argparse.ArgumentParser, default_help: str) -> None:
    parser.add_argument("--tls-dir", metavar="DIR",
                        help=f"certificate bundle: ca.pem, cert.pem, key.pem (or cert-manager's "
                             f"ca.crt, tls.crt, tls.key); default {default_help}")
    parser.add_argument("--insecure", action="store_true",
                        help="plaintext gRPC, no authentication (journaled; never on a network "
                             "others can reach)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="elasticd", description="Fault-tolerant elastic "
                                     "training for multi-host JAX: the controller.")
    sub = parser.add_subparsers(dest="command", required=True)
    start = sub.add_parser("start", help="run the controller of one job")
    start.add_argument("--config", required=True, help="job spec (TOML)")
    start.add_argument("--listen", default="0.0.0.0:7470", help="HOST:PORT (default %(default)s)")
    start.add_argument("--state-dir", default=DEFAULT_STATE_DIR,
                       help="journal and state (default ./%(default)s)")
    start.add_argument("--checkpoint-dir", metavar="DIR_OR_URL",
                       help="the job's checkpoint directory, local or gs://bucket/prefix, "
                            "instead of job.checkpoint_dir")
    start.add_argument("--standby", action="store_true",
                       help="wait while another controller leads the job in --state-dir, "
                            "then take over and adopt its slice (agents list both "
                            "addresses: --controller LEADER,STANDBY)")
    start.add_argument("--metrics-port", type=port_number, metavar="PORT",
                       help="serve Prometheus metrics on this port of the --listen host "
                            "(HTTPS with client certificates of the job's CA; plain HTTP "
                            "with --insecure)")
    start.add_argument("--expect-hosts", type=host_count, metavar="N",
                       help="the first generation waits for N hosts to register, at most "
                            "30 s (instead of health.expected_hosts)")
    _tls_args(start, CONTROLLER_TLS_DIR + " (a controller certificate)")

    status = sub.add_parser("status", help="show a running job")
    status.add_argument("--json", action="store_true", help="JSON instead of a table")
    status.add_argument("--controller", help="HOST:PORT (default: from the state dir)")
    status.add_argument("--state-dir", default=DEFAULT_STATE_DIR)
    _tls_args(status, f"STATE_DIR/{LOCAL_OPERATOR_BUNDLE} if there (elasticd local), else "
                      f"{OPERATOR_TLS_DIR} (an operator or controller certificate)")

    logs = sub.add_parser("logs", help="the workers' and agents' output, from the agents")
    logs.add_argument("--host", help="only this host (default: every registered host)")
    logs.add_argument("--generation", type=int, default=0,
                      help="only this generation's worker output (default: all the hosts keep)")
    logs.add_argument("--follow", "-f", action="store_true",
                      help="then print what is written, until Ctrl-C")
    logs.add_argument("--tail-bytes", type=int, default=0, metavar="N",
                      help="bytes from the end of each file (default 64 KiB, at most 16 MiB)")
    logs.add_argument("--no-agent", action="store_true", help="leave out the agents' own logs")
    logs.add_argument("--controller", help="HOST:PORT (default: from the state dir)")
    logs.add_argument("--state-dir", default=DEFAULT_STATE_DIR)
    _tls_args(logs, f"STATE_DIR/{LOCAL_OPERATOR_BUNDLE} if there (elasticd local), else "
                    f"{OPERATOR_TLS_DIR} (an operator certificate)")

    report = sub.add_parser("report", help="goodput of a finished or running job")
    report.add_argument("--state-dir", default=DEFAULT_STATE_DIR)
    report.add_argument("--json", action="store_true", help="JSON instead of a table")
    report.add_argument("--plot", metavar="FILE.png",
                        help="also draw the timeline (generations, hosts, steps, step rate, "
                             "incidents, badput by cause) into this PNG (needs matplotlib: "
                             "the plot extra)")

    chaos = sub.add_parser("chaos", help="random faults on a running `elasticd local` slice")
    chaos.add_argument("--state-dir", default=DEFAULT_STATE_DIR)
    chaos.add_argument("--chaos", required=True, metavar="SPEC",
                       help="e.g. mtbf=60,seed=1,kinds=all,count=5 (see elastic.chaos)")
    chaos.add_argument("--duration-s", type=float, default=None,
                       help="stop after this long (default: until Ctrl-C or count faults)")
    _tls_args(chaos, f"STATE_DIR/{LOCAL_OPERATOR_BUNDLE}")

    local = sub.add_parser("local", help="controller and N simulated hosts on this machine")
    local.add_argument("--config", help="job spec (TOML); required but with --cleanup")
    local.add_argument("--hosts", type=int, default=4)
    local.add_argument("--devices-per-host", default="2", metavar="D[,D...]",
                       help="devices of each simulated host: one count for all, or one per "
                            "host, e.g. 2,2,2,1 for a host with a failed chip (default 2)")
    local.add_argument("--state-dir", default=DEFAULT_STATE_DIR)
    local.add_argument("--quiet", action="store_true", help="do not print the journal")
    local.add_argument("--fault", action="append", default=[], metavar="KIND:HOST@TRIGGER",
                       help="inject a fault, e.g. kill-host:host-1@step=120 or "
                            "kill-worker:host-2@t=30 (repeatable)")
    local.add_argument("--chaos", metavar="SPEC",
                       help="random faults, e.g. mtbf=60,seed=1,kinds=all (see elastic.chaos)")
    local.add_argument("--gce-metadata", metavar="URL",
                       help="agents watch this GCE metadata URL for preemption notices; "
                            "{host} is replaced by each host's id")
    local.add_argument("--insecure", action="store_true",
                       help="plaintext gRPC between the simulated hosts (for comparing what TLS "
                            "costs; default: mutual TLS with a throwaway CA under the state dir)")
    local.add_argument("--compile-cache-dir", metavar="DIR",
                       help="the simulated hosts' executable cache, kept across runs "
                            "(default: a new one under the state dir; with --isolate each "
                            "host starts with a copy of it)")
    local.add_argument("--gcs-emulator", action="store_true",
                       help="keep checkpoints in a bucket of a local GCS emulator "
                            "(fake-gcs-server, from the dev extra) started for this run "
                            "(or gcs_emulator = true in the spec's [local] table)")
    local.add_argument("--standby", action="store_true",
                       help="run a standby controller beside the leader (elasticd start "
                            "--standby): a killed leader is replaced at once; agents get both "
                            "addresses")
    local.add_argument("--metrics-port", type=port_number, metavar="PORT",
                       help="the controller's Prometheus metrics on this port of 127.0.0.1 "
                            "(HTTPS; scrape with the operator bundle in STATE_DIR/tls)")
    local.add_argument("--isolate", action="store_true",
                       help="each host and the controller in namespaces of their own: an "
                            "address on a private bridge, private /dev/shm and disk (needs "
                            "root; implies --gcs-emulator; enables the network fault kinds; "
                            "or isolate = true in the spec's [local] table)")
    local.add_argument("--cleanup", action="store_true",
                       help="only remove what a killed run in --state-dir left (processes, "
                            "namespaces, links, snapshots), then exit")

    certs = sub.add_parser("certs", help="a certificate authority for the controller, hosts "
                                         "and operators")
    verbs = certs.add_subparsers(dest="verb", required=True)
    init = verbs.add_parser("init", help="create a CA (DIR/ca.pem, DIR/ca.key)")
    init.add_argument("--dir", required=True)
    init.add_argument("--name", default="elastic CA", help="the CA's common name")
    init.add_argument("--days", type=int, default=3650)
    issue = verbs.add_parser("issue", help="issue a bundle (ca.pem, cert.pem, key.pem) under DIR")
    issue.add_argument("--dir", required=True, help="the CA's directory")
    issue.add_argument("--role", required=True, choices=("controller", "host", "operator"))
    issue.add_argument("--name", required=True,
                       help="host id (role host), operator name, or controller name")
    issue.add_argument("--san", action="append", default=[], metavar="NAME_OR_IP",
                       help="controller only: another DNS name or IP it is reached at "
                            "(repeatable; agents check the name elastic-controller)")
    issue.add_argument("--days", type=int, default=365)
    check = verbs.add_parser("check", help="check a bundle: chain, key, role, expiry")
    check.add_argument("--tls-dir", required=True)
    return parser


def _load(path: str):
    try:
        return load_spec(path)
    except SpecError as e:
        raise UsageError(str(e)) from None


def _check_storage(spec, retry_s: float | None = None) -> None:
    """A gs:// checkpoint directory must be usable before anything starts:
    UsageError when it is not (no bucket, no right to write, no package,
    no credentials). A bucket that is out of reach (StorageError.transient:
    an outage) is only warned about: a controller restarted during an
    outage must not fail for good (exit 2 is final), and the controller
    waits for it before it leads (elastic.controller.server.serve).
    `retry_s`: how long transient errors are retried (storage.check)."""
    from elastic.checkpoint.storage import StorageError, check

    try:
        check(spec.checkpoint_dir, retry_s)
    except StorageError as e:
        if not e.transient:
            raise UsageError(str(e)) from None
        print(f"elasticd: warning: {e} (starting anyway: an outage is not a mistake in the "
              f"spec)", file=sys.stderr, flush=True)


def _finite(value: float | None, what: str, minimum: float = 0.0) -> None:
    if value is not None and not (math.isfinite(value) and value >= minimum):
        raise UsageError(f"{what} must be a finite number >= {minimum:g}, got {value}")


def _client_tls(args):
    """The TLS files `status` and `chaos` use (None with --insecure)."""
    from elastic.security.tls import TLSError, TLSFiles

    if args.insecure:
        return None
    directory = args.tls_dir
    if directory is None:
        local = pathlib.Path(args.state_dir) / LOCAL_OPERATOR_BUNDLE
        directory = local if local.is_dir() else OPERATOR_TLS_DIR
    try:
        return TLSFiles.in_dir(directory)
    except TLSError as e:
        raise UsageError(str(e)) from None


def _controller_address(args) -> str:
    from elastic.controller.server import ADDRESS_FILE
    from elastic.transport import parse_address

    if args.controller:
        try:
            parse_address(args.controller, "--controller")
        except ValueError as e:
            raise UsageError(str(e)) from None
        return args.controller
    path = pathlib.Path(args.state_dir) / ADDRESS_FILE
    try:
        address = path.read_bytes().decode("ascii").strip()
        parse_address(address)
    except FileNotFoundError:
        raise UsageError(f"no controller address in {path} (is the controller running?); "
                         f"pass --controller") from None
    except (OSError, UnicodeDecodeError, ValueError):
        raise UsageError(f"{path} does not hold a controller address (HOST:PORT)") from None
    return address


def _status(args) -> int:
    from google.protobuf import json_format

    from elastic.controller.status import fetch_status, format_status
    from elastic.security.tls import TLSError

    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `elasticd status | head` ends quietly
    address = _controller_address(args)
    try:
        status = fetch_status(address, _client_tls(args))
    except TLSError as e:
        raise UsageError(str(e)) from None
    except grpc.RpcError as e:
        print(f"elasticd: cannot reach the controller at {address}: {e.code().name}: "
              f"{e.details()}", file=sys.stderr)
        return 1
    if args.json:
        print(json_format.MessageToJson(status, always_print_fields_with_no_presence=True))
    else:
        print(format_status(status))
    return 0


def _logs(args) -> int:
    from elastic import logs
    from elastic.controller.status import fetch_status
    from elastic.security.tls import TLSError

    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    if args.generation < 0 or args.tail_bytes < 0:
        raise UsageError("--generation and --tail-bytes must be >= 0")
    address = _controller_address(args)
    tls = _client_tls(args)
    try:
        status = fetch_status(address, tls)
        problems = logs.fetch(status, tls, args.host, args.generation, args.follow,
                              args.tail_bytes, not args.no_agent, logs.print_line)
    except (TLSError, ValueError) as e:
        raise UsageError(str(e)) from None
    except grpc.RpcError as e:
        print(f"elasticd: cannot reach the controller at {address}: {e.code().name}: "
              f"{e.details()}", file=sys.stderr)
        return 1
    for problem in problems:
        print(f"elasticd: {problem}", file=sys.stderr)
    return 1 if problems else 0


def _report(args) -> int:
    import json
    import time

    from elastic.controller.journal import JOURNAL_NAME, job_entries, load_journal
    from elastic.goodput import account, format_report

    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    path = pathlib.Path(args.state_dir) / JOURNAL_NAME
    if not path.is_file():
        print(f"elasticd: no journal at {path}", file=sys.stderr)
        return 1
    try:
        entries, skipped = load_journal(args.state_dir)
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror or e}") from None
    entries = job_entries(entries)  # (the latest job's, where several ran)
    goodput = account(entries, now=time.time())
    if skipped:
        print(f"elasticd: {skipped} line(s) of {path} are not journal entries; skipped",
              file=sys.stderr)
    print(json.dumps(goodput.to_json(), indent=2) if args.json else format_report(goodput))
    if args.plot:
        from elastic.plot import PlotError, plot_timeline

        try:
            plot_timeline(entries, args.plot)
        except PlotError as e:
            raise UsageError(str(e)) from None
        except OSError as e:
            raise UsageError(f"cannot write {args.plot}: {e.strerror or e}") from None
        print(f"timeline written to {args.plot}", file=sys.stderr)
    return 0


def _certs(args) -> int:
    from elastic.security import certs
    from elastic.security.identity import Role
    from elastic.security.tls import TLSError, TLSFiles, load

    try:
        if args.verb == "init":
            root = certs.create_ca(args.dir, args.name, args.days)
            print(f"CA created: {root / certs.CA_CERT} (key {root / certs.CA_KEY}: keep it off "
                  f"the hosts)")
        elif args.verb == "issue":
            issued = certs.issue(args.dir, Role.parse(args.role), args.name, tuple(args.san),
                                 args.days)
            print(f"{issued.role.short} certificate for {issued.name} in {issued.directory} "
                  f"(valid until {issued.not_after:%Y-%m-%d})")
        else:
            c = load(TLSFiles.in_dir(args.tls_dir), tuple(Role))
            print(f"{args.tls_dir}: {c.identity}, valid until {c.not_after:%Y-%m-%d %H:%M} UTC, "
                  f"sha256 {c.identity.fingerprint[:16]}")
    except (certs.CertError, TLSError, ValueError) as e:
        raise UsageError(str(e)) from None
    except OSError as e:
        raise UsageError(f"{e.filename or args.dir}: {e.strerror or e}") from None
    return 0


def port_number(text: str) -> int:
    """An argparse type: a TCP port from 0 (any free one) to 65535."""
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port from 0 to 65535")
    return int(text)


def host_count(text: str) -> int:
    """An argparse type: a number of hosts, 0 or more; raises
    argparse.ArgumentTypeError for anything else (a sign, a fraction, a word)."""
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of hosts (0 or more)")
    return int(text)


def _start(args) -> int:
    """`elasticd start`: the controller's exit code (elastic.controller.server:
    serve's, or CRASHED_EXIT after an unexpected error, logged with its
    traceback). Raises UsageError when it cannot start."""
    from elastic.controller.server import CRASHED_EXIT, StartError, serve
    from elastic.security.tls import TLSError, TLSFiles
    from elastic.transport import parse_address

    try:
        parse_address(args.listen, "--listen", allow_port_zero=True)
    except ValueError as e:
        raise UsageError(str(e)) from None
    spec = _load(args.config)
    if args.checkpoint_dir is not None and not args.checkpoint_dir.strip():
        raise UsageError("--checkpoint-dir is empty (leave it out for job.checkpoint_dir)")
    if args.checkpoint_dir:
        spec = dataclasses.replace(spec, checkpoint_dir=args.checkpoint_dir if "://" in
                                   args.checkpoint_dir else os.path.abspath(args.checkpoint_dir))
    if args.expect_hosts is not None:
        spec = dataclasses.replace(spec, health=dataclasses.replace(
            spec.health, expected_hosts=args.expect_hosts))
    _check_storage(spec)
    tls = None
    if not args.insecure:
        try:
            tls = TLSFiles.in_dir(args.tls_dir or CONTROLLER_TLS_DIR)
        except TLSError as e:
            raise UsageError(str(e)) from None
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s elasticd %(levelname)s %(message)s")
    try:
        return asyncio.run(serve(spec, args.listen, args.state_dir, tls, args.standby,
                                 args.metrics_port))
    except StartError as e:
        raise UsageError(str(e)) from None
    except Exception:  # noqa: BLE001 - a bug: restartable, unlike "the job failed" (1)
        logging.getLogger("elasticd").exception("the controller crashed")
        return CRASHED_EXIT


def _cleanup(state_dir: str) -> int:
    from elastic.local import leftovers, network

    try:
        removed = leftovers.cleanup(pathlib.Path(state_dir))
    except (leftovers.StillRunning, network.IsolationError) as e:
        print(f"elasticd: error: {e}", file=sys.stderr)
        return 1
    print(f"elasticd local --cleanup: removed {', '.join(removed)}" if removed
          else f"elasticd local --cleanup: nothing left by a run in {state_dir}")
    return 0


def _local(args) -> int:
    from elastic.chaos import JOB_KINDS, NETWORK_KINDS, STORAGE_KINDS, parse_chaos
    from elastic.faults import parse_fault
    from elastic.local import host_devices, network, run_local

    if args.cleanup:
        return _cleanup(args.state_dir)
    if not args.config:
        raise UsageError("--config is required (but with --cleanup)")
    spec = _load(args.config)
    args.isolate = args.isolate or spec.local.isolate
    # isolated hosts share no directory: the checkpoints live in a bucket
    # (elastic.local.surroundings starts the emulator for them)
    args.gcs_emulator = args.gcs_emulator or spec.local.gcs_emulator or args.isolate
    if args.isolate:
        problem = network.capability_problem()
        if problem:
            raise UsageError(problem)
        if args.gce_metadata:
            raise UsageError("--isolate does not take --gce-metadata: the hosts cannot "
                             "reach this machine's loopback")
    if not 1 <= args.hosts <= 256:
        raise UsageError("--hosts must be from 1 to 256")
    parts = args.devices_per_host.split(",")
    if not all(part.strip().isdigit() for part in parts):
        raise UsageError(f"--devices-per-host {args.devices_per_host!r}: expected a count, or "
                         f"one count per host separated by commas")
    counts = [int(part) for part in parts]
    try:
        devices = host_devices(args.hosts, counts[0] if len(counts) == 1 else counts)
    except ValueError as e:
        raise UsageError(f"--devices-per-host: {e}") from None
    if not args.gcs_emulator:  # else checkpoints go to the emulator's bucket
        _check_storage(spec)
    try:
        faults = [parse_fault(text) for text in args.fault]
        chaos = parse_chaos(args.chaos) if args.chaos else None
    except ValueError as e:
        raise UsageError(str(e)) from None
    unknown = sorted({f.host for f in faults if f.kind not in JOB_KINDS} -
                     {f"host-{i}" for i in range(args.hosts)})
    if unknown:  # (it would never fire, nor would any `after` fault behind it)
        raise UsageError(f"--fault names no host of this slice: {', '.join(unknown)} (the hosts "
                         f"are host-0 to host-{args.hosts - 1})")
    storage = sorted({f.kind for f in faults if f.kind in STORAGE_KINDS})
    if storage and not args.gcs_emulator:
        raise UsageError(f"--fault {'/'.join(storage)} needs --gcs-emulator (the fault acts on "
                         f"the emulator's bucket through a proxy)")
    net_faults = sorted({f.kind for f in faults if f.kind in NETWORK_KINDS})
    if net_faults and not args.isolate:
        raise UsageError(f"--fault {'/'.join(net_faults)} needs --isolate (the fault acts on "
                         f"the links of isolated hosts)")
    try:
        return run_local(args.config, spec, args.hosts, devices, args.state_dir,
                         quiet=args.quiet, faults=faults, metadata_url=args.gce_metadata,
                         chaos=chaos, insecure=args.insecure, gcs_emulator=args.gcs_emulator,
                         compile_cache_dir=args.compile_cache_dir, isolate=args.isolate,
                         standby=args.standby, metrics_port=args.metrics_port)
    except NotADirectoryError as e:
        raise UsageError(str(e)) from None
    except RuntimeError as e:
        print(f"elasticd: error: {e}", file=sys.stderr)
        return 1


def _chaos(args) -> int:
    from elastic.chaos import parse_chaos
    from elastic.local import LOCAL_FILE, run_chaos

    _finite(args.duration_s, "--duration-s")
    try:
        spec = parse_chaos(args.chaos)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if not (pathlib.Path(args.state_dir) / LOCAL_FILE).is_file():
        raise UsageError(f"no running `elasticd local` slice in {args.state_dir} (no "
                         f"{LOCAL_FILE})")
    return run_chaos(args.state_dir, spec, args.duration_s, _client_tls(args))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    commands = {"status": _status, "logs": _logs, "report": _report, "chaos": _chaos,
                "certs": _certs, "start": _start, "local": _local}
    try:
        return commands[args.command](args)
    except UsageError as e:
        print(f"elasticd: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
