"""Helper of bench/checkpoint_storage.py: one JAX process (2 CPU devices)
saves a state of a given size to a checkpoint directory `--trials` times
through elastic.checkpoint.Checkpoints (Orbax, async), and restores it;
prints one JSON line with the seconds of each phase.

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
    for step in range(trials):
        # random values: a constant array would compress to nothing
        state = {"w": jax.jit(lambda: jax.random.normal(jax.random.key(step), (rows, 1024)),
                              out_shardings=sharding)()}
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        assert ckpt.save(step, state, {"step": step}, force=True)
        saves.append(time.perf_counter() - t0)
        ckpt.wait()
        commits.append(time.perf_counter() - t0)
    abstract = {"w": jax.ShapeDtypeStruct((rows, 1024), jnp.float32, sharding=sharding)}
    for _ in range(trials):
        t0 = time.perf_counter()
        restored = ckpt.restore_latest(abstract)
        jax.block_until_ready(restored.state)
        restores.append(time.perf_counter() - t0)
    print(json.dumps({"bytes": rows * 1024 * 4, "save_blocking_s": saves, "commit_s": commits,
                      "restore_s": restores}), flush=True)
    ctx.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
