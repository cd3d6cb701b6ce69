"""A pre-started worker process: Python with JAX, Orbax and the training
program's packages already imported, waiting for the launch of the next
generation's worker.

The agent starts one (`python -m elastic.worker.prestart`) once the current
worker has made its first step, with the environment the next worker will
have except the per-generation variables. At the next start it writes one
JSON line to the process's stdin, {"argv": [...], "env": {...}, "cwd": ...};
this process then takes that environment, directory and argv and runs the
program as `__main__`, exactly as `python script.py ...` or
`python -m module ...` would. End of input before a launch: exit 0.

Why: on 2 cores, starting 4 Python processes that import JAX and Orbax takes
~1.9 s of a ~4 s restart (bench/recovery.py, phase `process_start`), and the
slowest start holds up everyone's `jax.distributed.initialize`. Only modules
that read no per-generation setting at import time are imported ahead (JAX
reads its `JAX_*` defaults at import; the agent refuses a launch whose
environment differs in anything but the per-generation variables, see
`elastic.agent.supervisor.launch_key`). The backend is not touched: devices
are created after `jax.distributed.initialize`, in the launched program.
A process whose imported code changed on disk before its launch (a library
installed again between jobs) does not run it: it starts the program afresh
(`start_afresh`), as a cold start would.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import json
import os
import pathlib
import runpy
import sys
import time
import types

from elastic.checkpoint import storage

#: Unix time the launch message arrived (None until then, or when this
#: process was not pre-started); `elastic.worker.init()` measures its
#: `process_start` phase from here instead of from the process's exec.
launched_at: float | None = None

#: Written to stderr once the preloads are done and the launch may come.
READY_LINE = b"elastic-prestart: ready"

#: What `elastic.worker.init()` and `Checkpoints` import, preloaded for a
#: program that imports JAX (a program that does not gets only its own
#: imports: preloading JAX for it would make its start slower, not faster).
RUNTIME_PRELOAD = ("jax", "jax.numpy", "numpy", "orbax.checkpoint", "elastic.worker.runtime",
                   "elastic.checkpoint.manager")

#: What opening checkpoints on a bucket imports besides (Orbax reaches gs://
#: through etils.epath over gcsfs), preloaded when the checkpoint directory
#: is one: `import gcsfs` took 0.38 s alone on the project's machine, and
#: it came in the `checkpoint_setup` phase of every restart. Imports only:
#: no client is made and no request sent before the launch.
STORAGE_PRELOAD = {"gs": ("gcsfs", "etils.epath")}


def _module_imports(path: pathlib.Path) -> list[str]:
    """Modules a file imports at module level (absolute imports only), in
    order; [] when it cannot be read or parsed."""
    try:
        tree = ast.parse(path.read_text(), filename=str(path))
    except (OSError, SyntaxError, ValueError):
        return []
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def program_imports(script: str) -> list[str]:
    """Top-level modules a script imports at module level (absolute imports
    only), and those its own modules next to it (`import model`, a file
    model.py beside it) import, read from their source, without importing
    them: the program's own modules are never preloaded (user code may read
    its environment when imported), only what they import from elsewhere
    (optax for a step built in step.py). Unreadable script: []."""
    path = pathlib.Path(script)
    if not path.is_file():
        return []
    folder = path.parent
    local = {p.stem for p in folder.glob("*.py")} | \
        {p.name for p in folder.iterdir() if (p / "__init__.py").exists()}
    names: list[str] = []
    pending, read = [path], {path}
    while pending:
        for name in _module_imports(pending.pop(0)):
            top = name.split(".")[0]
            if top not in local:
                if name not in names:
                    names.append(name)
            elif (own := folder / f"{top}.py") not in read and own.is_file():
                read.add(own)
                pending.append(own)
    return names


def preload_names(script: str, checkpoint_dir: str = "") -> list[str]:
    """What to import ahead for `script` ("" for `-m module`): its own
    top-level imports, after RUNTIME_PRELOAD if it imports JAX (or is a
    module, whose imports are not read), and then STORAGE_PRELOAD's modules
    for the scheme of `checkpoint_dir` (gs://...)."""
    names = program_imports(script) if script else []
    if not script or any(n.split(".")[0] == "jax" for n in names):
        names = [*RUNTIME_PRELOAD, *STORAGE_PRELOAD.get(storage.scheme(checkpoint_dir), ()),
                 *names]
    return names


def preload(names) -> None:
    """Import each module, ignoring failures (the program will import it
    again and report the error where the user expects it)."""
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - anything a module raises at import
            pass


def run(launch: dict) -> None:
    """Become the program `launch` describes (argv[0] is the interpreter,
    then `script args...` or `-m module args...`). Returns when it returns;
    its exceptions and SystemExit propagate."""
    global launched_at
    launched_at = time.time()
    from elastic import worker_env

    worker_env.replace_environ(launch["env"])
    if launch.get("cwd"):
        os.chdir(launch["cwd"])
    argv = list(launch["argv"][1:])
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path.insert(0, os.getcwd())
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        # As `python script.py` does: argv[0] as given, __file__ absolute,
        # the directory of the script's real path first on sys.path (the
        # allow-list checked that path: a symlink to the script in another
        # directory must not import that directory's modules; runpy.run_path
        # would make argv[0] the path it was given). Joined, not normalised:
        # the kernel takes `..` after a symlink physically, as the allow-list
        # did (os.path.abspath would take it textually, to another file).
        script = os.path.join(os.getcwd(), argv[0])
        sys.argv = list(argv)
        sys.path.insert(0, os.path.dirname(os.path.realpath(script)))
        main = types.ModuleType("__main__")
        main.__file__ = script
        main.__builtins__ = builtins
        sys.modules["__main__"] = main
        with open(script, "rb") as f:
            code = compile(f.read(), script, "exec")
        exec(code, main.__dict__)


def set_policy(pid: int | str, policy: int) -> bool:
    """Set the scheduling policy of every thread of process `pid` ("self"
    for this one); False if not permitted (only root may always leave
    SCHED_IDLE again) or the process is gone."""
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            os.sched_setscheduler(int(tid), policy, os.sched_param(0))
        return True
    except (OSError, AttributeError):
        return False


def main() -> None:
    script = sys.argv[1] if len(sys.argv) > 1 else ""
    # Preload at idle priority, so it never takes CPU from the training it
    # runs beside (4 imports ~3 CPU-seconds: ~1.5 s of training on 2 cores).
    # Only as root, where normal priority can surely be restored: the agent
    # (same user) restores it before it sends the launch, and so do we.
    idle = os.geteuid() == 0 and set_policy("self", os.SCHED_IDLE)
    from elastic import worker_env
    from elastic.worker import launch_memo

    preload(preload_names(script, worker_env.checkpoint_dir()))
    launch_memo.remember_loaded_code()
    sys.stderr.buffer.write(READY_LINE + b"\n")
    sys.stderr.flush()
    line = sys.stdin.readline()
    if not line.strip():
        return
    if idle:
        set_policy("self", os.SCHED_OTHER)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    launch = json.loads(line)
    changed = launch_memo.changed_since_loaded()
    if changed is not None:
        start_afresh(launch, changed)
    run(launch)


def start_afresh(launch: dict, changed: str) -> None:
    """Replace this process with the program `launch` describes, started
    as a cold worker is (exec: the same pid, which the agent watches), for
    `changed`, a file of the code it imported that changed on disk since
    (a library installed again between jobs): what it imported is not what
    the program would import now. Its `process_start` phase is measured
    from now (worker_env.ENV_LAUNCHED_AT). Returns only if the exec fails
    (then the imported code runs, as before this check)."""
    from elastic import worker_env

    print(f"elastic.worker.prestart: {changed} changed since this pre-started process "
          f"imported it; starting the program afresh", file=sys.stderr, flush=True)
    env = {**launch["env"], worker_env.ENV_LAUNCHED_AT: repr(time.time())}
    try:
        if launch.get("cwd"):
            os.chdir(launch["cwd"])
        os.execvpe(launch["argv"][0], launch["argv"], env)
    except OSError as e:
        print(f"elastic.worker.prestart: cannot start afresh ({e}); running what was "
              f"imported", file=sys.stderr, flush=True)


if __name__ == "__main__":
    # Run as the importable module, not as __main__, so that `launched_at`
    # is the attribute `elastic.worker.init()` reads.
    from elastic.worker import prestart

    prestart.main()
