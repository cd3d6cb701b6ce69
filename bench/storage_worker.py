"""Helper of bench/checkpoint_storage.py: one JAX process (2 CPU devices)
saves a state of a given size to a checkpoint directory `--trials` times
through elastic.checkpoint.Checkpoints (Orbax, async), and restores it;
prints one JSON line with the seconds of each phase. A save and a restore
before the trials warm up (tracing, Orbax's and the storage client's first
use) and are not counted.

    storage_worker.py DIR BYTES TRIALS
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time


def main() -> int:
    directory, size, trials = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", ELASTIC_PROCESS_ID="0",
                      ELASTIC_NUM_PROCESSES="1", ELASTIC_GENERATION="1", ELASTIC_JOB_ID="bench",
                      ELASTIC_HOST_ID="h0", ELASTIC_MESH="data=-1", ELASTIC_CHECKPOINT_DIR=directory,
                      ELASTIC_DEVICES_PER_HOST="2")
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    import elastic.worker

    ctx = elastic.worker.init()
    rows = max(2, size // 4 // 1024 // 2 * 2)  # float32 [rows, 1024], rows even
    sharding = NamedSharding(ctx.mesh, P("data"))
    ckpt = ctx.checkpoints(interval_steps=1, max_to_keep=2, snapshot_every=0)
    saves, commits, restores = [], [], []
    for step in range(trials + 1):  # (step 0: the warm-up)
        # random values: a constant array would compress to nothing
        state = {"w": jax.jit(lambda: jax.random.normal(jax.random.key(step), (rows, 1024)),
                              out_shardings=sharding)()}
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        assert ckpt.save(step, state, {"step": step}, force=True)
        blocked_s = time.perf_counter() - t0
        ckpt.wait()
        if step:
            saves.append(blocked_s)
            commits.append(time.perf_counter() - t0)
    abstract = {"w": jax.ShapeDtypeStruct((rows, 1024), jnp.float32, sharding=sharding)}
    for trial in range(trials + 1):  # (the first: the warm-up)
        t0 = time.perf_counter()
        restored = ckpt.restore_latest(abstract)
        jax.block_until_ready(restored.state)
        if trial:
            restores.append(time.perf_counter() - t0)
    print(json.dumps({"bytes": rows * 1024 * 4, "save_blocking_s": saves, "commit_s": commits,
                      "restore_s": restores}), flush=True)
    ctx.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
