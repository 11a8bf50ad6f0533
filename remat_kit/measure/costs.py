"""Figures of a compiled program: XLA's memory analysis, and FLOPs with loop bodies
counted once per trip.
Docs: docs/targets.md ("FLOPs"), docs/compare.md.
"""

from __future__ import annotations

import re

import jax

from remat_kit._jax_private import hlo_module, hlo_text_cost_analysis
from remat_kit.measure import loops

_COMPUTATION = re.compile(r"^(ENTRY )?%([^\s(]+) \(", re.M)
_BODY = re.compile(r"body=%([\w.\-]+)")
# Computations an instruction calls, and a Pallas TPU kernel's cost estimate in its
# custom call's backend config.
_CALLS = re.compile(r"(?:calls|to_apply|body|condition|branch_computations)=\{?%([\w.\-]+)")
_ESTIMATE = re.compile(r'\\?"cost_estimate\\?":\{\\?"flops\\?":\\?"?(\d+)')
_COST_KEYS = ("flops", "transcendentals")
# XLA's memory analysis of host memory (TPU and GPU compiles; the CPU reports 0).
HOST_FIELDS = ("host_temp_size_in_bytes", "host_argument_size_in_bytes",
               "host_output_size_in_bytes")


def _hlo_computations(text: str) -> tuple[str, dict[str, str], str]:
    """(preamble, {name: computation text without 'ENTRY '}, entry name) of HLO text."""
    starts = list(_COMPUTATION.finditer(text))
    comps, entry = {}, None
    for m, nxt in zip(starts, starts[1:] + [None]):
        body = text[m.start():nxt.start() if nxt else len(text)]
        if m.group(1):
            entry, body = m.group(2), body[len("ENTRY "):]
        comps[m.group(2)] = body
    # Keep the file/stack-frame tables metadata refers to; drop the module header line.
    preamble = text[text.index("\n") + 1:starts[0].start()] if starts else ""
    return preamble, comps, entry


def _while_loops(compiled) -> dict[str, list[tuple[str, int | None]]]:
    """{computation name: [(body name, trip count or None), ...]} of every while
    loop in the optimized HLO (`loops.trip_count`)."""
    module = hlo_module(compiled)
    comps = {c.name: c for c in module.computations()}
    return {name: [(_BODY.search(i.to_string()).group(1), loops.trip_count(i, comps))
                   for i in comp.instructions() if i.opcode.name == "kWhile"]
            for name, comp in comps.items()}


def loop_scaled_costs(compiled) -> tuple[dict[str, float], tuple[str, ...]]:
    """FLOPs and transcendentals of a compiled program, while loops counted per trip.

    XLA's `cost_analysis()` counts a while loop's body once, so a model whose
    layers run under `scan` reports about one layer's FLOPs. This reads the
    optimized HLO, finds each while loop's trip count (`loops.trip_count`: its
    `known_trip_count`, or its condition's bound where the compiler dropped
    that, as XLA:TPU does), runs XLA's HloCostAnalysis on the loop body alone
    (`_jax_private.hlo_text_cost_analysis`) and adds (trip count - 1) x the
    body's cost; nested loops are scaled the same way, inside every trip of
    the loop around them.

    Returns:
      ({"flops": FLOPs, "transcendentals": count}, notes). An empty dict if
      the backend gives no cost analysis. notes say which loops could not be
      scaled (no trip count found), which leaves their bodies counted once.
    """
    costs = compiled.cost_analysis()
    costs = costs[0] if isinstance(costs, (list, tuple)) else costs
    if not costs:
        return {}, ("the backend gives no cost analysis",)
    total = {k: float(costs.get(k, 0.0)) for k in _COST_KEYS}
    found = _while_loops(compiled)
    if not any(found.values()):
        return total, ()
    preamble, comps, entry = _hlo_computations(compiled.as_text())
    client = jax.devices()[0].client
    notes: list[str] = []

    def body_cost(name: str) -> dict[str, float]:
        """XLA's cost of computation `name`, nested loop bodies counted once; with its
        Pallas kernels' cost estimates, which this machine's analysis (not the TPU's)
        leaves out, so every trip but the first would lose them."""
        module = "\n".join(("ENTRY " if n == name else "") + c
                           for n, c in comps.items() if n != entry)
        cost = hlo_text_cost_analysis(f"HloModule {name}\n{preamble}\n{module}", client)
        found = {k: float(cost.get(k, 0.0)) for k in _COST_KEYS}
        if client.platform != "tpu":
            found["flops"] += _estimated_flops(name, comps)
        return found

    def extra(name: str) -> dict[str, float]:
        """What counting every loop inside computation `name` per trip adds to
        XLA's count of `name`, which has each loop body once."""
        add = dict.fromkeys(_COST_KEYS, 0.0)
        for body, trips in found.get(name, ()):
            if trips is None:
                notes.append(f"while loop with body {body} has no trip count found; "
                             "its body is counted once")
            n = 1 if trips is None else trips
            nested = extra(body)  # every trip runs the nested loops in full
            once = body_cost(body) if n != 1 else dict.fromkeys(_COST_KEYS, 0.0)
            for k in _COST_KEYS:
                add[k] += (n - 1) * (once[k] + nested[k]) + nested[k]
        return add

    for k, v in extra(entry).items():
        total[k] += v
    return total, tuple(notes)


def _estimated_flops(name: str, comps: dict[str, str]) -> float:
    """FLOPs of the cost estimates of the kernels (TPU custom calls) computation `name`
    runs, in the computations it calls too, each computation once."""
    seen, todo, total = set(), [name], 0.0
    while todo:
        comp = todo.pop()
        if comp in seen or comp not in comps:
            continue
        seen.add(comp)
        total += sum(float(f) for f in _ESTIMATE.findall(comps[comp]))
        todo += _CALLS.findall(comps[comp])
    return total


def memory_fields(compiled) -> dict[str, int | None]:
    """XLA's memory figures of a compiled executable (`compiled.memory_analysis()`).

    Returns:
      {"temp_size_in_bytes", "peak_memory_in_bytes", "argument_size_in_bytes",
      "output_size_in_bytes", "alias_size_in_bytes", and the host-memory
      figures "host_temp_size_in_bytes", "host_argument_size_in_bytes",
      "host_output_size_in_bytes" (offloaded residuals live in host temp)}:
      bytes per device, None for a figure the backend does not report; an
      empty dict if the backend gives no memory analysis. On the XLA CPU backend peak_memory_in_bytes
      leaves out temp buffers (it is about arguments + outputs - aliased
      bytes, alike for every policy): compare policies by temp_size_in_bytes
      there.
    """
    stats = compiled.memory_analysis()
    keys = ("temp_size_in_bytes", "peak_memory_in_bytes", "argument_size_in_bytes",
            "output_size_in_bytes", "alias_size_in_bytes", *HOST_FIELDS)
    return {k: getattr(stats, k, None) for k in keys} if stats is not None else {}


# An instruction XLA's own rematerialization pass cloned (HloRematerialization names the
# copy "<name>.remat", "<name>.remat2", ...), where it defines its value.
_XLA_REMAT = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\.remat\d*\s*=", re.MULTILINE)


def xla_remat_note(compiled, platform: str) -> tuple[str, ...]:
    """A line where the compiled program holds instructions XLA rematerialized on its own
    (its rematerialization pass, run where the program would not fit the device's memory,
    e.g. "Can't reduce memory use below ..." on a GPU): the row's peak and FLOPs are then
    after XLA's remat as well as the policy's. () on the CPU, whose compiler has no such
    pass, and where there is none."""
    if platform == "cpu":
        return ()
    n = len(_XLA_REMAT.findall(compiled.as_text()))
    return (f"XLA rematerialized {n} instruction{'s' * (n != 1)} on its own to fit the "
            "device's memory (its remat pass, beyond the policy): this row's peak and FLOPs "
            "are after it",) if n else ()


__all__ = ["HOST_FIELDS", "loop_scaled_costs", "memory_fields", "xla_remat_note"]
