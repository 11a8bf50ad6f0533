"""`remat-kit fit`'s outputs: the table, the JSON and the bar chart of a
`remat_kit.decide.fit.FitResult`.
Docs: docs/fit.md.
"""

from __future__ import annotations

import dataclasses

from rich.markup import escape
from rich.table import Table
from rich.text import Text

from remat_kit.ui.report import SCHEMA_VERSION, fmt_ratio, save_figure
from remat_kit.units import fmt_bytes


# The default columns, which fit 100 columns; --wide adds the step memory's parts,
# FLOPs per token and the compiles.
_NARROW = ("policy", "picked", "step memory", "FLOPs x none")


def fit_table(result, title: str = "", wide: bool = False) -> Table:
    """A rich Table of a `remat_kit.decide.fit.FitResult`: one line per policy with the
    largest size, the step memory there (per device) and the FLOPs over no remat's at
    that size, marked † where no remat does not fit there; a "picked" column with the
    auto row's policy where there is one. `wide` adds the step memory's parts
    (params, grads, opt state, activations+other), FLOPs/token and the compiles."""
    vary = result.vary
    where = (f"per device of mesh {result.mesh} ({result.devices} devices); sizes and "
             f"FLOPs/token global" if result.mesh else "per device")
    source = next((r.memory.source for r in result.rows if r.memory), None)
    t = Table(title=Text(title), caption=(
        f"budget {fmt_bytes(result.budget_bytes)} {where}; "
        + ("" if source is None else f"step memory = {source}; ")
        + ("(cap): the largest size searched fits, larger ones were not tried; " if any(
            r.capped and not r.limit and r.size for r in result.rows) else "")
        + f"FLOPs x none = step FLOPs / no remat's at the same {vary}"
        + ("; † no remat (`none`) does not fit there" if any(
            r.none_fits is False for r in result.rows) else "")
        + ("; traced: no remat not compiled, its traced estimate far over the budget, its "
           "FLOPs from the traced programs' ratio" if any(
               r.none_flops == "traced" for r in result.rows) else "")
        + ("" if wide else "; --wide: the step memory's parts, FLOPs/token, compiles")),
        caption_justify="left")
    auto = any(r.picked for r in result.rows)
    names = ("policy", *(("picked",) if auto else ()), f"max {vary}", "step memory", "params",
             "grads", "opt state", "activations+other", "FLOPs/token", "FLOPs x none",
             "compiles")
    keep = [i for i, name in enumerate(names) if wide or name in (*_NARROW, f"max {vary}")]
    for i in keep:
        words = names[i] in ("policy", "picked")
        t.add_column(names[i], justify="left" if words else "right", overflow="fold",
                     max_width=None if wide or not words else 30)
    for r in result.rows:
        cells = _fit_cells(r, auto)
        t.add_row(*(cells[i] for i in keep))
    return t


def _fit_cells(r, auto: bool) -> list[str]:
    """A FitRow's cells, in `fit_table`'s wide order."""
    picked = [escape(r.picked or "-")] if auto else []
    if r.error and r.memory is None:
        return [escape(r.policy), *picked,
                f"[red]error: {escape(r.error.splitlines()[0])}[/red]", *["-"] * 7,
                str(r.compiles)]
    m = r.memory
    cap = " (model's limit)" if r.limit else " (cap)"
    size = str(r.size) + (cap if r.capped else "") if r.size else "no size fits"
    overhead = fmt_ratio(r.flop_overhead)
    if r.none_flops in ("extrapolated", "traced"):
        overhead += " extrap." if r.none_flops == "extrapolated" else " traced"
    if r.none_fits is False:
        overhead += " †"
    cells = [fmt_bytes(x) for x in (m.total_bytes, m.params_bytes, m.grads_bytes,
                                    m.opt_state_bytes, m.other_bytes)] if m else ["-"] * 5
    return [escape(r.policy), *picked, size, *cells,
            "-" if r.flops_per_token is None else f"{r.flops_per_token:.4g}", overhead,
            str(r.compiles)]


def pick_fit(result):
    """fit's `verdict.Choice`: the row with the largest size (the fewest FLOPs over
    no remat's among equals, an auto row's picked policy named; an auto row's per-layer
    pick only where no other row fits); None where no policy fits any size."""
    from remat_kit.cli.verdict import Choice, cost_text
    rows = [r for r in result.rows if r.size]
    if not rows:
        return None
    # An auto row that picked one policy per layer names no spec to paste: another row's
    # policy is the verdict where one fits.
    rows = [r for r in rows if not r.picked_layers] or rows
    best = max(rows, key=lambda r: (r.size, -(r.flop_overhead or 0.0)))
    none = next((r for r in result.rows if r.policy == "none"), None)
    against = ("" if none is None or best is none else
               f"; no remat (`none`): {result.vary} {none.size}" if none.size else
               f"; no remat (`none`) fits no {result.vary}")
    name = best.picked if best.picked and not best.picked_layers else best.policy
    cost = ("FLOPs over no remat unknown (no remat compiled at no size to count them)"
            if best.flop_overhead is None else cost_text(best.flop_overhead - 1, None))
    capped = (f" (the largest {result.vary} searched; larger ones were not tried)"
              if best.capped and not best.limit else "")
    return Choice(name=name, gives=f"{result.vary} {best.size}{capped} in "
                  f"{fmt_bytes(result.budget_bytes)} per device", cost=cost,
                  why=f"largest {result.vary}{against}")


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


__all__ = ["fit_table", "fit_to_dict", "pick_fit", "plot_fit"]
