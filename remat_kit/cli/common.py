"""Flag values every command reads alike: the model's source with --batch and --seq (a
config file's defaults otherwise), the --target list (libtpu and each TPU topology
checked before anything is measured), and a plot's path per target.
Docs: docs/compare.md ("Flags"), docs/targets.md.
"""

from __future__ import annotations

import math
import os

import jax
import numpy as np

from remat_kit import mesh as rk_mesh
from remat_kit.ui.inputs import BadInput, check_seq
from remat_kit.ui.report import map_context, print_map
from remat_kit.ui.sources import Source, load_source
from remat_kit.decide.fit import fit_budget_bytes
from remat_kit.errors import BudgetError
from remat_kit.policy.budget import parse_budget


def make_host_devices(args) -> None:
    """The CPU devices --mesh needs (data:2,fsdp:2: 4), and as many as a --target's
    topology has chips (tpu:v5p:2x2x1: 4), made before anything asks JAX's backend (a
    target, the user's module, the default backend): the `jax_num_cpu_devices` option,
    as XLA_FLAGS=--xla_force_host_platform_device_count=N would, so no flag is needed.
    A model that builds its own mesh from `jax.devices()` at import then finds as many
    devices as the target it is measured for. A bad spec or target is left to
    `inputs.device_mesh` and `targets_of`, which name the flag."""
    from remat_kit.measure import targets
    try:
        sizes = rk_mesh.parse_spec(getattr(args, "mesh", None) or "")
    except rk_mesh.MeshError:
        sizes = {}
    try:
        chips = [t.chip_count or 1 for t in targets.parse_targets(args.target)] if getattr(
            args, "target", None) else []
    except targets.TargetError:
        chips = []
    rk_mesh.host_devices(max([math.prod(sizes.values()), *chips]))


def budget_bytes(text: str) -> int:
    """--budget in bytes; BadInput for a budget that does not parse, or a fraction (a
    fraction of no remat's peak is plan's)."""
    try:
        budget = parse_budget(text).bytes
    except BudgetError:
        try:
            fit_budget_bytes(text)  # the same refusal, offering sizes only
        except BudgetError as e:
            raise BadInput(f"--budget: {e}") from None
    if budget is None:
        raise BadInput(f"--budget must be a size such as 16GiB, not a fraction: got "
                       f"{text!r}")
    return budget


def source_and_sizes(args) -> tuple[Source, int, int]:
    """(the --config or --model source, batch, seq): the sizes from the flags, else the
    config file's or a (model, batch) FUNCTION's (seq None where its batch has no
    sequence axis), else the defaults (8, min(max_len, 1024)). BadInput as `load_source`,
    or where a config's model cannot take seq (`check_seq`)."""
    src = load_source(args)
    cfg = src.cfg
    batch = args.batch or src.defaults.get("batch", 8)
    seq = args.seq or src.defaults.get("seq", min(cfg.max_len, 1024) if cfg else 1024)
    if cfg is not None:
        check_seq(cfg, seq, "--seq" if args.seq else "seq_len")
    return src, batch, seq


def sizes_text(batch, seq) -> str:
    """"batch 8, seq 1024" for a title; "batch 8" where the batch has no sequence axis
    (seq None: a --model's images or latents); "the batch as declared" where its leaves share
    no leading axis (batch None)."""
    if batch is None:
        return "the batch as declared"
    return f"batch {batch}" + (f", seq {seq}" if seq is not None else "")


def targets_of(text: str | None) -> list:
    """The --target list as `Target`s, parsed here once for the whole command; JAX's
    default backend's if not given. Checks that libtpu is there and accepts each
    TPU topology, before anything is measured."""
    from remat_kit.measure import targets
    if text is None:
        return [targets.parse_target(None)]
    found = targets.parse_targets(text)
    for target in found:  # its devices made now, kept on it: a bad topology fails first
        if target.aot:
            _ = target.devices
    return found


def mesh_origin(work, asked, target) -> str | None:
    """Where the step's mesh came from, for every caption (`rk_mesh.compiled_step`):
    "the model's own mesh (5 axes ...; device order [0, 2, 1, 3])", "--mesh data:2
    (...)", or a TPU target's chips where neither gives one; None on one device.
    `work`: the Workload; `asked`: what `inputs.device_mesh` gave (a Mesh for --mesh, a
    `rk_mesh.Fallback` for the target's chips, or None)."""
    own = getattr(work, "own_mesh", None)
    if own is not None:
        return rk_mesh.origin(own, "the model's own mesh")
    mesh = rk_mesh.plain(asked)
    if mesh is None or mesh.size == 1:
        return None
    chips = isinstance(asked, rk_mesh.Fallback)
    slices = getattr(target, "slices", 1)
    across = f" over {slices} slices, data parallel across them" if slices > 1 else ""
    return rk_mesh.origin(mesh, f"the {mesh.size} chips of {target}, data parallel" if chips
                          else f"--mesh{across}")


def parameters_sharded(params, records) -> bool:
    """Whether the compiled programs take any parameter split over devices: a
    record's `parameter_bytes_per_device` (read from the compiled argument
    shardings: a `Record`'s, or a train step's `StepMemory`'s) below the bytes of
    `params` (the parameters' tree of ShapeDtypeStructs, global shapes) whole; where
    no record read it, whether the placed parameters say so. A caption claims
    sharded gradients only then."""
    leaves = jax.tree.leaves(params)
    whole = sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in leaves)
    read = [r.parameter_bytes_per_device for r in records
            if getattr(r, "parameter_bytes_per_device", None) is not None]
    if read:
        return min(read) < whole
    return any(rk_mesh.local_shape(x).shape != tuple(x.shape) for x in leaves)


def step_caption(step: str, mesh, params, records, origin: str | None = None) -> str:
    """What every report (compare, plan, fit) says was compiled (`rk_mesh.compiled_step`
    over `mesh`, with `origin`), claiming the gradients sharded like the parameters only
    where the compiled programs take them so (`parameters_sharded` of `params` and
    `records`); else "parameters and gradients whole on every device of ..."."""
    return rk_mesh.compiled_step(step, mesh, origin, parameters_sharded(params, records))


def plot_path(path: str, target, several: bool) -> str:
    """`path`, or with several targets one file per target: pareto_tpu_v5e_1x1.png."""
    if not several:
        return path
    stem, ext = os.path.splitext(path)
    return f"{stem}_{str(target).replace(':', '_')}{ext}"


__all__ = ["budget_bytes", "make_host_devices", "map_context", "mesh_origin",
           "parameters_sharded", "print_map", "source_and_sizes",
           "plot_path", "sizes_text", "step_caption", "targets_of"]
