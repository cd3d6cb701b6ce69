"""A byte-level decoder-only transformer, tensor-parallel on the 'model' axis.

Megatron-style layout: attention heads and the MLP's hidden units are split
over 'model' (column-parallel in, row-parallel out); the batch is split over
'data'. Embeddings and norms are replicated. Shapes: tokens int32 [B, L];
logits float32 [B, L, 256].
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

VOCAB = 256


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    d_model: int = 128
    heads: int = 4
    layers: int = 2
    mlp: int = 512
    seq_len: int = 128

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads


def param_specs(cfg: ModelConfig) -> dict:
    """PartitionSpecs of the parameters (same tree as `init_params`)."""
    layer = {"ln1": P(), "wqkv": P(None, None, "model", None), "wo": P("model", None, None),
             "ln2": P(), "w1": P(None, "model"), "w2": P("model", None)}
    return {"embed": P(), "pos": P(), "ln_f": P(), "layers": [dict(layer) for _ in range(cfg.layers)]}


def init_params(cfg: ModelConfig, key: jax.Array) -> dict:
    """Parameters (float32), scaled-normal initialised from `key`."""
    keys = iter(jax.random.split(key, 2 + 4 * cfg.layers))
    d, h, k, f = cfg.d_model, cfg.heads, cfg.head_dim, cfg.mlp

    def normal(shape, fan_in):
        return jax.random.normal(next(keys), shape, jnp.float32) / jnp.sqrt(fan_in)

    layers = [{"ln1": jnp.ones(d), "wqkv": normal((d, 3, h, k), d),
               "wo": normal((h, k, d), d) / jnp.sqrt(2 * cfg.layers),
               "ln2": jnp.ones(d), "w1": normal((d, f), d),
               "w2": normal((f, d), f) / jnp.sqrt(2 * cfg.layers)}
              for _ in range(cfg.layers)]
    return {"embed": normal((VOCAB, d), 1.0) * 0.02, "pos": normal((cfg.seq_len, d), 1.0) * 0.02,
            "ln_f": jnp.ones(d), "layers": layers}


def _rmsnorm(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def forward(params: dict, tokens: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Logits float32 [B, L, 256] for tokens int32 [B, L] (causal)."""
    length = tokens.shape[1]
    x = params["embed"][tokens] + params["pos"][:length]
    x = jax.lax.with_sharding_constraint(x, P("data", None, None))
    mask = jnp.tril(jnp.ones((length, length), bool))
    for layer in params["layers"]:
        h = _rmsnorm(x, layer["ln1"])
        q, k, v = jnp.einsum("bld,dthk->tblhk", h, layer["wqkv"])
        scores = jnp.einsum("blhk,bmhk->bhlm", q, k) / jnp.sqrt(cfg.head_dim)
        scores = jnp.where(mask, scores, -1e9)
        attn = jnp.einsum("bhlm,bmhk->blhk", jax.nn.softmax(scores, axis=-1), v)
        x = x + jnp.einsum("blhk,hkd->bld", attn, layer["wo"])
        h = _rmsnorm(x, layer["ln2"])
        x = x + jax.nn.gelu(h @ layer["w1"]) @ layer["w2"]
        x = jax.lax.with_sharding_constraint(x, P("data", None, None))
    return _rmsnorm(x, params["ln_f"]) @ params["embed"].T


def loss_fn(params: dict, inputs: jax.Array, targets: jax.Array, weights: jax.Array,
            cfg: ModelConfig) -> jax.Array:
    """Weighted mean over rows of the per-row mean token cross-entropy (nats).
    Rows with weight 0 (padding) do not count."""
    logits = forward(params, inputs, cfg)
    logp = jax.nn.log_softmax(logits, axis=-1)
    token_loss = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    row_loss = token_loss.mean(axis=-1)
    return jnp.sum(row_loss * weights) / jnp.maximum(jnp.sum(weights), 1.0)
