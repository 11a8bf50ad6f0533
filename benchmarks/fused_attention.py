"""Fused attention priced and planned: splash against its einsum twin at Llama-8B widths.

    python benchmarks/fused_attention.py [--seqs 2048,8192] [--target tpu:v5p:2x2x1]
        [--batch 4] [--layers 4] [--attentions splash,einsum,cudnn,xla]
        [--policies none,full,...]
        [--json out.json]

The model is `tests/zoo/kernel_nnx.py`'s Llama (d 4096, 32 query and 8 key/value heads
of 128, MLP 14336, vocab 128256, bf16 activations) with its attention a splash kernel
(causal, grouped-query heads, segment ids, `residual_checkpoint_name="context"`, as
MaxText calls it), jax.nn.dot_product_attention's cuDNN kernel or its XLA path, or the
same attention written as einsums. Per sequence length,
attention and policy (none, full, minimal, minimal_with_context): FLOPs and the
kernels' share (`remat_kit.measure.kernels`), the peak per chip, the predicted step
and the compile seconds. Compile-only: no accelerator is needed.
"""

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ("none", "full", "minimal", "maxtext:minimal_with_context")
# --attentions: the zoo model's attention settings. cudnn: jax.nn.dot_product_attention's
# cuDNN kernel (traced as remat_kit.trace.stand_in's stand-in where it cannot be built);
# xla: its XLA path (dots and a softmax).
ATTENTIONS = {"splash": {"attention": "splash"}, "einsum": {"attention": "einsum"},
              "cudnn": {"attention": "dpa", "implementation": "cudnn"},
              "xla": {"attention": "dpa", "implementation": "xla"}}
LLAMA_8B = {"vocab": 128256, "dim": 4096, "heads": 32, "kv_heads": 8, "head_dim": 128,
            "hidden": 14336, "dtype": "bfloat16"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqs", default="2048,8192")
    parser.add_argument("--target", default="tpu:v5p:2x2x1")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--attentions", default="splash,einsum")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    import remat_kit as rk
    from tests.zoo import kernel_nnx

    rows = []
    for seq in (int(s) for s in args.seqs.split(",")):
        for attention in args.attentions.split(","):
            model, _, _ = kernel_nnx.make(args.batch, seq, abstract=True, layers=args.layers,
                                          **ATTENTIONS[attention], **LLAMA_8B)
            work = rk.from_model.workload(model, args.batch, seq)
            start = time.perf_counter()
            records = rk.measure(work, policies=args.policies.split(","), target=args.target)
            seconds = time.perf_counter() - start
            for r in records:
                row = {"seq": seq, "attention": attention, "policy": r.names[0],
                       "flops": r.flops, "kernel_flops": r.kernel_flops or 0.0,
                       "peak_bytes": r.memory_bytes, "predicted_s": r.predicted_seconds,
                       "compile_s": r.compile_seconds, "error": r.error}
                rows.append(row)
                print(f"seq {seq:6d} {attention:7s} {row['policy']:30s} "
                      f"{(r.flops or 0) / 1e12:8.2f} TFLOP (kernels {row['kernel_flops'] / 1e12:6.2f})"
                      f" peak {(r.memory_bytes or 0) / 2**30:7.2f} GiB"
                      f" step {(r.predicted_seconds or 0) * 1e3:8.1f} ms"
                      f" compile {r.compile_seconds or 0:6.1f} s {r.error or ''}", flush=True)
            print(f"  {attention} at seq {seq}: {seconds:.0f} s in all", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
