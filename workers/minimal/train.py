"""A complete, minimal elastic worker: linear regression, data-parallel.

Run it with `elasticd local --config workers/minimal/job.toml --hosts 2`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import elastic.worker

STEPS, BATCH = 200, 64
TRUE_W = np.arange(1.0, 9.0, dtype=np.float32)          # the weights to learn, [8]

ctx = elastic.worker.init()                               # distributed JAX + mesh
mesh = ctx.mesh                                           # axes from the job's [mesh]
replicated = NamedSharding(mesh, P())
rows = NamedSharding(mesh, P("data"))
optimizer = optax.adam(0.1)


def init_state():
    w = jnp.zeros(8)
    return {"w": w, "opt": optimizer.init(w), "step": jnp.int32(0)}


def batch(step):
    """The global batch of `step`: the same on any number of hosts."""
    rng = np.random.default_rng([0, step])
    x = rng.normal(size=(BATCH, 8)).astype(np.float32)
    return x, x @ TRUE_W


def train_step(state, x, y):
    loss, grad = jax.value_and_grad(lambda w: jnp.mean((x @ w - y) ** 2))(state["w"])
    updates, opt = optimizer.update(grad, state["opt"])
    return {"w": state["w"] + updates, "opt": opt, "step": state["step"] + 1}, loss


shapes = jax.eval_shape(init_state)
shardings = jax.tree.map(lambda _: replicated, shapes)
abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        shapes, shardings)
step_fn = jax.jit(train_step, in_shardings=(shardings, rows, rows),
                  out_shardings=(shardings, replicated))

ckpt = ctx.checkpoints(interval_steps=20)                 # async Orbax saves, every 20 steps
restored = ckpt.restore_latest(abstract)                  # latest committed, into this mesh
if restored:
    state, start = restored.state, restored.meta["next_step"]
else:
    state, start = jax.jit(init_state, out_shardings=shardings)(), 0
ctx.log.info("generation %d on %d processes, starting at step %d", ctx.generation,
             ctx.process_count, start)

for step in range(start, STEPS):
    x, y = (jax.make_array_from_callback(a.shape, rows, lambda idx, a=a: a[idx])
            for a in batch(step))
    state, loss = step_fn(state, x, y)
    ctx.step_done(step, loss=float(loss), steps_total=STEPS)  # progress to the controller
    ckpt.save(step, state, {"next_step": step + 1})

ckpt.save(STEPS - 1, state, {"next_step": STEPS}, force=True)  # the final state, committed
ctx.log.info("done: loss %.6f", float(loss))
ctx.finish()                                              # wait for the last save, leave together
