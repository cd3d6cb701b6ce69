"""Goodput accounting from a journal built by hand (every second accounted)."""

from __future__ import annotations

import pytest

from elastic.goodput import CAUSES, account, format_report


def e(ts, kind, generation=0, host=None, reason="", **fields):
    return {"ts": 1000.0 + ts, "kind": kind, "generation": generation, "host": host,
            "reason": reason or kind, **fields}


JOURNAL = [
    e(0, "controller_started"),
    e(1, "generation_started", 1, hosts=["a", "b"]),
    e(5, "first_progress", 1, step=0),
    e(6, "checkpoint_saved", 1, "a", step=0, step_time_s=0.1, blocking_s=0.05),
    e(15, "checkpoint_saved", 1, "a", step=100, step_time_s=0.1, blocking_s=0.05),
    e(16, "checkpoint_committed", 1, "a", step=100),
    e(20, "fault_injected", 1, "a", fault="kill-worker", step=149),
    e(20.1, "worker_exited", 1, "a", signal=9, exit_code=0, step=149),
    e(20.1, "slice_stopping", 1, "a", cause="failure"),
    e(20.2, "worker_exited", 1, "b", signal=9, exit_code=0, stopped_on_request=True, step=149),
    e(20.3, "slice_stopped", 1),
    e(20.3, "generation_started", 2, hosts=["a", "b"]),
    e(21, "checkpoint_restored", 2, "a", step=100, restore_s=0.5),
    e(24, "first_progress", 2, step=101),
    # with the local snapshots taken since the previous save (0.03 s blocked)
    e(30, "checkpoint_saved", 2, "a", step=200, step_time_s=0.1, blocking_s=0.2, snapshots_s=0.03),
    e(40, "job_succeeded", 2, step=299),
]


def test_every_second_is_accounted():
    g = account(JOURNAL)
    assert g.wall_s == pytest.approx(40.0)
    expected = {"waiting": 1.0, "startup": 4.0 + 3.2, "restore": 0.5, "teardown": 0.2,
                "detection": 0.1, "lost_work": 20 - 14.95,
                "checkpoint_save": 0.05 + 0.05 + 0.2 + 0.03}
    for cause in CAUSES:
        assert g.badput_s[cause] == pytest.approx(expected[cause], abs=1e-6), cause
    # generation 1: 15.1 s of training, 0.1 s detection, from the save of step
    # 100 (started at 14.95) to the fault lost, 0.1 s blocked in saves
    assert g.productive_s == pytest.approx(15.1 - 0.1 - 5.05 - 0.1 + 16.0 - 0.2 - 0.03)
    assert g.productive_s + sum(g.badput_s.values()) == pytest.approx(g.wall_s)
    assert g.ettr == pytest.approx(25.62 / 40)
    assert g.steps == 300 and g.generations == 2


@pytest.mark.parametrize("second_hosts, full_size_steps", [
    (["a", "b"], 300.0),  # steps 0-100 kept of the first generation, 101-299 of the second
    (["a"], 101 + 199 / 2),  # the second on half the hosts: its steps count half
])
def test_steps_kept_are_weighted_by_their_slices_share_of_the_hosts(second_hosts,
                                                                   full_size_steps):
    journal = [dict(x, hosts=second_hosts) if x["kind"] == "generation_started" and
               x["generation"] == 2 else x for x in JOURNAL]
    g = account(journal)
    # steps 101-149 of the first generation were lost and count for nothing
    assert g.steps == 300 and g.full_size_steps == pytest.approx(full_size_steps)
    assert f"({full_size_steps:.0f} in steps of the largest slice)" in format_report(g)


def test_incident_from_an_injected_fault():
    [incident] = account(JOURNAL).incidents
    assert (incident.kind, incident.host, incident.generation) == ("kill-worker", "a", 1)
    assert incident.detected_after_s == pytest.approx(0.1)
    assert incident.recovered_after_s == pytest.approx(4.0)
    assert incident.lost_steps == 49


def test_a_restart_is_accounted_for_phase_by_phase():
    """slice_stopping -> first step of the next generation, back to back:
    the old workers ending, the launch, process 0's phases, the report."""
    phases = dict(process_start_s=0.3, import_jax_s=0.6, distributed_init_s=0.2, mesh_s=0.01,
                  setup_s=0.9, compile_s=0.4, checkpoint_setup_s=0.05, restore_s=0.5,
                  first_step_s=0.6)
    journal = JOURNAL[:13] + [e(23.9, "worker_phases", 2, "a", step=101, total_s=3.56,
                                launched_at=1000.0 + 20.34, **phases)] + JOURNAL[13:]
    [incident] = account(journal).incidents
    startup = incident.startup
    assert list(startup) == ["stop", "launch", "process_start", "import_jax", "distributed_init",
                             "mesh", "setup", "compile", "checkpoint_setup", "restore",
                             "first_step", "report"]
    assert startup["stop"] == pytest.approx(0.2) and startup["launch"] == pytest.approx(0.04)
    assert startup["report"] == pytest.approx(3.9 - 0.2 - 0.04 - 3.56)
    assert sum(startup.values()) == pytest.approx(incident.recovered_after_s -
                                                  incident.detected_after_s)
    assert "launch 0.04, process_start 0.30" in format_report(account(journal))
    assert account(JOURNAL).incidents[0].startup == {}  # (no phases journaled)
    # phases that overrun the whole by a few ms (clocks read in other
    # processes) leave a remainder that prints as 0.00, not -0.00
    journal[13] = dict(journal[13], first_step_s=0.703)
    assert account(journal).incidents[0].startup["report"] == pytest.approx(-0.003)
    assert "first_step 0.70, report 0.00  (=" in format_report(account(journal))


def test_a_generation_adopted_after_its_first_step_counts_from_the_adoption():
    """The controller that started generation 2 died before journaling its
    first step; the one that adopted it says it had stepped."""
    journal = [x for x in JOURNAL if not (x["kind"] == "first_progress" and x["generation"] == 2)]
    journal.insert(13, e(25, "slice_adopted", 2, hosts=["a", "b"], step=105))
    [incident] = account(journal).incidents
    assert incident.recovered_after_s == pytest.approx(5.0)  # (at the latest)


def test_lost_host_detection_counts_from_its_silence():
    journal = JOURNAL[:5] + [
        e(25, "host_lost", 1, "b", silent_s=5.0),
        e(25, "slice_stopping", 1, "b", cause="failure"),
        e(25.1, "slice_stopped", 1),
    ]
    g = account(journal, now=1000.0 + 30)
    [incident] = g.incidents
    assert incident.kind == "host_lost" and incident.detected_after_s == pytest.approx(5.0)
    assert incident.recovered_after_s is None
    assert g.badput_s["detection"] == pytest.approx(5.0)
    assert g.badput_s["waiting"] == pytest.approx(1.0 + 4.9)  # nothing ran after the stop


def test_running_job_so_far_and_empty_journal():
    g = account(JOURNAL[:3], now=1000.0 + 10)
    assert g.wall_s == pytest.approx(10) and g.productive_s == pytest.approx(5.0)
    assert account([]).ettr == 0.0


def test_report_lists_causes_and_incidents():
    g = account(JOURNAL)
    text = format_report(g)
    assert f"ETTR {100 * g.ettr:.1f} %" in text and "wall time 40.0 s" in text
    for cause in CAUSES:
        assert cause in text
    assert "kill-worker" in text and "49" in text


def test_no_lost_work_counted_when_the_next_generation_never_resumed():
    journal = JOURNAL[:11] + [e(21, "controller_stopped", 2)]
    g = account(journal)
    assert g.badput_s["lost_work"] == 0.0
    assert g.incidents[0].lost_steps == 0


def test_training_during_detection_is_not_counted_twice():
    # host b's agent stopped at 20 (its worker trained on) and was declared
    # lost at 25; the next generation resumed from step 100, saved at 14.95
    journal = JOURNAL[:6] + [
        e(24, "checkpoint_saved", 1, "a", step=190, blocking_s=0.05),
        e(25, "host_lost", 1, "b", silent_s=5.0),
        e(25, "slice_stopping", 1, "b", cause="failure"),
        e(25.1, "slice_stopped", 1),
        e(25.1, "generation_started", 2, hosts=["a"]),
        e(26, "checkpoint_restored", 2, "a", step=100, restore_s=0.5),
        e(27, "first_progress", 2, step=101),
        e(30, "job_succeeded", 2, step=130),
    ]
    g = account(journal)
    assert g.badput_s["detection"] == pytest.approx(5.0)
    assert g.badput_s["lost_work"] == pytest.approx(20 - 14.95)  # to the failure moment only
    # the save at 24 started within the lost span: lost work, not checkpoint time
    assert g.badput_s["checkpoint_save"] == pytest.approx(0.05 + 0.05)
    assert g.productive_s + sum(g.badput_s.values()) == pytest.approx(g.wall_s)


def test_lost_work_after_a_local_snapshot_restore_counts_from_the_snapshot():
    # generation 2 resumed from a local snapshot of step 148, copied at 19.9
    # (the fault came at 20): 0.1 s of training lost, not the 5 s since the
    # last persistent save
    journal = JOURNAL[:11] + [
        e(20.3, "generation_started", 2, hosts=["a", "b"]),
        e(20.5, "checkpoint_restored", 2, "a", step=148, restore_s=0.05, source="snapshot",
          saved_at=1000.0 + 19.9),
        e(21, "first_progress", 2, step=149),
        e(40, "job_succeeded", 2, step=299),
    ]
    g = account(journal)
    assert g.badput_s["lost_work"] == pytest.approx(0.1)
    assert g.incidents[0].lost_steps == 1
    assert g.badput_s["restore"] == pytest.approx(0.05)
    assert g.productive_s + sum(g.badput_s.values()) == pytest.approx(g.wall_s)


def test_a_silent_agent_the_slice_rode_out_is_an_incident_without_a_restart():
    # generation 1: a stopped agent at 8 (carried from 9.5, heard at 15), then a
    # worker kill at 20 that does end it
    journal = JOURNAL[:5] + [
        e(8, "fault_injected", 1, "b", fault="stop-agent", step=30),
        e(9.5, "agent_silent", 1, "b", silent_s=1.6, lead_steps=3),
        e(15, "agent_heard", 1, "b", silent_s=7.0),
    ] + JOURNAL[5:]
    g = account(journal)
    ridden, killed = g.incidents
    assert (ridden.kind, ridden.host, ridden.restarted) == ("stop-agent", "b", False)
    assert ridden.detected_after_s == pytest.approx(1.5)
    assert ridden.recovered_after_s == pytest.approx(7.0) and ridden.lost_steps == 0
    # the generation's end is still blamed on the kill, and nothing else changed
    assert (killed.kind, killed.restarted) == ("kill-worker", True)
    assert killed.detected_after_s == pytest.approx(0.1)
    assert g.productive_s == pytest.approx(account(JOURNAL).productive_s)
    assert "no restart" in format_report(g)


def test_a_carried_agent_that_is_then_lost_is_one_incident():
    journal = JOURNAL[:5] + [
        e(8, "fault_injected", 1, "b", fault="stop-agent", step=30),
        e(9.5, "agent_silent", 1, "b", silent_s=1.6, lead_steps=3),
        e(12, "host_lost", 1, "b", silent_s=4.1),
        e(12, "slice_stopping", 1, "b", cause="failure"),
        e(12.1, "slice_stopped", 1),
    ]
    [incident] = account(journal, now=1000.0 + 20).incidents
    assert (incident.kind, incident.restarted) == ("stop-agent", True)
    assert incident.detected_after_s == pytest.approx(4.0)


def test_faults_the_slice_rode_out_are_not_blamed_for_a_later_stop():
    # a partition at 8 that healed unnoticed, then a worker kill at 20 that
    # ends the generation: the kill is the cause, the partition an incident
    # that nobody noticed
    journal = JOURNAL[:5] + [
        e(8, "fault_injected", 1, "a", fault="partition-peers", step=30),
        e(12, "fault_healed", 1, "a", fault="partition-peers"),
    ] + JOURNAL[5:]
    g = account(journal)
    partition, killed = g.incidents
    assert (partition.kind, partition.noticed, partition.restarted) == \
        ("partition-peers", False, False)
    assert (killed.kind, killed.restarted) == ("kill-worker", True)
    assert killed.detected_after_s == pytest.approx(0.1)
    assert g.productive_s == pytest.approx(account(JOURNAL).productive_s)
    assert "(nothing noticed)" in format_report(g)


def test_a_hang_blamed_on_nobody_is_still_put_down_to_the_fault_on_its_suspect():
    """A lockstep hang names no host in slice_stopping (blamed on none), but
    hang_detected names its first suspect: the fault injected there is the
    cause, not a later one elsewhere the slice rode out."""
    journal = JOURNAL[:5] + [
        e(8, "fault_injected", 1, "b", fault="stop-worker", step=30),
        e(9, "fault_injected", 1, "a", fault="throttle", step=40),
        e(19, "hang_detected", 1, "b", silent_s=11.0, suspects=["b", "a"], blamed=[]),
        e(19.1, "slice_stopping", 1, None, cause="failure", blamed=[]),
        e(19.3, "slice_stopped", 1),
    ] + JOURNAL[11:]
    stopped = [i for i in account(journal).incidents if i.restarted]
    assert [(i.kind, i.host) for i in stopped] == [("stop-worker", "b")]


def total(g) -> float:
    return g.productive_s + sum(g.badput_s.values())


def test_a_stop_a_killed_controller_left_unfinished_ends_at_the_next_start():
    """`--fault kill-controller:all@after=slice_stopping`: generation 1 has
    slice_stopping and no slice_stopped. Its teardown ran to the job's end
    while generation 2 was accounted on top (100 s of wall, 146 s of causes)."""
    journal = [e(0, "controller_started"), e(1, "generation_started", 1, hosts=["a", "b"]),
               e(5, "first_progress", 1, step=0),
               e(50, "worker_exited", 1, "a", exit_code=1, step=400),
               e(50.1, "slice_stopping", 1, "a", cause="failure"),
               # the controller is killed here; the next one starts generation 2
               e(53, "controller_started"), e(54, "generation_started", 2, hosts=["a", "b"]),
               e(58, "first_progress", 2, step=401), e(100, "job_succeeded", 2, step=900)]
    g = account(journal)
    assert g.wall_s == pytest.approx(100.0) and total(g) == pytest.approx(g.wall_s)
    assert g.badput_s["teardown"] == pytest.approx(54 - 50.1)
    assert g.productive_s == pytest.approx(50.1 - 5 - 0.1 + 100 - 58)


RESTARTED = [e(0, "controller_started"), e(1, "generation_started", 1, hosts=["a", "b"]),
             e(5, "first_progress", 1, step=0), e(30, "controller_stopped", 1),
             e(32, "controller_started", 1), e(33, "slice_adopted", 1, hosts=["a", "b"], step=300)]
FAILED_AFTER = [e(100, "worker_exited", 1, "a", exit_code=1, step=900),
                e(100.1, "slice_stopping", 1, "a", cause="failure"), e(101, "slice_stopped", 1),
                e(101, "generation_started", 2, hosts=["a", "b"]),
                e(104, "checkpoint_restored", 2, step=800, restore_s=1.0),
                e(106, "first_progress", 2, step=801)]


@pytest.mark.parametrize("journal, now, wall_s", [
    # a controller restarted (SIGTERM, a step-down, a crash systemd restarts)
    # and adopted the slice, which runs on: until now
    (RESTARTED, 1200.0, 200.0),
    (RESTARTED + FAILED_AFTER, 1200.0, 200.0),
    # ... and the job ended later: at its end, not at the first controller's stop
    (RESTARTED + [e(150, "job_succeeded", 1, step=1500), e(150.5, "controller_stopped", 1)],
     1200.0, 150.5),
    # the last controller stopped and none came after it: at its stop
    (RESTARTED + [e(90, "controller_stopped", 1)], 1200.0, 90.0),
    (RESTARTED[:4], 1200.0, 30.0),
])
def test_wall_time_ends_at_a_controllers_stop_only_if_none_started_after_it(journal, now,
                                                                           wall_s):
    """The wall time ended at the last `controller_stopped` even when a later
    controller started and adopted the slice: 30 s for a job running for
    200 s; one journal summed 106 s of causes in that 30 s wall, ETTR 0."""
    g = account(journal, now=now)
    assert g.wall_s == pytest.approx(wall_s)
    assert total(g) == pytest.approx(g.wall_s) and 0.0 <= g.ettr <= 1.0


def test_a_discovered_generation_is_accounted():
    """A leader died before mirroring generation 2's start to the bucket; the
    controller after it rebuilt the generation from the agents' reports
    (`generation_discovered`) and adopted it. That generation was left out:
    its 74 s of training counted as waiting (ETTR 15 % instead of ~90 %)."""
    journal = [e(0, "controller_started"), e(1, "generation_started", 1, hosts=["a", "b"]),
               e(5, "first_progress", 1, step=0),
               e(20, "worker_exited", 1, "a", exit_code=1, step=100),
               e(20.1, "slice_stopping", 1, "a", cause="failure"), e(20.5, "slice_stopped", 1),
               e(25, "controller_started", 1),
               e(25.5, "generation_discovered", 2, hosts=["a", "b"]),
               e(25.6, "slice_adopted", 2, hosts=["a", "b"], step=150),
               e(100, "job_succeeded", 2, step=900)]
    g = account(journal)
    assert g.generations == 2 and g.steps == 901
    # its start is not journaled: from the end of generation 1 to its adoption
    assert g.badput_s["waiting"] == pytest.approx(1.0)
    assert g.badput_s["startup"] == pytest.approx(4.0 + 25.6 - 20.5)
    assert g.productive_s == pytest.approx(20.1 - 5 - 0.1 + 100 - 25.6)
    assert total(g) == pytest.approx(g.wall_s)
    [incident] = g.incidents
    assert incident.recovered_after_s == pytest.approx(25.6 - 20)


@pytest.mark.parametrize("kind, fields", [
    ("checkpoint_restored", {"step": 100, "restore_s": None}),
    ("checkpoint_restored", {"step": 100, "restore_s": "0.5", "saved_at": "yesterday"}),
    ("checkpoint_restored", {"step": "100", "restore_s": float("nan"), "saved_at": 10**400}),
    ("checkpoint_saved", {"step": 120, "blocking_s": "0.5"}),
    ("checkpoint_saved", {"step": 120, "blocking_s": None, "snapshots_s": [1]}),
    ("checkpoint_saved", {"step": None, "blocking_s": 0.5}),
    ("worker_phases", {"step": 101, "launched_at": "x", "compile_s": None, "setup_s": "1"}),
])
def test_fields_that_are_not_numbers_do_not_break_the_accounting(kind, fields):
    """A worker event with `"restore_s": null` or `"blocking_s": "0.5"`
    (admission let them through) made `account()` raise TypeError: `elasticd
    report`, `status` and every metrics scrape failed, and with
    --metrics-port the controller itself. Such a field now counts as absent."""
    journal = JOURNAL[:12] + [e(22, kind, 2, "a", **fields)] + JOURNAL[13:]
    g = account(journal)
    assert total(g) == pytest.approx(g.wall_s) and g.steps == 300
    assert format_report(g).startswith("wall time 40.0 s")
