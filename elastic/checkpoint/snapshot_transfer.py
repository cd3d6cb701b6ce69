"""A snapshot step made up over the network from the parts the processes
of a new slice hold, so that a host without it (a newcomer, a restarted
host, a host that was cut off and missed a generation, a lost host's
replacement) resumes from the step its peers hold instead of sending every
process back to the last committed checkpoint.

The parts are each process's own snapshot and the replicas of peers'
snapshots its agent keeps (elastic.agent.replicas: every host's snapshot
also lives on a buddy host), so state sharded across hosts survives the
loss of a host as long as its buddy lives. snapshot.plan_assembly gives
every region of every leaf to one process. They send them through one
compiled collective over a mesh of one device per process: every process
puts a row of the whole state's bytes on its device, zeros but in the
regions it sends, and the sum of the rows comes back on every device. A sum
of unsigned bytes where all but one row are zero at each byte is that byte,
bit for bit, whatever the leaves' dtypes. The transfer goes where JAX's
collectives go between hosts (gloo over TCP on CPU, the data-centre network
between TPU slices), never through shared memory or a shared disk. The idea
is Orbax's emergency checkpointing (orbax.checkpoint.experimental.emergency),
where a replica that lost its local checkpoint gets it broadcast from a
replica that has one.

Cost: the whole state's bytes once per process in host memory, twice on
the device, whatever part of it a process needs: fine for the states this
project's hosts hold in memory anyway, wasteful for a model sharded over
hundreds of hosts (sending each process only its regions is the way on);
one compile of a small sum per state size.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from elastic.checkpoint.snapshot import Region, Snapshot, inside, needed_regions


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


def assemble(plan: dict[str, list[tuple[Region, int]]], held: list[Snapshot],
             abstract_state: Any, own: Snapshot | None = None) -> Snapshot:
    """Make up a snapshot step from the parts the processes hold
    (collective: every process of the slice calls it with the same `plan`,
    from snapshot.plan_assembly: per leaf, which process sends which
    region). `held`: this process's snapshots of the step (its own and
    replicas), where its assigned regions are found; `own`: a snapshot of
    the step it can restore from itself, returned as it is (it still takes
    part). Returns the snapshot to restore (an assembled one has one whole
    shard per leaf), with `sent_by` the sending processes and
    `replicas_of` the hosts whose replicas they sent from. Raises
    ValueError when this process lacks a region the plan gives it, and the
    collective's error (XlaRuntimeError) when a process fails or is gone."""
    import jax
    import jax.numpy as jnp

    from elastic.worker.coordination import all_gather

    me = jax.process_index()
    needed = needed_regions(abstract_state)
    sizes = [int(np.prod(shape, dtype=np.int64)) * jnp.dtype(dtype).itemsize
             for shape, dtype, _ in needed.values()]
    row = np.zeros(sum(sizes), np.uint8)
    offset, header, used = 0, None, set()
    for (name, (shape, dtype, _)), size in zip(needed.items(), sizes):
        full = row[offset:offset + size].view(jnp.dtype(dtype)).reshape(shape)
        for region, process in plan[name]:
            if process != me:
                continue
            snap, held_region, data = next(
                ((s, r, d) for s in held for r, d in s.leaves[name][2] if inside(region, r)),
                (None, None, None))
            if snap is None:
                raise ValueError(f"process {me} is to send {region} of {name} but holds none")
            full[tuple(slice(a, b) for a, b in region)] = data[tuple(
                slice(a - h, b - h) for (a, b), (h, _) in zip(region, held_region))]
            header = header or {"step": snap.step, "saved_at": snap.saved_at,
                                "run_id": snap.run_id, "meta": snap.meta}
            used.update(snap.replicas_of)
        offset += size
    gathered = all_gather("snapshot-assembled", {"header": header, "replicas": sorted(used)})
    senders = tuple(i for i, g in enumerate(gathered) if g["header"] is not None)
    replicas = tuple(sorted({h for g in gathered for h in g["replicas"]}))
    sent = gathered[senders[0]]["header"]
    received = _sum_rows(row)
    if own is not None:
        return dataclasses.replace(own, sent_by=senders, replicas_of=replicas)
    leaves, offset = {}, 0
    for (name, (shape, dtype, _)), size in zip(needed.items(), sizes):
        data = np.frombuffer(received[offset:offset + size].tobytes(),
                             jnp.dtype(dtype)).reshape(shape)
        leaves[name] = (shape, dtype, [(tuple((0, dim) for dim in shape), data)])
        offset += size
    return Snapshot(sent["step"], sent["saved_at"], sent["run_id"], sent["meta"], leaves,
                    sent_by=senders, replicas_of=replicas)
