"""GPU truth: each policy's real train step on one NVIDIA GPU against what remat_kit predicted.

    PYTHONPATH=. python benchmarks/gpu_truth.py            # on a machine with the GPU
    PYTHONPATH=. python benchmarks/gpu_truth.py --smoke    # anywhere: tiny shapes, CPU
    PYTHONPATH=. python benchmarks/gpu_truth.py --predict  # the deviceless figures (CUDA plugin)
    PYTHONPATH=. python benchmarks/gpu_truth.py --report DIR  # a run's table again, anywhere

For each config (`RUNS`: GPT-2 medium shapes and Llama 3.2 1B shapes, bfloat16
activations, float32 parameters, AdamW, layers scanned) and each policy in
`POLICIES`, one fresh process compiles the train step of `remat_kit.decide.step.train_step`
on the device (`lowering.compile_for`, parameters and optimizer state donated), runs
`--warmup` steps and then `--steps` timed ones. A user's model (`MODEL_RUNS`: a
`--model FILE.py:FUNCTION`) runs through `rk.remat_model` in a train step written as a
user writes it. Each row reports:

* the measured peak: `device.memory_stats()["peak_bytes_in_use"]`; one process
  per policy, since that peak cannot be reset;
* the device compile's prediction of it (`memory_analysis()`, the figure
  `step_memory` reports on a GPU: `peak_memory_in_bytes`);
* the deviceless prediction for an H200 (`--target gpu:h200`, made on a machine
  without a GPU and shipped in gpu_truth_predictions.json; `--predict` makes it);
* the median step time with its quartiles, the ratio to `none`, and MFU: the FLOPs
  of the no-remat step (XLA's count, from the CPU compile of the same program) per
  second over the GPU's dense bf16 peak (H200 SXM: 989 TFLOP/s, NVIDIA H200 Tensor
  Core GPU datasheet: 1,979 TFLOP/s with sparsity); HFU counts the policy's own
  FLOPs, recompute included;
* the time model's seconds (`remat_kit.measure.time_model.compiled_seconds`) of the
  program the device ran and of the deviceless one, and their ratios to `none`.

The auto rows are the plans made deviceless for the H200 (`Run.autos`: 0.5 and 0.3
of no remat's value-and-grad peak), shipped with the predictions, so the GPU runs the
policies the CPU chose; without a shipped plan one is planned on the device.

Where a prediction can differ from the measured peak (see `DIFFERENCES`, printed
under the table): the allocator, the memory the client is given, cuDNN and cuBLAS
workspaces, and the compiler's version and flags. The environment of the
measurement is set here (`MEASURE_ENV`, values a user set are kept) and recorded.

Policies run one after another across the configs (none for all, then full, ...);
no policy starts after --time-limit seconds (default 380: the 17 rows took 406 s on an
H200) and none runs longer than CHILD_SECONDS on a GPU. The children share one XLA
autotuning cache, which changes compile times only.

Writes gpu_truth.json, gpu_truth.md, the optimized HLO of every program run
(`HLO_TAR`: the time model reads it where the device's JAX cannot, `--report`) and the
autotuning results (`AUTOTUNE_TAR`) to $OUT (default ./gpu_truth_out) and prints the
table. Without a GPU and without --smoke it says so in one line and exits 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)  # the working tree's remat_kit, in this process and its children
PREDICTIONS = os.path.join(HERE, "gpu_truth_predictions.json")
PREDICT_TARGET = "gpu:h200"
H200_BF16_PEAK = 989e12  # FLOP/s, dense (NVIDIA H200 Tensor Core GPU datasheet)
# In the order they run: a time limit cuts the last. auto: each of Run.autos.
POLICIES = ("none", "full", "minimal", "auto", "selective", "dots")
HLO_TAR = "gpu_truth_hlo.tar.gz"  # each program the device compiled, as optimized HLO text
# XLA's per-fusion autotuning results on the device: a deviceless compile cannot
# autotune, so it picks other kernels (Triton GEMM fusions where the device ran
# cuBLAS) and prices another program; these let a later one pick the device's.
AUTOTUNE_TAR = "gpu_truth_autotune.tar.gz"
MARK = "GPU_TRUTH_ROW "  # a child's result line on its stdout
# The allocator and its limit, set before JAX starts its backend (the children
# inherit them): the BFC allocator (the only one memory_stats reports on), its pool
# taken at start as one region of 95% of the GPU's memory (JAX's default 75%), so a
# step that fits the device fits here. Grown on demand instead (PREALLOCATE=false,
# the first H200 run), the pool came in regions of doubling size and GPT-2 medium's
# no remat step failed to place its 113.6 GiB temp buffer in a 64 GiB largest free
# block of a 128 GiB pool (docs/gpu.md). peak_bytes_in_use is the same either way.
MEASURE_ENV = {"XLA_PYTHON_CLIENT_ALLOCATOR": "bfc", "XLA_PYTHON_CLIENT_PREALLOCATE": "true",
               "XLA_CLIENT_MEM_FRACTION": "0.95"}
# Autotuning results shared by the children (each policy's process would tune the same
# GEMMs again): compile time only, the programs are the same.
AUTOTUNE_CACHE_FLAG = "--xla_gpu_per_fusion_autotune_cache_dir"
CHILD_SECONDS = 180.0  # one policy on the GPU: start, compile, warm-up and timed steps
RECORDED_ENV = (*MEASURE_ENV, "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_FLAGS",
                "JAX_DEFAULT_PRNG_IMPL", "CUDA_VISIBLE_DEVICES")
DIFFERENCES = (
    "Allocator: peak_bytes_in_use counts what the BFC allocator handed out, each buffer "
    "rounded up to its bins (multiples of 256 bytes and up); the compiler's peak counts the "
    "buffers it assigned. The measured peak is the whole process's: the parameter "
    "initialization and the tokens are in it as well.",
    "Memory given to the client: XLA_CLIENT_MEM_FRACTION sets the allocator's limit (JAX's "
    "default 75%); XLA_PYTHON_CLIENT_PREALLOCATE=false grows the pool on demand in regions, "
    "and a step predicted to fit can then fail to place one large buffer (on the H200, a "
    "113.6 GiB temp in a 128 GiB pool whose largest free block was 64 GiB); this script "
    "preallocates. Neither changes peak_bytes_in_use of a step that runs.",
    "Workspaces: cuBLAS and cuDNN scratch is part of the compiled program's temp on the "
    "device, chosen by autotuning; the deviceless compile cannot autotune and takes default "
    "algorithms and fusions, so its temp can differ. The CUDA context and loaded kernels sit "
    "outside the allocator and count in neither figure.",
    "Compiler: the device runs its own jax/XLA and CUDA plugin, the deviceless figures come "
    "from this project's (versions in the JSON); XLA_FLAGS changes fusion and scheduling. "
    "XLA's GPU scheduler and its rematerialization pass work to a limit derived from the "
    "device's memory size, which the deviceless compile takes from the target description.",
)


@dataclasses.dataclass(frozen=True)
class Run:
    """One model at one shape: a base config of remat_kit.models with overrides, and
    the planner budgets of its auto rows (fractions of no remat's value-and-grad peak)."""

    base: str
    overrides: dict
    batch: int
    seq: int
    autos: tuple = ("auto:budget=0.5", "auto:budget=0.3")

    def config(self):
        from remat_kit.models import get_config
        return get_config(self.base, **self.overrides)


_BF16 = {"dtype": "bfloat16", "param_dtype": "float32", "scan_layers": True}
RUNS = {
    # GPT-2 medium (Radford et al. 2019): 24 layers, d1024, 16 heads.
    "gpt2_medium": Run("gpt2_small", {"num_layers": 24, "d_model": 1024, "num_heads": 16,
                                      "mlp_dim": 4096, **_BF16}, batch=20, seq=1024),
    "llama_1b": Run("llama_1b", {"max_len": 2048, **_BF16}, batch=5, seq=2048),
}
SMOKE_RUNS = {
    # Full remat takes 0.63 of no remat's peak here: half would be below it.
    "tiny": Run("tiny", {**_BF16}, batch=2, seq=32, autos=("auto:budget=0.8",)),
}


@dataclasses.dataclass(frozen=True)
class ModelRun:
    """A user's model through `--model FILE.py:FUNCTION`, run through `rk.remat_model`:
    FUNCTION() returns the unbound linen module; the loss is next-token cross-entropy
    on int32 tokens [batch, seq] (`from_model.next_token_loss`), AdamW as the configs'."""

    file: str
    function: str
    batch: int
    seq: int
    policies: tuple = ("none", "minimal", "full")

    def load(self):
        """make(batch, seq) -> the Workload `compare --model` measures; make.model is
        FUNCTION()'s module (`remat_kit.flax.user_model.load`)."""
        from remat_kit.flax import user_model
        return user_model.load(f"{os.path.join(ROOT, self.file)}:{self.function}")[1]


MODEL_RUNS = {
    # tests/zoo/hf_llama_linen.py at Llama 3.2 1B's widths (float32, as that library's
    # Flax models run by default): 16 layers, d2048, 32 heads, 8 key/value heads.
    "hf_llama_1b": ModelRun("tests/zoo/hf_llama_linen.py", "llama_1b", batch=4, seq=1024),
}
SMOKE_MODEL_RUNS = {"hf_llama_tiny": ModelRun("tests/zoo/hf_llama_linen.py", "model",
                                              batch=2, seq=16)}


def all_runs(smoke: bool) -> dict:
    """The configs and the user models measured, by name."""
    return {**SMOKE_RUNS, **SMOKE_MODEL_RUNS} if smoke else {**RUNS, **MODEL_RUNS}


ALL_RUNS = {**all_runs(False), **all_runs(True)}


def _fingerprint(run) -> dict:
    """What the predictions must match: the model's fields (a config's, or a user
    model's file and function) and the shapes, as JSON has them."""
    model = ({"file": run.file, "function": run.function} if isinstance(run, ModelRun)
             else dataclasses.asdict(run.config().replace(remat="none")))
    return json.loads(json.dumps({"model": model, "batch": run.batch, "seq": run.seq}))


def _matches(entry: dict | None, run) -> bool:
    """Whether `entry` was predicted for `run`; a config field added since, at its
    default, changes no program, so it does not stale the entry."""
    if entry is None or not isinstance(entry.get("model"), dict):
        return False
    want = _fingerprint(run)
    model = entry["model"]
    if not isinstance(run, ModelRun):
        cls = type(run.config())
        defaults = json.loads(json.dumps({f.name: f.default for f in dataclasses.fields(cls)
                                          if f.default is not dataclasses.MISSING}))
        model = {**{k: defaults[k] for k in want["model"]
                    if k not in model and k in defaults}, **model}
    return {"model": model, "batch": entry.get("batch"), "seq": entry.get("seq")} == want


def _specs(policy: str, run, predicting: bool = False) -> tuple:
    """The specs `policy` stands for in `run`: a user model runs only its own policies
    (and none, where predicted: the FLOPs of MFU)."""
    if isinstance(run, ModelRun):
        return (policy,) if policy in run.policies or (predicting and policy == "none") else ()
    return run.autos if policy == "auto" else (policy,)


def _auto_budget(spec: str) -> str | None:
    return spec.split("=", 1)[1] if spec.startswith("auto:budget=") else None


# ---------------------------------------------------------------------------
# One policy, in its own process
# ---------------------------------------------------------------------------

def _timed(compiled, args, warmup: int, steps: int) -> tuple[list[float], list[float]]:
    """Seconds of each timed step and the losses, feeding each step's state to the next
    (the parameters and optimizer state are donated)."""
    import jax
    params, opt_state, *data = args
    times, losses = [], []
    for i in range(warmup + steps):
        start = time.perf_counter()
        params, opt_state, loss = compiled(*jax.tree.leaves((params, opt_state, *data)))
        jax.block_until_ready((params, opt_state, loss))
        if i >= warmup:
            times.append(time.perf_counter() - start)
        losses.append(float(loss))
    return times, losses


def model_step(run: ModelRun, spec: str):
    """The train step of `rk.remat_model(FUNCTION(), spec)` written as a user writes it:
    value-and-grad of the next-token loss, then AdamW; a `TrainStep`."""
    import jax
    import optax
    import remat_kit as rk
    from remat_kit.decide.step import TrainStep, default_optimizer
    from remat_kit.flax.from_model import logits_of, next_token_loss
    model, optimizer = rk.remat_model(run.load().model, spec), default_optimizer()

    def loss(params, tokens):
        out = model.apply({"params": params}, tokens)
        return next_token_loss(logits_of(out, run.batch, run.seq), tokens)

    def step(params, opt_state, tokens):
        value, grads = jax.value_and_grad(loss)(params, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    def make_args(key):
        tokens = jax.random.randint(key, (run.batch, run.seq), 0, 256)  # any LM's vocabulary
        params = model.init(key, tokens)["params"]
        return params, optimizer.init(params), tokens

    return TrainStep(step, jax.eval_shape(make_args, jax.random.key(0)), make_args)


def _made(run, spec: str, row: dict, target: str | None = None):
    """The `TrainStep` of one row: an auto spec is planned first (on `target`, default
    this device) and row["resolved"] says what ran."""
    from remat_kit.api.configs import config_planner, train_step
    if isinstance(run, ModelRun):
        row["resolved"] = spec
        return model_step(run, spec)
    if _auto_budget(spec) is not None:
        planner = config_planner(run.config(), run.batch, run.seq, target=target, cache=False)
        plan = planner.plan(_auto_budget(spec))
        row["plan"] = {"spec": plan.spec, "value_and_grad_bytes": plan.measured_bytes,
                       "budget_bytes": plan.budget_bytes,
                       "compiles": len({id(r) for r in planner.records.values()})}
        row["planned_on"] = target or "this device"
        spec = plan.spec
    row["resolved"] = spec
    return train_step(run.config(), run.batch, run.seq, spec)


def _xla_figures(c, made, target: str) -> dict:
    """What the compiler says of a compiled step: `step_figures` and the time model's
    seconds of its ops on `target`'s roofline."""
    from remat_kit.decide.step import step_figures
    from remat_kit.measure import time_model
    figures = step_figures(c, made.args)
    out = {"total_bytes": figures.total_bytes, "source": figures.source, **c.memory,
           "compile_seconds": c.seconds, "flops": figures.flops}
    try:
        out["time_model_seconds"] = time_model.compiled_seconds(
            c.compiled, time_model.roofline(target))
    except Exception as e:  # noqa: BLE001 - the figure is left out, the row still runs
        out["time_model_error"] = f"{type(e).__name__}: {e}"[:300]
    return out


def measure_one(run, spec: str, warmup: int, steps: int, hlo: str | None = None) -> dict:
    """Compile, run and time one policy on JAX's default device; a JSON-ready row.
    hlo: a file to write the compiled program's optimized HLO to (the time model
    reads it where this JAX cannot: `report`)."""
    import jax
    from remat_kit.decide.step import TrainStep
    from remat_kit.measure import lowering, targets
    device = jax.devices()[0]
    row = {"policy": spec, "device": device.device_kind, "platform": device.platform,
           "versions": targets.versions(device.platform)}
    try:
        made = _made(run, spec, row)
        c = lowering.compile_for(made.step, *made.args, compile_only=False,
                                 donate=TrainStep.DONATED, count_flops=False)
        row["device_compile"] = _xla_figures(c, made, PREDICT_TARGET)
        if hlo:
            with open(hlo, "w") as f:
                f.write(c.compiled.as_text())
            row["hlo_file"] = os.path.basename(hlo)
        args = jax.jit(made.make_args)(jax.random.key(0))
        times, losses = _timed(c.compiled, args, warmup, steps)
        q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive")
        row["step_time"] = {"median_s": statistics.median(times), "q1_s": q1, "q3_s": q3,
                            "min_s": min(times), "max_s": max(times), "steps": steps,
                            "warmup": warmup, "times_s": times}
        row["losses"] = [losses[0], losses[-1]]
    except Exception as e:  # noqa: BLE001 - reported in the row, the others still run
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        row["error"] = f"{type(e).__name__}: {text}"[:500]
        row["out_of_memory"] = (targets.is_out_of_memory(e)
                                or "out of memory" in str(e).lower())
    stats = device.memory_stats()
    row["memory_stats"] = stats and {k: v for k, v in stats.items() if isinstance(v, int)}
    row["measured_peak_bytes"] = stats and stats.get("peak_bytes_in_use")
    return row


def _child(name: str, smoke: bool, spec: str, warmup: int, steps: int, timeout: float,
           hlo: str) -> dict:
    """measure_one in a fresh process (its own allocator, so its own peak)."""
    argv = [sys.executable, os.path.abspath(__file__), "--child", name, spec, "--hlo", hlo,
            "--warmup", str(warmup), "--steps", str(steps)] + (["--smoke"] if smoke else [])
    start = time.perf_counter()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"policy": spec, "error": f"timed out after {timeout:.0f} s"}
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith(MARK)]
    if not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"policy": spec, "error": f"process exited {done.returncode}: {tail[:400]}"}
    return {**json.loads(lines[-1][len(MARK):]), "process_seconds": time.perf_counter() - start}


# ---------------------------------------------------------------------------
# Deviceless predictions (on a machine without a GPU, with the CUDA plugin)
# ---------------------------------------------------------------------------

def predict_one(run, spec: str) -> dict:
    """The deviceless H200 figures of one policy (an auto spec planned first, deviceless):
    the train step compiled for `PREDICT_TARGET` and the time model of its ops."""
    from remat_kit.decide.step import TrainStep
    from remat_kit.measure import lowering
    out, start = {"policy": spec}, time.perf_counter()
    try:
        made = _made(run, spec, out, target=PREDICT_TARGET)
        c = lowering.compile_for(made.step, *made.args, target=PREDICT_TARGET,
                                 donate=TrainStep.DONATED)
        out.update(_xla_figures(c, made, PREDICT_TARGET))
        out["time_model"] = "remat_kit.measure.time_model.compiled_seconds (a roofline per op)"
    except Exception as e:  # noqa: BLE001 - e.g. an out-of-memory compile, reported
        out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500]
    out["seconds"] = time.perf_counter() - start
    return out


def predict(names: list[str], policies: list[str], path: str) -> None:
    """Adds the deviceless figures of `names` x `policies` to the JSON file at `path`."""
    from remat_kit.measure import targets
    found = _read(path) or {}
    found.update({"target": PREDICT_TARGET, "versions": targets.versions(PREDICT_TARGET),
                  "description": targets.gpu_description(PREDICT_TARGET),
                  "command": "PYTHONPATH=. python benchmarks/gpu_truth.py --predict "
                             "[--smoke] [--configs ...] (with jax[cuda12] installed)"})
    for name in names:
        run = ALL_RUNS[name]
        entry = found.setdefault("configs", {}).get(name)
        if not _matches(entry, run):
            entry = {**_fingerprint(run), "policies": {}}
        for spec in (s for p in policies for s in _specs(p, run, predicting=True)):
            entry["policies"][spec] = predict_one(run, spec)
            print(f"{name} {spec}: {_gib(entry['policies'][spec].get('total_bytes'))} "
                  f"{entry['policies'][spec].get('error', '')}", flush=True)
            found["configs"][name] = entry
            _write(path, found)  # after each policy: a long run keeps what it made


# ---------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------

def _read(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _write(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")


def _gib(n) -> str:
    if n is None:
        return "-"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def _off(predicted, measured) -> str:
    if predicted is None or not measured:
        return ""
    return f" ({(predicted - measured) / measured:+.1%})"


def _ratio(x, y):
    return x / y if x and y else None


def rows_for(name: str, results: list[dict], shipped: dict | None, peak_flops: float | None):
    """The report rows of one config: each child's row with its predictions and ratios.
    The time model prices two programs: the one the device compiled and ran, and the
    deviceless one shipped (a compile without autotuning, so another program)."""
    predicted = (shipped or {}).get("policies", {})
    none = next((r for r in results if r["policy"] == "none" and "step_time" in r), None) or {}
    none_p = predicted.get("none", {})
    model = lambda r: (r.get("device_compile") or {}).get("time_model_seconds")  # noqa: E731
    out = []
    for r in results:
        p = predicted.get(r["policy"], {})
        t = (r.get("step_time") or {}).get("median_s")
        out.append({
            "config": name, **r, "deviceless": p or None,
            "ratio_to_none": _ratio(t, (none.get("step_time") or {}).get("median_s")),
            "flop_ratio_to_none": _ratio(p.get("flops"), none_p.get("flops")),
            "predicted_seconds": model(r),
            "predicted_ratio_to_none": _ratio(model(r), model(none)),
            "deviceless_ratio_to_none": _ratio(p.get("time_model_seconds"),
                                               none_p.get("time_model_seconds")),
            "mfu": t and peak_flops and none_p.get("flops") and none_p["flops"] / t / peak_flops,
            "hfu": t and peak_flops and p.get("flops") and p["flops"] / t / peak_flops})
    return out


def _row_line(r: dict) -> str:
    measured = r.get("measured_peak_bytes") if "step_time" in r else None
    device = (r.get("device_compile") or {}).get("total_bytes")
    less = (r.get("deviceless") or {}).get("total_bytes")
    t = r.get("step_time")
    time_text = (f"{t['median_s'] * 1e3:.1f} ms ({t['q1_s'] * 1e3:.1f}-"
                 f"{t['q3_s'] * 1e3:.1f})" if t else
                 "out of memory" if r.get("out_of_memory") else
                 f"error: {r.get('error', '?')[:60]}")
    policy = r["policy"] + (f" → `{r['resolved']}`" if r.get("resolved", r["policy"])
                            != r["policy"] else "")
    fmt = lambda x, f: "-" if not x else f.format(x)  # noqa: E731
    predicted = (f"{r['predicted_seconds'] * 1e3:.1f} ms"
                 f"{_off(r['predicted_seconds'], t and t['median_s'])}"
                 if r.get("predicted_seconds") else "-")
    ratios = [fmt(r[k], "{:.3f}") for k in ("ratio_to_none", "predicted_ratio_to_none",
                                             "deviceless_ratio_to_none", "flop_ratio_to_none")]
    return (f"| {r['config']} | {policy} | {_gib(measured)} | {_gib(device)}"
            f"{_off(device, measured)} | {_gib(less)}{_off(less, measured)} | {time_text} | "
            f"{predicted} | {' | '.join(ratios)} | {fmt(r['mfu'], '{:.1%}')} | "
            f"{fmt(r['hfu'], '{:.1%}')} |")


def markdown(rows: list[dict], peak_flops: float | None, notes: list[str]) -> str:
    head = ("| config | policy | measured peak | device compile | deviceless H200 | "
            "step time (median, q1-q3) | time model | × none | time model × none | "
            "deviceless × none | FLOPs × none | MFU | HFU |")
    lines = [head, "| --- | --- |" + " ---: |" * 11]
    lines += [_row_line(r) for r in rows]
    peak = (f"{peak_flops / 1e12:.0f} TFLOP/s (H200 SXM dense bf16, NVIDIA's datasheet)"
            if peak_flops else "none on this platform, so no MFU")
    lines += ["", f"MFU: the no-remat step's FLOPs (XLA's count) per measured second over "
                  f"the peak, {peak}; HFU: the policy's own FLOPs, recompute included. "
                  "Percentages: the prediction against the measured figure. Time model: "
                  "remat_kit's (a roofline per compiled op, `gpu:h200`'s ceilings) of the "
                  "program the device ran; deviceless × none: of the deviceless program "
                  "shipped (compiled without autotuning: another program).", ""]
    lines += [f"- {n}" for n in notes]
    lines += ["", "Where a prediction can differ from the measured peak:", ""]
    lines += [f"- {d}" for d in DIFFERENCES]
    return "\n".join(lines) + "\n"


def has_gpu() -> bool:
    """An NVIDIA GPU device file and JAX's CUDA plugin, checked without starting JAX."""
    from remat_kit._jax_private import has_nvidia_gpu
    return has_nvidia_gpu() and any(importlib.util.find_spec(m) is not None
                                    for m in ("jax_cuda12_plugin", "jax_cuda13_plugin"))


def measure_all(args) -> int:
    if not args.smoke and not has_gpu():
        print("gpu_truth: no GPU is present (an NVIDIA GPU and JAX's CUDA plugin are needed); "
              "run the CPU smoke mode: PYTHONPATH=. python benchmarks/gpu_truth.py --smoke",
              file=sys.stderr)
        return 2
    cache = args.autotune_cache = _set_measure_env()
    try:
        return _measure_all(args)
    finally:
        if cache is not None:
            shutil.rmtree(cache, ignore_errors=True)


def _entries(names, runs: dict, shipped: dict, notes: list) -> dict:
    """Each run's shipped deviceless predictions, None where they are for other shapes."""
    entries = {}
    for name in names:
        entry = shipped.get("configs", {}).get(name)
        if entry is not None and not _matches(entry, runs[name]):
            notes.append(f"{name}: the shipped predictions are for other shapes; rerun --predict")
            entry = None
        entries[name] = entry
    return entries


def _measure_all(args) -> int:
    out_dir = os.environ.get("OUT") or args.out
    os.makedirs(out_dir, exist_ok=True)
    shipped, notes, start = _read(args.predictions) or {}, [], time.perf_counter()
    entries = _entries(args.configs, all_runs(args.smoke), shipped, notes)
    results = {name: [] for name in args.configs}
    args.hlo_dir = tempfile.mkdtemp(prefix="gpu_truth_hlo_")
    # Policy by policy across the configs, so a time limit cuts the last policies of
    # every config rather than a whole config.
    for policy in args.policies:
        for name in args.configs:
            for spec in _specs(policy, all_runs(args.smoke)[name]):
                results[name].append(_run_child(args, name, spec, entries[name], start))
    with tarfile.open(os.path.join(out_dir, HLO_TAR), "w:gz") as tar:
        tar.add(args.hlo_dir, arcname="hlo")
    shutil.rmtree(args.hlo_dir, ignore_errors=True)
    if args.autotune_cache:  # what the device chose, for deviceless compiles to load
        with tarfile.open(os.path.join(out_dir, AUTOTUNE_TAR), "w:gz") as tar:
            tar.add(args.autotune_cache, arcname="autotune")
    # The parent never starts JAX's backend: a CUDA context here would take device
    # memory from the children. Versions and the device come from their rows.
    first = next((r for rs in results.values() for r in rs if "versions" in r), {})
    report = {"command": " ".join(["python", *sys.argv]), "smoke": args.smoke,
              "seconds": time.perf_counter() - start, "versions": first.get("versions"),
              "device": first.get("device"),
              "environment": {k: os.environ.get(k) for k in RECORDED_ENV},
              "peak_flops": None if args.smoke else H200_BF16_PEAK,
              "peak_flops_source": None if args.smoke else
              "NVIDIA H200 Tensor Core GPU datasheet: BF16 1,979 TFLOP/s with sparsity",
              "runs": {n: dataclasses.asdict(all_runs(args.smoke)[n]) for n in args.configs},
              "results": results, "notes": notes, "differences": list(DIFFERENCES)}
    return _write_report(report, out_dir, shipped, entries)


def _write_report(report: dict, out_dir: str, shipped: dict, entries: dict) -> int:
    """The rows and table of `report`'s results against `entries` (the predictions),
    written as gpu_truth.json and gpu_truth.md in out_dir and printed."""
    rows = [r for name, results in report["results"].items()
            for r in rows_for(name, results, entries[name], report["peak_flops"])]
    notes = list(report["notes"])
    if not any(r.get("deviceless") for r in rows):
        notes.append("no deviceless predictions shipped for these configs")
    report = {**report, "rows": rows,
              "predictions": {k: shipped.get(k) for k in ("target", "versions", "command")}}
    table = markdown(rows, report["peak_flops"], notes)
    _write(os.path.join(out_dir, "gpu_truth.json"), report)
    with open(os.path.join(out_dir, "gpu_truth.md"), "w") as f:
        f.write(table)
    print(table)
    print(f"wrote {out_dir}/gpu_truth.json and gpu_truth.md ({report['seconds']:.0f} s measuring)")
    return 0


class _HloText:
    """A compiled program known by its optimized HLO text alone (what
    `time_model.compiled_ops` reads where there is no runtime executable)."""

    def __init__(self, text: str):
        self.text = text

    def runtime_executable(self):
        raise RuntimeError("no runtime executable: read the text")

    def as_text(self) -> str:
        return self.text


def report_again(folder: str, out_dir: str, predictions: str) -> int:
    """The table of a device run (folder: its gpu_truth.json and HLO archive) against
    the predictions shipped now, with the time model of each program it compiled,
    computed here (the device's JAX may lack what the time model reads)."""
    from remat_kit.measure import time_model
    report = _read(os.path.join(folder, "gpu_truth.json"))
    if report is None or "results" not in report:
        print(f"gpu_truth: no device run's gpu_truth.json in {folder}", file=sys.stderr)
        return 2
    line = time_model.roofline(PREDICT_TARGET)
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(os.path.join(folder, HLO_TAR)) as tar:
            tar.extractall(tmp, filter="data")
        for row in (r for rs in report["results"].values() for r in rs):
            path = os.path.join(tmp, "hlo", row.get("hlo_file") or "-")
            if os.path.isfile(path) and row.get("device_compile"):
                with open(path) as f:
                    row["device_compile"]["time_model_seconds"] = time_model.compiled_seconds(
                        _HloText(f.read()), line)
    shipped, notes = _read(predictions) or {}, []
    entries = _entries(report["results"], ALL_RUNS, shipped, notes)
    os.makedirs(out_dir, exist_ok=True)
    return _write_report({**report, "notes": report["notes"] + notes}, out_dir, shipped,
                         entries)


def _run_child(args, name: str, spec: str, entry: dict | None, start: float) -> dict:
    """One policy's row from its own process; an auto spec runs the plan shipped for it."""
    left = args.time_limit - (time.perf_counter() - start)
    if left < 5:
        return {"policy": spec, "error": "skipped: --time-limit reached"}
    plan = ((entry or {}).get("policies", {}).get(spec) or {}).get("resolved")
    hlo = os.path.join(args.hlo_dir, f"{name}-{len(os.listdir(args.hlo_dir))}.hlo.txt")
    row = _child(name, args.smoke, plan or spec, args.warmup, args.steps,
                 left if args.smoke else min(left, CHILD_SECONDS), hlo)
    print(f"{name} {spec}: peak {_gib(row.get('measured_peak_bytes'))}, "
          f"{row.get('step_time', {}).get('median_s', row.get('error'))}", flush=True)
    return {**row, "policy": spec, "resolved": row.get("resolved", plan or spec)}


def _set_measure_env() -> str | None:
    """MEASURE_ENV, before JAX starts its backend; values the user set are kept. The
    children inherit it, and one autotuning cache: a fresh folder (returned, for the
    caller to remove) unless XLA_FLAGS names one."""
    for key, value in MEASURE_ENV.items():
        if not (key == "XLA_CLIENT_MEM_FRACTION" and "XLA_PYTHON_CLIENT_MEM_FRACTION"
                in os.environ):  # JAX refuses both names at once
            os.environ.setdefault(key, value)
    flags = os.environ.get("XLA_FLAGS", "")
    if AUTOTUNE_CACHE_FLAG not in flags:
        cache = tempfile.mkdtemp(prefix="gpu_truth_autotune_")
        os.environ["XLA_FLAGS"] = f"{flags} {AUTOTUNE_CACHE_FLAG}={cache}".strip()
        return cache
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, any backend")
    parser.add_argument("--predict", action="store_true",
                        help=f"make the deviceless {PREDICT_TARGET} figures (CUDA plugin needed)")
    parser.add_argument("--configs", type=lambda s: s.split(","), default=None)
    parser.add_argument("--policies", type=lambda s: s.split(","), default=list(POLICIES))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--time-limit", type=float, default=380.0,
                        help="seconds for all the runs; later policies are skipped")
    parser.add_argument("--out", default="gpu_truth_out", help="used where $OUT is not set")
    parser.add_argument("--predictions", default=PREDICTIONS)
    parser.add_argument("--report", metavar="DIR",
                        help="the table again from DIR's gpu_truth.json (a device run's), with "
                             "the predictions shipped now and the time model of its HLO")
    parser.add_argument("--child", nargs=2, metavar=("CONFIG", "POLICY"), help=argparse.SUPPRESS)
    parser.add_argument("--hlo", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    known = ALL_RUNS if args.predict else all_runs(args.smoke)
    if args.configs is None:
        args.configs = list(known)
    bad = [c for c in args.configs if c not in known]
    if bad or args.steps < 2 or args.warmup < 0:
        print("gpu_truth: " + (f"unknown config {bad[0]!r}; valid: {', '.join(known)}" if bad
                               else "--steps must be at least 2 and --warmup at least 0"),
              file=sys.stderr)
        return 2
    if args.child:
        row = measure_one(known[args.child[0]], args.child[1], args.warmup, args.steps,
                          args.hlo)
        print(MARK + json.dumps(row), flush=True)
        return 0
    if args.predict:
        predict(args.configs, args.policies, args.predictions)
        return 0
    if args.report:
        return report_again(args.report, args.out, args.predictions)
    return measure_all(args)


if __name__ == "__main__":
    sys.exit(main())
