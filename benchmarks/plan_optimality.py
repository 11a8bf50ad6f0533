"""The planner's optimality, shown by compiling its whole decision space.

    PYTHONPATH=. python benchmarks/plan_optimality.py [--configs tiny,tiny_llama]

For `tiny` and `tiny_llama` (batch 2, seq 32, f32, XLA CPU, objective flops, no
offload) and two decision spaces small enough to compile every point of:

- uniform: a subset of 4 tags saved in every layer, x each base rule
  (nothing, dots_no_batch, dots): 16 x 3 = 48 policies;
- per layer: a subset of 2 tags saved in each of the 2 layers (2 groups) x each
  base rule: 4 x 4 x 3 = 48 policies;

a planner narrowed to the same tags (`Planner(decide=...)`) plans 5 budgets
spread between the least compiled memory and no remat's. A second planner
compiles every policy of the space (so the first never sees them as
candidates); the best fitting one is the one with the fewest measured FLOPs
whose memory fits. Checks: the verified plan fits, and its measured FLOPs are
within 0.5% of the best fitting policy's. Prints the table; exit status 1 if a
check fails.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time

from remat_kit.decide.cost_model import PLANNED_BASES
from remat_kit.policy.policy import Policy

BATCH, SEQ = 2, 32
TOLERANCE = 0.005  # of the best fitting policy's FLOPs
# The tags each space decides: the costliest chains of each model's layer.
SPACES = {
    "tiny": {"uniform": ("attn_probs", "context", "mlpwi", "mlp_act"),
             "per layer": ("mlpwi", "mlp_act")},
    "tiny_llama": {"uniform": ("attn_probs", "mlpwi_0", "mlpwi_1", "mlp_act"),
                   "per layer": ("mlpwi_0", "mlp_act")},
}


def subsets(tags):
    return [frozenset(c) for k in range(len(tags) + 1) for c in itertools.combinations(tags, k)]


def space(tags, layers: int | None):
    """Every policy of a decision space: a subset of `tags` per layer (one subset for
    all layers where `layers` is None) x each planned base rule."""
    out = []
    for base in PLANNED_BASES:
        if layers is None:
            out += [Policy(save=s, base=base) for s in subsets(tags)]
        else:
            out += [tuple(Policy(save=s, base=base) for s in choice)
                    for choice in itertools.product(subsets(tags), repeat=layers)]
    return out


def best_fitting(exhaustive, policies, limit: int):
    """(record, policy) with the fewest measured FLOPs, then memory, among `policies`
    compiled by planner `exhaustive` whose memory fits `limit` bytes; None if none fits."""
    found = [(exhaustive.record_of(p), p) for p in policies]
    fits = [(r, p) for r, p in found if r.error is None and r.memory_bytes <= limit]
    return min(fits, key=lambda rp: (rp[0].flops, rp[0].memory_bytes), default=None)


def budgets(planner, n: int = 5) -> list[int]:
    """n budgets in bytes, evenly between the least compiled memory and no remat's."""
    least, none = planner.minimum()
    return [int(least + (none - least) * (k + 1) / (n + 1)) for k in range(n)]


def check(make_planner, policies, limits, tags):
    """Rows (budget, plan, best, gap, ok) for `limits`: a planner narrowed to `tags`
    plans them; another compiles `policies` for the best fitting one."""
    planner, exhaustive = make_planner(decide=tags), make_planner()
    rows = []
    for limit in limits:
        plan = planner.plan(limit)
        best = best_fitting(exhaustive, policies, limit)
        record, _ = best
        gap = plan.measured_flops / record.flops - 1
        spec = record.policy
        rows.append(dict(budget=limit, fraction=limit / plan.none_bytes, plan=plan.spec,
                         plan_bytes=plan.measured_bytes,
                         plan_flops=plan.flops_overhead, best=spec,
                         best_bytes=record.memory_bytes,
                         best_flops=record.flops / plan.none_flops - 1, gap=gap,
                         ok=plan.measured_bytes <= limit and gap <= TOLERANCE))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="tiny,tiny_llama")
    args = parser.parse_args(argv)
    from remat_kit.models import get_config
    from remat_kit.api.configs import config_planner

    failed = 0
    start = time.perf_counter()
    print("| model | space | policies | budget (x none) | plan | FLOPs + | best fitting "
          "compiled | FLOPs + | plan - best | ok |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in args.configs.split(","):
        cfg = get_config(name)
        for kind, tags in SPACES[name].items():
            groups = 1 if kind == "uniform" else cfg.num_layers

            def make(groups=groups, **kw):
                return config_planner(cfg, BATCH, SEQ, cache=None, groups=groups,
                                      offload=False, objective="flops", **kw)

            policies = space(tags, None if kind == "uniform" else cfg.num_layers)
            limits = budgets(make())
            for row in check(make, policies, limits, tags):
                failed += not row["ok"]
                print(f"| {name} | {kind} ({', '.join(tags)}) | {len(policies)} | "
                      f"{row['fraction']:.3f} | `{row['plan']}` | {row['plan_flops']:+.2%} | "
                      f"`{row['best']}` | {row['best_flops']:+.2%} | {row['gap']:+.3%} | "
                      f"{'yes' if row['ok'] else 'NO'} |", flush=True)
    print(f"{'all' if not failed else failed} {'checks pass' if not failed else 'checks fail'}"
          f" (plan within {TOLERANCE:.1%} of the best fitting compiled policy's FLOPs, and "
          f"fits); {time.perf_counter() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
