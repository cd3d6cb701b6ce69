"""One process of a multi-process executable-cache test (run by
tests/test_compile_cache.py): compiles a sharded function with collectives
through `WorkerContext.compile` and runs it.

    compile_worker.py OUT_PREFIX [--own-dir] [--ahead] [--bad-lower] [--lazy]
                      [--other-flags-on-1] [--no-cache-on-0]
    (writes OUT_PREFIX.<process index>.json)

With --own-dir each process caches in ELASTIC_CACHE_DIR/<host id>: hosts that
share no directory. With --ahead the function is compiled with `lower_for`,
and after its first step process 0 waits for the compile ahead for
ELASTIC_NEXT_SLICES (elastic.worker.compile_ahead) and records its outcome;
with --bad-lower, lowering for any other mesh raises. With --lazy the program
gives `WorkerContext.compile` its lowering function, not the lowered program
(elastic.worker.launch_memo), and records whether it was called ("traced").
With --other-flags-on-1 process 1 runs with XLA_FLAGS other than process
0's; with --no-cache-on-0 process 0 keeps no executable cache. Either way
process 1 waits at most 60 s for process 0 (not the 600 s of
SHARED_WAIT_S), and every process records the executable cache's warnings.

The environment is what an agent would set (ELASTIC_*, JAX_COORDINATOR_ADDRESS,
ELASTIC_CACHE_DIR).
"""

from __future__ import annotations

import json
import logging
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import elastic.worker
from elastic.worker import compile_cache


class Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def main() -> int:
    process = os.environ["ELASTIC_PROCESS_ID"]
    if "--own-dir" in sys.argv:
        os.environ["ELASTIC_CACHE_DIR"] = os.path.join(os.environ["ELASTIC_CACHE_DIR"],
                                                       os.environ["ELASTIC_HOST_ID"])
    if "--other-flags-on-1" in sys.argv or "--no-cache-on-0" in sys.argv:
        compile_cache.SHARED_WAIT_S = 60.0
    if "--other-flags-on-1" in sys.argv and process == "1":  # (the default's value, spelled out)
        os.environ["XLA_FLAGS"] = "--xla_cpu_enable_fast_math=false"
    if "--no-cache-on-0" in sys.argv and process == "0":
        del os.environ["ELASTIC_CACHE_DIR"]
    warnings = Warnings()
    logging.getLogger("elastic.compile_cache").addHandler(warnings)
    ctx = elastic.worker.init()
    mesh = ctx.mesh
    x_sharding, w_sharding = NamedSharding(mesh, P("data", "model")), NamedSharding(mesh, P("model"))

    def f(x, w):  # a contraction over the model axis and a sum over everything: collectives
        return jnp.tanh(x @ w).sum()

    lowered_meshes = []

    def lower_for(m):
        lowered_meshes.append(dict(m.shape))
        if "--bad-lower" in sys.argv and m is not mesh:
            raise ValueError("this program cannot be lowered for another mesh")
        return jax.jit(f, out_shardings=NamedSharding(m, P())).lower(
            jax.ShapeDtypeStruct((12, 8), jnp.float32, sharding=NamedSharding(m, P("data", "model"))),
            jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=NamedSharding(m, P("model"))))

    ahead = "--ahead" in sys.argv
    program = (lambda: lower_for(mesh)) if "--lazy" in sys.argv else lower_for(mesh)
    compiled, hit, _ = ctx.compile(program, "f", lower_for=lower_for if ahead else None)
    lowered_here = len(lowered_meshes)  # (0 or 1: compiling ahead starts later)
    xg = np.arange(96, dtype=np.float32).reshape(12, 8) / 96
    wg = np.eye(8, dtype=np.float32) * 0.5 + 0.01
    x = jax.make_array_from_callback((12, 8), x_sharding, lambda i: xg[i])
    w = jax.make_array_from_callback((8, 8), w_sharding, lambda i: wg[i])
    result = float(compiled(x, w))
    ahead_records = []
    if ahead:
        ctx.progress.event = lambda kind, reason, **fields: ahead_records.append(
            {"kind": kind, "reason": reason, **fields})
    ctx.step_done(0)
    if ctx.ahead_thread is not None:
        ctx.ahead_thread.join(120)
    with open(f"{sys.argv[1]}.{ctx.process_index}.json", "w") as out:
        json.dump({"hit": hit, "traced": lowered_here > 0, "result": result,
                   "expected": float(np.tanh(xg @ wg).sum()),
                   "ahead": ahead_records, "lowered_for": lowered_meshes[lowered_here:],
                   "warnings": warnings.messages}, out)
    ctx.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
