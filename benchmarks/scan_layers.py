"""Scanned layers and the nested (sqrt N) schedule: compile time and what nested costs.

1. Compile time of the train step (value and grad of the LM loss) with
   `scan_layers=True`, 48 layers against 12, and
   the unrolled (looped) stack's ratio beside it. One run, one compile each,
   default XLA options.
2. For 64 layers: layer inputs the nested schedule stores (target <= 2 sqrt(64)
   = 16: group inputs in the forward pass + one group's layer inputs while it
   is recomputed) and its FLOPs over no remat (target <= 2 extra forwards),
   from `remat_kit.measure_config` (XLA CPU compile, loops counted per trip).

    .venv/bin/python benchmarks/scan_layers.py [--config tiny] [--batch 8] [--seq 128]
        [--layers 12,48] [--nested-layers 64] [--skip-unrolled]
"""

import argparse
import time

import jax
import jax.numpy as jnp

import remat_kit as rk
from remat_kit.measure.costs import loop_scaled_costs
from remat_kit.models import Transformer, get_config, make_loss_fn


def _args(cfg, batch: int, seq: int):
    """(loss, its args as ShapeDtypeStructs) for the reference model of cfg."""
    model = Transformer(cfg)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, seq), jnp.int32))
                            )["params"]
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    return make_loss_fn(model), (params, tokens, tokens, jax.eval_shape(lambda: jax.random.key(0)))


def compile_seconds(cfg, batch: int, seq: int) -> float:
    """Seconds to trace, lower and compile value_and_grad of the loss (compile-only)."""
    loss, args = _args(cfg, batch, seq)
    start = time.perf_counter()
    jax.jit(jax.value_and_grad(loss)).lower(*args).compile()
    return time.perf_counter() - start


def forward_flops(cfg, batch: int, seq: int) -> float:
    """FLOPs of the loss alone (no backward pass), loops counted per trip."""
    loss, args = _args(cfg, batch, seq)
    return loop_scaled_costs(jax.jit(loss).lower(*args).compile())[0]["flops"]


def stored_layer_inputs(cfg, batch: int, seq: int) -> int:
    """Layer or group inputs [batch, seq, d_model] the forward pass stores
    (residual walker), counting each stacked [n, ...] scan residual as n."""
    loss, args = _args(cfg, batch, seq)
    one = batch * seq * cfg.d_model * jnp.dtype(cfg.dtype).itemsize
    return sum(r.nbytes for r in rk.residuals(loss, *args)
               if r.shape[-3:] == (batch, seq, cfg.d_model) and r.name in (
                   "decoder_layer_input", "decoder_layer_output", "scan input")) // one


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--policy", default="full", help="remat policy of the compile-time runs")
    ap.add_argument("--layers", default="12,48", help="two layer counts, small,large")
    ap.add_argument("--nested-layers", type=int, default=64)
    ap.add_argument("--skip-unrolled", action="store_true")
    args = ap.parse_args()
    small, large = (int(n) for n in args.layers.split(","))
    base = get_config(args.config, remat=args.policy)
    print(f"{args.config}, batch {args.batch}, seq {args.seq}, policy {args.policy}, "
          f"{jax.default_backend()} backend")

    print("\n1. compile time (trace + lower + compile, value_and_grad)")
    for scan in ((True,) if args.skip_unrolled else (True, False)):
        secs = [compile_seconds(base.replace(num_layers=n, scan_layers=scan), args.batch,
                                args.seq) for n in (small, large)]
        print(f"   {'scanned' if scan else 'unrolled'}: {small} layers {secs[0]:.2f} s, "
              f"{large} layers {secs[1]:.2f} s, ratio {secs[1] / secs[0]:.2f}x")

    n = args.nested_layers
    cfg = base.replace(num_layers=n, scan_layers=True)
    print(f"\n2. {n} layers, scanned: nested against full and no remat")
    records = rk.measure_config(cfg, args.batch, args.seq, ["none", "full", "nested"],
                                per_layer=False)
    none_flops = next(r.flops for r in records if r.policy == "none")
    forward = forward_flops(cfg, args.batch, args.seq)
    print(f"   one forward pass: {forward / 1e9:.2f} GFLOPs")
    for r in records:
        c = cfg.replace(remat=r.policy)
        stored = stored_layer_inputs(c, args.batch, args.seq) if r.policy != "none" else None
        schedule = rk.parse(r.policy).schedule
        peak = (f"{stored} + {schedule.group_size(n)} while a group is recomputed = "
                f"{stored + schedule.group_size(n)}" if schedule.kind == "nested" else stored)
        print(f"   {r.policy:12s} FLOPs {r.flops / 1e9:8.2f} G  "
              f"extra forwards {(r.flops - none_flops) / forward:5.2f}  "
              f"temp {r.temp_size_in_bytes / 2**20:8.1f} MiB  stored layer inputs: {peak}")


if __name__ == "__main__":
    main()
