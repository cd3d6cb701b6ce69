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
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import data as data_lib  # noqa: E402
import model as model_lib  # noqa: E402

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
    return p.parse_args()


def main() -> int:
    args = parse_args()
    ctx = elastic.worker.init()
    mesh, log = ctx.mesh, ctx.log
    cfg = model_lib.ModelConfig(d_model=args.d_model, layers=args.layers, seq_len=args.seq_len)
    data_shards = mesh.shape["data"]
    plan = plan_batch(ctx.env.batch.mode, data_shards, args.global_batch, args.per_device_batch,
                      ctx.env.batch.lr_scaling)
    corpus = data_lib.load_corpus(args.data)
    batches = data_lib.Batches(corpus.train, cfg.seq_len, plan.global_batch, args.seed)
    held_out = data_lib.Batches(corpus.held_out, cfg.seq_len, plan.global_batch, args.seed + 1)

    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.lr * plan.lr_multiplier, args.warmup_steps, max(args.steps, args.warmup_steps + 1),
        end_value=args.lr * plan.lr_multiplier * 0.1)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                            optax.adamw(schedule, b2=0.98, weight_decay=0.01))

    def init_state(seed):
        params = model_lib.init_params(cfg, jax.random.PRNGKey(seed))
        return {"params": params, "opt_state": optimizer.init(params), "ema": params,
                "step": jnp.zeros((), jnp.int32), "rng": jax.random.PRNGKey(seed + 1)}

    # shardings of the whole train state: optimizer moments follow their params
    pspecs = model_lib.param_specs(cfg)
    shapes = jax.eval_shape(init_state, args.seed)
    opt_specs = optax.tree_map_params(optimizer, lambda _, spec: spec, shapes["opt_state"], pspecs,
                                      transform_non_params=lambda _: P(),
                                      is_leaf=lambda x: isinstance(x, P))
    specs = {"params": pspecs, "opt_state": opt_specs, "ema": pspecs, "step": P(), "rng": P()}
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                             is_leaf=lambda x: isinstance(x, P))
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            shapes, shardings)
    batch_sharding = NamedSharding(mesh, P("data", None))
    weight_sharding = NamedSharding(mesh, P("data"))

    def train_step(state, inputs, targets, weights):
        loss, grads = jax.value_and_grad(model_lib.loss_fn)(state["params"], inputs, targets,
                                                            weights, cfg)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        ema = jax.tree.map(lambda e, p: args.ema_decay * e + (1 - args.ema_decay) * p,
                           state["ema"], params)
        rng, _ = jax.random.split(state["rng"])
        return {"params": params, "opt_state": opt_state, "ema": ema,
                "step": state["step"] + 1, "rng": rng}, loss

    with jax.set_mesh(mesh):
        step_fn = jax.jit(train_step, in_shardings=(shardings, batch_sharding, batch_sharding,
                                                    weight_sharding),
                          out_shardings=(shardings, NamedSharding(mesh, P())), donate_argnums=0)
        eval_fn = jax.jit(lambda params, i, t, w: model_lib.loss_fn(params, i, t, w, cfg),
                          out_shardings=NamedSharding(mesh, P()))

        def global_rows(rows):
            return [jax.make_array_from_callback(a.shape, s, lambda idx, a=a: a[idx])
                    for a, s in zip(rows, (batch_sharding, batch_sharding, weight_sharding))]

        rows_abstract = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh) for a, sh in
                         zip(batches.rows(0, plan.data_shards),
                             (batch_sharding, batch_sharding, weight_sharding))]
        step_fn, hit, seconds = ctx.compile(step_fn.lower(abstract, *rows_abstract), "train_step")
        log.info("%s the train step in %.2f s", "loaded" if hit else "compiled", seconds)
        ckpt = ctx.checkpoints(interval_steps=args.checkpoint_every, max_to_keep=args.max_to_keep,
                               snapshot_every=args.snapshot_every)
        restored = ckpt.restore_latest(abstract)
        if restored is None:  # (cached too: a slice that fails before its first commit
            # starts from scratch again, and compiling init costs seconds on 2 cores)
            init_fn, _, _ = ctx.compile(jax.jit(init_state, static_argnums=0,
                                                out_shardings=shardings).lower(args.seed),
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
        for step in range(start, args.steps):
            rows = batches.rows(step, plan.data_shards)
            state, loss = step_fn(state, *global_rows(rows))
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
                held = float(eval_fn(state["params"], *global_rows(held_out.rows(0, plan.data_shards))))
                ema_held = float(eval_fn(state["ema"], *global_rows(held_out.rows(0, plan.data_shards))))
                elapsed = time.perf_counter() - t_last
                log.info("step %d: loss %.4f, held-out %.4f (EMA %.4f), %.0f tokens/s", step,
                         loss_value, held, ema_held,
                         steps_since * plan.global_batch * cfg.seq_len / elapsed)
                t_last, steps_since = time.perf_counter(), 0
        log.info("done: step %d, loss %.4f", args.steps - 1, loss_value)
        ckpt.save(args.steps - 1, state, {"data_position": args.steps, "seed": args.seed,
                                          "mesh": dict(mesh.shape), "loss": loss_value}, force=True)
    ctx.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
