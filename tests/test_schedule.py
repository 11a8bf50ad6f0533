"""Layer schedules (every:k, first:n, nested sqrt N, per-layer lists) on a 16-layer tiny."""

import chex
import jax
import pytest

import remat_kit as rk
from remat_kit.models import Transformer, get_config, make_loss_fn
from remat_kit.models.layout import stack_layers, unstack_layers
from remat_kit.policy.schedule import Schedule
from remat_kit.policy.spec import layer_policies

LAYERS, BATCH, SEQ = 16, 2, 8
CFG = get_config("tiny", num_layers=LAYERS)


@pytest.mark.parametrize("spec, canonical, schedule", [
    ("nested", "full@nested", Schedule("nested")),
    ("levanter:nested", "full@nested", Schedule("nested")),
    ("nested:4", "full@nested:4", Schedule("nested", 4)),
    (" nested : 4 ", "full@nested:4", Schedule("nested", 4)),
    ("full@every:2", "full@every:2", Schedule("every", 2)),
    ("save_qkv_proj@first:4", "save:query_proj,key_proj,value_proj,kv_proj,qkv_proj@first:4",
     Schedule("first", 4)),
    ("minimal@nested:8", "save:query_proj,key_proj,value_proj,kv_proj,qkv_proj,out_proj,mlpwi,"
     "mlpwi_0,mlpwi_1,mlpwo,moe_mlpwi_0,moe_mlpwo@nested:8", Schedule("nested", 8)),
    ("dots|save:context@every:3", "dots;save:context@every:3", Schedule("every", 3)),
    ("nested;save:context", "save:context@nested", Schedule("nested")),
    ("full@uniform", "full", Schedule()),
])
def test_schedule_specs_round_trip(spec, canonical, schedule):
    p = rk.parse(spec)
    assert p.schedule == schedule
    assert str(p) == canonical
    assert rk.parse(str(p)) == p
    assert hash(rk.parse(str(p))) == hash(p)


def test_levanter_nested_is_chen_sqrt_n():
    assert rk.parse("levanter:nested") == rk.parse("nested") == rk.Policy(
        schedule=Schedule("nested"))
    assert Schedule("nested").group_size(16) == 4
    assert Schedule("nested").group_size(64) == 8
    assert Schedule("nested").group_size(12) == 3  # 3 + 4 = 4 + 3 boundaries; the smaller g
    assert Schedule("nested").boundaries(64) == 8


def test_layer_policies():
    full, none = rk.parse("full"), rk.parse("none")
    assert layer_policies("full@every:3", 7) == (full, none, none, full, none, none, full)
    assert layer_policies("full@first:2", 4) == (full, full, none, none)
    assert layer_policies("full@nested:2", 4) == (full,) * 4
    assert layer_policies(["full", "none", "selective"], 3) == (full, none, rk.parse("selective"))


# spec, the token the error names, its position, words the message must contain.
@pytest.mark.parametrize("spec, token, position, words", [
    ("full@", "", 5, ["missing layer schedule after '@'", "every:K"]),
    ("@every:2", "", 0, ["no policy before '@'", "full@every:2"]),
    ("@@", "", 0, ["no policy before '@'", "full@every:2"]),
    ("full@every", "every", 5, ["every needs a layer count", "every:2",
                                "did you mean 'every:K'"]),
    ("full@every:0", "0", 11, ["every:K", "K must be a positive int"]),
    ("full@every:x", "x", 11, ["K must be a positive int"]),
    ("full@first:-1", "-1", 11, ["first:N", "N must be a positive int"]),
    ("full@uniform:3", "3", 13, ["uniform schedule takes no number"]),
    ("full@sometimes:2", "sometimes:2", 5, ["unknown layer schedule", "nested:G"]),
    ("none@every:2", "every:2", 5, ["'none' runs no layer under remat"]),
    ("nested@first:2", "first:2", 7, ["two layer schedules", "nested", "first:2"]),
    ("full@every:2@first:1", "@first:1", 12, ["one layer schedule", "'every:2' and "
                                              "'first:1'", "layer_remat"]),
    ("full@nested|dots@every:2", "@every:2", 16, ["one layer schedule", "'nested' and "
                                                  "'every:2'"]),
    ("nested:4@every:2", "@every:2", 8, ["one layer schedule", "'nested:4' and 'every:2'"]),
    # A schedule applies to the whole spec: terms or clauses after it are misplaced.
    ("a@first:2|b", "|b", 9, ["'@first:2' applies to the whole spec", "nothing may follow",
                              "write the schedule once, at the end;"]),  # a|b does not parse
    ("full@every:2|none", "|none", 12, ["nothing may follow", "at the end;"]),  # none: no @
    ("full@first:2|selective", "|selective", 12, ["nothing may follow",
                                                  "full|selective@first:2"]),
    ("full@every:2;save:context", ";save:context", 12, ["full;save:context@every:2"]),
    ("save:context@nested:2,out_proj", ",out_proj", 21,
     ["nothing may follow", "save:context,out_proj@nested:2"]),
    # nested:G is shorthand for the whole spec full@nested:G.
    ("nested:0", "0", 7, ["nested:G", "G must be a positive int"]),
    ("nested:x", "x", 7, ["G must be a positive int"]),
    ("nested:", "", 7, ["G must be a positive int"]),
    ("nested:4|full", "|full", 8, ["'nested:4' is the whole spec 'full@nested:4'",
                                   "nothing may follow", "full|full@nested:4"]),
    ("full|nested:4", "nested:4", 5, ["shorthand for the whole spec 'full@nested:4'",
                                      "full|full@nested:4"]),
    # So are the presets nested and levanter:nested (full@nested), in a union.
    ("nested|selective", "nested", 0, ["preset 'nested' is shorthand for the whole spec "
                                       "'full@nested'", "full|selective@nested"]),
    ("dots|levanter:nested", "levanter:nested", 5, ["dots|full@nested"]),
    # auto:budget= is planned for a whole model: alone, without a schedule.
    ("auto:budget=0.5|full", "|full", 15, ["auto:budget= spec stands alone", "union"]),
    ("auto:budget=0.5;full", ";full", 15, ["stands alone", "clause"]),
    ("full|auto:budget=0.5", "auto:budget=0.5", 5, ["stands alone"]),
    ("auto:budget=0.5@every:2", "@every:2", 15, ["takes no layer schedule", "planner"]),
    ("auto:budget=", "", 12, ["auto:budget= needs a budget after '='", "6GiB", "fraction"]),
    ("auto", "auto", 0, ["auto:budget=SIZE", "auto:budget=FRACTION"]),
])
def test_bad_schedule_specs(spec, token, position, words):
    with pytest.raises(rk.RematSpecError) as info:
        rk.parse(spec)
    e = info.value
    assert (e.token, e.position) == (token, position)
    # A token that is the whole spec is shown once.
    shown = f"in spec {spec!r} at position {position}" + ("" if token == spec else f": {token!r}")
    assert shown in str(e)
    for word in words:
        assert word in str(e)
    if not any("did you mean" in word for word in words):  # no near miss for misplaced syntax
        assert "did you mean" not in str(e)


@pytest.mark.parametrize("spec", ["full@first:2|selective", "full@every:2;save:context",
                                  "nested:4|full", "full|nested:4", "nested:4;save:context"])
def test_suggested_fix_parses(spec):
    with pytest.raises(rk.RematSpecError) as info:
        rk.parse(spec)
    fix = str(info.value).split("at the end: ")[1].split("; in spec")[0]
    assert rk.parse(fix).schedule != Schedule()


def test_schedule_constructor_names_the_count():
    with pytest.raises(rk.RematSpecError, match="G must be a positive int; got '0'"):
        Schedule("nested", 0)
    with pytest.raises(rk.RematSpecError, match="uniform schedule takes no number; got '2'"):
        Schedule("uniform", 2)


@pytest.mark.parametrize("changes, message", [
    ({"remat": "full@every:17"}, r"every:17: 17 is out of range for 16 layers; use 1\.\.16"),
    ({"remat": "full@first:20"}, r"first:20: 20 is out of range for 16 layers"),
    ({"remat": "full@nested:5"}, r"group size 5 does not divide 16 layers; use one of "
                                 r"\[1, 2, 4, 8, 16\]"),
    ({"remat": "full@every:2", "scan_layers": True}, r"every:2 needs scan_layers=False"),
    ({"remat": "selective@first:2", "scan_layers": True}, r"first:2 needs scan_layers=False"),
    ({"layer_remat": ("full",) * 3}, r"3 entries for 16 layers"),
    ({"layer_remat": ("full",) * 16, "remat": "full"}, r"needs remat='none' \(got 'full'\)"),
])
def test_schedule_out_of_range_for_config(changes, message):
    with pytest.raises(ValueError, match=message):
        CFG.replace(**changes)


def test_per_layer_entry_with_schedule_is_rejected():
    with pytest.raises(rk.RematSpecError, match="layer_remat: per-layer policy 1 has a layer "
                                                "schedule"):
        CFG.replace(num_layers=2, layer_remat=("full", "full@every:2"))


@pytest.fixture(scope="module")
def reference():
    tokens = jax.random.randint(jax.random.key(0), (BATCH, SEQ), 0, CFG.vocab_size)
    # No remat, scanned and jitted: one layer body to compile, not 16.
    scanned = CFG.replace(scan_layers=True)
    params = Transformer(scanned).init(jax.random.key(1), tokens)["params"]
    grads = jax.jit(jax.grad(make_loss_fn(Transformer(scanned))))(params, tokens, tokens,
                                                                   jax.random.key(2))
    return tokens, unstack_layers(params, scanned), unstack_layers(grads, scanned)


def boundaries_stored(cfg, params, tokens) -> float:
    """Layer inputs the forward pass stores, in units of one [batch, seq, d_model] array.

    Residuals named decoder_layer_input / decoder_layer_output (a layer's
    input is the previous layer's output), or a scan-body input (a group's
    input under nested scan). In a looped stack the first layer's input is
    the embedding sum, which the walker names by its primitive (add): not counted.
    """
    loss = make_loss_fn(Transformer(cfg))
    found = rk.residuals(loss, params, tokens, tokens, jax.random.key(2))
    one = BATCH * SEQ * cfg.d_model * 4
    return sum(r.nbytes for r in found if r.shape[-3:] == (BATCH, SEQ, cfg.d_model) and (
        r.name in ("decoder_layer_input", "decoder_layer_output", "scan input"))) / one


# (spec, scan_layers, layer inputs stored per the schedule). Under `full` a
# remat'd layer stores its input alone. Uniform `full` is in test_remat.py.
CASES = [
    ("full@every:5", False, 4),  # layers 0, 5, 10, 15
    ("full@first:4", False, 4),
    ("nested", False, 4),        # 16 layers: groups of 4, 4 group inputs
    ("full@nested:8", True, 2),
]


@pytest.mark.parametrize("spec, scan, stored", CASES)
def test_schedule_grads_and_stored_boundaries(reference, spec, scan, stored):
    tokens, params, ref = reference
    cfg = CFG.replace(remat=spec, scan_layers=scan)
    if scan:
        params = stack_layers(params, cfg)
    # Eager: op-by-op dispatch of 16 identical layers hits JAX's per-op cache
    # and is several times faster than compiling the unrolled stack.
    grads = jax.grad(make_loss_fn(Transformer(cfg)))(params, tokens, tokens, jax.random.key(2))
    chex.assert_trees_all_close(unstack_layers(grads, cfg) if scan else grads, ref,
                                rtol=1e-5, atol=1e-6)
    assert cfg.policy.schedule.boundaries(LAYERS) == stored
    assert boundaries_stored(cfg, params, tokens) == stored - (0 if scan else 1)


def test_per_layer_list_is_a_schedule():
    listed = CFG.replace(layer_remat=["full", "none"] * 8)  # a list, as from a config file
    assert listed.layer_remat == ("full", "none") * 8
    assert listed.layer_policies == CFG.replace(remat="full@every:2").layer_policies


def test_nested_stores_4_plus_4():
    """Chen et al.: 16 layers in groups of 4 store 4 group inputs in the forward
    pass; recomputing one group stores its 4 layer inputs; not 16."""
    tokens = jax.random.randint(jax.random.key(0), (BATCH, SEQ), 0, CFG.vocab_size)
    shapes = lambda cfg: jax.eval_shape(Transformer(cfg).init, jax.random.key(1),
                                        tokens)["params"]
    nested = CFG.replace(remat="nested", scan_layers=True)
    assert boundaries_stored(nested, shapes(nested), tokens) == 4
    one_group = CFG.replace(remat="full", scan_layers=True, num_layers=4)
    assert boundaries_stored(one_group, shapes(one_group), tokens) == 4
    full = CFG.replace(remat="full", scan_layers=True)
    assert boundaries_stored(full, shapes(full), tokens) == 16
