"""Batch size under resize: what each generation trains with.

Two modes, chosen in the job spec (`[batch] mode`):

- "global" (default): the global batch stays fixed whatever the host count.
  Each data shard takes its rows of the same global batch; when the 'data'
  axis does not divide it, rows are padded with zero weight, so the loss and
  gradients equal the unpadded mean. The samples of step s are a function of
  (seed, s) only.
- "per_device": every device keeps `per_device_batch` rows, so the global
  batch grows and shrinks with the slice, and the learning rate is scaled by
  (global / reference) ("linear", Goyal et al. 2017, "Accurate, Large
  Minibatch SGD") or by its square root ("sqrt", Krizhevsky 2014, "One weird
  trick"); the samples of a step then depend on the slice size.
"""

from __future__ import annotations

import dataclasses
import math

BATCH_MODES = ("global", "per_device")
LR_SCALINGS = ("linear", "sqrt")


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """global_batch: real rows per step; padded_batch: rows including zero-
    weight padding (a multiple of data_shards); lr_multiplier: factor on the
    tuned learning rate."""

    global_batch: int
    padded_batch: int
    data_shards: int
    lr_multiplier: float


def plan_batch(mode: str, data_shards: int, global_batch: int, per_device_batch: int = 1,
               lr_scaling: str = "linear", reference_batch: int | None = None) -> BatchPlan:
    """The batch of a generation whose mesh has `data_shards` on 'data'.

    reference_batch: the global batch the learning rate was tuned for
    (default `global_batch`). Raises ValueError on an unknown mode or scaling
    or a non-positive size."""
    if mode not in BATCH_MODES:
        raise ValueError(f"batch mode {mode!r}: expected one of {BATCH_MODES}")
    if lr_scaling not in LR_SCALINGS:
        raise ValueError(f"lr scaling {lr_scaling!r}: expected one of {LR_SCALINGS}")
    if min(data_shards, global_batch, per_device_batch) < 1:
        raise ValueError("data_shards, global_batch and per_device_batch must be >= 1")
    if mode == "global":
        padded = -(-global_batch // data_shards) * data_shards
        return BatchPlan(global_batch, padded, data_shards, 1.0)
    batch = per_device_batch * data_shards
    ratio = batch / (reference_batch or global_batch)
    return BatchPlan(batch, batch, data_shards,
                     ratio if lr_scaling == "linear" else math.sqrt(ratio))
