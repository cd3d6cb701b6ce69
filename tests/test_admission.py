"""What the controller accepts from the network (elastic.controller.admission), by table."""

from __future__ import annotations

import json

import pytest

from elastic.controller import admission as adm
from elastic.protocol import PROTOCOL
from elastic.security.identity import Identity, Role
from elastic.security.text import clean_text
from elastic.v1 import control_pb2 as pb

HOST_H0 = Identity(Role.HOST, "h0", "aa")
PLAUSIBLE = adm.Plausible(generation=5, known_step=1_000)


def register(host="h0", job="job", incarnation="inc1", devices=1, address="10.0.0.2",
             domain="", free_port=0, pid=7, kind="", service_port=0, protocol=PROTOCOL,
             **worker) -> pb.RegisterRequest:
    return pb.RegisterRequest(
        header=pb.Header(job_id=job, host_id=host, incarnation=incarnation), protocol=protocol,
        devices=devices, device_kind=kind, address=address, failure_domain=domain,
        free_port=free_port, service_port=service_port,
        agent_pid=pid, worker=pb.WorkerStatus(**{"step": -1, "committed_step": -1, **worker}))


@pytest.mark.parametrize("request_, peer, kind, reason", [
    (register(), HOST_H0, None, None),
    (register(job=""), HOST_H0, None, None),                     # an agent not pinned to a job
    (register(), None, None, None),                              # --insecure: nobody is known
    (register(host="h1"), HOST_H0, "denied", "certificate of host h0 cannot speak for host 'h1'"),
    (register(), Identity(Role.OPERATOR, "h0", "bb"), "denied", "operator certificate"),
    (register(job="other"), HOST_H0, "invalid", "message for job 'other'"),
    (register(host="../h0"), None, "invalid", "host id '../h0' is not valid"),
    (register(host="h\n0"), None, "invalid", "is not valid"),
    (register(host="h\x000"), None, "invalid", "is not valid"),
    (register(host="h" * 129), None, "invalid", "is not valid"),
    (register(incarnation=""), HOST_H0, "invalid", "incarnation '' is not valid"),
    (register(devices=0), HOST_H0, "invalid", "reports 0 devices"),
    (register(devices=10**6), HOST_H0, "invalid", "need 1 to 65536"),
    (register(kind="NVIDIA H100 80GB HBM3"), HOST_H0, None, None),
    (register(kind="tpu\n"), HOST_H0, "invalid", "device kind 'tpu\\n'"),
    (register(kind="x" * 65), HOST_H0, "invalid", "a kind is 1 to 64"),
    (register(address="a b"), HOST_H0, "invalid", "is not a host name or IP"),
    (register(address="[fe80::1%eth0]"), HOST_H0, None, None),
    (register(domain="rack/1"), HOST_H0, "invalid", "failure domain 'rack/1'"),
    (register(free_port=70000), HOST_H0, "invalid", "metrics_port must be 0-65535"),
    (register(service_port=-1), HOST_H0, "invalid", "metrics_port must be 0-65535"),
    (register(step=10**18), HOST_H0, "implausible", "more than 10,000,000 past"),
    (register(committed_step=-5), HOST_H0, "invalid", "is below -1"),
    (register(generation=10**9), HOST_H0, None, None),  # a worker of a lost journal's run: a stray
    (register(protocol=0), HOST_H0, "incompatible", "speaks no protocol version"),
    (register(protocol=PROTOCOL + 1), HOST_H0, "incompatible", f"protocol {PROTOCOL + 1}"),
    # only a host of the job learns this controller's release: identity first
    (register(protocol=0), Identity(Role.OPERATOR, "h0", "bb"), "denied", "operator"),
    (register(protocol=0, job="other"), HOST_H0, "invalid", "message for job 'other'"),
])
def test_register(request_, peer, kind, reason):
    refusal = adm.check_register(request_, "job", peer, PLAUSIBLE)
    assert (refusal.kind if refusal else None) == kind
    if reason:
        assert reason in refusal.reason


def message(generation=5, **body) -> pb.AgentMessage:
    return pb.AgentMessage(header=pb.Header(job_id="job", host_id="h0", incarnation="i",
                                            generation=generation), **body)


@pytest.mark.parametrize("msg, kind, reason", [
    (message(heartbeat=pb.Heartbeat(worker=pb.WorkerStatus(generation=5, step=1_200))), None,
     None),
    (message(heartbeat=pb.Heartbeat(worker=pb.WorkerStatus(step=10**18))), "implausible",
     "heartbeat: step 1000000000000000000 is more than"),
    (message(heartbeat=pb.Heartbeat(worker=pb.WorkerStatus(generation=9))), None, None),
    (message(heartbeat=pb.Heartbeat(sent_at=float("nan"))), "invalid", "sent_at finite"),
    (message(heartbeat=pb.Heartbeat(devices=1, device_kind="tpu")), None, None),
    (message(heartbeat=pb.Heartbeat(devices=-1)), "invalid", "heartbeat reports -1 devices"),
    (message(heartbeat=pb.Heartbeat(device_kind="tpu")), "invalid", "reports 0 devices"),
    (message(heartbeat=pb.Heartbeat(devices=2, device_kind="<script>")), "invalid",
     "device kind '<script>'"),
    (message(heartbeat=pb.Heartbeat(worker=pb.WorkerStatus(metrics={"loss": float("inf")}))),
     "invalid", "metric loss is inf"),
    (message(heartbeat=pb.Heartbeat(worker=pb.WorkerStatus(metrics={"a\nb": 1.0}))),
     "invalid", "metric name"),
    (message(heartbeat=pb.Heartbeat(worker=pb.WorkerStatus(
        metrics={f"m{i}": 1.0 for i in range(65)}))), "invalid", "65 metrics"),
    (message(progress=pb.Progress(step=1_001, committed_step=1_000)), None, None),
    (message(progress=pb.Progress(step=-1, committed_step=10**18)), "implausible",
     "committed step"),
    (message(generation=999_999, progress=pb.Progress(step=3)), "implausible",
     "about generation 999999, but the current generation is 5"),
    (message(generation=6, worker_exited=pb.WorkerStatus(generation=6)), "implausible",
     "generation 6"),
    (message(generation=4, worker_exited=pb.WorkerStatus(generation=4)), None, None),
    (message(), "invalid", "without a body"),
])
def test_messages(msg, kind, reason):
    refusal = adm.check_message(msg, PLAUSIBLE)
    assert (refusal.kind if refusal else None) == kind
    if reason:
        assert reason in refusal.reason


def test_steps_are_measured_from_the_step_the_job_is_known_to_have_reached():
    fresh = adm.Plausible(generation=0, known_step=-1)
    assert fresh.step(adm.MAX_STEP_ADVANCE, "step") is None
    assert fresh.step(adm.MAX_STEP_ADVANCE + 1, "step").kind == "implausible"
    resumed = adm.Plausible(generation=0, known_step=50_000_000)  # from the journal
    assert resumed.step(50_000_000 + adm.MAX_STEP_ADVANCE, "step") is None


@pytest.mark.parametrize("bound, incarnation, live, refused", [
    (None, "i2", True, False),      # never registered
    ("aa", "i2", True, False),      # the same certificate (an agent restart)
    ("bb", "i2", False, False),     # another certificate, the old registration silent
    ("bb", "i1", True, False),      # the same agent process, renewed certificate
    ("bb", "i2", True, True),       # another certificate while the host is alive
])
def test_rebinding_a_host_id_to_another_certificate(bound, incarnation, live, refused):
    refusal = adm.check_rebind(bound, "aa", incarnation, "i1", live)
    assert (refusal is not None) == refused
    assert refusal is None or refusal.kind == "denied"


@pytest.mark.parametrize("host_id,refused_for", [
    ("h1", None),            # itself again
    ("h2", None),            # another host
    ("H1", "h1"),            # TLS would take h1's certificate for H1's
    ("HOST-1", "host-1"),
    ("host-10", None),
])
def test_host_ids_that_differ_only_in_letter_case(host_id, refused_for):
    registered = {"h1": "h1", "host-1": "host-1"}
    refusal = adm.check_letter_case(host_id, registered)
    assert (refusal and refusal.kind, refusal and f"registered host {refused_for!r}" in
            refusal.reason) == (("invalid", True) if refused_for else (None, None))


@pytest.mark.parametrize("behind_s,jitter,wait_s", [
    (0.0, 0.5, None), (0.99, 1.0, None),      # keeping up: admitted
    (1.0, 0.0, 1.0), (2.0, 0.5, 4.0),          # behind: 1x to 3x its lag
    (4.0, 1.0, 12.0), (20.0, 1.0, 30.0)])      # at most 30 s
def test_registrations_wait_while_the_controller_is_behind(behind_s, jitter, wait_s):
    assert adm.registration_wait_s(behind_s, jitter) == wait_s


FREE = adm.STREAMS_AWAITED_FREELY


@pytest.mark.parametrize("awaiting, taken_per_s, booked_s, turn_s", [
    (0, 0.0, 0.0, None),
    (FREE, 0.0, 0.0, None),                   # a few always: no rate needed
    (FREE + 1, 0.0, 0.0, 1.0),                # none taken up yet: at least 1 s,
    (FREE + 1, 0.0, 40.0, 40.0 + 1 / adm.MIN_TURNS_PER_S),  # ... after the last turn given
    (1000, 200.0, 0.0, None),                 # 5 s at 200 a second
    (1000, 100.0, 0.0, 5.0),                  # 10 s: the 5 s too many
    (1000, 100.0, 7.0, 7.005),                # after the last turn given, at 2 x 100 a second
    (1000, 190.0, 0.0, 1.0),                  # at least 1 s
    (10_000, 60.0, 0.0, 30.0),                # the excess counts up to 30 s
    (10_000, 60.0, 900.0, 600.0),             # at most 600 s
])
def test_registrations_wait_for_a_turn_while_streams_wait_to_be_taken_up(
        awaiting, taken_per_s, booked_s, turn_s):
    assert adm.stream_wait_s(awaiting, taken_per_s, booked_s) == pytest.approx(turn_s)


def test_deferred_registrations_get_turns_spaced_at_the_rate_streams_are_taken_up():
    """A deferral is a call too: each deferred agent gets its own turn, one
    after the other at the take-up rate, so it is deferred about once."""
    intake = adm.StreamIntake(expire_s=60.0, window_s=10.0)
    for i in range(1000):
        intake.registered(("old", i), 0.0)
    intake.taken_up(("old", 0), 0.0)
    for i in range(1, 500):                     # 50 a second taken up lately
        intake.taken_up(("old", i), 5.0)
    assert intake.defer(10.0, jitter=0.0) == (pytest.approx(5.0), 500, 50.0)  # 10 s: 5 too many
    turns = [intake.defer(10.0, jitter=0.0)[0] for _ in range(3)]  # 2 x 50 a second
    assert turns == [pytest.approx(5.01), pytest.approx(5.02), pytest.approx(5.03)]
    wait_s, _, _ = intake.defer(10.0, jitter=1.0)
    assert wait_s == pytest.approx(5.04 + 0.01)   # jitter: within its turn's spacing
    assert intake.defer(10.0, jitter=0.0)[0] == pytest.approx(5.05)  # (not booked)
    for i in range(500, 1000):                 # all taken up: admitted again
        intake.taken_up(("old", i), 10.5)
    assert intake.defer(11.0, jitter=0.0) is None


def test_the_take_up_rate_is_measured_over_the_burst_until_the_window_is_full():
    """A burst after a quiet spell (a controller up for hours, then its
    agents re-registering at once) is measured by itself, not spread over
    the whole window."""
    intake = adm.StreamIntake(expire_s=60.0, window_s=10.0)
    assert intake.taken_per_s(0.0) == 0.0
    intake.registered("early", 0.0)
    intake.taken_up("early", 0.0)
    for i in range(50):                          # 50 taken up in 0.5 s, 1,000 s later
        intake.registered(i, 1000.0)
        intake.taken_up(i, 1000.0 + 0.01 * i)
    assert intake.taken_per_s(1000.5) == 50.0    # over the burst's first second
    assert intake.taken_per_s(1002.0) == 25.0    # over its 2 s
    assert intake.taken_per_s(1010.0) == 5.0     # over the window
    assert intake.taken_per_s(1011.0) == 0.0     # nothing in the window


def test_stream_intake_counts_registrations_until_taken_up_replaced_or_expired():
    intake = adm.StreamIntake(expire_s=60.0, window_s=10.0)
    a, b, c, d = object(), object(), object(), object()
    for at, token in ((0.0, a), (1.0, b), (2.0, c), (30.0, d)):
        intake.registered(token, at)
    assert intake.awaiting(30.0) == 4 and intake.taken_per_s(30.0) == 0.0
    intake.taken_up(b, 31.0)            # out of order
    intake.gone(c)                      # its host registered again
    intake.taken_up(c, 31.5)            # (a replaced one is not counted as taken up)
    assert intake.awaiting(31.0) == 2 and intake.taken_per_s(32.0) == 1.0  # (1 in 1 s)
    assert intake.awaiting(60.0) == 2 and intake.awaiting(60.1) == 1   # a expired
    assert intake.taken_per_s(41.1) == 0.0                             # b out of the window
    intake.taken_up(a, 61.0)            # (an expired one is not counted either)
    assert intake.taken_per_s(61.0) == 0.0 and intake.awaiting(90.0) == 1
    assert intake.awaiting(90.1) == 0


def test_budget_refills_at_its_rate_and_counts_what_it_refused():
    budget = adm.Budget(rate_per_s=1.0, burst=2)
    assert [budget.take("h", 0.0) for _ in range(4)] == [(True, 0), (True, 0), (False, 1),
                                                         (False, 2)]
    assert budget.take("h", 1.0) == (True, 2)   # one token back after a second
    assert budget.take("other", 1.0) == (True, 0)
    once_per_10s = adm.Budget(rate_per_s=0.1, burst=1)
    assert once_per_10s.take("k", 0.0)[0] and not once_per_10s.take("k", 9.9)[0]
    assert once_per_10s.take("k", 10.0) == (True, 1)


@pytest.mark.parametrize("fields, expected", [
    ({"step": 12, "restore_s": 0.4, "source": "snapshot"},
     {"step": 12, "restore_s": 0.4, "source": "snapshot"}),
    ({"kind": "job_succeeded"}, "reserved"),
    ({"generation": 999_999}, "reserved"),
    ({"ts": 0}, "reserved"),
    ({"ettr_s": 7.8e11}, "is not a duration"),
    ({"blocking_s": -1}, "is not a duration"),
    # null, text or a boolean for a duration or a time: `account()` (report,
    # status, every metrics scrape, the controller with --metrics-port) raised
    # TypeError adding them up
    ({"step": 12, "restore_s": None}, "restore_s = null is not a duration"),
    ({"step": 12, "blocking_s": "0.5"}, 'blocking_s = "0.5" is not a duration'),
    ({"total_s": True}, "total_s = true is not a duration"),
    ({"step": 12, "saved_at": "yesterday"}, 'saved_at = "yesterday" is not a time'),
    ({"step": 12, "saved_at": None}, "saved_at = null is not a time"),
    ({"step": 12, "saved_at": -1.0}, "saved_at = -1.0 is not a time"),
    ({"step": 12, "restore_s": 0, "saved_at": 1.7e9}, {"step": 12, "restore_s": 0,
                                                        "saved_at": 1.7e9}),
    ({"step": 10**18}, "more than 10,000,000 past"),
    ({"step": "12"}, "must be an integer"),
    ({"nested": {"a": 1}}, "must be a string, number"),
    # a failed save names its processes (checkpoint_save_failed, _skipped)
    ({"step": 4, "processes": [0, 1]}, {"step": 4, "processes": [0, 1]}),
    ({"processes": list(range(65))}, "a list of at most 64 integers"),
    ({"processes": ["0"]}, "a list of at most 64 integers"),
    ({"processes": [[0]]}, "a list of at most 64 integers"),
    ({"x": "line\nforged line\x1b[2J"}, {"x": "line forged line\ufffd[2J"}),
    ({f"f{i}": i for i in range(33)}, "at most 32 fields"),
])
def test_worker_event_fields(fields, expected):
    result = adm.worker_event_fields(json.dumps(fields), PLAUSIBLE)
    if isinstance(expected, dict):
        assert result == expected
    else:
        assert isinstance(result, adm.Refusal) and expected in result.reason


@pytest.mark.parametrize("text", ["[1, 2]", "not json", "x" * 20_000, "NaN",
                                  "[" * 2000 + "]" * 2000])
def test_worker_event_fields_that_are_not_an_object(text):
    assert isinstance(adm.worker_event_fields(text, PLAUSIBLE), adm.Refusal)


def test_status_is_for_operators_and_controllers():
    assert adm.check_status_peer(Identity(Role.OPERATOR, "alice", "f")) is None
    assert adm.check_status_peer(Identity(Role.CONTROLLER, "c", "f")) is None
    assert adm.check_status_peer(None) is None  # --insecure
    assert adm.check_status_peer(HOST_H0).kind == "denied"


def test_stream_limits_per_peer_and_in_all():
    limits = adm.StreamLimits(per_peer=2, total=3)
    assert limits.acquire("a") and limits.acquire("a")
    assert not limits.acquire("a")           # per peer
    assert limits.acquire("b")
    assert not limits.acquire("c")           # in all
    limits.release("a")
    assert limits.acquire("c")
    limits.release("zzz")                    # never acquired: no effect
    assert limits.count == 3


def test_clean_text_keeps_newlines_only_when_asked():
    assert clean_text("a\nb\x00c\x1b", 100) == "a b\ufffdc\ufffd"
    assert clean_text("a\nb\tc\u2028", 100, keep_newlines=True) == "a\nb\tc\ufffd"
    assert clean_text("0123456789", 4) == "6789"


def test_late_streams_are_logged_at_most_once_an_interval_counting_those_left_out():
    """(now, waited) -> what LateStreamLog.note says, interval 5 s: the first
    is logged; the next two within 5 s are left out; the one after carries
    them and the longer of their waits."""
    from elastic.controller.servicer import LateStreamLog

    late = LateStreamLog(interval_s=5.0)
    table = [(100.0, 12.0, (0, 0.0)), (101.0, 30.0, None), (104.9, 20.0, None),
             (105.0, 11.0, (2, 30.0)), (109.0, 40.0, None), (200.0, 15.0, (1, 40.0)),
             (205.0, 15.0, (0, 0.0))]
    assert [late.note(now, waited) for now, waited, _ in table] == [e for _, _, e in table]
