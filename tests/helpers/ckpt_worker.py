"""One process of a multi-process JAX checkpoint test (run by tests/test_checkpoint.py).

    ckpt_worker.py save DIR STEP OUT.json [--kill-after-save]
    ckpt_worker.py train DIR STEPS INTERVAL OUT.json [--wait-each] [--leftovers-stay]
                   [--resume [--unlisted-on PROCESS:STEP]]
        (steps 0..STEPS-1, a save call each; --wait-each: and a wait for it;
        --leftovers-stay: removing the leftovers of saves cut short fails, as
        a storage outage would make it; --resume: from the step after the
        one restore_latest restores)
    ckpt_worker.py restore DIR OUT.json [--unreadable-on PROCESS:STEP] [--unlisted-on PROCESS:STEP]
        (--unreadable-on: that process alone fails to read that step, as a
        storage fault on one host would make it; --unlisted-on: that process
        alone does not list that step, as a stale listing would make it)

The process environment is what an agent would set (ELASTIC_*, JAX_COORDINATOR_ADDRESS).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import elastic.worker

SPECS = {"w": P("data", "model"), "b": P("model"), "r": P(), "step": P()}
if os.environ.get("CKPT_REPLICATED"):  # data parallelism: every host holds the whole state
    SPECS["w"] = P(None, "model")
SHAPES = {"w": ((120, 8), jnp.float32), "b": ((8,), jnp.float32), "r": ((3, 5), jnp.float32),
          "step": ((), jnp.int32)}
ODD = bool(os.environ.get("CKPT_ODD_LEAVES"))  # a typed PRNG key and a zero-size array too
if ODD:
    SPECS.update(rng=P(), pad=P())
    SHAPES.update(pad=((0, 4), jnp.float32))  # (and rng's, once JAX is up: main)


def make_state(step: int, big: bool) -> dict:
    key = jax.random.PRNGKey(step)
    state = {"w": jax.random.normal(key, (120, 8)), "b": jnp.arange(8.0) * step,
             "r": jnp.full((3, 5), float(step)), "step": jnp.int32(step)}
    if big:  # enough bytes that an async save is still running when the process dies
        state["big"] = jax.random.normal(key, (4096, 2048))
    if ODD:
        state["rng"], state["pad"] = jax.random.key(step), jnp.zeros((0, 4))
    return state


def checksums(state: dict) -> dict:
    out = {}
    for name, value in sorted(state.items()):
        if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
            value = jax.random.key_data(value)
        full = np.asarray(multihost_utils.process_allgather(value, tiled=True))
        out[name] = hashlib.sha256(full.tobytes()).hexdigest()
    return out


def unlist(ctx, ckpt) -> None:
    """--unlisted-on PROCESS:STEP: that process alone does not list that
    step, as a stale listing would make it (ours and Orbax's own)."""
    if "--unlisted-on" not in sys.argv:
        return
    process, step = sys.argv[sys.argv.index("--unlisted-on") + 1].split(":")
    if int(process) != ctx.process_index:
        return
    listed, orbax_listed = ckpt.committed_steps, ckpt.manager.all_steps
    ckpt.committed_steps = lambda: [s for s in listed() if s != int(step)]
    ckpt.manager.all_steps = lambda *a, **k: [s for s in orbax_listed(*a, **k) if s != int(step)]
    ckpt.manager.latest_step = lambda: max(ckpt.manager.all_steps(), default=None)


def main() -> int:
    mode = sys.argv[1]  # argv[2], the directory, is also in ELASTIC_CHECKPOINT_DIR
    if "--leftovers-stay" in sys.argv:
        from orbax.checkpoint._src.path import async_path

        remove = async_path.rmtree

        async def rmtree(path, *args, **kwargs):
            if ".orbax-checkpoint-tmp" in str(path):
                raise OSError(f"storage error removing {path}")
            return await remove(path, *args, **kwargs)
        async_path.rmtree = rmtree
    ctx = elastic.worker.init()
    if ODD:
        SHAPES["rng"] = ((), jax.random.key(0).dtype)
    mesh = ctx.mesh
    events = []
    interval = int(sys.argv[4]) if mode == "train" else 1
    ckpt = elastic.worker.runtime.WorkerContext.checkpoints(ctx, interval_steps=interval,
                                                            max_to_keep=5, snapshot_every=1)
    ckpt.on_event = lambda kind, reason, fields: events.append({"kind": kind, "reason": reason,
                                                                **fields})
    shardings = {k: NamedSharding(mesh, s) for k, s in SPECS.items()}
    if mode == "save":
        step, out = int(sys.argv[3]), sys.argv[4]
        kill = "--kill-after-save" in sys.argv
        big = kill
        specs = dict(SPECS, big=P("data", "model"))
        sh = {k: NamedSharding(mesh, specs[k]) for k in make_state(0, big)}
        state = jax.jit(lambda: make_state(step, big), out_shardings=sh)()
        assert ckpt.save(step, state, {"data_position": step + 1}, force=True)
        if kill:
            os.kill(os.getpid(), signal.SIGKILL)
        ckpt.wait()
        result = {"checksums": checksums(state), "committed": ckpt.committed_steps()}
    elif mode == "train":
        steps, out = int(sys.argv[3]), sys.argv[5]
        first = 0
        if "--resume" in sys.argv:
            unlist(ctx, ckpt)
            abstract = {k: jax.ShapeDtypeStruct(shape, dtype, sharding=shardings[k])
                        for k, (shape, dtype) in SHAPES.items()}
            first = ckpt.restore_latest(abstract).step + 1
        for step in range(first, steps):
            state = jax.jit(lambda step=step: make_state(step, False), out_shardings=shardings)()
            ckpt.save(step, state, {"data_position": step + 1})
            if "--wait-each" in sys.argv:  # every save ends before the next step
                ckpt.wait()
        ckpt.close()
        result = {"checksums": checksums(state), "committed": ckpt.committed_steps(),
                  "events": events, "restored": first - 1}
    else:
        out = sys.argv[3]
        if "--unreadable-on" in sys.argv:
            process, step = sys.argv[sys.argv.index("--unreadable-on") + 1].split(":")
            if int(process) == ctx.process_index:
                import orbax.checkpoint as ocp

                read = ocp.StandardCheckpointHandler.restore

                def unreadable(self, directory, *args, **kwargs):
                    if directory.parent.name == step:  # (DIR/STEP/state)
                        raise OSError(f"step {step} unreadable on process {process}")
                    return read(self, directory, *args, **kwargs)
                ocp.StandardCheckpointHandler.restore = unreadable
        unlist(ctx, ckpt)
        abstract = {k: jax.ShapeDtypeStruct(shape, dtype, sharding=shardings[k])
                    for k, (shape, dtype) in SHAPES.items()}
        restored = ckpt.restore_latest(abstract)
        result = {"step": restored.step, "meta": restored.meta,
                  "checksums": checksums(restored.state),
                  "specs": {k: str(v.sharding.spec) for k, v in restored.state.items()},
                  "types": {k: f"{v.dtype}{list(v.shape)}" for k, v in restored.state.items()},
                  "mesh": dict(mesh.shape), "events": events}
    if ctx.process_index == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    ctx.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
