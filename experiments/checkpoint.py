"""Checkpoints of a training run, through orbax-checkpoint's `CheckpointManager`.

One checkpoint per saved step in `workdir/checkpoints/STEP`, two items:
`state` (parameters, optimizer state, step and PRNG key data: arrays, written
with `StandardSave`) and `meta` (JSON: the step, the next batch number, the
data seed, the model and remat spec). Saves are asynchronous: `save` returns
once the arrays are copied off the device, and the write finishes in a
background thread. Orbax writes each step into a temporary folder and renames
it when complete, so `latest_step` never names a half-written checkpoint and a
failed write leaves the previous ones intact.

Integrity: orbax checks a checkpoint's structure when it reads it (metadata,
OCDBT manifest, every array's chunks), but not the bytes of the arrays: a
flipped byte in a data file loads as a wrong number. So once a write is
complete, the SHA-256 of each of its files goes into `STEP/sha256.json`
(written in the background too), and `restore_latest` checks them before
orbax reads. A checkpoint that fails either check is damaged: it is moved to
`checkpoints/damaged/STEP-N` (never deleted) and the one before it is tried.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pathlib
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import orbax.checkpoint as ocp

from remat_kit.errors import BadInput

CHECKSUMS = "sha256.json"
DAMAGED = "damaged"


def _keystr(path) -> str:
    # Orbax stores an attribute of a pytree node (an NNX Variable's `value`,
    # GetAttrKey) as a dict key of that name: both read as the name.
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))
                    for k in path)


def _describe(leaf) -> str:
    return f"{tuple(leaf.shape)} {leaf.dtype}"


def check_params_match(saved: Any, expected: Any, where: str) -> None:
    """BadInput naming the first parameter whose path, shape or dtype differs.

    Args:
      saved: the checkpoint's parameter metadata tree (leaves with .shape and
        .dtype), as orbax's `item_metadata` gives it.
      expected: the model's parameter tree (arrays or ShapeDtypeStructs).
      where: the checkpoint folder, for the message.
    """
    saved_leaves = {_keystr(p): leaf for p, leaf in jax.tree_util.tree_leaves_with_path(saved)}
    ours = {_keystr(p): leaf for p, leaf in jax.tree_util.tree_leaves_with_path(expected)}
    hint = "; it holds another model's checkpoint: use a new workdir or the model it was trained with"
    for name, leaf in ours.items():
        if name not in saved_leaves:
            raise BadInput(f"checkpoint {where} has no parameter {name!r} (this model's is "
                           f"{_describe(leaf)}){hint}")
        old = saved_leaves[name]
        if tuple(old.shape) != tuple(leaf.shape) or old.dtype != leaf.dtype:
            raise BadInput(f"checkpoint {where}: parameter {name!r} is {_describe(old)}, this "
                           f"model's is {_describe(leaf)}{hint}")
    extra = sorted(set(saved_leaves) - set(ours))
    if extra:
        raise BadInput(f"checkpoint {where} has parameter {extra[0]!r}, which this model "
                       f"lacks{hint}")


class Damaged(Exception):
    """A checkpoint that cannot be read back as written; the message says why (one line)."""


def _summary(error: BaseException) -> str:
    """The first line of an error, cut to 150 characters (orbax's and
    TensorStore's messages run to dozens of lines)."""
    lines = str(error).strip().splitlines() or [""]
    text = lines[0].split(" See full TensorStore details")[0]  # then a repr of the spec
    text = text if len(text) <= 150 else text[:147] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def file_hashes(folder: pathlib.Path) -> dict[str, str]:
    """{path relative to `folder`: SHA-256 hex digest} of every file under it
    but the checksum file itself."""
    hashes = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file() and path.name != CHECKSUMS:
            with path.open("rb") as fh:
                hashes[path.relative_to(folder).as_posix()] = hashlib.file_digest(
                    fh, "sha256").hexdigest()
    return hashes


def verify(folder: pathlib.Path) -> bool:
    """True if `folder`'s files match its sha256.json, False if it has none
    (written before this check existed, or the run died between orbax's rename
    and the checksum write). Raises Damaged naming the first file that is
    missing, changed or extra, or an unreadable checksum file."""
    try:
        expected = json.loads((folder / CHECKSUMS).read_text())
    except FileNotFoundError:
        return False
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise Damaged(f"its {CHECKSUMS} is unreadable: {_summary(e)}") from e
    if not isinstance(expected, dict):
        raise Damaged(f"its {CHECKSUMS} is not a JSON object")
    try:
        actual = file_hashes(folder)
    except OSError as e:
        raise Damaged(f"a file cannot be read: {_summary(e)}") from e
    for name in sorted(set(expected) | set(actual)):
        if name not in actual:
            raise Damaged(f"file {name} is missing")
        if name not in expected:
            raise Damaged(f"file {name} was not there when it was written")
        if actual[name] != expected[name]:
            raise Damaged(f"file {name} has changed since it was written (SHA-256 differs)")
    return True


def is_disk_full(error: BaseException | None) -> bool:
    """ENOSPC anywhere in the error's chain; TensorStore reports it as text
    (RESOURCE_EXHAUSTED ... No space left on device [os_error_code='28'])."""
    seen = set()
    while error is not None and id(error) not in seen:  # chains can loop
        if getattr(error, "errno", None) == errno.ENOSPC or "No space left on device" in str(error):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def disk_full_message(path: pathlib.Path) -> str:
    """'disk full: N free of M on the file system of PATH' (MiB; shutil.disk_usage)."""
    try:
        usage = shutil.disk_usage(path if path.exists() else path.parent)
        space = f"{usage.free / 2**20:,.1f} MiB free of {usage.total / 2**20:,.1f} MiB"
    except OSError:
        space = "free space unknown"
    return f"disk full ({space} on the file system of {str(path)!r})"


def steps_on_disk(directory: pathlib.Path) -> list[int]:
    """The steps of the complete checkpoints in `directory`, ascending (orbax
    writes into STEP.orbax-checkpoint-tmp and renames it to STEP when done)."""
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit() and p.is_dir())


class Checkpoints:
    """The checkpoints of one workdir: save every few steps, keep the last `keep`.

    `state` trees passed to `save` and `restore` are dicts of arrays:
    {"step": int32 [], "params": ..., "opt_state": ..., "rng": uint32 key data}.
    `meta` is a JSON-serializable dict.

    Raises (from every method): BadInput, one line, when the folder cannot be
    written or read (unwritable, full disk: named as such, with the free
    space) or holds another model's checkpoint.
    """

    def __init__(self, workdir: pathlib.Path, keep: int):
        self.directory = (workdir / "checkpoints").absolute()
        self._pending: tuple[int, float] | None = None  # (step, time save was called)
        self._sealer: threading.Thread | None = None
        self._seal_error: BaseException | None = None
        self._last_step: int | None = None
        self._failed = False  # a write error was raised (orbax raises it again on close)
        self.last_write_seconds: float | None = None
        self.last_blocking_seconds: float | None = None
        self._check_writable()
        try:
            self._manager = ocp.CheckpointManager(
                self.directory,
                # Handlers named up front, so a fresh process can read item metadata.
                item_handlers={"state": ocp.StandardCheckpointHandler(),
                               "meta": ocp.JsonCheckpointHandler()},
                # cleanup_tmp_directories: a write a crash or a full disk cut short
                # leaves STEP.orbax-checkpoint-tmp; never a checkpoint, it only holds space.
                options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                                     enable_async_checkpointing=True,
                                                     cleanup_tmp_directories=True))
        except OSError as e:
            raise BadInput(f"cannot use checkpoint folder {str(self.directory)!r}: {e}") from e

    def _check_writable(self) -> None:
        """BadInput at once where the folder exists but a file cannot be created in
        it (a read-only mount): orbax would fail the first save, then its
        threads would wait forever at exit."""
        if not self.directory.is_dir():
            return  # the workdir was checked writable; orbax creates the folder
        try:
            with tempfile.TemporaryFile(dir=self.directory):
                pass
        except OSError as e:
            steps = steps_on_disk(self.directory)
            kept = f"checkpoint {steps[-1]} is intact" if steps else "it holds no checkpoint"
            raise BadInput(f"checkpoint folder {str(self.directory)!r} cannot be written "
                           f"({e.strerror or e}); {kept}; make it writable or use another "
                           "workdir") from None

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None."""
        return self._manager.latest_step()

    def restore(self, template: dict, step: int) -> tuple[dict, dict]:
        """(state, meta) of checkpoint `step`, as arrays shaped and placed like `template`.

        The files are checked against their checksums first, then the
        parameters against template["params"], so another model's checkpoint
        is a BadInput naming the differing parameter. Returns meta["verified"]
        False when the checkpoint has no checksums. Raises Damaged for any
        other failure to read it.
        """
        where = str(self.directory / str(step))
        verified = verify(self.directory / str(step))
        try:
            saved = self._manager.item_metadata(step)["state"]
            params = getattr(saved, "tree", saved)["params"]
        except Exception as e:  # noqa: BLE001 - orbax raises TypeError, KeyError, ...
            raise Damaged(f"its metadata cannot be read: {_summary(e)}") from e
        check_params_match(params, template["params"], where)
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        except Exception as e:  # noqa: BLE001 - any failure to read is damage
            raise Damaged(f"orbax cannot read it: {_summary(e)}") from e
        meta = restored["meta"]
        if not isinstance(meta, dict):
            raise Damaged(f"its meta item is {type(meta).__name__}, not a JSON object")
        return restored["state"], {**meta, "verified": verified}

    def restore_latest(self, template: dict, warn: Callable[[str], None]
                       ) -> tuple[int, dict, dict] | None:
        """(step, state, meta) of the newest intact checkpoint, or None when
        there is no checkpoint.

        Each damaged one on the way is moved to checkpoints/damaged/STEP-N and
        named in one `warn` line. Raises BadInput when every checkpoint was damaged
        (they are moved aside, so the next start trains from step 0), and, in
        a multi-process run, on the first damaged one (the processes would
        race to move it).
        """
        damaged: list[tuple[int, str, pathlib.Path]] = []
        while (step := self.latest_step()) is not None:
            try:
                state, meta = self.restore(template, step)
            except Damaged as e:
                if jax.process_count() > 1:
                    raise BadInput(f"checkpoint {self.directory / str(step)} is damaged ({e}); "
                                   f"move it out of {self.directory} to resume from the one "
                                   "before it") from e
                damaged.append((step, str(e), self._set_aside(step)))
                continue
            for bad, reason, moved in damaged:
                warn(f"checkpoint {bad} in {self.directory} is damaged ({reason}): moved it to "
                     f"{moved}; resuming from checkpoint {step}")
            if not meta["verified"]:
                warn(f"checkpoint {step} in {self.directory} has no {CHECKSUMS} (the run "
                     "stopped before writing it, or an older version wrote it): restored "
                     "without checking its files")
            return step, state, meta
        if not damaged:
            return None
        steps = ", ".join(str(s) for s, _, _ in damaged)
        raise BadInput(f"no intact checkpoint in {self.directory}: checkpoint(s) {steps} are "
                       f"damaged (checkpoint {damaged[0][0]}: {damaged[0][1]}) and were moved "
                       f"to {self.directory / DAMAGED}; run the same command again to train "
                       "from step 0")

    def _set_aside(self, step: int) -> pathlib.Path:
        """Moves checkpoint `step` to damaged/STEP-N (the first unused N)."""
        folder = self.directory / DAMAGED
        folder.mkdir(exist_ok=True)
        n = 0
        while (folder / f"{step}-{n}").exists():
            n += 1
        os.rename(self.directory / str(step), folder / f"{step}-{n}")
        self._manager.reload()
        return folder / f"{step}-{n}"

    def save(self, step: int, state: dict, meta: dict) -> None:
        """Starts writing checkpoint `step` (no-op if it exists) and returns
        once the arrays are off the device; the write, and then its checksums,
        go on in the background. Sets last_blocking_seconds (the time training
        waited in this call)."""
        if step in self._manager.all_steps():
            return
        self._finish()  # one write at a time; also surfaces the previous one's error
        start = time.perf_counter()
        try:
            self._manager.save(step, force=True, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))
        except Exception as e:  # noqa: BLE001 - orbax and TensorStore raise many kinds
            raise self._write_error(step, e) from e
        self._pending = (step, start)
        self._last_step = step
        self._seal_error = None
        self._sealer = threading.Thread(target=self._seal, args=(step,), daemon=True,
                                        name=f"checksums-{step}")
        self._sealer.start()
        self.last_blocking_seconds = time.perf_counter() - start

    def _seal(self, step: int) -> None:
        """Background: waits for orbax to finish `step`, then writes its
        checksums (process 0 only: the processes share the folder)."""
        try:
            self._manager.wait_until_finished()
            folder = self.directory / str(step)
            if jax.process_index() == 0 and folder.is_dir():
                tmp = folder / (CHECKSUMS + ".tmp")
                tmp.write_text(json.dumps(file_hashes(folder), indent=0) + "\n")
                os.replace(tmp, folder / CHECKSUMS)
        except BaseException as e:  # noqa: BLE001 - surfaced by _finish in the main thread
            self._seal_error = e

    def wait(self) -> None:
        """Blocks until the pending write and its checksums are complete; sets
        last_write_seconds (from the `save` call to the end of the write, seconds)."""
        self._finish()

    def _finish(self) -> None:
        if self._pending is None:
            return
        step, start = self._pending
        self._pending = None
        self._sealer.join()
        try:
            if self._seal_error is not None:
                raise self._seal_error
            self._manager.check_for_errors()
        except Exception as e:  # noqa: BLE001 - orbax and TensorStore raise many kinds
            raise self._write_error(step, e) from e
        self.last_write_seconds = time.perf_counter() - start

    def _write_error(self, step: int, error: BaseException) -> BadInput:
        self._failed = True
        # From the disk: orbax's own list may already have dropped the one
        # max_to_keep would delete once this write succeeded.
        previous = [s for s in steps_on_disk(self.directory) if s != step]
        kept = (f"checkpoint {max(previous)} is intact" if previous
                else "no earlier checkpoint exists")
        if is_disk_full(error):
            return BadInput(f"writing checkpoint {step} failed: {disk_full_message(self.directory)}"
                            f"; {kept}; free some space and run the same command to resume")
        return BadInput(f"writing checkpoint {step} in {str(self.directory)!r} failed "
                        f"({_summary(error)}); {kept}")

    def size_bytes(self, step: int) -> int:
        """Bytes on disk of checkpoint `step` (all its files)."""
        return sum(f.stat().st_size for f in (self.directory / str(step)).rglob("*")
                   if f.is_file())

    def close(self) -> None:
        """Waits for the pending write, then releases orbax's threads."""
        try:
            self._finish()
        finally:
            try:
                self._manager.close()
            except Exception as e:  # noqa: BLE001 - orbax raises a failed write again here
                if not self._failed:
                    raise self._write_error(self._last_step, e) from e
