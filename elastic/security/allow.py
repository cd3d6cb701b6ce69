"""Which worker programs an agent runs: its own host's allow-list, so that
even a controller that was taken over cannot make a host run what its
operator did not allow (pure; the agent applies it to every start and
pre-start).

An allow-list entry is a command head of patterns, matched token by token
against the start of the worker's argv after resolution; the rest of argv
(the program's own arguments) is free. In a pattern `*` and `?` match
within one path component, `**` across components, `[...]` a character.

- token 0 is the program as the agent will run it: found through the
  agent's PATH unless it holds a `/` (then taken against the working
  directory); the agent then runs exactly that absolute path, so the job's
  environment cannot make another program of the same name run;
- a later token that starts with `-`, or follows `-m`, `-c`, `-W` or `-X`,
  is compared as is; one that starts with `-` only with a pattern that does
  too (`-cimport os;#/train.py` is python's -c, whatever `**/train.py` says);
- any other later token is a path (the script), compared by its real path
  (symlinks and `..` resolved as the kernel will when it opens it). A path
  that passes through /proc matches no pattern: /proc/self and the links
  to it (/dev/fd, /dev/stdin) name the agent when it checks, the worker
  when it runs. (The program's own arguments, past the patterns, are free,
  /dev/stdout as well.)

So `/opt/venv/bin/python /srv/jobs/*/train.py` allows `python train.py
--steps 10` started in /srv/jobs/lm, and nothing else: not `python -c ...`,
not another script, not /srv/jobs/lm/out/train.py. `[!...]` never matches
`/`, as `*` does not. An entry of a Python
interpreter alone allows any code (the agent warns). `python -m module` puts
the working directory first on sys.path, so such a start also needs the
directory's real path allowed (`workdirs`).

The job's environment may set only the variables the controller itself sets
(`worker_env.JOB_LEVEL_ENV`) and those the agent allows by name
(`--allow-env`): a list of what is forbidden could never be complete, as
too many variables make a loader, an interpreter or a library run other
code (LD_PRELOAD, PYTHONPATH, PYTHONWARNINGS with BROWSER, BASH_FUNC_*,
PJRT_NAMES_AND_LIBRARY_PATHS, ...; RISKY_ENV names those the agent warns
about allowing).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import os
import re
import shlex
from collections.abc import Callable, Mapping, Sequence

from elastic import worker_env

#: Variables known to make a loader, an interpreter or a library run code
#: of the variable's choosing: the agent warns when its --allow-env allows
#: one (the list is for the warning only; what is not allowed is refused).
RISKY_ENV = ("LD_*", "PATH", "PYTHON*", "BROWSER", "BASH_ENV", "BASH_FUNC_*", "ENV",
             "SHELLOPTS", "PS4", "PERL5*", "PERLLIB", "RUBY*", "NODE_OPTIONS", "GCONV_PATH",
             "JAVA_TOOL_OPTIONS", "OPENSSL_*", "PJRT_*", "TPU_LIBRARY_PATH",
             "JAX_COMPILATION_CACHE_DIR")


#: Interpreter options whose next token is a value, not a path (python's
#: -m module, -c code, -W and -X settings; a shell's -c command).
_OPTIONS_WITH_VALUE = frozenset({"-m", "-c", "-W", "-X"})


def _is_python(program: str) -> bool:
    return os.path.basename(program).startswith("python")


@dataclasses.dataclass(frozen=True)
class AllowList:
    """An agent's allow-list.

    workers: command heads, each a tuple of patterns (see the module doc).
    workdirs: patterns a working directory must match for `-m` starts.
    env: name patterns of the variables a job's environment may set,
      besides worker_env.JOB_LEVEL_ENV.
    any_worker: run any program with any environment
      (`--allow-any-worker`; for trusted development setups only)."""

    workers: tuple[tuple[str, ...], ...] = ()
    workdirs: tuple[str, ...] = ()
    env: tuple[str, ...] = ()
    any_worker: bool = False

    @classmethod
    def parse(cls, workers: Sequence[str], workdirs: Sequence[str] = (),
              env: Sequence[str] = (), any_worker: bool = False) -> "AllowList":
        """From the agent's flags: each worker entry is a shell-quoted
        command head ("/opt/venv/bin/python /srv/jobs/*/train.py"). Raises
        ValueError for an empty or unparsable entry, or a relative program
        or workdir pattern."""
        heads = []
        for text in workers:
            try:
                head = tuple(shlex.split(text))
            except ValueError as e:
                raise ValueError(f"--allow-worker {text!r}: {e}") from None
            if not head:
                raise ValueError("--allow-worker needs a program")
            if not head[0].startswith(("/", "*")):
                raise ValueError(f"--allow-worker {text!r}: the program must be an absolute "
                                 f"path pattern")
            heads.append(head)
        for pattern in workdirs:
            if not pattern.startswith(("/", "*")):
                raise ValueError(f"--allow-workdir {pattern!r} must be an absolute path pattern")
        return cls(tuple(heads), tuple(workdirs), tuple(env), any_worker)

    def warnings(self) -> list[str]:
        """Entries that allow more than they seem to."""
        return [f"--allow-worker {' '.join(head)!r} names only a Python interpreter: it allows "
                f"any Python code (python -c ...); name the script too"
                for head in self.workers if len(head) == 1 and _is_python(head[0])] + [
                f"--allow-env {pattern!r} allows a variable that can make the worker run code "
                f"of the controller's choosing ({risky})"
                for pattern in self.env for risky in [next(
                    (r for r in RISKY_ENV if fnmatch.fnmatchcase(pattern, r)
                     or fnmatch.fnmatchcase(r.replace("*", "X"), pattern)), None)] if risky]


@functools.lru_cache(maxsize=1024)
def _regex(pattern: str) -> re.Pattern:
    """`pattern` as a regular expression: `**` any characters, `*` and `?`
    any within one path component, `[...]` (`[!...]`) a character class."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        c = pattern[i]
        close = pattern.find("]", i + 2) if c == "[" else -1
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif close != -1:
            body = pattern[i + 1:close]
            body = "^/" + body[1:] if body.startswith("!") else body  # (never a `/`)
            out.append("[" + body.replace("\\", "\\\\").replace("[", "\\[") + "]")
            i = close
        else:
            out.append(re.escape(c))
        i += 1
    return re.compile("".join(out) + r"\Z", re.DOTALL)


def matches(text: str, pattern: str) -> bool:
    """Whether `text` matches the allow-list `pattern` (see the module doc)."""
    return _regex(pattern).match(text) is not None


def _token_matches(token: str | None, pattern: str) -> bool:
    """`matches`, but an option (`-...`) only ever matches an option's
    pattern, and a path that could not be judged (None) nothing."""
    return token is not None and (not token.startswith("-") or pattern.startswith("-")) \
        and matches(token, pattern)


#: How many symlinks a path may pass through (Linux's own limit, MAXSYMLINKS).
_MAX_LINKS = 40


def real_path(path: str) -> str | None:
    """The real path of the absolute `path` — symlinks and `..` resolved as
    the kernel resolves them, a missing part kept as it is (as
    os.path.realpath) — or None if the way passes through /proc (where
    /proc/self names the process that looks, and /dev/fd, /dev/stdin lead)
    or through more than 40 symlinks. A relative `path` is taken against
    the current directory (joined, not normalised)."""
    path = os.path.join(os.getcwd(), path)
    parts, done, links = [p for p in path.split("/") if p], "/", 0
    while parts:
        part = parts.pop(0)
        if part == ".":
            continue
        if part == "..":
            done = os.path.dirname(done)
            continue
        here = os.path.join(done, part)
        if here == "/proc" or here.startswith("/proc/"):
            return None
        try:
            target = os.readlink(here)
        except OSError:  # (not a link, or not there)
            done = here
            continue
        links += 1
        if links > _MAX_LINKS:
            return None
        if target.startswith("/"):
            done = "/"
        parts = [p for p in target.split("/") if p] + parts
    return done


def _program(argv: Sequence[str], workdir: str, which: Callable[[str], str | None]
             ) -> str | None:
    """The absolute path of argv[0] as the agent will run it (see the
    module doc); None if it is not on the PATH `which` searches."""
    program = argv[0]
    if "/" in program:
        return os.path.normpath(os.path.join(workdir, program))
    path = which(program)
    return None if path is None else os.path.abspath(path)


def _under_proc(path: str) -> bool:
    return path == "/proc" or path.startswith("/proc/")


def resolve(argv: Sequence[str], workdir: str, which: Callable[[str], str | None]
            ) -> list[str | None] | str:
    """argv as the allow-list sees it — the program resolved (see the
    module doc), later path tokens by their real path against `workdir`,
    options and their values as they are, None for a path that passes
    through /proc (no pattern matches it: `real_path`) — or why it cannot
    be (the program is not on the PATH `which` searches)."""
    path = _program(argv, workdir, which)
    if path is None:
        return f"program {argv[0]!r} is not on this agent's PATH"
    resolved: list[str | None] = [None if _under_proc(path) else path]
    takes_value = False
    for token in argv[1:]:
        if token.startswith("-") or takes_value:
            resolved.append(token)
        else:
            resolved.append(real_path(os.path.join(workdir, token)))
        takes_value = token in _OPTIONS_WITH_VALUE
    return resolved


def check_launch(allow: AllowList, argv: Sequence[str], env: Mapping[str, str], workdir: str,
                 which: Callable[[str], str | None]) -> list[str] | str:
    """The argv to run — `argv` with its program replaced by the absolute
    path that was checked — if this agent may start `argv` in `workdir`
    with the job's `env`; else why not (a sentence naming the flag that
    would allow it). `which(name)` finds a program on the agent's PATH
    (shutil.which)."""
    if not argv or any("\0" in a for a in argv) or "\0" in workdir or \
            any("\0" in k or "\0" in v or "=" in k or not k for k, v in env.items()):
        return "the command, its directory or environment is empty or holds NUL or '=' in a name"
    if not os.path.isabs(workdir):
        return f"working directory {workdir!r} is not an absolute path"
    resolved = resolve(argv, workdir, which)
    if isinstance(resolved, str):
        return resolved
    # (resolved already; looked up again only when under /proc, which matches nothing)
    run = [resolved[0] or _program(argv, workdir, which), *argv[1:]]
    if allow.any_worker:
        return run
    for name in sorted(env):
        if name not in worker_env.JOB_LEVEL_ENV and not any(
                fnmatch.fnmatchcase(name, p) for p in allow.env):
            return (f"the job's environment sets {name}, which this host does not allow (a "
                    f"variable can make the worker run other code); allow it with "
                    f"--allow-env {name}")
    shown = " ".join(shlex.quote(t if t is not None else a)
                     for t, a in zip(resolved[:4], [run[0], *argv[1:4]]))
    for head in allow.workers:
        if len(head) <= len(resolved) and all(_token_matches(token, pattern)
                                              for token, pattern in zip(resolved, head)):
            first_option_or_script = next(
                (t for t in resolved[1:] if t is None or t == "-m" or not t.startswith("-")),
                None)
            real_workdir = real_path(workdir)
            if first_option_or_script == "-m" and (real_workdir is None or not any(
                    matches(real_workdir, p) for p in allow.workdirs)):
                return (f"`{shown}` runs a module with {workdir} first on its import path; "
                        f"allow the directory with --allow-workdir")
            return run
    compared = max((len(head) for head in allow.workers), default=0)
    through_proc = [a for t, a in zip(resolved[:compared], [run[0], *argv[1:]]) if t is None]
    if through_proc:
        return (f"`{shown}` is not in this host's allow-list: "
                f"{', '.join(map(repr, through_proc))} passes through /proc, whose links name "
                f"the agent when it checks and the worker when it runs (or through over "
                f"{_MAX_LINKS} symlinks)")
    return (f"`{shown}` is not in this host's allow-list; allow it with --allow-worker "
            f"(e.g. --allow-worker {shlex.quote(' '.join(t or '' for t in resolved[:2]))})")
