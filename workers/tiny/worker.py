"""A tiny non-JAX worker for trying the control plane and for its tests.

It counts steps (sleeping `--step-time-s` each), reports them to its agent,
and every `--checkpoint-every` steps process 0 commits the step to
`<checkpoint dir>/tiny-step.json` (written to a temporary file, then renamed,
so a crash never leaves a half-written one). A new generation resumes after
the last committed step. Exits 0 after `--steps` steps.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

from elastic.config import WorkerEnv
from elastic.worker import ProgressReporter


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--step-time-s", type=float, default=0.05)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--crash-on-start", action="store_true",
                        help="exit 1 before the first step (a crash loop)")
    parser.add_argument("--crash-on-host", default="",
                        help="on this host only, exit 3 after --crash-after-steps steps")
    parser.add_argument("--crash-after-steps", type=int, default=5)
    parser.add_argument("--ignore-sigterm", action="store_true",
                        help="ignore SIGTERM (only SIGKILL ends this worker)")
    parser.add_argument("--spawn-child", action="store_true",
                        help="start a long-lived child process (a grandchild of the agent)")
    args = parser.parse_args()
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.spawn_child:
        subprocess.Popen(["sleep", "1000"])

    env = WorkerEnv.from_environ()
    ckpt = pathlib.Path(env.checkpoint_dir) / "tiny-step.json"
    start = json.loads(ckpt.read_text())["step"] + 1 if ckpt.exists() else 0
    print(f"tiny worker: process {env.process_id}/{env.num_processes} generation "
          f"{env.generation}, coordinator {env.coordinator_address}, starting at step {start}",
          flush=True)
    if args.crash_on_start:
        print("tiny worker: crashing on purpose", file=sys.stderr, flush=True)
        return 1
    progress = ProgressReporter(env.progress_socket, env.generation)
    crash_at = start + args.crash_after_steps if env.host_id == args.crash_on_host else None
    for step in range(start, args.steps):
        if step == crash_at:
            print(f"tiny worker: crashing on purpose on {env.host_id}", file=sys.stderr, flush=True)
            return 3
        time.sleep(args.step_time_s)
        progress.step(step)
        if env.process_id == 0 and (step + 1) % args.checkpoint_every == 0:
            ckpt.parent.mkdir(parents=True, exist_ok=True)
            tmp = ckpt.with_suffix(".tmp")
            tmp.write_text(json.dumps({"step": step}))
            os.replace(tmp, ckpt)
            progress.committed(step)
    print(f"tiny worker: done at step {args.steps - 1}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
