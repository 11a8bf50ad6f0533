"""Does offload ever pay on a TPU? The offload probe and plans with and without offload.

    python benchmarks/offload_probe.py [--models tiny,wide] [--budgets 0.5,0.6,0.7,0.8]
        [--target tpu:v5e:1x1] [--bandwidth BYTES_PER_S]

On `tpu:v5e:1x1` with a scanned stack (`scan_layers=True`,
docs/scan.md), find a model and budget where a plan that offloads verifies
under budget with less recompute than any plan without offload, or show why
none exists. For each model (`MODELS`: the tiny GPT-2, and a wide one, d_model
2048 (2 layers), where a layer's compute is long enough for a PCIe transfer to hide
behind it), this prints:

- the offload probe (`remat_kit.decide.offload_probe`): the decided tags
  offloaded against saved, device bytes removed per byte offloaded;
- per budget (a fraction of no remat's compiled peak), the plan with offload
  asked for and the plan without (objective FLOPs, the TPU default): the
  policy, its compiled peak and whether it fits, its FLOPs and predicted step
  time (the time model on the compiled program, which prices its host DMAs)
  over no remat's, and the bytes offloaded;
- the verdict: the budgets where the offload plan fits with fewer FLOPs than
  the plan without (and than every compiled policy that fits without
  offloading), or none.

Compile-only (deviceless TPU compiles through libtpu); compiled figures are
kept in the commands' figure cache (`cli.use_compile_cache`), so a rerun
compiles nothing it compiled before. Exit status 0 either way: the result is
a finding, not a check.
"""

from __future__ import annotations

import argparse
import os
import sys

from remat_kit.cli import commands as cli
from remat_kit.errors import BudgetError
from remat_kit.models import get_config
from remat_kit.api.configs import config_planner

# name -> (config, batch, seq): scanned stacks, bf16 activations.
MODELS = {
    "tiny": (get_config("tiny", scan_layers=True), 8, 128),
    "wide": (get_config("gpt2_small", num_layers=2, d_model=2048, num_heads=16, mlp_dim=8192,
                        vocab_size=8192, scan_layers=True), 4, 1024),
}
BUDGETS = "0.5,0.6,0.7,0.8"


def _row(planner, budget):
    """(spec, peak bytes, fits, FLOPs over none, bytes offloaded, predicted step time
    over none) of the plan, or None below the minimum."""
    try:
        p = planner.plan(budget)
    except BudgetError:
        return None
    return (p.spec, p.measured_bytes, p.measured_bytes <= p.budget_bytes,
            p.measured_flops / p.none_flops, p.offloaded_bytes, 1 + p.time_overhead)


def run(name: str, budgets: list[float], target: str, bandwidth) -> list[str]:
    """Prints one model's probe and plans; returns the budgets where offload paid."""
    cfg, batch, seq = MODELS[name]
    common = dict(dtype="bfloat16", cache=None, target=target, max_iterations=3)
    asked = config_planner(cfg, batch, seq, offload=bandwidth or True, **common)
    plain = config_planner(cfg, batch, seq, offload=False, **common)
    probe = asked.offload_probe
    print(f"\n{name}: {cfg.num_layers} layers scanned, d_model {cfg.d_model}, batch {batch}, "
          f"seq {seq}, bf16, {target}; host link {asked.host_bandwidth / 1e9:.1f} GB/s")
    print(probe.note)
    paid = []
    print(f"{'budget':>6}  {'with offload asked for (peak, FLOPs and predicted step over none)':<72}"
          f" {'without offload':<60}")
    for b in budgets:
        with_, without = _row(asked, b), _row(plain, b)
        if with_ is None or without is None:
            print(f"{b:>6}  below the minimum")
            continue

        def cell(r):
            spec, peak, fits, flops, off, step = r
            return (f"{spec[:24]:<24} {peak / 2**20:7.1f} MiB {'fits' if fits else 'OVER'}"
                    f" x{flops:.4f} t x{step:.3f}" + (f" off {off / 2**20:.1f} MiB" if off else ""))
        print(f"{b:>6}  {cell(with_):<72} {cell(without):<60}")
        # Fewer FLOPs than the planner's plan without offload and than every compiled
        # policy that offloads nothing and fits: the bases, the plans tried, and the
        # probe's twin that saves every decided tag (the least recompute of all).
        best_plain = min([without[3]] + [
            r.flops / plain.none_flops() for r in asked.compiled_records() + plain.compiled_records()
            if not r.offloaded_bytes and r.memory_bytes <= b * plain.none().memory_bytes])
        if with_[4] and with_[2] and with_[3] < best_plain * (1 - 1e-6):
            paid.append(f"{name} at {b}: {with_[0]} x{with_[3]:.4f} FLOPs (predicted step "
                        f"x{with_[5]:.3f}) against x{best_plain:.4f} without offload (the "
                        f"plan's step x{without[5]:.3f})")
    return paid


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--budgets", default=BUDGETS)
    parser.add_argument("--target", default="tpu:v5e:1x1")
    parser.add_argument("--bandwidth", type=float, default=None,
                        help="host bytes/s each way (default: the target's listed figure)")
    args = parser.parse_args(argv)
    cli.use_compile_cache()
    budgets = [float(b) for b in args.budgets.split(",")]
    paid = []
    for name in args.models.split(","):
        paid += run(name, budgets, args.target, args.bandwidth)
    print(f"\nload average {os.getloadavg()[0]:.1f}")
    print("offload paid: " + ("; ".join(paid) if paid else "at no model and budget tried"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
