"""`elasticd report --plot FILE.png`: the job's timeline as a picture, from
its journal (matplotlib, the optional `plot` extra).

Four panels on one time axis (seconds since the journal's first entry):
the hosts in each generation (a band per generation, its startup before the
first step drawn lighter); the step the slice had reached and the latest
committed step; the step rate between journal entries of one generation;
and, below, the badput by cause (elastic.goodput). Incidents are vertical
lines across the panels, labelled with their kind and host.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterable

from elastic.goodput import CAUSES, account

#: Colours of the badput causes (matplotlib's tab10, in CAUSES order).
_CAUSE_COLOURS = ("tab:gray", "tab:red", "tab:orange", "tab:purple", "tab:brown", "tab:pink",
                  "tab:olive")


class PlotError(RuntimeError):
    """The plot cannot be made: matplotlib is missing, or the journal is empty."""


def _generations(entries: list[dict], t0: float, t_end: float) -> list[dict]:
    """{number, start, first, end, hosts} per generation, seconds since t0."""
    gens: dict[int, dict] = {}
    for e in entries:
        g, kind = e.get("generation") or 0, e["kind"]
        if kind == "generation_started":
            gens[g] = {"number": g, "start": e["ts"] - t0, "first": None, "end": None,
                       "hosts": len(e.get("hosts") or [])}
        elif g in gens:
            if kind == "first_progress" and gens[g]["first"] is None:
                gens[g]["first"] = e["ts"] - t0
            elif kind in ("slice_stopped", "job_succeeded", "job_failed") and \
                    gens[g]["end"] is None:
                gens[g]["end"] = e["ts"] - t0
    for gen in gens.values():
        gen["end"] = gen["end"] if gen["end"] is not None else t_end - t0
    return [gens[g] for g in sorted(gens)]


def _steps(entries: list[dict], t0: float) -> tuple[list, list]:
    """([(t, step, generation)] of entries that report a step, [(t, committed step)])."""
    reached, committed = [], []
    for e in entries:
        step = e.get("step")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            continue
        if e["kind"] == "checkpoint_committed":
            committed.append((e["ts"] - t0, step))
        if e["kind"] in ("first_progress", "checkpoint_saved", "checkpoint_committed",
                         "slice_adopted", "job_succeeded", "fault_injected", "worker_exited",
                         "agent_silent"):
            reached.append((e["ts"] - t0, step, e.get("generation") or 0))
    reached.sort()
    return reached, committed


def plot_timeline(journal: Iterable[dict], path: str | pathlib.Path) -> pathlib.Path:
    """Write the timeline of the job whose journal entries (in order) are
    `journal` to `path` (PNG, 1600 x 1100 pixels). Returns the path. Raises
    PlotError when matplotlib is not installed or the journal is empty, and
    OSError when the file cannot be written."""
    entries = list(journal)
    if not entries:
        raise PlotError("the journal has no entries: nothing to plot")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotError("--plot needs matplotlib: pip install 'elastic[plot]'") from None
    goodput = account(entries, now=entries[-1]["ts"])
    t0, t_end = entries[0]["ts"], entries[-1]["ts"]
    gens = _generations(entries, t0, t_end)
    reached, committed = _steps(entries, t0)

    fig, (ax_hosts, ax_steps, ax_rate, ax_bad) = plt.subplots(
        4, 1, figsize=(16, 11), dpi=100, gridspec_kw={"height_ratios": [2, 3, 2, 1]})
    job = next((e["reason"].split(":")[0] for e in entries if e["kind"] == "controller_started"),
               "job")
    fig.suptitle(f"{job}: {goodput.steps} steps, {goodput.generations} generation(s), "
                 f"{len(goodput.incidents)} incident(s), ETTR {100 * goodput.ettr:.1f} %")
    colours = plt.get_cmap("tab20")
    for i, gen in enumerate(gens):
        colour = colours(i % 20)
        first = gen["first"] if gen["first"] is not None else gen["end"]
        ax_hosts.broken_barh([(gen["start"], max(0.0, first - gen["start"]))], (0, gen["hosts"]),
                             facecolors=colour, alpha=0.35)
        ax_hosts.broken_barh([(first, max(0.0, gen["end"] - first))], (0, gen["hosts"]),
                             facecolors=colour)
        ax_hosts.text(gen["start"], gen["hosts"] + 0.1, f"g{gen['number']}", fontsize=8)
    ax_hosts.set_ylabel("hosts")
    ax_hosts.set_ylim(0, max([g["hosts"] for g in gens] + [1]) + 1)

    if reached:
        ax_steps.plot([t for t, _, _ in reached], [s for _, s, _ in reached], ".-",
                      label="step reached", color="tab:blue")
    if committed:
        ax_steps.step([t for t, _ in committed], [s for _, s in committed], where="post",
                      label="committed step", color="tab:green")
    ax_steps.set_ylabel("step")
    ax_steps.legend(loc="upper left")

    rates = [((t1 + t2) / 2, (s2 - s1) / (t2 - t1))
             for (t1, s1, g1), (t2, s2, g2) in zip(reached, reached[1:])
             if g1 == g2 and t2 - t1 > 0.5 and s2 > s1]
    if rates:
        ax_rate.plot([t for t, _ in rates], [r for _, r in rates], ".-", color="tab:cyan")
    ax_rate.set_ylabel("steps / s")
    ax_rate.set_ylim(bottom=0)
    ax_rate.set_xlabel("seconds since the job started")

    for ax in (ax_hosts, ax_steps, ax_rate):
        ax.set_xlim(0, max(1.0, t_end - t0))
        for incident in goodput.incidents:
            ax.axvline(incident.at - t0, color="tab:red" if incident.restarted else "tab:orange",
                       linestyle="--", linewidth=1)
    for incident in goodput.incidents:
        ax_hosts.text(incident.at - t0, ax_hosts.get_ylim()[1] * 0.98,
                      f" {incident.kind} {incident.host or ''}", rotation=90, fontsize=7,
                      va="top", color="tab:red")

    left = 0.0
    for cause, colour in zip(CAUSES, _CAUSE_COLOURS):
        share = 100 * goodput.badput_s[cause] / goodput.wall_s if goodput.wall_s else 0.0
        ax_bad.barh([0], [share], left=left, color=colour, label=f"{cause} {share:.1f} %")
        left += share
    ax_bad.set_xlim(0, max(1.0, left * 1.1))
    ax_bad.set_yticks([])
    ax_bad.set_xlabel("badput, % of wall time")
    ax_bad.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    fig.tight_layout()
    out = pathlib.Path(path)
    fig.savefig(out, format="png")
    plt.close(fig)
    return out
