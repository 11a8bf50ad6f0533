"""remat-kit's plan against MaxText's own remat search (its "estimator"), on MaxText's train step.

    python benchmarks/vs_estimator.py [--hbm 15.75GiB] [--topology v5e-1] [--out runs/vs_estimator]

Needs `maxtext` and libtpu, which compile TPU programs ahead of time: no TPU is
needed. Not in CI. Where either is missing the script says which, in one line,
and exits 2. maxtext 0.2.5's wheel lists its requirements only under extras
(`[tpu]` and others, pinning many packages); with our jax it installs in a
scratch environment as `pip install --no-deps maxtext==0.2.5` beside this
project's packages (a .pth file naming its venv's site-packages), plus what
its train step and estimator import: omegaconf, pathwaysutils, jinja2, qwix,
aqtp, tokamax, huggingface_hub, transformers, grain, drjax, tiktoken,
sentencepiece, sympy. Each MaxText compile at these sizes is one to several
minutes of CPU (docs/plan.md, "Against MaxText's own search").

The setting: MaxText's llama2 decoder at 2 layers, emb 2048, MLP 8192,
8 heads of 256, vocab 8192, seq 2048, per-device batch 52, bf16 activations, f32
weights, AdamW, one TPU v5e chip (15.75 GiB HBM), where no remat does not fit the
train step and full remat does. It runs

1. MaxText's estimator (`python -m maxtext.utils.estimator`, batch size given: its
   policy search alone), timed;
2. `remat-kit plan --step train --uniform --emit maxtext` on tests/zoo/own_tags_linen.py's
   `vs_estimator_decoder` (the same sizes and dtypes) (a llama2-like decoder that names its values as MaxText's does),
   budget the chip's HBM, timed (a policy that remats: MaxText reads remat_policy=none as
   full remat);
3. MaxText's train step compiled (`maxtext.trainers.pre_train.train_compile`) under
   each policy and under full remat: fits, peak, FLOPs over full remat's.

Exit status 0 with the table printed, 1 if a step failed, 2 if a dependency is missing.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
import time

# override_model_config: MaxText 0.2.5 refuses CLI values that differ from the model's own.
SHAPES = ["model_name=llama2-7b", "override_model_config=True", "base_num_decoder_layers=2", "base_emb_dim=2048",
          "base_mlp_dim=8192", "base_num_query_heads=8", "base_num_kv_heads=8", "head_dim=256",
          "vocab_size=8192", "max_target_length=2048", "per_device_batch_size=52",
          "dtype=bfloat16", "weight_dtype=float32", "scan_layers=false", "attention=dot_product",
          "dataset_type=synthetic", "steps=1", "enable_checkpointing=false"]


def missing() -> str | None:
    """What is not installed that the comparison needs, or None."""
    for module, why in (("maxtext", "pip install maxtext (a scratch environment)"),
                        ("libtpu", "pip install libtpu (TPU ahead-of-time compiles)")):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed: {why}"
    return None


def base_yml() -> str:
    """MaxText's configs/base.yml, as installed."""
    import maxtext
    return os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")


def run(argv: list[str]) -> tuple[str, float]:
    """(stdout, wall seconds) of a command; CalledProcessError where it fails."""
    start = time.perf_counter()
    done = subprocess.run(argv, check=True, capture_output=True, text=True)
    return done.stdout, time.perf_counter() - start


def compile_maxtext(topology: str, overrides: list[str]) -> dict:
    """MaxText's train step compiled for `topology` under `overrides`: {"fits", "flops",
    "bytes" (argument + output - alias + temp, from its printed memory analysis),
    "seconds", "stdout", "stderr"}."""
    argv = [sys.executable, "-m", "maxtext.trainers.pre_train.train_compile", base_yml(),
            f"compile_topology={topology}", "compile_topology_num_slices=1", *SHAPES, *overrides]
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True)
    text = done.stdout + done.stderr
    flops = re.search(r"'flops': ([0-9.e+]+)", text)
    stats = dict(re.findall(r"(?<![a-z_])(argument|output|alias|temp)_size_in_bytes=([0-9]+)",
                            text))  # not the host_ figures
    total = (int(stats["argument"]) + int(stats["output"]) - int(stats["alias"])
             + int(stats["temp"])) if len(stats) == 4 else None
    return {"fits": done.returncode == 0, "flops": flops and float(flops.group(1)),
            "bytes": total, "seconds": time.perf_counter() - start,
            "stdout": done.stdout[-3000:], "stderr": done.stderr[-3000:]}


def estimator_policy(output: str) -> list[str] | None:
    """The overrides of the last policy MaxText's estimator found not OOM, from its output."""
    checked = re.findall(r"policy=(\{.*?\}) is OOM\s*\nIs OOM: (True|False)", output)
    fits = [p for p, oom in checked if oom == "False"]
    if not fits:
        return None
    return ["remat_policy=custom", *(f"{k}={v}" for k, v in ast.literal_eval(fits[-1]).items())]


def _save(out: str, found: dict) -> None:
    with open(os.path.join(out, "vs_estimator.json"), "w") as f:
        json.dump(found, f, indent=2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hbm", default="15.75GiB")
    ap.add_argument("--topology", default="v5e-1")
    ap.add_argument("--out", default="runs/vs_estimator")
    args = ap.parse_args()
    if (why := missing()) is not None:
        print(f"vs_estimator: {why}; nothing compared", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    found = {}
    try:
        out, found["estimator_seconds"] = run(
            [sys.executable, "-m", "maxtext.utils.estimator", base_yml(),
             f"compile_topology={args.topology}", "compile_topology_num_slices=1", *SHAPES])
        found["estimator_output"] = out[-6000:]
        found["estimator_policy"] = estimator_policy(out)
        _save(args.out, found)
        plan_json = os.path.join(args.out, "plan.json")
        _, found["remat_kit_seconds"] = run(
            [sys.executable, "-m", "remat_kit.cli", "plan", "--model",
             "tests/zoo/own_tags_linen.py:vs_estimator_decoder", "--batch", "52", "--seq", "2048",
             "--target", "tpu:v5e:1x1", "--budgets", args.hbm, "--step", "train", "--uniform",
             "--emit", "maxtext", "--no-presets", "--cache", "", "--json", plan_json])
        with open(plan_json) as f:
            emitted = json.load(f)["budgets"][0]["emit"]
    except subprocess.CalledProcessError as e:
        print(f"vs_estimator: {' '.join(e.cmd[:4])} failed: {e.stderr[-2000:]}", file=sys.stderr)
        return 1
    if not emitted or emitted["text"] is None:
        print(f"vs_estimator: remat-kit gave no MaxText policy: {emitted}", file=sys.stderr)
        return 1
    found["remat_kit_policy"] = emitted["text"]
    _save(args.out, found)
    found["compiles"] = {
        "remat_kit": compile_maxtext(args.topology, emitted["text"].split()),
        "full": compile_maxtext(args.topology, ["remat_policy=full"])}
    if found["estimator_policy"]:
        found["compiles"]["estimator"] = compile_maxtext(args.topology, found["estimator_policy"])
    _save(args.out, found)
    print(f"estimator: {found['estimator_seconds']:.0f} s; remat-kit plan: "
          f"{found['remat_kit_seconds']:.0f} s; remat-kit's policy fits MaxText's train step: "
          f"{found['compiles']['remat_kit']['fits']}; figures in {args.out}/vs_estimator.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
