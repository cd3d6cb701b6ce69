"""A snapshot sent from one process to the rest of a new slice over the
network, so that a host without one (a newcomer, a restarted host, a host
that was cut off and missed a generation) resumes from the step its peers
hold instead of sending every process back to the last committed checkpoint.

The source is a process whose snapshot holds every leaf whole
(elastic.checkpoint.snapshot.whole). It sends the leaves' bytes through one
compiled collective over a mesh of one device per process: every process
puts a row of bytes on its device, zeros but on the source, and the sum of
the rows comes back on every device. A sum of unsigned bytes where all but
one row are zero is that row, bit for bit, whatever the leaves' dtypes. The
transfer goes where JAX's collectives go between hosts (gloo over TCP on
CPU, the data-centre network between TPU slices), never through shared
memory or a shared disk. The idea is Orbax's emergency checkpointing
(orbax.checkpoint.experimental.emergency), where a replica that lost its
local checkpoint gets it broadcast from a replica that has one.

Cost: the state's bytes once per process in host memory, twice on the
device; one compile of a small sum per state size. Sending a sharded
state's pieces to the hosts that need them (buddy replication across
failure domains) is not here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from elastic.checkpoint.snapshot import Snapshot, needed_regions


def _one_device_per_process() -> list:
    import jax

    first: dict[int, Any] = {}
    for device in jax.devices():
        if device.process_index not in first or device.id < first[device.process_index].id:
            first[device.process_index] = device
    return [first[p] for p in sorted(first)]


def _sum_rows(row: np.ndarray) -> np.ndarray:
    """Every process's `row` (uint8, one length everywhere) summed over
    processes: a collective every process of the slice calls."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = _one_device_per_process()
    mesh = Mesh(np.array(devices), ("processes",))
    mine = next(d for d in devices if d.process_index == jax.process_index())
    rows = jax.make_array_from_single_device_arrays(
        (len(devices), row.size), NamedSharding(mesh, PartitionSpec("processes")),
        [jax.device_put(row[None], mine)])
    with jax.set_mesh(mesh):  # not the training mesh a caller may have set
        summed = jax.jit(lambda x: jnp.sum(x, axis=0, dtype=jnp.uint8),
                         out_shardings=NamedSharding(mesh, PartitionSpec()))(rows)
    return np.asarray(summed.addressable_data(0))


def send_whole(whole: Snapshot | None, abstract_state: Any, source: int,
               own: Snapshot | None = None) -> Snapshot:
    """Send the source's whole snapshot to every process (collective: every
    process of the slice calls it, with the same `source`, the process
    index that sends). `whole`: this process's whole snapshot of the step
    (required on the source); `own`: a snapshot of the step this process
    can restore from itself, returned as it is (it still takes part).
    Returns the snapshot to restore (the received one has one whole shard
    per leaf), with `sent_by` = source. Raises ValueError when the
    source has no whole snapshot, and the collective's error
    (XlaRuntimeError) when a process fails or is gone."""
    import jax
    import jax.numpy as jnp

    from elastic.worker.coordination import all_gather

    is_source = jax.process_index() == source
    if is_source and whole is None:
        raise ValueError(f"process {source} is to send a whole snapshot but holds none")
    needed = needed_regions(abstract_state)
    sizes = [int(np.prod(shape, dtype=np.int64)) * jnp.dtype(dtype).itemsize
             for shape, dtype, _ in needed.values()]
    row = np.zeros(sum(sizes), np.uint8)
    header = None
    if is_source:
        offset = 0
        for (name, _), size in zip(needed.items(), sizes):
            [(_, data)] = whole.leaves[name][2]
            row[offset:offset + size] = np.frombuffer(np.ascontiguousarray(data).tobytes(),
                                                      np.uint8)
            offset += size
        header = {"step": whole.step, "saved_at": whole.saved_at, "run_id": whole.run_id,
                  "meta": whole.meta}
    [sent] = [h for h in all_gather(f"snapshot-sent-{source}", header) if h is not None]
    received = _sum_rows(row)
    if own is not None:
        return dataclasses.replace(own, sent_by=source)
    leaves, offset = {}, 0
    for (name, (shape, dtype, _)), size in zip(needed.items(), sizes):
        data = np.frombuffer(received[offset:offset + size].tobytes(),
                             jnp.dtype(dtype)).reshape(shape)
        leaves[name] = (shape, dtype, [(tuple((0, dim) for dim in shape), data)])
        offset += size
    return Snapshot(sent["step"], sent["saved_at"], sent["run_id"], sent["meta"], leaves,
                    sent_by=source)
