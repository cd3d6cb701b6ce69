"""Planned faults for `elasticd local --fault`, tests and benchmarks.

A fault spec is `KIND:HOST@TRIGGER`, e.g. `kill-host:host-1@step=120` or
`stop-agent:host-2@t=30`. KIND is any chaos fault kind (see elastic.chaos:
kill-worker, kill-host, stop-worker, stop-agent, preempt, kill-during-save,
partition, lose-device, storage-slow, storage-outage, kill-controller; the
storage kinds and kill-controller act on the whole job, whatever HOST says). TRIGGER is `step=N` (the slice has reported step N), `t=S`
(S seconds after the slice started) or `after=KIND` (the journal has an entry
of KIND, e.g. `slice_stopping`, written after the faults listed before this
one were all injected: `--fault kill-worker:host-1@step=30 --fault
kill-controller:all@after=slice_stopping` kills the controller while the
slice restarts). Every injected fault is journaled as
`fault_injected`.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class Fault:
    """One planned fault: `kind` on `host`, when the slice reaches step
    `at_step`, `at_s` seconds after it started, or once the journal has an
    entry of kind `after` (one of the three is set)."""
    kind: str
    host: str
    at_step: int | None = None
    at_s: float | None = None
    after: str | None = None

    def due(self, step: int, elapsed_s: float, journaled: frozenset[str] = frozenset()) -> bool:
        """Whether the trigger is reached at slice step `step` (-1 before
        the first), `elapsed_s` seconds after start, with entries of the
        kinds `journaled` written since the faults before it were injected."""
        if self.after is not None:
            return self.after in journaled
        if self.at_step is not None:
            return step >= self.at_step
        return elapsed_s >= (self.at_s or 0.0)


def parse_fault(text: str) -> Fault:
    """Parse `KIND:HOST@step=N`, `KIND:HOST@t=S` or `KIND:HOST@after=KIND`.
    Raises ValueError naming what is wrong."""
    from elastic.chaos import CHAOS_KINDS

    kind, sep, rest = text.partition(":")
    host, at, trigger = rest.partition("@")
    if not sep or not at or kind not in CHAOS_KINDS or not host:
        raise ValueError(f"fault {text!r}: expected KIND:HOST@step=N or KIND:HOST@t=S "
                         f"with KIND one of {', '.join(CHAOS_KINDS)}")
    key, eq, value = trigger.partition("=")
    try:
        if key == "step" and eq:
            return Fault(kind, host, at_step=int(value))
        if key == "t" and eq and math.isfinite(at_s := float(value.rstrip("s"))) and at_s >= 0:
            return Fault(kind, host, at_s=at_s)
        if key == "after" and eq and value.replace("_", "").isalpha():
            return Fault(kind, host, after=value)
    except ValueError:
        pass
    raise ValueError(f"fault {text!r}: trigger {trigger!r} is not step=N, t=SECONDS or "
                     f"after=JOURNAL_KIND")
