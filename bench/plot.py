"""A PNG of a session: TG of every request in the order sent, and draft acceptance per round."""
from __future__ import annotations

import textwrap

from bench.records import Record
from bench.summary import Summary, config_line


def plot(records: list[Record], summary: Summary, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")  # files only: no display on a server, and no GUI toolkit to import
    import matplotlib.pyplot as plt

    fig, (tg_ax, acc_ax) = plt.subplots(1, 2, figsize=(11, 4.5))
    ordered = sorted(records, key=lambda r: (r.run, r.lane))
    lanes = sorted({r.lane for r in ordered})
    for lane in lanes:
        points = [(i, r) for i, r in enumerate(ordered) if r.lane == lane and r.predicted_per_second is not None]
        valid = [(i, r.predicted_per_second) for i, r in points if r.valid]
        invalid = [(i, r.predicted_per_second) for i, r in points if not r.valid]
        line = tg_ax.plot(*zip(*valid), "o", label=f"lane {lane}")[0] if valid else None
        if invalid:
            tg_ax.plot(*zip(*invalid), "x", color=line.get_color() if line else None, label=f"lane {lane} (invalid)")
    tg_ax.set(xlabel="request (run, then lane)", ylabel="TG tokens/s", title="TG per request")
    tg_ax.set_ylim(bottom=0)
    tg_ax.legend(fontsize="small")

    drafted = [r for r in summary.rounds if r.acceptance is not None]
    if drafted:
        acc_ax.bar([str(r.run) for r in drafted], [r.acceptance for r in drafted])
        acc_ax.set_ylim(0, 1)
    else:
        acc_ax.text(0.5, 0.5, "no drafts reported", ha="center", va="center", transform=acc_ax.transAxes)
    acc_ax.set(xlabel="run", ylabel="draft_n_accepted / draft_n", title="draft acceptance per run")

    fig.suptitle("\n".join(textwrap.wrap(config_line(summary.config), 130)), fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
