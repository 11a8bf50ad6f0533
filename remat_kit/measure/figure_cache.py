"""What a compile that will not run gave, kept for a repeated run.

JAX's persistent compilation cache cannot load back an executable compiled
ahead of time for devices this machine lacks (a TPU or GPU target: "PjRtCompiler
must be constructed with a Client to call DeserializeLoadedExecutable"), so
a repeated `remat-kit compare --target tpu:v5e:1x1` would compile every
program again, 1-3 minutes each for gpt2_small on 2 cores. What the reports
read from such a compile is kept instead: XLA's memory figures, the FLOPs,
the time model's step time, and their notes, one JSON file per program.
A CPU program that is only measured is kept the same way: reading the
figures back skips loading the executable from JAX's cache and reading its
HLO again (0.4-0.6 s of the ~3 s a cached gpt2_small program took).

The key is a SHA-256 of the lowered program's text (StableHLO, with its
shardings), the target, the compiler and JAX versions, the compile options,
the target's roofline figures, $XLA_FLAGS and $LIBTPU_INIT_ARGS, `FORMAT` and the source of the modules that
compute the figures (`costs`, `peak`, `targets`, `time_model`): any change to the
program or to what reads it misses. A hit skips the compile; residuals
still come from the traced program. The folder sits beside JAX's cache
(`cli.use_compile_cache`: $REMAT_KIT_COMPILE_CACHE, then "-figures"); with
no JAX cache folder set nothing is kept. Past `MAX_ENTRIES` files the least
recently used half is removed.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os

import jax

from remat_kit.measure import costs
from remat_kit.measure import peak
from remat_kit.measure import targets
from remat_kit.measure import time_model

FORMAT = 1  # bump when what is stored, or how it is computed, changes
# Entries are ~1 KB; past this many, the least recently used half is removed.
MAX_ENTRIES = 20_000


@functools.cache
def _code() -> str:
    """A digest of the code that turns a compile into figures."""
    return hashlib.sha256("".join(inspect.getsource(m) for m in (costs, peak, targets, time_model))
                          .encode()).hexdigest()


def folder() -> str | None:
    """Where figures are kept: JAX's compilation cache folder + "-figures"; None if unset."""
    base = jax.config.jax_compilation_cache_dir
    return f"{base.rstrip(os.sep)}-figures" if base else None


def key(lowered_text: str, target: "targets.Target", options: dict | None,
        kind: str, runs: bool = False) -> str | None:
    """The program's key, or None where figures are not kept: an executable
    that will run (`runs`, on devices this machine has) or no cache folder.
    kind names what is stored (a `measure` record's figures, a
    `lowering.compile_for`'s)."""
    if (runs and not target.aot) or folder() is None:
        return None
    parts = (FORMAT, _code(), kind, str(target), sorted(targets.versions(target).items()),
             sorted((options or {}).items()), repr(time_model.roofline(target)),
             [os.environ.get(v, "") for v in ("XLA_FLAGS", "LIBTPU_INIT_ARGS")], lowered_text)
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def lookup(lowered_text: str, target: "targets.Target", options: dict | None,
           kind: str, runs: bool = False) -> tuple[str | None, dict | None]:
    """(the program's `key`, the figures kept under it or None): what a compile
    site asks before compiling; it `store`s under the key after a miss."""
    program_key = key(lowered_text, target, options, kind, runs)
    return program_key, load(program_key)


def load(program_key: str | None) -> dict | None:
    """The figures stored under `program_key`; None on a miss or an unreadable file."""
    if program_key is None:
        return None
    path = os.path.join(folder(), f"{program_key}.json")
    try:
        with open(path) as f:
            figures = json.load(f)
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
    try:
        os.makedirs(folder(), exist_ok=True)
        with open(f"{path}.{os.getpid()}.tmp", "w") as f:
            json.dump(figures, f)
        os.replace(f"{path}.{os.getpid()}.tmp", path)
        _prune(folder())
    except OSError:
        pass


def _prune(where: str) -> None:
    """Past `MAX_ENTRIES` files, removes the least recently used half."""
    with os.scandir(where) as it:
        entries = [e for e in it if e.name.endswith(".json")]
    if len(entries) <= MAX_ENTRIES:
        return
    entries.sort(key=lambda e: e.stat().st_mtime)
    for e in entries[:len(entries) - MAX_ENTRIES // 2]:
        try:
            os.remove(e.path)
        except OSError:  # another process removed it first
            pass


__all__ = ["FORMAT", "MAX_ENTRIES", "folder", "key", "load", "lookup", "store"]
