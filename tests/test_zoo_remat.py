"""Remat on models that are not ours (tests/zoo), through the front door (`from_model.workload`).

On each: grads under full, minimal and selective equal no remat (f32), and
every MaxText preset saves, of one block, exactly the roles its definition
names (the roles the block has whose values the backward pass reads).
"""

import importlib

import chex
import jax
import jax.numpy as jnp
import pytest

import remat_kit as rk
from remat_kit import from_model
from remat_kit._jax_private import saved_residuals
from remat_kit.roles import ROLES
from remat_kit.spec import PRESET_TABLE
from tests.test_remat import _design_saved

B, T = 2, 8
MODELS = ["gemma_linen", "gpt_linen", "llama_nnx", "fused_nnx", "nano_moe"]
MAXTEXT = [name for cb, name, *_ in PRESET_TABLE if cb == "maxtext"]


def concrete(args, key):
    """Random arrays shaped like ShapeDtypeStructs: small normal floats, token ids < 64."""
    leaves, tree = jax.tree.flatten(args)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(tree, [
        0.1 * jax.random.normal(k, a.shape, a.dtype) if jnp.issubdtype(a.dtype, jnp.floating)
        else jax.random.randint(k, a.shape, 0, 64, a.dtype) for k, a in zip(keys, leaves)])


@pytest.fixture(scope="module")
def works():
    out = {}
    for name in MODELS:
        if name == "nano_moe":
            pytest.importorskip("nano_moe", reason="nano-moe-jax (requirements.txt) not installed")
        model, _, _ = importlib.import_module(f"tests.zoo.{name}").make(B, T, abstract=True)
        if name == "nano_moe":  # its (logits, aux_loss) tuple is refused; take the logits
            from tests.zoo.nano_moe import LogitsOnly
            model = LogitsOnly(model)
        out[name] = from_model.workload(model, B, T)
    return out


SPECS = ("none", "full", "minimal", "selective")


@pytest.mark.parametrize("name", MODELS)
def test_grads_equal_no_remat(works, name):
    work = works[name]
    args = concrete(work.args, jax.random.key(0))
    all_grads = [jax.jit(jax.grad(work.loss_for_policy(rk.parse(s))))(*args) for s in SPECS]
    ref = all_grads[0]
    assert jax.tree.leaves(ref) and all(jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(ref))
    for spec, g in zip(SPECS[1:], all_grads[1:]):
        chex.assert_trees_all_close(g, ref, rtol=1e-5, atol=1e-7, custom_message=spec)


def saved_names(work, spec) -> set:
    loss, args = work.block(rk.parse(spec))
    return {d.split("'")[1] for _, d in saved_residuals(loss, *args) if d.startswith("named '")}


@pytest.fixture(scope="module")
def readable(works):
    """Per model: the roles of one block the backward pass reads (saved when all are named)."""
    return {name: saved_names(w, "save:" + ",".join(ROLES)) & set(ROLES)
            for name, w in works.items()}


@pytest.mark.parametrize("name", MODELS)
def test_maxtext_presets_save_their_roles(works, readable, name):
    assert {"out_proj", "context"} <= readable[name]  # the roles reach the block
    for preset in MAXTEXT:
        saved = saved_names(works[name], f"maxtext:{preset}") & set(ROLES)
        assert saved == _design_saved(preset, None) & readable[name], preset
