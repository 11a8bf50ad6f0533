"""A model's pipeline, as its one trace shows it: layers run as stages over a mesh axis that
`ppermute` passes activations along, inside a loop of iterations.

`find` reads it (`Pipeline`): the stage axis and its size, the loop's iterations
(microbatches x repeats + stages - 1) and, where the loop's operands tell them, microbatches
and repeats apart; the schedule (`schedule_of`); the pipeline's own remat around each
iteration with the names it saves. The policy applies to the layers within a stage.
Docs: docs/models.md ("Pipelines").
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction

from remat_kit.errors import MeshError
from remat_kit.trace import wrapping
from remat_kit.trace.marked import region, sub_jaxprs
from remat_kit.trace.own_remat import policy_name

# What each schedule holds in flight, the words every report uses.
SCHEDULES = {
    "GPipe": "autodiff's backward of the forward loop: every stage holds every "
             "microbatch's residuals until the backward runs",
    "1F1B": "forward and backward passes interleaved (a backward written by hand): stage s "
            "holds min(stages - s, microbatches) microbatches in flight, the first the most",
    "unknown": "a hand-written backward (custom_vjp) decides what each stage holds: "
               "the compiled program's figures, no schedule assumed",
}


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """A pipeline found in a traced loss.

    Attributes:
      axis: the mesh axis the stages run over, e.g. "stage".
      stages: that axis's size.
      iterations: trips of the loop around the `ppermute` (one per stage step);
        the number of `ppermute`s where the loop is unrolled.
      schedule: "GPipe" or "unknown" as read (`schedule_of`), or "1F1B" where given
        (`SCHEDULES` says what each holds in flight).
      own_remat: the JAX policy of the pipeline's own remat around each iteration
        (`own_remat.policy_name`), "" where it has none.
      own_saves: the names that policy saves, e.g. ("decoder_layer_input",
        "iteration_input").
      told: the microbatches, read from the loop's operands (`microbatches_of`); None
        where they cannot be told from the repeats (then `microbatches` is their product).
    """

    axis: str
    stages: int
    iterations: int
    schedule: str = "GPipe"
    own_remat: str = ""
    own_saves: tuple[str, ...] = ()
    told: int | None = None

    @property
    def passes(self) -> int:
        """Microbatches x repeats: iterations - (stages - 1) (MaxText's `pipeline.py`
        runs microbatches x repeats + stages - 1 iterations)."""
        return max(self.iterations - self.stages + 1, 1)

    @property
    def microbatches(self) -> int:
        """The microbatches where told (`told`), else microbatches x repeats (`passes`)."""
        return self.told or self.passes

    @property
    def repeats(self) -> int | None:
        """Each stage's passes over its layers per microbatch (a circular pipeline's
        repeats), passes / microbatches; None where the microbatches are not told."""
        return self.passes // self.told if self.told else None

    @property
    def bubble(self) -> Fraction:
        """The idle share of each stage's iterations, (stages - 1) / (repeats x
        microbatches + stages - 1) (Huang et al. 2019, GPipe, section 2.2; Narayanan et
        al. 2021 for the repeats of an interleaved schedule)."""
        return Fraction(self.stages - 1, self.passes + self.stages - 1)

    def in_flight(self, stage: int) -> int | None:
        """Microbatch passes whose residuals `stage` (0 the first) holds at once: every
        one under GPipe (microbatches x repeats), min(stages - stage, microbatches)
        under 1F1B (Narayanan et al. 2021, section 2.2); None for "unknown"."""
        if self.schedule == "GPipe":
            return self.passes
        if self.schedule == "1F1B":
            return min(self.stages - stage, self.microbatches)
        return None

    def counts(self) -> str:
        """E.g. "4 microbatches, 2 repeats", or "8 microbatches x repeats (not told
        apart)" where the loop's operands do not tell them."""
        if self.told is None:
            return f"{self.passes} microbatches x repeats (not told apart)"
        return (f"{self.told} microbatches, {self.repeats} repeat"
                + ("s" if self.repeats != 1 else ""))

    def text(self) -> str:
        """E.g. "4 stages over stage, 4 microbatches, 1 repeat, GPipe (bubble 3/7 of the
        iterations, every microbatch in flight); no own remat per iteration; the policy
        applies to the layers within a stage"."""
        own = (f"own remat per iteration: jax.checkpoint({self.own_remat})"
               + (f" saves {', '.join(self.own_saves)}" if self.own_saves else "")
               if self.own_remat else "no own remat per iteration")
        held = {"GPipe": "every microbatch in flight",
                "1F1B": f"the first stage holds {self.in_flight(0)} microbatches in flight, "
                        "the last 1",
                "unknown": "a hand-written backward: schedule not told"}[self.schedule]
        return (f"{self.stages} stages over {self.axis}, {self.counts()}, {self.schedule} "
                f"(bubble {self.bubble} of the iterations, {held}); {own}; the policy "
                "applies to the layers within a stage")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {
            "microbatches": self.microbatches, "repeats": self.repeats,
            "bubble": float(self.bubble), "line": self.text(),
            "in_flight": [self.in_flight(s) for s in range(self.stages)]}


def saved_names(policy) -> tuple[str, ...]:
    """The checkpoint names a JAX policy saves, read from its closure
    (`save_only_these_names`, `save_from_both_policies` of such); () for others."""
    found: set[str] = set()
    seen: set[int] = set()

    def walk(x):
        if id(x) in seen:
            return
        seen.add(id(x))
        if isinstance(x, str):
            found.add(x)
        elif isinstance(x, (set, frozenset, tuple, list)):
            for y in x:
                walk(y)
        elif callable(x):
            for cell in getattr(x, "__closure__", None) or ():
                walk(cell.cell_contents)

    walk(policy)
    return tuple(sorted(found))


@dataclasses.dataclass(frozen=True)
class _Hit:
    """One `ppermute` inside a `shard_map`: its mesh, the loops around it (scan
    equations, outermost first), the remat policies around it, and whether a
    custom_vjp (a hand-written backward) holds it."""
    eqn: object
    mesh: object
    loops: tuple
    owns: tuple
    custom_vjp: bool


def _hits(jaxpr) -> list[_Hit]:
    """Every `ppermute` inside a `shard_map` in `jaxpr`, at any depth, in order."""
    hits: list[_Hit] = []

    def walk(jaxpr, mesh, loops: tuple, owns: tuple, custom: bool) -> None:
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if name == "ppermute" and mesh is not None:
                hits.append(_Hit(eqn, mesh, loops, owns, custom))
                continue
            r = region(eqn)
            own = owns + ((r[2],) if r is not None and not isinstance(r[2], wrapping.Marker)
                          else ())
            inner_mesh = eqn.params.get("mesh", mesh) if name == "shard_map" else mesh
            trips = loops + ((eqn,) if name == "scan" else ())
            for sub in sub_jaxprs(eqn):
                walk(sub, inner_mesh, trips, own, custom or name.startswith("custom_vjp"))

    walk(jaxpr, None, (), (), False)
    return hits


def schedule_of(hits: list[_Hit], stages: int) -> str:
    """"unknown" where a custom_vjp holds the pipeline (its backward is written by hand,
    as a 1F1B schedule's must be in JAX, so what a stage holds is not the forward's to
    say); else "GPipe": autodiff's backward of the forward loop keeps every iteration's
    residuals, whichever ways the loop's `ppermute`s pass (MaxText's circular buffers
    pass both ways under GPipe). "1F1B" is never read from a trace: give it with
    `dataclasses.replace(pipe, schedule="1F1B")`."""
    return "unknown" if any(h.custom_vjp for h in hits) else "GPipe"


def microbatches_of(loop, operand_shape: tuple, passes: int, stages: int) -> int | None:
    """The microbatches of a pipeline loop (a scan equation): the leading size m of the
    loop's operands shaped [m, *microbatch] (the microbatched input, the outputs; also
    [a, b, *microbatch], m = a x b, as MaxText stacks them over the stages), where the
    microbatch is what a stage passes on (`operand_shape`, or it less a leading stage
    dimension of 1) and m divides microbatches x repeats (`passes`). A stage buffer
    [stages, *microbatch] that a loop carries is not counted. None where no one size
    fits, or several do."""
    if loop is None:
        return None
    micro = {tuple(operand_shape)} | ({tuple(operand_shape[1:])} if operand_shape[:1] == (1,)
                                      else set())
    _, carry, _ = loop.params["ft_in"].update(loop.invars).unpack()  # jax 0.12's scan
    carried = {id(v) for v in carry}  # by identity: a Literal operand is not hashable
    found = set()
    for v in loop.invars:
        shape = tuple(getattr(v.aval, "shape", ()))
        for lead in (1, 2):
            if shape[lead:] not in micro or len(shape) <= lead:
                continue
            m = shape[0] * (shape[1] if lead == 2 else 1)
            stage_buffer = lead == 1 and m == stages and id(v) in carried and (1,) == tuple(
                operand_shape[:1])
            if not stage_buffer and passes % m == 0:
                found.add(m)
    if len(found) > 1:  # a carried [1, *microbatch] stage buffer reads as one microbatch
        found.discard(1)
    return found.pop() if len(found) == 1 else None


def find(jaxpr) -> Pipeline | None:
    """The pipeline in a traced loss: the first `ppermute` inside a `shard_map`, its
    axis's size there, the trips of the innermost loop around it, the microbatches its
    operands tell, the schedule (`schedule_of`) and the model's own remat region around
    it; None where the loss passes nothing along a mesh axis.

    Raises:
      MeshError: a `ppermute` names a stage at or past its axis's size (a model that
        builds its mesh over fewer devices than its stages).
    """
    hits = _hits(jaxpr)
    if not hits:
        return None
    first = hits[0]
    names = first.eqn.params["axis_name"]
    axis = names[0] if isinstance(names, tuple) else names
    stages = dict(first.mesh.shape)[axis]
    reach = max((max(pair) for pair in first.eqn.params["perm"]), default=0)
    if reach >= stages:
        raise MeshError(f"the pipeline passes to stage {reach} along mesh axis {axis!r}, which "
                        f"has {stages} device(s) in the model's mesh: a stage index must be "
                        f"below the axis's size; build the mesh with at least {reach + 1} "
                        f"devices on {axis!r} (on CPU: XLA_FLAGS=--xla_force_host_platform_"
                        f"device_count={reach + 1})")
    loop = first.loops[-1] if first.loops else None
    iterations = loop.params["length"] if loop is not None else sum(
        1 for h in hits if h.eqn.params["axis_name"] == names)
    passes = max(iterations - stages + 1, 1)
    told = microbatches_of(loop, first.eqn.invars[0].aval.shape, passes, stages)
    policy = first.owns[-1] if first.owns else None
    return Pipeline(str(axis), stages, iterations, schedule_of(hits, stages),
                    own_remat=policy_name(policy) if first.owns else "",
                    own_saves=saved_names(policy) if first.owns else (), told=told)


__all__ = ["SCHEDULES", "Pipeline", "find", "microbatches_of", "saved_names", "schedule_of"]
