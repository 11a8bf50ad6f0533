"""The model map: what a model's layers are, as remat_kit found them in its one trace.

`ModelMap`: every stack of layers (`Stack`, unrolled or scanned), each `Layer`'s class and
structure, the model's own remat, and what runs outside every layer under every policy. The
providers put it on the `Workload`; every report prints `ModelMap.line()` first, `--json` carries
`to_dict()`, `remat-kit explain --map` prints `lines()`. Also `notes`, `stacks_of`, `uniform`.
What a layer is and the line's parts: docs/models.md ("The model map").
"""

from __future__ import annotations

import dataclasses

from remat_kit.trace.own_remat import OwnRegion
from remat_kit.trace.pipeline import Pipeline


@dataclasses.dataclass(frozen=True)
class Layer:
    """One layer, or one scanned instance running `copies` layers.

    Attributes:
      path: its module path, e.g. "encoder/block/0", "blocks_1", "layers" (a scan).
      cls: its class name, e.g. "T5Block".
      structure: which parameter structure of its class it has, 0 for the first seen.
      label: what sets that structure apart from the class's others (the module or
        parameter only it holds, e.g. "relative_attention_bias", "recurrent_block"),
        "" where the class has one structure.
      parameters: its scalars (a scanned instance: all its layers'), e.g. 12,352.
      copies: the layers it runs: a scan's length, else 1.
    """

    path: str
    cls: str
    structure: int = 0
    label: str = ""
    parameters: int = 0
    copies: int = 1


@dataclasses.dataclass(frozen=True)
class Stack:
    """Layers run one after another under one parent module ("" the model itself)."""

    path: str
    layers: tuple[Layer, ...]

    @property
    def scanned(self) -> bool:
        return any(layer.copies > 1 for layer in self.layers)

    @property
    def num_layers(self) -> int:
        return sum(layer.copies for layer in self.layers)

    def text(self) -> str:
        """E.g. "2 x ResidualBlock (recurrent_block, attention_block: 2 structures)"."""
        parts = []
        for cls in dict.fromkeys(layer.cls for layer in self.layers):
            mine = [layer for layer in self.layers if layer.cls == cls]
            labels = list(dict.fromkeys(layer.label or "other" for layer in mine))
            kinds = len({layer.structure for layer in mine})
            shapes = f" ({', '.join(labels)}: {kinds} structures)" if kinds > 1 else ""
            parts.append(f"{sum(layer.copies for layer in mine)} x {cls}{shapes}")
        return " + ".join(parts)


@dataclasses.dataclass(frozen=True)
class ModelMap:
    """The layers of a model, its own remat and what lies outside every layer.

    Attributes:
      stacks: in the order the forward pass runs them; () for a model with no layer
        (nothing to remat: every policy runs as `none`).
      own_remat: the model's own remat regions (`remat_kit.trace.own_remat`).
      outside: what runs outside every layer under every policy, outermost module
        paths in call order, the model's loose parameters, what its own call computes
        (`remat_kit.trace.own_call`), then "loss" (e.g. ("wte", "ln_f", "the model's
        own call: 1 op (dot_general)", "loss")).
      pipeline: where the layers run as pipeline stages, the pipeline
        (`remat_kit.trace.pipeline`), else None.
    """

    stacks: tuple[Stack, ...] = ()
    own_remat: tuple[OwnRegion, ...] = ()
    outside: tuple[str, ...] = ()
    pipeline: Pipeline | None = None

    @property
    def num_layers(self) -> int:
        return sum(s.num_layers for s in self.stacks)

    @property
    def layers(self) -> tuple[Layer, ...]:
        return tuple(layer for s in self.stacks for layer in s.layers)

    @property
    def scanned(self) -> bool:
        return any(s.scanned for s in self.stacks)

    def own_text(self) -> str:
        """The model's own remat in words: "none", or each kind (`OwnRegion.text`)."""
        return "; ".join(r.text() for r in self.own_remat) or "none"

    def line(self) -> str:
        """One line, e.g. "2 x ResidualBlock (recurrent_block, attention_block: 2
        structures), scanned: no; own remat: none; outside: embedder, final_norm, loss"."""
        outside = ", ".join(self.outside) or "nothing"
        if not self.stacks:
            return (f"no layers found: nothing to remat, every policy runs as none; own "
                    f"remat: {self.own_text()}; outside: {outside}")
        stacks = ", ".join(f"{s.path}: {s.text()}" if s.path and len(self.stacks) > 1
                           else s.text() for s in self.stacks)
        piped = f"; pipeline: {self.pipeline.text()}" if self.pipeline else ""
        return (f"{stacks}, scanned: {'yes' if self.scanned else 'no'}; own remat: "
                f"{self.own_text()}; outside: {outside}{piped}")

    def lines(self) -> list[str]:
        """The map in full: the line, then one line per layer (a scan's instance once,
        with its layer count), for `remat-kit explain --map`. Parameters are counted
        per layer, a scan's too ("8,480 parameters each, scanned x2")."""
        out = [self.line()]
        i = 0
        for layer in self.layers:
            first = f"{i}-{i + layer.copies - 1}" if layer.copies > 1 else f"{i}"
            shape = f", structure {layer.structure}" + (f" ({layer.label})" if layer.label
                                                         else "")
            scan = f" each, scanned x{layer.copies}" if layer.copies > 1 else ""
            out.append(f"  layer {first}: {layer.path or '(root)'} {layer.cls}{shape}, "
                       f"{layer.parameters // layer.copies:,} parameters{scan}")
            i += layer.copies
        return out

    def to_dict(self) -> dict:
        """JSON for `--json`'s `context.model_map`."""
        return {"line": self.line(), "num_layers": self.num_layers, "scanned": self.scanned,
                "stacks": [{"path": s.path, "layers": [dataclasses.asdict(x) for x in s.layers]}
                           for s in self.stacks],
                "own_remat": [dataclasses.asdict(r) | {"taken_over": r.taken_over}
                              for r in self.own_remat],
                "outside": list(self.outside),
                "pipeline": self.pipeline.to_dict() if self.pipeline else None}


def notes(the_map: ModelMap) -> tuple[str, ...]:
    """The notes every report row carries for this map: no layer at all, and each own
    remat region kept under every policy (not a whole layer's)."""
    out = []
    if not the_map.stacks:
        out.append("no layers found: nothing to remat, so every policy runs as none; "
                   "name the layer class with --block (block=)")
    for r in the_map.own_remat:
        if not r.taken_over:
            out.append(f"own remat kept: the model runs {r.text()}, so `none` here is not "
                       "no remat")
    pipe = the_map.pipeline
    if pipe is not None:
        out.append(f"pipeline: per-chip figures are the largest stage's, the first's "
                   f"(every chip runs the same program: its stage's layers and the residuals "
                   f"{_held(pipe)}); FLOPs and the predicted step include the bubble "
                   f"({pipe.bubble} of the iterations), as compiled")
        if pipe.own_remat:
            saves = ", ".join(pipe.own_saves) or "what its policy saves"
            out.append(f"nested remat: the pipeline's own remat per iteration "
                       f"(jax.checkpoint({pipe.own_remat})) saves {saves}; within it each "
                       "layer's remat saves what the policy under test saves")
    return tuple(out)


def _held(pipe: Pipeline) -> str:
    """What the compiled program's residuals are, in words, for the pipeline's schedule."""
    if pipe.schedule == "GPipe":
        return (f"of all {pipe.passes} microbatch passes in flight, GPipe: every stage "
                "holds them all")
    if pipe.schedule == "1F1B":
        return (f"of the microbatches in flight, 1F1B: {pipe.in_flight(0)} on the first "
                f"stage, 1 on the last")
    return "a hand-written backward keeps: the schedule is not told, none assumed"


def stacks_of(layers: list[Layer]) -> tuple[Stack, ...]:
    """The layers grouped into stacks by parent path, in order: a scanned instance is
    a stack of its own; consecutive layers under one parent are one stack."""
    out: list[tuple[str, list[Layer]]] = []
    for layer in layers:
        parent = layer.path if layer.copies > 1 else layer.path.rpartition("/")[0]
        if out and out[-1][0] == parent and layer.copies == 1 and not out[-1][1][0].copies > 1:
            out[-1][1].append(layer)
        else:
            out.append((parent, [layer]))
    return tuple(Stack(p, tuple(ls)) for p, ls in out)


def uniform(cls: str, num_layers: int, parameters: int, outside: tuple[str, ...],
            scanned: bool = False) -> ModelMap:
    """The map of a stack of `num_layers` layers of one class and structure (our
    reference configs): `parameters` per layer."""
    if scanned:
        layers = [Layer("layers", cls, parameters=parameters * num_layers, copies=num_layers)]
    else:
        layers = [Layer(f"layers/{i}", cls, parameters=parameters) for i in range(num_layers)]
    return ModelMap(stacks_of(layers), (), outside)


__all__ = ["Layer", "ModelMap", "Stack", "notes", "stacks_of", "uniform"]
