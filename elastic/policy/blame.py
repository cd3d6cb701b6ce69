"""Which host a failed generation is blamed on: pure, no clock of its own.

A slice fails as a cascade: one process fails, and every peer's next
collective fails with it. Their exits race to the controller, and the first
one heard is not always the cause (2026-11-29, CI: a ValueError raised on
host-1 was blamed on host-0, whose all-reduce failed with it, because
host-0's exit was reported 3 ms sooner). The blame feeds quarantine
(elastic.policy.quarantine), so blaming the echo sets a healthy host aside.

So a failure that is an echo (its worker said a collective or the
coordination service failed under it, or JAX's coordination service aborted
it: elastic.policy.view.WorkerObs.failed_by_peer) is blamed only when
nothing better turns up: a member that failed by itself, was lost, or
whose agent's stream closed; or one still running that said it is failing
by its own error (it waits for a checkpoint save in flight before it exits).
While only echoes are known and some member has not failed, the controller
waits up to ECHO_WAIT_S for the cause's own report before it stops.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

#: How long (seconds) the controller waits, with only echoes of a failure
#: known, for the report of its cause before it stops the slice and blames
#: the first echo. An agent reports its worker's exit at once over its
#: stream, and a worker that raises says it is failing before anything
#: else, so the cause's report is milliseconds behind its echoes on a
#: healthy control plane; the wait ends as soon as it arrives. Bounded well
#: under the stop it delays: the slice cannot step once a collective failed.
ECHO_WAIT_S = 1.0


@dataclasses.dataclass(frozen=True, order=True)
class MemberFailure:
    """One member's failure as the controller saw it.

    at: when the controller saw it (seconds, its clock); host: the member;
    why: a sentence for the journal; echo: whether it reads as another
    member's failure seen from here (a collective failed under it)."""

    at: float
    host: str
    why: str
    echo: bool = False


@dataclasses.dataclass(frozen=True)
class Blame:
    """What `culprit` found. why: a sentence (for the journal, or while
    waiting the slice's reason); hosts: the members blamed; waiting: the
    cause's report may still come, so do not stop yet."""

    why: str
    hosts: tuple[str, ...] = ()
    waiting: bool = False


def culprit(failures: Sequence[MemberFailure], declared: Sequence[str], others_running: bool,
            now: float) -> Blame:
    """Whom a generation with `failures` (not empty) is blamed on, or
    whether to wait a little longer for its cause.

    `declared`: members whose worker still runs but said it is failing by
    its own error, in rank order; `others_running`: whether some member has
    not failed (its report may still come); `now`: the controller's clock
    (seconds). The earliest failure that is not an echo is blamed; else a
    member that declared its own failure; else, once ECHO_WAIT_S passed
    since the first echo or no member is left to report, the first echo.
    Raises ValueError for no failures."""
    if not failures:
        raise ValueError("culprit: no failures")
    causes = [f for f in failures if not f.echo]
    if causes:
        first = min(causes)
        return Blame(first.why, (first.host,))
    first = min(failures)
    if declared:
        return Blame(f"the worker on host {declared[0]} is failing by its own error (it said "
                     f"so, and is ending); {first.why}, a collective failing with it",
                     (declared[0],))
    if others_running and now - first.at < ECHO_WAIT_S:
        return Blame(f"{first.why}, a collective failing under it: waiting up to "
                     f"{ECHO_WAIT_S:g} s for the report of its cause", waiting=True)
    return Blame(f"{first.why} (a collective failed under it: the cause may be a peer's)",
                 (first.host,))
