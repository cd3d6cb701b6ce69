"""Reference workload: a byte-level transformer that trains through failures.

Run under an elastic agent (e.g. `elasticd local --config workers/lm/job.toml`).
`elastic.worker` does the plumbing (distributed init, mesh, checkpoints,
progress); this script holds the model and the loop. Every generation
restores the latest committed checkpoint into its own mesh and continues at
the next step: params, optimizer state, EMA params, step, RNG and data
position are all in the checkpoint.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import jax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import data as data_lib  # noqa: E402
import model as model_lib  # noqa: E402
import step as step_lib  # noqa: E402

import elastic.worker  # noqa: E402
from elastic.worker.batch import plan_batch  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--per-device-batch", type=int, default=2,
                   help="rows per device in the job spec's batch.mode = per_device")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate at --global-batch")
    p.add_argument("--warmup-steps", type=int, default=30)
    p.add_argument("--ema-decay", type=float, default=0.99)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-every", type=int, default=100,
                   help="steps between persistent checkpoints (restarts mostly resume from "
                        "the local snapshots, every --snapshot-every steps)")
    p.add_argument("--max-to-keep", type=int, default=3)
    p.add_argument("--snapshot-every", type=int, default=10,
                   help="steps between local snapshots (restarts resume from them; 0: none)")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--data", nargs="*", help="text files or folders (default: the stdlib's .py)")
    p.add_argument("--sample-log", help="process 0 appends {generation, step, ids} per step here")
    p.add_argument("--step-times", help="process 0 writes here, at the end, the time.perf_counter() "
                   "at which each step's iteration ended: {first_step, ends} (bench/steady_state.py)")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    ctx = elastic.worker.init()
    mesh, log = ctx.mesh, ctx.log
    cfg = model_lib.ModelConfig(d_model=args.d_model, layers=args.layers, seq_len=args.seq_len)
    corpus = data_lib.load_corpus(args.data)

    def for_mesh(m):
        """(batch plan, train parts, a batch's rows) for mesh `m`: the batch
        and learning rate follow its 'data' axis."""
        p = plan_batch(ctx.env.batch.mode, m.shape["data"], args.global_batch,
                       args.per_device_batch, ctx.env.batch.lr_scaling)
        optimizer = step_lib.make_optimizer(args.lr * p.lr_multiplier, args.warmup_steps,
                                            args.steps)
        with jax.set_mesh(m):
            built = step_lib.build(cfg, m, optimizer, args.seed, args.ema_decay)
            rows = data_lib.Batches(corpus.train, cfg.seq_len, p.global_batch,
                                    args.seed).rows(0, p.data_shards)
            return p, built, rows

    def lower(built, rows):
        return built.jit_step.lower(built.abstract, *built.rows_abstract(rows))

    def lowered_step(m):
        """The train step lowered for mesh `m` (process 0 compiles it ahead
        for the meshes a lost host would leave)."""
        _, built, rows = for_mesh(m)
        with jax.set_mesh(m):
            return lower(built, rows)

    plan, parts, first_rows = for_mesh(mesh)
    batches = data_lib.Batches(corpus.train, cfg.seq_len, plan.global_batch, args.seed)
    held_out = data_lib.Batches(corpus.held_out, cfg.seq_len, plan.global_batch, args.seed + 1)

    with jax.set_mesh(mesh):
        abstract, shardings = parts.abstract, parts.shardings
        # (a function, not the lowered step: a restart launched as this
        # generation was loads the step without tracing it; the program is a
        # function of its arguments, its files and the mesh, which the memo's
        # key covers: elastic.worker.launch_memo)
        step_fn, hit, seconds = ctx.compile(lambda: lower(parts, first_rows), "train_step",
                                            lower_for=lowered_step)
        log.info("%s the train step in %.2f s", "loaded" if hit else "compiled", seconds)
        ckpt = ctx.checkpoints(interval_steps=args.checkpoint_every, max_to_keep=args.max_to_keep,
                               snapshot_every=args.snapshot_every)
        restored = ckpt.restore_latest(abstract)
        if restored is None:  # (cached too: a slice that fails before its first commit
            # starts from scratch again, and compiling init costs seconds on 2 cores)
            # (a function too: the next job of this program loads it untraced)
            init_fn, _, _ = ctx.compile(lambda: jax.jit(
                parts.init_state, static_argnums=0, out_shardings=shardings).lower(args.seed),
                "init_state")
            state = init_fn()
            start = 0
        else:
            state, start = restored.state, restored.meta["data_position"]
            assert int(state["step"]) == start, (int(state["step"]), start)
        log.info("generation %d: %d processes, mesh %s, global batch %d (padded %d), lr x%.3g, "
                 "starting at step %d%s", ctx.generation, ctx.process_count, dict(mesh.shape),
                 plan.global_batch, plan.padded_batch, plan.lr_multiplier, start,
                 f" (restored checkpoint step {restored.step})" if restored else "")
        sample_log = open(args.sample_log, "a") if args.sample_log and ctx.process_index == 0 else None
        t_last, steps_since = time.perf_counter(), 0
        loss_value = float("nan")
        step_ends = [] if args.step_times and ctx.process_index == 0 else None
        eval_fn = None  # (compiled at the first evaluation)
        for step in range(start, args.steps):
            rows = batches.rows(step, plan.data_shards)
            state, loss = step_fn(state, *parts.global_rows(rows))
            loss_value = float(loss)
            ctx.step_done(step, loss=loss_value, steps_total=args.steps)
            if sample_log:
                sample_log.write(json.dumps({"generation": ctx.generation, "step": step,
                                             "ids": batches.sample_ids(step).tolist(),
                                             "loss": loss_value}) + "\n")
                sample_log.flush()
            ckpt.save(step, state, {"data_position": step + 1, "seed": args.seed,
                                    "mesh": dict(mesh.shape), "loss": loss_value})
            steps_since += 1
            if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
                held_rows = held_out.rows(0, plan.data_shards)
                if eval_fn is None:  # (through the executable cache, as the train step:
                    # jitted alone it would compile again in every generation, on
                    # every process at once)
                    eval_fn, _, _ = ctx.compile(lambda: parts.lower_eval(held_rows), "eval_loss")
                held, ema_held = parts.held_out_losses(state, held_rows, eval_fn)
                elapsed = time.perf_counter() - t_last
                log.info("step %d: loss %.4f, held-out %.4f (EMA %.4f), %.0f tokens/s", step,
                         loss_value, held, ema_held,
                         steps_since * plan.global_batch * cfg.seq_len / elapsed)
                t_last, steps_since = time.perf_counter(), 0
            if step_ends is not None:
                step_ends.append(time.perf_counter())
        if step_ends is not None:
            pathlib.Path(args.step_times).write_text(json.dumps({"first_step": start,
                                                                 "ends": step_ends}))
        log.info("done: step %d, loss %.4f", args.steps - 1, loss_value)
        ckpt.save(args.steps - 1, state, {"data_position": args.steps, "seed": args.seed,
                                          "mesh": dict(mesh.shape), "loss": loss_value}, force=True)
    ctx.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
