"""The planner's search: a budget's plan solved, verified by compiling, and kept.

`plan(planner, budget)` is `Planner.plan`: each base rule whose compile fits is a starting point,
the MILP fills the room the budget leaves above it, the best predicted candidate is compiled and
solved again with the room corrected (up to `max_iterations`), every compiled policy a candidate;
`frontier` makes budgets' plans monotone; `predict`, `what_holds`. Reads the `Planner`'s parts.
Docs: docs/plan.md ("How it works"), docs/architecture.md ("The planner's parts").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from remat_kit.decide import offload as host_offload
from remat_kit.decide.cost_model import PLANNED_BASES
from remat_kit.decide.planner_costs import TIME_RESOLUTION
from remat_kit.decide.plan_cache import Plan, write_cache, cached_plan, layers_summary
from remat_kit.errors import BudgetError
from remat_kit.measure import pool
from remat_kit.measure.measure import measure
from remat_kit.measure.peak import held_line, vocab_chunks_for
from remat_kit.measure.record import MEMORY_LABELS, STEP, memory_kind
from remat_kit.policy.budget import parse_budget
from remat_kit.policy.policy import Policy

# Recompute FLOPs below this fraction of the step's are within the cost model's
# error (predicted vs compiled FLOPs differ by ~0.1% on gpt2_small and llama_1b),
# so the MILP's second solve trades them for fewer saved bytes.
FLOP_RESOLUTION = 1e-4


def what_holds(planner, rechunk: "Callable[[int], object] | None" = None
               ) -> tuple[str, dict | None]:
    """What holds the least memory any compiled policy reaches (normally full
    remat's), for a budget below it: ("full remat's peak 3.38 GiB: logits and
    their gradient 2.30 GiB, ...; no layer policy lowers the logits and their
    gradient; --vocab-chunks 29 ...", `PlannerCompiles.peak`'s breakdown), the line as
    `peak.held_line` says it. ("", None) where the breakdown cannot be had. One
    more compile; where the line names a vocabulary chunk count and `rechunk`
    is given (rechunk(n) -> the planner's workload with its loss over n
    vocabulary chunks), one more, of full remat with that loss, whose figure
    the line gives."""
    full = planner.compiles.measure(Policy())
    least = min(planner.compiled_records(), key=lambda r: r.memory_bytes)
    try:
        found = planner.compiles.peak(Policy() if least is full
                                      else planner.compiles.policy_of(least))
    except Exception:  # noqa: BLE001 - a budget's error must not be lost to it
        found = None
    if not found:
        return "", None
    which = "full remat" if least is full else least.policy
    chunks = vocab_chunks_for(found)
    chunked = None
    if chunks is not None and rechunk is not None:
        try:
            [record] = measure(rechunk(chunks), policies=[Policy()], target=planner.target)
            chunked = record.memory_bytes
        except Exception:  # noqa: BLE001 - the line stands without the figure
            chunked = None
    # a CPU train step's figure (argument + temp + output - alias) has no label of its own
    label = MEMORY_LABELS.get(found["figure"], MEMORY_LABELS[STEP])
    return held_line(found, f"{which}'s {label}", chunked), found


def plan(planner, budget: "str | int | float") -> Plan:
    """The policy with the fewest FLOPs (or least predicted time) whose
    compiled memory fits `budget`.

    Each base rule (`Planner.bases`, default `cost_model.PLANNED_BASES`) whose own
    compile fits is a starting point: the MILP fills the room above it. The base with the best predicted objective is
    verified by compiling (and re-solved with the room corrected, up to
    `max_iterations` compiles); every compiled policy, the bases alone
    included, is a candidate, so a plan is never worse than them.

    Args:
      budget: see `parse_budget`.
    Returns:
      A verified `Plan`: measured_bytes <= budget_bytes.
    Raises:
      BudgetError: a malformed budget, or one below the least memory of
        any compiled policy, normally `full` (the message gives that
        minimum in bytes and as a fraction); a fraction budget where no
        remat runs out of the target's memory (there is nothing to take a
        fraction of); `full` runs out of the target's memory.
      RuntimeError: `full` or `none` does not compile for another reason.
      ValueError: more groups than layers (`group_count`).
    """
    parsed = parse_budget(budget)
    groups, group_note = planner.costs.group_count()
    key = _cache_key(planner, parsed, groups)
    if planner.cache and (kept := cached_plan(planner.cache, key)) is not None \
            and not _beaten(planner, kept):
        return kept
    full, none = _full_and_none(planner)
    if none is None and parsed.bytes is None:
        raise BudgetError(f"budget {budget} is a fraction of no remat's memory, but no remat "
                          f"runs out of {planner.target}'s memory at these shapes; give the "
                          "budget in bytes (e.g. 12GiB)", budget=budget)
    limit = parsed.resolve(none and none.memory_bytes)
    _check_minimum(planner, budget, limit, full, none)
    if none is not None and limit >= none.memory_bytes and planner.no_remat:
        return _finish(planner, key, budget, limit, Policy(remat=False), none,
                            none.memory_bytes, none.flops, "the budget holds no remat", 0,
                            groups)
    notes = [group_note] if group_note else []
    time_objective = planner.objective == "time"
    unit = FLOP_RESOLUTION * (planner.costs.seconds(Policy(remat=False)) if time_objective
                              else planner.none_flops())
    floors, starts = _starts(planner, limit, groups, unit)
    tried, status, best = set(), "", None
    if starts:
        base = min(starts)[1]
        notes.append(f"base {base}")
        tried, status, best = _verify(planner, base, floors[base], groups, limit, unit, notes)
    # Any other policy compiled for this loss (the base rules alone, the presets
    # remat-kit plan compares) that fits and scores better wins: it is verified
    # just the same.
    other = min((r for r in planner.compiled_records() if r.memory_bytes <= limit),
                key=planner.costs.score)  # `least` fits
    if best is None or planner.costs.score(other) < best[0]:
        policy, record = planner.compiles.policy_of(other), other
        predicted = (other.memory_bytes, other.flops)
        if best is not None:
            notes.append(f"{other.policy} (compiled before) scores better")
    else:
        _, policy, record, predicted = best
        predicted = predicted[:2]
    probe = planner.costs.offload_probe  # the figure offload was planned with, or why not
    offload_notes = ([probe.note] if probe else []) + host_offload.verify(planner, policy, record)
    return _finish(planner, key, budget, limit, policy, record, *predicted,
                        "; ".join([status, *notes, "chose " + (
                            layers_summary(policy) if isinstance(policy, tuple)
                            else str(policy)), *offload_notes]), len(tried),
                        groups, offload_notes)

def _starts(planner, limit: int, groups: int, unit: float) -> tuple[dict, list[tuple]]:
    """({base: its record compiled alone}, [(predicted objective, base)] for each base
    whose own compile fits `limit` bytes, its MILP solved for the room above it)."""
    # Each base rule alone is compiled: its memory is the floor the MILP fills above.
    floors = dict(zip(planner.bases, planner.compiles.measure_all(
        [Policy(base=b) for b in planner.bases])))
    starts = []
    for base, floor in floors.items():
        if floor.error or floor.memory_bytes is None or floor.memory_bytes > limit:
            continue
        model = planner.costs.model_for(base, groups)
        saved, offloaded, _ = model.solve(limit - floor.memory_bytes, unit, planner.objective)
        predicted = _predict(planner, base, floor, model, saved, offloaded)
        starts.append((predicted[2] if planner.objective == "time" else predicted[1]
                       + model.excess(offloaded) * model.flop_rate, base))
    return floors, starts


def _full_and_none(planner) -> tuple:
    """(full remat's record, no remat's or None where it runs out of memory), compiled side
    by side on the compile pool (the base rules compile together after, in one
    `measure_all`). Raises as `PlannerCompiles.measure`."""
    planner.compiles.side_by_side([Policy(), Policy(remat=False)])
    return planner.compiles.measure(Policy()), planner.compiles.none()


def _beaten(planner, kept: Plan) -> bool:
    """Whether a policy compiled since `kept` was cached (a preset `remat-kit plan`
    compiled) fits its budget and scores better: the plan is then made again."""
    if planner.objective == "time":
        step = TIME_RESOLUTION * planner.costs.seconds(Policy(remat=False))
        mine = None if kept.predicted_seconds is None else round(kept.predicted_seconds / step)
    else:
        mine = kept.measured_flops
    return mine is not None and any(
        planner.costs.score(r)[0] < mine for r in planner.compiled_records()
        if r.memory_bytes <= kept.budget_bytes)


def _cache_key(planner, parsed, groups: int) -> str:
    """What the plan cache keys a budget's plan by: the program, the figure budgeted (a
    temp plan never answers a peak budget), the budget and every setting of the planner."""
    return (f"{planner.compiles.fingerprint()}|{memory_kind(planner.target.platform)}|{parsed}"
            f"|groups={groups}|{planner.objective}|offload={planner.host_bandwidth}"
            f"|step={planner.step}{planner.compiles.optimizer_key()}"
            + (f"|decide={','.join(sorted(planner.decide))}" if planner.decide is not None
               else "")
            + (f"|bases={','.join(planner.bases)}" if planner.bases != PLANNED_BASES else "")
            + ("" if planner.no_remat else "|remat"))


def _check_minimum(planner, budget, limit: int, full, none) -> None:
    """BudgetError where `limit` bytes are below the least memory any compiled policy
    reaches (normally `full`'s, the records `full` and `none`), saying what holds it."""
    least = min(planner.compiled_records(), key=lambda r: r.memory_bytes)
    if limit < least.memory_bytes:
        lo = least.memory_bytes
        which = "full remat" if least is full else f"{least.policy} (below full remat's)"
        of_none = (f"{lo / none.memory_bytes:.3f} of no remat ({none.memory_bytes:,} bytes)"
                   if none else f"no remat runs out of {planner.target}'s memory")
        raise BudgetError(
            f"budget {budget} ({limit:,} bytes) is below the least "
            f"{MEMORY_LABELS[full.memory_kind]} memory any policy "
            f"reaches: {lo:,} bytes under {which}, {of_none}"
            + ("; " + held if (held := what_holds(planner)[0]) else ""),
            budget=budget, minimum_bytes=lo, minimum_fraction=none and lo / none.memory_bytes)


def _verify(planner, base: str, floor, groups: int, limit: int, unit: float,
            notes: list) -> tuple[set, str, tuple | None]:
    """The MILP's plans above base rule `base` (its compiled record `floor`), each
    compiled and the room corrected, up to `max_iterations` compiles: (the
    (saved, offloaded) pairs tried, HiGHS's last status, the best fitting
    (score, policy, record, prediction) or None). Appends a note per compile.

    With more than one compile at a time (`pool.current().jobs`), while a plan compiles
    the plan the search would try next, were the compile to come out as predicted
    (`_speculated`), compiles beside it as a spare (`PlannerCompiles.spare`): taken only
    where the search asks for it, so the plans are those of one compile at a time."""
    model = planner.costs.model_for(base, groups)
    tried, status, best = set(), "", None
    room, hi, fit = limit - floor.memory_bytes, None, False
    anchors = _anchors(planner, base, groups, floor, model)
    with planner.compiles.in_phase("verify"):
        for i in range(planner.max_iterations):
            planner.compiles.left = planner.max_iterations - i - 1
            saved, offloaded, status = model.solve(room, unit, planner.objective)
            if (saved, offloaded) in tried:
                room = _bumped(model, saved, room, hi, fit)
                if room is None:
                    break
                fit = False
                continue
            tried.add((saved, offloaded))
            # Predicted before its compile, from the nearest compile so far (`_predict`).
            predicted = _predict(planner, base, floor, model, saved, offloaded, anchors)
            policy = planner.costs.policy_from_items(saved, base, groups, offloaded)
            tag_bytes = model.cost(saved, offloaded)[0]
            ahead = (_speculated(planner, model, unit, base, groups, tried, i,
                                 _after(room, hi, predicted[0], limit, tag_bytes))
                     if pool.current().jobs > 1 else None)
            if ahead is None:
                record = planner.compiles.record_of(policy)
            else:
                record, _ = pool.side_by_side([lambda: planner.compiles.record_of(policy),
                                               lambda: planner.compiles.spare(ahead)])
                if isinstance(record, Exception):
                    raise record
            name = record.policy
            if record.error or record.memory_bytes is None or record.flops is None:
                notes.append(f"{name}: no figures ({record.error}), skipped")
                hi, room = tag_bytes, max(0, tag_bytes - 1)
                continue
            used = record.memory_bytes
            anchors.append((saved, offloaded, used))
            fit = used <= limit
            notes.append(f"{name}: {used:,} bytes, " + ("fits" if fit else "over"))
            if fit:
                found = (planner.costs.score(record), policy, record, predicted)
                best = found if best is None or found[0] < best[0] else best
            room, hi, fit = _after(room, hi, used, limit, tag_bytes)
    return tried, status, best


def _after(room: float, hi, used: int, limit: int, tag_bytes: int) -> tuple:
    """(room, hi, fit) after a plan of `tag_bytes` compiled to `used` bytes: where it
    fits with bytes to spare the model over-predicted, so the slack is offered, below
    a room already found too much (`hi`); over, the room shrinks by the overshoot and
    below this plan's bytes."""
    if used <= limit:
        grown = room + limit - used
        return (grown if hi is None else min(grown, (room + hi) / 2)), hi, True
    return max(0, min(room - (used - limit), tag_bytes - 1)), tag_bytes, False


def _bumped(model, saved, room: float, hi, fit: bool) -> float | None:
    """The room to solve at where the room moved and the answer did not: where the last
    compile fit, the budget may hold more than the model says (XLA reuses buffers: the
    last layer's residuals often cost nothing), so the next smallest item is offered,
    below any room already found too much; None where the search stops."""
    bump = min((model.byte_share * model.nbytes[t] for t in model.tags
                if model.nbytes[t] and t not in saved and t not in model.fixed),
               default=None)
    if not fit or bump is None or (hi is not None and room + bump >= hi):
        return None
    return room + bump


def _speculated(planner, model, unit: float, base: str, groups: int, tried: set, i: int,
                state: tuple):
    """The plan `_verify` would compile after its iteration `i`, were that compile to come
    out as predicted (`state`: the (room, hi, fit) `_after` gives then); None where it
    would compile none within `max_iterations`."""
    room, hi, fit = state
    for _ in range(i + 1, planner.max_iterations):
        saved, offloaded, _ = model.solve(room, unit, planner.objective)
        if (saved, offloaded) not in tried:
            return planner.costs.policy_from_items(saved, base, groups, offloaded)
        room, fit = _bumped(model, saved, room, hi, fit), False
        if room is None:
            return None
    return None


def _anchors(planner, base: str, groups: int, floor, model) -> list[tuple]:
    """The compiles a prediction above base rule `base` may start from, as
    (saved, offloaded, compiled bytes): the base alone (`floor`), and above base
    nothing every decidable tag saved (`PlannerCosts.byte_share`'s compile)."""
    found = [(frozenset(), frozenset(), floor.memory_bytes)]
    if base == "nothing" and planner.costs.byte_share_measured:
        kept = frozenset(t for t in model.tags if t not in model.fixed)
        # Compiled for the share where it holds bytes; looked up, never compiled here.
        every = planner.compiles.records.get(str(Policy(save=frozenset(
            t if groups == 1 else t[0] for t in kept))))
        if every is not None and not every.error and every.memory_bytes is not None:
            found.append((kept, frozenset(), every.memory_bytes))
    return found


def _predict(planner, base, floor, model, saved, offloaded=frozenset(),
             anchors=()) -> tuple[int, float, float | None]:
    """(device bytes, FLOPs, seconds or None) the cost model predicts for saving
    `saved` and offloading `offloaded` above base rule `base` alone (`floor`,
    its compiled record).

    The bytes start from the compile in `anchors` ((saved, offloaded, compiled
    bytes) triples; the floor where none is given) nearest this plan (the fewest
    bytes of items decided otherwise) and add what the cost model says the
    difference costs: the compiled figure is not linear in the kept bytes
    (docs/plan.md, "The first estimate"), so the nearer the compile the better."""
    def apart(anchor):
        kept = {(t, "s") for t in saved} | {(t, "o") for t in offloaded}
        there = {(t, "s") for t in anchor[0]} | {(t, "o") for t in anchor[1]}
        return sum(model.nbytes[t] for t, _ in kept ^ there)
    start_saved, start_offloaded, start = min(
        anchors or [(frozenset(), frozenset(), floor.memory_bytes)], key=apart)
    nbytes, flops = model.cost(saved, offloaded)
    nbytes += start - model.cost(start_saved, start_offloaded)[0]
    empty = model.cost(frozenset())[1]
    seconds = None
    if planner.objective == "time":
        seconds = planner.costs.seconds(Policy(base=base)) - model.time(frozenset()) + \
            model.time(saved, offloaded)
    return nbytes, floor.flops - empty + flops, seconds

def predict(planner, policy: Policy) -> tuple[int, float, float | None] | None:
    """(device bytes of `memory_kind`, FLOPs, predicted step seconds or None) of a uniform
    `policy` without compiling it: the cost model's figures above its base rule's compile,
    from the nearest compile (`_predict`), as the search predicts a plan before verifying
    it. None where the model cannot say: no remat, a layer schedule, a base rule not
    planned or not compiled yet, offload where it is not planned. Compiles nothing
    (before the byte share is measured, saved bytes count whole: an upper estimate)."""
    floor = planner.compiles.records.get(str(Policy(base=policy.base)))
    if (not policy.remat or policy.schedule != Policy().schedule or floor is None
            or policy.base not in planner.bases or floor.error or floor.memory_bytes is None
            or policy.offload and not (planner.costs.plans_offload and planner.costs.byte_share_measured)):
        return None
    model = (planner.costs.model_for(policy.base, 1) if policy.base != "nothing"
             or planner.costs.byte_share_measured else planner.costs.offload_free_model())
    kept = {t: next((d for d in map(policy.decide, (t, *model.aliases.get(t, ())))
                     if d != "recompute"), "recompute")  # kept where its name or an alias is
            for t in model.tags}
    saved = frozenset(t for t, d in kept.items() if d == "save")
    offloaded = frozenset(t for t, d in kept.items() if d == "offload")
    nbytes, flops, seconds = _predict(planner, policy.base, floor, model, saved, offloaded,
                                      _anchors(planner, policy.base, 1, floor, model))
    if seconds is None and planner.predict_time:
        seconds = planner.costs.seconds(Policy(base=policy.base)) - model.time(frozenset()) + \
            model.time(saved, offloaded)
    if seconds is not None and seconds < planner.costs.seconds(Policy(remat=False)):
        seconds = None  # faster than no remat: the per-tag time terms cannot say
    return nbytes, flops, seconds


def _finish(planner, key, budget, limit, policy, record, predicted_bytes, predicted_flops,
            status, iterations, groups, offload_notes=()) -> Plan:
    least, none = planner.minimum()
    if record.audit and not record.audit["as_asked"]:  # the compile did not do the plan
        status += f"; compiled not as planned: {record.audit['findings'][0]}"
    if none is None:
        status += "; no remat runs out of the target's memory: its FLOPs are the cost model's"
    layered = isinstance(policy, tuple)
    result = Plan(
        budget=str(budget), budget_bytes=limit, policy=policy,
        spec=layers_summary(policy) if layered else str(policy),
        predicted_bytes=predicted_bytes,
        predicted_flops=predicted_flops, measured_bytes=record.memory_bytes,
        measured_flops=record.flops, none_bytes=none, none_flops=planner.none_flops(),
        minimum_bytes=least, status=status, iterations=iterations,
        platform=record.platform, memory_kind=planner.compiles.memory_kind,
        none_out_of_memory=none is None,
        layer_specs=tuple(map(str, policy)) if layered else (), groups=groups,
        objective=planner.objective,
        predicted_seconds=planner.costs.seconds(policy) if planner.predict_time else None,
        none_seconds=(planner.costs.seconds(Policy(remat=False)) if planner.predict_time
                      else None),
        offloaded_bytes=record.offloaded_bytes, host_bytes=record.host_temp_size_in_bytes,
        offload_notes=tuple(offload_notes), model=dict(planner.made_for), step=planner.step,
        aliases=planner.costs.aliases_of(policy), audit=record.audit)
    if planner.cache:
        write_cache(planner.cache, key, result)
    return result

def frontier(planner, budgets: Sequence) -> list[Plan]:
    """`plan` for each budget, made monotone: where a smaller budget's plan
    scores better (fewer measured FLOPs, or less predicted time), it is kept
    for the larger budget too (it fits).

    Returns:
      Plans in the order of `budgets`.
    Raises:
      BudgetError: as `plan`, for the first budget that fails.
    """
    plans = [plan(planner, b) for b in budgets]
    score = ((lambda p: p.predicted_seconds) if planner.objective == "time"
             else (lambda p: p.measured_flops))
    best: Plan | None = None
    for i in sorted(range(len(plans)), key=lambda i: plans[i].budget_bytes):
        p = plans[i]
        if best is not None and score(best) < score(p):
            plans[i] = dataclasses.replace(
                best, budget=p.budget, budget_bytes=p.budget_bytes, cached=p.cached,
                status=p.status + f"; kept the plan of budget {best.budget} (scores better)")
        best = plans[i]
    return plans


__all__ = ["frontier", "plan", "predict"]
