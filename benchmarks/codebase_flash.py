"""MaxText's own flash attention (splash in its own kernel wrapper) priced against the causal count.

    PYTHONPATH=$PWD ALLOW_MULTIPLE_LIBTPU_LOAD=1 ~/mt-venv/bin/python benchmarks/codebase_flash.py \
        [--targets tpu:v5p:2x2x1,tpu:v5p:1x1x1] [--emb 256] [--layers 2] [--seq 2048] \
        [--per-device-batch 1] [--policies none,full] [--scan|--no-scan]

MaxText's llama2 decoder (`benchmarks/codebase_mesh.build`, `attention=flash`) built over each
target's own chips, as its ahead-of-time compile builds it (its attention picks splash from its
mesh's platform), fsdp over all of them; measured by `rk.measure` per chip. MaxText makes the
splash kernel inside a `jax.jit` with the mask static, constrains the mask's arrays to its mesh
and hands them to a `shard_map` (`attention_op.tpu_flash_attention`). Per row: the kernels'
FLOPs (`Record.kernel_flops`) beside the causal count, each kernel call priced at the causal
block count n(n+1)/2 of n x n blocks (`sa_block_q` = `sa_block_kv` = 512), FlashAttention-2's
matmuls (forward 1, dq 1.5, dk/dv 2 forwards: docs/targets.md), 4 b h s^2 d FLOPs a forward
unmasked, b the chip's batch; the kernel calls counted from the record's note.

Measured (libtpu 0.0.52, MaxText 0.2.5, a loaded 2-core machine), kernels / causal per chip:
emb 256 (2 heads of 128), 2 layers scanned, seq 2048, 1 per chip: tpu:v5p:2x2x1 (fsdp:4) none
24.159 / 24.159 GFLOP (fwd x2, dq x2, dkv x2), full 29.528 / 29.528 (fwd x4); tpu:v5p:1x1x1
the same, 1.000 each. emb 1024, seq 4096 (8 x 8 blocks), 2 layers, tpu:v5p:2x2x1, none:
425.202 / 425.202 (fwd x4: no layers found at that width, MaxText's own remat kept); with a
scanned stack's layer axis read anywhere in its shape (its layers found, MaxText's remat taken
over): none 347.892 / 347.892 (fwd x2), full and minimal 425.202 / 425.202 (fwd x4: minimal
keeps no `context`, so the forward reruns).
Needs `maxtext` and libtpu (see benchmarks/vs_estimator.py); where either is missing, one line
and exit 2. Not in CI.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

if __name__ == "__main__":  # before JAX starts: the host devices MaxText's config counts
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=4").strip()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import codebase_mesh  # noqa: E402

BLOCK = 512  # MaxText's sa_block_q and sa_block_kv (configs/base.yml)
# FlashAttention-2's matmuls per splash kernel, in forwards (remat_kit.measure.kernels).
ROLES = {"fwd": 1.0, "dq": 1.5, "dkv": 2.0}
_CALLS = re.compile(r"splash_m[hq]a_(fwd|dq|dkv)\w* x(\d+)")


def causal_forward(chip_batch: int, heads: int, seq: int, head_dim: int) -> float:
    """FLOPs of one splash forward at the causal block count: 4 b h s^2 d x n(n+1)/2 / n^2,
    n = seq / BLOCK blocks along each side."""
    n = max(1, seq // min(BLOCK, seq))
    return 4.0 * chip_batch * heads * seq * seq * head_dim * (n * (n + 1) / 2) / (n * n)


def kernel_calls(notes) -> dict[str, int]:
    """{"fwd" | "dq" | "dkv": calls} of the splash kernels a record's notes list."""
    calls: dict[str, int] = {}
    for note in notes:
        for kind, n in _CALLS.findall(note):
            calls[kind] = calls.get(kind, 0) + int(n)
    return calls


def priced(size: dict, target: str, policy: str) -> dict:
    """remat-kit's record of MaxText's flash decoder built over `target`'s chips:
    {"kernels": its kernel FLOPs per chip, "causal": the causal count, "calls", "flops",
    "masked": any note saying a mask was not read}."""
    import remat_kit as rk
    from remat_kit.measure import targets
    chips = targets.devices(target)
    size = {**size, "fsdp": len(chips), "policy": policy, "attention": "flash"}
    model = codebase_mesh.build(size, chips)
    batch = size["per_device_batch"] * len(chips)
    (rec,) = rk.measure(rk.from_model.workload(model, batch, size["seq"]), policies=[policy],
                        target=target)
    calls = kernel_calls(rec.notes)
    heads = size["emb"] // 128
    once = causal_forward(size["per_device_batch"], heads, size["seq"], 128)
    return {"kernels": rec.kernel_flops, "flops": rec.flops, "calls": calls,
            "causal": once * sum(ROLES[k] * n for k, n in calls.items()),
            "unread": [n for n in rec.notes if "not read" in n], "error": rec.error}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--targets", default="tpu:v5p:2x2x1,tpu:v5p:1x1x1")
    for key, default in (("emb", 256), ("layers", 2), ("seq", 2048), ("per_device_batch", 1)):
        ap.add_argument(f"--{key.replace('_', '-')}", type=int, default=default)
    ap.add_argument("--scan", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--policies", default="none,full")
    args = ap.parse_args()
    if (why := codebase_mesh.missing()) is not None:
        print(f"codebase_flash: {why}; nothing priced", file=sys.stderr)
        return 2
    size = dict(codebase_mesh.DEFAULTS, emb=args.emb, layers=args.layers, seq=args.seq,
                per_device_batch=args.per_device_batch, scan=args.scan)
    shown = {k: v for k, v in size.items() if k not in ("fsdp", "attention", "policy")}
    print(f"MaxText llama2 decoder, attention=flash, {shown}, fsdp over every chip; per chip")
    print(f"{'target':15} {'policy':7} {'kernel calls':28} {'kernels GF':>11} "
          f"{'causal GF':>10} {'ratio':>6}  mask")
    for target in args.targets.split(","):
        for policy in args.policies.split(","):
            r = priced(size, target, policy)
            if r["error"]:
                print(f"{target:15} {policy:7} error: {r['error'][:200]}")
                continue
            calls = " ".join(f"{k} x{n}" for k, n in sorted(r["calls"].items()))
            print(f"{target:15} {policy:7} {calls:28} {r['kernels'] / 1e9:11.3f} "
                  f"{r['causal'] / 1e9:10.3f} {r['kernels'] / r['causal']:6.3f}  "
                  f"{'; '.join(r['unread']) or 'read'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
