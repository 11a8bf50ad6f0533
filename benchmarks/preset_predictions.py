"""How far `remat-kit plan`'s predicted presets (the `~` rows: `search.predict`) are from
their compiles.

    python benchmarks/preset_predictions.py [--cases tiny:cpu,tiny_llama:tpu:v5e:1x1]
        [--batch 2] [--seq 32]

For each case (a reference config and a target), the planner compiles what plain `plan`
compiles before predicting (none, full, its base rules, and every decidable tag saved for
the byte share); then each preset it predicts is predicted, compiled, and the two set
side by side: bytes (the planner's memory figure) and FLOPs, as (predicted - compiled) /
compiled. Prints a table per case and the largest errors.
"""

from __future__ import annotations

import argparse

from remat_kit.ui.inputs import preset_policies
from remat_kit.decide.plan import Planner
from remat_kit.decide.search import predict
from remat_kit.models import get_config
from remat_kit.models.program import workload
from remat_kit.policy.policy import Policy
from remat_kit.policy.spec import parse

CASES = "tiny:cpu,tiny_llama:cpu,tiny:tpu:v5e:1x1,tiny_llama:tpu:v5e:1x1"


def case(config: str, target: str, batch: int, seq: int) -> list[tuple]:
    """(preset name, predicted bytes, compiled bytes, predicted FLOPs, compiled FLOPs) of each
    preset `plan` predicts by default, after the planner's own compiles."""
    planner = Planner(workload(get_config(config), batch, seq), cache=None, target=target)
    planner.minimum()
    planner.measure_all([Policy(base=b) for b in planner.bases])
    assert planner.byte_share > 0  # its compile, as the search makes it
    out = []
    named = {}  # canonical spec -> its first preset name
    for p in preset_policies():
        named.setdefault(str(parse(p)), p)
    for key, name in named.items():
        if key in planner.records:
            continue
        figures = predict(planner, parse(key))
        if figures is None:
            continue
        record = planner.measure_all([parse(key)])[0]
        if record.error is None and record.memory_bytes is not None:
            out.append((name, figures[0], record.memory_bytes, figures[1], record.flops))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=CASES)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=32)
    args = ap.parse_args()
    for item in args.cases.split(","):
        config, target = item.split(":", 1)
        rows = case(config, target, args.batch, args.seq)
        print(f"{config} on {target}, batch {args.batch}, seq {args.seq}: "
              f"{len(rows)} presets predicted")
        for key, pb, cb, pf, cf in rows:
            print(f"  {key:34s} bytes {pb:>12,} vs {cb:>12,} ({pb / cb - 1:+7.1%})  "
                  f"FLOPs {pf / cf - 1:+7.2%}")
        if rows:
            print(f"  largest |error|: bytes {max(abs(r[1] / r[2] - 1) for r in rows):.1%}, "
                  f"FLOPs {max(abs(r[3] / r[4] - 1) for r in rows):.2%}", flush=True)


if __name__ == "__main__":
    main()
