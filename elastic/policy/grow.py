"""Does growing the slice pay for its restart? A pure decision.

A grow is a restart too: the slice stops (an emergency checkpoint, the
grace), starts again on more hosts, restores and compiles the new shape.
It pays when the time it saves on the steps left is more than that cost:

    saved_s = steps_left * step_time_s * (1 - devices_now / devices_after)
    grow when saved_s > GROW_MARGIN * restart_cost_s

The step time is assumed to shrink with the devices (a fixed global batch
spread over more devices, the usual way an elastic job keeps its
optimisation unchanged; with a fixed per-device batch a bigger slice trains
more samples per step instead, and counting only time undervalues it).
`restart_cost_s` is what restarts of this job cost lately (slice stopping
-> first step of the next generation, SliceState.restart_costs_s; before any
restart, the first generation's start -> first step, a lower bound).

A job that does not say how many steps it runs (the worker reports the
metric `steps_total` with its steps, see elastic.worker) always grows:
without its length there is nothing to weigh. The same holds while no step
time or cost was measured yet. The step time is rank 0's median, or until
the running generation reports its own (at its second step), the last one
the job's workers reported (ClusterView.step_time): before, every grow in
a generation's first steps went ahead, "a step time is not known".
"""

from __future__ import annotations

import statistics

#: The saving must exceed the cost by this factor: a restart's cost varies
#: (a new shape compiles, a host is slow to come back), its saving is only
#: an estimate.
GROW_MARGIN = 1.5
#: Restart costs remembered (the median of these is the estimate).
COSTS_KEPT = 5


def restart_cost_s(costs_s: tuple[float, ...]) -> float | None:
    """The median of the latest restart costs (seconds), None if none."""
    return statistics.median(costs_s) if costs_s else None


def grow_pays(devices_now: int, devices_after: int, step: int, steps_total: float | None,
              step_time_s: float | None, costs_s: tuple[float, ...]) -> tuple[bool, str]:
    """(whether to grow from `devices_now` to `devices_after` devices in
    all, a sentence saying why) at slice step `step` of `steps_total` (None:
    unknown), with the slice's median `step_time_s` (seconds, None:
    unknown) and the job's latest restart costs `costs_s` (seconds).
    `devices_after` must exceed `devices_now` (> 0)."""
    cost_s = restart_cost_s(costs_s)
    if not steps_total or not step_time_s or cost_s is None:
        missing = ("the job's length (steps_total)" if not steps_total else
                   "a step time" if not step_time_s else "a restart's cost")
        return True, f"{missing} is not known"
    steps_left = max(0.0, steps_total - step - 1)
    saved_s = steps_left * step_time_s * (1.0 - devices_now / devices_after)
    numbers = (f"{steps_left:.0f} steps left at {step_time_s:.3f} s; {devices_after} devices "
               f"instead of {devices_now} would save ~{saved_s:.1f} s, a restart costs "
               f"~{cost_s:.1f} s (median of {len(costs_s)})")
    if saved_s > GROW_MARGIN * cost_s:
        return True, numbers
    return False, f"{numbers}: not worth it (needs {GROW_MARGIN:g}x)"


def remember_cost(costs_s: tuple[float, ...], cost_s: float) -> tuple[float, ...]:
    """`costs_s` with `cost_s` added, the oldest dropped past COSTS_KEPT."""
    return (*costs_s, round(cost_s, 3))[-COSTS_KEPT:]
