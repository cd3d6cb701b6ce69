"""Benchmark: hang and preemption handling on the reference workload
(workers/lm, 4 local hosts x 2 CPU devices, default hang settings).

- SIGSTOP a worker -> `hang_detected`, then -> first step of the next
  generation. The agent sees the stopped process and reports it, and the
  controller ends it after `hang.suspended_timeout_s` (2 s): a SIGSTOP is
  not a hang of the code, which only the learned step timeout (max(10 s,
  10 x the median step)) or a stuck collective finds, later;
- SIGTERM an agent (preemption) -> emergency checkpoint committed, and -> first
  step of the next generation (without that host); the agent is then started
  again and the slice grows back to 4 hosts before the next trial.

    .venv/bin/python bench/hangs_preemption.py --trials 10
"""

from __future__ import annotations

import argparse
import pathlib
import signal
import sys
import time

from common import (add_keep_flag, lm_job, machine, print_table, reported_host, summarize,
                    wait_entry, work_dir, write_result)

from elastic.config import load_spec
from elastic.controller.status import fetch_status, slice_step
from elastic.local import restart_agent, start_slice, stop_slice
from elastic.procs import signal_pid

REPO = pathlib.Path(__file__).resolve().parent.parent


def wait_running(local, hosts: int, after_step: int = 5) -> int:
    """Wait until `hosts` members run and have made a few steps; the generation."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        st = fetch_status(local.address, local.tls)
        members = [h for h in st.hosts if h.state == "member"]
        if st.phase == "running" and len(members) == hosts and slice_step(st) >= 0:
            start = slice_step(st)
            while slice_step(fetch_status(local.address, local.tls)) < start + after_step:
                time.sleep(0.1)
            return st.generation
        time.sleep(0.1)
    raise TimeoutError(f"slice did not run on {hosts} hosts")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" /
                                             "hangs_preemption.json"))
    add_keep_flag(parser)
    args = parser.parse_args()
    with work_dir("elastic-hangs-", args.keep) as work:
        spec_path = lm_job(work, "hangs", args.hosts, 100,
                           extra='grow = "immediately"\n[quarantine]\nfailures = 10000')
        state = work / "state"
        local = start_slice(str(spec_path), load_spec(spec_path), args.hosts, 2, state)
        rows: dict[str, list[float]] = {}

        def add(name: str, value: float) -> None:
            rows.setdefault(name, []).append(value)

        try:
            for trial in range(args.trials):
                generation = wait_running(local, args.hosts)
                victim = reported_host(local, f"host-{trial % args.hosts}")
                t0 = time.time()
                signal_pid(victim.worker_pid, signal.SIGSTOP)
                hang = wait_entry(state, "hang_detected", generation=generation, timeout_s=120)
                first = wait_entry(state, "first_progress", generation=generation + 1,
                                   timeout_s=120)
                add("sigstop_to_hang_detected", hang["ts"] - t0)
                add("sigstop_to_first_step", first["ts"] - t0)
                print(f"hang {trial + 1}/{args.trials}: detected {hang['ts'] - t0:.2f} s "
                      f"(timeout {hang['timeout_s']:.1f} s, suspects {hang['suspects']}), "
                      f"first step {first['ts'] - t0:.2f} s", flush=True)
            for trial in range(args.trials):
                generation = wait_running(local, args.hosts)
                host_id = f"host-{1 + trial % (args.hosts - 1)}"
                victim = reported_host(local, host_id)
                t0 = time.time()
                signal_pid(victim.agent_pid, signal.SIGTERM)
                saved = wait_entry(state, "checkpoint_saved", generation=generation,
                                   preemption=True, timeout_s=60)
                committed = wait_entry(state, "checkpoint_committed", step=saved["step"])
                first = wait_entry(state, "first_progress", generation=generation + 1,
                                   timeout_s=120)
                add("sigterm_to_checkpoint_committed", committed["ts"] - t0)
                add("sigterm_to_first_step", first["ts"] - t0)
                print(f"preemption {trial + 1}/{args.trials}: committed step {saved['step']} after "
                      f"{committed['ts'] - t0:.2f} s, first step of generation {generation + 1} "
                      f"after {first['ts'] - t0:.2f} s", flush=True)
                local.agents[host_id].wait(30)  # the preempted agent leaves; start it again
                restart_agent(local, host_id)
        finally:
            stop_slice(local)
    result = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "hosts": args.hosts,
              "results": {k: summarize(v) for k, v in rows.items()}, "raw": rows}
    print_table(result["results"])
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
