"""Benchmark: checkpoint save and restore on a local directory against a
GCS bucket (fake-gcs-server on loopback, elastic.checkpoint.emulator), with
0 and 50 ms added per request (elastic.checkpoint.faulty_storage: a
round trip to another zone), for the reference job's state (6.4 MB,
workers/lm's default model) and a 1 GiB state. One JAX process with 2 CPU
devices saves through elastic.checkpoint.Checkpoints (Orbax, async):
save blocking time (what the training loop waits), time to commit, and
restore time; medians of `--trials`.

    .venv/bin/python bench/checkpoint_storage.py --trials 3
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import uuid

from common import add_keep_flag, machine, work_dir, write_result

from elastic.checkpoint.emulator import GCSEmulator
from elastic.checkpoint.faulty_storage import FaultProxy

REPO = pathlib.Path(__file__).resolve().parent.parent
WORKER = REPO / "bench" / "storage_worker.py"
SIZES = {"reference (6.4 MB)": 6_400_000, "1 GiB": 1 << 30}


def run(directory: str, size: int, trials: int, env: dict) -> dict:
    out = subprocess.run([sys.executable, str(WORKER), directory, str(size), str(trials)],
                         env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"storage worker failed on {directory}:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--latencies-ms", type=float, nargs="+", default=[0.0, 50.0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--out", default=str(REPO / "bench" / "results" /
                                            "checkpoint_storage.json"))
    add_keep_flag(parser)
    args = parser.parse_args()
    rows = []
    with work_dir("elastic-storage-", args.keep) as work, GCSEmulator() as emulator, \
            FaultProxy(emulator.url) as proxy:
        for name in args.sizes:
            size = SIZES[name]
            targets = [("local dir", str(work / uuid.uuid4().hex), 0.0)]
            for latency in args.latencies_ms:
                bucket = emulator.create_bucket(f"bench-{uuid.uuid4().hex[:12]}")
                targets.append(("gs:// emulator", f"{bucket}/ckpt", latency))
            for target, directory, latency in targets:
                proxy.set(latency_s=latency / 1000)
                env = dict(os.environ, **proxy.env)
                result = run(directory, size, args.trials, env)
                row = {"state": name, "storage": target, "added_latency_ms": latency,
                       "bytes": result["bytes"],
                       **{k: round(statistics.median(result[k]), 3)
                          for k in ("save_blocking_s", "commit_s", "restore_s")}}
                rows.append(row)
                print(f"{name:20} {target:15} +{latency:4.0f} ms  save blocks "
                      f"{row['save_blocking_s']:7.3f} s  commit {row['commit_s']:7.3f} s  "
                      f"restore {row['restore_s']:7.3f} s", flush=True)
    write_result(args.out, {"date": __import__("datetime").date.today().isoformat(),
                            "machine": machine(), "trials": args.trials, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
