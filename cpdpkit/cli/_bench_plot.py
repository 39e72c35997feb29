"""The accuracy-vs-wall-clock plot of ``cpdpkit bench --plot`` (and of ``tools/docs_tables.py --plot``).

It reads the ``--json`` schema (``BenchReport.to_dict()``), so a plot can be redrawn from a saved run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["plot_accuracy_vs_wall"]


def plot_accuracy_vs_wall(report: dict[str, Any], path: Path) -> None:
    """Test accuracy against wall clock, one curve per strategy (and topology, when there are several).

    The mean over seeds, with a band of ±1 std across seeds at each epoch when there are several.
    A strategy keeps its colour on every topology; the topology sets the line style.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = report["config"]
    topologies = list(dict.fromkeys(r.get("topology") or cfg.get("topology") for r in report["results"]))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colours: dict[str, Any] = {}
    styles = ("-", "--", ":", "-.")
    for r in report["results"]:
        curve = r.get("curve") or []
        if curve:
            wall, acc = [p["wall_s"] for p in curve], [p["test_acc"] * 100 for p in curve]
            std = [p.get("test_acc_std", 0.0) * 100 for p in curve]
            label = r["strategy"] if r.get("period") is None else f"{r['strategy']} K={r['period']}"
            topology = r.get("topology") or cfg.get("topology")
            style = styles[topologies.index(topology) % len(styles)]
            colour = colours.setdefault(label, f"C{len(colours) % 10}")
            if len(topologies) > 1:
                label += f" ({topology})"
            (line,) = ax.plot(wall, acc, marker=".", label=label, color=colour, linestyle=style)
            if any(std):
                ax.fill_between(wall, [a - s for a, s in zip(acc, std)], [a + s for a, s in zip(acc, std)],
                                color=line.get_color(), alpha=0.2, linewidth=0)
    seeds = cfg.get("seeds", 1)
    spread = f"; mean ± std over {seeds} seeds" if seeds > 1 else ""
    ax.set_xlabel("wall-clock training time (s)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(f"test accuracy vs wall clock ({', '.join(map(str, topologies or [cfg['topology']]))}{spread})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small" if len(report["results"]) > 8 else None)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
