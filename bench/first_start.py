"""Benchmark: a job's first generation, start -> first step, cold and warm,
with checkpoints and the hosts' shared executable cache in a bucket.

Every run is a new job (a checkpoint prefix of its own: nothing to restore,
so the initial state is made, as at any job's start) on new hosts: `--hosts`
simulated hosts x 2 CPU devices, agents started with the run, each host's
own executable cache empty. All runs use one GCS emulator's bucket: the
first finds its `compile-cache/` empty (cold: process 0 compiles the train
step and the initial state, the other processes wait for its entries); the
`--warm` runs after it find them there (warm: every process loads them).
Per run, from the journal: controller_started -> generation_started (the
hosts registering; with --agents-stay, agents already up), then
generation_started -> first_progress (the controller's clock; the figure
the target is about), and where it went: `launch` (generation_started -> the
launch of process 0's worker: the agents' pre-started processes finishing
their imports, which start with the agents) and process 0's startup phases
(elastic.worker.runtime; `checkpoint_setup` holds Orbax's barrier, i.e.
waiting for the slowest process).

With `--agents-stay`, the hosts' agents are started once, with the first
job, and serve every job after it, as a deployment's agents (systemd units,
not pinned to a job) do: each next job is a new controller at the same
address with a journal in the same state directory
(elastic.local.controllers.start_next_job), and its workers start in the
processes the agents pre-started during the job before. Its own executable
cache and the bucket's stay warm as before; the first run is cold in both
modes.

    .venv/bin/python bench/first_start.py --warm 3 [--agents-stay] [--isolate]

Issue 19's target: warm <= 3 s.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import subprocess
import sys
import time

from common import add_keep_flag, lm_job, machine, run_in_one_generation, work_dir, write_result

from elastic.config import load_spec
from elastic.controller.journal import read_journal
from elastic.local import start_slice, stop_slice, surroundings
from elastic.local.controllers import start_next_job

REPO = pathlib.Path(__file__).resolve().parent.parent


def job_spec(work: pathlib.Path, index: int, hosts: int, steps: int) -> tuple[str, pathlib.Path]:
    """Run `index`'s job id and spec, every spec in one working directory
    (`work`/jobs, as one deployment's jobs in one place)."""
    jobs = work / "jobs"
    jobs.mkdir(exist_ok=True)
    job_id = f"first-{index}"
    # (min_hosts: all of them, a first start of this many hosts; agents that
    # stay come back to the next controller after their reconnect backoff,
    # and the job would start on the first ones and grow)
    return job_id, lm_job(jobs, job_id, hosts, worker_args=("--steps", str(steps)),
                          file_name=f"{job_id}.toml", min_hosts=hosts)


def figures(journal: list[dict]) -> dict:
    """A job's first generation's start figures from its journal (the
    entries since its controller started)."""
    controller = next(e for e in journal if e["kind"] == "controller_started")
    started = next(e for e in journal if e["kind"] == "generation_started")
    first = next(e for e in journal if e["kind"] == "first_progress")
    phases = next(e for e in journal if e["kind"] == "worker_phases")
    names = [k[:-2] for k in phases if k.endswith("_s") and k != "total_s"]
    split = {"launch": round(phases["launched_at"] - started["ts"], 3),
             **{name: phases[f"{name}_s"] for name in names}}
    return {"start_to_first_step_s": round(first["ts"] - started["ts"], 3), "phases": split,
            "controller_to_start_s": round(started["ts"] - controller["ts"], 3),
            "traced": phases.get("traced")}


def one_run(work: pathlib.Path, made, index: int, hosts: int, steps: int,
            timeout_s: float, previous=None, stay: bool = False) -> tuple[dict, object]:
    """Run a new job of `steps` steps: on new hosts, or with `previous` (the
    LocalSlice of the job before, ended) on its agents; in `made`
    (surroundings). Returns its figures and, with `stay`, its LocalSlice
    (its agents still running; else None: stopped). Raises RuntimeError
    when the job does not succeed in one generation within `timeout_s`."""
    job_id, spec_path = job_spec(work, index, hosts, steps)
    checkpoints = f"{made.checkpoint_dir.rsplit('/', 1)[0]}/{job_id}"
    if previous is None:
        state = work / f"run-{index}" / "state"
        state.parent.mkdir()
        local = start_slice(str(spec_path), load_spec(spec_path), hosts, 2, state,
                            checkpoint_dir=checkpoints, extra_env=made.extra_env, net=made.net,
                            shared_cache=made.shared_cache,
                            shared_cache_key=made.shared_cache_key, pin_job=not stay)
    else:
        local = start_next_job(previous, str(spec_path), checkpoints)
    if not stay:  # (run_in_one_generation stops it)
        journal = run_in_one_generation(local, timeout_s)
        return {"state": str(local.state_dir), **figures(journal)}, None
    try:
        local.controller.wait(timeout_s)  # (start_next_job refuses standbys: the only one)
    except subprocess.TimeoutExpired:
        stop_slice(local)
        raise RuntimeError(f"the job did not end within {timeout_s} s: {local.state_dir}") \
            from None
    journal = list(read_journal(local.state_dir))
    journal = journal[max(i for i, e in enumerate(journal) if e["kind"] == "controller_started"):]
    kinds = [e["kind"] for e in journal]
    if "job_succeeded" not in kinds or kinds.count("generation_started") != 1:
        stop_slice(local)
        raise RuntimeError(f"the run failed or restarted: {local.state_dir}")
    return {"state": str(local.state_dir), **figures(journal)}, local


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warm", type=int, default=3, help="warm runs after the cold one")
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--agents-stay", action="store_true",
                        help="the agents of the first job serve the next ones (a deployment's)")
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
        local = None
        try:
            for index in range(1 + args.warm):
                run, local = one_run(work, made, index, args.hosts, args.steps, args.timeout_s,
                                     local if args.agents_stay else None, args.agents_stay)
                run["kind"] = "cold" if index == 0 else "warm"
                runs.append(run)
                print(f"run {index + 1} ({run['kind']}): controller -> start "
                      f"{run['controller_to_start_s']:.2f} s, start -> first step "
                      f"{run['start_to_first_step_s']:.2f} s: " +
                      ", ".join(f"{k} {v:.2f}" for k, v in run["phases"].items()) +
                      f"; traced: {run['traced'] or 'none'}", flush=True)
        finally:
            if local is not None:
                stop_slice(local)
    warm = [r["start_to_first_step_s"] for r in runs[1:]]
    print(f"\n{args.hosts} hosts x 2 CPU devices{' (isolated)' if args.isolate else ''}, "
          f"checkpoints and shared executable cache in the emulator's bucket, "
          f"{'agents serving job after job' if args.agents_stay else 'new agents each job'}, "
          f"{machine()}")
    print(f"cold: {runs[0]['start_to_first_step_s']:.2f} s")
    if warm:
        print(f"warm: median {statistics.median(warm):.2f} s of {len(warm)} "
              f"({', '.join(f'{w:.2f}' for w in warm)})")
    write_result(args.out, {"date": time.strftime("%Y-%m-%d"), "machine": machine(),
                            "hosts": args.hosts, "isolate": args.isolate,
                            "agents_stay": args.agents_stay, "runs": runs,
                            "cold_s": runs[0]["start_to_first_step_s"],
                            "warm_median_s": statistics.median(warm) if warm else None})
    return 0


if __name__ == "__main__":
    sys.exit(main())
