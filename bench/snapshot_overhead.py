"""Benchmark: what local snapshots cost the training loop (workers/lm, 4 local
hosts x 2 CPU devices): the median step time with a snapshot every `--every`
steps against none, each interval with every snapshot also sent to a buddy
host's agent (restart.replicate_snapshots, the default) and, with
`--replicas-off-too`, without; in alternating runs (this machine is shared:
the ratio of medians is the figure, not one run); and how long a snapshot
blocks the training loop (process 0's median).

    .venv/bin/python bench/snapshot_overhead.py --rounds 3 --every 10 --replicas-off-too
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

from common import add_keep_flag, lm_job, machine, work_dir, write_result

from elastic.config import load_spec
from elastic.controller.journal import read_journal
from elastic.controller.status import fetch_status, slice_step
from elastic.local import start_slice, stop_slice

REPO = pathlib.Path(__file__).resolve().parent.parent


def run(every: int, hosts: int, steps: int, replicas: bool = True,
        mesh: str = "data=-1,model=2", keep: bool = False) -> tuple[list[float], list[float]]:
    """One job with `--snapshot-every every` (and `replicas`: each sent to a
    buddy host); the median step times and snapshot times (s, over the last
    50 steps) process 0 reported with its saves after step 50. Its working
    directory is removed at the end unless `keep`."""
    with work_dir("elastic-snapbench-", keep) as work:
        spec_path = lm_job(work, "snapbench", hosts, worker_args=("--snapshot-every", str(every)),
                           extra=f"replicate_snapshots = {str(replicas).lower()}", mesh=mesh)
        state = work / "state"
        local = start_slice(str(spec_path), load_spec(spec_path), hosts, 2, state)
        try:
            deadline = time.monotonic() + 600
            while slice_step(fetch_status(local.address, local.tls)) < steps:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the job did not reach step {steps}")
                time.sleep(0.5)
        finally:
            stop_slice(local)
        saves = [e for e in read_journal(state)
                 if e["kind"] == "checkpoint_saved" and e.get("step_time_s") and e["step"] >= 50]
        return ([e["step_time_s"] for e in saves],
                [e["snapshot_s"] for e in saves if "snapshot_s" in e])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--every", type=int, nargs="+", default=[1, 10],
                        help="snapshot intervals (steps) to compare with none")
    parser.add_argument("--mesh", default="data=-1,model=2",
                        help="the job's mesh, axes in order (model=4,data=-1: 'model' across "
                             "hosts, so each host's snapshot is replicated to its buddy; under "
                             "the default every host holds the whole state and none is)")
    parser.add_argument("--replicas-off-too", action="store_true",
                        help="run every interval also with restart.replicate_snapshots = false")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "snapshot_overhead.json"))
    add_keep_flag(parser)
    args = parser.parse_args()
    # (label, interval, replicas)
    settings = [("none", 0, False)]
    for every in args.every:
        if args.replicas_off_too:
            settings.append((f"every {every}, no replicas", every, False))
        settings.append((f"every {every}" + (", replicas" if args.replicas_off_too else ""),
                         every, True))
    times: dict[str, list[float]] = {label: [] for label, _, _ in settings}
    blocking: dict[str, list[float]] = {label: [] for label, _, _ in settings}
    for r in range(args.rounds):
        for label, every, replicas in settings:
            steps, snaps = run(every, args.hosts, args.steps, replicas, args.mesh, args.keep)
            times[label] += steps
            blocking[label] += snaps
            print(f"round {r + 1}: snapshot {label}: median step "
                  f"{statistics.median(steps):.4f} s ({len(steps)} saves)"
                  + (f", a snapshot blocks {1000 * statistics.median(snaps):.1f} ms"
                     if snaps else ""), flush=True)
    base = statistics.median(times["none"])
    print(f"\n{args.hosts} hosts x 2 CPU devices, mesh {args.mesh}, {args.rounds} rounds, "
          f"{machine()}")
    print(f"median step time without snapshots: {base:.4f} s")
    rows = {}
    for label, every, replicas in settings[1:]:
        med = statistics.median(times[label])
        block = statistics.median(blocking[label]) if blocking[label] else None
        rows[label] = {"every": every, "replicas": replicas, "median_step_s": med,
                       "ratio": med / base, "snapshot_blocking_s": block}
        print(f"a snapshot {label:>22}: median step {med:.4f} s -> x{med / base:.3f} "
              f"({100 * (med / base - 1):+.1f} %); a snapshot blocks "
              f"{1000 * (block or 0):.1f} ms ({100 * (block or 0) / (every * base):.2f} % of "
              f"{every} steps)")
    write_result(args.out, {"date": time.strftime("%Y-%m-%d"), "machine": machine(),
                            "hosts": args.hosts, "rounds": args.rounds, "mesh": args.mesh,
                            "median_step_s_without": base, "settings": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
