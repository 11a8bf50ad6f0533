"""The cost model's first estimate of a chosen plan against its compile, and the share of a
saved byte the estimate counts (`PlannerCosts.byte_share`)."""

import pytest

from remat_kit.decide.plan import Planner
from remat_kit.flax import from_model
from remat_kit.models import get_config
from remat_kit.api.configs import config_planner
from remat_kit.policy.policy import Policy
from tests.zoo import own_tags_linen

# One decision per tag, base nothing, on tpu:v5e:1x1's peak or the
# CPU's temp.
_SETTINGS = dict(cache=None, groups=1, bases=("nothing",))


def _share_from_records(planner: Planner) -> float:
    """(every decidable tag saved - full) / those tags' bytes, from the compiled records."""
    model = planner.offload_free_model()
    kept = frozenset(t for t in model.tags if t not in model.fixed)
    every = planner.measure(Policy(save=kept)).memory_bytes
    return (every - planner.measure(Policy()).memory_bytes) / sum(model.nbytes[t] for t in kept)


@pytest.mark.parametrize("which,target,budgets", [
    ("own_tags", "tpu:v5e:1x1", (0.7, 0.85)), ("tiny", "tpu:v5e:1x1", (0.75, 0.85)),
    ("own_tags", None, (0.6, 0.85)), ("tiny_llama", None, (0.6,))])
def test_first_estimate_of_a_uniform_plan_is_within_a_tenth_of_the_compile(which, target,
                                                                           budgets):
    # Counting every kept byte whole, the estimate was 6-11% high on the own-tags decoder
    # (batch 8, seq 64) and 14-34% high on tiny (batch 8, seq 128) on the TPU peak. On the
    # CPU's temp, from full's compile alone: +22.9% (own-tags at 0.6) and +16.9%
    # (tiny_llama at 0.6, batch 8, seq 128); from the nearest compile so far: +6.3%, +5.6%.
    settings = dict(_SETTINGS, target=target)
    planner = (Planner(from_model.workload(own_tags_linen.model(), 8, 64), **settings)
               if which == "own_tags" else
               config_planner(get_config(which), 4 if which == "tiny" else 8, 128, **settings))
    share = planner.byte_share
    assert share == pytest.approx(_share_from_records(planner)) and 0.1 <= share < 1
    for budget in budgets:
        p = planner.plan(budget)
        assert p.spec not in ("full", "none") and p.measured_bytes <= p.budget_bytes
        assert abs(p.predicted_bytes / p.measured_bytes - 1) <= 0.10, (budget, p.spec)
