"""compare's Pareto plot: memory against FLOP overhead, one labelled point per policy
(`plot`), written with `report.save_figure`.
Docs: docs/compare.md (`--plot`).
"""

from __future__ import annotations

from collections.abc import Sequence

from remat_kit.ui.report import compiled_by, memory_kind_of, save_figure
from remat_kit.measure.record import MEMORY_LABELS


def plot(path, report_rows: Sequence[dict], title: str = "") -> None:
    """PNG of memory (`memory_bytes`, GiB or MiB: temp on CPU, peak on TPU and GPU,
    named on the axis) against FLOP overhead (% over `none`, or over the fewest
    FLOPs if `none` is absent): one labelled point per policy, the Pareto front
    as a step line. Rows with an error are left out. The title's last line
    names the target and the jax and compiler versions."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter

    pts = [d for d in report_rows if d["error"] is None and d["flops"] is not None
           and d["memory_bytes"] is not None]
    base = next((d["flops"] for d in pts if d["policy"] == "none"),
                min((d["flops"] for d in pts), default=1.0))
    top = max((d["memory_bytes"] for d in pts), default=0)
    unit, size = ("GiB", 2**30) if top >= 2**30 else ("MiB", 2**20)
    xy = [((d["flops"] / base - 1) * 100, d["memory_bytes"] / size) for d in pts]
    fig, ax = plt.subplots(figsize=(9, 6), dpi=120)
    ax.scatter([x for x, _ in xy], [y for _, y in xy],
               c=["tab:red" if d["pareto"] else "tab:blue" for d in pts], zorder=3)
    # One label per position (policies that compile alike coincide); labels
    # alternate above and below their point so neighbours overlap less.
    labels: dict[tuple, list[str]] = {}
    for d, (x, y) in zip(pts, xy):
        labels.setdefault((round(x, 2), round(y, 3)), []).append(d["names"][0])
    for i, ((x, y), text) in enumerate(sorted(labels.items())):
        ax.annotate(" / ".join(text), (x, y), fontsize=7, rotation=20,
                    xytext=(4, 4 if i % 2 == 0 else -10), textcoords="offset points")
    front = sorted(p for p, d in zip(xy, pts) if d["pareto"])
    if front:
        ax.step([x for x, _ in front], [y for _, y in front], where="post", color="tab:red",
                alpha=0.6, label="Pareto front")
        ax.legend()
    platform = pts[0]["platform"] if pts else ""
    ax.set_xlabel("FLOP overhead vs no remat (%)")
    ax.set_ylabel(f"{MEMORY_LABELS[memory_kind_of(pts)]} memory, {unit} ({platform})")
    ax.set_title(f"{title}\n{compiled_by(report_rows)}" if title else compiled_by(report_rows),
                 fontsize=9)
    ax.grid(alpha=0.3)
    if xy and max(y for _, y in xy) / max(min(y for _, y in xy), 1e-12) > 5:
        ax.set_yscale("log")  # a wide memory range would squash the low rows
        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
    fig.tight_layout()
    save_figure(fig, path)


__all__ = ["plot"]
