"""One process of a multi-process executable-cache test (run by
tests/test_compile_cache.py): compiles a sharded function with collectives
through `WorkerContext.compile` and runs it.

    compile_worker.py OUT_PREFIX [--own-dir]   (writes OUT_PREFIX.<process index>.json)

With --own-dir each process caches in ELASTIC_CACHE_DIR/<host id>: hosts that
share no directory.

The environment is what an agent would set (ELASTIC_*, JAX_COORDINATOR_ADDRESS,
ELASTIC_CACHE_DIR).
"""

from __future__ import annotations

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import elastic.worker


def main() -> int:
    if "--own-dir" in sys.argv:
        os.environ["ELASTIC_CACHE_DIR"] = os.path.join(os.environ["ELASTIC_CACHE_DIR"],
                                                       os.environ["ELASTIC_HOST_ID"])
    ctx = elastic.worker.init()
    mesh = ctx.mesh
    x_sharding, w_sharding = NamedSharding(mesh, P("data", "model")), NamedSharding(mesh, P("model"))

    def f(x, w):  # a contraction over the model axis and a sum over everything: collectives
        return jnp.tanh(x @ w).sum()

    lowered = jax.jit(f, out_shardings=NamedSharding(mesh, P())).lower(
        jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=x_sharding),
        jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=w_sharding))
    compiled, hit, _ = ctx.compile(lowered, "f")
    xg = np.arange(64, dtype=np.float32).reshape(8, 8) / 64
    wg = np.eye(8, dtype=np.float32) * 0.5 + 0.01
    x = jax.make_array_from_callback((8, 8), x_sharding, lambda i: xg[i])
    w = jax.make_array_from_callback((8, 8), w_sharding, lambda i: wg[i])
    result = float(compiled(x, w))
    with open(f"{sys.argv[1]}.{ctx.process_index}.json", "w") as out:
        json.dump({"hit": hit, "result": result, "expected": float(np.tanh(xg @ wg).sum())}, out)
    ctx.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
