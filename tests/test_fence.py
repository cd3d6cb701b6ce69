"""Self-fencing decisions (elastic.agent.fence), with a fake clock."""

import pytest

from elastic.agent import fence


def test_lease_is_one_interval_inside_the_controllers_timeout():
    assert fence.lease_s(1.0, 5.0) == 4.0
    assert fence.lease_s(0.5, 2.0) == 1.5
    assert fence.lease_s(1.0, 1.0) == 1.0  # never below one interval


@pytest.mark.parametrize("heard_at, checked_at, now, expected", [
    (0.0, 3.75, 4.0, (False, 0.0)),     # heard 4.0 s ago, lease 4: not yet
    (0.0, 4.0, 4.25, (True, 0.0)),      # past the lease: fence
    (10.0, 13.75, 14.0, (False, 10.0)),
    # checks held up 7 s (the agent was stopped): 2 s of grace first
    (0.0, 1.0, 8.0, (False, 6.0)),
    (0.0, 1.0, 8.0 + 2.25, (False, 6.0 + 2.25)),  # held up again: grace again
    # a held-up check never moves a fresh lease back
    (7.5, 1.0, 8.0, (False, 7.5)),
])
def test_check(heard_at, checked_at, now, expected):
    assert fence.check(heard_at, checked_at, now, lease=4.0, tick_s=0.25,
                       grace_s=2.0) == expected


def test_a_steady_silence_fences_once_the_lease_is_over():
    heard_at, checked_at, now = 0.0, 0.0, 0.0
    fenced_at = None
    while fenced_at is None and now < 10:
        now += 0.25
        expired, heard_at = fence.check(heard_at, checked_at, now, 4.0, 0.25, 2.0)
        checked_at = now
        fenced_at = now if expired else None
    assert fenced_at == 4.25
