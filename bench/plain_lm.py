"""The reference workload (workers/lm) as a JAX user runs it without elastic.

One process per host, started by hand or by a supervisor: jax.distributed
with explicit arguments and JAX's heartbeat timeout (10 s), an Orbax
CheckpointManager (async saves every --checkpoint-every steps, restore of
the latest at start, a save at JAX's preemption sync point: Orbax's own
`reached_preemption` check), and JAX's persistent compilation cache. The same
model, data, batch and train step (workers/lm/step.py) as workers/lm/train.py,
with nothing of elastic imported: no progress reports, no snapshots.

Used by bench/steady_state.py to measure what elastic.worker costs a step,
and by bench/vs_restart_all.py as the job a restart-all supervisor runs.

    python bench/plain_lm.py --process-id 0 --num-processes 4 \\
        --coordinator 127.0.0.1:8476 --checkpoint-dir /tmp/ckpt --steps 300
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

LM = pathlib.Path(__file__).resolve().parent.parent / "workers" / "lm"
sys.path.insert(0, str(LM))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--process-id", type=int, required=True)
    p.add_argument("--num-processes", type=int, required=True)
    p.add_argument("--coordinator", required=True, help="host:port of process 0's service")
    p.add_argument("--devices", type=int, default=2, help="CPU devices per process")
    p.add_argument("--model-axis", type=int, default=2)
    p.add_argument("--checkpoint-dir", required=True)
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--max-to-keep", type=int, default=3)
    p.add_argument("--compile-cache-dir", help="JAX's persistent compilation cache (default: none)")
    p.add_argument("--heartbeat-timeout-s", type=int, default=10)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup-steps", type=int, default=30)
    p.add_argument("--ema-decay", type=float, default=0.99)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-times", help="as workers/lm/train.py --step-times")
    p.add_argument("--progress-log", help="process 0 appends {step, ts, pid} here after "
                   "each step (ts: time.time(), seconds)")
    return p.parse_args(argv)


def main() -> int:
    args = parse_args()
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    if args.compile_cache_dir:
        jax.config.update("jax_compilation_cache_dir", args.compile_cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    jax.distributed.initialize(coordinator_address=args.coordinator,
                               num_processes=args.num_processes, process_id=args.process_id,
                               initialization_timeout=120,
                               heartbeat_timeout_seconds=args.heartbeat_timeout_s)
    import orbax.checkpoint as ocp

    import data as data_lib
    import model as model_lib
    import step as step_lib

    devices = args.num_processes * args.devices
    mesh = jax.make_mesh((devices // args.model_axis, args.model_axis), ("data", "model"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    data_shards = mesh.shape["data"]
    cfg = model_lib.ModelConfig()
    corpus = data_lib.load_corpus(None)
    batches = data_lib.Batches(corpus.train, cfg.seq_len, args.global_batch, args.seed)
    held_out = data_lib.Batches(corpus.held_out, cfg.seq_len, args.global_batch, args.seed + 1)
    optimizer = step_lib.make_optimizer(args.lr, args.warmup_steps, args.steps)
    manager = ocp.CheckpointManager(
        pathlib.Path(args.checkpoint_dir).resolve(),
        options=ocp.CheckpointManagerOptions(save_interval_steps=args.checkpoint_every,
                                             max_to_keep=args.max_to_keep))
    with jax.set_mesh(mesh):
        parts = step_lib.build(cfg, mesh, optimizer, args.seed, args.ema_decay)
        latest = manager.latest_step()
        if latest is None:
            state = jax.jit(parts.init_state, static_argnums=0,
                            out_shardings=parts.shardings)(args.seed)
            start = 0
        else:  # a checkpoint's step is the number of steps taken
            state = manager.restore(latest, args=ocp.args.StandardRestore(parts.abstract))
            start = latest
        step_ends: list[float] = []
        progress = open(args.progress_log, "a") if args.progress_log and args.process_id == 0 \
            else None
        loss = float("nan")
        for step in range(start, args.steps):
            state, loss_array = parts.jit_step(state, *parts.global_rows(
                batches.rows(step, data_shards)))
            loss = float(loss_array)
            if progress:
                progress.write(json.dumps({"step": step, "ts": time.time(),
                                           "pid": os.getpid()}) + "\n")
                progress.flush()
            manager.save(step + 1, args=ocp.args.StandardSave(state))
            if manager.reached_preemption(step + 1):
                manager.wait_until_finished()
                print(f"preempted: saved step {step + 1}", flush=True)
                return 0
            if (step + 1) % args.eval_every == 0:  # (a collective: every process)
                held, ema_held = parts.held_out_losses(state, held_out.rows(0, data_shards))
                if args.process_id == 0:
                    print(f"step {step}: loss {loss:.4f}, held-out {held:.4f} "
                          f"(EMA {ema_held:.4f})", flush=True)
            step_ends.append(time.perf_counter())
        manager.wait_until_finished()
        manager.close()
    if args.step_times and args.process_id == 0:
        pathlib.Path(args.step_times).write_text(json.dumps({"first_step": start,
                                                             "ends": step_ends}))
    print(f"done: step {args.steps - 1}, loss {loss:.4f}", flush=True)
    jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
