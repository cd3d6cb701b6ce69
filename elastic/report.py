"""The end-of-run summary of `elasticd local`: outcome, then the goodput report."""

from __future__ import annotations

from collections.abc import Iterable

from elastic.controller.journal import job_entries
from elastic.goodput import account, format_report


def summarize(journal: Iterable[dict]) -> str:
    """Outcome (succeeded / failed / unfinished, final loss) and the goodput
    report (ETTR, badput by cause, one line per incident), of the journal's
    latest job where several ran one after another."""
    entries = job_entries(list(journal))
    if not entries:
        return "no journal entries"
    end = next((e for e in reversed(entries) if e["kind"] in ("job_succeeded", "job_failed")),
               None)
    t0 = entries[0]["ts"]
    if end is None:
        outcome = f"job did not finish (last entry: {entries[-1]['kind']})"
    elif end["kind"] == "job_failed":
        outcome = f"job FAILED after {end['ts'] - t0:.1f} s: {end['reason']}"
    else:
        loss = (end.get("metrics") or {}).get("loss")
        outcome = (f"job succeeded in {end['ts'] - t0:.1f} s"
                   + (f", final loss {loss:.4f}" if loss is not None else ""))
    report = format_report(account(entries, now=entries[-1]["ts"]))
    return "\n".join(["", "summary: " + outcome, *("  " + line for line in report.splitlines())])
