"""Benchmark: how fast the control plane reacts, on a local slice.

Runs `workers/tiny` (no JAX) on N simulated hosts with the default health
timings (heartbeat 1 s, timeout 5 s) and measures, over `--trials` trials:

- worker SIGKILL -> `slice_stopping` (detection) and -> `generation_started`
  of the next generation (restart decided and sent), and -> `first_progress`;
- agent + worker SIGKILL -> `host_lost` (then the agent is started again and
  rejoins, ready for the next trial).

Times are journal timestamps minus the time just before the kill (same
machine clock). Prints a table and writes JSON (`--out`).

    .venv/bin/python bench/control_plane.py --trials 10
"""

from __future__ import annotations

import argparse
import json
import pathlib
import signal
import subprocess
import sys
import time

from elastic.config import load_spec
from elastic.controller.status import fetch_status
from elastic.local import child_env, start_slice, stop_slice
from elastic.procs import signal_group, signal_pid

from common import (add_keep_flag, machine, print_table, reported_host, summarize, wait_entry,
                    work_dir, write_result)

REPO = pathlib.Path(__file__).resolve().parent.parent


def spec_text(heartbeat_interval_s: float, heartbeat_timeout_s: float) -> str:
    argv = json.dumps([sys.executable, str(REPO / "workers/tiny/worker.py"),
                       "--steps", "10000000", "--step-time-s", "0.02"])
    return f"""
[job]
id = "bench"
command = {argv}
min_hosts = 1
max_hosts = 4

[restart]
grow = "immediately"
max_restarts = 1000
crash_loop_failures = 1000

[health]
heartbeat_interval_s = {heartbeat_interval_s}
heartbeat_timeout_s = {heartbeat_timeout_s}

[quarantine]
failures = 1000000  # the same hosts fail again and again on purpose
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--heartbeat-interval-s", type=float, default=1.0)
    parser.add_argument("--heartbeat-timeout-s", type=float, default=5.0)
    parser.add_argument("--insecure", action="store_true",
                        help="plaintext gRPC (to measure what mutual TLS costs)")
    parser.add_argument("--out", default=None,
                        help="default bench/results/control_plane[_insecure].json")
    add_keep_flag(parser)
    args = parser.parse_args()
    args.out = args.out or str(REPO / "bench" / "results" /
                               f"control_plane{'_insecure' if args.insecure else ''}.json")

    with work_dir("elastic-bench-", args.keep) as work:
        spec_path = work / "job.toml"
        spec_path.write_text(spec_text(args.heartbeat_interval_s, args.heartbeat_timeout_s))
        spec = load_spec(spec_path)
        state = work / "state"
        local = start_slice(str(spec_path), spec, args.hosts, 1, state, insecure=args.insecure)
        rows = {"worker_kill_to_detection": [], "worker_kill_to_generation_started": [],
                "worker_kill_to_first_progress": [], "agent_kill_to_host_lost": []}
        extra: list[subprocess.Popen] = []
        try:
            generation = wait_entry(state, "first_progress")["generation"]
            for trial in range(args.trials):
                victim = reported_host(local, f"host-{trial % args.hosts}")
                t0 = time.time()
                signal_pid(victim.worker_pid, signal.SIGKILL)
                stopping = wait_entry(state, "slice_stopping", generation=generation, after_ts=t0)
                started = wait_entry(state, "generation_started", generation=generation + 1,
                                     after_ts=t0)
                first = wait_entry(state, "first_progress", generation=generation + 1,
                                   after_ts=t0)
                rows["worker_kill_to_detection"].append(stopping["ts"] - t0)
                rows["worker_kill_to_generation_started"].append(started["ts"] - t0)
                rows["worker_kill_to_first_progress"].append(first["ts"] - t0)
                generation += 1
                print(f"worker kill {trial + 1}/{args.trials}: detected "
                      f"{stopping['ts'] - t0:.3f} s, next generation "
                      f"{started['ts'] - t0:.3f} s, first step {first['ts'] - t0:.3f} s",
                      flush=True)
            for trial in range(args.trials):
                host_id = f"host-{1 + trial % (args.hosts - 1)}"
                victim = reported_host(local, host_id)
                t0 = time.time()
                signal_pid(victim.agent_pid, signal.SIGKILL)
                signal_group(victim.worker_pid, signal.SIGKILL)
                lost = wait_entry(state, "host_lost", host=host_id, after_ts=t0)
                rows["agent_kill_to_host_lost"].append(lost["ts"] - t0)
                print(f"agent kill {trial + 1}/{args.trials}: host_lost after "
                      f"{lost['ts'] - t0:.3f} s", flush=True)
                # bring the host back and wait until the slice runs on all hosts again
                log = open(state / "hosts" / f"{host_id}.log", "ab")
                extra.append(subprocess.Popen(local.agent_argv[host_id], env=child_env(),
                                              stdout=log, stderr=subprocess.STDOUT))
                log.close()
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    st = fetch_status(local.address, local.tls)
                    if st.phase == "running" and \
                            sum(h.state == "member" for h in st.hosts) == args.hosts:
                        break
                    time.sleep(0.05)
                generation = st.generation
        finally:
            for p in extra:  # stop now (SIGTERM would be a preemption, waiting for a controller)
                p.send_signal(signal.SIGINT)
            stop_slice(local)
            for p in extra:
                p.wait(15)

    result = {"date": time.strftime("%Y-%m-%d"), "machine": machine(),
              "hosts": args.hosts, "heartbeat_interval_s": args.heartbeat_interval_s,
              "heartbeat_timeout_s": args.heartbeat_timeout_s,
              "results": {k: summarize(v) for k, v in rows.items() if v},
              "raw": {k: [round(x, 4) for x in v] for k, v in rows.items()}}
    print_table(result["results"])
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
