"""Agreement among a generation's processes through the JAX coordination
service (its key-value store and barriers) instead of compiled collectives.

`jax.experimental.multihost_utils` (sync_global_devices, process_allgather)
builds arrays over every device and assumes each process has as many: it
fails when a host puts only some of its devices in the mesh (a host with
more devices than the slice's others, see elastic.policy.mesh). These need
no devices at all, and cost a few milliseconds of RPCs to process 0.
"""

from __future__ import annotations

import json
import time


def _client():
    from jax._src import distributed

    return distributed.global_state.client


def all_gather(name: str, own, timeout_s: float = 60.0) -> list:
    """Every process's `own` (any JSON value), in process order. `name` must
    be new for every gather within one distributed runtime. A single process
    gets [own]. Raises the coordination service's error (XlaRuntimeError)
    when a process does not arrive within `timeout_s` seconds."""
    import jax

    if jax.process_count() == 1:
        return [own]
    client = _client()
    prefix = f"elastic/gather/{name}/"
    client.key_value_set(prefix + str(jax.process_index()), json.dumps(own))
    client.wait_at_barrier(f"elastic-gather-{name}", int(timeout_s * 1000))
    values = {int(key.rsplit("/", 1)[-1]): json.loads(value)
              for key, value in client.key_value_dir_get(prefix)}
    return [values[i] for i in sorted(values)]


def barrier(name: str, timeout_s: float = 60.0) -> None:
    """Wait until every process has reached the barrier `name` (new within
    one distributed runtime); nothing to wait for with one process."""
    import jax

    if jax.process_count() > 1:
        _client().wait_at_barrier(name, int(timeout_s * 1000))


class BarrierAborted(RuntimeError):
    """A barrier given up because a process marked the operation failed."""


def mark(key: str, value: str) -> None:
    """Set `key` to `value` in the coordination service's key-value store
    (visible to every process; nothing to do with one process)."""
    import jax

    if jax.process_count() > 1:
        _client().key_value_set(key, value, allow_overwrite=True)


def abortable_barrier(name: str, timeout_s: float, abort_prefix: str,
                      clock=time.monotonic, sleep=time.sleep) -> None:
    """Wait until every process has arrived at barrier `name` (a counter in
    the key-value store; `name` must be new for every use), unless a key
    under `abort_prefix` appears first (a process gave the operation up,
    see `mark`): then raise BarrierAborted with its value. Raises
    TimeoutError after `timeout_s` seconds. Polls, from 1 ms up to every
    50 ms (~0.3 ms per poll on loopback).

    Why not the coordination service's own barrier: a process waiting at
    it cannot be told that a peer will never come; Orbax's commit barriers
    would then hold every other process's save for the whole save timeout
    after one process's write failed."""
    import jax

    count = jax.process_count()
    if count == 1:
        return
    client = _client()
    arrived = client.key_value_increment(name, 1)
    deadline = clock() + timeout_s
    delay = 0.001
    while arrived < count:
        aborted = client.key_value_dir_get(abort_prefix)
        if aborted:
            raise BarrierAborted(f"barrier {name} given up: {aborted[0][1]}")
        if clock() >= deadline:
            raise TimeoutError(f"barrier {name}: {arrived} of {count} processes arrived "
                               f"within {timeout_s:g} s")
        sleep(delay)
        delay = min(delay * 2, 0.05)
        arrived = client.key_value_increment(name, 0)
