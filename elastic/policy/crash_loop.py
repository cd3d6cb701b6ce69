"""The crash-loop count (pure): `restart.crash_loop_failures` failures in a
row with no progress between them end the job (elastic.policy.decide).

Progress is a generation that made a step and got away from the step the
failure before it reached. A first step alone is not progress: a crash that
comes deterministically just after the restore (bad data, a NaN assert at
step 1001 of every generation restoring step 1000) makes a step in every
generation; counted as progress, it started the count again at each
failure, and with restarts more than `restart.window_s` /
`restart.max_restarts` apart (180 s by default) the restart budget never
tripped either: the job restarted forever (an audit found it). So a
generation's first step starts the count again only when the count has no
step to compare with (its failures came before any step); otherwise the
generation's stop tells: the highest step a member reached (`reached`) is
compared with `SliceState.failure_step`, the step reached by the failure
that began the count.

A generation that got anywhere else, further or (restored from an older
checkpoint) not as far, made progress: the unrelated faults of a healthy
but unlucky cluster land on other steps, and must not fail the job. (Not
"past the highest step ever reached": generations that a host fault cuts
short after a restore 100 steps back would count as a crash loop.)

The same step is within SAME_STEP_STEPS of it, not exactly it: the step a
deterministic crash is reported at moves by one between generations (the
failing process stops before or after reporting the step whose result it
checks, and the highest step is any member's, whose reports may be one step
ahead by asynchronous dispatch or one behind a heartbeat). Wider would let
random faults of a slice whose generations make only a few dozen steps
read as one step more often: with failures at steps spread like a
geometric distribution of mean 20 after the same restore, two more in a row
within 1 step of the first happen about 0.6 % of the time, within 2 steps
1.5 %, and exactly on it 0.06 %. The count is anchored to the failure that
began it (not moved to each later one), so failures creeping on a step per
generation do not count.

The journal carries each verdict (`progressed` and `step` of
`slice_stopping`, `progressed` of `slice_adopted`), which
elastic.policy.failure_history folds the same way for a successor.
"""

from __future__ import annotations

from elastic.policy.state import SliceState
from elastic.policy.view import ClusterView

#: Steps within which two failures count as failing at the same step.
SAME_STEP_STEPS = 1


def reached(state: SliceState, view: ClusterView) -> int:
    """The highest step a member of the current generation reported (-1:
    none). O(members)."""
    steps = [r.worker.step for h in state.members
             if (r := view.hosts.get(h)) is not None and r.worker.generation == state.generation]
    return max(steps, default=-1)


def got_away(failure_step: int, step: int) -> bool:
    """Whether a generation that reached `step` (-1: not known) got away
    from `failure_step` (-1: no failure step to compare with): not within
    SAME_STEP_STEPS of it."""
    return failure_step < 0 or step < 0 or abs(step - failure_step) > SAME_STEP_STEPS


def on_first_step(state: SliceState) -> int:
    """The count once the current generation made its first step: 0 when
    it has no failure step to compare with, else unchanged (its stop will
    tell whether it got away)."""
    return 0 if state.failure_step < 0 else state.failures_without_progress


def on_stop(state: SliceState, kind: str, step: int) -> tuple[bool, dict]:
    """(progressed, SliceState changes) for the stop of the current
    generation for `kind` ("failure", "preemption", "grow", "adoption"),
    which reached `step` (-1: no step known). A failure counts one more
    without progress, or starts the count at 1 with its own step; any other
    stop of a generation that progressed ends the count."""
    progressed = state.progressed and got_away(state.failure_step, step)
    if kind == "failure":
        if progressed:
            return True, {"failures_without_progress": 1, "failure_step": step}
        return False, {"failures_without_progress": state.failures_without_progress + 1}
    if progressed:
        return True, {"failures_without_progress": 0, "failure_step": -1}
    return False, {}
