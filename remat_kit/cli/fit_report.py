"""`remat-kit fit`'s outputs: the table, the JSON and the bar chart of a
`remat_kit.decide.fit.FitResult`."""

from __future__ import annotations

import dataclasses

from rich.markup import escape
from rich.table import Table
from rich.text import Text

from remat_kit.cli.report import SCHEMA_VERSION, fmt_ratio, save_figure
from remat_kit.units import fmt_bytes


def fit_table(result, title: str = "") -> Table:
    """A rich Table of a `remat_kit.decide.fit.FitResult`: one line per policy with the
    largest size, the step memory there (per device) and its parts, and the FLOP
    overhead; a "picked" column with the auto row's policy where there is one."""
    vary = result.vary
    where = (f"per device of mesh {result.mesh} ({result.devices} devices); sizes and "
             f"FLOPs/token global" if result.mesh else "per device")
    t = Table(title=Text(title), caption=(
        f"budget {fmt_bytes(result.budget_bytes)} {where}; step memory = "
        f"{result.rows[0].memory.source if result.rows and result.rows[0].memory else 'n/a'}; "
        f"x none = step FLOPs / no remat's at the same {vary}"), caption_justify="left")
    auto = any(r.picked for r in result.rows)
    for name in ("policy", *(("picked",) if auto else ()), f"max {vary}", "step memory",
                 "params", "grads", "opt state", "activations+other", "FLOPs/token", "x none",
                 "compiles"):
        t.add_column(name, justify="left" if name in ("policy", "picked") else "right")
    for r in result.rows:
        picked = (escape(r.picked or "-"),) if auto else ()
        if r.error and r.memory is None:
            t.add_row(escape(r.policy), *picked,
                      f"[red]error: {escape(r.error.splitlines()[0])}[/red]", *["-"] * 7,
                      str(r.compiles))
            continue
        m = r.memory
        cap = " (model's limit)" if r.limit else " (cap)"
        size = str(r.size) + (cap if r.capped else "") if r.size else "no size fits"
        overhead = fmt_ratio(r.flop_overhead)
        if r.none_fits is False:
            overhead += " (none over budget)"
        if r.none_flops == "extrapolated":
            overhead += " extrap."
        cells = [fmt_bytes(x) for x in (m.total_bytes, m.params_bytes, m.grads_bytes,
                                        m.opt_state_bytes, m.other_bytes)] if m else ["-"] * 5
        t.add_row(escape(r.policy), *picked, size, *cells,
                  "-" if r.flops_per_token is None else f"{r.flops_per_token:.4g}", overhead,
                  str(r.compiles))
    return t


def fit_to_dict(result) -> dict:
    """A JSON-ready dict of a `remat_kit.decide.fit.FitResult` (every field; bytes, FLOPs, seconds)."""
    return {"schema_version": SCHEMA_VERSION, **dataclasses.asdict(result)}


def plot_fit(path, result, title: str = "") -> None:
    """PNG: the largest size per policy as bars, the FLOP overhead (x no remat at
    that size) as points on a second axis. Rows without a size are left out."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result.rows if r.size]
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(rows) + 2), 5), dpi=120)
    x = range(len(rows))
    ax.bar(x, [r.size for r in rows], color="tab:blue", alpha=0.8)
    # An auto row names what it picked (cut short: a planned spec lists many tags).
    labels = [r.policy + (f"\n{r.picked[:28]}{'...' * (len(r.picked) > 28)}" if r.picked else "")
              for r in rows]
    ax.set_xticks(list(x), labels, rotation=20, ha="right", fontsize=8)
    mesh = f" of mesh {result.mesh}" if result.mesh else ""
    ax.set_ylabel(f"max {result.vary} within {fmt_bytes(result.budget_bytes)} per device{mesh}")
    twin = ax.twinx()
    twin.plot(x, [r.flop_overhead for r in rows], "o", color="tab:red")
    twin.set_ylabel("FLOP overhead (x no remat at that size)", color="tab:red")
    ax.set_title(f"{title}\n{result.platform}" if title else result.platform)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    save_figure(fig, path)


__all__ = ["fit_table", "fit_to_dict", "plot_fit"]
