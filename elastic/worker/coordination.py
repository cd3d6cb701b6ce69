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
