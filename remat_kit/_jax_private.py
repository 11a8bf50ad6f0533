"""Every import from jax._src, in one place, behind version checks.

JAX's public API does not return saved residuals, cost one computation of a compiled module,
say which accelerators are attached, skip the compilation cache for one compile or trace cuDNN
attention without cuDNN; the private names that do live here (and `scan_parts`, which reads a
scan equation in jax 0.11 and 0.12). If a JAX release moves any, only this module changes.
Why each is needed: docs/architecture.md (after the parts' list).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence

import jax
import numpy as np

_MIN, _MAX = (0, 11), (0, 13)
_version = tuple(int(p) for p in jax.__version__.split(".")[:2])
if not _MIN <= _version < _MAX:
    raise ImportError(f"remat_kit needs jax >= {_MIN[0]}.{_MIN[1]} and < {_MAX[0]}.{_MAX[1]} "
                      f"(it reads jax._src.ad_checkpoint.saved_residuals); found {jax.__version__}")

from jax._src.ad_checkpoint import saved_residuals  # noqa: E402
if _version >= (0, 12):
    from jax.ad_checkpoint import name_p  # noqa: E402
else:
    from jax._src.ad_checkpoint import name_p  # noqa: E402
from jax._src import compilation_cache as _compilation_cache  # noqa: E402
from jax._src import config as _config  # noqa: E402
from jax._src import hardware_utils  # noqa: E402
from jax._src.lib import _jax, hlo  # noqa: E402
from jax._src.nn import functions as _nn_functions  # noqa: E402
from jax._src.cudnn import fused_attention_stablehlo as _cudnn_attention  # noqa: E402


def hlo_text_cost_analysis(text: str, client) -> dict[str, float]:
    """XLA's HloCostAnalysis of an HLO module given as text.

    Args:
      text: an HLO module in text form (as `Compiled.as_text()` prints it).
      client: the XLA client whose cost model to use, e.g. `jax.devices()[0].client`.
    Returns:
      {"flops": ..., "transcendentals": ..., "bytes accessed": ..., ...}; while
      loop bodies are counted once.
    Raises:
      jax.errors.JaxRuntimeError: the text does not parse as an HLO module.
    """
    return _jax.hlo_module_cost_analysis(client, hlo.hlo_module_from_text(text))


def hlo_module_from_proto(serialized: bytes):
    """An HLO module (`jaxlib._hlo.HloModule`) from its serialized `HloModuleProto`."""
    return hlo.HloModule.from_serialized_hlo_module_proto(serialized)


def hlo_module(compiled):
    """The optimized HLO module of a JAX `Compiled` (`jaxlib._hlo.HloModule`): its
    runtime executable's, or parsed from `compiled.as_text()` where there is none
    (a target compiled ahead of time)."""
    try:
        return compiled.runtime_executable().hlo_modules()[0]
    except Exception:  # noqa: BLE001 - no runtime half: read the text XLA printed
        return hlo.hlo_module_from_text(compiled.as_text())


def scan_parts(eqn) -> tuple:
    """(body Jaxpr, body consts, num_consts, num_carry) of a `scan` equation, under
    every jax release remat_kit supports. The equation's inputs are
    [*consts, *carry, *xs]; the body's inputs the same, one slice of each xs.

    Raises:
      ValueError: `eqn` is not a scan equation.
    """
    if eqn.primitive.name != "scan":
        raise ValueError(f"scan_parts reads a scan equation, got {eqn.primitive.name}")
    p = eqn.params
    body = p["jaxpr"]
    consts = tuple(getattr(body, "consts", ()))
    body = getattr(body, "jaxpr", body)  # 0.11: ClosedJaxpr; 0.12: Jaxpr
    if "ft_in" in p:  # jax 0.12: a flat tree of (consts, carry, xs)
        nc, ncarry, _ = (len(part) for part in p["ft_in"].unpack())
    else:
        nc, ncarry = p["num_consts"], p["num_carry"]
    return body, consts, nc, ncarry


def has_nvidia_gpu() -> bool:
    """True if this machine shows an NVIDIA GPU device file."""
    return hardware_utils.has_visible_nvidia_gpu()


def num_tpu_chips() -> int:
    """TPU chips attached to this machine through PCI (0 on a machine without a TPU)."""
    return hardware_utils.num_available_tpu_chips_and_device_id()[0]


# Threads inside `without_compilation_cache`. jax 0.12 decides once per process whether
# the persistent cache is used (`compilation_cache.is_cache_used` memoizes its first
# answer), so its `enable_compilation_cache` flag set later is not seen: the check
# itself is wrapped to answer False in these threads.
_UNCACHED = threading.local()


def _guard_cache_check() -> None:
    if getattr(_compilation_cache.is_cache_used, "_remat_kit", False):
        return
    original = _compilation_cache.is_cache_used

    def is_cache_used(backend):
        return False if getattr(_UNCACHED, "on", False) else original(backend)

    is_cache_used._remat_kit = True
    _compilation_cache.is_cache_used = is_cache_used


@contextlib.contextmanager
def without_compilation_cache():
    """A context (this thread only) in which compiles neither read nor write JAX's
    persistent compilation cache: XLA itself runs, e.g. to write its dump."""
    _guard_cache_check()
    before, _UNCACHED.on = getattr(_UNCACHED, "on", False), True
    try:
        with _config.enable_compilation_cache(False):
            yield
    finally:
        _UNCACHED.on = before


def cudnn_version() -> int | None:
    """The cuDNN library's version JAX finds (e.g. 91900), or None where it finds none."""
    try:
        return int(_cudnn_attention.check_cudnn_version())
    except (RuntimeError, AttributeError):
        return None


_SWAP = threading.Lock()
_SWAPPED = {"depth": 0, "original": None}


@contextlib.contextmanager
def replacing_cudnn_attention(stand_in):
    """A context (the whole process: tracing may run on any thread) in which
    `jax.nn.dot_product_attention(implementation="cudnn")` calls `stand_in`, with the
    arguments of jax's cuDNN `dot_product_attention`; nested uses keep the outermost
    stand-in. The original is restored when the outermost context exits."""
    with _SWAP:
        if _SWAPPED["depth"] == 0:
            _SWAPPED["original"] = _nn_functions.cudnn_dot_product_attention
            _nn_functions.cudnn_dot_product_attention = stand_in
        _SWAPPED["depth"] += 1
    try:
        yield
    finally:
        with _SWAP:
            _SWAPPED["depth"] -= 1
            if _SWAPPED["depth"] == 0:
                _nn_functions.cudnn_dot_product_attention = _SWAPPED["original"]


def compile_request(lowered, options: dict | None) -> tuple[bytes, bytes, list[int]] | None:
    """What `lowered.compile(options)` hands XLA, as bytes another process can compile:
    (the StableHLO module's bytecode, the serialized `CompileOptions` JAX builds for it,
    the ids of its devices in order); None for a program another process cannot compile
    (host callbacks, shape polymorphism). Built as `pxla.UnloadedMeshExecutable.from_hlo`
    builds them (jax 0.12)."""
    from jax._src.interpreters import mlir, pxla

    computation = lowered._lowering
    args = computation.compile_args
    if args.get("host_callbacks") or getattr(args.get("shape_poly_state"), "uses_dim_vars",
                                             False):
        return None
    devices = computation._device_list
    ins = tuple(pxla.maybe_concretize_mesh(s, devices) for s in args["in_shardings"])
    outs = tuple(pxla.maybe_concretize_mesh(s, devices) for s in args["out_shardings"])
    to_inputs, to_outputs = pxla.get_prop_to_input_output(ins, outs, len(args["ordered_effects"]))
    kvs = dict(computation._compiler_options_kvs + tuple((options or {}).items()))
    placed = np.empty(len(devices), dtype=object)
    placed[:] = list(devices)
    made = pxla.create_compile_options(computation._hlo, args["tuple_args"], to_inputs,
                                       to_outputs, args["backend"], placed, kvs)
    return (mlir.module_to_bytecode(computation._hlo), made.SerializeAsString(),
            [d.id for d in devices])


def lowered_shardings(lowered) -> tuple | None:
    """(`input_shardings`, `out_info`) as `lowered.compile()` would report them, where the
    lowering fixes them: every argument's and result's sharding given, or one device
    (replicated there); None where XLA's propagation would choose some. Read as
    `stages.Lowered.out_info` and `Compiled.input_shardings` read theirs (jax 0.12)."""
    from jax._src.sharding_impls import GSPMDSharding, UnspecifiedValue

    computation = lowered._lowering
    args, devices = computation.compile_args, computation._device_list

    def fixed(sharding):
        if not isinstance(sharding, UnspecifiedValue):
            return sharding
        return GSPMDSharding.get_replicated(devices) if len(devices) == 1 else None

    ins = [fixed(s) for s in args["in_shardings"]]
    outs = [fixed(s) for s in args["out_shardings"]]
    if any(s is None for s in ins + outs):
        return None
    skip = len(computation.const_args)
    ins = ins[skip:]
    if lowered.in_tree.num_leaves > len(ins):  # arguments the program never reads
        given = iter(ins)
        ins = [next(given) if i + skip in args["kept_var_idx"] else None
               for i in range(lowered.in_tree.num_leaves)]
    out_info = [jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=s)
                for o, s in zip(args["global_out_avals"], outs)]
    return lowered.in_tree.unflatten(ins), lowered.out_tree.unflatten(out_info)


def compile_module(module: bytes, options: bytes, devices: Sequence):
    """XLA's executable of a `compile_request` on `devices` (the same ids, this process's
    backend or a topology's, e.g. `targets.Target.devices`), past JAX's persistent cache:
    `get_hlo_text()`, `cost_analysis()`, `get_compiled_memory_stats()`."""
    from jax._src import compiler
    from jax._src.interpreters import mlir
    from jax._src.lib import _jax as xc
    from jax._src.lib.mlir import ir

    with mlir.make_ir_context():
        parsed = ir.Module.parse(module)
        return compiler.backend_compile_and_load(
            devices[0].client, parsed, xc.DeviceList(tuple(devices)),
            xc.CompileOptions.ParseFromString(options), [])


__all__ = ["compile_module", "compile_request", "cudnn_version", "has_nvidia_gpu", "hlo_module",
           "hlo_module_from_proto", "hlo_text_cost_analysis", "lowered_shardings", "name_p",
           "num_tpu_chips", "replacing_cudnn_attention", "saved_residuals", "scan_parts",
           "without_compilation_cache"]
