"""Per-chip truth at 7B width on a 4-chip TPU slice: remat_kit's train step against a
hand-written FSDP train step of the same model, compiled ahead of time in the same run.

The model: our reference Llama (`remat_kit.models.Transformer`, a flax linen Llama with
logical axes) at Llama-2-7B width (Touvron et al. 2023: d_model 4096, 32 heads, MLP
11008, vocabulary 32000), bf16 parameters and activations, seq 4096, global batch 4,
4 layers by default (--layers 4,32 for the full depth: slow), unrolled and scanned.

For each (layers, scanned, policy):

* remat_kit: the train step `fit` and `rk.step_memory(cfg, ..., target=tpu:v5p:2x2x1,
  mesh=fsdp:4)` compile (`models.configs.train_step`, `lowering.compile_for`):
  value_and_grad, AdamW, parameters and optimizer state donated, gradients and optimizer state sharded like the
  parameters. Its FLOPs are the TPU compile's own (`loop_scaled_costs`, a scan's trip
  count read from its loop condition, `remat_kit.measure.loops`), and its predicted step
  the time model's (`time_model.compiled_seconds`) beside the floor the chip allows
  (FLOPs over its peak FLOP/s);
* hand-written: as a training codebase writes it (the Flax SPMD guide's recipe):
  boxed parameters from `jax.eval_shape(model.init)`, the AdamW state of the boxed
  parameters, their `NamedSharding`s by the logical rules, and
  `jax.jit(train_step, in_shardings, out_shardings, donate_argnums=(0, 1))`, traced
  under the mesh's rules, `.trace(...).lower(lowering_platforms=("tpu",)).compile()`.

Printed: per-chip peak (the TPU compiler's `peak_memory_in_bytes`), FLOPs per chip
(loops counted per trip), remat_kit's predicted step and the chip's floor, compile
seconds, and the process's peak resident memory at the end.

`--pods`: Llama-2-70B shapes (Touvron et al. 2023: d_model 8192, 64 heads, 8 key/value
heads, MLP 28672, vocabulary 32000, 80 layers scanned, bf16) on a 64-chip v5p slice
(`tpu:v5p:4x4x4`) over fsdp:16 x tensor:4, and on two such slices
(`tpu:v5p:4x4x4:slices=2`: the same mesh within each slice, data:2 across them, the
gradient all-reduce over the data-center network in the predicted step), seq 4096,
global batch 16 a slice; remat_kit's train step only, with the process's resident
memory after each row.

    PYTHONPATH=. .venv/bin/python benchmarks/scale.py [--layers 4] [--policies full,minimal]
        [--stacks unrolled,scanned]
    PYTHONPATH=. .venv/bin/python benchmarks/scale.py --pods [--policies full,minimal]
"""

import argparse
import resource
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from remat_kit import mesh as rk_mesh
from remat_kit.decide import step as stepping
from remat_kit.measure import lowering, targets, time_model
from remat_kit.measure.costs import loop_scaled_costs
from remat_kit.models import Transformer, TransformerConfig, make_loss_fn
from remat_kit.api.configs import train_step

TARGET = "tpu:v5p:2x2x1"
BATCH, SEQ = 4, 4096


def config(layers: int, scan: bool, policy: str) -> TransformerConfig:
    """Llama-2-7B width, bf16, `layers` deep."""
    return TransformerConfig(family="llama", vocab_size=32000, num_layers=layers,
                             d_model=4096, num_heads=32, num_kv_heads=32, mlp_dim=11008,
                             max_len=SEQ, dtype="bfloat16", param_dtype="bfloat16",
                             remat=policy, scan_layers=scan)


def ours(cfg: TransformerConfig, policy: str, mesh, target=TARGET, batch=BATCH) -> tuple:
    """(StepMemory, FLOPs per chip or None, predicted seconds) of remat_kit's train step."""
    made = train_step(cfg, batch, SEQ, policy, mesh=mesh)
    c = lowering.compile_for(made.step, *made.args, target=target,
                             donate=stepping.TrainStep.DONATED, compile_only=False)
    found, notes = loop_scaled_costs(c.compiled)
    seconds = time_model.compiled_seconds(c.compiled, targets.parse_target(target).roofline)
    return stepping.step_figures(c, made.args), None if notes else found.get("flops"), seconds


def hand_written(cfg: TransformerConfig, mesh) -> tuple[dict, float | None, float]:
    """(memory figures, FLOPs per chip or None, seconds) of a hand-written FSDP train step."""
    start = time.perf_counter()
    model, optimizer = Transformer(cfg), optax.adamw(1e-4)
    boxed = jax.eval_shape(model.init, jax.random.key(0),
                           jax.ShapeDtypeStruct((1, SEQ), jnp.int32))["params"]
    boxed_state = jax.eval_shape(optimizer.init, boxed)  # optax keeps the boxes on mu, nu
    p_sh, o_sh = rk_mesh.shardings(boxed, mesh), rk_mesh.shardings(boxed_state, mesh)
    b_sh, whole = rk_mesh.batch_sharding(mesh), rk_mesh.replicated(mesh)
    loss = make_loss_fn(model)

    def train_step(params, opt_state, inputs, targets_, key):
        value, grads = jax.value_and_grad(loss)(params, inputs, targets_, key)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    def struct(x, s):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)

    tokens = struct(jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32), b_sh)
    args = (jax.tree.map(struct, nn.unbox(boxed), p_sh),
            jax.tree.map(struct, nn.unbox(boxed_state), o_sh), tokens, tokens,
            struct(jax.eval_shape(lambda: jax.random.key(0)), whole))
    step = jax.jit(train_step, in_shardings=(p_sh, o_sh, b_sh, b_sh, whole),
                   out_shardings=(p_sh, o_sh, whole), donate_argnums=(0, 1))
    with rk_mesh.use(mesh):  # the model's activation constraints, as its training run traces
        compiled = step.trace(*args).lower(lowering_platforms=("tpu",)).compile()
    seconds = time.perf_counter() - start
    m = compiled.memory_analysis()
    found, notes = loop_scaled_costs(compiled)
    return ({"peak": m.peak_memory_in_bytes, "argument": m.argument_size_in_bytes,
             "output": m.output_size_in_bytes, "temp": m.temp_size_in_bytes},
            None if notes else found.get("flops"), seconds)


def pods(policies: list[str]) -> None:
    """The Llama-2-70B rows: one and two 64-chip v5p slices (see the module's doc)."""
    gib = 2.0 ** 30
    print("| target | mesh | policy | peak GiB | TFLOP | pred. s | compile s | resident GiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for target in ("tpu:v5p:4x4x4", "tpu:v5p:4x4x4:slices=2"):
        found = targets.parse_target(target)
        mesh = targets.make_mesh(found, {"fsdp": 16, "tensor": 4})
        for policy in policies:
            cfg = TransformerConfig(family="llama", vocab_size=32000, num_layers=80,
                                    d_model=8192, num_heads=64, num_kv_heads=8,
                                    mlp_dim=28672, max_len=SEQ, dtype="bfloat16",
                                    param_dtype="bfloat16", remat=policy, scan_layers=True)
            step, flops, predicted = ours(cfg, policy, mesh, target, 16 * found.slices)
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
            print(f"| {target} | {rk_mesh.spec_text(mesh)} | {policy} | "
                  f"{step.total_bytes / gib:.2f} | "
                  f"{'n/a' if flops is None else f'{flops / 1e12:.1f}'} | {predicted:.2f} | "
                  f"{step.compile_seconds:.1f} | {rss:.2f} |", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", default="4", help="comma-separated depths (32: slow)")
    parser.add_argument("--policies", default="full,minimal")
    parser.add_argument("--stacks", default="unrolled,scanned")
    parser.add_argument("--pods", action="store_true",
                        help="the Llama-2-70B rows on one and two 64-chip v5p slices")
    args = parser.parse_args()
    if args.pods:
        return pods(args.policies.split(","))
    mesh = targets.make_mesh(TARGET, {"fsdp": 4})
    gib = 2.0 ** 30
    peak_flops = time_model.roofline(TARGET).bf16_flops
    print(f"| layers | stack | policy | remat_kit peak GiB | hand peak GiB | peak ratio | "
          f"remat_kit TFLOP | hand TFLOP | pred. ms | floor ms | remat_kit s | hand s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for layers in map(int, args.layers.split(",")):
        for scan in (s == "scanned" for s in args.stacks.split(",")):
            for policy in args.policies.split(","):
                cfg = config(layers, scan, policy)
                step, flops, predicted = ours(cfg, policy, mesh)
                hand, hand_flops, hand_s = hand_written(cfg, mesh)
                tflop = lambda f: "n/a" if f is None else f"{f / 1e12:.2f}"  # noqa: E731
                print(f"| {layers} | {'scanned' if scan else 'unrolled'} | {policy} | "
                      f"{step.total_bytes / gib:.2f} | {hand['peak'] / gib:.2f} | "
                      f"{step.total_bytes / hand['peak']:.4f} | {tflop(flops)} | "
                      f"{tflop(hand_flops)} | {predicted * 1e3:.1f} | "
                      f"{'n/a' if flops is None else f'{flops / peak_flops * 1e3:.1f}'} | "
                      f"{step.compile_seconds:.1f} | {hand_s:.1f} |",
                      flush=True)
                print(f"  remat_kit: argument {step.argument_size_in_bytes / gib:.2f} GiB, "
                      f"output {step.output_size_in_bytes / gib:.2f}, temp "
                      f"{step.temp_size_in_bytes / gib:.2f}; hand: argument "
                      f"{hand['argument'] / gib:.2f}, output {hand['output'] / gib:.2f}, "
                      f"temp {hand['temp'] / gib:.2f}", flush=True)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"peak resident memory of this process: {rss:.2f} GiB")


if __name__ == "__main__":
    main()
