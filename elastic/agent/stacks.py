"""Where a hung worker is stuck: the Python stacks of its threads, dumped
with py-spy (https://github.com/benfred/py-spy, PyPI `py-spy`) before the
agent stops it, so that the `hang_detected` incident names the frame.

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
import shutil
import sys

#: Seconds a dump may take before it is abandoned (the stop goes on).
DUMP_TIMEOUT_S = 5.0
#: Characters of a dump kept (its end is cut).
MAX_STACKS_CHARS = 16_000


def py_spy() -> str | None:
    """The py-spy executable: on PATH, or beside this interpreter (a venv's
    bin directory); None if neither."""
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return shutil.which("py-spy") or (beside if os.access(beside, os.X_OK) else None)


async def dump(pid: int, timeout_s: float = DUMP_TIMEOUT_S) -> tuple[str, str, str]:
    """(stacks, frame, error) of the Python process `pid`: py-spy's dump of
    every thread from the first thread on (at most MAX_STACKS_CHARS), the
    innermost frame of its main thread ("function (file:line)"), and "" —
    or ("", "", why) when py-spy is missing, fails or takes longer than
    `timeout_s`. Never raises."""
    exe = py_spy()
    if exe is None:
        return "", "", "py-spy is not installed (pip install py-spy)"
    try:
        proc = await asyncio.create_subprocess_exec(
            exe, "dump", "--pid", str(pid), "--nonblocking", stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
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
    return stacks, main_frame(stacks), ""


def main_frame(stacks: str) -> str:
    """The innermost frame of the main thread in a py-spy dump (the first
    frame under the thread named "MainThread", else under the first
    thread); "" if there is none."""
    blocks, current = [], None
    for line in stacks.splitlines():
        if line.startswith("Thread "):
            current = [line]
            blocks.append(current)
        elif current is not None and line.startswith("    ") and line.strip():
            current.append(line.strip())
    main = next((b for b in blocks if '"MainThread"' in b[0]), blocks[0] if blocks else [])
    return main[1] if len(main) > 1 else ""
