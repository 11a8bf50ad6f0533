"""GPU truth: each policy's real train step on one NVIDIA GPU against what remat_kit predicted.

    PYTHONPATH=. python benchmarks/gpu_truth.py            # on a machine with the GPU
    PYTHONPATH=. python benchmarks/gpu_truth.py --smoke    # anywhere: tiny shapes, CPU
    PYTHONPATH=. python benchmarks/gpu_truth.py --predict  # the deviceless figures (CUDA plugin)

For each config (`RUNS`: GPT-2 medium shapes and Llama 3.2 1B shapes, bfloat16
activations, float32 parameters, AdamW, layers scanned) and each policy in
`POLICIES`, one fresh process compiles the train step of `remat_kit.decide.step.train_step`
on the device (`lowering.compile_for`, parameters and optimizer state donated), runs
`--warmup` steps and then `--steps` timed ones, and reports:

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
* the step-time ratio to `none` that a time model predicts, where remat_kit has one.

The auto row is the plan made deviceless for the H200 (`auto:budget=0.5`: half of
no remat's value-and-grad peak), shipped with the predictions, so the GPU runs the
policy the CPU chose; without a shipped plan it is planned on the device.

Where a prediction can differ from the measured peak (see `DIFFERENCES`, printed
under the table): the allocator, the memory the client is given, cuDNN and cuBLAS
workspaces, and the compiler's version and flags. The environment of the
measurement is set here (`MEASURE_ENV`, values a user set are kept) and recorded.

Policies run one after another across the configs (none for both, then full, ...);
no policy starts after --time-limit seconds (default 380, so a whole run takes under 7
minutes on an H200) and none runs longer than CHILD_SECONDS on a GPU. The children
share one XLA autotuning cache, which changes compile times only.

Writes gpu_truth.json and gpu_truth.md to $OUT (default ./gpu_truth_out) and prints
the table. Without a GPU and without --smoke it says so in one line and exits 2.
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
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)  # the working tree's remat_kit, in this process and its children
PREDICTIONS = os.path.join(HERE, "gpu_truth_predictions.json")
PREDICT_TARGET = "gpu:h200"
H200_BF16_PEAK = 989e12  # FLOP/s, dense (NVIDIA H200 Tensor Core GPU datasheet)
POLICIES = ("none", "full", "selective", "minimal", "dots", "auto")  # auto: Run.auto
MARK = "GPU_TRUTH_ROW "  # a child's result line on its stdout
# The allocator and its limit, set before JAX starts its backend (the children
# inherit them): the BFC allocator (the only one memory_stats reports on),
# growing on demand rather than taking its pool at start, up to 95% of the GPU's
# memory instead of JAX's default 75%, so a step that fits the device fits here.
MEASURE_ENV = {"XLA_PYTHON_CLIENT_ALLOCATOR": "bfc", "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
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
    "default 75%); XLA_PYTHON_CLIENT_PREALLOCATE=false grows the pool on demand, which can "
    "fragment near the limit: a step predicted to fit can still fail to allocate. Neither "
    "changes peak_bytes_in_use of a step that runs.",
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
    the planner budget of its auto row (a fraction of no remat's value-and-grad peak)."""

    base: str
    overrides: dict
    batch: int
    seq: int
    auto: str = "auto:budget=0.5"

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
    "tiny": Run("tiny", {**_BF16}, batch=2, seq=32, auto="auto:budget=0.8"),
}


def runs(smoke: bool) -> dict[str, Run]:
    return SMOKE_RUNS if smoke else RUNS


def _fingerprint(run: Run) -> dict:
    """What the predictions must match: the model's fields and the shapes, as JSON has them."""
    return json.loads(json.dumps({"model": dataclasses.asdict(run.config().replace(remat="none")),
                                  "batch": run.batch, "seq": run.seq}))


def _matches(entry: dict | None, run: Run) -> bool:
    """Whether `entry` was predicted for `run`; a config field added since, at its
    default, changes no program, so it does not stale the entry."""
    if entry is None or not isinstance(entry.get("model"), dict):
        return False
    want = _fingerprint(run)
    cls = type(run.config())
    defaults = json.loads(json.dumps({f.name: f.default for f in dataclasses.fields(cls)
                                      if f.default is not dataclasses.MISSING}))
    model = {**{k: defaults[k] for k in want["model"]
                if k not in entry["model"] and k in defaults}, **entry["model"]}
    return {"model": model, "batch": entry.get("batch"), "seq": entry.get("seq")} == want


def _spec(policy: str, run: Run) -> str:
    return run.auto if policy == "auto" else policy


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


def measure_one(run: Run, spec: str, warmup: int, steps: int) -> dict:
    """Compile, run and time one policy on JAX's default device; a JSON-ready row."""
    import jax
    from remat_kit.measure import targets
    from remat_kit.measure import lowering
    from remat_kit.decide.step import TrainStep, step_figures
    from remat_kit.models.shortcuts import train_step
    device = jax.devices()[0]
    row = {"policy": spec, "device": device.device_kind, "platform": device.platform,
           "versions": targets.versions(device.platform)}
    cfg = run.config()
    try:
        if _auto_budget(spec) is not None:  # no plan shipped: plan on this device
            from remat_kit.models.shortcuts import config_planner
            spec = config_planner(cfg, run.batch, run.seq, cache=False).plan(
                _auto_budget(spec)).spec
            row["planned_on"] = device.platform
        row["resolved"] = spec
        made = train_step(cfg, run.batch, run.seq, spec)
        c = lowering.compile_for(made.step, *made.args, compile_only=False,
                                donate=TrainStep.DONATED, count_flops=False)
        figures = step_figures(c, made.args)
        row["device_compile"] = {"total_bytes": figures.total_bytes, "source": figures.source,
                                 **c.memory, "compile_seconds": c.seconds}
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


def _child(name: str, smoke: bool, spec: str, warmup: int, steps: int, timeout: float) -> dict:
    """measure_one in a fresh process (its own allocator, so its own peak)."""
    argv = [sys.executable, os.path.abspath(__file__), "--child", name, spec,
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

def _time_model_seconds(made) -> tuple[float | None, str]:
    """The step's seconds on the H200 by remat_kit's time model, where there is one."""
    if importlib.util.find_spec("remat_kit.measure.time_model") is None:
        return None, "remat_kit has no time model yet (the planner minimizes FLOPs)"
    import jax
    from remat_kit.measure import time_model
    jaxpr = jax.make_jaxpr(made.step)(*made.args).jaxpr
    return (time_model.program_seconds(jaxpr, time_model.roofline(PREDICT_TARGET), {}),
            "remat_kit.measure.time_model roofline of the step's jaxpr")


def predict_one(run: Run, spec: str) -> dict:
    """The deviceless H200 figures of one policy (an auto spec planned first)."""
    from remat_kit.models.shortcuts import train_step
    from remat_kit.models.shortcuts import step_memory
    from remat_kit.models.shortcuts import config_planner
    cfg, out = run.config(), {"policy": spec}
    start = time.perf_counter()
    try:
        if _auto_budget(spec) is not None:
            planner = config_planner(cfg, run.batch, run.seq, target=PREDICT_TARGET,
                                     cache=False)
            plan = planner.plan(_auto_budget(spec))
            out["plan"] = {"spec": plan.spec, "value_and_grad_bytes": plan.measured_bytes,
                           "budget_bytes": plan.budget_bytes,
                           "compiles": len({id(r) for r in planner.records.values()})}
            spec = plan.spec
        out["resolved"] = spec
        m = step_memory(cfg, run.batch, run.seq, spec, target=PREDICT_TARGET)
        out.update(dataclasses.asdict(m))
        out["time_model_seconds"], out["time_model"] = _time_model_seconds(
            train_step(cfg, run.batch, run.seq, spec))
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
        run = {**RUNS, **SMOKE_RUNS}[name]
        entry = found.setdefault("configs", {}).get(name)
        if not _matches(entry, run):
            entry = {**_fingerprint(run), "policies": {}}
        for spec in (_spec(p, run) for p in policies):
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


def rows_for(name: str, results: list[dict], shipped: dict | None, peak_flops: float | None):
    """The report rows of one config: each child's row with its predictions and ratios."""
    predicted = (shipped or {}).get("policies", {})
    none = next((r for r in results if r["policy"] == "none" and "step_time" in r), None)
    none_flops = predicted.get("none", {}).get("flops")
    out = []
    for r in results:
        p = predicted.get(r["policy"], {})
        t = r.get("step_time")
        row = {"config": name, **r, "deviceless": p or None,
               "ratio_to_none": t and none and t["median_s"] / none["step_time"]["median_s"],
               "flop_ratio_to_none": p.get("flops") and none_flops and p["flops"] / none_flops,
               "predicted_ratio_to_none": (
                   p.get("time_model_seconds") and predicted.get("none", {}).get(
                       "time_model_seconds") and p["time_model_seconds"]
                   / predicted["none"]["time_model_seconds"]),
               "mfu": t and peak_flops and none_flops and none_flops / t["median_s"] / peak_flops,
               "hfu": (t and peak_flops and p.get("flops")
                       and p["flops"] / t["median_s"] / peak_flops)}
        out.append(row)
    return out


def markdown(rows: list[dict], peak_flops: float | None, notes: list[str]) -> str:
    head = ("| config | policy | measured peak | device compile | deviceless H200 | "
            "step time (median, q1-q3) | × none | predicted × none | FLOPs × none | MFU | HFU |")
    lines = [head, "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
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
        fmt = lambda x, f: "-" if x is None else f.format(x)  # noqa: E731
        lines.append(
            f"| {r['config']} | {policy} | {_gib(measured)} | {_gib(device)}{_off(device, measured)}"
            f" | {_gib(less)}{_off(less, measured)} | {time_text} | "
            f"{fmt(r['ratio_to_none'], '{:.3f}')} | {fmt(r['predicted_ratio_to_none'], '{:.3f}')}"
            f" | {fmt(r['flop_ratio_to_none'], '{:.3f}')} | {fmt(r['mfu'], '{:.1%}')} | "
            f"{fmt(r['hfu'], '{:.1%}')} |")
    peak = (f"{peak_flops / 1e12:.0f} TFLOP/s (H200 SXM dense bf16, NVIDIA's datasheet)"
            if peak_flops else "none on this platform, so no MFU")
    lines += ["", f"MFU: the no-remat step's FLOPs (XLA's count) per measured second over "
                  f"the peak, {peak}; HFU: the policy's own FLOPs, recompute included. "
                  "Percentages: the prediction against the measured peak.", ""]
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
    cache = _set_measure_env()
    try:
        return _measure_all(args)
    finally:
        if cache is not None:
            shutil.rmtree(cache, ignore_errors=True)


def _measure_all(args) -> int:
    out_dir = os.environ.get("OUT") or args.out
    os.makedirs(out_dir, exist_ok=True)
    shipped = _read(args.predictions) or {}
    peak_flops = None if args.smoke else H200_BF16_PEAK
    notes, start = [], time.perf_counter()
    entries, results = {}, {name: [] for name in args.configs}
    for name in args.configs:
        entry = shipped.get("configs", {}).get(name)
        if entry is not None and not _matches(entry, runs(args.smoke)[name]):
            notes.append(f"{name}: the shipped predictions are for other shapes; rerun --predict")
            entry = None
        entries[name] = entry
    # Policy by policy across the configs, so a time limit cuts the last policies of
    # every config rather than a whole config.
    for policy in args.policies:
        for name in args.configs:
            spec = _spec(policy, runs(args.smoke)[name])
            left = args.time_limit - (time.perf_counter() - start)
            if left < 5:
                results[name].append({"policy": spec, "error": "skipped: --time-limit reached"})
                continue
            plan = ((entries[name] or {}).get("policies", {}).get(spec) or {}).get("resolved")
            row = _child(name, args.smoke, plan or spec, args.warmup, args.steps,
                         left if args.smoke else min(left, CHILD_SECONDS))
            results[name].append({**row, "policy": spec,
                                  "resolved": row.get("resolved", plan or spec)})
            print(f"{name} {spec}: peak {_gib(row.get('measured_peak_bytes'))}, "
                  f"{row.get('step_time', {}).get('median_s', row.get('error'))}", flush=True)
    rows = [r for name in args.configs
            for r in rows_for(name, results[name], entries[name], peak_flops)]
    if not any(r.get("deviceless") for r in rows):
        notes.append("no deviceless predictions for these configs: " + args.predictions)
    if all(r.get("predicted_ratio_to_none") is None for r in rows):
        notes.append("predicted × none: empty, remat_kit has no time model yet (the planner "
                     "minimizes FLOPs; FLOPs × none is beside it)")
    table = markdown(rows, peak_flops, notes)
    # The parent never starts JAX's backend: a CUDA context here would take device
    # memory from the children. Versions and the device come from their rows.
    first = next((r for r in rows if "versions" in r), {})
    report = {"command": " ".join(["python", *sys.argv]), "smoke": args.smoke,
              "seconds": time.perf_counter() - start, "versions": first.get("versions"),
              "device": first.get("device"),
              "environment": {k: os.environ.get(k) for k in RECORDED_ENV},
              "peak_flops": peak_flops, "peak_flops_source": None if args.smoke else
              "NVIDIA H200 Tensor Core GPU datasheet: BF16 1,979 TFLOP/s with sparsity",
              "predictions": {k: shipped.get(k) for k in ("target", "versions", "command")},
              "runs": {n: dataclasses.asdict(runs(args.smoke)[n]) for n in args.configs},
              "rows": rows, "notes": notes, "differences": list(DIFFERENCES)}
    _write(os.path.join(out_dir, "gpu_truth.json"), report)
    with open(os.path.join(out_dir, "gpu_truth.md"), "w") as f:
        f.write(table)
    print(table)
    print(f"wrote {out_dir}/gpu_truth.json and gpu_truth.md in {report['seconds']:.0f} s")
    return 0


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
        import tempfile
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
    parser.add_argument("--child", nargs=2, metavar=("CONFIG", "POLICY"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    known = {**RUNS, **SMOKE_RUNS} if args.predict else runs(args.smoke)
    if args.configs is None:
        args.configs = list(known)
    bad = [c for c in args.configs if c not in known]
    if bad or args.steps < 2 or args.warmup < 0:
        print("gpu_truth: " + (f"unknown config {bad[0]!r}; valid: {', '.join(known)}" if bad
                               else "--steps must be at least 2 and --warmup at least 0"),
              file=sys.stderr)
        return 2
    if args.child:
        row = measure_one(known[args.child[0]], args.child[1], args.warmup, args.steps)
        print(MARK + json.dumps(row), flush=True)
        return 0
    if args.predict:
        predict(args.configs, args.policies, args.predictions)
        return 0
    return measure_all(args)


if __name__ == "__main__":
    sys.exit(main())
