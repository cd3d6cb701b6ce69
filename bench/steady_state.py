"""Benchmark: what elastic costs a training step in steady state.

The same train step (workers/lm/step.py), on the same processes and devices
(`--hosts` processes x 2 CPU devices), run in alternating rounds:
  plain   -- bench/plain_lm.py: jax.distributed + Orbax, nothing of elastic;
  elastic -- workers/lm/train.py under `elasticd local` (controller, agents,
             elastic.worker: a progress report every step, a local snapshot
             every 10 steps, the default).
Both take persistent checkpoints every 100 steps and evaluate every 50.
The figure per run is the mean step time over steps [--from, --steps) from
process 0's clock (snapshots and checkpoint saves included, as goodput
counts them), and its median step; the result is the ratio of the medians
over the rounds (this machine is shared: one run is not a figure).

    .venv/bin/python bench/steady_state.py --rounds 3
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import subprocess
import sys
import time

from common import (add_keep_flag, lm_job, machine, run_in_one_generation, step_window,
                    work_dir, write_result)

from elastic.checkpoint.emulator import free_port
from elastic.config import load_spec
from elastic.local import start_slice

REPO = pathlib.Path(__file__).resolve().parent.parent


def run_plain(work: pathlib.Path, hosts: int, steps: int, timeout_s: float) -> pathlib.Path:
    """Run bench/plain_lm.py on `hosts` processes to the end; the path of
    process 0's step times. Raises RuntimeError when a process fails."""
    times = work / "plain-times.json"
    coordinator = f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen(
        [sys.executable, str(REPO / "bench" / "plain_lm.py"), "--process-id", str(i),
         "--num-processes", str(hosts), "--coordinator", coordinator,
         "--checkpoint-dir", str(work / "plain-ckpt"), "--steps", str(steps),
         "--step-times", str(times)],
        stdout=subprocess.DEVNULL if i else None, env={**os.environ, "XLA_FLAGS": ""})
        for i in range(hosts)]
    try:
        codes = [p.wait(timeout=timeout_s) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(codes):
        raise RuntimeError(f"plain_lm exited with {codes}")
    return times


def run_elastic(work: pathlib.Path, hosts: int, steps: int, timeout_s: float) -> pathlib.Path:
    """Run workers/lm under `elasticd local` on `hosts` hosts x 2 devices to
    the end; the path of process 0's step times. Raises RuntimeError when
    the job does not succeed in one generation within `timeout_s`."""
    times = work / "elastic-times.json"
    spec_path = lm_job(work, "steady", hosts, worker_args=(
        "--steps", str(steps), "--eval-every", "50", "--step-times", str(times)))
    state = work / "state"
    local = start_slice(str(spec_path), load_spec(spec_path), hosts, 2, state)
    run_in_one_generation(local, timeout_s)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--from", dest="first", type=int, default=50,
                        help="first step of the window (after compile and warm-up)")
    parser.add_argument("--timeout-s", type=float, default=900.0)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "steady_state.json"))
    add_keep_flag(parser)
    args = parser.parse_args()
    if not 1 <= args.first < args.steps - 1:
        parser.error("--from must lie within the run, two steps before its end")
    runs: dict[str, list[tuple[float, float]]] = {"plain": [], "elastic": []}
    for r in range(args.rounds):
        for kind, run in (("plain", run_plain), ("elastic", run_elastic)):
            with work_dir(f"elastic-steady-{kind}-", args.keep) as work:
                mean, median = step_window(run(work, args.hosts, args.steps, args.timeout_s),
                                           args.first)
            runs[kind].append((mean, median))
            print(f"round {r + 1}: {kind:7}: mean step {mean:.4f} s, median {median:.4f} s "
                  f"(steps {args.first}-{args.steps - 1})", flush=True)
    figures = {kind: {"mean_step_s": statistics.median(m for m, _ in rows),
                      "median_step_s": statistics.median(d for _, d in rows)}
               for kind, rows in runs.items()}
    ratio_mean = figures["elastic"]["mean_step_s"] / figures["plain"]["mean_step_s"]
    ratio_median = figures["elastic"]["median_step_s"] / figures["plain"]["median_step_s"]
    print(f"\n{args.hosts} processes x 2 CPU devices, {args.rounds} rounds, {machine()}")
    print(f"plain JAX + Orbax : mean step {figures['plain']['mean_step_s']:.4f} s, "
          f"median {figures['plain']['median_step_s']:.4f} s")
    print(f"under elastic     : mean step {figures['elastic']['mean_step_s']:.4f} s, "
          f"median {figures['elastic']['median_step_s']:.4f} s")
    print(f"elastic / plain   : mean x{ratio_mean:.3f} ({100 * (ratio_mean - 1):+.1f} %), "
          f"median x{ratio_median:.3f} ({100 * (ratio_median - 1):+.1f} %)")
    write_result(args.out, {"date": time.strftime("%Y-%m-%d"), "machine": machine(),
                            "hosts": args.hosts, "rounds": args.rounds, "steps": args.steps,
                            "from": args.first, "runs": runs, "figures": figures,
                            "ratio_mean": ratio_mean, "ratio_median": ratio_median})
    return 0


if __name__ == "__main__":
    sys.exit(main())
