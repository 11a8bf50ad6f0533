"""Reports of `measure` records: a rich table, JSON and CSV (the Pareto plot: `plots`).

Every output is built from the same `rows`: each `Record` plus ratios to the `none` policy,
Pareto optimality and the Korthikanti et al. 2022 estimate (`formula_bytes`), among the records
of one target, memory compared by `Record.memory_kind`'s figure. Main names: `rows`, `table`,
`print_table`, `side_by_side`, `write_json` (`SCHEMA_VERSION`), `write_csv`.
Columns and the JSON schema: docs/compare.md ("What it prints").
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Sequence

from rich.console import Console
from rich.markup import escape
from rich.text import Text
from rich.table import Table

from remat_kit.ui import labels
from remat_kit.measure import estimate, peak
from remat_kit.measure.record import MEMORY_LABELS, PEAK, TEMP, Record, memory_kind
from remat_kit.models import TransformerConfig
from remat_kit.files import atomic_write
from remat_kit.measure.audit import column as audit_column
from remat_kit.units import fmt_bytes, fmt_flops, fmt_seconds
from remat_kit.policy.spec import parse

SCHEMA_VERSION = 1

FORMULA_NOTE = (
    "Korthikanti x L: Korthikanti et al. 2022 Table 2 per-layer activation bytes (no "
    "parallelism for none/everything, selective, full recompute 2sbh; the 'tensor parallel' "
    "row on a mesh with a tensor axis, and the 'tensor + sequence parallel' row in 'Korthikanti "
    "SP x L') times the layers, at "
    "this run's bytes per element, dropout masks only with dropout on. 'layer x L': each "
    "decoder layer measured alone under its policy, summed over the layers, its constants "
    "(the same in every layer: the causal mask and its fill, a rotary table) left out. Gaps "
    "come from what the formula models: "
    "Megatron's GeLU 4h-wide multi-head layer with 16-bit tensors. Here, without remat, the "
    "softmax keeps its exp output in f32, LayerNorm keeps f32 intermediates and GELU keeps its "
    "input and derivative; Llama configs (SwiGLU, grouped-query attention, RMSNorm) change "
    "the constants. Embeddings, logits and the loss are in 'residuals' only.")

# Canonical policy -> Korthikanti Table 2 row ("none", "selective", "full").
_FORMULA_METHOD = {"none": "none", "everything": "none", "full": "full",
                   str(parse("selective")): "selective"}


def formula_bytes(cfg: TransformerConfig, batch: int, seq: int, policy: str, t: int = 1,
                  sequence_parallel: bool = False) -> int | None:
    """Korthikanti et al. 2022 activation bytes for `policy`, all layers, one device.

    `estimate.model_total` with s=seq, b=batch (per device), h=d_model,
    a=num_heads, L=num_layers, t=tensor-parallel size, bytes_per_elem = the
    activation dtype's size, dropout masks only if cfg.dropout_rate > 0: the
    Table 2 rows "no parallelism" (t=1), "tensor parallel" (t>1) or "tensor +
    sequence parallel" (`sequence_parallel`). Policies other than none /
    everything, selective and full, and a t that does not divide d_model and
    num_heads, have no formula: None.
    """
    method = _FORMULA_METHOD.get(str(parse(policy)))
    if method is None or cfg.d_model % t or cfg.num_heads % t:
        return None
    return estimate.model_total(method, seq, batch, cfg.d_model, cfg.num_heads, cfg.num_layers,
                                t, sequence_parallel,
                                bytes_per_elem=cfg.activation_dtype.itemsize,
                                dropout=cfg.dropout_rate > 0)


def pareto_flags(records: Sequence[Record]) -> list[bool]:
    """Per record: True if no other measured record has memory (`Record.memory_bytes`)
    and FLOPs both <=, one strictly <. Records with an error or missing figures
    are never optimal."""
    def point(r):
        ok = r.error is None and r.memory_bytes is not None and r.flops is not None
        return (r.memory_bytes, r.flops) if ok else None

    points = [point(r) for r in records]
    return [p is not None and not any(
        q is not None and q[0] <= p[0] and q[1] <= p[1] and q != p for q in points)
        for p in points]


def _ratio(a, b) -> float | None:
    return None if a is None or not b else a / b


def rows(records: Sequence[Record], cfg: TransformerConfig | None = None,
         batch: int | None = None, seq: int | None = None, tensor: int = 1) -> list[dict]:
    """Records as dicts (`Record.to_dict`) plus memory_ratio_to_none (memory_bytes
    over none's, both of one memory_kind), temp_ratio_to_none,
    flops_ratio_to_none, predicted_ratio_to_none (predicted step seconds over
    none's, `time_model.compiled_seconds`), pareto, formula_bytes and formula_sp_bytes; sorted
    by memory_bytes (failed rows last). cfg,
    batch (per device), seq: for the two per-layer figures. tensor: the
    tensor-parallel size; above 1, formula_bytes is Korthikanti's "tensor
    parallel" row and formula_sp_bytes the "tensor + sequence parallel" row
    (else None)."""
    none = next((r for r in records if r.policy == "none" and r.error is None), None)
    out = []
    for r, pareto in zip(records, pareto_flags(records)):
        d = r.to_dict()
        d["memory_ratio_to_none"] = (_ratio(r.memory_bytes, none.memory_bytes)
                                     if none and none.memory_kind == r.memory_kind else None)
        d["temp_ratio_to_none"] = _ratio(r.temp_size_in_bytes, none and none.temp_size_in_bytes)
        d["flops_ratio_to_none"] = _ratio(r.flops, none and none.flops)
        d["predicted_ratio_to_none"] = _ratio(r.predicted_seconds,
                                              none and none.predicted_seconds)
        d["pareto"] = pareto
        d["formula_bytes"] = (formula_bytes(cfg, batch, seq, r.policy, tensor)
                              if cfg is not None and r.error is None else None)
        d["formula_sp_bytes"] = (formula_bytes(cfg, batch, seq, r.policy, tensor, True)
                                 if cfg is not None and r.error is None and tensor > 1
                                 else None)
        out.append(d)
    return sorted(out, key=lambda d: (d["memory_bytes"] is None, d["memory_bytes"] or 0))


def fmt_ratio(x) -> str:
    """A ratio to 3 decimals; '-' for None."""
    return "-" if x is None else f"{x:.3f}"




def compiled_by(report_rows: Sequence[dict]) -> str:
    """'XLA TPU compile (v5e:1x1, AOT); jax 0.12.0.1, libtpu 0.0.52': whose figures
    `report_rows` are (of their first row; '' for no rows)."""
    if not report_rows:
        return ""
    d = report_rows[0]
    return f"{d['platform']}; jax {d['jax_version']}, {d['compiler_version']}"


def memory_kind_of(report_rows: Sequence[dict]) -> str:
    """The `memory_kind` `report_rows` (of one target) are compared by: that of
    their `none` row, else of their first row that compiled; where none
    compiled, their target's (`record.memory_kind`: peak on TPU and GPU)."""
    measured = [d for d in report_rows if d["memory_bytes"] is not None]
    found = next((d for d in measured if d["policy"] == "none"), measured[0] if measured else None)
    if found is None:
        target = report_rows[0].get("target") if report_rows else None
        return memory_kind(target.split(":", 1)[0]) if target else TEMP
    return found["memory_kind"]


_MEMORY_NOTES = {
    TEMP: "temp: temp_size_in_bytes (XLA CPU's peak figure leaves temp buffers out)",
    PEAK: "peak: the compiler's peak_memory_in_bytes (its temp figure leaves out buffers "
          "the peak counts)"}


# The default table's columns (`table`) besides the memory figure's two, which fit 100
# columns; --wide adds the rest.
NARROW = ("", "policy", "FLOPs x none", "pred. step", "pred. x none", "step x none")
DOCS_POINTER = "each column: docs/compare.md"


def _columns(report_rows: Sequence[dict], kind: str) -> list[tuple[str, object]]:
    """(header, cell function of a row) per column of the wide table, in order; the
    columns whose figure no row has (timed steps without --time, Korthikanti's rows
    for a --model) left out."""
    other = TEMP if kind == PEAK else PEAK if any(
        d.get("formula_sp_bytes") is not None for d in report_rows) else None
    label = MEMORY_LABELS[kind]

    def step(d):
        st = d["step_time"]
        return f"{st['median_s']:.3f} ({st['min_s']:.3f}-{st['max_s']:.3f})" if st else "-"

    columns = [
        ("", lambda d: "*" if d["pareto"] else ""),
        ("policy", lambda d: escape(", ".join(d["names"]))),  # specs hold [src->dst]
        (label, lambda d: fmt_bytes(d["memory_bytes"])),
        (f"{label} x none", lambda d: fmt_ratio(d["memory_ratio_to_none"])),
        ("residuals (traced)", lambda d: fmt_bytes(d["activation_residual_bytes"])),
        ("layer x L", lambda d: fmt_bytes(d["layers_residual_bytes"])),
        ("Korthikanti x L", lambda d: fmt_bytes(d["formula_bytes"])),
        ("FLOPs", lambda d: fmt_flops(d["flops"])),
        ("FLOPs x none", lambda d: fmt_ratio(d["flops_ratio_to_none"])),
        ("pred. step", lambda d: fmt_seconds(d.get("predicted_seconds"))),
        ("pred. x none", lambda d: fmt_ratio(d.get("predicted_ratio_to_none"))),
        ("Korthikanti SP x L", lambda d: fmt_bytes(d.get("formula_sp_bytes"))),
        *(((MEMORY_LABELS[other], lambda d: fmt_bytes(d[other])),) if other else ()),
        ("step s (min-max)", step),
        ("step x none", lambda d: fmt_ratio(d["step_time"] and d["step_time"]["ratio_to_none"])),
        ("compile s", lambda d: "-" if d["compile_seconds"] is None
         else f"{d['compile_seconds']:.1f}"),
        ("as asked", lambda d: escape(audit_column(d.get("audit"))) if d.get("audit") else "-")]
    ok = [d for d in report_rows if not d["error"]]
    return [(h, f) for h, f in columns
            if h in ("", "policy") or any(f(d) not in ("-", "") for d in ok)]


def table(report_rows: Sequence[dict], title: str = "", wide: bool = False) -> Table:
    """A rich Table of `rows(...)`: one line per policy, Pareto-optimal rows marked *.

    By default (`wide` False) the columns that fit a 100-column terminal (`NARROW`):
    the policy, its memory (the figure `memory_kind_of(report_rows)` names: "peak"
    on TPU and GPU, "temp" on CPU, in the header), and its memory, FLOPs,
    predicted step and timed step (with --time) over no remat's; the caption names
    the figure, the compiler and versions, and points to docs/compare.md. `wide`
    gives every column with a figure: the traced residual bytes, each layer
    measured alone x L, Korthikanti et al. 2022's estimate, FLOPs, predicted step,
    the other memory figure, timed steps and compile seconds. A column no row has a
    figure for is left out of either."""
    kind = memory_kind_of(report_rows)
    columns = _columns(report_rows, kind)
    if not wide:
        label = MEMORY_LABELS[kind]
        columns = [(h, f) for h, f in columns if h in (*NARROW, label, f"{label} x none")]
    failed = labels.failed_caption(report_rows, compiled_by(report_rows))
    t = Table(title=Text(title), caption=escape(failed) if failed else (
        f"* Pareto-optimal (no row has less memory and fewer FLOPs); memory: "
        f"{_MEMORY_NOTES[kind] if wide else MEMORY_LABELS[kind]}; "
        f"{escape(compiled_by(report_rows))}; "
        + ("" if wide else "--wide: every column; ") + DOCS_POINTER), caption_justify="left")
    # The policy column is at least its longest name (up to 20, minimal_with_context), so
    # a narrow terminal shrinks the figures' columns, not "minimal" into "minim/al"; a
    # longer spec folds.
    names = min(20, max((len(n) for d in report_rows for n in ", ".join(d["names"]).split()),
                        default=6))
    for header, _ in columns:  # a long spec folds in its column, never widens the table
        policy = header == "policy"
        t.add_column(header, justify="left" if header in ("", "policy") else "right",
                     overflow="fold", min_width=names if policy else None,
                     max_width=None if wide or not policy else 24)
    for d in report_rows:
        if d["error"]:
            error = escape(d["error"].splitlines()[0])
            t.add_row("", f"{columns[1][1](d)}\n[red]error: {error}[/red]",
                      *["-"] * (len(columns) - 2))
            continue
        t.add_row(*(f(d) for _, f in columns))
    return t


def print_table(report_rows: Sequence[dict], title: str = "", console: Console | None = None,
                note: bool = True, wide: bool = False) -> None:
    """Prints `table(...)` and, if `note` and `wide`, FORMULA_NOTE where a row has
    Korthikanti's figure. A console that is not a terminal gets 180 columns, so
    piped tables do not wrap."""
    console = _console(console)
    print_title(console, title)
    console.print(table(report_rows, "", wide))
    if note and wide and any(d["formula_bytes"] is not None for d in report_rows):
        console.print(FORMULA_NOTE, style="dim", markup=False)


def side_by_side(sections: Sequence[tuple[str, Sequence[dict]]], title: str = "",
                 wide: bool = False) -> Table:
    """A rich Table with one line per policy and, per target, its memory (the
    figure that target is compared by, `memory_kind_of`: temp on CPU, peak on
    TPU and GPU, named in the column header), the ratio to `none` on that
    target, the FLOP ratio and the predicted step-time ratio; `wide` adds the temp
    memory where peak is the figure and the compile seconds.

    Args:
      sections: (target name, `rows(...)` of that target's records) pairs;
        lines follow the first target's order (by its memory figure).
    """
    kinds = [memory_kind_of(rows) for _, rows in sections]
    peaks = [k == PEAK and wide for k in kinds]  # the temp column beside the peak
    failed = [labels.failed_caption(rows, compiled_by(rows)) for _, rows in sections]
    t = Table(title=Text(title), caption="; ".join(
        [*(f"{name}: {escape(why or compiled_by(rows))}"
           for (name, rows), why in zip(sections, failed)),
         *(_MEMORY_NOTES[k] for k in dict.fromkeys(
             k for k, why in zip(kinds, failed) if why is None)), DOCS_POINTER]),
        caption_justify="left")
    t.add_column("policy", justify="left", overflow="fold", max_width=None if wide else 16)
    for (name, _), kind, peak in zip(sections, kinds, peaks):
        label = MEMORY_LABELS[kind]
        # Two-line headers by default: two targets' columns then fit 100 columns.
        for column in ((f"{label}\n{escape(name)}", f"{label} x none",
                        *(("temp",) if peak else ()), "FLOPs x none", "pred. x none",
                        "compile s") if wide else
                       (f"{label}\n{escape(name)}", f"{label}\nx none", "FLOPs\nx none",
                        "pred.\nx none")):
            t.add_column(column, justify="right")
    by_target = [{d["policy"]: d for d in rows} for _, rows in sections]
    policies = list(dict.fromkeys(d["policy"] for _, rows in sections for d in rows))
    for policy in policies:
        names = dict.fromkeys(n for found in by_target if policy in found
                              for n in found[policy]["names"])
        cells = [escape(", ".join(names))]
        for found, peak in zip(by_target, peaks):
            d = found.get(policy)
            if d is None or d["error"]:
                error = d["error"].splitlines()[0][:60] if d else "not measured"
                cells += [f"[red]{escape(error)}[/red]"] + ["-"] * (3 + peak + wide)
                continue
            cells += [fmt_bytes(d["memory_bytes"]), fmt_ratio(d["memory_ratio_to_none"]),
                      *((fmt_bytes(d["temp_size_in_bytes"]),) if peak else ()),
                      fmt_ratio(d["flops_ratio_to_none"]),
                      fmt_ratio(d.get("predicted_ratio_to_none")),
                      *((("-" if d["compile_seconds"] is None
                          else f"{d['compile_seconds']:.1f}"),) if wide else ())]
        t.add_row(*cells)
    return t


def print_side_by_side(sections: Sequence[tuple[str, Sequence[dict]]], title: str = "",
                       console: Console | None = None, wide: bool = False) -> None:
    """Prints `side_by_side(...)`; a console that is not a terminal gets 180 columns."""
    console = _console(console)
    print_title(console, title)
    console.print(side_by_side(sections, "", wide))


def print_title(console: Console, title: str) -> None:
    """A table's title on its own line above it (a narrow table would fold it), wrapped
    to a terminal's width; piped, one line, for whatever reads it."""
    if title:
        console.print(title, markup=False, emoji=False, soft_wrap=not console.is_terminal,
                      style="bold")


def _console(console: Console | None) -> Console:
    return terminal_console() if console is None else console


def terminal_console(piped: int = 180) -> Console:
    """The console the commands print to: the terminal's width; where stdout is not a
    terminal, $COLUMNS if set (COLUMNS=100 renders what a 100-column terminal shows),
    else `piped` columns, so that piped tables do not wrap."""
    console = Console()
    if console.is_terminal:
        return console
    columns = os.environ.get("COLUMNS", "")
    return Console(width=int(columns) if columns.isdigit() and int(columns) > 0 else piped)


def write_json(path, report_rows: Sequence[dict], context: dict,
               verdicts: Sequence[dict] = ()) -> None:
    """Writes the schema in this module's docstring to `path`."""
    doc = {"schema_version": SCHEMA_VERSION, "context": context, "formula_note": FORMULA_NOTE,
           "verdicts": list(verdicts), "records": list(report_rows)}
    with atomic_write(path) as f:
        json.dump(doc, f, indent=2)
        f.write("\n")


CSV_FIELDS = ("policy", "names", "temp_size_in_bytes", "temp_ratio_to_none", "memory_kind",
              "memory_bytes", "memory_ratio_to_none",
              "activation_residual_bytes", "offloaded_bytes", "layer_residual_bytes",
              "formula_bytes", "formula_sp_bytes", "flops", "flops_ratio_to_none",
              "transcendentals", "predicted_seconds", "predicted_ratio_to_none",
              "peak_memory_in_bytes", "argument_size_in_bytes", "output_size_in_bytes",
              "step_median_s", "step_min_s", "step_max_s", "step_ratio_to_none",
              "compile_seconds", "pareto", "error", "target", "platform", "jax_version",
              "compiler_version")


def write_csv(path, report_rows: Sequence[dict]) -> None:
    """One line per policy with the scalar fields in CSV_FIELDS (names joined by ' ')."""
    with atomic_write(path) as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for d in report_rows:
            st = d["step_time"] or {}
            w.writerow(d | {"names": " ".join(d["names"]), "step_median_s": st.get("median_s"),
                            "step_min_s": st.get("min_s"), "step_max_s": st.get("max_s"),
                            "step_ratio_to_none": st.get("ratio_to_none")})


def save_figure(fig, path) -> None:
    """Writes a matplotlib figure to `path` in the format its suffix names (PNG by
    default) with `outputs.atomic_write`, and closes it.

    Raises:
      OutputError: the file cannot be written; nothing is left half-written.
    """
    import matplotlib.pyplot as plt

    suffix = os.path.splitext(str(path))[1].lstrip(".").lower()
    try:
        with atomic_write(path, "wb") as f:
            fig.savefig(f, format=suffix or "png")
    finally:
        plt.close(fig)


def _map_of(work):
    # A Workload's map, or a ModelMap itself (`program.config_map` of a --config report
    # that builds no workload).
    return getattr(work, "model_map", work)


def print_map(work) -> None:
    """Every report's first line: the model map's (`remat_kit.trace.model_map`): the
    layers remat applies to, the model's own remat, what runs outside every layer.
    `work`: a Workload, or a ModelMap; nothing printed where it has none."""
    if _map_of(work) is not None:
        print(f"model map: {_map_of(work).line()}", flush=True)


def map_context(work) -> dict:
    """`--json`'s `context.model_map`: the whole map (`work` a Workload or a ModelMap),
    where there is one."""
    return {} if _map_of(work) is None else {"model_map": _map_of(work).to_dict()}


__all__ = ["CSV_FIELDS", "FORMULA_NOTE", "SCHEMA_VERSION", "compiled_by", "fmt_bytes", "fmt_ratio",
           "fmt_seconds", "formula_bytes", "map_context", "memory_kind_of", "pareto_flags",
           "print_map", "print_peaks", "print_side_by_side", "print_table", "print_title", "rows",
           "save_figure", "side_by_side", "table", "terminal_console", "write_csv", "write_json"]


def print_peaks(report_rows: Sequence[dict], console: Console | None = None) -> None:
    """One line per policy measured with its peak breakdown (`Record.peak`):
    "peak of full: 3.38 GiB: logits and their gradient 2.30 GiB, ...", and under
    it `peak.scores_note` where the attention scores hold the most; nothing for
    rows without one."""
    console = _console(console)
    for d in report_rows:
        if d.get("peak"):
            console.print(f"{MEMORY_LABELS[d['peak']['figure']]} of {', '.join(d['names'])}: "
                          f"{peak.summary(d['peak'])}", markup=False, soft_wrap=True)
            if note := peak.scores_note(d["peak"]):
                console.print(f"  {note}", markup=False, soft_wrap=True)
