"""A Llama in flax.linen, written the way Hugging Face transformers writes its Flax models.

Our own code in that library's layout: a causal-LM module around a base model
module, which holds a block collection module (its only job: own the decoder
layers, named "0", "1", ..., and loop over them); `setup`-style modules; a
`Conv1D` layer as their GPT-2 has (kernel [features, in], applied by a
transposed `lax.dot_general`, plus bias) for the fused query/key/value;
`attention_mask` and `position_ids` as inputs, built inside when None, the
padding mask combined with the causal one (`nn.make_causal_mask`,
`nn.combine_masks`) into an additive bias; rotary embedding gathered from a
numpy sin/cos table by position_ids; grouped-query attention (keys and values
repeated per query group); an RMSNorm class of its own (variance in float32);
attention weights from `flax.linen.attention.dot_product_attention_weights`
with a dropout rate and `deterministic`; a SwiGLU MLP; decoder layers that
return a tuple, called with keyword arguments; a config dataclass and an
output dataclass with `.logits`.

input_ids int32 [batch, seq], attention_mask int32 [batch, seq] (1 = token,
0 = padding), position_ids int32 [batch, seq] -> CausalLMOutput(logits float32
[batch, seq, vocab]).
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax.linen.attention import dot_product_attention_weights


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 64
    hidden_size: int = 32
    intermediate_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 64
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    attention_dropout: float = 0.1
    initializer_range: float = 0.02
    fused_qkv: bool = True  # False: q_proj, k_proj, v_proj (nn.Dense), as their Llama has

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@flax.struct.dataclass
class CausalLMOutput:
    logits: jax.Array


def sincos_table(num_pos: int, dim: int, theta: float) -> np.ndarray:
    """[num_pos, dim] float32: sin in the first half, cos in the second (a constant)."""
    inv_freq = 1.0 / theta ** (np.arange(0, dim, 2) / dim)
    angle = np.einsum("i,j->ij", np.arange(num_pos), inv_freq)
    emb = np.concatenate([angle, angle], axis=-1)
    return np.concatenate([np.sin(emb), np.cos(emb)], axis=-1).astype(np.float32)


def rotate_half(x):
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


class Conv1D(nn.Module):
    """y = x @ kernel.T + bias, kernel [features, in] (GPT-2's layout)."""

    features: int
    use_bias: bool = True

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", nn.initializers.normal(0.02), (self.features, x.shape[-1]))
        y = jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (1,)), ((), ())))
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros_init(), (self.features,))
        return y


class LlamaRMSNorm(nn.Module):
    config: LlamaConfig

    def setup(self):
        self.weight = self.param("weight", nn.initializers.ones_init(), (self.config.hidden_size,))

    def __call__(self, hidden_states):
        h = jnp.asarray(hidden_states, jnp.float32)
        variance = jnp.mean(jnp.power(h, 2), axis=-1, keepdims=True)
        h = h * jax.lax.rsqrt(variance + self.config.rms_norm_eps)
        return self.weight * h.astype(hidden_states.dtype)


class LlamaAttention(nn.Module):
    config: LlamaConfig

    def setup(self):
        c = self.config
        self.q_size = c.num_attention_heads * c.head_dim
        self.kv_size = c.num_key_value_heads * c.head_dim
        if c.fused_qkv:
            self.qkv_proj = Conv1D(self.q_size + 2 * self.kv_size)
        else:
            dense = lambda n: nn.Dense(n, use_bias=False)  # noqa: E731
            self.q_proj, self.k_proj, self.v_proj = (dense(self.q_size), dense(self.kv_size),
                                                     dense(self.kv_size))
        self.o_proj = nn.Dense(c.hidden_size, use_bias=False,
                               kernel_init=nn.initializers.normal(c.initializer_range))
        self.embed_positions = sincos_table(c.max_position_embeddings, c.head_dim, c.rope_theta)
        self.causal_mask = nn.make_causal_mask(
            jnp.ones((1, c.max_position_embeddings), bool), dtype=bool)

    def _heads(self, x, n):
        return x.reshape(x.shape[:2] + (n, self.config.head_dim))

    def __call__(self, hidden_states, attention_mask, position_ids, deterministic=True):
        c = self.config
        if c.fused_qkv:
            query, key, value = jnp.split(self.qkv_proj(hidden_states),
                                          [self.q_size, self.q_size + self.kv_size], axis=-1)
        else:
            query, key, value = (f(hidden_states) for f in (self.q_proj, self.k_proj,
                                                            self.v_proj))
        query = self._heads(query, c.num_attention_heads)
        key = self._heads(key, c.num_key_value_heads)
        value = self._heads(value, c.num_key_value_heads)

        sincos = jnp.take(self.embed_positions, position_ids, axis=0)[:, :, None, :]
        sin, cos = jnp.split(sincos, 2, axis=-1)
        query = query * cos + rotate_half(query) * sin
        key = key * cos + rotate_half(key) * sin

        groups = c.num_attention_heads // c.num_key_value_heads
        key = jnp.repeat(key, groups, axis=2)
        value = jnp.repeat(value, groups, axis=2)

        q_len, k_len = query.shape[1], key.shape[1]
        causal = jnp.broadcast_to(self.causal_mask[:, :, :q_len, :k_len],
                                  (query.shape[0], 1, q_len, k_len))
        padding = jnp.broadcast_to(attention_mask[:, None, None, :], causal.shape)
        mask = nn.combine_masks(padding, causal)
        bias = jax.lax.select(mask > 0, jnp.full(mask.shape, 0.0, query.dtype),
                              jnp.full(mask.shape, jnp.finfo(query.dtype).min, query.dtype))

        dropout_rng = None
        if not deterministic and c.attention_dropout > 0.0:
            dropout_rng = self.make_rng("dropout")
        weights = dot_product_attention_weights(
            query, key, bias=bias, dropout_rng=dropout_rng, dropout_rate=c.attention_dropout,
            deterministic=deterministic, dtype=query.dtype)
        out = jnp.einsum("...hqk,...khd->...qhd", weights, value)
        return (self.o_proj(out.reshape(out.shape[:2] + (-1,))),)


class LlamaMLP(nn.Module):
    config: LlamaConfig

    def setup(self):
        c = self.config
        dense = lambda n: nn.Dense(n, use_bias=False,  # noqa: E731
                                   kernel_init=nn.initializers.normal(c.initializer_range))
        self.gate_proj = dense(c.intermediate_size)
        self.up_proj = dense(c.intermediate_size)
        self.down_proj = dense(c.hidden_size)

    def __call__(self, hidden_states):
        return self.down_proj(nn.silu(self.gate_proj(hidden_states)) * self.up_proj(hidden_states))


class LlamaDecoderLayer(nn.Module):
    config: LlamaConfig

    def setup(self):
        self.input_layernorm = LlamaRMSNorm(self.config)
        self.self_attn = LlamaAttention(self.config)
        self.post_attention_layernorm = LlamaRMSNorm(self.config)
        self.mlp = LlamaMLP(self.config)

    def __call__(self, hidden_states, attention_mask=None, position_ids=None,
                 deterministic=True):
        attn = self.self_attn(self.input_layernorm(hidden_states), attention_mask=attention_mask,
                              position_ids=position_ids, deterministic=deterministic)
        hidden_states = hidden_states + attn[0]
        hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        return (hidden_states,) + attn[1:]


class LlamaLayerCollection(nn.Module):
    config: LlamaConfig

    def setup(self):
        self.blocks = [LlamaDecoderLayer(self.config, name=str(i))
                       for i in range(self.config.num_hidden_layers)]

    def __call__(self, hidden_states, attention_mask=None, position_ids=None,
                 deterministic=True):
        for block in self.blocks:
            hidden_states = block(hidden_states, attention_mask=attention_mask,
                                  position_ids=position_ids, deterministic=deterministic)[0]
        return hidden_states


class LlamaModel(nn.Module):
    config: LlamaConfig

    def setup(self):
        c = self.config
        self.embed_tokens = nn.Embed(c.vocab_size, c.hidden_size,
                                     embedding_init=nn.initializers.normal(c.initializer_range))
        self.layers = LlamaLayerCollection(c)
        self.norm = LlamaRMSNorm(c)

    def __call__(self, input_ids, attention_mask, position_ids, deterministic=True):
        hidden_states = self.embed_tokens(input_ids.astype("i4"))
        hidden_states = self.layers(hidden_states, attention_mask=attention_mask,
                                    position_ids=position_ids, deterministic=deterministic)
        return self.norm(hidden_states)


class LlamaForCausalLM(nn.Module):
    config: LlamaConfig = LlamaConfig()

    def setup(self):
        self.model = LlamaModel(self.config)
        self.lm_head = nn.Dense(self.config.vocab_size, use_bias=False,
                                kernel_init=nn.initializers.normal(self.config.initializer_range))

    def __call__(self, input_ids, attention_mask=None, position_ids=None, deterministic=True):
        batch, seq = input_ids.shape
        if attention_mask is None:  # as the library's wrapper builds them
            attention_mask = jnp.ones((batch, seq), "i4")
        if position_ids is None:
            position_ids = jnp.broadcast_to(jnp.arange(seq)[None, :], (batch, seq))
        hidden_states = self.model(input_ids, attention_mask, position_ids,
                                   deterministic=deterministic)
        return CausalLMOutput(logits=self.lm_head(hidden_states))


def make(batch: int, seq: int, abstract: bool = False, fused_qkv: bool = True):
    """(model, params, forward(params, tokens) -> logits) at tiny size, random init;
    abstract: params as ShapeDtypeStructs (for tracing only); fused_qkv: one Conv1D
    (else three nn.Dense)."""
    model = LlamaForCausalLM(LlamaConfig(fused_qkv=fused_qkv))
    tokens = jnp.zeros((batch, seq), jnp.int32)
    init = lambda key: model.init(key, tokens)["params"]  # noqa: E731
    params = jax.eval_shape(init, jax.random.key(0)) if abstract else jax.jit(init)(
        jax.random.key(0))
    return model, params, lambda p, tok: model.apply({"params": p}, tok).logits


def model() -> LlamaForCausalLM:
    """The model alone, for `remat-kit --model tests/zoo/hf_llama_linen.py:model`."""
    return LlamaForCausalLM()


def llama_1b() -> LlamaForCausalLM:
    """At Llama 3.2 1B's widths (16 layers, d2048, MLP 8192, 32 heads, 8 key/value heads,
    its tokenizer's 128,256 tokens), float32: benchmarks/gpu_truth.py's user model."""
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=128_256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=2048))
