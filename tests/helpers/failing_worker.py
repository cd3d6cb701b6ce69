"""A multi-process JAX worker that fails on purpose (run by
tests/test_worker_exit.py): every process sums an array across the slice in
a loop, reporting each step; on host `--fail-on-host`, after 10 steps,
generation 1 raises an exception nothing catches and generation 2 calls
sys.exit(3) (both before `finish()`). Before failing it prints
`failing at <Unix time>` on stderr. Otherwise it ends with `finish()`
after `--steps` steps.
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
    x = jax.make_array_from_callback((len(jax.devices()),), spread, lambda idx: jnp.ones((1,)))
    step_fn = jax.jit(lambda a: a * 0.5 + a.sum() / a.size, out_shardings=spread)
    for step in range(args.steps):
        x = step_fn(x)
        float(x.sum())  # (a collective every step: the peers wait for one another)
        ctx.step_done(step)
        time.sleep(0.05)
        if ctx.env.host_id == args.fail_on_host and step == 10:
            print(f"failing at {time.time():.3f}", file=sys.stderr, flush=True)
            if ctx.generation == 1:
                raise ValueError("failing on purpose")
            sys.exit(3)
    ctx.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
