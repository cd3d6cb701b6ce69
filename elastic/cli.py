"""`elasticd`: start | status | report | local | chaos.

Exit codes: 0 job succeeded, 1 job failed (or status could not reach the
controller), 2 bad command line or job spec (nothing was started).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import pathlib
import sys

import grpc

from elastic.config import SpecError, load_spec

DEFAULT_STATE_DIR = "elastic-state"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="elasticd", description="Fault-tolerant elastic "
                                     "training for multi-host JAX: the controller.")
    sub = parser.add_subparsers(dest="command", required=True)
    start = sub.add_parser("start", help="run the controller of one job")
    start.add_argument("--config", required=True, help="job spec (TOML)")
    start.add_argument("--listen", default="0.0.0.0:7470", help="HOST:PORT (default %(default)s)")
    start.add_argument("--state-dir", default=DEFAULT_STATE_DIR,
                       help="journal and state (default ./%(default)s)")

    status = sub.add_parser("status", help="show a running job")
    status.add_argument("--json", action="store_true", help="JSON instead of a table")
    status.add_argument("--controller", help="HOST:PORT (default: from the state dir)")
    status.add_argument("--state-dir", default=DEFAULT_STATE_DIR)

    report = sub.add_parser("report", help="goodput of a finished or running job")
    report.add_argument("--state-dir", default=DEFAULT_STATE_DIR)
    report.add_argument("--json", action="store_true", help="JSON instead of a table")

    chaos = sub.add_parser("chaos", help="random faults on a running `elasticd local` slice")
    chaos.add_argument("--state-dir", default=DEFAULT_STATE_DIR)
    chaos.add_argument("--chaos", required=True, metavar="SPEC",
                       help="e.g. mtbf=60,seed=1,kinds=all,count=5 (see elastic.chaos)")
    chaos.add_argument("--duration-s", type=float, default=None,
                       help="stop after this long (default: until Ctrl-C or count faults)")

    local = sub.add_parser("local", help="controller and N simulated hosts on this machine")
    local.add_argument("--config", required=True, help="job spec (TOML)")
    local.add_argument("--hosts", type=int, default=4)
    local.add_argument("--devices-per-host", type=int, default=2)
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
    return parser


def _load(path: str):
    try:
        return load_spec(path)
    except SpecError as e:
        print(f"elasticd: error: {e}", file=sys.stderr)
        sys.exit(2)


def _status(args) -> int:
    from google.protobuf import json_format

    from elastic.controller.server import ADDRESS_FILE
    from elastic.controller.status import fetch_status, format_status

    address = args.controller
    if not address:
        path = pathlib.Path(args.state_dir) / ADDRESS_FILE
        if not path.exists():
            print(f"elasticd: no controller address in {path}; pass --controller",
                  file=sys.stderr)
            return 1
        address = path.read_text().strip()
    try:
        status = fetch_status(address)
    except grpc.RpcError as e:
        print(f"elasticd: cannot reach the controller at {address}: {e.code().name}",
              file=sys.stderr)
        return 1
    if args.json:
        print(json_format.MessageToJson(status, always_print_fields_with_no_presence=True))
    else:
        print(format_status(status))
    return 0


def _report(args) -> int:
    import json
    import time

    from elastic.controller.journal import JOURNAL_NAME, read_journal
    from elastic.goodput import account, format_report

    path = pathlib.Path(args.state_dir) / JOURNAL_NAME
    if not path.exists():
        print(f"elasticd: no journal at {path}", file=sys.stderr)
        return 1
    goodput = account(read_journal(args.state_dir), now=time.time())
    print(json.dumps(goodput.to_json(), indent=2) if args.json else format_report(goodput))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "status":
        return _status(args)
    if args.command == "report":
        return _report(args)
    if args.command == "chaos":
        from elastic.chaos import parse_chaos
        from elastic.local import run_chaos

        try:
            spec = parse_chaos(args.chaos)
        except ValueError as e:
            print(f"elasticd: error: {e}", file=sys.stderr)
            return 2
        return run_chaos(args.state_dir, spec, args.duration_s)
    spec = _load(args.config)
    if args.command == "start":
        from elastic.controller.server import serve

        logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                            format="%(asctime)s elasticd %(levelname)s %(message)s")
        try:
            return asyncio.run(serve(spec, args.listen, args.state_dir))
        except RuntimeError as e:
            print(f"elasticd: error: {e}", file=sys.stderr)
            return 2
    if args.command == "local":
        from elastic.local import run_local

        from elastic.chaos import parse_chaos
        from elastic.faults import parse_fault

        if args.hosts < 1 or args.devices_per_host < 1:
            print("elasticd: error: --hosts and --devices-per-host must be at least 1",
                  file=sys.stderr)
            return 2
        try:
            faults = [parse_fault(text) for text in args.fault]
            chaos = parse_chaos(args.chaos) if args.chaos else None
        except ValueError as e:
            print(f"elasticd: error: {e}", file=sys.stderr)
            return 2
        try:
            return run_local(args.config, spec, args.hosts, args.devices_per_host,
                             args.state_dir, quiet=args.quiet, faults=faults,
                             metadata_url=args.gce_metadata, chaos=chaos)
        except RuntimeError as e:
            print(f"elasticd: error: {e}", file=sys.stderr)
            return 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
