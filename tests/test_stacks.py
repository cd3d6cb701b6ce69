"""Where a hung worker is stuck: the frame named from a py-spy dump
(elastic.agent.stacks.main_frame), as a table over dumps in py-spy's
--full-filenames format."""

from __future__ import annotations

import pytest

from elastic.agent.stacks import main_frame

LIBS = ("/usr/lib/python3.11/", "/opt/elastic/elastic/")
LOOP = "train (/home/u/train.py:40)"
SEND = "ProgressReporter._send (/opt/elastic/elastic/worker/progress.py:94)"
JAX = "__call__ (/home/u/.venv/lib/python3.11/site-packages/jax/_src/pjit.py:250)"
WAIT = "wait (/usr/lib/python3.11/threading.py:327)"


def dump(*threads: tuple[str, list[str]]) -> str:
    return "\n".join(f"Thread {i} ({name})\n" + "".join(f"    {f}\n" for f in frames)
                     for i, (name, frames) in enumerate(threads))


@pytest.mark.parametrize("stacks, frame", [
    # the program's own frame is innermost: named alone
    (dump(('active): "MainThread"', [LOOP, "<module> (/home/u/train.py:60)"])), LOOP),
    # inside elastic's runtime, a library, the standard library: the program's caller too
    (dump(('idle): "MainThread"', [SEND, LOOP])), f"{SEND}, called from {LOOP}"),
    (dump(('idle): "MainThread"', [JAX, "f (/home/u/.venv/lib/python3.11/site-packages/"
                                         "jax/_src/api.py:9)", LOOP])),
     f"{JAX}, called from {LOOP}"),
    (dump(('idle): "MainThread"', [WAIT, LOOP])), f"{WAIT}, called from {LOOP}"),
    # the main thread, not the first thread
    (dump(('idle): "Thread-1"', [WAIT]), ('active): "MainThread"', [LOOP])), LOOP),
    # no thread named MainThread: the first
    (dump(('idle)', [SEND, LOOP]), ('idle)', [WAIT])), f"{SEND}, called from {LOOP}"),
    # nothing of the program on the stack: the innermost alone
    (dump(('idle): "MainThread"', [WAIT, "run (/usr/lib/python3.11/threading.py:9)"])), WAIT),
    # a thread without frames, lines that are not frames, no threads
    (dump(('idle): "MainThread"', [])), ""),
    ('Thread 1 (idle): "MainThread"\n    Locals:\n    ' + LOOP + "\n", LOOP),
    ("", ""),
])
def test_the_frame_named_is_the_innermost_and_the_programs_own(stacks, frame):
    assert main_frame(stacks, LIBS) == frame
