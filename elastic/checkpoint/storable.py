"""Leaves that checkpoints and snapshots cannot store as they are, made
storable and back again (functions of pytrees; elastic.checkpoint.manager
applies them around Orbax and the local snapshots).

- Typed PRNG keys (`jax.random.key`, dtype `key<impl>`) are stored as their
  key data (`jax.random.key_data`: uint32, the key's shape followed by the
  implementation's key shape, in the key's sharding) and wrapped again on
  restore with the implementation the abstract state names. Before, the
  snapshots could not size them (every restore raised, and a job holding one
  never started) and Orbax 0.12 restored them as raw uint32 arrays, silently
  another type (an audit of realistic training states found both).
- Zero-size arrays hold no data, and Orbax refuses to save them ("Cannot
  save arrays with zero size"): no checkpoint of such a state was ever
  committed. They are left out of what Orbax saves (None, an empty subtree)
  and made again, empty, from the abstract state on restore. The snapshots
  store them as they are.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp


def is_key(leaf: Any) -> bool:
    """Whether `leaf` (an array or a jax.ShapeDtypeStruct) holds typed PRNG keys."""
    dtype = getattr(leaf, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _empty(leaf: Any) -> bool:
    shape = getattr(leaf, "shape", None)
    return shape is not None and math.prod(shape) == 0


def unwrap_keys(tree: Any) -> Any:
    """`tree` with every typed key array replaced by its key data (the same
    tree when it holds none)."""
    if not any(is_key(leaf) for leaf in jax.tree.leaves(tree)):
        return tree
    return jax.tree.map(lambda x: jax.random.key_data(x) if is_key(x) else x, tree)


def unwrap_abstract(abstract: Any) -> Any:
    """`abstract` (a pytree of jax.ShapeDtypeStruct) as `unwrap_keys` stores
    it: a key leaf becomes uint32 of its shape + the key shape, in the same
    sharding (its trailing dimensions replicated)."""
    def stored(x: Any) -> Any:
        if not is_key(x):
            return x
        key_shape = x.dtype._impl.key_shape  # (the implementation's: (2,) for threefry)
        return jax.ShapeDtypeStruct(tuple(x.shape) + tuple(key_shape), jnp.uint32,
                                    sharding=getattr(x, "sharding", None))
    return jax.tree.map(stored, abstract)


def wrap_keys(tree: Any, abstract: Any) -> Any:
    """`tree`, restored from what `unwrap_abstract(abstract)` describes, with
    the key leaves of `abstract` wrapped again as typed keys of its
    implementation."""
    if not any(is_key(leaf) for leaf in jax.tree.leaves(abstract)):
        return tree
    return jax.tree.map(lambda a, x: jax.random.wrap_key_data(x, impl=a.dtype._impl)
                        if is_key(a) else x, abstract, tree)


def without_empty(tree: Any) -> Any:
    """`tree` (arrays or jax.ShapeDtypeStructs) with zero-size leaves replaced
    by None, for Orbax, which refuses to save them."""
    if not any(_empty(leaf) for leaf in jax.tree.leaves(tree)):
        return tree
    return jax.tree.map(lambda x: None if _empty(x) else x, tree)


def with_empty(tree: Any, abstract: Any) -> Any:
    """`tree`, restored from `without_empty(abstract)`, with the zero-size
    leaves of `abstract` made again (empty, of its dtype and sharding)."""
    if not any(_empty(leaf) for leaf in jax.tree.leaves(abstract)):
        return tree

    def made(a: Any, x: Any) -> Any:
        if not _empty(a):
            return x
        return jnp.zeros(a.shape, a.dtype, device=getattr(a, "sharding", None))
    return jax.tree.map(made, abstract, tree, is_leaf=lambda x: x is None)
