"""Step time of `experiments.train --model` under `minimal` against the same model wrapped by hand.

The model is the zoo GPT (tests/zoo/gpt_linen.py) at a byte vocab. `experiments.train --model`'s
step is `train.make_train_step` of `own_model.OwnModel.loss_fn()` (the model under
`rk.remat_model(model, "minimal")`). The hand-wrapped form is what a JAX user writes without
remat_kit: `Block = nn.remat(Block, policy=jax.checkpoint_policies.save_only_these_names(...))`
(flax's lifted `jax.checkpoint` over each block) in a copy of the model's module, with
`checkpoint_name` on the module outputs that compare's `minimal` saves on this model
(`remat-kit explain --model tests/zoo/gpt_linen.py:model --policy minimal`: qkv_proj = c_attn,
out_proj = the attention's c_proj, mlpwi = c_fc; mlpwo = the MLP's output, which minimal names
but the backward pass does not need). Both run train's optimizer
(`train_setup.make_optimizer` of the tiny config: clipped AdamW, warmup-cosine) in a
`TrainState`, jitted with the state donated as train does, on the same parameters and batch.

The forms take turns step by step (which goes first swaps each step), --steps steps each
after one warm-up step each, so a shared machine's load falls on both alike; the
report gives each form's median step, the ratio of medians, the median of the paired steps'
ratios and the ratio of the fastest steps, the two programs' compiled temp bytes and FLOPs, and the first loss of each (equal where
the programs compute the same function).

    PYTHONPATH=. python benchmarks/train_step_time.py [--batch 4] [--seq 128] [--embed 128] \
        [--layers 4] [--heads 4] [--steps 100]
"""

import argparse
import collections
import importlib.util
import os
import re
import statistics
import sys
import time

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, REPO)

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax.training import train_state  # noqa: E402
from jax.ad_checkpoint import checkpoint_name  # noqa: E402

import remat_kit as rk  # noqa: E402
from experiments import own_model, train, train_setup  # noqa: E402
from experiments.configs import tiny  # noqa: E402
from remat_kit.flax import from_model  # noqa: E402

ZOO = os.path.join(REPO, "tests", "zoo", "gpt_linen.py")
# The tag a hand-written model puts on each module's output (by module name), as minimal names it.
TAGS = {"c_attn": "qkv_proj", "c_proj": "out_proj", "c_fc": "mlpwi", "mlp": "mlpwo"}


def _module_copy(name: str):
    """tests/zoo/gpt_linen.py loaded afresh as module `name`, to be edited by hand."""
    spec = importlib.util.spec_from_file_location(name, ZOO)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def _tag(next_fun, args, kwargs, context):
    """The hand-written model's checkpoint_name on each TAGS module's output."""
    out = next_fun(*args, **kwargs)
    name = TAGS.get(context.module.name) if context.method_name == "__call__" else None
    return checkpoint_name(out, name) if name else out


def _hand_loss(model):
    """loss(params, inputs, targets, rng) of the hand-tagged model: compare's next-token
    loss, as own_model's."""
    def loss(params, inputs, targets, rng):
        del targets, rng
        with nn.intercept_methods(_tag):
            out = model.apply({"params": params}, inputs)
        return from_model.next_token_loss(from_model.logits_of(out, *inputs.shape), inputs)
    return loss


def _opcodes(compiled) -> collections.Counter:
    """How many instructions of each opcode the optimized HLO holds (names and source
    locations differ between the forms; the instructions of one program do not)."""
    return collections.Counter(re.findall(r"=\s+\S+\s+([a-z][a-z\-]*)\(", compiled.as_text()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for flag, default in (("batch", 4), ("seq", 128), ("embed", 128), ("layers", 4),
                          ("heads", 4), ("steps", 100)):
        parser.add_argument(f"--{flag}", type=int, default=default)
    args = parser.parse_args()
    b, s = args.batch, args.seq
    ours_zoo, hand_zoo = _module_copy("gpt_linen_ours"), _module_copy("gpt_linen_by_hand")
    cfg = dict(vocab=256, layers=args.layers, embed=args.embed, heads=args.heads, max_len=s)
    model = ours_zoo.GPT(ours_zoo.GPTConfig(**cfg))
    names = [TAGS[m] for m in ("c_attn", "c_proj", "c_fc", "mlp")]
    hand_zoo.Block = nn.remat(  # the user's edit: each block under flax's jax.checkpoint
        hand_zoo.Block, policy=jax.checkpoint_policies.save_only_these_names(*names))
    hand = hand_zoo.GPT(hand_zoo.GPTConfig(**cfg))

    config = tiny.get_config()
    config.update(dict(batch_size=b, seq_len=s))
    tx, _ = train_setup.make_optimizer(config)
    workload = rk.from_model.workload(model, b, s)
    own = own_model.OwnModel("gpt_linen", model, workload, "minimal", "minimal", 256)
    forms = {"experiments.train --model (rk.remat_model)": own.loss_fn(),
             "by hand (nn.remat + save_only_these_names)": _hand_loss(hand)}

    tokens = np.random.default_rng(0).integers(0, 256, (b, s), dtype=np.int32)
    params = jax.jit(model.init)(jax.random.key(0), tokens[:1])["params"]
    rng = jax.random.key(1)
    states, steps, stats, first = {}, {}, {}, {}
    for name, loss in forms.items():
        states[name] = train_state.TrainState.create(apply_fn=None, params=jax.tree.map(
            np.array, params), tx=tx)
        steps[name] = jax.jit(train.make_train_step(loss, True), donate_argnums=0).lower(
            states[name], tokens, tokens, rng).compile()
        stats[name] = train._compiled_stats(steps[name])
        states[name], loss0 = steps[name](states[name], tokens, tokens, rng)  # warm-up
        first[name] = float(loss0)

    # One step of each in turn (the first swapping each step), so both meet the same load.
    seconds = {name: [] for name in forms}
    order = list(forms)
    for i in range(args.steps):
        for name in order if i % 2 == 0 else order[::-1]:
            t0 = time.perf_counter()
            states[name], loss = steps[name](states[name], tokens, tokens, rng)
            loss.block_until_ready()
            seconds[name].append(time.perf_counter() - t0)

    print(f"gpt_linen vocab 256, {args.layers} layers, embed {args.embed}, heads {args.heads}; "
          f"batch {b}, seq {s}; train step (clipped AdamW) under minimal; {args.steps} steps "
          f"per form, taking turns; {jax.devices()[0].device_kind}")
    medians = {name: statistics.median(t) for name, t in seconds.items()}
    for name, t in seconds.items():
        st = stats[name]
        print(f"  {name:44s} median {1e3 * medians[name]:7.2f} ms (min {1e3 * min(t):.2f}, "
              f"max {1e3 * max(t):.2f}); temp {st['temp_size_in_bytes']:,} B, "
              f"FLOPs {st['flops']:,.0f}; first loss {first[name]:.7f}")
    ours, by_hand = medians.values()
    paired = statistics.median(x / y for x, y in zip(*seconds.values()))
    (a, b_) = stats.values()
    ops = [_opcodes(c) for c in steps.values()]
    print(f"  ratio experiments.train / by hand: {ours / by_hand:.3f} (of medians), {paired:.3f} "
          f"(median of the {len(seconds[order[0]])} paired steps), "
          f"{min(seconds[order[0]]) / min(seconds[order[1]]):.3f} (of minima)")
    print(f"  compiled: temp "
          f"{'equal' if a['temp_size_in_bytes'] == b_['temp_size_in_bytes'] else 'differs'}, "
          f"FLOPs {'equal' if a['flops'] == b_['flops'] else 'differ'} "
          f"({a['flops'] / b_['flops']:.4f}x); optimized HLO {sum(ops[0].values()):,} and "
          f"{sum(ops[1].values()):,} instructions, "
          + ("the same count of every opcode" if ops[0] == ops[1] else "opcode counts differ: "
             + str({k: (ops[0][k], ops[1][k]) for k in ops[0] | ops[1] if ops[0][k] != ops[1][k]})))


if __name__ == "__main__":
    main()
