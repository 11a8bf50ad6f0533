"""Old import paths that moved in round 5 (issue 47) still give the same objects, with a
DeprecationWarning naming the new path (README.md, "Changes")."""

import importlib

import pytest

from remat_kit.api import answers, configs, inputs, report
from remat_kit import errors

MOVED = [
    ("remat_kit.decide.resolve", "measure", answers.measure, "remat_kit.api.answers"),
    ("remat_kit.measure.explain", "explain", answers.explain, "remat_kit.api.answers"),
    ("remat_kit.trace.validate", "validate", answers.validate, "remat_kit.api.answers"),
    ("remat_kit.models.shortcuts", "fit", configs.fit, "remat_kit.api.configs"),
    ("remat_kit.models.shortcuts", "measure_config", configs.measure_config,
     "remat_kit.api.configs"),
    ("remat_kit.cli.inputs", "BadInput", errors.BadInput, "remat_kit.api.inputs"),
    ("remat_kit.cli.inputs", "check_seq", inputs.check_seq, "remat_kit.api.inputs"),
    ("remat_kit.cli.report", "rows", report.rows, "remat_kit.api.report"),
    ("remat_kit.cli.sources", "load_config", importlib.import_module(
        "remat_kit.api.sources").load_config, "remat_kit.api.sources"),
    ("remat_kit.cli.plots", "plot", importlib.import_module(
        "remat_kit.api.plots").plot, "remat_kit.api.plots"),
    ("remat_kit.cli.labels", "dtype_label", importlib.import_module(
        "remat_kit.api.labels").dtype_label, "remat_kit.api.labels"),
]


@pytest.mark.parametrize("old, name, value, new", MOVED)
def test_an_old_path_gives_the_same_object_and_names_the_new_one(old, name, value, new):
    with pytest.warns(DeprecationWarning, match=f"{old}.{name} moved to {new}.{name}"):
        assert getattr(importlib.import_module(old), name) is value


def test_a_name_that_never_was_there_is_an_attribute_error():
    with pytest.raises(AttributeError, match="remat_kit.decide.resolve.*'nothing'"):
        importlib.import_module("remat_kit.decide.resolve").nothing


def test_below_the_front_floor_a_spec_string_is_a_type_error():
    # rk.measure parses the specs once (README, "Changes"); below it, values only.
    import jax.numpy as jnp
    from remat_kit.decide.resolve import resolve
    from remat_kit.measure import measure, targets
    loss, x, here = (lambda x: jnp.sum(x * x)), jnp.ones(3), targets.parse_target(None)
    with pytest.raises(TypeError, match="resolve takes parsed policies.*'full'.*rk.parse"):
        resolve(["full"], loss, x, target=here)
    with pytest.raises(TypeError, match="measure takes parsed policies.*'full'.*rk.parse"):
        measure.measure(loss, x, policies=["full"], target=here)


def test_the_planners_old_attributes_warn_and_read_its_parts():
    import jax.numpy as jnp
    from remat_kit.decide.plan import Planner
    planner = Planner(lambda w, x: jnp.sum(jnp.tanh(x @ w)), jnp.ones((8, 8)),
                      jnp.ones((4, 8)), cache=None)
    with pytest.warns(DeprecationWarning, match=r"Planner.loss_fn is planner.compiles.loss_fn"):
        assert planner.loss_fn is planner.compiles.loss_fn
    with pytest.warns(DeprecationWarning, match=r"planner.costs.groups"):
        assert planner.groups == planner.costs.groups == "layers"
    with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
        planner.nonsense
