"""Loading a restart's executable without tracing the program again.

The executable cache (elastic.worker.compile_cache) is keyed by the lowered
program, so a restarted process traced and lowered its train step only to
find the executable it had compiled before: for the reference workload on
this project's machine, 0.26-0.34 s of tracing and 0.12-0.16 s of lowering
in one process alone (`workers/lm`, d_model 128, 2 CPU devices, 2026-11-27),
most of the 0.75 s "program setup" of a restart on 4 hosts x 2 devices and
of the 1.9-2.4 s from a crash to the next first step.

A worker launched as the one before it on this host (the same argv, working
directory and environment but the variables that only name the generation,
the job, its run, its checkpoint directory and the agent's incarnation:
elastic.worker_env.NOT_IN_LAUNCH_KEY_ENV), whose program files and installed
code are unchanged, lowers the same program for the same slice. So after a
compile, this host's cache directory keeps a memo under a key of those
(`launch_key`): the entry's name and the pytree structures of its inputs
and outputs. A restart that finds the memo loads the entry without calling
the program's lowering function (`WorkerContext.compile` given a function
instead of a lowered program); so does the next job of the same program on
the same slice (on agents that stay up between jobs), and a host whose
agent restarted.

What the key covers, and the contract for a program that opts in: the
program's lowered step must be a function of its launch (argv, working
directory, and the environment the process was started with:
elastic.worker_env.started_environ, because libraries set variables at
import — JAX sets TF_CPP_MIN_LOG_LEVEL — and a pre-started process imported
them before its launch while a cold one imports them after; left out: the
job's id, run and checkpoint directory, and the agent's incarnation and
what changes with it, worker_env.NOT_IN_LAUNCH_KEY_ENV), of its own files
(the `.py` files beside its script and in the packages there, by size and
modification time, as Python's own bytecode cache judges a source
unchanged), of the installed code as it stood at the process's first
compile (`installed_code`: every installed distribution's record, and the
files of every package the process had loaded by then from outside the
standard library and the site directories, such as an editable install or
a PYTHONPATH entry; this project among them), of the Python, JAX and jaxlib
versions and this machine type, of the slice (process count, every device
id, the mesh's axes, shape, device order and axis types), of how many
programs of the same name the process compiled before (two programs under
one name get two memos), and of the `trace_key` the program passes (for
anything else it reads: a config file, a tokenizer's vocabulary; and the
job's id or checkpoint directory, should its step depend on them). A memo
that names a missing or unloadable entry only means tracing and compiling
as before.

The key hashes the code on disk, and a process runs the code it imported:
a process whose imported code changed on disk since (remember_loaded_code,
at the end of a pre-started process's imports or at elastic.worker.init)
neither reads nor writes a memo (CodeChanged), or it would file an
executable traced with the old code under the new code's key for every
later job. (A pre-started process in that state starts its program afresh
instead of running it: elastic.worker.prestart.start_afresh.)

Memos stay in the host's cache directory (`--compile-cache-dir`), never in
the signed shared tier: unpickling one, like deserialising an executable,
runs code, so they go only where the executables are trusted unsigned
(mode 0700, see compile_cache; hosts that share that directory trust each
other already). One memo of ~3 KB stays per program, launch, slice and
installed code; nothing removes them.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import json
import logging
import os
import pathlib
import pickle
from collections.abc import Iterable, Mapping, Sequence
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


#: The files of a loaded package that `installed_code` stats.
CODE_SUFFIXES = tuple(importlib.machinery.SOURCE_SUFFIXES + importlib.machinery.EXTENSION_SUFFIXES)

#: path -> (size, modification time) of this process's installed code when
#: it had imported it (remember_loaded_code), and that code at its first
#: compile (the key's, the same for every program it compiles).
_loaded: dict[str, tuple[int, int]] | None = None
_at_first_compile: list[tuple[str, int, int]] | None = None


class CodeChanged(RuntimeError):
    """The installed code changed on disk after this process imported it."""


def _stat(path: str) -> tuple[str, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:  # removed meanwhile
        return None
    return path, st.st_size, st.st_mtime_ns


def _existing(path: str) -> str:
    """`path`, or its nearest ancestor that exists (the archive a module
    was imported from by zipimport)."""
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def _top_level(name: str, file: str) -> str:
    """The file or folder of the top-level package that module `name`
    (loaded from `file`) belongs to: `a.b.c` from .../a/b/c.py is .../a;
    `file` itself when the folders do not bear the package's name (a
    module put in sys.modules under another name)."""
    path = os.path.dirname(file) if os.path.basename(file).startswith("__init__.") else file
    for _ in range(name.count(".")):
        path = os.path.dirname(path)
    top = name.split(".")[0]
    if os.path.basename(path) == top or os.path.basename(path).split(".")[0] == top:
        return path
    return file


def installed_code(modules: Mapping[str, object], site_dirs: Iterable[str],
                   library_dirs: Iterable[str]) -> list[tuple[str, int, int]]:
    """(path, size in bytes, modification time in ns), sorted, of the code
    a process may run besides its program's own files: the `RECORD` of
    every distribution installed in `site_dirs` (its folder without one;
    an `.egg-info` itself), which pip writes anew with every install; and,
    of each top-level package or module that `modules` (sys.modules)
    loaded from anywhere but `site_dirs` and `library_dirs` (the standard
    library) — an editable install, a PYTHONPATH entry, the program's own
    folder — every source or extension file of a package (so that a
    process pre-started with more of its modules imported keys as a cold
    one does), the files loaded from a namespace package (which may span
    large folders), a module's file, or the archive it was imported from.
    Modules without a file (built in, frozen) are skipped. Not seen: a
    file edited in place inside a site directory, or a package linked
    into one, without a new install."""
    found = []
    sites = [d for d in dict.fromkeys(site_dirs) if d]
    for site in sites:
        try:
            names = sorted(os.listdir(site))
        except OSError:
            continue
        for entry in names:
            if entry.endswith(".dist-info"):
                found.append(_stat(os.path.join(site, entry, "RECORD")) or
                             _stat(os.path.join(site, entry)))
            elif entry.endswith(".egg-info"):
                found.append(_stat(os.path.join(site, entry)))
    known = tuple(os.path.join(d, "") for d in (*sites, *library_dirs) if d)
    known += tuple(os.path.join(os.path.realpath(d), "") for d in (*sites, *library_dirs) if d)
    roots: dict[str, list[str]] = {}
    for name, module in list(modules.items()):
        file = getattr(module, "__file__", None)
        if name == "__main__" or not isinstance(file, str) or not os.path.isabs(file) or \
                file.startswith(known) or os.path.realpath(file).startswith(known):
            continue
        roots.setdefault(_top_level(name, file), []).append(file)
    for root, files in sorted(roots.items()):
        if any(os.path.isfile(os.path.join(root, "__init__" + s)) for s in CODE_SUFFIXES):
            for folder, subfolders, names in os.walk(root):
                subfolders[:] = sorted(d for d in subfolders
                                       if d != "__pycache__" and not d.startswith("."))
                found += [_stat(os.path.join(folder, f)) for f in sorted(names)
                          if f.endswith(CODE_SUFFIXES)]
        elif os.path.isdir(root):
            found += [_stat(f) for f in files]
        else:
            found.append(_stat(_existing(root)))
    return sorted(set(f for f in found if f is not None))


def loaded_code() -> list[tuple[str, int, int]]:
    """`installed_code` of this process: its sys.modules, the site
    directories of its interpreter and its standard library."""
    import site
    import sys
    import sysconfig

    paths = sysconfig.get_paths()
    sites = [*site.getsitepackages(), site.getusersitepackages(), paths["purelib"],
             paths["platlib"]]
    return installed_code(sys.modules, sites, [paths["stdlib"], paths["platstdlib"]])


def remember_loaded_code() -> None:
    """Note this process's installed code as it stands once imported
    (elastic.worker.prestart, when its imports are done; elastic.worker.init
    for a process started cold; only the first call counts), so that
    `changed_since_loaded` can tell when it changed on disk later."""
    global _loaded
    if _loaded is None:
        _loaded = {path: (size, mtime) for path, size, mtime in loaded_code()}


def changed_since_loaded() -> str | None:
    """A file of the installed code noted by remember_loaded_code that has
    since changed or gone (a library installed again, an edited editable
    install): the process may run code other than what is on disk now.
    None when none has, or nothing was noted."""
    for path, stat in (_loaded or {}).items():
        now = _stat(path)
        if now is None or now[1:] != stat:
            return path
    return None


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
               versions: Sequence[str], slice_: str, left_out: Sequence[str],
               ordinal: int = 0, installed: Sequence[tuple[str, int, int]] = ()) -> str:
    """Hex digest (32 characters) naming the memo of program `name`, the
    `ordinal`-th (from 0) of that name its process compiled so, launched
    with `argv` in `cwd` with `environ` (the variables in `left_out` left
    out: they differ between generations, jobs and agents that launch the
    same program), its `files` (program_files), `installed`
    (installed_code), `versions` (Python, JAX, jaxlib, the machine type),
    `slice_` (slice_description) and the program's own `trace_key`. Pure:
    the same inputs give the same key in every process and generation."""
    env = sorted((k, v) for k, v in environ.items() if k not in left_out)
    h = hashlib.sha256()
    for part in (name, str(ordinal), trace_key, json.dumps(list(argv)), cwd, json.dumps(env),
                 json.dumps([list(f) for f in files]), json.dumps(list(versions)), slice_,
                 json.dumps([list(f) for f in installed])):
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


def current_launch(name: str, trace_key: str, mesh, left_out: Sequence[str],
                   machine_type: str, ordinal: int) -> str:
    """`launch_key` for the `ordinal`-th (from 0) program named `name` this
    process compiles (elastic.worker.compile_cache counts them): its argv,
    working directory, the environment it was started with
    (elastic.worker_env.started_environ, hashed whole but the variables in
    `left_out`, not read for settings), its program files (beside
    `__main__`'s file: the script, or the module of `python -m`), the
    installed code as it stood at the process's first compile
    (installed_code), the Python, JAX and jaxlib versions, and the slice of
    `mesh` (needs the JAX backend initialised). Raises CodeChanged when the
    installed code changed on disk after the process imported it (a memo
    keyed by the code on disk would then name an executable traced with
    the old code), OSError when the working directory is gone."""
    global _at_first_compile
    import sys

    import jax
    import jaxlib

    from elastic import worker_env

    changed = changed_since_loaded()
    if changed is not None:
        raise CodeChanged(f"{changed} changed after this process imported its code; "
                          f"no launch memo is read or written")
    if _at_first_compile is None:
        _at_first_compile = loaded_code()
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    return launch_key(name, trace_key, sys.argv, os.getcwd(), worker_env.started_environ(),
                      program_files(main_file) if main_file else [],
                      (sys.version, jax.__version__, jaxlib.__version__, machine_type),
                      slice_description(mesh, jax.process_count(),
                                        [d.id for d in jax.devices()]),
                      left_out, ordinal, _at_first_compile)
