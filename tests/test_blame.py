"""Which host a failed generation is blamed on, when the peers' collectives
fail with the process that failed first (elastic.policy.blame and its use in
decide: tables on a fake clock), and how a worker judges its own failure
(elastic.worker.failure_cause)."""

from __future__ import annotations

import pytest

from elastic.policy import blame
from elastic.policy.decide import Phase, decide
from elastic.policy.view import (ClusterView, HeartbeatReceived, WorkerExited, WorkerObs,
                                 WorkerState, observe)
from elastic.worker.failure_cause import caused_by_peer
from policy_tables import T0, register, running_slice, spec

F = blame.MemberFailure


@pytest.mark.parametrize("failures,declared,others_running,now,expected", [
    # the cause known: blamed whenever it was seen, before or after its echo
    ([F(1.0, "h0", "h0 exited", echo=True), F(1.01, "h1", "h1 exited")], [], True, 1.01,
     ("h1",)),
    ([F(1.0, "h1", "h1 exited"), F(1.01, "h0", "h0 exited", echo=True)], [], False, 1.01,
     ("h1",)),
    # of two causes, the first seen
    ([F(2.0, "h2", "h2 lost"), F(1.5, "h1", "h1 exited")], [], True, 2.0, ("h1",)),
    # only an echo, but a member still running said it is failing by itself
    ([F(1.0, "h0", "h0 exited", echo=True)], ["h1"], True, 1.0, ("h1",)),
    # only an echo: wait for the cause while a member may still report it ...
    ([F(1.0, "h0", "h0 exited", echo=True)], [], True, 1.0 + blame.ECHO_WAIT_S - 0.01, None),
    # ... and blame the first echo once the wait is over, or nobody is left to report
    ([F(1.0, "h0", "h0 exited", echo=True)], [], True, 1.0 + blame.ECHO_WAIT_S, ("h0",)),
    ([F(1.2, "h1", "h1 exited", echo=True), F(1.0, "h0", "h0 exited", echo=True)], [], False,
     1.2, ("h0",)),
])
def test_culprit(failures, declared, others_running, now, expected):
    found = blame.culprit(failures, declared, others_running, now)
    assert found.waiting is (expected is None)
    assert found.hosts == (expected or ())
    if expected is None:
        assert "waiting up to" in found.why
    with pytest.raises(ValueError, match="no failures"):
        blame.culprit([], declared, others_running, now)


def _report(view, host, now, state, cause="", exit_code=0, sig=0):
    obs = WorkerObs(generation=1, state=state, pid=42, step=5, exit_code=exit_code, signal=sig,
                    failure_cause=cause)
    event = (WorkerExited if state is WorkerState.EXITED else HeartbeatReceived)(
        host, view.hosts[host].incarnation, obs, *(() if state is WorkerState.EXITED else (0,)))
    return observe(view, event, now)


def _two_hosts():
    view = ClusterView()
    for h in ("h0", "h1"):
        register(view, h)
    return view, running_slice(view, ["h0", "h1"])


def _blamed(decision):
    stopping = next(a for a in decision.actions if getattr(a, "kind", "") == "slice_stopping")
    return stopping.fields["blamed"]


def test_an_echo_heard_first_waits_for_the_cause_and_blames_it():
    """2026-11-29, CI: host-1 raised; host-0's all-reduce failed with it and
    its exit was heard 3 ms sooner."""
    view, state = _two_hosts()
    _report(view, "h0", T0 + 1.0, WorkerState.EXITED, cause="peer", exit_code=1)
    waiting = decide(state, view, T0 + 1.0, spec())
    assert waiting.state.phase is Phase.RUNNING and not waiting.actions
    assert "waiting up to 1 s for the report of its cause" in waiting.reason
    _report(view, "h1", T0 + 1.003, WorkerState.EXITED, cause="own", exit_code=1)
    decision = decide(waiting.state, view, T0 + 1.003, spec())
    assert decision.state.phase is Phase.STOPPING
    assert _blamed(decision) == ["h1"] and "worker on host h1 exited" in decision.reason


def test_a_member_that_said_it_is_failing_is_blamed_before_it_exits():
    """The cause waits for its checkpoint save in flight before it exits; it
    said so first, and its echo's exit is blamed on it at once."""
    view, state = _two_hosts()
    relevant, _ = _report(view, "h1", T0 + 0.9, WorkerState.RUNNING, cause="own")
    assert relevant  # (the word alone wakes the decision)
    _report(view, "h0", T0 + 1.0, WorkerState.EXITED, cause="peer", exit_code=1)
    decision = decide(state, view, T0 + 1.0, spec())
    assert decision.state.phase is Phase.STOPPING and _blamed(decision) == ["h1"]
    assert "failing by its own error" in decision.reason


@pytest.mark.parametrize("echo", [dict(cause="peer", exit_code=1), dict(sig=6)])
def test_an_echo_alone_is_blamed_after_the_wait(echo):
    """No cause turns up (say its host is cut off and not yet found lost):
    the slice stops ECHO_WAIT_S later, blaming the echo, as before; JAX's
    coordination service aborting a process (SIGABRT) is an echo too."""
    view, state = _two_hosts()
    _report(view, "h0", T0 + 1.0, WorkerState.EXITED, **echo)
    waited = decide(state, view, T0 + 1.0 + blame.ECHO_WAIT_S - 0.05, spec())
    assert waited.state.phase is Phase.RUNNING
    decision = decide(waited.state, view, T0 + 1.0 + blame.ECHO_WAIT_S, spec())
    assert decision.state.phase is Phase.STOPPING and _blamed(decision) == ["h0"]
    assert "the cause may be a peer's" in decision.reason


def test_a_worker_that_says_it_failed_by_itself_is_not_an_echo_even_aborted():
    view, state = _two_hosts()
    _report(view, "h0", T0 + 1.0, WorkerState.EXITED, cause="own", sig=6)
    decision = decide(state, view, T0 + 1.0, spec())
    assert decision.state.phase is Phase.STOPPING and _blamed(decision) == ["h0"]


def test_every_member_an_echo_stops_at_once():
    view, state = _two_hosts()
    for h in ("h0", "h1"):
        _report(view, h, T0 + 1.0, WorkerState.EXITED, cause="peer", exit_code=1)
    decision = decide(state, view, T0 + 1.0, spec())
    assert decision.state.phase is Phase.STOPPING and _blamed(decision) == ["h0"]


def _raised_while_handling(error: BaseException) -> BaseException:
    try:
        try:
            raise error
        except BaseException:
            raise KeyError("x")  # noqa: B904 (its __context__ is `error`)
    except KeyError as e:
        return e


@pytest.mark.parametrize("error,peer", [
    # what JAX raised on these machines when a peer's process ended (2026-11-29)
    (ValueError("UNKNOWN: Gloo all-reduce failed: [external/gloo/gloo/transport/tcp/pair.cc:"
                "547] Connection closed by peer [127.0.0.1]:20882"), True),
    (RuntimeError("NCCL operation ncclAllReduce failed: remote process exited or there was "
                  "a network error"), True),
    (RuntimeError("NCCL error: unhandled cuda error"), False),  # (its own GPU)
    (RuntimeError("DEADLINE_EXCEEDED: Barrier timed out. Id: shutdown"), True),
    (ValueError("failing on purpose"), False),
    (MemoryError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate"), False),
    (KeyError("params"), False),
])
def test_caused_by_peer(error, peer):
    assert caused_by_peer(error) is peer
    # the judgement follows the chain: raised while handling, or from, another
    assert caused_by_peer(_raised_while_handling(error)) is peer
    wrapped = RuntimeError("step failed")
    wrapped.__cause__ = error
    assert caused_by_peer(wrapped) is peer
