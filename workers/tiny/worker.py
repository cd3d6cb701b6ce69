"""A tiny non-JAX worker for trying the control plane and for its tests.

It counts steps (sleeping `--step-time-s` each), reports them to its agent,
and every `--checkpoint-every` steps process 0 saves the step to
`<checkpoint dir>/tiny-step.json`: written to a temporary file, held for
`--save-time-s` (a save in flight), then renamed, so a crash never leaves a
half-written checkpoint in place. A gs:// checkpoint dir is the bucket's,
reached as the reference worker's Orbax reaches it (etils.epath over gcsfs):
hosts that share nothing but the bucket share its checkpoints, and no
others. A new generation resumes after the last
committed step. On SIGTERM (a preemption notice through its agent) it stops
stepping and waits to be stopped; process 0 first saves the step it reached
(tiny workers do not synchronise, unlike JAX's preemption sync point, so the
others may be a few steps ahead). Exits 0 after
`--steps` steps.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import signal
import subprocess
import sys
import time

from elastic.worker_env import WorkerEnv
from elastic.worker import ProgressReporter


def checkpoint_dir(directory: str):
    """The checkpoint directory as a path: pathlib's for a local one, the
    bucket's for gs:// (elastic.checkpoint.storage.resolve; imported only
    then, ~0.7 s)."""
    if directory.startswith("gs://"):
        from elastic.checkpoint.storage import resolve

        return resolve(directory)
    return pathlib.Path(directory)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--step-time-s", type=float, default=0.05)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--save-time-s", type=float, default=0.0,
                        help="how long a save stays in flight before its commit")
    parser.add_argument("--crash-on-start", action="store_true",
                        help="exit 1 before the first step (a crash loop)")
    parser.add_argument("--crash-on-host", default="",
                        help="on this host only, exit 3 after --crash-after-steps steps")
    parser.add_argument("--crash-after-steps", type=int, default=5)
    parser.add_argument("--crash-when-file", default="",
                        help="with --crash-on-host: exit 3 at the first step once this file "
                             "exists (a test's cue), instead of after --crash-after-steps")
    parser.add_argument("--finish-when-file", default="",
                        help="end as after the last step (exit 0) at the first step once this "
                             "file exists (a test's cue: with a large --steps, a job that "
                             "runs until the test is done with it)")
    parser.add_argument("--raise-on-host", default="",
                        help="on this host, in generation 1 only, raise an exception (a "
                             "traceback on stderr) after --crash-after-steps steps")
    parser.add_argument("--ignore-sigterm", action="store_true",
                        help="ignore SIGTERM (only SIGKILL ends this worker)")
    parser.add_argument("--spawn-child", action="store_true",
                        help="start a long-lived child process (a grandchild of the agent)")
    args = parser.parse_args()
    preempted: list[int] = []
    signal.signal(signal.SIGTERM, signal.SIG_IGN if args.ignore_sigterm
                  else lambda signum, frame: preempted.append(signum))
    if args.spawn_child:
        subprocess.Popen(["sleep", "1000"])

    env = WorkerEnv.from_environ()
    progress = ProgressReporter(env.progress_socket, env.generation)
    ckpt = checkpoint_dir(env.checkpoint_dir) / "tiny-step.json"
    start = json.loads(ckpt.read_text())["step"] + 1 if ckpt.exists() else 0
    print(f"tiny worker: process {env.process_id}/{env.num_processes} generation "
          f"{env.generation}, coordinator {env.coordinator_address}, starting at step {start}",
          flush=True)
    if env.process_id == 0 and start > 0:
        progress.event("checkpoint_restored", f"restored checkpoint step {start - 1}",
                       step=start - 1, restore_s=0.0)
    if args.crash_on_start:
        print("tiny worker: crashing on purpose", file=sys.stderr, flush=True)
        return 1

    def save(step: int, emergency: bool) -> None:
        progress.event("checkpoint_saved", f"{'emergency ' if emergency else ''}save of "
                       f"step {step} started", step=step, blocking_s=0.0,
                       step_time_s=args.step_time_s, preemption=emergency)
        ckpt.parent.mkdir(parents=True, exist_ok=True)
        tmp = ckpt.with_suffix(".tmp")
        tmp.write_text(json.dumps({"step": step}))
        time.sleep(args.save_time_s)
        tmp.replace(ckpt)
        progress.committed(step)

    crashes_here = env.host_id == args.crash_on_host
    cue = pathlib.Path(args.crash_when_file) if crashes_here and args.crash_when_file else None
    crash_at = start + args.crash_after_steps if crashes_here and cue is None else None
    finish = pathlib.Path(args.finish_when_file) if args.finish_when_file else None
    last = args.steps - 1
    for step in range(start, args.steps):
        if finish is not None and finish.exists():
            last = step - 1
            break
        if env.host_id == args.raise_on_host and env.generation == 1 and \
                step == start + args.crash_after_steps:
            raise RuntimeError(f"tiny worker: raised on purpose at step {step}")
        if step == crash_at or (cue is not None and cue.exists()):
            print(f"tiny worker: crashing on purpose on {env.host_id}", file=sys.stderr, flush=True)
            return 3
        time.sleep(args.step_time_s)
        progress.step(step)
        if preempted:  # only process 0 writes checkpoints; the others just stop stepping
            if env.process_id == 0:
                save(step, emergency=True)
            print(f"tiny worker: SIGTERM at step {step}, waiting to be stopped", flush=True)
            while True:
                time.sleep(1)
        if env.process_id == 0 and (step + 1) % args.checkpoint_every == 0:
            save(step, emergency=False)
    print(f"tiny worker: done at step {last}", flush=True)
    progress.close()  # (the last step again, should the agent have been too slow for it)
    return 0


if __name__ == "__main__":
    sys.exit(main())
