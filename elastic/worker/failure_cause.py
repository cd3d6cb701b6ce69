"""Whether a worker's failure is its own or a peer's seen from here.

When one process of a slice fails, every other one fails soon after: its
next collective finds the connection to the failed process closed (on CPU,
`Gloo all-reduce failed: ... Connection closed by peer`), or JAX's
coordination service tells it a task is gone. Those exits say nothing about
their own host, but they can reach the controller first (2026-11-29, CI: a
ValueError raised on host-1 was blamed on host-0, whose all-reduce failed
with it and whose exit was reported 3 ms sooner). The worker runtime tells
its agent which kind of failure it is having, and the controller blames the
host whose worker failed by itself (elastic.policy.decide).

The judgement reads the exception's text, and that of the exceptions it
was raised from or during: JAX raises these as XlaRuntimeError or ValueError
("UNKNOWN: Gloo all-reduce failed"), with no type of their own.
"""

from __future__ import annotations

#: Lower-case fragments of the messages a collective or the coordination
#: service fails with when another process of the slice is gone: Gloo (CPU;
#: seen on these machines), NCCL's ncclRemoteError (GPU: "remote process
#: exited or there was a network error"; its other errors, a CUDA error say,
#: are the process's own), the coordination service, a distributed barrier.
#: A fragment here marks a failure as a peer's; everything else is the
#: worker's own.
PEER_FAILURE_SIGNS = (
    "gloo",
    "remote process exited",
    "connection closed by peer",
    "connection reset by peer",
    "coordination service",
    "barrier timed out",
)


def caused_by_peer(error: BaseException) -> bool:
    """Whether `error`, or an exception in its `__cause__` / `__context__`
    chain, reads as a collective or the coordination service failing under
    this process (PEER_FAILURE_SIGNS): the likely echo of another process's
    failure, not a failure of this one."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        text = f"{type(current).__name__}: {current}".lower()
        if any(sign in text for sign in PEER_FAILURE_SIGNS):
            return True
        current = current.__cause__ or current.__context__
    return False
