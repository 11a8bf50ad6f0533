"""What the `remat-kit` commands take, checked before JAX starts: sizes, policy lists,
budgets, meshes and output paths (the model itself: `sources`). Each check raises
`BadInput`, one line for the user; `experiments/` use the same checks for their flags.
Docs: docs/compare.md ("Flags").
"""

from __future__ import annotations

import argparse
import math
import os
import re
import tempfile
from collections.abc import Sequence

from remat_kit import mesh as rk_mesh
from remat_kit.policy import names as tag_names
from remat_kit import files as outputs
from remat_kit.errors import BadInput, RematSpecError, shorten
from remat_kit.models import TransformerConfig
from remat_kit.policy.spec import BARE_NAMES, PRESET_TABLE, AutoSpec, parse, per_layer
from remat_kit.measure.targets import Target


# The largest size or count accepted: XLA takes shapes and seeds as 32-bit ints.
MAX_INT = 2**31 - 1


def check_int(name: str, value, minimum: int = 1) -> int:
    """`value` if it is an int in [minimum, MAX_INT], else BadInput naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= MAX_INT:
        kind = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise BadInput(f"{name} must be {kind} (at most {MAX_INT}), got {value!r}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an int in 1..MAX_INT, else ArgumentTypeError naming `text`."""
    try:  # ASCII digits only: int() also reads '٢' and '１６', which no other flag takes
        value = int(text) if text.strip().replace("_", "").isascii() else 0
    except ValueError:
        value = 0
    if not 0 < value <= MAX_INT:
        raise argparse.ArgumentTypeError(f"must be a positive int (at most {MAX_INT}), "
                                         f"got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: 0 or a positive int (`positive_int`)."""
    if text.strip() == "0":
        return 0
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be 0 or a positive int (at most {MAX_INT}), "
                                         f"got {text!r}") from None


def check_seq(cfg: TransformerConfig, seq: int, name: str = "--seq") -> None:
    """BadInput if a GPT-2 model has no position embedding for `seq` positions."""
    if cfg.family == "gpt2" and seq > cfg.max_len:
        raise BadInput(f"{name} {seq} exceeds the model's max_len {cfg.max_len} "
                       "(GPT-2 learns one position embedding per position)")


def check_memory(cfg: TransformerConfig, batch: int, seq: int, sizes: str) -> None:
    """BadInput if one layer's attention scores [batch, heads, seq, seq] alone
    outgrow the memory of the first device (host RAM on CPU): running would
    fail with out-of-memory after compiling. Starts JAX.

    Args:
      sizes: the user's names for batch and seq, e.g. "batch_size=8, seq_len=64".
    """
    import jax
    import jax.numpy as jnp

    from remat_kit.units import fmt_bytes

    need = batch * cfg.num_heads * seq * seq * jnp.dtype(cfg.dtype).itemsize
    device = jax.devices()[0]
    if device.platform == "cpu":
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    else:
        have = (device.memory_stats() or {}).get("bytes_limit")
    if have and need > have:
        raise BadInput(f"{sizes} do not fit: one layer's attention scores [{batch}, "
                       f"{cfg.num_heads}, {seq}, {seq}] {cfg.dtype} alone take "
                       f"{fmt_bytes(need)}, more than the {fmt_bytes(have)} of "
                       f"{device.platform} memory")


def out_of_memory(error: BaseException, sizes: str) -> BadInput | None:
    """A one-line BadInput for an XLA out-of-memory error (RESOURCE_EXHAUSTED),
    naming `sizes` and the bytes XLA asked for; None for any other error."""
    text = str(error)
    if "RESOURCE_EXHAUSTED" not in text:
        return None
    detail = text.split("RESOURCE_EXHAUSTED:", 1)[-1].strip().splitlines()[0]
    return BadInput(f"out of memory with {sizes}: {detail}")


def check_folder(path: str, flag: str, create: bool = False) -> None:
    """BadInput unless `path` is a folder a file can be written in; with
    `create`, makes it (and its parents) first. Run before any long work."""
    if not path or not path.strip():
        raise BadInput(f"{flag} is empty; give a folder")
    if os.path.exists(path) and not os.path.isdir(path):
        raise BadInput(f"{flag} {path!r} is a file, not a folder")
    if not create and not os.path.isdir(path):
        raise BadInput(f"{flag}: folder {path!r} does not exist")
    try:
        if create:
            os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise BadInput(f"{flag}: cannot write in folder {path!r} ({e.strerror or e})") from None


def check_output_file(path: str, flag: str, suffix: str | None = None) -> None:
    """BadInput unless `path` names a file (ending in `suffix`, if given) that
    can be written: not a folder, FIFO or device, in a folder that exists and
    is writable (`outputs.problem`). Run before any long work."""
    if not path:
        raise BadInput(f"{flag} is empty; give a file path")
    if suffix and not path.lower().endswith(suffix):
        raise BadInput(f"{flag} {path!r} must end in {suffix}")
    why = outputs.problem(path)
    if why:
        raise BadInput(f"{flag}: {why}; give a file path")


def check_json_and_plot(args) -> None:
    """`check_output_file` for a command's --json and --plot (a .png), where given, and
    `check_apart` for every file the command writes (with plan's --cache)."""
    for path, flag, suffix in ((args.json, "--json", None), (args.plot, "--plot", ".png")):
        if path is not None:
            check_output_file(path, flag, suffix=suffix)
    written = [(flag, path) for flag, path in (("--json", args.json), ("--plot", args.plot))
               if path]
    cache = getattr(args, "cache", "")
    if cache is None:  # plan's default cache is written too
        from remat_kit.decide.plan_cache import default_cache_path
        written.append(("the plan cache", default_cache_path()))
    elif cache:
        written.append(("--cache", cache))
    check_apart(written, input_files(args))


def input_files(args) -> list[tuple[str, str]]:
    """(what, path) of the files a command reads its model from: the --model's file
    (FILE.py, or a package.module's once imported), the modules loaded from its folder
    or below (what it imports from beside it: `import helpmod`), and a --config .py file."""
    import sys
    found = []
    spec = getattr(args, "model", None)
    if spec:
        path = spec.rpartition(":")[0]
        if not (path.endswith(".py") or os.sep in path):
            path = getattr(sys.modules.get(path), "__file__", None)
        if path:
            found.append((f"the file of --model {spec}", path))
            folder = os.path.join(os.path.dirname(os.path.realpath(path)), "")
            found += [(f"the file of module {name}, loaded from beside --model {spec}", file)
                      for name, file in sorted((n, getattr(m, "__file__", None))
                                               for n, m in list(sys.modules.items()))
                      if isinstance(file, str) and os.path.realpath(file).startswith(folder)]
    config = getattr(args, "config", None)
    if config and (config.endswith(".py") or os.sep in config):
        found.append((f"--config {config}", config))
    return found


def check_apart(written: Sequence[tuple[str, str]], read: Sequence[tuple[str, str]]) -> None:
    """BadInput, before any work, where a file to write (flag, path) is one of the
    files read (what, path), or two outputs are one file (`files.same_file`: links
    and relative paths included): one would replace the other, or the user's model.

    Args:
      written: (flag, path) of each output, e.g. ("--json", "out.json").
      read: (what, path) of each input, e.g. ("the file of --model m.py:f", "m.py").
    """
    for i, (flag, path) in enumerate(written):
        for what, other in [*read, *((f"{f} {p!r}", p) for f, p in written[:i])]:
            if outputs.same_file(path, other):
                raise BadInput(f"{flag} {path!r} is {what}; writing it would replace it: "
                               "give another path")


def _starts_policy(piece: str) -> bool:
    """False where `piece` opens with a bare tag, alias or glob (query_proj,
    key_proj;recompute:x): it continues the previous spec's tag list."""
    head = re.split(r"[;|@]", piece, maxsplit=1)[0].strip()
    if head in BARE_NAMES or ":" in head:
        return True
    try:
        tag_names.expand(head)
    except RematSpecError:
        return True
    return False


def split_policies(text: str, flag: str = "--policies") -> list[str]:
    """'minimal,save:query_proj,key_proj,full' -> ['minimal', 'save:query_proj,key_proj', 'full'].

    Commas separate policies, except before a piece that opens with a tag,
    alias or glob after a spec with a tag list (one with ':'): it continues
    that list, so every spec `parse` accepts stays whole
    ('save:query_proj,key_proj;recompute:attn_probs' is one policy).

    Raises:
      BadInput: `text` is empty, an item between commas is empty, or a
        policy does not parse (the message gives its item number).
    """
    if not text.strip():
        raise BadInput(f"{flag} is empty; give comma-separated policy specs, or leave it "
                       "out for every preset")
    if per_layer(text) is not None:
        raise BadInput(f"{flag} {shorten(text)!r} is a per-layer plan (plan's paste), which "
                       "rk.remat_model and --config.remat= run; a row here is one policy for "
                       "every layer: give the plan's uniform specs, or see it in plan's table")
    items: list[tuple[int, str]] = []
    for i, piece in enumerate(text.split(","), 1):
        word = piece.strip()
        if not word:
            raise BadInput(f"empty policy at item {i} of {shorten(text)!r}")
        if items and ":" in items[-1][1] and not _starts_policy(word):
            items[-1] = (items[-1][0], f"{items[-1][1]},{word}")
        else:
            items.append((i, word))
    for i, spec in items:
        try:
            parse(spec)
        except RematSpecError as e:
            raise BadInput(f"policy at item {i} of {shorten(text)!r}: {e}") from None
    return [spec for _, spec in items]


def check_schedules(cfg, specs: Sequence[str], flag: str) -> None:
    """BadInput, before anything compiles, for a spec the model cannot take: the
    config's own checks (`TransformerConfig`), e.g. a layer schedule that does not
    fit its layers (full@every:99 on 2 layers, nested:7) or needs a looped stack;
    for a model of the user's (cfg its Workload, or its block count), the
    schedule's own check, and with the Workload its loss built under the policy
    (a scanned stack refuses a policy per layer: one scan body takes one)."""
    from remat_kit.trace.workload import Workload
    for spec in specs:
        try:
            if isinstance(cfg, TransformerConfig):
                cfg.replace(remat=spec)
            elif cfg is not None and not isinstance(policy := parse(spec), AutoSpec):
                layers = cfg.num_layers if isinstance(cfg, Workload) else cfg
                if layers is not None:
                    policy.schedule.check(layers)
                if isinstance(cfg, Workload):
                    cfg.loss_for_policy(policy)
        except ValueError as e:  # RematSpecError is a ValueError
            raise BadInput(f"{flag} {shorten(spec)!r}: {e}") from None


def preset_policies() -> list[str]:
    """Every row of `spec.PRESET_TABLE` as a spec that is also its display name: the
    bare word where it means this row (`spec.BARE_NAMES`), else 'codebase:name'."""
    return [name if BARE_NAMES.get(name) == (cb, name) else f"{cb}:{name}"
            for cb, name, _, _ in PRESET_TABLE]


def device_mesh(text: str | None, batch: int, cfg: TransformerConfig,
                target: Target | None = None):
    """The `Mesh` for a --mesh spec such as 'data:2,fsdp:2,tensor:2' over the
    first data x fsdp x tensor devices (`remat_kit.mesh.make`), or None.

    On CPU, that many host devices are created if JAX has not started yet
    (the `jax_num_cpu_devices` option, like
    XLA_FLAGS=--xla_force_host_platform_device_count=N). For a target
    compiled ahead of time the devices are its topology's
    (`targets.make_mesh`; on several slices --mesh is within a slice, and the
    slices add a data-parallel axis), and with no --mesh the mesh is data parallel over
    all of them (a TPU slice's chips), as a `rk_mesh.Fallback`: a --model's own
    mesh (cfg None) replaces it, so its batch is checked where the model is placed.

    Raises:
      BadInput: a bad spec (unknown axis, size not a positive int, more than
        `remat_kit.mesh.MAX_DEVICES` devices), a global `batch` that does not
        split over data x fsdp, heads or mlp_dim that do not split over
        tensor, or fewer devices than the mesh needs. All but the last are
        found before JAX starts.
      TargetError: an AOT target with fewer devices than the mesh (the
        message names both numbers).
    """
    aot = target is not None and target.aot
    if text is None and not aot:
        return None
    flag, args_given = "--mesh", text is not None
    if text is None:  # a TPU slice: data parallel over all of its chips (of every slice)
        text = f"data:{len(target.devices) // target.slices}"
        flag = f"target {target} ({text})"
    try:
        sizes = rk_mesh.parse_spec(text)
        if aot:  # the whole mesh checked: several slices add a data-parallel axis
            from remat_kit.measure import targets
            made = targets.make_mesh(target, sizes)
            if cfg is not None or args_given:
                rk_mesh.check_fits(made, cfg, batch)
            return made if args_given else rk_mesh.Fallback(made)
        if cfg is not None or args_given:
            rk_mesh.check_fits(sizes, cfg, batch)
        import jax
        n = math.prod(sizes.values())
        rk_mesh.host_devices(n)
        devices = jax.devices()
        if len(devices) < n:
            raise rk_mesh.MeshError(
                f"mesh {text} needs {n} devices, found {len(devices)} {devices[0].platform}; "
                f"on CPU set XLA_FLAGS=--xla_force_host_platform_device_count={n} before "
                "starting")
        return rk_mesh.make(sizes, devices[:n])
    except rk_mesh.MeshError as e:
        raise BadInput(f"{flag}: {e}") from None


def split_budgets(text: str) -> list[str]:
    """'0.2,0.4,6GiB' -> ['0.2', '0.4', '6GiB'], each checked (`budget.parse_budget`).

    Raises:
      BadInput: empty, an empty item, or an item that is not a budget.
    """
    from remat_kit.errors import BudgetError
    from remat_kit.policy.budget import parse_budget

    items = [b.strip() for b in text.split(",")]
    if not text.strip() or not all(items):
        raise BadInput(f"--budgets must be comma-separated sizes or fractions, e.g. "
                       f"0.2,0.4,6GiB; got {text!r}")
    for b in items:
        try:
            parse_budget(b)
        except BudgetError as e:
            raise BadInput(f"--budgets: {e}") from None
    return items


def plan_groups(text: str | None, num_layers: int) -> "int | str":
    """--groups G checked against the model's layers: an int 1..num_layers, or
    "layers" (one group per layer) when not given."""
    if text is None:
        return "layers"
    try:
        g = int(text)
    except ValueError:
        g = None
    if g is None or not 1 <= g <= num_layers:
        raise BadInput(f"--groups {text!r}: give a whole number of layer groups from 1 to "
                       f"{num_layers} (the model's layers)")
    return g


def check_planner_floor(work, budgets: Sequence[str], target, mesh, flag: str) -> None:
    """BadInput, in one line naming the floor, for a budget in bytes below the
    parameters plus gradients where the planner's figure counts them
    (`floor.planner_floor`: TPU and GPU); eval_shape only, nothing compiles."""
    from remat_kit.decide import floor
    from remat_kit.policy.budget import parse_budget
    from remat_kit.errors import BudgetError

    sizes = [n for n in (parse_budget(b).bytes for b in budgets) if n is not None]
    if not sizes:
        return
    least = floor.planner_floor(work, target.platform)
    try:
        floor.check(min(sizes), least, "the parameters plus gradients")
    except BudgetError as e:
        raise BadInput(f"{flag}: {e}") from None
