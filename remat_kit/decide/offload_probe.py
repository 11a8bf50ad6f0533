"""The offload probe: what the compiler really does with an offloaded residual, on this model.

XLA's TPU and GPU compiles keep part of an offloaded residual on the device, so before the planner
trusts offload it compiles the user's loss twice, a tag set offloaded and saved (`probe`), and
takes figure = (peak saving - peak offloading) / bytes offloaded: 1 frees all, 0 nothing.
The cost model charges (1 - figure) of an offloaded byte to the device (`Probe.pays` if > 0).
The figure, measured values and the CPU case: docs/plan.md ("Offload").
"""

from __future__ import annotations

import dataclasses
import re

from remat_kit.errors import shorten
from remat_kit.measure import figure_cache
from remat_kit.measure import sealed
from remat_kit.measure.lowering import compile_options
from remat_kit.policy.policy import Policy
from remat_kit.trace.validate import tag_of

CPU_OFFLOAD_NOTE = ("on the CPU host memory is device memory: its compile counts offloaded "
                    "residuals in temp as it counts saved ones, so the offload probe's figure "
                    "there is only how XLA's CPU buffer assignment differs between the two "
                    "compiles (0.000 to 0.098 on the tiny GPT-2), not what a TPU or GPU does")

# What a probe keeps: the two compiles' device memory and the bytes offloaded.
SCHEMA: sealed.Schema = {"saved_bytes": sealed.count, "offloaded_device_bytes": sealed.count,
                         "offloaded_bytes": sealed.count}


@dataclasses.dataclass(frozen=True)
class Probe:
    """One offload probe's compiles.

    Attributes:
      target: the target compiled for (e.g. "tpu:v5e:1x1").
      stack: "scanned" (the tags are in a scan body) or "unrolled".
      tags: the tag set offloaded, and saved in the twin.
      saved_bytes: device memory (the planner's `memory_kind`, bytes) saving `tags`.
      offloaded_device_bytes: device memory offloading them instead.
      offloaded_bytes: residual bytes the offload compile placed in host memory.
      cached: the figures came from the figure cache (no compile).
      unfit: "" where both compiles gave a figure; else why one did not, e.g. the
        program does not fit the chip: no figure (0), offload not planned, and the
        bytes of a compile that failed are 0.
    """

    target: str
    stack: str
    tags: tuple
    saved_bytes: int
    offloaded_device_bytes: int
    offloaded_bytes: int
    cached: bool = False
    unfit: str = ""

    @property
    def figure(self) -> float:
        """Device bytes removed per byte offloaded (1 ideal, 0 none, < 0 the peak rose);
        0 where nothing was offloaded or a compile gave no figure (`unfit`)."""
        if not self.offloaded_bytes or self.unfit:
            return 0.0
        return (self.saved_bytes - self.offloaded_device_bytes) / self.offloaded_bytes

    @property
    def pays(self) -> bool:
        """Whether offload lowers device memory at all (figure > 0): else not planned."""
        return self.figure > 0

    def predict(self, saving_bytes: int, offloaded_bytes: int) -> int:
        """Device memory (bytes) of a plan that offloads `offloaded_bytes` of residuals,
        from the compiled memory of the same plan with them saved (`saving_bytes`)."""
        return saving_bytes - round(self.figure * offloaded_bytes)

    @property
    def note(self) -> str:
        """One line: the figure, the compiles behind it, and what the planner does with it."""
        if self.unfit:
            return (f"offload probe ({self.target}, {self.stack} stack, {', '.join(self.tags)}):"
                    f" {self.unfit}, so what offload frees on this model is not measured and "
                    "offload is not planned; plan a smaller batch or seq to probe it")
        verdict = (f"each offloaded byte is charged {1 - self.figure:.3f} device bytes"
                   if self.pays else "offload does not pay here and is not planned")
        return (f"offload probe ({self.target}, {self.stack} stack, {', '.join(self.tags)}): "
                f"offloading {self.offloaded_bytes:,} bytes gave {self.offloaded_device_bytes:,}"
                f" device bytes against {self.saved_bytes:,} saving them: {self.figure:.3f} "
                f"removed per byte offloaded; {verdict}"
                + (" (cached)" if self.cached else ""))


def stack_kind(program) -> str:
    """"scanned" where a tag of `program` (`cost_model.Program`) is inside a scan
    body's remat region, else "unrolled"."""
    inside = any(n.region is not None and program.regions[n.region]
                 for n in program.nodes if tag_of(n.eqn) is not None)
    return "scanned" if inside else "unrolled"


def probe_tags(model) -> tuple:
    """The tag set a probe offloads: the items of `model` (a uniform `CostModel`)
    the backward pass reads, the plan may decide, and that have bytes."""
    return tuple(t for t in model.tags
                 if t in model.needed and t not in model.fixed and model.nbytes[t])


def probe(model, compiles) -> Probe:
    """Compiles the planner's loss with its decided tags offloaded and saved (two
    compiles, or none on a figure cache hit) and returns the `Probe`.

    model: the planner's offload-free uniform `CostModel` (the tags probed).
    compiles: its `PlannerCompiles` (the `target`, `program`, `fingerprint`
      and `record_of` compiled with).
    A compile that gives no memory figure (the program does not fit the chip:
    XLA's RESOURCE_EXHAUSTED at compile time) is an answer, not a failure: the
    `Probe` says so in `unfit` and offload is not planned. It is not cached.
    """
    tags = probe_tags(model)
    stack = stack_kind(compiles.program)
    target = compiles.target
    program_key, kept = figure_cache.lookup(
        f"{compiles.fingerprint()}|{stack}|{','.join(tags)}", target,
        compile_options(target, True), "offload_probe", schema=SCHEMA)
    if kept is not None:
        return Probe(str(target), stack, tags, cached=True, **{k: kept[k] for k in SCHEMA})
    saved, offloaded = (compiles.record_of(Policy(save=frozenset(tags))),
                        compiles.record_of(Policy(offload=frozenset(tags))))
    figures = {"saved_bytes": saved.memory_bytes or 0,
               "offloaded_device_bytes": offloaded.memory_bytes or 0,
               "offloaded_bytes": offloaded.offloaded_bytes or 0}
    failed = [r for r in (saved, offloaded) if r.error or r.memory_bytes is None]
    if failed:
        return Probe(str(target), stack, tags, **figures, unfit="; ".join(
            f"its compile of {r.policy!r} gave no memory figure ({_reason(r.error)})"
            for r in failed))
    figure_cache.store(program_key, figures)
    return Probe(str(target), stack, tags, **figures)


def _reason(error: str | None) -> str:
    """A compile's error in a few words: XLA's out-of-memory line without its codes."""
    if not error:
        return "the backend reports none"
    text = " ".join(error.split())
    if "RESOURCE_EXHAUSTED" in text:
        detail = text.split("RESOURCE_EXHAUSTED:", 1)[1].strip()
        return "it does not fit the chip: " + shorten(re.sub(r"^E\d+: \w+: ", "", detail), 100)
    return shorten(text, 100)


__all__ = ["CPU_OFFLOAD_NOTE", "Probe", "SCHEMA", "probe", "probe_tags", "stack_kind"]
