"""A policy spec is parsed once, where it comes in: `rk.fit` parses its rows and
hands `Policy` values down (each row still shows the user's label), fit's step cache keys
them by their canonical spec, a `TransformerConfig` parses its `remat` in its constructor,
and the wrappers' helpers below the public calls refuse text. No compile here."""

import flax.linen as nn
import pytest

import remat_kit as rk
from remat_kit.api.configs import fit_rows
from remat_kit.decide import fit as fitting
from remat_kit.decide.fit_search import NONE, Steps
from remat_kit.decide.plan_cache import Plan
from remat_kit.errors import BudgetError, RematSpecError
from remat_kit.models import config as config_module
from remat_kit.policy.policy import Policy
from remat_kit.policy.spec import AutoSpec, parse
from remat_kit.trace import wrapping

MINIMAL = parse("minimal")


def test_fit_rows_keep_the_labels_and_hold_values():
    rows = fit_rows(["minimal", MINIMAL, "auto", "full", "minimal"], "1MiB")
    # "minimal" and its Policy are two rows (two labels); the repeated "minimal" is one.
    assert list(rows) == ["minimal", str(MINIMAL), "auto", "full"]
    assert rows["minimal"] == rows[str(MINIMAL)] == MINIMAL
    assert rows["auto"] == AutoSpec("1048576B") and rows["full"] == Policy()
    assert fit_rows("none", 2**20) == {"none": NONE}  # one spec, not its letters


def test_fit_below_the_front_floor_takes_values_only():
    assert fitting.is_auto_spec(AutoSpec("1048576B"), 2**20, "auto")
    assert not fitting.is_auto_spec(MINIMAL, 2**20)
    with pytest.raises(TypeError, match="parsed policies"):
        fitting.is_auto_spec("minimal", 2**20)
    with pytest.raises(BudgetError, match="not 'auto:budget=2MiB'"):
        fitting.is_auto_spec(parse("auto:budget=2MiB"), 2**20, "auto:budget=2MiB")
    with pytest.raises(TypeError, match="parsed policies"):
        fitting.fit(rk.models.workload(rk.models.get_config("tiny"), 1, 16), "1MiB",
                    policies=["full"])


def test_steps_key_by_the_canonical_spec_and_keep_the_policy():
    compiled = []

    def measure(policy, size, loss):
        compiled.append((str(policy), size))
        return f"step of {policy} at {size}"

    steps = Steps(measure)
    assert steps.get(MINIMAL, 8) == steps.get(parse(str(MINIMAL)), 8)
    assert compiled == [(str(MINIMAL), 8)]  # one compile, whichever row asked
    assert steps.at(8) == {str(MINIMAL): f"step of {MINIMAL} at 8"}
    assert steps.policy(str(MINIMAL)) is MINIMAL
    with pytest.raises(TypeError, match="parsed policies"):
        steps.get("full", 8)


def test_a_config_parses_its_remat_once(monkeypatch):
    calls = []
    monkeypatch.setattr(config_module, "parse", lambda s: calls.append(s) or parse(s))
    cfg = config_module.TransformerConfig(remat="selective@every:2", num_layers=4)
    assert cfg.policy == parse("selective@every:2") and len(cfg.layer_policies) == 4
    assert cfg.policy.schedule.kind == "every"
    assert calls == ["selective@every:2"]


def test_a_cached_plan_takes_the_policy_read_back():
    plan = Plan("1MiB", 2**20, MINIMAL, str(MINIMAL), 1, 1.0, 1, 1.0, 2, 2.0, 1, "ok", 1,
                "XLA CPU compile", "temp_size_in_bytes")
    assert Plan.from_dict(plan.to_dict(), MINIMAL) == plan


def test_the_wrappers_parse_at_the_public_call():
    with pytest.raises(TypeError, match="parsed policies"):
        wrapping.module_policy("full")
    with pytest.raises(TypeError, match="parsed policies"):
        wrapping.Plan.of({"Dense": "full"})

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4)(x)

    assert rk.linen.remat(Block, "none") is Block  # text at the public call still works
    with pytest.raises(RematSpecError, match="layer schedule"):
        rk.linen.remat(Block, "full@every:2")
