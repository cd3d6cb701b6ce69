"""Goodput accounting from the journal: how much wall time became training.

ETTR (effective training time ratio) = productive step time / wall time. The
rest (badput) is split by cause:

- waiting: no generation running (before the first one, or between a stop
  and the next start: too few hosts, settling);
- detection: from the moment a failure happened to `slice_stopping` (the
  failure moment: an injected fault's time, a lost host's or a hang's last
  sign of life, a worker's exit);
- teardown: `slice_stopping` -> `slice_stopped`;
- startup: `generation_started` -> first step, less the restore (process
  start, distributed init, compile);
- restore: the restore time the workers report;
- lost work: training thrown away: from the save of the step the next
  generation resumed from (a checkpoint save, or the copy of a local
  snapshot; from the generation's first step, if it kept none of it) to the
  failure moment; training after that moment is already
  counted as detection;
- checkpoint save: the time training was blocked starting checkpoint saves
  (the device-to-host copy and Orbax's barriers; the write itself runs in
  the background) and writing local snapshots, as process 0 reports it
  (snapshots: summed at each checkpoint save).

Productive time is each generation's time from its first step to its stop,
less its detection time, lost work and checkpoint save time. Pure: journal entries in, numbers out.
The definitions follow the ML Goodput notion of Google Cloud's
`ml-goodput-measurement` (productive training time over total job time; it
also counts unproductive checkpoint save time as badput).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

from elastic.policy.failure_history import number

CAUSES = ("waiting", "detection", "teardown", "startup", "restore", "lost_work",
          "checkpoint_save")


@dataclasses.dataclass
class Incident:
    """One failure or preemption, as the journal tells it.

    detected_after_s: failure moment -> slice_stopping; recovered_after_s:
    failure moment -> first step of the next generation (None if none came);
    lost_steps: steps computed again after the restore. restarted: False for
    a silent agent the slice rode out (`agent_silent`: its worker trained
    on, no restart, nothing lost): then detected_after_s runs to
    `agent_silent` and recovered_after_s to `agent_heard` (None if its
    heartbeats had not resumed when the generation ended). noticed: False
    for an injected fault that left no sign at all (a partition that healed
    before anything timed out, a throttled link): then both are 0.0.
    """

    kind: str
    host: str | None
    generation: int
    at: float
    detected_after_s: float
    recovered_after_s: float | None
    lost_steps: int
    reason: str
    restarted: bool = True
    noticed: bool = True
    #: the failing host's own words: the last lines its worker wrote to
    #: stderr before it failed (a traceback, as the agent reported them with
    #: its exit), or the stacks of a hung worker's threads; "" if none
    last_words: str = ""
    #: where the time from the stop to the next generation's first step went
    #: (seconds, in order; see startup_phases); empty if none came
    startup: dict = dataclasses.field(default_factory=dict)


#: Lines of a worker's stderr tail shown with its incident.
LAST_WORDS_LINES = 20


def last_lines(text: str, lines: int = LAST_WORDS_LINES) -> str:
    """The last `lines` non-empty lines of `text`."""
    return "\n".join([line for line in text.splitlines() if line.strip()][-lines:])


@dataclasses.dataclass
class Goodput:
    """wall_s and productive_s in seconds; badput_s by cause (CAUSES);
    ettr = productive_s / wall_s; steps: the last step reached + 1.
    full_size_steps: the steps that survived (not computed again after a
    restore), each weighted by its generation's hosts over the largest
    generation's: the work done, in steps of the full slice, where a
    slice's throughput scales with its hosts. ETTR alone can rise while
    this does not (a slower step is more productive time); compare both."""

    wall_s: float
    productive_s: float
    badput_s: dict[str, float]
    ettr: float
    steps: int
    generations: int
    incidents: list[Incident]
    full_size_steps: float = 0.0

    def to_json(self) -> dict:
        """The figures as a JSON object (seconds rounded to ms), as
        `elasticd report --json` prints them."""
        return {"wall_s": round(self.wall_s, 3), "productive_s": round(self.productive_s, 3),
                "ettr": round(self.ettr, 5), "steps": self.steps,
                "full_size_steps": round(self.full_size_steps, 2),
                "generations": self.generations,
                "badput_s": {k: round(v, 3) for k, v in self.badput_s.items()},
                "incidents": [dataclasses.asdict(i) for i in self.incidents]}


@dataclasses.dataclass
class _Generation:
    number: int
    start: float
    hosts: list[str]
    first: float | None = None
    first_step: int = -1
    restore_s: float = 0.0
    restored_step: int | None = None
    # when the restored state was captured, if the workers said (local snapshots)
    restored_saved_at: float | None = None
    stop: float | None = None
    stop_entry: dict | None = None
    stopped: float | None = None
    last_step: int = -1
    # (when, seconds): how long each checkpoint save blocked training
    save_blocking: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    # step -> when its save started (the state it captured)
    saved_at: dict[int, float] = dataclasses.field(default_factory=dict)
    # (when, kind, host, reason, injected): what may have ended this generation
    signs: list[tuple[float, str, str | None, str, bool]] = dataclasses.field(default_factory=list)
    # agent_silent entries, and (when, host) of agent_heard / host_lost entries
    silences: list[dict] = dataclasses.field(default_factory=list)
    # (when, host) of every fault_injected
    faults: list[tuple[float, str | None]] = dataclasses.field(default_factory=list)
    heard: list[tuple[float, str]] = dataclasses.field(default_factory=list)
    lost: list[tuple[float, str]] = dataclasses.field(default_factory=list)
    # host -> its worker's last words (stderr tail of a failed exit, stacks of a hang)
    last_words: dict[str, str] = dataclasses.field(default_factory=dict)
    # process 0's worker_phases entry (elastic.worker: phase -> seconds, launched_at)
    phases: dict | None = None
    # rebuilt from the agents' reports (generation_discovered): its start is not
    # journaled, and `start` is when it was discovered
    discovered: bool = False


def _seconds(entry: Mapping, key: str) -> float:
    """entry[key] as a duration in seconds: 0.0 unless a finite number > 0."""
    value = number(entry, key)
    return value if value is not None and value > 0 else 0.0


def _step(entry: Mapping, default: int | None = -1) -> int | None:
    """entry["step"] when it is an integer, else `default`."""
    value = entry.get("step")
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _generations(entries: list[dict]) -> list[_Generation]:
    gens: dict[int, _Generation] = {}
    for e in entries:
        kind, g = e["kind"], e.get("generation") or 0
        if kind == "generation_started" or kind == "generation_discovered" and g not in gens:
            hosts = e.get("hosts")
            hosts = [h for h in hosts if isinstance(h, str)] if isinstance(hosts, list) else []
            if kind == "generation_started" or hosts:
                gens[g] = _Generation(g, e["ts"], hosts,
                                      discovered=kind == "generation_discovered")
            continue
        gen = gens.get(g)
        if gen is None:
            continue
        if kind == "first_progress" and gen.first is None:
            gen.first, gen.first_step = e["ts"], _step(e)
            gen.last_step = max(gen.last_step, gen.first_step)
        elif kind == "slice_adopted" and gen.first is None and _step(e) >= 0:
            # a generation adopted after its first step, which the controller
            # that started it did not live to journal: it stepped by now
            gen.first, gen.first_step = e["ts"], _step(e)
            gen.last_step = max(gen.last_step, gen.first_step)
        elif kind == "worker_phases" and gen.phases is None:
            gen.phases = e
        elif kind == "checkpoint_restored":
            gen.restore_s, gen.restored_step = _seconds(e, "restore_s"), _step(e, None)
            gen.restored_saved_at = number(e, "saved_at")
        elif kind in ("slice_stopping", "job_succeeded", "job_failed") and gen.stop is None:
            gen.stop, gen.stop_entry = e["ts"], e
            if kind != "slice_stopping":
                gen.stopped = e["ts"]
                gen.last_step = max(gen.last_step, _step(e))
        elif kind == "slice_stopped" and gen.stopped is None:
            gen.stopped = e["ts"]
        elif kind in ("worker_exited", "checkpoint_committed", "checkpoint_saved"):
            if gen.first is not None or kind == "worker_exited":
                gen.last_step = max(gen.last_step, _step(e))
            blocking = _seconds(e, "blocking_s")
            if kind == "checkpoint_saved" and (blocking or _seconds(e, "snapshots_s")):
                gen.save_blocking.append((e["ts"], blocking + _seconds(e, "snapshots_s")))
            if kind == "checkpoint_saved" and _step(e, None) is not None:
                gen.saved_at[_step(e)] = e["ts"] - blocking
        if kind == "agent_silent":
            gen.silences.append(e)
        elif kind in ("agent_heard", "host_lost"):
            (gen.heard if kind == "agent_heard" else gen.lost).append((e["ts"], e.get("host")))
        if kind == "fault_injected":
            gen.faults.append((e["ts"], e.get("host")))
        # signs of the failure that ends this generation, with the moment it happened
        if kind == "fault_injected" and not str(e.get("fault", "")).startswith("storage-"):
            # (storage faults slow or fail saves; they end no generation)
            gen.signs.append((e["ts"], e.get("fault", "fault"), e.get("host"), e["reason"], True))
        elif kind in ("host_lost", "hang_detected"):
            gen.signs.append((e["ts"] - _seconds(e, "silent_s"), kind, e.get("host"), e["reason"],
                              False))
        elif kind == "preemption_notice":
            gen.signs.append((e["ts"], "preemption", e.get("host"), e["reason"], False))
        elif kind == "worker_exited" and not e.get("stopped_on_request") and \
                (e.get("exit_code") or e.get("signal")):
            gen.signs.append((e["ts"], "worker_exited", e.get("host"), e["reason"], False))
            if e.get("stderr_tail") and e.get("host"):
                gen.last_words.setdefault(e["host"], last_lines(str(e["stderr_tail"])))
        if kind == "worker_stacks" and e.get("host") and e.get("stacks"):
            gen.last_words[e["host"]] = str(e["stacks"])
    return [gens[k] for k in sorted(gens)]


def _ridden_out(gen: _Generation) -> list[Incident]:
    """Incidents of silent agents the generation kept (no restart), each with
    the injected fault that explains it, which is then no longer a candidate
    cause of the generation's end (removed from `gen.signs`)."""
    incidents = []
    for e in gen.silences:
        ts, host = e["ts"], e.get("host")
        if any(at >= ts and h == host for at, h in gen.lost):
            continue  # carried, then lost: the generation's end tells it
        went_silent = ts - _seconds(e, "silent_s")
        faults = [s for s in gen.signs if s[4] and s[2] == host and went_silent - 2.0 <= s[0] <= ts]
        at, kind = went_silent, "agent_silent"
        if faults:
            fault = max(faults)
            gen.signs.remove(fault)
            at, kind = fault[0], fault[1]
        heard = min((t for t, h in gen.heard if h == host and t >= ts), default=None)
        incidents.append(Incident(kind, host, gen.number, at, max(0.0, ts - at),
                                  None if heard is None else heard - at, 0, e["reason"],
                                  restarted=False))
    return incidents


def _unnoticed(gen: _Generation, stop: float, blamed: tuple | None) -> list[Incident]:
    """Injected faults of `gen` up to `stop` that were not `blamed` for its
    end (nor a silence the slice rode out) and left no sign (a loss, a
    hang, a crash, a silence) on their host before the next fault there: a
    partition that healed before anything timed out, a throttled link."""
    faults = sorted(s for s in gen.signs if s[4] and s[0] <= stop + 1e-6 and s != blamed)
    seen = [(at, host) for at, _, host, _, injected in gen.signs if not injected] + \
        [(e["ts"], e.get("host")) for e in gen.silences]
    out = []
    for at, kind, host, reason, _ in faults:
        until = min((t for t, h in gen.faults if h == host and t > at), default=stop + 1e-6)
        if not any(h == host and at <= t <= until for t, h in seen):
            out.append(Incident(kind, host, gen.number, at, 0.0, 0.0, 0,
                                f"{reason} (nothing noticed)", restarted=False, noticed=False))
    return out


def _end(entries: list[dict], now: float | None) -> float:
    """When the wall time ends (Unix seconds): at the last end of the job or
    stop of a controller that no later controller started after; else (a
    job still running, or whose controller exited and was started again:
    every exit, SIGTERM, a step-down, a crash systemd restarts, journals
    `controller_stopped`) at `now` or the last entry, whichever is later."""
    for e in reversed(entries):
        if e["kind"] == "controller_started":
            break
        if e["kind"] in ("job_succeeded", "job_failed", "controller_stopped"):
            return e["ts"]
    return max(now or 0.0, entries[-1]["ts"])


def account(journal: Iterable[dict], now: float | None = None) -> Goodput:
    """Goodput of a job from its journal entries (in order). For a job still
    running, `now` (Unix seconds) ends the wall time (default: the last entry)."""
    entries = list(journal)
    if not entries:
        return Goodput(0.0, 0.0, dict.fromkeys(CAUSES, 0.0), 0.0, 0, 0, [])
    t0 = entries[0]["ts"]
    t_end = _end(entries, now)
    gens = _generations(entries)
    bad = dict.fromkeys(CAUSES, 0.0)
    productive = 0.0
    incidents: list[Incident] = []
    covered_until = t0
    full_size_steps, largest = 0.0, max((len(g.hosts) for g in gens), default=0) or 1
    for i, gen in enumerate(gens):
        incidents += _ridden_out(gen)
        nxt = gens[i + 1] if i + 1 < len(gens) else None
        # A generation ends by the next one's start at the latest: a stop that a
        # killed controller left unfinished (no slice_stopped) or never began
        # is over when a later controller starts the next generation.
        until = min(t_end, nxt.start) if nxt is not None else t_end
        # (a discovered generation started unjournaled after the one before it
        # ended: its leader died before its start reached this journal)
        start = min(gen.start, covered_until if gen.discovered else until)
        bad["waiting"] += max(0.0, start - covered_until)
        stop = min(gen.stop, until) if gen.stop is not None else until
        stopped = min(gen.stopped, until) if gen.stopped is not None else until
        first = min(gen.first, stop) if gen.first is not None else stop
        restore = min(gen.restore_s, max(0.0, first - start))
        bad["restore"] += restore
        bad["startup"] += max(0.0, first - start) - restore
        bad["teardown"] += max(0.0, stopped - stop)
        covered_until = max(stopped, stop)
        training = max(0.0, stop - first)
        # lost steps: after the checkpoint the next generation restored (known
        # once the next generation restored a step or made its first step; a
        # job that ended before that lost nothing it would redo)
        lost_steps, resumed = 0, None
        if nxt is not None and gen.first is not None:
            resumed = nxt.restored_step if nxt.restored_step is not None else \
                (nxt.first_step - 1 if nxt.first is not None else None)
            if resumed is not None:
                lost_steps = max(0, gen.last_step - resumed)
        if gen.first is not None:  # its steps from its first to the last one kept
            kept = gen.last_step - lost_steps - gen.first_step + 1
            full_size_steps += max(0, kept) * len(gen.hosts) / largest
        detection, at, blamed = 0.0, stop, None
        cause = (gen.stop_entry or {}).get("cause")
        if gen.stop_entry and gen.stop_entry["kind"] == "slice_stopping" and \
                cause in ("failure", "preemption"):
            signs = [s for s in gen.signs if s[0] <= stop + 1e-6] or \
                [(stop, cause, gen.stop_entry.get("host"), gen.stop_entry["reason"], False)]
            # an injected fault is the known cause: the latest one on the host
            # the stop names (a hang blamed on nobody names none: then its
            # first suspect), else the latest one (those before it the slice
            # rode out); without one, the earliest sign of trouble
            injected = [s for s in signs if s[4]]
            suspect = gen.stop_entry.get("host") or next(
                (s[2] for s in reversed(signs) if s[1] == "hang_detected"), None)
            named = [s for s in injected if s[2] == suspect]
            blamed = max(named or injected) if injected else min(signs)
            at, kind, host, reason, _ = blamed
            if cause == "failure":
                detection = min(training, max(0.0, stop - max(at, first)))
            recovered = (nxt.first - at) if nxt is not None and nxt.first is not None else None
            incidents.append(Incident(kind, host, gen.number, at, max(0.0, stop - at),
                                      recovered, lost_steps, reason,
                                      last_words=gen.last_words.get(host or "", ""),
                                      startup=startup_phases(stop, nxt)))
        # Useful training ends at the failure moment (after it: detection), or
        # at the stop; with steps lost, at the save of the step resumed from.
        useful_until = min(at, stop) if cause == "failure" else stop
        lost = 0.0
        if lost_steps:
            saved = nxt.restored_saved_at if nxt.restored_saved_at is not None else \
                gen.saved_at.get(resumed, first)
            kept_until = min(useful_until, max(first, saved))
            lost = min(max(0.0, training - detection), useful_until - kept_until)
            useful_until = kept_until
        saving = min(max(0.0, training - detection - lost),
                     sum(s for ts, s in gen.save_blocking if first <= ts - s <= useful_until))
        incidents += _unnoticed(gen, stop, blamed)
        bad["detection"] += detection
        bad["lost_work"] += lost
        bad["checkpoint_save"] += saving
        productive += max(0.0, training - detection - lost - saving)
    bad["waiting"] += max(0.0, t_end - covered_until)
    incidents.sort(key=lambda inc: inc.at)
    wall = max(1e-9, t_end - t0)
    steps = max((g.last_step for g in gens), default=-1) + 1
    return Goodput(wall, productive, bad, productive / wall, steps, len(gens), incidents,
                   full_size_steps)


#: The worker's startup phases in the order they run (elastic.worker.runtime).
WORKER_PHASES = ("process_start", "import_jax", "distributed_init", "mesh", "setup", "compile",
                 "checkpoint_setup", "restore", "first_step")


def startup_phases(stop: float, nxt: _Generation | None) -> dict:
    """From `stop` (slice_stopping, Unix seconds) to the first step of the
    generation `nxt`, back to back: `stop` (to generation_started: the old
    workers ending), `launch` (to the worker process's start or launch, on
    its host's clock), process 0's phases (WORKER_PHASES), and `report` (the
    rest: the first step's report reaching the controller, and whatever the
    phases missed). `report` is negative, by tens of milliseconds, when
    another process's first step reached the controller before process 0
    ended its own first step (the generation's first step is the earliest
    any member reports), or when the hosts' clocks disagree. {} without a
    first step or phases."""
    if nxt is None or nxt.first is None or not nxt.phases:
        return {}
    e = nxt.phases
    out = {"stop": round(nxt.start - stop, 3)}
    launched = number(e, "launched_at")
    if launched:
        out["launch"] = round(launched - nxt.start, 3)
    for name in WORKER_PHASES:
        if number(e, f"{name}_s") is not None:
            out[name] = number(e, f"{name}_s")
    out["report"] = round(nxt.first - stop - sum(out.values()), 3)
    return out


def format_report(g: Goodput) -> str:
    """The table `elasticd report` prints."""
    lines = [f"wall time {g.wall_s:.1f} s, productive {g.productive_s:.1f} s: "
             f"ETTR {100 * g.ettr:.1f} %", f"{g.steps} steps ({g.full_size_steps:.0f} in steps "
             f"of the largest slice), {g.generations} generation(s), "
             f"{len(g.incidents)} incident(s)", "", "badput by cause:"]
    for cause in CAUSES:
        share = 100 * g.badput_s[cause] / g.wall_s if g.wall_s else 0.0
        lines.append(f"  {cause:15} {g.badput_s[cause]:8.1f} s  {share:5.1f} %")
    if g.incidents:
        lines += ["", f"  {'GEN':>4}  {'KIND':16} {'HOST':8} {'DETECTED AFTER':>14} "
                      f"{'RECOVERED AFTER':>15} {'LOST STEPS':>10}"]
        for i in g.incidents:
            detected = f"{i.detected_after_s:.2f} s" if i.noticed else "-"
            recovered = f"{i.recovered_after_s:.2f} s" \
                if i.noticed and i.recovered_after_s is not None else "-"
            lines.append(f"  {i.generation:>4}  {i.kind:16} {i.host or '-':8} "
                         f"{detected:>14} {recovered:>15} {i.lost_steps:>10}"
                         + ("" if i.restarted else "  no restart: the slice kept stepping")
                         + ("" if i.noticed else " (nothing noticed)"))
        startups = [i for i in g.incidents if i.startup]
        if startups:
            lines += ["", "  stop -> first step of the next generation (seconds):"]
            for i in startups:
                lines.append(f"  {i.generation:>4}  " + ", ".join(
                    f"{k} {round(v, 2) + 0.0:.2f}" for k, v in i.startup.items())  # (no -0.00)
                    + f"  (= {sum(i.startup.values()):.2f})")
        for i in g.incidents:
            if i.last_words:
                lines += ["", f"  generation {i.generation}, {i.kind} on {i.host}: its last "
                              f"words", *(f"    | {line}" for line in i.last_words.splitlines())]
    return "\n".join(lines)
