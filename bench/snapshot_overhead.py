"""Benchmark: what local snapshots cost the training loop (workers/lm, 4 local
hosts x 2 CPU devices): the mean step time over steps `--from` to `--steps`
(process 0's own step ends: every step's share of the time, the snapshot
steps' too) with a snapshot every `--every` steps against none, each
interval with every snapshot also sent to a buddy host's agent
(restart.replicate_snapshots, the default) and, with `--replicas-off-too`,
without; in alternating runs (this machine is shared: the ratio of the
rounds' medians is the figure, not one run); the median step beside it
(which leaves the snapshot steps out); and how long a snapshot blocks the
training loop (process 0's median, from its checkpoint saves' reports).

    .venv/bin/python bench/snapshot_overhead.py --rounds 3 --every 10 --replicas-off-too
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

from common import add_keep_flag, lm_job, machine, run_in_one_generation, step_window, work_dir, \
    write_result

from elastic.config import load_spec
from elastic.local import start_slice

REPO = pathlib.Path(__file__).resolve().parent.parent


def run(every: int, hosts: int, steps: int, first: int, replicas: bool = True,
        mesh: str = "data=-1,model=2", keep: bool = False
        ) -> tuple[float, float, list[float]]:
    """One job of `steps` steps with `--snapshot-every every` (and
    `replicas`: each sent to a buddy host), to its end in one generation:
    (the mean and the median step time over steps [first, steps), seconds,
    from process 0's step ends; the snapshot times, seconds, process 0
    reported with its checkpoint saves from step `first` on). Its working
    directory is removed at the end unless `keep`. Raises RuntimeError when
    the job fails or restarts."""
    with work_dir("elastic-snapbench-", keep) as work:
        times = work / "step-times.json"
        spec_path = lm_job(work, "snapbench", hosts, worker_args=(
            "--snapshot-every", str(every), "--steps", str(steps), "--step-times", str(times)),
            extra=f"replicate_snapshots = {str(replicas).lower()}", mesh=mesh)
        state = work / "state"
        local = start_slice(str(spec_path), load_spec(spec_path), hosts, 2, state)
        journal = run_in_one_generation(local, timeout_s=900)
        mean, median = step_window(times, first)
        return mean, median, [e["snapshot_s"] for e in journal if e["kind"] == "checkpoint_saved"
                              and e["step"] >= first and "snapshot_s" in e]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--from", dest="first", type=int, default=50,
                        help="first step of the window (after compile and warm-up)")
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
    if not 1 <= args.first < args.steps - 1:
        parser.error("--from must lie within the run, two steps before its end")
    means: dict[str, list[float]] = {label: [] for label, _, _ in settings}
    medians: dict[str, list[float]] = {label: [] for label, _, _ in settings}
    blocking: dict[str, list[float]] = {label: [] for label, _, _ in settings}
    for r in range(args.rounds):
        for label, every, replicas in settings:
            mean, median, snaps = run(every, args.hosts, args.steps, args.first, replicas,
                                      args.mesh, args.keep)
            means[label].append(mean)
            medians[label].append(median)
            blocking[label] += snaps
            print(f"round {r + 1}: snapshot {label}: mean step {mean:.4f} s, median "
                  f"{median:.4f} s (steps {args.first}-{args.steps - 1})"
                  + (f", a snapshot blocks {1000 * statistics.median(snaps):.1f} ms"
                     if snaps else ""), flush=True)
    base = statistics.median(means["none"])
    base_median = statistics.median(medians["none"])
    print(f"\n{args.hosts} hosts x 2 CPU devices, mesh {args.mesh}, {args.rounds} rounds, "
          f"{machine()}")
    print(f"without snapshots: mean step {base:.4f} s, median {base_median:.4f} s "
          f"(medians of the rounds)")
    rows = {}
    for label, every, replicas in settings[1:]:
        mean, med = statistics.median(means[label]), statistics.median(medians[label])
        block = statistics.median(blocking[label]) if blocking[label] else None
        rows[label] = {"every": every, "replicas": replicas, "mean_step_s": mean,
                       "ratio": mean / base, "median_step_s": med,
                       "median_ratio": med / base_median, "snapshot_blocking_s": block,
                       "rounds_mean_step_s": means[label]}
        print(f"a snapshot {label:>22}: mean step {mean:.4f} s -> x{mean / base:.3f} "
              f"({100 * (mean / base - 1):+.1f} %; median step {100 * (med / base_median - 1):+.1f}"
              f" %); a snapshot blocks {1000 * (block or 0):.1f} ms "
              f"({100 * (block or 0) / (every * base):.2f} % of {every} steps)")
    write_result(args.out, {"date": time.strftime("%Y-%m-%d"), "machine": machine(),
                            "hosts": args.hosts, "rounds": args.rounds, "mesh": args.mesh,
                            "steps": [args.first, args.steps],
                            "mean_step_s_without": base, "median_step_s_without": base_median,
                            "rounds_mean_step_s_without": means["none"], "settings": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
