"""Predicted step time against the chip's floor at Llama-2-7B width, scanned, on a TPU slice.

A Llama-2-7B-width config (Touvron et al. 2023: d 4096, 32 heads, MLP 11008,
vocab 32000; bf16 parameters and activations) with its layers in one
`nn.scan`, on `tpu:v5p:2x2x1` sharded fsdp:4, batch 4, seq 4096, compiled
ahead of time. Per policy: FLOPs per chip (every trip of the scan counted),
the time model's predicted step, and the FLOP floor it must not beat, FLOPs /
peak FLOP/s (`time_checks.floor_seconds`; the bytes the step writes, under 1
ms at the chip's bandwidth here, were checked as each policy compiled).
XLA:TPU drops the scan's trip count; priced once, the body gave `full` 30.2
ms for 32.8 TFLOP per chip, below the 71.5 ms floor. About 2-3 minutes per
policy on 2 cores.

    .venv/bin/python benchmarks/time_floor.py [--layers 4] [--policies full,minimal]
"""

import argparse

from remat_kit.api import answers
from remat_kit.measure import targets, time_model
from remat_kit.measure.time_checks import floor_seconds
from remat_kit.models import get_config, workload
from remat_kit.units import fmt_bytes

TARGET = "tpu:v5p:2x2x1"


def llama2_7b_width(layers: int):
    return get_config("llama_1b", vocab_size=32000, num_layers=layers, d_model=4096,
                      num_heads=32, num_kv_heads=32, head_dim=128, mlp_dim=11008,
                      max_len=4096, rope_theta=10000.0, param_dtype="bfloat16",
                      dtype="bfloat16", scan_layers=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--policies", default="full,minimal")
    args = parser.parse_args(argv)
    mesh = targets.make_mesh(TARGET, {"fsdp": 4})
    work = workload(llama2_7b_width(args.layers), 4, 4096, mesh=mesh)
    line = time_model.roofline(TARGET)
    print(f"{args.layers} layers, scanned, {TARGET} fsdp:4, batch 4, seq 4096, bf16")
    print("| policy | peak per chip | TFLOP per chip | predicted ms | FLOP floor ms | x floor |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in answers.measure(work, policies=args.policies.split(","), target=TARGET):
        if r.error:
            print(f"| {r.policy} | error: {r.error.splitlines()[0][:100]} | | | | |")
            continue
        floor = floor_seconds(line, r.flops, 0)
        print(f"| {', '.join(r.names)} | {fmt_bytes(r.peak_memory_in_bytes)} | "
              f"{r.flops / 1e12:.1f} | {r.predicted_seconds * 1e3:.1f} | {floor * 1e3:.1f} | "
              f"{r.predicted_seconds / floor:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
