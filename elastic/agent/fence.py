"""Self-fencing: an agent that has not heard any controller for a lease stops
its worker on its own, so a host cut off from every controller cannot train
on alone for long.

The controller answers every heartbeat (HeartbeatAck) and tells the lease at
registration (`health.controller_lease_s`, 30 s by default): long enough
that a controller restarted by systemd, or a standby taking over, finds the
slice still training and adopts it (elastic.policy.adopt). A host cut off
from the controller alone cannot step meanwhile: the controller stops its
peers, and every step needs all processes. But process 0 alone finishes a
checkpoint's commit, so when its host is cut off the controller starts no
generation until that host's lease has run out (`fenced_by`,
elastic.policy.fencing).
This is the lease of Gray and Cheriton ("Leases", SOSP 1989) as fencing uses
it: the holder stops acting before the grantor acts as if it had.

A lease counts the agent's own running time: when its checks were held up
(the agent was stopped with SIGSTOP, or starved), it first gives the
controller `grace_s` to be heard again instead of fencing on a stale clock.
Pure functions of monotonic seconds; the agent owns the clock.
"""

from __future__ import annotations

#: An agent whose checks were held up this much longer than their interval
#: was not running; its lease clock restarts with a grace.
HELD_UP_S = 1.0
#: Seconds between an agent's checks of its lease.
CHECK_EVERY_S = 0.25


def grace_s(heartbeat_interval_s: float) -> float:
    """Seconds an agent whose checks were held up gives the controller to
    be heard again before it fences: two heartbeat intervals."""
    return 2 * heartbeat_interval_s


def fenced_by(heard_at: float, lease: float, heartbeat_interval_s: float) -> float:
    """When an agent last heard at `heard_at` (seconds, its controller's
    clock) has stopped its worker at the latest, its lease being `lease`:
    the lease, a check's interval, and, should its checks have been held
    up once before it ran out, the grace it then gives and another check.
    An agent stopped for longer fences later (README: stopped agents)."""
    return heard_at + lease + grace_s(heartbeat_interval_s) + 2 * CHECK_EVERY_S


def lease_s(heartbeat_interval_s: float, heartbeat_timeout_s: float) -> float:
    """The lease (seconds) for a controller that tells none (before
    `controller_lease_s` existed): one heartbeat interval inside the
    controller's timeout, and at least one interval."""
    return max(heartbeat_interval_s, heartbeat_timeout_s - heartbeat_interval_s)


def check(heard_at: float, checked_at: float, now: float, lease: float,
          tick_s: float, grace_s: float) -> tuple[bool, float]:
    """One check, at `now`, of a lease last renewed at `heard_at` and last
    checked at `checked_at`, checked every `tick_s`. Returns (fence,
    heard_at): fence is True when the lease has run out; heard_at is moved
    forward to `now - lease + grace_s` when the checks were held up (the
    agent was not running, so silence means nothing yet)."""
    if now - checked_at > tick_s + HELD_UP_S:
        heard_at = max(heard_at, now - lease + grace_s)
    return now - heard_at > lease, heard_at
