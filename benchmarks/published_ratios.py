"""The time model against published step-time measurements of remat, at their shapes.

Two published measurements, both on NVIDIA A100 80GB:

* Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
  Transformer Models" (arXiv:2205.05198), Table 4: one layer of their 22B
  GPT-3 model (hidden 6144, 64 heads, sequence 2048, tensor-parallel 8),
  forward and backward time: full recompute +39%, selective recompute +7%
  (+4% with sequence parallelism, which splits the norms and dropout over the
  tensor-parallel ranks; not modelled here). The slice is what one of the 8
  tensor-parallel ranks computes: 8 heads of 96, MLP 3072 wide, the residual
  stream and norms whole, micro-batch 4; no dropout.
* torchtitan's docs/performance.md (pytorch/torchtitan), Llama 2 13B with FSDP
  on 64 A100 80GB, local batch 2, sequence 4096: 2162 tokens/s without
  activation checkpointing, 1904 with selective op checkpointing (+13.5% step
  time), which saves the output of every other matmul of a layer and of the
  attention kernel (torchtitan's `_custom_policy`): wq, wv, w1, w2 and the
  attention output, here `save:query_proj,value_proj,context,mlpwi_0,mlpwo`.
  The slice: 2 Llama-2-13B layers (dim 5120, 40 heads of 128, MLP 13824).

Both slices have a 256-token vocabulary, so the embedding and head, which
no layer policy touches, are a negligible part of the step, as they are
per layer in the published figures. Every figure is the time model's
prediction (`remat_kit.measure.time_model.compiled_seconds`) of the compiled
value-and-grad program, a ratio to no remat's; "fwd share" is the predicted
forward pass over the whole step. Megatron's full recompute re-runs the whole
forward (PyTorch's checkpoint re-runs the function), while JAX's remat
recomputes only what the backward pass reads (not a layer's last matmuls), so
the ratio comparable to Korthikanti's +39% is 1 + fwd share.

Run: PYTHONPATH=. python benchmarks/published_ratios.py [--targets gpu:a100,tpu:v5e:1x1]
(a GPU target needs the CUDA plugin: pip install jax-cuda12-plugin jax-cuda12-pjrt;
no GPU is needed). Prints a Markdown table; --json PATH writes the figures.
"""

from __future__ import annotations

import argparse
import json
import time

import jax

from remat_kit.measure import lowering, targets, time_model
from remat_kit.models import get_config
from remat_kit.models.program import workload
from remat_kit.policy.spec import parse

TORCHTITAN_SELECTIVE_OP = "save:query_proj,value_proj,context,mlpwi_0,mlpwo"
CASES = {
    "korthikanti_22b": dict(
        config=dict(family="gpt2", vocab_size=256, num_layers=2, d_model=6144, num_heads=8,
                    head_dim=96, mlp_dim=3072, max_len=2048, dtype="bfloat16"),
        batch=4, seq=2048,
        published={"full": 1.39, "selective": 1.07},
        source="Korthikanti et al. 2022, Table 4 (A100)"),
    "torchtitan_llama2_13b": dict(
        config=dict(family="llama", vocab_size=256, num_layers=2, d_model=5120, num_heads=40,
                    num_kv_heads=40, head_dim=128, mlp_dim=13824, max_len=4096,
                    dtype="bfloat16"),
        batch=2, seq=4096,
        published={TORCHTITAN_SELECTIVE_OP: 2162 / 1904},
        source="torchtitan docs/performance.md (64 A100, FSDP)"),
}


def predict(case: dict, target: str) -> dict:
    """{"none_ms", "fwd_share", "ratios": {policy: (time ratio, FLOP ratio)}} of one case on
    one target; a policy whose compile fails (e.g. over the device's memory) maps to its error."""
    cfg = get_config("tiny").replace(**case["config"])
    work = workload(cfg, case["batch"], case["seq"])
    line = time_model.roofline(target)

    def one(fn):
        # compile_only=False: the executable itself, never figures kept from an earlier run
        compiled = lowering.compile_for(fn, *work.args, target=target, compile_only=False,
                                        count_flops=False).compiled
        ops = time_model.compiled_ops(compiled)
        return (sum(o.trips * line.seconds(o.flops, o.nbytes, o.dtype) for o in ops),
                sum(o.trips * o.flops for o in ops))

    none = one(jax.value_and_grad(work.loss_for_policy(parse("none"))))
    forward = one(work.loss_for_policy(parse("none")))
    ratios = {}
    for policy in case["published"]:
        try:
            seconds, flops = one(jax.value_and_grad(work.loss_for_policy(parse(policy))))
            ratios[policy] = (seconds / none[0], flops / none[1])
        except Exception as e:  # noqa: BLE001 - reported in the table
            ratios[policy] = f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
    return {"none_ms": none[0] * 1e3, "fwd_share": forward[0] / none[0], "ratios": ratios}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default="gpu:a100,tpu:v5e:1x1")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    out = []
    print("| case | target | policy | published × none | predicted × none | FLOPs × none |"
          " none predicted | fwd share |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for name in args.cases.split(","):
        case = CASES[name]
        for target in args.targets.split(","):
            start = time.perf_counter()
            try:
                found = predict(case, target)
            except targets.TargetError as e:
                print(f"| {name} | {target} | skipped: {e} | | | | | |")
                continue
            for policy, published in case["published"].items():
                got = found["ratios"][policy]
                cells = (("—", "—") if isinstance(got, str)
                         else (f"{got[0]:.3f}", f"{got[1]:.3f}"))
                print(f"| {name} | {target} | `{policy}` | {published:.3f} | {cells[0]} | "
                      f"{cells[1]} | {found['none_ms']:.2f} ms | {found['fwd_share']:.3f} |",
                      flush=True)
                out.append({"case": name, "target": target, "policy": policy,
                            "published": published, "predicted": got,
                            "none_ms": found["none_ms"], "fwd_share": found["fwd_share"],
                            "seconds": time.perf_counter() - start, "source": case["source"]})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"versions": {t: targets.versions(t) for t in args.targets.split(",")},
                       "rows": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
