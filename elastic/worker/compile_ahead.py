"""Compiling a program ahead for the slice a restart would start next.

The first restart onto a slice shape not seen before compiles its train
step (~3.7 s for the reference model on 2 cores, against ~0.2–0.4 s to load
a cached one): issue 19 asks that host loss → first step cost no more than
detection + 0.5 s, including the first time the slice shrinks to a shape.
The controller names, in each start message, the slices its planner would
start if one failure domain were lost (elastic.policy.slice_plan.
next_slices); once the first step is done, process 0 lowers each program
the worker compiled with `ctx.compile(..., lower_for=...)` for those
slices' meshes and compiles it in a background thread into the executable
cache (elastic.worker.compile_cache), under the key the next slice will
look up.

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


#: Compiles for one program and next slice that may be started and not
#: finish (the generation ended first) before no more are tried: each costs
#: a compile's CPU beside the training.
MAX_ATTEMPTS = 2


def compile_for(next_slices, programs: list[tuple[Callable[[Any], Any], str, Any]], env,
                devices: list) -> list[dict]:
    """For each (process count, devices per host) of `next_slices` this
    slice can lay out, and each (lower_for, name, lowered) of `programs`
    (`lowered`: the program as this slice compiled it), make sure the
    executable cache holds the program compiled for that slice.

    A note in the cache, named after this slice's entry of the program and
    the next slice, names the entry an earlier generation stored: then it
    is "present" and nothing is lowered. Otherwise the program is lowered
    for the slice's mesh; an entry already there is "present", else it is
    compiled and stored ("stored"). XLA compiles on threads of its own, at
    the process's priority: the compile costs the host a compile's CPU
    beside the training (a thread of ours at idle priority would not make
    them idle). A compile cut short by the end of its generation is tried
    again by the next one, at most MAX_ATTEMPTS times in all ("skipped").

    Returns one record per slice and program: {"slice": "PxD", "name",
    "outcome" ("stored", "present", "skipped: ...", "no cache", or
    "failed: ..."), "seconds"}. Never raises: a program that cannot be
    lowered or compiled for another mesh only means the restart compiles
    it."""
    from elastic.worker import compile_cache as cache
    from elastic.worker.runtime import build_mesh

    tiers = cache.cache_tiers(env.cache_dir, env.shared_cache, env.shared_cache_key_file)
    records = []
    here, count = [d.id for d in devices], len({d.process_index for d in devices})
    for processes, per_host in next_slices:
        chosen = slice_devices(devices, processes)
        for lower_for, name, lowered in programs:
            record = {"slice": f"{processes}x{per_host}", "name": name, "outcome": "no cache"}
            records.append(record)
            t0 = time.perf_counter()
            try:
                if chosen is None:
                    record["outcome"] = "failed: fewer processes than the slice"
                elif tiers:
                    # (named after this slice's entry of the program)
                    note = f"{cache.entry_name(name, lowered, count, here)}.ahead-{record['slice']}"
                    record["outcome"] = _ensure(cache, tiers, note, lambda: cache_entry(
                        cache, name, lower_for(build_mesh(chosen, per_host, env.mesh)),
                        processes, chosen))
            except Exception as e:  # noqa: BLE001 - the program's own code ran
                record["outcome"] = "failed: " + f"{type(e).__name__}: {e}".splitlines()[0][:200]
            record["seconds"] = round(time.perf_counter() - t0, 3)
    return records


def cache_entry(cache, name: str, lowered, processes: int, devices: list) -> tuple[str, Any]:
    """(entry name, lowered) of `lowered` for the slice of `processes`
    processes whose devices are `devices`."""
    return cache.entry_name(name, lowered, processes, [d.id for d in devices]), lowered


def _ensure(cache, tiers: list, note: str, lower: Callable[[], tuple[str, Any]]) -> str:
    """The outcome for one program and next slice (see compile_for)."""
    known = cache.read_note(tiers, note)
    if known and cache.holds(tiers, known):
        return "present"
    entry, lowered = lower()
    if cache.holds(tiers, entry):
        cache.write_note(tiers, note, entry)
        return "present"
    tried = cache.read_note(tiers, note + ".attempts")
    attempts = int(tried) if tried and tried.isdigit() else 0
    if attempts >= MAX_ATTEMPTS:
        return f"skipped: {attempts} earlier compiles did not finish"
    cache.write_note(tiers, note + ".attempts", str(attempts + 1))
    cache.compile_into(tiers, entry, lowered)
    cache.write_note(tiers, note, entry)
    return "stored"


def start(next_slices, programs, env, devices,
          report: Callable[[list[dict]], None]) -> threading.Thread:
    """Run `compile_for` in a daemon thread, then `report(records)`.
    Returns the started thread."""

    def run() -> None:
        records = compile_for(next_slices, programs, env, devices)
        for r in records:
            log.info("compiled ahead for %s: %s %s in %.2f s", r["slice"], r["name"],
                     r["outcome"], r["seconds"])
        report(records)

    thread = threading.Thread(target=run, name="elastic-compile-ahead", daemon=True)
    thread.start()
    return thread
