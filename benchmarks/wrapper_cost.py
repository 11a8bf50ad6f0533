"""What the wrappers cost at compile time, and what they compile to, on a model not ours.

Compile time: the wrapped model's grad under `rk.remat_model` and under `rk.linen.apply_remat`
with a role preset (`minimal`: the block traced alone and its roles tagged) against the same
model under flax's `nn.remat` with a JAX built-in policy (`apply_remat(model, {block: "full"})`
lowers to `nn.remat(policy=nothing_saveable)` regions), same run. For each round, each form is
traced, lowered and compiled from a cold jit (`jax.clear_caches`), alternating forms; the report
gives each form's median seconds and its ratio of medians to the built-in form.

Program: temp bytes and FLOPs of value_and_grad, as multiples of no remat's, for
`compare --model`'s row (the workload's program) and for each wrapper form, per preset.

    python benchmarks/wrapper_cost.py [--model gpt_linen] [--rounds 5] [--batch 8] [--seq 32]
"""

import argparse
import importlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402

import remat_kit as rk  # noqa: E402
from remat_kit.flax.from_model import logits_of, next_token_loss  # noqa: E402
from remat_kit.measure import lowering  # noqa: E402


def _compile_seconds(model, params, tokens, batch, seq) -> float:
    def loss(p, t):
        return next_token_loss(logits_of(model.apply({"params": p}, t), batch, seq), t)

    jax.clear_caches()
    start = time.perf_counter()
    jax.jit(jax.value_and_grad(loss)).lower(params, tokens).compile()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt_linen", help="a linen model of tests/zoo")
    parser.add_argument("--block", default="Block")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=32)
    args = parser.parse_args()
    zoo = importlib.import_module(f"tests.zoo.{args.model}")
    model = zoo.model()
    tokens = jax.ShapeDtypeStruct((args.batch, args.seq), "int32")
    params = jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]
    forms = {"nn.remat, built-in policy": rk.linen.apply_remat(model, {args.block: "full"}),
             "rk.remat_model full": rk.remat_model(model, "full"),
             "rk.remat_model minimal": rk.remat_model(model, "minimal"),
             "apply_remat minimal (roles)": rk.linen.apply_remat(model, {args.block: "minimal"})}
    seconds = {name: [] for name in forms}
    for _ in range(args.rounds):
        for name, wrapped in forms.items():
            seconds[name].append(_compile_seconds(wrapped, params, tokens, args.batch, args.seq))
    medians = {name: statistics.median(s) for name, s in seconds.items()}
    print(f"{args.model} b{args.batch} s{args.seq}, trace + lower + compile of value_and_grad, "
          f"{args.rounds} rounds")
    for name, s in seconds.items():
        print(f"  {name:28s} median {medians[name]:.3f} s  (min {min(s):.3f}, max {max(s):.3f})")
    base = medians["nn.remat, built-in policy"]
    for name, median in list(medians.items())[1:]:
        print(f"  ratio {name} / nn.remat: {median / base:.3f}")
    _programs(model, args.block, 4, 32)


def _figures(model, work) -> tuple[int, float]:
    def loss(p, t, r):
        return next_token_loss(logits_of(model.apply({"params": p, **r}, t), *t.shape), t)
    compiled = lowering.compile_for(jax.value_and_grad(loss), *work.args)
    return compiled.memory["temp_size_in_bytes"], compiled.flops


def _programs(model, block: str, batch: int, seq: int) -> None:
    """The table: compare's row against each wrapper form, x no remat."""
    work = rk.from_model.workload(model, batch, seq)
    none = lowering.compile_for(jax.value_and_grad(work.loss_for_policy(rk.parse("none"))),
                                *work.args)
    base = none.memory["temp_size_in_bytes"], none.flops
    print(f"\nb{batch} s{seq} value_and_grad: temp x none / FLOPs x none")
    for spec in ("minimal", "selective", "full"):
        c = lowering.compile_for(jax.value_and_grad(work.loss_for_policy(rk.parse(spec))),
                                 *work.args)
        rows = {"compare --model row": (c.memory["temp_size_in_bytes"], c.flops),
                "rk.remat_model": _figures(rk.remat_model(model, spec), work),
                "rk.linen.apply_remat": _figures(rk.linen.apply_remat(model, {block: spec}),
                                                 work)}
        for name, (temp, flops) in rows.items():
            print(f"  {spec:10s} {name:22s} {temp / base[0]:.3f} / {flops / base[1]:.3f}"
                  f"  ({temp:,} B, {flops:,.0f} FLOPs)")


if __name__ == "__main__":
    main()
