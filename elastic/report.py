"""Summaries of a job from its journal."""

from __future__ import annotations

from collections.abc import Iterable


def _next(entries: list[dict], kind: str, after_ts: float, **match) -> dict | None:
    return next((e for e in entries if e["kind"] == kind and e["ts"] >= after_ts
                 and all(e.get(k) == v for k, v in match.items())), None)


def summarize(journal: Iterable[dict]) -> str:
    """A few lines: outcome, steps, generations, restarts, final loss, and per
    injected fault how it was detected and how long recovery took (fault ->
    first step of the next generation) and how many steps were recomputed."""
    entries = list(journal)
    if not entries:
        return "no journal entries"
    t0 = entries[0]["ts"]
    end = next((e for e in reversed(entries) if e["kind"] in ("job_succeeded", "job_failed")),
               None)
    generations = max((e.get("generation") or 0) for e in entries)
    restarts = sum(1 for e in entries if e["kind"] == "slice_stopped")
    lines = ["", "summary:"]
    if end is None:
        lines.append(f"  job did not finish (last entry: {entries[-1]['kind']})")
    elif end["kind"] == "job_failed":
        lines.append(f"  job FAILED after {end['ts'] - t0:.1f} s: {end['reason']}")
    else:
        loss = (end.get("metrics") or {}).get("loss")
        lines.append(f"  job succeeded in {end['ts'] - t0:.1f} s: {end.get('step', -1) + 1} steps"
                     + (f", final loss {loss:.4f}" if loss is not None else ""))
    lines.append(f"  {generations} generation(s), {restarts} restart(s)")
    for fault in (e for e in entries if e["kind"] == "fault_injected"):
        detected = _next(entries, "slice_stopping", fault["ts"])
        started = _next(entries, "generation_started", fault["ts"])
        first = started and _next(entries, "first_progress", started["ts"],
                                  generation=started["generation"])
        restored = started and _next(entries, "checkpoint_restored", started["ts"],
                                     generation=started["generation"])
        parts = [f"  {fault['reason']}:"]
        if detected:
            parts.append(f"detected after {detected['ts'] - fault['ts']:.1f} s "
                         f"({detected['reason']});")
        if first:
            parts.append(f"generation {started['generation']} on {len(started['hosts'])} hosts "
                         f"made its first step {first['ts'] - fault['ts']:.1f} s after the fault;")
        if restored is not None and fault.get("step", -1) >= 0:
            lost = max(0, fault["step"] - restored["step"])
            parts.append(f"resumed from checkpoint step {restored['step']}, "
                         f"{lost} step(s) recomputed")
        lines.append(" ".join(parts))
    return "\n".join(lines)
