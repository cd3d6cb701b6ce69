"""What the controller accepts from the network, decided before a message
becomes an event: pure checks, tested with tables.

Three kinds of refusal (`Refusal.kind`):
- "denied": the peer may not do this (a host certificate speaking for
  another host, a host asking for status, a second certificate for a live
  host id);
- "invalid": the message is malformed (an id outside the safe charset,
  text or maps beyond their bounds, numbers out of range, NaN);
- "implausible": well formed but impossible now (a report about a
  generation the controller never started, a step more than
  MAX_STEP_ADVANCE past the step the job is known to have reached). The
  servicer refuses such reports, but only ignores the numbers of a
  heartbeat or registration, which still count as signs of life.

The known step (`Plausible.known_step`) is never raised by one host's word:
it is the highest of what the journal and checkpoint directory recorded
before this controller started, the committed step (which only the host of
rank 0 reports), and the lowest step the members of the running generation
reached.

Free text (stderr tails, reasons) is not refused but cleaned: control
characters other than newline and tab are replaced and the length is
capped, so it cannot forge log lines or drive an operator's terminal.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import re
from collections.abc import Mapping

from elastic import protocol
from elastic.config import DEVICE_KIND, MAX_DEVICES_PER_HOST as MAX_DEVICES
from elastic.controller.journal import RESERVED_FIELDS
from elastic.security.identity import Identity, Role, id_problem
from elastic.security.text import clean_text

#: How far past the step the job is known to have reached a reported step
#: may be: far more than any honest jump (a slice resumes at most at the
#: last committed step), far less than a poisoned 10^18.
MAX_STEP_ADVANCE = 10_000_000
MAX_ADDRESS_CHARS = 255
MAX_STDERR_CHARS = 8_000
MAX_REASON_CHARS = 1_000
MAX_STACKS_CHARS = 16_000
MAX_METRICS = 64
MAX_EVENT_FIELDS = 32
#: Integers in a list field of a worker event (process ids of a failed save).
MAX_EVENT_LIST_ITEMS = 64
MAX_EVENT_JSON_BYTES = 4_096
MAX_FIELD_TEXT_CHARS = 256
#: Seconds a duration reported by a worker may be (a week).
MAX_DURATION_S = 7 * 86_400.0
#: Reports (progress, exit reports, worker events: all that may journal a
#: line) one host may send: per second sustained, and in a burst.
REPORTS_PER_S, REPORT_BURST = 20.0, 200

_ADDRESS = re.compile(r"[A-Za-z0-9._:\[\]%-]+")
_METRIC = re.compile(r"[A-Za-z_][A-Za-z0-9_./-]{0,63}")


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Why a message is refused: `kind` is "denied", "incompatible" (another
    wire protocol), "invalid" or "implausible"; `reason` a sentence for the
    peer and the journal."""

    kind: str
    reason: str


def check_identity(peer: Identity | None, host_id: str) -> Refusal | None:
    """A host may speak only for itself: the peer must hold the host
    certificate of `host_id`. None on a plaintext channel (`--insecure`),
    where nobody is authenticated."""
    if peer is None:
        return None
    if peer.role is not Role.HOST:
        return Refusal("denied", f"a {peer.role.short} certificate ({peer.name}) cannot act "
                                 f"as a host")
    if peer.name != host_id:
        return Refusal("denied", f"the certificate of host {peer.name} cannot speak for host "
                                 f"{host_id!r}")
    return None


def check_letter_case(host_id: str, registered: Mapping[str, str]) -> Refusal | None:
    """A host id that differs from a registered one only in letter case.
    `registered` maps the `str.casefold()` of every host id this controller
    has admitted to that id. Certificates name hosts by DNS name
    (`<host id>.elastic-host`) and TLS compares DNS names regardless of case
    (RFC 6125, 6.4.1), so the sender of a replica could not tell such two
    hosts apart: the later one is refused, naming the other."""
    first = registered.get(host_id.casefold())
    if first is None or first == host_id:
        return None
    return Refusal("invalid", f"host id {host_id!r} differs from that of registered host "
                              f"{first!r} only in letter case, which TLS cannot tell apart; "
                              f"give hosts ids that differ in more than case")


def check_status_peer(peer: Identity | None) -> Refusal | None:
    """Status (pids, addresses, incarnations of every host) is for
    operators and controllers, not for hosts."""
    if peer is None or peer.role in (Role.OPERATOR, Role.CONTROLLER):
        return None
    return Refusal("denied", f"a {peer.role.short} certificate ({peer.name}) may not read the "
                             f"job's status; use an operator certificate")


def check_header(header, job_id: str, registering: bool = False) -> Refusal | None:
    """Ids in a Header: the job (empty allowed when `registering`: an agent
    not pinned to a job), host id and incarnation in the safe charset."""
    if not (registering and not header.job_id) and header.job_id != job_id:
        return Refusal("invalid", f"message for job {header.job_id[:128]!r} sent to the "
                                  f"controller of job {job_id!r}")
    for value, what in ((header.host_id, "host id"), (header.incarnation, "incarnation")):
        problem = id_problem(value, what)
        if problem:
            return Refusal("invalid", problem)
    if header.generation < 0:
        return Refusal("invalid", f"generation {header.generation} is negative")
    return None


@dataclasses.dataclass(frozen=True)
class Plausible:
    """What is possible now: the controller's current generation and the
    step the job is known to have reached (-1: none; see the module doc)."""

    generation: int
    known_step: int

    def step(self, step: int, what: str) -> Refusal | None:
        """Refusal for a step below -1 or more than MAX_STEP_ADVANCE past
        the known step."""
        if step < -1:
            return Refusal("invalid", f"{what} {step} is below -1")
        limit = max(self.known_step, 0) + MAX_STEP_ADVANCE
        if step > limit:
            return Refusal("implausible", f"{what} {step} is more than {MAX_STEP_ADVANCE:,} past "
                                          f"the step the job is known to have reached "
                                          f"({self.known_step})")
        return None

    def report_generation(self, generation: int, what: str) -> Refusal | None:
        """A report about a worker of a generation the controller has not
        started yet cannot be true."""
        if generation > self.generation:
            return Refusal("implausible", f"{what} about generation {generation}, but the "
                                          f"current generation is {self.generation}")
        return None


def _metrics(metrics: Mapping[str, float]) -> Refusal | None:
    if len(metrics) > MAX_METRICS:
        return Refusal("invalid", f"{len(metrics)} metrics; at most {MAX_METRICS}")
    for name, value in metrics.items():
        if not _METRIC.fullmatch(name):
            return Refusal("invalid", f"metric name {name[:40]!r} is not valid (letters, digits, "
                                      f"_ . / -, at most 64)")
        if not math.isfinite(value):
            return Refusal("invalid", f"metric {name} is {value}")
    return None


def check_worker(status, plausible: Plausible, what: str) -> Refusal | None:
    """The numbers of a WorkerStatus as an agent reports it (in Register, a
    heartbeat or an exit report). Its generation may be one this controller
    never started (a worker of a controller run whose journal is lost): such
    a worker is stopped as a stray, and its heartbeats still tell the truth
    about it."""
    if status.generation < 0 or status.pid < 0:
        return Refusal("invalid", f"{what}: negative generation or pid")
    for step, name in ((status.step, "step"), (status.committed_step, "committed step")):
        refusal = plausible.step(step, f"{what}: {name}")
        if refusal:
            return refusal
    return _metrics(status.metrics)


def _devices(count: int, kind: str, what: str) -> Refusal | None:
    """A device count (1 to MAX_DEVICES) and kind ("" or elastic.config.DEVICE_KIND)."""
    if not 1 <= count <= MAX_DEVICES:
        return Refusal("invalid", f"{what} reports {count} devices; need 1 to {MAX_DEVICES}")
    if kind and not DEVICE_KIND.fullmatch(kind):
        return Refusal("invalid", f"{what} reports device kind {kind[:40]!r}; a kind is 1 to "
                                  f"64 letters, digits, spaces and ._()+-")
    return None


def check_register(request, job_id: str, peer: Identity | None,
                   plausible: Plausible) -> Refusal | None:
    """A RegisterRequest from `peer`: once its job and identity hold, first
    whether its agent speaks this controller's wire protocol
    (elastic.protocol; the answer names this controller's release)."""
    h = request.header
    refusal = check_header(h, job_id, registering=True) or check_identity(peer, h.host_id)
    if refusal:
        return refusal
    problem = protocol.mismatch(request.protocol, request.release, "agent", "controller")
    if problem:
        return Refusal("incompatible", problem)
    refusal = _devices(request.devices, request.device_kind, f"host {h.host_id}")
    if refusal:
        return refusal
    if request.address and (len(request.address) > MAX_ADDRESS_CHARS
                            or not _ADDRESS.fullmatch(request.address)):
        return Refusal("invalid", f"address {request.address[:40]!r} is not a host name or IP")
    if request.failure_domain:
        problem = id_problem(request.failure_domain, "failure domain")
        if problem:
            return Refusal("invalid", problem)
    if not all(0 <= port <= 65535 for port in (request.free_port, request.service_port,
                                                request.metrics_port)) or request.agent_pid < 0:
        return Refusal("invalid", "free_port, service_port and metrics_port must be 0-65535 "
                                  "and agent_pid >= 0")
    return check_worker(request.worker, plausible, "registration")


def check_message(message, plausible: Plausible) -> Refusal | None:
    """The body of an AgentMessage on an established stream (the header's
    ids were checked when the stream was bound to its host)."""
    kind = message.WhichOneof("body")
    if kind is None:
        return Refusal("invalid", "agent message without a body")
    if kind != "heartbeat":
        refusal = plausible.report_generation(message.header.generation, kind)
        if refusal:
            return refusal
    if kind == "heartbeat":
        hb = message.heartbeat
        if not 0 <= hb.free_port <= 65535 or not math.isfinite(hb.sent_at):
            return Refusal("invalid", "heartbeat: free_port must be 0-65535, sent_at finite")
        if hb.devices or hb.device_kind:
            refusal = _devices(hb.devices, hb.device_kind, "heartbeat")
            if refusal:
                return refusal
        return check_worker(hb.worker, plausible, "heartbeat")
    if kind == "worker_exited":
        return check_worker(message.worker_exited, plausible, "exit report")
    if kind == "progress":
        p = message.progress
        for step, name in ((p.step, "progress: step"), (p.committed_step,
                                                        "progress: committed step")):
            refusal = plausible.step(step, name)
            if refusal:
                return refusal
        return _metrics(p.metrics)
    if kind == "stacks":
        st = message.stacks
        if len(st.stacks) > MAX_STACKS_CHARS or len(st.frame) > MAX_FIELD_TEXT_CHARS * 2 \
                or len(st.error) > MAX_REASON_CHARS or st.pid < 0 or st.process_id < 0:
            return Refusal("invalid", f"stacks: at most {MAX_STACKS_CHARS} characters, a frame "
                                      f"of {MAX_FIELD_TEXT_CHARS * 2}, pid and rank >= 0")
        return None
    return None  # worker_event: see worker_event_fields


def worker_event_fields(fields_json: str, plausible: Plausible) -> dict | Refusal:
    """The journal fields a worker event may add: a JSON object of at most
    MAX_EVENT_FIELDS scalars (text capped and cleaned, numbers finite) or
    lists of at most MAX_EVENT_LIST_ITEMS integers (process ids),
    none of them a reserved journal field; `step` plausible; fields ending
    in `_s` numbers of seconds from 0 to MAX_DURATION_S and `saved_at` a
    number of Unix seconds >= 0 (not null, not text: the goodput
    accounting adds them up). Returns the fields or a Refusal."""
    if len(fields_json.encode()) > MAX_EVENT_JSON_BYTES:
        return Refusal("invalid", f"event fields exceed {MAX_EVENT_JSON_BYTES} bytes")
    try:
        fields = json.loads(fields_json or "{}")
    except (ValueError, RecursionError):
        return Refusal("invalid", "event fields are not JSON (or nest too deeply)")
    if not isinstance(fields, dict) or len(fields) > MAX_EVENT_FIELDS:
        return Refusal("invalid", f"event fields must be an object of at most "
                                  f"{MAX_EVENT_FIELDS} fields")
    clean = {}
    for key, value in fields.items():
        if key in RESERVED_FIELDS or not _METRIC.fullmatch(key):
            return Refusal("invalid", f"event field {key[:40]!r} is reserved or not a valid name")
        if isinstance(value, str):
            value = clean_text(value, MAX_FIELD_TEXT_CHARS)
        elif isinstance(value, float) and not math.isfinite(value):
            return Refusal("invalid", f"event field {key} is {value}")
        elif isinstance(value, list):
            if len(value) > MAX_EVENT_LIST_ITEMS or \
                    not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
                return Refusal("invalid", f"event field {key} must be a list of at most "
                                          f"{MAX_EVENT_LIST_ITEMS} integers")
        elif value is not None and not isinstance(value, (bool, int, float)):
            return Refusal("invalid", f"event field {key} must be a string, number, "
                                      f"boolean, null or a list of integers")
        number = not isinstance(value, bool) and isinstance(value, (int, float))
        if key.endswith("_s") and not (number and 0 <= value <= MAX_DURATION_S):
            return Refusal("invalid", f"event field {key} = {_shown(value)} is not a duration "
                                      f"from 0 to {MAX_DURATION_S:g} s")
        if key == "saved_at" and not (number and value >= 0):
            return Refusal("invalid", f"event field saved_at = {_shown(value)} is not a time "
                                      f"(Unix seconds)")
        if key == "step":
            if isinstance(value, bool) or not isinstance(value, int):
                return Refusal("invalid", "event field step must be an integer")
            refusal = plausible.step(value, "event step")
            if refusal:
                return refusal
        clean[key] = value
    return clean


def _shown(value) -> str:
    """A refused field's value as a refusal quotes it: JSON, at most 40 characters."""
    return json.dumps(value)[:40]


def check_rebind(bound: str | None, fingerprint: str, incarnation: str,
                 registered_incarnation: str | None, live: bool) -> Refusal | None:
    """A registration of a host id that registered before with the
    certificate `bound` (its SHA-256; None if never), now with
    `fingerprint`: refused while that registration is `live` (heard within
    the heartbeat timeout), unless it is the same certificate or the same
    agent process (`incarnation`) reconnecting with a renewed one."""
    if bound is None or bound == fingerprint or not live or \
            incarnation == registered_incarnation:
        return None
    return Refusal("denied", f"this host id is registered and alive with another certificate "
                             f"(sha256 {bound[:16]}); a new one is accepted once that "
                             f"registration has been silent for the heartbeat timeout")


#: Seconds of lag above which registrations are refused for a while (with a
#: hint when to come back) instead of adding to the backlog.
ADMIT_LAG_S = 1.0
#: Registrations whose streams wait to be taken up (see StreamIntake) that
#: are always admitted: a slice of up to this many hosts never waits.
STREAMS_AWAITED_FREELY = 256
#: Above that, a registration is admitted while the streams already waiting
#: would be taken up within this many seconds, at the rate streams were
#: lately taken up: well within an agent's wait for its stream's first
#: answer (elastic.agent.session: at least 15 s with the default lease).
STREAM_WAIT_S = 5.0
#: The window (seconds) over which that rate is measured.
INTAKE_WINDOW_S = 10.0
#: Deferred registrations are given turns at TURNS_PER_TAKEN times the rate
#: streams were taken up lately (more than that rate, so that a rate held
#: down by the turns themselves can grow: those that come too soon are
#: deferred again), at least MIN_TURNS_PER_S a second, at most MAX_TURN_S
#: seconds away. (At 10,000 agents, bench/scale.py, 2026-11-26: with at
#: least 10 a second their turns spread over 1,000 s and registrations
#: crawled at ~15 a second, the controller at 40 % of a core; with 50, the
#: generation came after 413 s; with 100, after 221 s.)
TURNS_PER_TAKEN = 2.0
MIN_TURNS_PER_S = 100.0
MAX_TURN_S = 600.0


def registration_wait_s(behind_s: float, jitter: float, admit_lag_s: float = ADMIT_LAG_S
                        ) -> float | None:
    """Admission control for registrations: None (admit) while the
    controller is less than `admit_lag_s` seconds behind (see
    elastic.controller.lag); else the seconds the agent should wait before
    trying again, `behind_s` stretched by `jitter` (0..1, drawn by the
    caller) to between 1x and 3x, and between 1 and 30 s. Refusing costs the
    controller almost nothing, whereas admitting a storm of registrations it
    cannot serve makes it fall further behind, declare hosts lost and
    receive their registrations again (the storm `bench/scale.py` saw at
    10,000 agents). Sessions already open are not refused anything."""
    if behind_s < admit_lag_s:
        return None
    return min(30.0, max(1.0, behind_s * (1.0 + 2.0 * jitter)))


def stream_wait_s(awaiting: int, taken_per_s: float, booked_s: float) -> float | None:
    """Admission control on the streams of admitted registrations: None
    (admit) while at most STREAMS_AWAITED_FREELY streams wait to be taken
    up, or while those `awaiting` would be taken up within STREAM_WAIT_S at
    `taken_per_s` (streams taken up a second, lately); else the seconds
    until the agent's turn to register again. Turns are spaced at twice the
    rate streams are taken up (TURNS_PER_TAKEN; at least MIN_TURNS_PER_S a
    second) after the last one given, `booked_s` seconds from now (0: none),
    and come no sooner than the excess wait (at most 30 s of it; none
    while no stream was taken up yet); between 1 and MAX_TURN_S seconds.
    (StreamIntake.defer books the turn and adds jitter.)

    Why: gRPC's asyncio server takes up a few new calls per turn of the
    controller's event loop, and a registration's stream queues behind every
    call made before it. At 10,000 agents registering at once, streams
    waited over a minute; their hosts were declared lost (no heartbeat
    within elastic.policy.silence.STREAM_OPEN_S) and their agents, without
    an answer, registered again: a storm, and no generation started in
    600 s (bench/scale.py, 2026-11-26). A deferral is a call too: with
    hints of 1 to 30 s regardless of the others, 10,000 agents were deferred
    60,483 times in 600 s, and those calls took the place of the streams'.
    Spaced turns defer an agent about once."""
    if awaiting <= STREAMS_AWAITED_FREELY:
        return None
    expected_s = awaiting / taken_per_s if taken_per_s > 0 else math.inf
    if expected_s <= STREAM_WAIT_S:
        return None
    excess_s = min(30.0, expected_s - STREAM_WAIT_S) if taken_per_s > 0 else 0.0
    turn_s = max(excess_s, booked_s + turn_spacing_s(taken_per_s))
    return min(MAX_TURN_S, max(1.0, turn_s))


def turn_spacing_s(taken_per_s: float) -> float:
    """Seconds between two deferred registrations' turns."""
    return 1.0 / max(TURNS_PER_TAKEN * taken_per_s, MIN_TURNS_PER_S)


class StreamIntake:
    """How many admitted registrations' streams wait to be taken up, how
    fast streams are taken up, and the last turn given to a deferred
    registration (for stream_wait_s). Times: the caller's monotonic
    seconds. A registration counts from `registered(token, now)` until
    `taken_up(token, now)`, `gone(token)` (replaced by a newer one, or its
    agent registering again: it gave up on that stream) or `expire_s`
    seconds (its stream never came). `token`: any hashable, the same object
    for one registration (the controller's Session). O(1) amortized per
    call; every call trims what has expired."""

    def __init__(self, expire_s: float, window_s: float = INTAKE_WINDOW_S) -> None:
        self.expire_s, self.window_s = expire_s, window_s
        self._awaiting: dict = {}  # token -> registered at (insertion order: oldest first)
        self._taken: collections.deque[float] = collections.deque()
        self._booked_until = float("-inf")
        #: when the first stream of the current burst was taken up (None: no
        #: stream in the window; the next one starts a burst)
        self._burst_from: float | None = None

    def registered(self, token, now: float) -> None:
        self._trim(now)
        self._awaiting[token] = now

    def taken_up(self, token, now: float) -> None:
        self._trim(now)
        if self._awaiting.pop(token, None) is not None:
            if not self._taken:
                self._burst_from = now
            self._taken.append(now)

    def gone(self, token) -> None:
        self._awaiting.pop(token, None)

    def defer(self, now: float, jitter: float) -> tuple[float, int, float] | None:
        """Whether a registration at `now` waits (stream_wait_s): None to
        admit it, else (seconds until its turn, plus `jitter` (0..1) of a
        turn's spacing; the streams awaited; streams taken up a second), and
        the turn is booked."""
        awaiting, taken_per_s = self.awaiting(now), self.taken_per_s(now)
        turn_s = stream_wait_s(awaiting, taken_per_s, max(0.0, self._booked_until - now))
        if turn_s is None:
            return None
        self._booked_until = max(self._booked_until, now + turn_s)
        return turn_s + jitter * turn_spacing_s(taken_per_s), awaiting, taken_per_s

    def awaiting(self, now: float) -> int:
        """Registrations whose streams have not been taken up (of the last
        `expire_s` seconds)."""
        self._trim(now)
        return len(self._awaiting)

    def taken_per_s(self, now: float) -> float:
        """Streams taken up a second over the last `window_s` seconds, or
        since the first of this burst was (at least a second) when that is
        shorter: a burst after a quiet spell is measured by itself."""
        self._trim(now)
        if not self._taken:
            return 0.0
        return len(self._taken) / min(self.window_s, max(1.0, now - self._burst_from))

    def _trim(self, now: float) -> None:
        while self._awaiting:
            token, at = next(iter(self._awaiting.items()))
            if now - at <= self.expire_s:
                break
            del self._awaiting[token]
        while self._taken and now - self._taken[0] > self.window_s:
            self._taken.popleft()


class Budget:
    """A token bucket per key: `take(key, now)` spends one of `burst`
    tokens, refilled at `rate_per_s` (seconds of the caller's clock).
    Returns (allowed, refused since the last allowed take). With
    rate_per_s = 1 / T and burst = 1: at most one per T seconds."""

    def __init__(self, rate_per_s: float, burst: float, max_keys: int = 100_000) -> None:
        self.rate_per_s, self.burst, self.max_keys = rate_per_s, burst, max_keys
        self._buckets: dict = {}  # key -> [tokens, last refill, refused since allowed]

    def take(self, key, now: float) -> tuple[bool, int]:
        bucket = self._buckets.get(key)
        if bucket is None:
            if len(self._buckets) >= self.max_keys:
                self._buckets.clear()
            bucket = self._buckets[key] = [float(self.burst), now, 0]
        bucket[0] = min(self.burst, bucket[0] + (now - bucket[1]) * self.rate_per_s)
        bucket[1] = now
        if bucket[0] < 1.0:
            bucket[2] += 1
            return False, bucket[2]
        bucket[0] -= 1.0
        refused, bucket[2] = bucket[2], 0
        return True, refused


class StreamLimits:
    """Caps on concurrent calls: at most `per_peer` streams per peer (its
    certificate's identity; on a plaintext channel, where nobody has one,
    its connection) and `total` in all. `acquire(peer)` takes a slot (False when none is left);
    `release(peer)` gives it back."""

    def __init__(self, per_peer: int, total: int) -> None:
        self.per_peer, self.total = per_peer, total
        self.open: dict[str, int] = {}
        self.count = 0

    def acquire(self, peer: str) -> bool:
        if self.count >= self.total or self.open.get(peer, 0) >= self.per_peer:
            return False
        self.open[peer] = self.open.get(peer, 0) + 1
        self.count += 1
        return True

    def release(self, peer: str) -> None:
        left = self.open.get(peer, 0) - 1
        if left < 0:
            return
        self.count -= 1
        if left:
            self.open[peer] = left
        else:
            del self.open[peer]
