"""A model that carries its own mesh, compiled for a target: its mesh is rebuilt on the
target's devices (same axis names and shape), or refused in one line where the target
has fewer devices than the mesh.

tests/zoo/mesh_linen.py builds `Mesh(jax.devices(), ("data",))` at import (8 CPU devices
under `make test`) and constrains its activations to it.
"""

import jax
import pytest

import remat_kit as rk
from remat_kit import cli
from remat_kit.errors import MeshError
from remat_kit.measure import lowering, targets
from remat_kit.trace import retarget
from tests.test_targets import needs_libtpu
from tests.zoo import mesh_linen

MODEL = "tests/zoo/mesh_linen.py:model"
pytestmark = pytest.mark.skipif(jax.device_count() != 8, reason="needs 8 host devices")


def test_the_workload_finds_the_model_s_mesh_and_places_its_arguments_there():
    work = rk.from_model.workload(mesh_linen.model(), 8, 8)
    closed = jax.make_jaxpr(work.loss_for_policy(rk.parse("full")))(*work.args)
    (mesh,) = retarget.meshes(closed.jaxpr)
    assert mesh.shape == {"data": 8} and retarget.describe(mesh) == "data: 8 over 8 cpu devices"
    assert all(leaf.sharding.mesh == mesh for leaf in jax.tree.leaves(work.args))


@needs_libtpu
def test_a_target_with_the_mesh_s_device_count_compiles_on_a_rebuilt_mesh():
    work = rk.from_model.workload(mesh_linen.model(), 8, 8)
    tpu = rk.measure(work, policies=["none", "full"], target="tpu:v5e:2x4")
    assert [r.error for r in tpu] == [None, None]
    none, full = (r.flops for r in tpu)
    assert none < full
    placed = lowering.place(work.args, targets.parse_target("tpu:v5e:2x4"))
    mesh = jax.tree.leaves(placed)[0].sharding.mesh
    assert mesh.shape == {"data": 8} and mesh.devices.flat[0].platform == "tpu"


@needs_libtpu
def test_a_target_with_fewer_devices_is_refused_in_one_line(capsys):
    assert cli.main(["compare", "--model", MODEL, "--batch", "8", "--seq", "8",
                     "--target", "tpu:v5e:1x1", "--policies", "none,full"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and (
        "the model builds its own mesh (data: 8 over 8 cpu devices) and target tpu:v5e:1x1 "
        "has 1 device: name a target with at least 8") in err, err
    with pytest.raises(MeshError, match="has 1 device"):
        lowering.place(rk.from_model.workload(mesh_linen.model(), 8, 8).args,
                       targets.parse_target("tpu:v5e:1x1"))
