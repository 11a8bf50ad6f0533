"""Spec strings: parsing, canonical printing, presets, composition and errors."""

import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import remat_kit as rk
from remat_kit.policy import names
from remat_kit.policy.policy import Policy
from remat_kit.policy import spec
from remat_kit.policy.presets import BARE_NAMES, PRESET_TABLE

ISSUE_SPECS = ["none", "full", "everything", "dots", "dots_no_batch", "selective", "minimal",
               "save:query_proj,key_proj,value_proj", "save:mlp*",
               "save:query_proj;offload:mlpwo"]


@pytest.mark.parametrize("spec", ISSUE_SPECS + [f"{cb}:{n}" for cb, n, *_ in PRESET_TABLE])
def test_round_trip(spec):
    p = rk.parse(spec)
    assert isinstance(p, Policy)
    assert rk.parse(str(p)) == p
    assert hash(rk.parse(str(p))) == hash(p)


def test_canonical_strings():
    assert str(rk.parse("none")) == "none"
    assert str(rk.parse("nothing_saveable")) == "full"
    assert str(rk.parse("save:value_proj,query_proj,key_proj")) == \
        "save:query_proj,key_proj,value_proj"
    assert str(rk.parse("selective")) == "save:*;recompute:attn_logits,attn_probs"
    assert str(rk.parse("offload[device->unpinned_host]:mlpwo")) == \
        "offload[device->unpinned_host]:mlpwo"
    assert str(rk.parse("save:query_proj;offload:mlpwo")) == "save:query_proj;offload:mlpwo"


@pytest.mark.parametrize("group", [
    ["full", "nothing_saveable", "save_nothing", "recompute", "maxtext:full", "levanter:true",
     "praxis:save_nothing", "megatron:full"],
    ["everything", "everything_saveable", "save_everything", "levanter:save_all"],
    ["dots", "dots_saveable", "checkpoint_dots", "praxis:save_dot_only"],
    ["dots_no_batch", "dots_with_no_batch_dims_saveable", "checkpoint_dots_with_no_batch_dims"],
    ["none", "levanter:false"],
    ["selective", "megatron:selective", "recompute:attn_logits,attn_probs",
     "save_any_names_but_these:attn_logits,attn_probs"],
    ["praxis:save_encoded_and_out_proj", "save:encoded,out_proj", "save:context,out_proj"],
])
def test_synonyms_compare_equal(group):
    policies = {rk.parse(s) for s in group}
    assert len(policies) == 1, [str(p) for p in policies]


def test_aliases_expand():
    assert rk.parse("save:ffn1,ffn2") == rk.parse("save:mlpwi,mlpwo")
    assert rk.parse("save:combined_qkv_proj") == rk.parse("save:qkv_proj")
    assert rk.parse("recompute:core_attn").recompute == {"attn_logits", "attn_probs", "context"}
    assert rk.parse("recompute:layernorm").recompute == {"attn_norm", "mlp_norm"}


def test_megatron_recompute_modules_keep_the_rest():
    p = rk.parse("recompute:core_attn,mlp")
    assert p.decide("query_proj") == "save"
    assert p.decide("attn_norm") == "save"
    for t in ["attn_logits", "attn_probs", "context", "mlpwi", "mlp_act", "mlpwo"]:
        assert p.decide(t) == "recompute"


def test_glob_and_specificity():
    p = rk.parse("save:mlp*")
    assert {t for t in names.TAGS if p.decide(t) == "save"} == {
        "mlp_norm", "mlpwi", "mlpwi_0", "mlpwi_1", "mlp_act", "mlpwo"}
    p = rk.parse("save:*;recompute:mlp*;offload:mlpwo")
    assert (p.decide("query_proj"), p.decide("mlpwi"), p.decide("mlpwo")) == (
        "save", "recompute", "offload")


def test_save_anything_except_these_names_does_what_it_says():
    p = rk.parse("save_anything_except_these_names:query_proj")
    assert p.base == "everything"
    assert {t for t in names.TAGS if p.decide(t) != "save"} == {"query_proj"}


def test_union_saves_what_either_saves():
    p = rk.parse("save:query_proj|save:mlpwo")
    assert p == rk.parse("save:query_proj,mlpwo")
    assert rk.parse("dots|save:context") == Policy(save={"context"}, base="dots")
    assert rk.parse("full|none") == rk.parse("none")


def test_union_conflict_needs_explicit_resolution():
    with pytest.raises(rk.RematSpecError, match="saved by one policy and offloaded"):
        rk.parse("save:mlpwo|offload:mlpwo")
    resolved = rk.parse("save:mlpwo").union(rk.parse("offload:mlpwo"), prefer="offload")
    assert resolved == rk.parse("offload:mlpwo")
    with pytest.raises(TypeError, match="unites only with a Policy.*int 3"):
        rk.parse("full").union(3)


def test_from_custom_maxtext_mapping():
    p = rk.from_custom({"query_proj": "device", "mlpwo": "offload", "context": "remat"})
    assert p == rk.parse("save:query_proj;offload:mlpwo")
    with pytest.raises(rk.RematSpecError, match="'keep'.*valid choices: remat, device, offload"):
        rk.from_custom({"query_proj": "keep"})


@pytest.mark.parametrize("spec, token, position, closest", [
    ("minimall", "minimall", 0, "minimal"),
    ("save:querry_proj", "querry_proj", 5, "query_proj"),
    ("save:query_proj;offload:mlpwoo", "mlpwoo", 24, "mlpwo"),
    ("maxtext:minmal", "minmal", 8, "minimal"),
    ("offload[dev->pinned_host]:mlpwo", "dev", 8, "device"),
    ("dots|selectve", "selectve", 5, "selective"),
])
def test_error_names_token_position_and_closest(spec, token, position, closest):
    with pytest.raises(rk.RematSpecError) as info:
        rk.parse(spec)
    e = info.value
    assert (e.token, e.position, e.closest) == (token, position, closest)
    assert repr(token) in str(e) and f"position {position}" in str(e)
    assert f"did you mean {closest!r}" in str(e) and "valid choices" in str(e)


@pytest.mark.parametrize("spec, message", [
    ("", "empty policy spec"),
    ("save:", "empty tag list"),
    ("save:query_proj,", "empty tag in list"),
    ("save:context,context", "duplicate tag"),
    ("save:context;offload:context", "conflicting decisions"),
    ("offload[device->device]:mlpwo", "to itself"),
    ("offload[device->hbm]:mlpwo", "unknown memory kind"),
    ("offload[pinned_host->device]:mlpwo", "offload_src must be 'device'"),
    ("save[device->pinned_host]:mlpwo", "only valid on offload"),
    ("none;save:context", "cannot be combined"),
    ("full;;dots", "empty clause"),
])
def test_precise_messages(spec, message):
    with pytest.raises(rk.RematSpecError, match=message):
        rk.parse(spec)


def test_unknown_tag_is_an_unknown_tag_error():
    with pytest.raises(rk.UnknownTagError):
        rk.parse("save:no_such_tag")


def test_non_string_spec():
    with pytest.raises(rk.RematSpecError, match="must be a string or a Policy"):
        rk.parse(42)


def test_tag_rejects_unknown_names_with_closest_match():
    import jax.numpy as jnp
    with pytest.raises(rk.UnknownTagError, match="did you mean 'query_proj'"):
        rk.tag(jnp.ones(2), "query_prj")
    assert rk.tag(jnp.ones(2), "my_custom_value", strict=False).shape == (2,)


def test_register_tag_extends_specs():
    rk.register_tag("router_logits")
    assert rk.parse("save:router_logits").save == {"router_logits"}
    with pytest.raises(ValueError, match="without whitespace or any of"):
        rk.register_tag("bad*name")


# -- bad input, generated ---------------------------------------------------

_WORDS = (list(BARE_NAMES) + list(names.TAGS) + list(names.ALIASES)
          + ["save", "offload", "recompute", "maxtext", "praxis", "levanter", "megatron",
             "device", "pinned_host", "*", "mlp*", "bogus", ""])
_PUNCT = [":", ";", ",", "|", "[", "]", "->", " "]


@settings(max_examples=300, deadline=None)
@given(st.one_of(
    st.text(alphabet=string.printable, max_size=40),
    st.lists(st.sampled_from(_WORDS + _PUNCT), max_size=12).map("".join)))
def test_fuzz_parse_returns_policy_or_spec_error(text):
    try:
        p = rk.parse(text)
    except rk.RematSpecError:
        return
    assert isinstance(p, Policy)
    assert rk.parse(str(p)) == p


_TAG_LISTS = st.lists(st.sampled_from(list(names.TAGS) + ["mlp*", "*_proj", "attn_*"]),
                      min_size=1, max_size=4, unique=True)


@settings(max_examples=200, deadline=None)
@given(save=_TAG_LISTS, offload=_TAG_LISTS, recompute=_TAG_LISTS,
       base=st.sampled_from(["", "dots;", "dots_no_batch;", "everything;"]),
       union=st.sampled_from(["", "|minimal", "|dots"]))
def test_generated_valid_specs_round_trip(save, offload, recompute, base, union):
    offload = [t for t in offload if t not in save]
    recompute = [t for t in recompute if t not in save + offload]
    clauses = [f"save:{','.join(save)}"]
    clauses += [f"offload:{','.join(offload)}"] if offload else []
    clauses += [f"recompute:{','.join(recompute)}"] if recompute else []
    spec = base + ";".join(clauses) + union
    try:
        p = rk.parse(spec)
    except rk.RematSpecError as e:
        assert "equally specific" in str(e) or "saved by one policy" in str(e), spec
        return
    assert rk.parse(str(p)) == p


def test_docs_policy_reference_is_current():
    from pathlib import Path
    page = (Path(__file__).parents[1] / "docs" / "policies.md").read_text()
    assert spec.reference_table() in page


# -- bad input found by trying to break it ------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(remat="yes"), "must be a bool"),
    (dict(save={"query_proj": 1}), "set, list or tuple"),
    (dict(save=["bogus"]), "unknown tag"),
    (dict(save=["query_proj,key_proj"]), "unknown tag"),
    (dict(save=["mlp*"], recompute=["*pwo"]), "equally specific"),
])
def test_policy_fields_are_checked(kwargs, message):
    with pytest.raises(rk.RematSpecError, match=message):
        Policy(**kwargs)


def test_policy_fields_expand_aliases_and_union_takes_parsed_policies():
    assert Policy(save=["mlp"]) == rk.parse("save:mlp")
    assert rk.parse(str(Policy(save=["ffn1"]))) == Policy(save=["mlpwi"])
    assert Policy() | rk.parse("minimal") == rk.parse("minimal")
    with pytest.raises(TypeError, match=r"parse the text first, Policy \| rk.parse\('minimal'\)"):
        Policy() | "minimal"
    with pytest.raises(TypeError, match="the string 'mlpwo'"):
        Policy().resolve("mlpwo")


@pytest.mark.parametrize("spec, message, closest", [
    ("save", "needs a tag list", None),
    ("full:", "takes no ':' arguments", None),
    ("MINIMAL", "unknown policy name", "minimal"),
])
def test_syntax_messages(spec, message, closest):
    with pytest.raises(rk.RematSpecError, match=message) as info:
        rk.parse(spec)
    assert info.value.closest == closest


def test_recompute_everything_is_not_a_conflict():
    p = rk.parse("recompute:*")
    assert all(p.decide(t) == "recompute" for t in names.TAGS)


@pytest.mark.parametrize("call, exc, message", [
    (lambda: rk.tag(1.0, 5), rk.UnknownTagError, "non-empty string"),
    (lambda: rk.from_custom("query_proj"), rk.RematSpecError, "is a mapping"),
    (lambda: rk.from_custom({3: "remat"}), rk.RematSpecError, "keys are tag names.*got '3'"),
    (lambda: rk.from_custom({"mlpwo": ["remat"]}), rk.RematSpecError,
     "unknown decision for tag 'mlpwo'.*valid choices: remat, device, offload"),
    (lambda: rk.register_tag(" padded "), ValueError, "without whitespace"),
])
def test_library_calls_reject_wrong_types(call, exc, message):
    with pytest.raises(exc, match=message):
        call()


@pytest.mark.parametrize("overrides, message", [
    (dict(num_kv_heads=-2), "num_kv_heads must be positive"),
    (dict(head_dim=0), "head_dim must be positive"),
    (dict(family="llama", d_model=12, num_heads=4), "even head_dim, got 3"),
])
def test_config_rejects_bad_heads(overrides, message):
    from remat_kit.models import TransformerConfig
    with pytest.raises(ValueError, match=message):
        TransformerConfig(**overrides)


def test_a_shortened_message_is_cut_between_words():
    from remat_kit.errors import shorten
    text = " ".join(["temporaries"] * 12 + ["values"] * 20)
    short = shorten(text, 40)
    head, _, rest = short.partition("...[")
    count, _, tail = rest.partition(" characters]...")
    assert head.split()[-1] == "temporaries" and tail.split()[0] == "values"
    assert len(head) + int(count) + len(tail) == len(text)


@pytest.mark.parametrize("spec, position", [
    ("x" * 100_000, 0), ("save:query_proj," + "b" * 100_000, 16),
    ("save:query_proj;" * 10_000 + "bad", 160_000),
])
def test_long_specs_are_shown_once_and_shortened(spec, position):
    """Fault 10: a 100k-character spec gave a 200k-character message (spec and token)."""
    with pytest.raises(rk.RematSpecError) as e:
        rk.parse(spec)
    message = str(e.value)
    assert len(message) < 1000 and e.value.spec == spec and e.value.position == position
    assert f"({len(spec)} characters)" in message or f"[{len(spec) - 160} characters]" in message
    if position:
        assert f"at position {position}" in message


def test_a_per_layer_plan_as_plan_prints_it_is_a_spec_config_and_remat_model_read():
    """plan's verdict pastes a per-layer plan as its layers summary ('0-1 save:... / 2
    full'): layer_policies, TransformerConfig.remat (--config.remat=) and rk.remat_model
    read it as one policy per layer; runs that skip a layer are refused in one line."""
    from remat_kit.decide.plan_cache import layers_summary
    from remat_kit.models import get_config
    from remat_kit.errors import RematSpecError
    from remat_kit.policy.spec import layer_policies, parse, per_layer
    layers = (parse("save:query_proj,key_proj"), parse("save:query_proj,key_proj"),
              parse("full"))
    text = layers_summary(layers)
    assert text == "0-1 save:query_proj,key_proj / 2 full"
    assert layer_policies(text, 3) == layers
    assert per_layer("save:query_proj,key_proj") is None and per_layer("full@every:2") is None
    cfg = get_config("tiny", num_layers=3, remat=text)
    assert (cfg.remat, tuple(map(parse, cfg.layer_remat))) == ("none", layers)
    from remat_kit.flax import measured
    assert measured._spec_of(text, None) == (per_layer(text), {})  # rk.remat_model's reading
    with pytest.raises(RematSpecError, match="layers 2 do not follow on from layer 1"):
        per_layer("0 full / 2 full")
