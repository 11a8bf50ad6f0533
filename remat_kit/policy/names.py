"""The tag vocabulary: names for the values a remat policy can choose to save.

Tags are MaxText's `checkpoint_name` names where MaxText has one
(MaxText `layers/decoders.py`, `layers/attentions.py`, `layers/linears.py`),
so JAX users already know them. Other codebases' names are accepted as
aliases that expand to one or more canonical tags.
Docs: docs/policies.md.
"""

from __future__ import annotations

import fnmatch

import jax
from jax.ad_checkpoint import checkpoint_name

from remat_kit.errors import UnknownTagError

# Canonical tag -> what value it names. Order is the order values appear in a
# decoder layer; reports list tags in this order.
TAGS: dict[str, str] = {
    "decoder_layer_input": "input to a decoder layer (the residual stream) [batch, seq, embed]",
    "attn_norm": "pre-attention norm output [batch, seq, embed]",
    "query_proj": ("query projection [batch, seq, heads, head_dim], after the rotary embedding "
                   "where there is one (as MaxText tags it, layers/attentions.py)"),
    "key_proj": ("key projection [batch, seq, kv_heads, head_dim], after the rotary embedding, "
                 "before grouped-query heads are repeated"),
    "value_proj": "value projection [batch, seq, kv_heads, head_dim]",
    "kv_proj": "fused key/value projection",
    "qkv_proj": "fused query/key/value projection",
    "attn_logits": "pre-softmax attention scores [batch, heads, q_len, kv_len]",
    "attn_probs": "softmax output, after dropout if any [batch, heads, q_len, kv_len]",
    "context": "attention output before the output projection [batch, seq, heads, head_dim]",
    "out_proj": "attention output projection [batch, seq, embed]",
    "mlp_norm": "pre-MLP norm output [batch, seq, embed]",
    "mlpwi": "MLP input projection (ungated) [batch, seq, mlp]",
    "mlpwi_0": "gated MLP gate projection [batch, seq, mlp]",
    "mlpwi_1": "gated MLP up projection [batch, seq, mlp]",
    "mlp_act": "MLP activation output [batch, seq, mlp]",
    "mlpwo": "MLP output projection [batch, seq, embed]",
    # A mixture of experts' values, as MaxText's layers/moe.py names them (its sparse path:
    # the routed tokens sorted by expert, grouped matmuls over them).
    "moe_routing_maps": ("MoE routing index maps: the top-k expert ids and the permutation "
                         "sorting the routed tokens by expert, int32 [batch x seq x top_k]"),
    "moe_x_sorted": ("MoE dispatched tokens: the routed copies of the tokens, sorted by "
                     "expert [batch x seq x top_k, embed]"),
    "moe_mlpwi_0": "MoE expert gate projection, a grouped matmul [batch x seq x top_k, mlp]",
    "moe_mlpwi_1": "MoE expert up projection, a grouped matmul [batch x seq x top_k, mlp]",
    "moe_mlpwo": "MoE expert output projection, a grouped matmul [batch x seq x top_k, embed]",
    # Expert parallelism: what the all-to-alls bring to a chip. Saving one keeps the backward
    # from sending it again (torchtitan's selective policy saves all-to-all outputs).
    "moe_dispatch": ("MoE dispatch: the routed tokens an all-to-all brings to the chip of "
                     "their expert [rows received, embed]"),
    "moe_combine": ("MoE combine: the expert outputs an all-to-all brings back to their "
                    "tokens' chip [rows sent, embed]"),
    "decoder_layer_output": "layer output [batch, seq, embed]",
}

# Alias -> (canonical tags, source). Groups (Megatron's --recompute-modules)
# expand to several tags.
ALIASES: dict[str, tuple[tuple[str, ...], str]] = {
    # Praxis (praxis/layers/transformers.py, checkpoint_name calls)
    "ffn1": (("mlpwi",), "Praxis"),
    "ffn2": (("mlpwo",), "Praxis"),
    "combined_qkv_proj": (("qkv_proj",), "Praxis"),
    "encoded": (("context",), "Praxis"),
    "transformer_layer_out": (("decoder_layer_output",), "Praxis"),
    # Megatron-LM --recompute-modules groups (megatron/training/arguments.py)
    "core_attn": (("attn_logits", "attn_probs", "context"), "Megatron"),
    "layernorm": (("attn_norm", "mlp_norm"), "Megatron"),
    "mlp": (("mlpwi", "mlpwi_0", "mlpwi_1", "mlp_act", "mlpwo"), "Megatron"),
    "moe_act": (("mlp_act",), "Megatron"),
}

# Tags that name one value in different model variants (fused or split
# projections, gated or plain MLP). Presets such as MaxText's `minimal` name
# every variant; validation accepts a variant the model lacks when the policy
# also names one it has.
VARIANTS: tuple[frozenset[str], ...] = (
    frozenset({"query_proj", "key_proj", "value_proj", "kv_proj", "qkv_proj"}),
    frozenset({"mlpwi", "mlpwi_0", "mlpwi_1", "moe_mlpwi_0", "moe_mlpwi_1"}),
    frozenset({"mlpwo", "moe_mlpwo"}),
)

# Tags saved under every policy unless a pattern names them: routing decisions are small
# integers, and a recompute of the router (bf16 logits, another fusion) may pick other
# experts on a tie than the forward did, so the backward would route its gradients
# differently (marin #7024: 2,698 of 2,732 assignments changed).
KEPT: tuple[str, ...] = ("moe_routing_maps",)

# Names added with register_tag(), for models with values outside the vocabulary.
_REGISTERED: set[str] = set()


def register_tag(*names: str) -> None:
    """Adds custom tag names, so specs and `tag(..., strict=True)` accept them.

    >>> import remat_kit as rk
    >>> rk.register_tag("router_logits")  # a value outside the vocabulary (an MoE router's)
    >>> str(rk.parse("save:router_logits"))
    'save:router_logits'

    Raises:
      ValueError: a name is empty, holds a glob character, or is an alias.
    """
    for name in names:
        if (not isinstance(name, str) or not name or name != name.strip()
                or any(c in name for c in "*?[],;|: \t\n")):
            raise ValueError(f"cannot register tag {name!r}: it must be a non-empty string "
                             "without whitespace or any of * ? [ ] , ; | :")
        if name in ALIASES:
            raise ValueError(f"cannot register tag {name!r}: it is an alias of {ALIASES[name][0]}")
        _REGISTERED.add(name)


def register_emitted(names) -> tuple[str, ...]:
    """Registers the names a model gives its own values (`checkpoint_name`) that are
    outside the vocabulary, so a plan may save or offload them: those that are not
    module paths (`is_path`), aliases, or names `register_tag` refuses.

    Returns:
      The names outside the vocabulary that are now registered, sorted.
    """
    own = sorted({n for n in names if isinstance(n, str) and n not in TAGS
                  and not is_path(n) and n not in ALIASES})
    for name in own:
        try:
            register_tag(name)
        except ValueError:  # a name a spec cannot hold (a glob character): never planned
            continue
    return tuple(n for n in own if n in _REGISTERED)


def known_tags() -> tuple[str, ...]:
    """The canonical vocabulary followed by registered custom tags."""
    return tuple(TAGS) + tuple(sorted(_REGISTERED - set(TAGS)))


def is_glob(pattern: str) -> bool:
    return any(c in pattern for c in "*?[")


def is_path(name: str) -> bool:
    """A path tag (or path glob), e.g. `Block_3/attn/query`: auto-tagged by module path.

    Path tags are named by `remat_kit.flax.linen_tags.auto_tag` / `flax_nnx.auto_tag`
    and are outside the vocabulary; globs over them (`*/attn/query`) are matched
    against the names a model really emits.
    """
    return "/" in name


def expand(name: str) -> tuple[str, ...]:
    """Resolves a tag, alias or glob to canonical tags of `known_tags()`.

    Returns:
      A tag, a path tag (`is_path`) or a glob resolves to itself (globs are
      matched later, against the names a function really emits); an alias to
      its canonical tags.
    Raises:
      UnknownTagError: `name` is neither a tag, a path tag, an alias, nor a
        glob that matches a known tag. The message lists the closest match.
    """
    if name in ALIASES:
        return ALIASES[name][0]
    vocab = known_tags()
    if name in vocab or (is_path(name) and not any(c in name for c in ",;|: \t\n")):
        return (name,)
    if is_glob(name) and fnmatch.filter(vocab, name):
        return (name,)
    raise UnknownTagError(name, vocab + tuple(ALIASES))


def tag(x, name: str, *, strict: bool = True):
    """Names `x` for remat policies: `jax.ad_checkpoint.checkpoint_name(x, name)`.

    >>> import jax.numpy as jnp, remat_kit as rk
    >>> rk.tag(jnp.ones((8, 8)), "mlpwi").shape  # the same value, now a policy can save it
    (8, 8)
    >>> rk.tag(jnp.ones((8, 8)), "mlp_wi")
    Traceback (most recent call last):
    remat_kit.errors.UnknownTagError: unknown tag; got 'mlp_wi'; did you mean 'mlpwi'?...

    Args:
      x: an array or pytree of arrays, any shape and dtype; returned unchanged.
      name: a canonical tag from `TAGS` (or one added with `register_tag`).
        Aliases are not accepted here: a value has one name.
      strict: if False, any non-empty name is accepted (custom tags).
    Raises:
      UnknownTagError: `strict` and `name` is not in the vocabulary; the
        message gives the closest match.
    """
    if not isinstance(name, str) or not name:
        raise UnknownTagError(repr(name), known_tags(), message="a tag name must be a "
                              "non-empty string")
    if strict and name not in known_tags():
        raise UnknownTagError(name, known_tags())
    return jax.tree.map(lambda v: checkpoint_name(v, name), x)
