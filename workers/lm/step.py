"""The train state, train step and eval of the reference workload, built for
one mesh. Shared by train.py (under elastic.worker) and bench/plain_lm.py
(the same step as a JAX user runs it without elastic), so that the two
compile the same computation.

State: {"params", "opt_state", "ema", "step" int32 [], "rng" key [2]}, with
the optimizer moments sharded like their params (model.param_specs).
Batch: (inputs int32 [B, L], targets int32 [B, L], weights float32 [B]),
rows split over the mesh's 'data' axis.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import model as model_lib


def make_optimizer(peak_lr: float, warmup_steps: int, steps: int) -> optax.GradientTransformation:
    """AdamW (b2 0.98, weight decay 0.01) after clipping the global norm at
    1.0, on a warmup-cosine schedule from 0 to `peak_lr` over `warmup_steps`
    and down to a tenth of it at `steps`."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, peak_lr, warmup_steps, max(steps, warmup_steps + 1), end_value=peak_lr * 0.1)
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(schedule, b2=0.98, weight_decay=0.01))


@dataclasses.dataclass
class TrainParts:
    """What a training loop needs for one mesh.

    init_state: seed -> the initial state (call under jax.jit with
      out_shardings=shardings; the seed is static).
    train_step: (state, inputs, targets, weights) -> (state, loss []), not
      yet jitted.
    jit_step: train_step jitted with the state donated.
    eval_loss: jitted (params, inputs, targets, weights) -> loss [].
    shardings / abstract: NamedShardings and ShapeDtypeStructs of the state
      (abstract is what a checkpoint restore needs).
    batch_shardings: of (inputs, targets, weights).
    """

    init_state: Callable[[int], dict]
    train_step: Callable
    jit_step: Any
    eval_loss: Any
    shardings: dict
    abstract: dict
    batch_shardings: tuple

    def global_rows(self, rows: tuple[np.ndarray, ...]) -> list[jax.Array]:
        """The host arrays of one batch (every process holds them whole) as
        global arrays sharded over 'data'."""
        return [jax.make_array_from_callback(a.shape, s, lambda idx, a=a: a[idx])
                for a, s in zip(rows, self.batch_shardings)]

    def held_out_losses(self, state: dict, rows: tuple[np.ndarray, ...],
                        eval_loss: Callable | None = None) -> tuple[float, float]:
        """The loss of the params and of their EMA on one held-out batch, by
        `eval_loss` (default: the jitted `self.eval_loss`; or the same
        compiled, see `lower_eval`)."""
        eval_loss = eval_loss or self.eval_loss
        batch = self.global_rows(rows)
        return float(eval_loss(state["params"], *batch)), float(eval_loss(state["ema"], *batch))

    def lower_eval(self, rows: tuple[np.ndarray, ...]):
        """eval_loss lowered for the params and one batch shaped as `rows`."""
        return self.eval_loss.lower(self.abstract["params"], *self.rows_abstract(rows))

    def rows_abstract(self, rows: tuple[np.ndarray, ...]) -> list[jax.ShapeDtypeStruct]:
        """ShapeDtypeStructs of one batch, for lowering the step."""
        return [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
                for a, s in zip(rows, self.batch_shardings)]


def build(cfg: model_lib.ModelConfig, mesh: jax.sharding.Mesh,
          optimizer: optax.GradientTransformation, seed: int, ema_decay: float) -> TrainParts:
    """The train state's shardings and the step for `mesh` (axes 'data' and
    'model'); call under `jax.set_mesh(mesh)`."""

    def init_state(seed):
        params = model_lib.init_params(cfg, jax.random.PRNGKey(seed))
        return {"params": params, "opt_state": optimizer.init(params), "ema": params,
                "step": jnp.zeros((), jnp.int32), "rng": jax.random.PRNGKey(seed + 1)}

    pspecs = model_lib.param_specs(cfg)
    found = {}

    def init_and_opt_specs(seed):
        # (the optimizer state's specs are found while tracing: optax maps
        # them by calling init, which outside a trace runs eagerly and
        # compiles each op it dispatches in every new process)
        state = init_state(seed)
        found["opt"] = optax.tree_map_params(optimizer, lambda _, spec: spec, state["opt_state"],
                                             pspecs, transform_non_params=lambda _: P(),
                                             is_leaf=lambda x: isinstance(x, P))
        return state

    shapes = jax.eval_shape(init_and_opt_specs, seed)
    opt_specs = found["opt"]
    specs = {"params": pspecs, "opt_state": opt_specs, "ema": pspecs, "step": P(), "rng": P()}
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                             is_leaf=lambda x: isinstance(x, P))
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            shapes, shardings)
    batch_sharding = NamedSharding(mesh, P("data", None))
    batch_shardings = (batch_sharding, batch_sharding, NamedSharding(mesh, P("data")))

    def train_step(state, inputs, targets, weights):
        loss, grads = jax.value_and_grad(model_lib.loss_fn)(state["params"], inputs, targets,
                                                            weights, cfg)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        ema = jax.tree.map(lambda e, p: ema_decay * e + (1 - ema_decay) * p, state["ema"], params)
        rng, _ = jax.random.split(state["rng"])
        return {"params": params, "opt_state": opt_state, "ema": ema,
                "step": state["step"] + 1, "rng": rng}, loss

    jit_step = jax.jit(train_step, in_shardings=(shardings, *batch_shardings),
                       out_shardings=(shardings, NamedSharding(mesh, P())), donate_argnums=0)
    eval_loss = jax.jit(lambda params, i, t, w: model_lib.loss_fn(params, i, t, w, cfg),
                        out_shardings=NamedSharding(mesh, P()))
    return TrainParts(init_state, train_step, jit_step, eval_loss, shardings, abstract,
                      batch_shardings)
