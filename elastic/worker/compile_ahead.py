"""Compiling a program ahead for the slice a restart would start next.

The first restart onto a slice shape not seen before compiles its train
step (~3.7 s for the reference model on 2 cores, against ~0.2–0.4 s to load
a cached one): issue 19 asks that host loss → first step cost no more than
detection + 0.5 s, including the first time the slice shrinks to a shape.
The controller names, in each start message, the slices its planner would
start if one failure domain were lost (elastic.policy.slice_plan.
next_slices); once the first step is done, process 0 lowers each program
the worker compiled with `ctx.compile(..., lower_for=...)` for those
slices' meshes and compiles it in a background thread, at idle CPU
priority, into the executable cache (elastic.worker.compile_cache), under
the key the next slice will look up.

A mesh of another slice is built from this slice's devices: the first
`process count` processes' (elastic.worker.runtime.build_mesh, the function
that builds every generation's mesh), assuming the next slice's processes
have as many devices each as this slice's processes of the same rank. The
executable is the same: an SPMD program is one for the whole slice, named
by its device ids, and JAX's CPU devices of process p are numbered
p × 2048 + local index whatever the slice's size (checked:
tests/test_compile_ahead.py compiles for 2 of 3 processes, loads the entry
in a 2-process slice and compares the results). Where the next slice's
devices are numbered otherwise, its key does not match and it compiles as
before: the entry is only wasted work, never a wrong executable, since the
key covers the program, every device id and the process count.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable

log = logging.getLogger("elastic.compile_ahead")


def slice_devices(devices: list, processes: int) -> list | None:
    """The devices (`jax.devices()` of this slice) of its first `processes`
    processes, in order: those of the next slice, as its own processes will
    number them; None when this slice has fewer processes."""
    chosen = [d for d in devices if d.process_index < processes]
    if len({d.process_index for d in chosen}) < processes:
        return None
    return chosen


def compile_for(next_slices, programs: list[tuple[Callable[[Any], Any], str, Any]], env,
                devices: list, idle: bool = True) -> list[dict]:
    """For each (process count, devices per host) of `next_slices` this
    slice can lay out, and each (lower_for, name, lowered) of `programs`
    (`lowered`: the program as this slice compiled it), make sure the
    executable cache holds the program compiled for that slice.

    First, at the thread's own priority: a note in the cache (written by an
    earlier generation that compiled ahead from the same program for the
    same slice) names an entry that is there: "present", nothing lowered;
    else the program is lowered for the slice's mesh and its entry looked
    up. Then, at SCHED_IDLE when `idle` (so that it takes only CPU the
    training leaves: on accelerators the host's cores are mostly free, on
    this project's 2-core CPU machine they are not), the missing ones are
    compiled and stored ("stored"). Lowering runs Python and holds the GIL,
    so it is not done at idle priority: an idle thread descheduled while
    holding the GIL would stall the training loop of its process; XLA's
    compile releases it.

    Returns one record per slice and program: {"slice": "PxD", "name",
    "outcome" ("stored", "present", "no cache", or "failed: ..."),
    "seconds"}. Never raises: a program that cannot be lowered or compiled
    for another mesh only means the restart compiles it."""
    from elastic.worker import compile_cache as cache
    from elastic.worker.runtime import build_mesh

    tiers = cache.cache_tiers(env.cache_dir, env.shared_cache, env.shared_cache_key_file)
    records, pending = [], []
    here, count = [d.id for d in devices], len({d.process_index for d in devices})
    for processes, per_host in next_slices:
        chosen = slice_devices(devices, processes)
        for lower_for, name, lowered in programs:
            record = {"slice": f"{processes}x{per_host}", "name": name, "outcome": "no cache",
                      "seconds": 0.0}
            records.append(record)
            t0 = time.perf_counter()
            try:
                if chosen is None:
                    record["outcome"] = "failed: fewer processes than the slice"
                elif tiers:
                    # (named after this slice's entry of the program)
                    note = f"{cache.entry_name(name, lowered, count, here)}.ahead-{record['slice']}"
                    known = cache.read_note(tiers, note)
                    if known and cache.holds(tiers, known):
                        record["outcome"] = "present"
                    else:
                        ahead = lower_for(build_mesh(chosen, per_host, env.mesh))
                        entry = cache.entry_name(name, ahead, processes, [d.id for d in chosen])
                        if cache.holds(tiers, entry):
                            cache.write_note(tiers, note, entry)
                            record["outcome"] = "present"
                        else:
                            pending.append((record, ahead, entry, note))
            except Exception as e:  # noqa: BLE001 - the program's own code ran
                record["outcome"] = "failed: " + f"{type(e).__name__}: {e}".splitlines()[0][:200]
            record["seconds"] = round(time.perf_counter() - t0, 3)
    if pending and idle:
        try:
            os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))
        except (OSError, AttributeError):
            pass
    for record, ahead, entry, note in pending:
        t0 = time.perf_counter()
        try:
            cache.compile_into(tiers, entry, ahead)
            cache.write_note(tiers, note, entry)
            record["outcome"] = "stored"
        except Exception as e:  # noqa: BLE001
            record["outcome"] = "failed: " + f"{type(e).__name__}: {e}".splitlines()[0][:200]
        record["seconds"] = round(record["seconds"] + time.perf_counter() - t0, 3)
    return records


def start(next_slices, programs, env, devices, report: Callable[[list[dict]], None],
          idle: bool = True) -> threading.Thread:
    """Run `compile_for` in a daemon thread, then `report(records)`.
    Returns the started thread."""

    def run() -> None:
        records = compile_for(next_slices, programs, env, devices, idle)
        for r in records:
            log.info("compiled ahead for %s: %s %s in %.2f s", r["slice"], r["name"],
                     r["outcome"], r["seconds"])
        report(records)

    thread = threading.Thread(target=run, name="elastic-compile-ahead", daemon=True)
    thread.start()
    return thread
