"""Compiling a program ahead for the slice a restart would start next.

The first restart onto a slice shape not seen before compiles its train
step (1.8–2.1 s for the reference model on 4 processes on 2 cores, against
0.1–0.3 s to load a cached one; bench/recovery.py): issue 19 asks that host
loss → first step cost no more than detection + 0.5 s, including the first
time the slice shrinks to a shape.
The controller names, in each start message, the slices its planner would
start if one failure domain were lost (elastic.policy.slice_plan.
next_slices); once the first step is done, process 0 lowers each program
the worker compiled with `ctx.compile(..., lower_for=...)` for those
slices' meshes and compiles it in a background thread into the executable
cache (elastic.worker.compile_cache), under the key the next slice will
look up. Only when every process of this slice reads what process 0 writes
there (they share its directory or the shared tier; a probe object, checked
through the JAX coordination service): otherwise the others would compile
for themselves anyway, and the slowest gates the first step.

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
import uuid
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


#: Compiles for one program and next slice that may be started without
#: storing an entry (cut short by the end of their generation, or failed)
#: before this host tries no more: each costs a compile's CPU.
MAX_ATTEMPTS = 2
#: The longest a process waits for another's answer to the probe (seconds).
PROBE_WAIT_S = 60.0


def processes_not_sharing(tiers: list, process_index: int, process_count: int, client,
                          wait_s: float = PROBE_WAIT_S) -> list[int]:
    """Every process of the slice calls this once per generation. Process
    0 writes a probe object with a fresh token into its tiers and posts the
    token (JAX coordination service); each other process looks for it in
    its own tiers and posts whether it is there. Returns, on process 0, the
    processes that do not read its tiers or did not answer within `wait_s`
    ([] when all do); [] on the others."""
    from elastic.worker import compile_cache as cache

    if process_count == 1:
        return []
    wait_ms = int(wait_s * 1000)
    if process_index != 0:
        try:
            token = client.blocking_key_value_get("elastic/ahead/probe", wait_ms)
            seen = cache.read_note(tiers, f"ahead-probe-{token}") == token
            client.key_value_set(f"elastic/ahead/seen/{process_index}", "1" if seen else "0",
                                 allow_overwrite=True)
        except Exception as e:  # noqa: BLE001 - a lost coordinator: process 0 times out
            log.warning("compile ahead: probe not answered: %s", str(e).splitlines()[0][:200])
        return []
    token = uuid.uuid4().hex
    probe = f"ahead-probe-{token}"
    cache.write_note(tiers, probe, token)
    deadline = time.monotonic() + wait_s
    missing = []
    try:
        client.key_value_set("elastic/ahead/probe", token, allow_overwrite=True)
        for other in range(1, process_count):
            left_ms = max(1, int((deadline - time.monotonic()) * 1000))
            try:
                answer = client.blocking_key_value_get(f"elastic/ahead/seen/{other}", left_ms)
            except Exception:  # noqa: BLE001 - no answer in time
                answer = None
            if answer != "1":
                missing.append(other)
    except Exception:  # noqa: BLE001 - the post failed: nobody was asked
        missing = list(range(1, process_count))
    finally:
        cache.remove_note(tiers, probe)
    return missing


def compile_for_next_slices(next_slices,
                            programs: list[tuple[Callable[[Any], Any], str, str | None]],
                            env, devices: list, tiers: list,
                            not_sharing: list[int] = ()) -> list[dict]:
    """For each (process count, devices per host) of `next_slices`, and
    each (lower_for, name, entry) of `programs` (`entry`: the name of the
    program's executable for this slice in the cache, None when there is
    no cache), make sure the executable cache `tiers` (compile_cache.cache_tiers) holds
    the program compiled for that slice.
    Runs on process 0.

    A note in the cache, named after this slice's entry of the program and
    the next slice, names the entry an earlier generation stored: then it
    is "present" and nothing is lowered. Otherwise the program is lowered
    for the slice's mesh; an entry already there is "present", else it is
    compiled and stored ("stored"). XLA compiles on threads of its own, at
    the process's priority: the compile costs the host a compile's CPU
    beside the training (a thread of ours at idle priority would not make
    them idle). After MAX_ATTEMPTS compiles on this host that stored no
    entry (cut short by the end of their generation, or failed), no more
    are started ("skipped"); nor any while processes `not_sharing` do not
    read process 0's tiers.

    Returns one record per slice and program: {"slice": "PxD", "name",
    "outcome" ("stored", "present", "skipped: ...", "no cache", or
    "failed: ..."), "seconds"}. Never raises: a program that cannot be
    lowered or compiled for another mesh only means the restart compiles
    it."""
    from elastic.worker import compile_cache as cache
    from elastic.worker.runtime import build_mesh

    records = []
    for processes, per_host in next_slices:
        chosen = slice_devices(devices, processes)
        for lower_for, name, current in programs:
            record = {"slice": f"{processes}x{per_host}", "name": name, "outcome": "no cache"}
            records.append(record)
            t0 = time.perf_counter()
            try:
                if chosen is None:
                    record["outcome"] = "failed: fewer processes than the slice"
                elif not_sharing:
                    record["outcome"] = (f"skipped: process(es) "
                                         f"{', '.join(map(str, not_sharing))} do not read "
                                         f"process 0's executable cache")
                elif tiers and current:
                    # (named after this slice's entry of the program)
                    record["outcome"] = ensure_cached(
                        cache, tiers, f"{current}.ahead-{record['slice']}",
                        lambda: entry_and_lowered(cache, name, lower_for(
                            build_mesh(chosen, per_host, env.mesh)), processes, chosen))
            except Exception as e:  # noqa: BLE001 - the program's own code ran
                record["outcome"] = "failed: " + f"{type(e).__name__}: {e}".splitlines()[0][:200]
            record["seconds"] = round(time.perf_counter() - t0, 3)
    return records


def entry_and_lowered(cache, name: str, lowered, processes: int,
                      devices: list) -> tuple[str, Any]:
    """(the entry's name, `lowered`) for `lowered` compiled for the slice of
    `processes` processes whose devices are `devices`."""
    return cache.entry_name(name, lowered, processes, [d.id for d in devices]), lowered


def ensure_cached(cache, tiers: list, note: str, lower: Callable[[], tuple[str, Any]]) -> str:
    """The outcome for one program and next slice (compile_for_next_slices):
    `note` names the entry once stored; `lower()` gives (entry, lowered).
    The attempts are counted in this host's tier only (tiers[0]): another
    host may still try. Raises what lowering or compiling raises."""
    known = cache.read_note(tiers, note)
    if known and cache.has_entry(tiers, known):
        return "present"
    entry, lowered = lower()
    if cache.has_entry(tiers, entry):
        cache.write_note(tiers, note, entry)
        return "present"
    own = tiers[:1]
    tried = cache.read_note(own, note + ".attempts")
    attempts = int(tried) if tried and tried.isdigit() else 0
    if attempts >= MAX_ATTEMPTS:
        return f"skipped: {attempts} earlier compiles on this host stored no entry"
    cache.write_note(own, note + ".attempts", str(attempts + 1))
    cache.compile_and_store(tiers, entry, lowered)
    if not cache.has_entry(tiers, entry):
        return "failed: compiled, but no tier took the entry (see the warnings)"
    cache.write_note(tiers, note, entry)
    return "stored"


def start(next_slices, programs, env, devices, process_index: int, process_count: int,
          report: Callable[[list[dict]], None]) -> threading.Thread | None:
    """In a daemon thread: the probe (processes_not_sharing), then, on
    process 0, compile_for_next_slices and `report(records)`. Returns the
    thread, or None when it could not be started (warned; never raised)."""
    from elastic.worker import compile_cache as cache

    def run() -> None:
        tiers = cache.cache_tiers(env.cache_dir, env.shared_cache, env.shared_cache_key_file)
        not_sharing = processes_not_sharing(tiers, process_index, process_count,
                                            cache._coordination_client()) \
            if tiers and process_count > 1 else []
        if process_index != 0:
            return
        records = compile_for_next_slices(next_slices, programs, env, devices, tiers,
                                          not_sharing)
        for r in records:
            log.info("compiled ahead for %s: %s %s in %.2f s", r["slice"], r["name"],
                     r["outcome"], r["seconds"])
        report(records)

    try:
        thread = threading.Thread(target=run, name="elastic-compile-ahead", daemon=True)
        thread.start()
        return thread
    except Exception as e:  # noqa: BLE001 - e.g. no thread to be had: train on
        log.warning("compile ahead not started: %s", e)
        return None
