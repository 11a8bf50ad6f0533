"""What a compile that will not run gave, kept for a repeated run.

JAX cannot load back an executable compiled ahead of time for devices this machine lacks, so the
figures the reports read from a compile (memory, FLOPs, predicted time, notes) are kept as one
sealed JSON file per program, beside JAX's cache, keyed by the program and what reads it.
Main names: `lookup`, `key`, `load`, `store`, `folder`, `FORMAT`, `MAX_ENTRIES`.
The key, eviction and the check on read: docs/speed.md ("What a repeated run reuses").
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import json
import os
import threading
import time

import jax

from remat_kit.measure import audit
from remat_kit.measure import boundary
from remat_kit.measure import buffers
from remat_kit.measure import chip_peaks
from remat_kit.measure import costs
from remat_kit.measure import gpu_calls
from remat_kit.measure import kernels
from remat_kit.measure import loops
from remat_kit.measure import peak
from remat_kit.measure import sealed
from remat_kit.measure import targets
from remat_kit.measure import time_checks
from remat_kit.measure import time_model

FORMAT = 2  # bump when what is stored, or how it is computed, changes
# Entries are ~1 KB; past this many, the least recently used half is removed.
MAX_ENTRIES = 20_000
# A temporary file this old is a dead writer's, not one being written.
STALE_SECONDS = 3600
# The environment variables that change what XLA compiles.
COMPILER_FLAGS = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")

_FIGURES = {"memory": sealed.mapping(sealed.optional(sealed.count)),
            "flops": sealed.optional(sealed.amount),
            "transcendentals": sealed.optional(sealed.amount)}
# What `measure` keeps of a compile, and what `targets.compile_for` keeps. Every field
# required: an entry an older version wrote without one (no audit facts, no parameter bytes)
# is a miss, not a record missing them.
MEASURED: sealed.Schema = {**_FIGURES, "predicted_seconds": sealed.optional(sealed.amount),
                           "kernel_flops": sealed.amount,
                           "cost_notes": sealed.texts, "time_notes": sealed.texts,
                           "compiled_audit": sealed.mapping(lambda _: True),
                           "parameter_bytes": sealed.optional(sealed.count)}
COMPILED: sealed.Schema = {**_FIGURES, "notes": sealed.texts, "kernel_seconds": sealed.amount,
                           "argument_bytes": sealed.optional(
                               lambda x: isinstance(x, list) and all(map(sealed.count, x)))}


@functools.cache
def _code() -> str:
    """A digest of the code that turns a compile into figures."""
    return hashlib.sha256("".join(inspect.getsource(m) for m in (
        audit, boundary, buffers, chip_peaks, costs, gpu_calls, kernels, loops, peak, targets,
        time_checks, time_model)).encode()).hexdigest()


def folder() -> str | None:
    """Where figures are kept: JAX's compilation cache folder + "-figures"; None if
    unset or not a folder."""
    base = jax.config.jax_compilation_cache_dir
    if not base or (os.path.exists(base) and not os.path.isdir(base)):
        return None  # none set, or a file (/dev/null): JAX keeps nothing there either
    return f"{base.rstrip(os.sep)}-figures"


def key(lowered_text: str, target: "targets.Target", options: dict | None,
        kind: str, runs: bool = False, program=None) -> str | None:
    """The program's key, or None where figures are not kept: an executable
    that will run (`runs`, on devices this machine has) or no cache folder.
    kind names what is stored (a `measure` record's figures, a
    `lowering.compile_for`'s). program: the ClosedJaxpr lowered to `lowered_text`,
    where it holds kernels: their pricing (`kernels.price`) joins the key, as the
    text lacks what it reads (a cuDNN call's mask type and window, a splash
    mask's values, a Pallas cost estimate)."""
    if (runs and not target.aot) or folder() is None:
        return None
    priced = (repr(kernels.price(program, target.platform)) if program is not None
              and kernels.has_kernels(lowered_text) else "")
    parts = (FORMAT, _code(), kind, compiler_parts(target, options), lowered_text, priced)
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def compiler_parts(target: "targets.Target", options: dict | None) -> list:
    """What a compile depends on besides the program, as the cache keys hold it:
    the target, the compiler and JAX versions, the compile `options`, the
    target's roofline figures and the compiler flags in the environment
    (`COMPILER_FLAGS`). The plan cache keys its plans by the same parts
    (`remat_kit.decide.planner_compiles.PlannerCompiles.fingerprint`)."""
    return [str(target), sorted(target.versions.items()),
            sorted((options or {}).items()), repr(target.roofline),
            [os.environ.get(v, "") for v in COMPILER_FLAGS]]


def lookup(lowered_text: str, target: "targets.Target", options: dict | None,
           kind: str, runs: bool = False, schema: sealed.Schema = MEASURED,
           program=None) -> tuple[str | None, dict | None]:
    """(the program's `key`, the figures kept under it or None): what a compile
    site asks before compiling; it `store`s under the key after a miss.
    schema: what the figures hold (`MEASURED`, `COMPILED`), checked by `load`.
    program: the lowered ClosedJaxpr, whose kernels' pricing joins the key (`key`)."""
    program_key = key(lowered_text, target, options, kind, runs, program)
    return program_key, load(program_key, schema)


def load(program_key: str | None, schema: sealed.Schema | None = None) -> dict | None:
    """The figures stored under `program_key`; None on a miss, an unreadable
    file, or an entry that fails its checksum or `schema` (`sealed.unseal`)."""
    if program_key is None:
        return None
    path = os.path.join(folder(), f"{program_key}.json")
    try:
        with open(path) as f:
            figures = sealed.unseal(json.load(f), schema or {})
        if figures is not None:
            os.utime(path)  # recently used: kept when the folder is pruned
        return figures
    except (OSError, ValueError):
        return None


def store(program_key: str | None, figures: dict) -> None:
    """Writes `figures` (JSON-ready) under `program_key`, atomically; a folder that
    cannot be written loses the entry, never the measurement."""
    if program_key is None:
        return
    path = os.path.join(folder(), f"{program_key}.json")
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"  # a writer's own, then renamed
    try:
        os.makedirs(folder(), exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(sealed.seal(figures), f)
        os.replace(tmp, path)
        _prune(folder())
    except OSError:
        with contextlib.suppress(OSError):
            os.remove(tmp)  # a full disk: no half-written file stays behind


def _prune(where: str) -> None:
    """Removes temporary files `STALE_SECONDS` old; past `MAX_ENTRIES` files,
    the least recently used half."""
    with os.scandir(where) as it:
        found = list(it)
    entries = [e for e in found if e.name.endswith(".json")]
    now = time.time()
    for e in found:
        with contextlib.suppress(OSError):  # another process removed it first
            if e.name.endswith(".tmp") and now - e.stat().st_mtime > STALE_SECONDS:
                os.remove(e.path)
    if len(entries) <= MAX_ENTRIES:
        return
    entries.sort(key=lambda e: e.stat().st_mtime)
    for e in entries[:len(entries) - MAX_ENTRIES // 2]:
        try:
            os.remove(e.path)
        except OSError:  # another process removed it first
            pass


__all__ = ["COMPILED", "COMPILER_FLAGS", "FORMAT", "MAX_ENTRIES", "MEASURED", "STALE_SECONDS",
           "compiler_parts", "folder", "key", "load", "lookup", "store"]
