"""Benchmark: a job's first generation, start -> first step, cold and warm,
with checkpoints and the hosts' shared executable cache in a bucket.

Every run is a new job (a checkpoint prefix of its own: nothing to restore,
so the initial state is made, as at any job's start) on new hosts: `--hosts`
simulated hosts x 2 CPU devices, agents started with the run, each host's
own executable cache empty. All runs use one GCS emulator's bucket: the
first finds its `compile-cache/` empty (cold: process 0 compiles the train
step and the initial state, the other processes wait for its entries); the
`--warm` runs after it find them there (warm: every process loads them).
Per run, from the journal: generation_started -> first_progress (the
controller's clock), and where it went: `launch` (generation_started -> the
launch of process 0's worker: the agents' pre-started processes finishing
their imports, which start with the agents) and process 0's startup phases
(elastic.worker.runtime; `checkpoint_setup` holds Orbax's barrier, i.e.
waiting for the slowest process).

    .venv/bin/python bench/first_start.py --warm 3 [--isolate]

Issue 19's target: warm <= 3 s.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

from common import add_keep_flag, lm_job, machine, run_in_one_generation, work_dir, write_result

from elastic.config import load_spec
from elastic.local import start_slice, surroundings

REPO = pathlib.Path(__file__).resolve().parent.parent


def one_run(work: pathlib.Path, made, index: int, hosts: int, steps: int,
            timeout_s: float) -> dict:
    """Run a new job of `steps` steps on new hosts in `made` (surroundings);
    its first generation's start figures. Raises RuntimeError when the job
    does not succeed in one generation within `timeout_s`."""
    run_dir = work / f"run-{index}"
    run_dir.mkdir()
    job_id = f"first-{index}"
    spec_path = lm_job(run_dir, job_id, hosts, worker_args=("--steps", str(steps)))
    state = run_dir / "state"
    local = start_slice(str(spec_path), load_spec(spec_path), hosts, 2, state,
                        checkpoint_dir=f"{made.checkpoint_dir.rsplit('/', 1)[0]}/{job_id}",
                        extra_env=made.extra_env, net=made.net, shared_cache=made.shared_cache,
                        shared_cache_key=made.shared_cache_key)
    journal = run_in_one_generation(local, timeout_s)
    started = next(e for e in journal if e["kind"] == "generation_started")
    first = next(e for e in journal if e["kind"] == "first_progress")
    phases = next(e for e in journal if e["kind"] == "worker_phases")
    names = [k[:-2] for k in phases if k.endswith("_s") and k != "total_s"]
    split = {"launch": round(phases["launched_at"] - started["ts"], 3),
             **{name: phases[f"{name}_s"] for name in names}}
    return {"state": str(state), "start_to_first_step_s": round(first["ts"] - started["ts"], 3),
            "phases": split}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warm", type=int, default=3, help="warm runs after the cold one")
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--isolate", action="store_true",
                        help="hosts in namespaces of their own (needs root)")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "first_start.json"))
    add_keep_flag(parser)
    args = parser.parse_args()
    runs = []
    with work_dir("elastic-first-start-", args.keep) as work, \
            surroundings(work / "around", "first", args.hosts, args.isolate, True,
                         quiet=True) as made:
        for index in range(1 + args.warm):
            run = one_run(work, made, index, args.hosts, args.steps, args.timeout_s)
            run["kind"] = "cold" if index == 0 else "warm"
            runs.append(run)
            print(f"run {index + 1} ({run['kind']}): start -> first step "
                  f"{run['start_to_first_step_s']:.2f} s: " +
                  ", ".join(f"{k} {v:.2f}" for k, v in run["phases"].items()), flush=True)
    warm = [r["start_to_first_step_s"] for r in runs[1:]]
    print(f"\n{args.hosts} hosts x 2 CPU devices{' (isolated)' if args.isolate else ''}, "
          f"checkpoints and shared executable cache in the emulator's bucket, {machine()}")
    print(f"cold: {runs[0]['start_to_first_step_s']:.2f} s")
    if warm:
        print(f"warm: median {statistics.median(warm):.2f} s of {len(warm)} "
              f"({', '.join(f'{w:.2f}' for w in warm)})")
    write_result(args.out, {"date": time.strftime("%Y-%m-%d"), "machine": machine(),
                            "hosts": args.hosts, "isolate": args.isolate, "runs": runs,
                            "cold_s": runs[0]["start_to_first_step_s"],
                            "warm_median_s": statistics.median(warm) if warm else None})
    return 0


if __name__ == "__main__":
    sys.exit(main())
