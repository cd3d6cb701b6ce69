"""Where a hung worker is stuck: the Python stacks of its threads, dumped
with py-spy (https://github.com/benfred/py-spy, PyPI `py-spy`) before the
agent stops it, so that the `hang_detected` incident names the frame.

The frame named is the main thread's innermost, and when that lies in a
library (site-packages, the standard library, `elastic` itself) also the
program's own innermost frame that led there: a worker stuck in a collective
is "in" JAX, but its user wants the line of their training loop.

`py-spy dump --nonblocking` reads the interpreter's memory without pausing
the process (which also works on a process stopped with SIGSTOP, where a
blocking dump fails) and takes tens of milliseconds; it needs ptrace
permission over the worker: the same user, and with Yama's
`kernel.yama.ptrace_scope` = 1 (Ubuntu's default) the worker's leave, which
`elastic.worker` gives its agent's processes at start (PR_SET_PTRACER).
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import sys
import sysconfig

#: Seconds a dump may take before it is abandoned (the stop goes on).
DUMP_TIMEOUT_S = 5.0
#: Characters of a dump kept (its end is cut).
MAX_STACKS_CHARS = 16_000
#: Characters of the frame kept (the controller refuses more:
#: elastic.controller.admission allows 2 x MAX_FIELD_TEXT_CHARS).
MAX_FRAME_CHARS = 512
#: Directories whose frames are a library's, not the program's: the standard
#: library and this package (installed or a checkout); any path with a
#: site-packages or dist-packages component is a library's too.
LIBRARY_DIRS = tuple(os.path.join(d, "") for d in {
    sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"],
    os.path.dirname(os.path.dirname(os.path.abspath(__file__)))})
_FRAME = re.compile(r"^(?P<function>.*) \((?P<file>.*):(?P<line>\d+)\)$")


def py_spy() -> str | None:
    """The py-spy executable: on PATH, or beside this interpreter (a venv's
    bin directory); None if neither."""
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return shutil.which("py-spy") or (beside if os.access(beside, os.X_OK) else None)


async def dump(pid: int, timeout_s: float = DUMP_TIMEOUT_S) -> tuple[str, str, str]:
    """(stacks, frame, error) of the Python process `pid`: py-spy's dump of
    every thread from the first thread on, with full file names (at most
    MAX_STACKS_CHARS), where its main thread is (`main_frame`), and "" —
    or ("", "", why) when py-spy is missing, fails or takes longer than
    `timeout_s`. Never raises."""
    exe = py_spy()
    if exe is None:
        return "", "", "py-spy is not installed (pip install py-spy)"
    try:
        proc = await asyncio.create_subprocess_exec(
            exe, "dump", "--pid", str(pid), "--nonblocking", "--full-filenames",
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE)
    except OSError as e:
        return "", "", f"cannot run py-spy: {e}"
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return "", "", f"py-spy took longer than {timeout_s:g} s"
    text = out.decode(errors="replace")
    if proc.returncode != 0 or "Thread " not in text:
        why = (err.decode(errors="replace").strip().splitlines() or ["no output"])[-1]
        return "", "", f"py-spy failed ({proc.returncode}): {why}"[:1000]
    stacks = text[text.index("Thread "):].rstrip()[:MAX_STACKS_CHARS]
    return stacks, main_frame(stacks)[:MAX_FRAME_CHARS], ""


def main_frame(stacks: str, library_dirs: tuple[str, ...] = LIBRARY_DIRS) -> str:
    """Where the main thread of a py-spy dump is (the thread named
    "MainThread", else the first): its innermost frame, "function
    (file:line)", followed by ", called from" and the innermost frame of the
    program when the innermost is a library's (`is_library`); "" if the
    thread has no frame."""
    blocks, current = [], None
    for line in stacks.splitlines():
        if line.startswith("Thread "):
            current = [line]
            blocks.append(current)
        elif current is not None and line.startswith("    ") and line.strip() \
                and _FRAME.match(line.strip()):
            current.append(line.strip())
    main = next((b for b in blocks if '"MainThread"' in b[0]), blocks[0] if blocks else [])
    frames = main[1:]
    if not frames:
        return ""
    if not is_library(frames[0], library_dirs):
        return frames[0]
    caller = next((f for f in frames[1:] if not is_library(f, library_dirs)), None)
    return f"{frames[0]}, called from {caller}" if caller else frames[0]


def is_library(frame: str, library_dirs: tuple[str, ...] = LIBRARY_DIRS) -> bool:
    """Whether a py-spy frame line ("function (file:line)", file in full)
    is a library's: under a site-packages or dist-packages directory, or
    under one of `library_dirs` (the standard library and `elastic`)."""
    match = _FRAME.match(frame)
    path = match["file"] if match else ""
    parts = path.split(os.sep)
    return "site-packages" in parts or "dist-packages" in parts or \
        any(path.startswith(d) for d in library_dirs)
