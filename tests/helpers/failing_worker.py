"""A multi-process JAX worker that fails on purpose (run by
tests/test_worker_exit.py): every process sums an array across the slice in
a loop, reporting each step. At the 10th step of a generation every process
starts a checkpoint save of it; right after, on host `--fail-on-host`,
generation 1 raises an exception nothing catches and generation 2 calls
sys.exit(3) (both before `finish()`), first printing `failing at <Unix
time>` on stderr. A generation resumes from the newest committed step.
Otherwise it ends with `finish()` after `--steps` steps.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import elastic.worker


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fail-on-host", default="host-1")
    parser.add_argument("--steps", type=int, default=100000)
    args = parser.parse_args()
    ctx = elastic.worker.init()
    mesh = ctx.mesh
    spread = NamedSharding(mesh, P(mesh.axis_names))
    shape = (len(jax.devices()),)
    ckpt = ctx.checkpoints(interval_steps=10 ** 9, snapshot_every=0)
    restored = ckpt.restore_latest({"x": jax.ShapeDtypeStruct(shape, jnp.float32,
                                                              sharding=spread)})
    x = restored.state["x"] if restored else \
        jax.make_array_from_callback(shape, spread, lambda idx: jnp.ones((1,)))
    start = restored.step + 1 if restored else 0
    step_fn = jax.jit(lambda a: a * 0.5 + a.sum() / a.size, out_shardings=spread)
    for step in range(start, args.steps):
        x = step_fn(x)
        float(x.sum())  # (a collective every step: the peers wait for one another)
        ctx.step_done(step)
        time.sleep(0.05)
        if step == start + 10:
            ckpt.save(step, {"x": x}, {}, force=True)  # (asynchronous: in flight now)
            if ctx.env.host_id == args.fail_on_host:
                print(f"failing at {time.time():.3f}", file=sys.stderr, flush=True)
                if ctx.generation == 1:
                    raise ValueError("failing on purpose")
                sys.exit(3)
    ctx.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
