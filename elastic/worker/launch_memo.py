"""Loading a restart's executable without tracing the program again.

The executable cache (elastic.worker.compile_cache) is keyed by the lowered
program, so a restarted process traced and lowered its train step only to
find the executable it had compiled before: for the reference workload on
this project's machine, 0.26-0.34 s of tracing and 0.12-0.16 s of lowering
in one process alone (`workers/lm`, d_model 128, 2 CPU devices, 2026-11-27),
most of the 0.75 s "program setup" of a restart on 4 hosts x 2 devices and
of the 1.9-2.4 s from a crash to the next first step.

A worker launched as the one before it on this host (the same argv, working
directory and environment but the per-generation variables, within the same
controller run: `ELASTIC_RUN_ID` is in the environment), whose program files
are unchanged, lowers the same program for the same slice. So after a
compile, this host's cache directory keeps a memo under a key of those
(`launch_key`): the entry's name and the pytree structures of its inputs
and outputs. A restart that finds the memo loads the entry without calling
the program's lowering function (`WorkerContext.compile` given a function
instead of a lowered program).

What the key covers, and the contract for a program that opts in: the
program's lowered step must be a function of its launch (argv, working
directory, and the environment the process was started with:
elastic.worker_env.started_environ, because libraries set variables at
import — JAX sets TF_CPP_MIN_LOG_LEVEL — and a pre-started process imported
them before its launch while a cold one imports them after), of its own files (the `.py`
files beside its script and in the packages there, by size and
modification time, as Python's own bytecode cache judges a source
unchanged), of the JAX and jaxlib versions and this machine type, of the
slice (process count, every device id, the mesh's axes, shape, device
order and axis types), of how many programs of the same name the process
compiled before (two programs under one name get two memos), and
of the `trace_key` the program passes (for anything else it reads: a
config file, a tokenizer's vocabulary). Installed libraries, this project
among them, are not hashed: a memo is scoped to one controller run and
one agent incarnation (both are in the environment), within which they
are not expected to change. A memo that names a missing or unloadable
entry only means tracing and compiling as before.

Memos stay in the host's cache directory (`--compile-cache-dir`), never in
the signed shared tier: unpickling one, like deserialising an executable,
runs code, so they go only where the executables are trusted unsigned
(mode 0700, see compile_cache; hosts that share that directory trust each
other already). One memo of ~3 KB stays per program, slice and controller
run; nothing removes them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import pickle
from collections.abc import Mapping, Sequence
from typing import Any

log = logging.getLogger("elastic.compile_cache")


def program_files(script: str) -> list[tuple[str, int, int]]:
    """(path relative to the folder of `script`, size in bytes,
    modification time in ns) of every `.py` file in that folder (a
    program's own modules sit beside it: `import model` for model.py) and,
    recursively, in its packages (subfolders with an `__init__.py`),
    sorted by path; [] when `script` is not a file."""
    path = pathlib.Path(script)
    if not path.is_file():
        return []
    folder = path.resolve().parent
    candidates = list(folder.glob("*.py"))
    for sub in folder.iterdir():
        if sub.is_dir() and (sub / "__init__.py").is_file():
            candidates += sub.rglob("*.py")
    found = []
    for f in sorted(candidates):
        try:
            st = f.stat()
        except OSError:  # removed meanwhile
            continue
        found.append((str(f.relative_to(folder)), st.st_size, st.st_mtime_ns))
    return found


def slice_description(mesh, process_count: int, device_ids: Sequence[int]) -> str:
    """The slice as the key needs it: the process count, every device id in
    order, and `mesh`'s axis names, shape, device ids in mesh order and
    axis types (None: no mesh)."""
    parts: dict[str, Any] = {"processes": process_count, "devices": list(device_ids)}
    if mesh is not None:
        parts["mesh"] = {"axes": list(mesh.axis_names), "shape": list(mesh.devices.shape),
                         "devices": [d.id for d in mesh.devices.flat],
                         "types": repr(getattr(mesh, "axis_types", None))}
    return json.dumps(parts, sort_keys=True)


def launch_key(name: str, trace_key: str, argv: Sequence[str], cwd: str,
               environ: Mapping[str, str], files: Sequence[tuple[str, int, int]],
               versions: Sequence[str], slice_: str, per_generation: Sequence[str],
               ordinal: int = 0) -> str:
    """Hex digest (32 characters) naming the memo of program `name`, the
    `ordinal`-th (from 0) of that name its process compiled so, launched
    with `argv` in `cwd` with `environ` (the variables in
    `per_generation` left out: they differ between generations of one
    launch), its `files` (program_files), `versions` (JAX, jaxlib, the
    machine type), `slice_` (slice_description) and the program's own
    `trace_key`. Pure: the same inputs give the same key in every process
    and generation."""
    env = sorted((k, v) for k, v in environ.items() if k not in per_generation)
    h = hashlib.sha256()
    for part in (name, str(ordinal), trace_key, json.dumps(list(argv)), cwd, json.dumps(env),
                 json.dumps([list(f) for f in files]), json.dumps(list(versions)), slice_):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


def memo_name(name: str, key: str) -> str:
    """The memo's file name in the host's cache directory."""
    return f"{name}-{key}.launch"


def read(tier, name: str, key: str) -> dict | None:
    """The memo {"entry", "cache_key", "in_tree", "out_tree"} that `tier`
    (the host's DirectoryTier) holds for `name` and `key`; None when there
    is none or it cannot be read or unpickled (warned: tracing follows)."""
    memo = memo_name(name, key)
    try:
        data = tier.read(memo)
        if data is None:
            return None
        found = pickle.loads(data)
        if not isinstance(found, dict) or not {"entry", "cache_key", "in_tree",
                                               "out_tree"} <= found.keys():
            raise ValueError("not a memo")
        return found
    except Exception as e:  # noqa: BLE001 - a damaged memo only means tracing
        log.warning("executable cache %s: cannot read %s (%s); tracing the program",
                    tier, memo, f"{type(e).__name__}: {e}".splitlines()[0][:200])
        return None


def write(tier, name: str, key: str, entry: str, cache_key: str, lowered) -> None:
    """Keep the memo of `lowered`, stored in the cache as `entry` under
    `cache_key` (compile_cache.cache_key), for `name` and launch `key` in
    `tier` (the host's DirectoryTier; written atomically). A failure is
    warned about, never raised."""
    try:
        tier.write(memo_name(name, key), pickle.dumps({
            "entry": entry, "cache_key": cache_key, "in_tree": lowered.in_tree,
            "out_tree": lowered.out_tree}))
    except Exception as e:  # noqa: BLE001 - no memo only means tracing next time
        log.warning("executable cache %s: cannot write %s (%s)", tier, memo_name(name, key),
                    f"{type(e).__name__}: {e}".splitlines()[0][:200])


def current_launch(name: str, trace_key: str, mesh, per_generation: Sequence[str],
                   machine_type: str, ordinal: int) -> str:
    """`launch_key` for the `ordinal`-th (from 0) program named `name` this
    process compiles (elastic.worker.compile_cache counts them): its argv,
    working directory, the environment it was started with
    (elastic.worker_env.started_environ, hashed whole, not read for
    settings), its program files (beside `__main__`'s file: the script, or
    the module of `python -m`), the JAX and jaxlib versions, and the slice
    of `mesh` (needs the JAX backend initialised). Raises OSError when the
    working directory is gone."""
    import sys

    import jax
    import jaxlib

    from elastic import worker_env

    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    return launch_key(name, trace_key, sys.argv, os.getcwd(), worker_env.started_environ(),
                      program_files(main_file) if main_file else [],
                      (jax.__version__, jaxlib.__version__, machine_type),
                      slice_description(mesh, jax.process_count(),
                                        [d.id for d in jax.devices()]),
                      per_generation, ordinal)
