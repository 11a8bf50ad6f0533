"""remat-kit: what each remat policy costs on your model before you launch (compare,
explain), the cheapest policy for a memory budget (plan), the longest sequence that fits (fit).

    remat-kit compare --config gpt2_small --batch 8 --seq 1024 --target cpu,tpu:v5e:1x1

`main` parses the flags and runs one command; each answer opens with the model map's line and
the verdict, then a table; bad input is one line on stderr, exit status 2.
The commands and their flags: docs/compare.md, docs/plan.md, docs/fit.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Sequence

from remat_kit import files as outputs
from remat_kit.cli import compare as compare_command
from remat_kit.cli import explain as explain_command
from remat_kit.cli import fit as fit_command
from remat_kit.cli import plan as plan_command
from remat_kit.cli import stops
from remat_kit.cli.common import make_host_devices
from remat_kit.ui.inputs import BadInput, non_negative_int, positive_int
from remat_kit.errors import RematSpecError
from remat_kit.measure import cluster, pool
from remat_kit.models import CONFIGS
from remat_kit.models.config import DTYPES


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    """The remat-kit parser: one subcommand per command, each with its flags."""
    parser = _Parser(prog="remat-kit", description=__doc__.split("\n\n")[0] + " " + YOUR_MODEL,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="{compare,explain,plan,fit}")
    for add in (_add_compare, _add_explain, _add_plan, _add_fit):
        add(sub)
    return parser


# The first lines of every --help: your own model, and the loss measured on it.
YOUR_MODEL = """
Your own model: --model FILE.py:FN, FN() returning
  a linen or NNX model (int32 tokens [batch, seq] -> logits): measured with
      remat-kit's mean next-token cross-entropy of its logits, or
  (model, batch, loss): measured with your loss(output, batch) -> scalar.
The table's title names the loss measured."""


def _command(sub, name: str, text: str):
    """The subparser `name` on `sub`, `text` its help, with `YOUR_MODEL` first in its --help."""
    return sub.add_parser(name, help=text, description=text + "." + YOUR_MODEL,
                          formatter_class=argparse.RawDescriptionHelpFormatter)


def _source_flags(p) -> None:
    """The flags every command takes: the model (--config or --model, --block) and its sizes
    and dtype."""
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--config",
                        help=f"a model name ({', '.join(CONFIGS)}) or a .py config file "
                             "with get_config()")
    source.add_argument("--model", metavar="FILE.py:FUNCTION",
                        help="your own model: FUNCTION() returns a linen or NNX model "
                             "(int32 tokens [batch, seq] -> logits, measured with remat-kit's "
                             "next-token cross-entropy), or (model, batch, loss) to measure "
                             "your loss(output, batch) -> scalar; or FUNCTION(batch, seq) "
                             "returns a remat_kit.Workload; also package.module:FUNCTION")
    p.add_argument("--block", default=None, metavar="NAME[,NAME]",
                   help="with --model: the repeated block class(es) to remat (default: the "
                        "class whose instances hold the most parameters, and any other "
                        "repeated one apart from it, e.g. an encoder's layers)")
    p.add_argument("--batch", type=positive_int, default=None,
                   help="global batch size (default: the config file's batch_size, or 8)")
    p.add_argument("--seq", type=positive_int, default=None,
                   help="sequence length (default: the config file's seq_len, or "
                        "min(max_len, 1024))")
    p.add_argument("--vocab-chunks", type=positive_int, default=None, metavar="N",
                   help="compute the loss over N vocabulary slices, each recomputed in "
                        "the backward pass, so the float32 logits and their gradient "
                        "never exist whole (N must divide the vocabulary; default 1)")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="activation dtype (default: the config's)")
    p.add_argument("--rules", default=None, metavar="FILE.json",
                   help="with --model: logical-axis rules ([[logical name, mesh axes], ...]) "
                        "for a model whose logical names nothing of its own maps")
    p.add_argument("--batch-axes", default=None, metavar="AXIS[,AXIS]",
                   help="with --model: the mesh axes the batch splits over where the "
                        "model's rules name none (default: data and fsdp)")


# --target's help, alike in every command: the chips first, then this machine's.
TARGET_HELP = ("the chip whose compiler measures: tpu:<chip>:<topology> ahead of time via "
               "libtpu (tpu:v5e:1x1, tpu:v5p:1x1x1, tpu:v6e:2x2; :slices=N for N slices, "
               "tpu:v5p:2x2x1:slices=2), or a Cloud TPU type (tpu:v5p-8, tpu:v5litepod-16, "
               "tpu:v6e-8), gpu:<chip> deviceless "
               "(gpu:h100, gpu:h200, gpu:a100), cpu, or tpu / gpu (this machine's); default "
               "JAX's default backend, which ranks policies as that machine does")


def _jobs(text: str) -> int:
    """argparse type of --jobs: a whole number in 1..the cores (`pool.check_jobs`)."""
    try:
        return pool.check_jobs(int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a whole number from 1 to {pool.cores()} (this machine's cores), "
            f"got {text!r}") from None


def _jobs_flag(p) -> None:
    """--jobs and --ray, on a command that compiles several programs."""
    p.add_argument("--jobs", type=_jobs, default=None, metavar="N",
                   help="compiles run at once (default: one a core, as many as the free "
                        "memory holds at 2 GiB a compile; one starts beside another only "
                        "while the free memory holds the peak RSS a compile was measured to "
                        "add); the answers do not depend on it")
    p.add_argument("--ray", default=None, metavar="ADDRESS",
                   help="compile on the Ray cluster at ADDRESS (host:port, ray://host:10001, "
                        "auto; local: start one here), as many at once as it has CPUs; "
                        "default $RAY_ADDRESS, else none. Needs ray (pip install "
                        "'remat-kit[ray]'); the answers are those of a local run")


def _add_compare(sub) -> None:
    """`compare` and its flags, on the subparsers `sub`."""
    compare = _command(sub, "compare", "measure every policy: memory, FLOPs, time")
    _source_flags(compare)
    _jobs_flag(compare)
    compare.add_argument("--policies", default=None,
                         help="comma-separated policy specs, or all for every preset "
                              "(default: every preset on the CPU; none,full,minimal,dots,"
                              "selective on a TPU or GPU target, whose compiles are slow, "
                              "and minimal_with_context where the model has fused attention)")
    compare.add_argument("--mesh", default=None,
                         help="e.g. data:2,fsdp:2,tensor:2: measure sharded, per device; "
                              "a --model may name its own axes (replica:1,shard:4,model:1), "
                              "and a model that builds its own mesh is measured on it "
                              "(docs/meshes.md)")
    compare.add_argument("--target", default=None,
                         help=TARGET_HELP + "; comma-separated targets go side by side")
    compare.add_argument("--budget", default=None, metavar="SIZE",
                         help="memory per device the verdict's policy must fit, e.g. 16GiB "
                              "(default: the target chip's memory less 10%%; on the CPU the "
                              "verdict is the Pareto row with the least memory x cost)")
    compare.add_argument("--time", type=non_negative_int, default=0, metavar="N",
                         help="also time N steps per policy on random data")
    compare.add_argument("--json", default=None, metavar="PATH", help="write the records here")
    compare.add_argument("--plot", default=None, metavar="PATH",
                         help="write a memory vs FLOPs PNG here")
    compare.add_argument("--wide", action="store_true",
                         help="every column (residuals, per layer, Korthikanti's estimate, "
                              "FLOPs, compile seconds, ...), not the 100-column default")
    compare.add_argument("--peak", action="store_true",
                         help="also say what holds each policy's peak (XLA's buffer "
                              "assignment, grouped): a line per policy, and in --json")
    compare.set_defaults(run=compare_command.run)


def _add_explain(sub) -> None:
    """`explain` and its flags, on the subparsers `sub`."""
    explain = _command(sub, "explain", "what one layer saves under one policy")
    _source_flags(explain)
    explain.add_argument("--policy", default=None, help="a policy spec (default: the config's)")
    explain.add_argument("--mesh", default=None,
                         help="e.g. data:2,fsdp:2,tensor:2: the layer one device runs")
    explain.add_argument("--target", default=None,
                         help="also compile the layer for this target (cpu, tpu:v5e:1x1, "
                              "gpu:h100, ...) and print its temp memory and FLOPs")
    explain.add_argument("--map", action="store_true",
                         help="print the model map in full, one line per layer, and stop")
    explain.add_argument("--audit", action="store_true",
                         help="also compile the whole model under the policy and print, per "
                              "tag, what it asks (save, offload, recompute) against what the "
                              "compiled program does, a line per difference")
    explain.add_argument("--peak", action="store_true",
                         help="also compile the whole model under the policy and say what "
                              "holds its peak (XLA's buffer assignment, grouped)")
    explain.set_defaults(run=explain_command.run)


def _add_plan(sub) -> None:
    """`plan` and its flags, on the subparsers `sub`."""
    plan = _command(sub, "plan", "the cheapest policy for each memory budget")
    _source_flags(plan)
    _jobs_flag(plan)
    plan.add_argument("--budgets", required=True,
                      help="comma-separated budgets: sizes (6GiB, 512MiB, 8e9B for bytes) or fractions "
                           "0 < f <= 1 of no remat's memory (temp on CPU, the compiler's "
                           "peak on TPU and GPU)")
    presets = plan.add_mutually_exclusive_group()
    presets.add_argument("--presets", default=None,
                         help="comma-separated specs to set against the plans (default: every "
                              "preset)")
    presets.add_argument("--no-presets", action="store_true", help="compare with no preset")
    plan.add_argument("--mesh", default=None,
                      help="e.g. data:2,fsdp:2,tensor:2: plan the per-device program")
    plan.add_argument("--target", default=None,
                      help=TARGET_HELP + "; the plan is against its compiled memory")
    plan.add_argument("--cache", default=None, metavar="PATH",
                      help="plan cache file (default: $REMAT_KIT_CACHE or "
                           "~/.cache/remat_kit/plans.json); '' for none")
    plan.add_argument("--json", default=None, metavar="PATH", help="write plans and presets here")
    plan.add_argument("--wide", action="store_true",
                      help="every column (the budget's bytes, tries, the best preset that "
                           "fits), not the 100-column default")
    plan.add_argument("--plot", default=None, metavar="PATH",
                      help="write a PNG of the plans over the presets' points")
    _plan_search_flags(plan)
    plan.set_defaults(run=plan_command.run)


def _plan_search_flags(plan) -> None:
    """plan's flags for what the planner searches: groups, objective, offload, the step a
    budget covers, one decision per tag, and what the plan is written out for."""
    plan.add_argument("--groups", default=None, metavar="G",
                      help="decide each tag in G groups of consecutive layers (default: one "
                           "group per layer, up to 64; 1: one decision for every layer)")
    plan.add_argument("--objective", default=None, metavar="flops|time",
                      help="minimize FLOPs or predicted step time (default: time only on a "
                           "target whose time model was checked within reach of measured "
                           "step times, flops elsewhere; time prints how far it was checked)")
    offload = plan.add_mutually_exclusive_group()
    offload.add_argument("--offload", dest="offload", action="store_const", const=True,
                         default=None, help="also plan offload to host memory, at the target's "
                         "host bandwidth (tpu:v5e, tpu:v5p, gpu:h100, gpu:h200; cpu: its memory "
                         "bandwidth), where a probe compile of this model shows offload lowers "
                         "device memory (docs/plan.md)")
    offload.add_argument("--no-offload", dest="offload", action="store_const", const=False,
                         help="plan save and recompute only")
    plan.add_argument("--step", default=None, metavar="grad|train",
                      help="the step a budget covers: train (the whole train step as fit "
                           "measures it: parameters, gradients, AdamW state and update, the "
                           "batch; the default on a TPU or GPU target where any budget is a size, "
                           "a fraction then being of no remat's train step) or "
                           "grad (value and grad, compare's figure; the default elsewhere)")
    plan.add_argument("--uniform", action="store_true",
                      help="one decision per tag for every layer (--groups 1), and what that "
                           "costs against the per-layer plan")
    plan.add_argument("--emit", default=None, metavar="maxtext|jax|remat_kit",
                      help="also write each plan out for the framework that runs it: MaxText's "
                           "overrides (remat_policy=custom ...; the plan keeps to MaxText's "
                           "tensors), the jax.checkpoint_policies expression, or the "
                           "rk.remat_model call")


def _add_fit(sub) -> None:
    """`fit` and its flags, on the subparsers `sub`."""
    fit = _command(sub, "fit", "the longest seq (or largest batch) each policy fits "
                                     "in a memory budget")
    _source_flags(fit)
    _jobs_flag(fit)
    fit.add_argument("--budget", default=None,
                     help="device memory per device, e.g. 16GiB, 512MiB, 8e9B for bytes (also the "
                          "budget of an auto row); default what a TPU or GPU target's device "
                          "holds for a program (a GPU: the share JAX takes, "
                          "XLA_PYTHON_CLIENT_MEM_FRACTION, 75%% by default); needed on the CPU")
    fit.add_argument("--vary", choices=("seq", "batch"), default="seq",
                     help="search the sequence length (global batch fixed, default 1, or "
                          "data x fsdp on a mesh) or the global batch (seq fixed)")
    fit.add_argument("--multiple", type=positive_int, default=None,
                     help="search in multiples of this (default 128 for seq; 1 for batch, or "
                          "data x fsdp on a mesh)")
    fit.add_argument("--policies", default=None,
                     help="comma-separated policy specs, and auto for the planner's pick at "
                          "each size (default: none,full,minimal,selective,dots)")
    fit.add_argument("--mesh", default=None,
                     help="e.g. data:2,fsdp:2,tensor:2: the step sharded over a mesh; the "
                          "budget is per device, the batch global (default: one device)")
    fit.add_argument("--target", default=None,
                     help=TARGET_HELP + "; the budget is per chip")
    fit.add_argument("--json", default=None, metavar="PATH", help="write the result here")
    fit.add_argument("--wide", action="store_true",
                     help="every column (the step memory's parts, FLOPs/token, compiles), "
                          "not the 100-column default")
    fit.add_argument("--plot", default=None, metavar="PATH",
                     help="write a bar chart of the sizes (PNG) here")
    fit.set_defaults(run=fit_command.run)


def use_compile_cache() -> None:
    """Keeps the commands' compiled programs in JAX's persistent compilation cache,
    so a repeated run loads them instead of compiling (the same memory and FLOP
    figures; only the compile seconds shrink). The folder is $REMAT_KIT_COMPILE_CACHE,
    default ~/.cache/remat_kit/jax ($XDG_CACHE_HOME if set); an empty value
    turns it off, and JAX_COMPILATION_CACHE_DIR, if set, is used as JAX uses it.

    Raises:
      BadInput: $REMAT_KIT_COMPILE_CACHE names something that is not a folder
        (/dev/null, a file): the figures would go to "/dev/null-figures".
    """
    if "JAX_COMPILATION_CACHE_DIR" in os.environ:
        return
    home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = os.environ.get("REMAT_KIT_COMPILE_CACHE", os.path.join(home, "remat_kit", "jax"))
    if path and os.path.exists(path) and not os.path.isdir(path):
        raise BadInput(f"REMAT_KIT_COMPILE_CACHE={path!r} is not a folder; give a folder for "
                       "the compile cache, or an empty value for none")
    if path:
        import jax
        jax.config.update("jax_compilation_cache_dir", path)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command; returns the exit status (2 for bad input)."""
    parser = _parser()
    try:
        args = parser.parse_args(_joined_values(sys.argv[1:] if argv is None else list(argv)))
    except SystemExit as e:  # --help, or a usage error already printed
        return e.code
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    with warnings.catch_warnings(), stops.catching():
        warnings.showwarning = _one_line_warning
        try:
            use_compile_cache()
            make_host_devices(args)  # before anything starts JAX's backend
            with pool.using(getattr(args, "jobs", None)), \
                    cluster.using(getattr(args, "ray", None)):
                return args.run(args)
        except stops.Stopped as e:  # Ctrl-C or SIGTERM: one line, never a traceback
            stops.handled()
            print(f"remat-kit {args.command}: stopped by {e.name}; {stops.kept(args)}",
                  file=sys.stderr)
            if argv is None:  # this process's own command line: it ends here
                stops.end_process(e.exit_code)
            return e.exit_code
        except (BadInput, RematSpecError, ValueError) as e:
            # RematSpecError is a ValueError; other ValueErrors here come from
            # validating sizes and dtypes before anything is measured.
            print(f"remat-kit {args.command}: error: {' '.join(str(e).split())}",
                  file=sys.stderr)  # as argparse names the command in its own errors
            return 2
        except outputs.OutputError as e:  # at the end, after the work: a disk fills up
            print(f"remat-kit {args.command}: error: {' '.join(str(e).split())}",
                  file=sys.stderr)
            return 1


def _joined_values(argv: list[str]) -> list[str]:
    """`--budget -1GiB` (or -inf) as `--budget=-1GiB`: argparse takes a value that starts with
    '-' and is not a plain number for an option, and would say only "expected one
    argument"; joined, the budget's own check names the bad value."""
    out = []
    for arg in argv:
        if (out and out[-1] in ("--budget", "--budgets") and arg[:1] == "-"
                and arg[1:2] != "-" and arg != "-h"):  # -1GiB, -inf, -nan, -.5
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def _one_line_warning(message, category, filename, lineno, file=None, line=None):
    print(f"remat-kit: warning: {' '.join(str(message).split())}", file=file or sys.stderr)
