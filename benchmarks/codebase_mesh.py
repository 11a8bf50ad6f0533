"""MaxText's own decoder over its own mesh, per chip, beside MaxText's own compile of the same step.

    PYTHONPATH=$PWD ALLOW_MULTIPLE_LIBTPU_LOAD=1 ~/mt-venv/bin/python benchmarks/codebase_mesh.py \
        [--target tpu:v5p:2x2x1] [--emb 1024] [--layers 2] [--seq 1024] [--per-device-batch 2] \
        [--policies full,minimal,none] [--attention dot_product] [--fsdp 4] [--tensor 1] \
        [--mlp 0] [--heads 0] [--scan|--no-scan] [--out runs/codebase_mesh]

For each policy (MaxText's `remat_policy`): MaxText's llama2 decoder built as
docs/recipes (`create_nnx_abstract_model` over its own 12-axis mesh, fsdp over the chips) and
measured by remat-kit's train step (`rk.step_memory`, AdamW: the step MaxText trains), beside
MaxText's own ahead-of-time compile of its train step (`maxtext.trainers.pre_train.
train_compile`, in a child process, its compiled executable read with the same functions:
`memory_fields`, `loop_scaled_costs`, so a scanned stack's FLOPs count every layer on both
sides). Per chip: arguments, FLOPs, peak; the ratio ours / MaxText's; compile seconds.

Flags: `--tensor N` adds MaxText's `ici_tensor_parallelism` (chips = fsdp x tensor, the global
batch per_device_batch x chips, as MaxText counts it); `--mlp`, `--heads` set the width (0:
4 x emb, emb / 128). One JSON per configuration in `--out`. Measured figures: docs/meshes.md
("MaxText itself, per chip"). The peak was 0.125 GiB high under every policy until the
next-token loss took the label's logit by a one-hot contraction (as MaxText's loss does): the
gather of `optax.softmax_cross_entropy_with_integer_labels` ran on the SparseCore from a float32
copy of the logits of its own.

The model is built over this machine's host devices (64 made here, fsdp x tensor used), its mesh rebuilt on the
target's chips as `--model` does. Needs `maxtext` 0.2.5 and libtpu (a scratch venv: see
benchmarks/vs_estimator.py); where either is missing, one line and exit 2. Not in CI.
`model()` is the same decoder for `remat-kit compare --model benchmarks/codebase_mesh.py:model`
(sizes from CODEBASE_MESH_* environment variables, the defaults below).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time

if __name__ == "__main__" or os.environ.get("CODEBASE_MESH_HOST"):  # before JAX starts
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")  # up to a 64-chip mesh
                               + " --xla_force_host_platform_device_count=64").strip()

DEFAULTS = {"emb": 1024, "layers": 2, "seq": 1024, "per_device_batch": 2, "fsdp": 4,
            "tensor": 1, "mlp": 0, "heads": 0, "attention": "dot_product", "scan": True,
            "policy": "full"}
SIZES = ("emb", "layers", "seq", "per_device_batch", "fsdp", "tensor", "mlp", "heads")


def missing() -> str | None:
    """What is not installed that the comparison needs, or None."""
    for module in ("maxtext", "libtpu"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed (a scratch venv: benchmarks/vs_estimator.py)"
    return None


def overrides(size: dict) -> dict:
    """MaxText config values of the llama2 decoder at `size` (DEFAULTS' keys): heads of 128
    (`heads` 0: emb / 128), MLP `mlp` (0: 4 x emb), vocab 32000, bf16 activations, f32
    weights, synthetic data, fsdp x tensor chips."""
    emb = size["emb"]
    heads = size["heads"] or emb // 128
    return dict(model_name="default", decoder_block="llama2", override_model_config=True,
                base_num_decoder_layers=size["layers"], base_emb_dim=emb,
                base_mlp_dim=size["mlp"] or 4 * emb, base_num_query_heads=heads,
                base_num_kv_heads=heads, head_dim=emb // heads,
                vocab_size=32000, max_target_length=size["seq"],
                per_device_batch_size=size["per_device_batch"], dtype="bfloat16",
                weight_dtype="float32", attention=size["attention"],
                scan_layers=size["scan"], remat_policy=size["policy"],
                ici_fsdp_parallelism=size["fsdp"], ici_tensor_parallelism=size["tensor"],
                dataset_type="synthetic",
                enable_checkpointing=False, steps=1)


def _base() -> str:
    import maxtext
    return os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")


def build(size: dict, devices):
    """MaxText's abstract NNX Transformer over its own mesh of `devices`, wrapped to map
    int32 tokens [batch, seq] to logits (positions 0..seq-1, one segment)."""
    import jax.numpy as jnp
    from flax import nnx
    from maxtext.configs import pyconfig
    from maxtext.utils import maxtext_utils, model_creation_utils

    class Decoder(nnx.Module):
        def __init__(self, inner):
            self.inner = inner

        def __call__(self, tokens):
            b, s = tokens.shape
            positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
            return self.inner(tokens, positions, decoder_segment_ids=jnp.ones((b, s), jnp.int32),
                              enable_dropout=False)

    cfg = pyconfig.initialize([None, _base()], run_name="codebase_mesh", hardware="tpu",
                              skip_jax_distributed_system=True, **overrides(size))
    mesh = maxtext_utils.get_mesh_from_config(cfg, devices)
    _, abstract = model_creation_utils.create_nnx_abstract_model(cfg, mesh)
    return Decoder(abstract)


def model():
    """For `--model benchmarks/codebase_mesh.py:model` (run with CODEBASE_MESH_HOST=1 so that
    4 host devices are made): sizes from CODEBASE_MESH_<KEY> (DEFAULTS' keys, upper case)."""
    import jax
    size = {k: type(v)(os.environ.get(f"CODEBASE_MESH_{k.upper()}", v)) if not isinstance(v, bool)
            else os.environ.get(f"CODEBASE_MESH_{k.upper()}", str(v)).lower() == "true"
            for k, v in DEFAULTS.items()}
    return build(size, jax.devices()[:size["fsdp"] * size["tensor"]])


def ours(size: dict, target: str) -> dict:
    """remat-kit's train step of MaxText's decoder built with `size` (its policy)."""
    import jax
    import remat_kit as rk
    start = time.perf_counter()
    chips = size["fsdp"] * size["tensor"]  # MaxText's global batch counts every chip
    batch = size["per_device_batch"] * chips
    work = rk.from_model.workload(build(size, jax.devices()[:chips]), batch, size["seq"])
    step = rk.step_memory(work, batch, size["seq"], size["policy"], target=target)
    return {"arguments": step.argument_size_in_bytes, "flops": step.flops,
            "peak": step.peak_memory_in_bytes, "seconds": time.perf_counter() - start,
            "placement": work.placement, "map": work.model_map.lines()[0]}


def maxtext_side(size: dict, topology: str) -> dict:
    """MaxText's own train_compile of the same step, in this process; its executable read
    as ours is (`memory_fields`, `loop_scaled_costs`)."""
    from maxtext.trainers.pre_train import train_compile
    from remat_kit.measure.costs import loop_scaled_costs, memory_fields
    caught = []
    compile_step = train_compile.jit_and_compile

    def keep(*args, **kwargs):
        caught.append(compile_step(*args, **kwargs))
        return caught[-1]

    train_compile.jit_and_compile = keep  # its own compile, kept to be read here
    start = time.perf_counter()
    train_compile.main([None, _base(), f"compile_topology={topology}",
                        "compile_topology_num_slices=1", "run_name=codebase_mesh",
                        *(f"{k}={v}" for k, v in overrides(size).items())])
    memory = memory_fields(caught[-1])
    return {"arguments": memory["argument_size_in_bytes"],
            "flops": loop_scaled_costs(caught[-1])[0]["flops"],
            "peak": memory["peak_memory_in_bytes"], "seconds": time.perf_counter() - start}


def topology_of(target: str) -> str:
    """MaxText's compile_topology for a remat-kit TPU target: tpu:v5p:2x2x1 -> v5p-8
    (v5p counts 2 cores a chip)."""
    _, chip, shape = target.split(":")
    chips = 1
    for n in shape.split("x"):
        chips *= int(n)
    return f"{chip}-{chips * 2 if chip == 'v5p' else chips}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="tpu:v5p:2x2x1")
    for key in SIZES:
        ap.add_argument(f"--{key.replace('_', '-')}", type=int, default=DEFAULTS[key])
    ap.add_argument("--attention", default=DEFAULTS["attention"])
    ap.add_argument("--scan", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--policies", default="full,minimal,none")
    ap.add_argument("--out", default="runs/codebase_mesh")
    ap.add_argument("--side", choices=("maxtext",), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--policy", default="full", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if (why := missing()) is not None:
        print(f"codebase_mesh: {why}; nothing compared", file=sys.stderr)
        return 2
    size = {k: getattr(args, k) for k in DEFAULTS if k != "policy"}
    if args.side == "maxtext":  # the child: MaxText's own compile, one JSON line
        print("CODEBASE_MESH " + json.dumps(maxtext_side({**size, "policy": args.policy},
                                                         topology_of(args.target))))
        return 0
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for policy in args.policies.split(","):
        child = subprocess.run(
            [sys.executable, __file__, "--side", "maxtext", "--policy", policy,
             "--target", args.target, "--attention", args.attention,
             "--scan" if args.scan else "--no-scan",
             *(f"--{k.replace('_', '-')}={size[k]}" for k in SIZES)],
            capture_output=True, text=True)
        line = next((x for x in child.stdout.splitlines() if x.startswith("CODEBASE_MESH ")),
                    None)
        if line is None:
            print(f"codebase_mesh: MaxText's compile of {policy} failed: {child.stderr[-2000:]}",
                  file=sys.stderr)
            return 1
        theirs = json.loads(line.split(" ", 1)[1])
        mine = ours({**size, "policy": policy}, args.target)
        rows.append({"policy": policy, "ours": mine, "maxtext": theirs})
        name = "-".join([args.target.replace(":", "_"), *(f"{k}{size[k]}" for k in SIZES),
                         args.attention, "scan" if args.scan else "noscan"])
        with open(os.path.join(args.out, name + ".json"), "w") as f:
            json.dump({"size": size, "target": args.target, "rows": rows}, f, indent=2)
    print(f"MaxText llama2 decoder, {size}, on {args.target}; per chip, ours / MaxText's")
    print(f"placement: {rows[0]['ours']['placement']}; model map: {rows[0]['ours']['map']}")
    print(f"{'policy':8} {'arguments':>24} {'FLOPs':>30} {'peak':>24} {'compile s':>12}")
    for r in rows:
        a, b = r["ours"], r["maxtext"]
        cell = lambda k, unit, d: (f"{a[k] / d:.3f}/{b[k] / d:.3f}{unit} "  # noqa: E731
                                   f"{a[k] / b[k]:.3f}")
        print(f"{r['policy']:8} {cell('arguments', 'GB', 1e9):>24} "
              f"{cell('flops', 'TF', 1e12):>30} {cell('peak', 'GiB', 2 ** 30):>24} "
              f"{a['seconds']:5.0f}/{b['seconds']:<5.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
