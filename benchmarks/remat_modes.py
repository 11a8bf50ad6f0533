"""Which presets save different residuals under JAX's two remat implementations.

Runs itself once with JAX_REMAT3=0 and once with JAX_REMAT3=1, measures what
one decoder layer of each model stores under every preset
(`remat_kit.api.configs.layer_residuals`), and prints the presets whose stored
tags or bytes differ.

    .venv/bin/python benchmarks/remat_modes.py [--config tiny] [--batch 2] [--seq 64]
"""

import argparse
import json
import os
import subprocess
import sys
import warnings


# JAX's name-taking policies, and compositions no built-in expresses.
EXTRA = ["save_only_these_names:query_proj", "save_any_names_but_these:query_proj",
         "save_anything_except_these_names:query_proj", "dots;save:attn_probs",
         "everything;recompute:attn_probs", "dots_no_batch;offload:context"]


def snapshot(config: str, batch: int, seq: int) -> dict:
    """{policy name: {"bytes": stored bytes per layer, "stored": sorted stored rows}}."""
    from remat_kit.api.configs import layer_residuals
    from remat_kit.models import get_config
    from remat_kit.policy.presets import PRESET_TABLE

    cfg = get_config(config)
    out = {}
    for spec in [f"{cb}:{name}" for cb, name, *_ in PRESET_TABLE] + EXTRA:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # remat3's callable warning
            layer = layer_residuals(cfg, batch, seq, spec)
        stored = sorted(f"{r.name}:{r.decision}" for r in layer.rows
                        if r.decision in ("saved", "offloaded"))
        out[spec] = {"bytes": layer.stored_bytes, "stored": stored}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(snapshot(args.config, args.batch, args.seq)))
        return
    runs = {}
    for mode in ("0", "1"):
        cmd = [sys.executable, __file__, "--child", "--config", args.config,
               "--batch", str(args.batch), "--seq", str(args.seq)]
        env = dict(os.environ, JAX_REMAT3=mode)
        runs[mode] = json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True,
                                               text=True).stdout)
    differ = [n for n in runs["0"] if runs["0"][n] != runs["1"][n]]
    print(f"{args.config}, batch {args.batch}, seq {args.seq}: {len(runs['0'])} policies, "
          f"{len(differ)} differ between jax_remat3 off and on")
    for n in differ:
        a, b = runs["0"][n], runs["1"][n]
        print(f"\n{n}: {a['bytes']:,} B per layer (remat3 off) vs {b['bytes']:,} B (on)")
        print(f"  only off: {sorted(set(a['stored']) - set(b['stored']))}")
        print(f"  only on:  {sorted(set(b['stored']) - set(a['stored']))}")


if __name__ == "__main__":
    main()
