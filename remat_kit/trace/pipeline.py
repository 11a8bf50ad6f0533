"""A model's pipeline, as its one trace shows it: layers run as stages over a mesh axis that
`ppermute` passes activations along, inside a loop of iterations.

`find` reads it (`Pipeline`): the stage axis and its size, the iterations of the loop around
the `ppermute` (microbatches x repeats + stages - 1), the schedule, and the pipeline's own remat
around each iteration with the names its policy saves (MaxText's `iteration_input` and
`decoder_layer_input`). The policy under test applies to the layers within a stage.
Docs: docs/models.md ("Pipelines").
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction

from remat_kit.trace import wrapping
from remat_kit.trace.marked import region, sub_jaxprs
from remat_kit.trace.own_remat import policy_name


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """A pipeline found in a traced loss.

    Attributes:
      axis: the mesh axis the stages run over, e.g. "stage".
      stages: that axis's size.
      iterations: trips of the loop around the `ppermute` (one per stage step);
        the number of `ppermute`s where the loop is unrolled.
      schedule: "GPipe": the backward pass is autodiff's of the forward loop, so
        every microbatch's residuals are held until the backward runs.
      own_remat: the JAX policy of the pipeline's own remat around each iteration
        (`own_remat.policy_name`), "" where it has none.
      own_saves: the names that policy saves, e.g. ("decoder_layer_input",
        "iteration_input").
    """

    axis: str
    stages: int
    iterations: int
    schedule: str = "GPipe"
    own_remat: str = ""
    own_saves: tuple[str, ...] = ()

    @property
    def microbatches(self) -> int:
        """Microbatches x repeats: iterations - (stages - 1) (MaxText's
        `pipeline.py` runs microbatches x repeats + stages - 1 iterations)."""
        return max(self.iterations - self.stages + 1, 1)

    @property
    def bubble(self) -> Fraction:
        """The idle share of each stage's iterations, (stages - 1) / (microbatches x
        repeats + stages - 1) (Huang et al. 2019, GPipe, section 2.2)."""
        return Fraction(self.stages - 1, self.microbatches + self.stages - 1)

    def text(self) -> str:
        """E.g. "4 stages over stage, 4 microbatches, GPipe (bubble 3/7 of the
        iterations); own remat per iteration saves iteration_input, decoder_layer_input;
        the policy applies to the layers within a stage"."""
        own = (f"own remat per iteration: jax.checkpoint({self.own_remat})"
               + (f" saves {', '.join(self.own_saves)}" if self.own_saves else "")
               if self.own_remat else "no own remat per iteration")
        return (f"{self.stages} stages over {self.axis}, {self.microbatches} microbatches "
                f"(x repeats), {self.schedule} (bubble {self.bubble} of the iterations, "
                f"every microbatch in flight); {own}; the policy applies to the layers "
                "within a stage")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"microbatches": self.microbatches,
                                           "bubble": float(self.bubble), "line": self.text()}


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


def find(jaxpr) -> Pipeline | None:
    """The pipeline in a traced loss: the first `ppermute` inside a `shard_map`, its
    axis's size there, the trips of the innermost loop around it and the model's own
    remat region around it; None where the loss passes nothing along a mesh axis."""
    hits = []

    def walk(jaxpr, mesh, loops: tuple, owns: tuple) -> None:
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if name == "ppermute" and mesh is not None:
                hits.append((eqn, mesh, loops, owns))
                continue
            r = region(eqn)
            own = owns + ((r[2],) if r is not None and not isinstance(r[2], wrapping.Marker)
                          else ())
            inner_mesh = eqn.params.get("mesh", mesh) if name == "shard_map" else mesh
            trips = loops + ((eqn.params["length"],) if name == "scan" else ())
            for sub in sub_jaxprs(eqn):
                walk(sub, inner_mesh, trips, own)

    walk(jaxpr, None, (), ())
    if not hits:
        return None
    eqn, mesh, loops, owns = hits[0]
    names = eqn.params["axis_name"]
    axis = names[0] if isinstance(names, tuple) else names
    stages = dict(mesh.shape)[axis]
    iterations = loops[-1] if loops else sum(1 for h in hits if h[0].params["axis_name"]
                                             == names)
    policy = owns[-1] if owns else None
    return Pipeline(str(axis), stages, iterations,
                    own_remat=policy_name(policy) if owns else "",
                    own_saves=saved_names(policy) if owns else ())


__all__ = ["Pipeline", "find", "saved_names"]
