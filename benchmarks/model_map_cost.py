"""What the model map costs: no extra trace, in one run.

    python benchmarks/model_map_cost.py [--batch 8] [--seq 32] [--repeats 5]

On `tests/zoo/gpt_linen.py`'s GPT (and the MaxText-like scanned decoder) prints the best
wall seconds of `rk.from_model.workload` (the one trace of the model, its roles, its map)
beside the seconds of the map's own parts on that trace: the layer search over the module
instances (`blocks.pick_block`) and the own-remat walk of the jaxpr (`own_remat.find`).
Their share of the workload's seconds is the map's cost; the target is under 5%. For
`compare --model` before and after, time the command on both checkouts in one run.
"""

import argparse
import time

import jax
import jax.numpy as jnp

import remat_kit as rk
from remat_kit.flax import blocks, from_model
from remat_kit.trace import own_remat as own_remat_walk
from tests.zoo import gpt_linen, maxtext_scan_linen


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    for name, model in (("gpt_linen", gpt_linen.model()),
                        ("maxtext_scan_linen", maxtext_scan_linen.model())):
        whole = _best(lambda: rk.from_model.workload(model, args.batch, args.seq), args.repeats)
        instances, _ = from_model.linen_instances(
            model, lambda t: model.init(jax.random.key(0), t),
            jax.ShapeDtypeStruct((1, args.seq), jnp.int32))
        pick = blocks.pick_block(instances)
        _, marked, parts = from_model._linen(model, args.batch, args.seq, None)
        traced, _ = from_model.trace(marked, from_model._on_mesh(parts, None), None, pick.cls)
        search = _best(lambda: blocks.pick_block(instances), args.repeats)
        walk = _best(lambda: own_remat_walk.find(traced.jaxpr, from_model.KEY), args.repeats)
        print(f"{name}: workload {whole:.3f} s; map: layer search {search * 1e3:.2f} ms + "
              f"own-remat walk {walk * 1e3:.2f} ms = {(search + walk) / whole:.2%} of it")


if __name__ == "__main__":
    main()
