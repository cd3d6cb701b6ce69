"""A non-JAX worker that reports checkpoint events whose durations are not
numbers (`restore_s` null, `blocking_s` text; run by
tests/test_observability.py), then steps `--steps` steps and exits 0."""

from __future__ import annotations

import argparse
import sys
import time

from elastic.worker import ProgressReporter
from elastic.worker_env import WorkerEnv


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    env = WorkerEnv.from_environ()
    progress = ProgressReporter(env.progress_socket, env.generation)
    progress.event("checkpoint_restored", "restored step 0", step=0, restore_s=None)
    progress.event("checkpoint_saved", "save of step 0 started", step=0, blocking_s="0.5")
    for step in range(args.steps):
        time.sleep(0.02)
        progress.step(step)
    progress.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
