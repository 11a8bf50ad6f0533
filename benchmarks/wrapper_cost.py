"""What `rk.remat_model` costs at compile time: the wrapped model's grad against the same model
under flax's `nn.remat` with a JAX built-in policy (`rk.linen.apply_remat(model, {block: "full"})`
lowers to `nn.remat(policy=nothing_saveable)` regions), same run.

For each round, each form is traced, lowered and compiled from a cold jit (`jax.clear_caches`),
alternating forms; the report gives each form's median seconds and the ratio of medians.

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
             "rk.remat_model": rk.remat_model(model, "full")}
    seconds = {name: [] for name in forms}
    for _ in range(args.rounds):
        for name, wrapped in forms.items():
            seconds[name].append(_compile_seconds(wrapped, params, tokens, args.batch, args.seq))
    medians = {name: statistics.median(s) for name, s in seconds.items()}
    print(f"{args.model} b{args.batch} s{args.seq}, trace + lower + compile of value_and_grad, "
          f"{args.rounds} rounds")
    for name, s in seconds.items():
        print(f"  {name:28s} median {medians[name]:.3f} s  (min {min(s):.3f}, max {max(s):.3f})")
    base, ours = medians.values()
    print(f"  ratio rk.remat_model / nn.remat: {ours / base:.3f}")


if __name__ == "__main__":
    main()
