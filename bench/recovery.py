"""Benchmark: worker SIGKILL -> first step of the next generation, by phase,
on the reference workload (workers/lm, 4 local hosts x 2 CPU devices); and the
blocking time of checkpoint saves as a share of step time.

Phases (medians over --trials):
  detection   kill -> slice_stopping (the agent reports the exit)
  teardown    slice_stopping -> slice_stopped (peers SIGKILLed and reaped)
  scheduling  slice_stopped -> generation_started
  then from the new process 0's own timings (`worker_phases`):
  process_start (exec -> elastic.worker.init(), incl. importing JAX and the
  script's modules), distributed_init, restore, first_step (compile + run);
  and "other" = what the worker did between them (corpus, Orbax set-up).
  total       kill -> first_progress of the next generation

    .venv/bin/python bench/recovery.py --trials 10
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import statistics
import sys
import tempfile
import time

from common import machine, summarize, wait_entry, write_result

from elastic.config import load_spec
from elastic.controller.journal import read_journal
from elastic.controller.status import fetch_status, slice_step
from elastic.local import start_slice, stop_slice

REPO = pathlib.Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--devices-per-host", type=int, default=2)
    parser.add_argument("--steps-between", type=int, default=10,
                        help="steps to run in each generation before the next kill")
    parser.add_argument("--warmup-steps", type=int, default=130,
                        help="steps before the first kill (checkpoint overhead is measured there)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "recovery.json"))
    args = parser.parse_args()

    work = pathlib.Path(tempfile.mkdtemp(prefix="elastic-recovery-"))
    argv = [sys.executable, str(REPO / "workers/lm/train.py"), "--steps", "1000000",
            "--checkpoint-every", "25", "--eval-every", "1000000"]
    spec_path = work / "job.toml"
    spec_path.write_text(f"""
[job]
id = "recovery"
command = {json.dumps(argv)}
min_hosts = 1
max_hosts = {args.hosts}

[mesh]
data = -1
model = 2

[restart]
max_restarts = 1000
crash_loop_failures = 1000
""")
    state = work / "state"
    local = start_slice(str(spec_path), load_spec(spec_path), args.hosts, args.devices_per_host,
                        state)
    phases: dict[str, list[float]] = {}
    try:
        generation = wait_entry(state, "first_progress", timeout_s=180)["generation"]
        # a stretch without faults, for the checkpoint overhead (saves every 25 steps)
        while slice_step(fetch_status(local.address)) < args.warmup_steps:
            time.sleep(0.2)
        for trial in range(args.trials):
            # let the generation make some steps (and a checkpoint now and then)
            target = slice_step(fetch_status(local.address)) + args.steps_between
            while slice_step(fetch_status(local.address)) < target:
                time.sleep(0.1)
            status = fetch_status(local.address)
            victim = next(h for h in status.hosts
                          if h.host_id == f"host-{trial % args.hosts}")
            t0 = time.time()
            os.killpg(victim.worker_pid, signal.SIGKILL)
            stopping = wait_entry(state, "slice_stopping", generation=generation)
            stopped = wait_entry(state, "slice_stopped", generation=generation)
            started = wait_entry(state, "generation_started", generation=generation + 1)
            first = wait_entry(state, "first_progress", generation=generation + 1, timeout_s=120)
            worker = wait_entry(state, "worker_phases", generation=generation + 1)
            row = {"detection": stopping["ts"] - t0, "teardown": stopped["ts"] - stopping["ts"],
                   "scheduling": started["ts"] - stopped["ts"]}
            for name in ("process_start", "distributed_init", "restore", "first_step"):
                row[name] = worker.get(f"{name}_s", 0.0)
            row["total"] = first["ts"] - t0
            row["other"] = max(0.0, first["ts"] - started["ts"] - sum(
                row[k] for k in ("process_start", "distributed_init", "restore", "first_step")))
            for k, v in row.items():
                phases.setdefault(k, []).append(v)
            print(f"trial {trial + 1}/{args.trials}: " + ", ".join(
                f"{k} {v:.2f} s" for k, v in row.items()), flush=True)
            generation += 1
    finally:
        stop_slice(local)

    saves = [e for e in read_journal(state) if e["kind"] == "checkpoint_saved"
             and e.get("step_time_s")]
    blocking = [e["blocking_s"] for e in saves[1:]]  # the first save sets up Orbax
    step_time = statistics.median(e["step_time_s"] for e in saves)
    share = statistics.median(blocking) / (25 * step_time) if blocking else float("nan")
    order = ["detection", "teardown", "scheduling", "process_start", "distributed_init",
             "restore", "first_step", "other", "total"]
    result = {"date": time.strftime("%Y-%m-%d"), "machine": machine(),
              "hosts": args.hosts, "devices_per_host": args.devices_per_host,
              "phases": {k: summarize(phases[k]) for k in order},
              "checkpoint": {"saves": len(blocking),
                             "median_blocking_s": round(statistics.median(blocking), 4)
                             if blocking else None,
                             "median_step_time_s": round(step_time, 4),
                             "interval_steps": 25, "blocking_share": round(share, 5)},
              "raw": phases}
    print(f"\n{'phase':18} {'median':>8} {'p95':>8}")
    for k in order:
        s = result["phases"][k]
        print(f"{k:18} {s['median_s']:8.2f} {s['p95_s']:8.2f}")
    c = result["checkpoint"]
    print(f"\ncheckpoint saves: median blocking {c['median_blocking_s']} s per save every 25 "
          f"steps of {c['median_step_time_s']} s -> {100 * share:.2f} % of step time")
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
