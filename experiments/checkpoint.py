"""Checkpoints of a training run, through orbax-checkpoint's `CheckpointManager`.

One checkpoint per saved step in `workdir/checkpoints/STEP`, two items:
`state` (parameters, optimizer state, step and PRNG key data: arrays, written
with `StandardSave`) and `meta` (JSON: the step, the next batch number, the
data seed, the model and remat spec). Saves are asynchronous: `save` returns
once the arrays are copied off the device, and the write finishes in a
background thread. Orbax writes each step into a temporary folder and renames
it when complete, so `latest_step` never names a half-written checkpoint and a
failed write leaves the previous ones intact.
"""

from __future__ import annotations

import pathlib
import time
from typing import Any

import jax
import orbax.checkpoint as ocp

from remat_kit.cli import BadInput


def _keystr(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


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


class Checkpoints:
    """The checkpoints of one workdir: save every few steps, keep the last `keep`.

    `state` trees passed to `save` and `restore` are dicts of arrays:
    {"step": int32 [], "params": ..., "opt_state": ..., "rng": uint32 key data}.
    `meta` is a JSON-serializable dict.

    Raises (from every method): BadInput, one line, when the folder cannot be
    written or read (unwritable, full disk) or holds another model's
    checkpoint.
    """

    def __init__(self, workdir: pathlib.Path, keep: int):
        self.directory = (workdir / "checkpoints").absolute()
        self._pending: tuple[int, float] | None = None  # (step, time save was called)
        self.last_write_seconds: float | None = None
        self.last_blocking_seconds: float | None = None
        try:
            self._manager = ocp.CheckpointManager(
                self.directory,
                # Handlers named up front, so a fresh process can read item metadata.
                item_handlers={"state": ocp.StandardCheckpointHandler(),
                               "meta": ocp.JsonCheckpointHandler()},
                options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                                     enable_async_checkpointing=True))
        except OSError as e:
            raise BadInput(f"cannot use checkpoint folder {str(self.directory)!r}: {e}") from e

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None."""
        return self._manager.latest_step()

    def restore(self, template: dict, step: int) -> tuple[dict, dict]:
        """(state, meta) of checkpoint `step`, as arrays shaped and placed like `template`.

        The parameters are checked against template["params"] first, so another
        model's checkpoint is a BadInput naming the differing parameter.
        """
        where = str(self.directory / str(step))
        saved = self._manager.item_metadata(step)["state"]
        check_params_match(getattr(saved, "tree", saved)["params"], template["params"], where)
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        except (OSError, ValueError) as e:
            raise BadInput(f"cannot restore checkpoint {where}: {e}") from e
        return restored["state"], restored["meta"]

    def save(self, step: int, state: dict, meta: dict) -> None:
        """Starts writing checkpoint `step` (no-op if it exists) and returns
        once the arrays are off the device; the write goes on in the background.
        Sets last_blocking_seconds (the time training waited in this call)."""
        if step in self._manager.all_steps():
            return
        self._finish()  # one write at a time; also surfaces the previous one's error
        start = time.perf_counter()
        try:
            self._manager.save(step, force=True, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))
        except (OSError, ValueError, RuntimeError) as e:
            raise self._write_error(step, e) from e
        self._pending = (step, start)
        self.last_blocking_seconds = time.perf_counter() - start

    def wait(self) -> None:
        """Blocks until the pending write is complete; sets last_write_seconds
        (from the `save` call to the end of the write, seconds)."""
        self._finish()

    def _finish(self) -> None:
        if self._pending is None:
            return
        step, start = self._pending
        self._pending = None
        try:
            self._manager.wait_until_finished()
            self._manager.check_for_errors()
        except (OSError, ValueError, RuntimeError) as e:
            raise self._write_error(step, e) from e
        self.last_write_seconds = time.perf_counter() - start

    def _write_error(self, step: int, error: BaseException) -> BadInput:
        previous = [s for s in self._manager.all_steps() if s != step]
        kept = (f"checkpoint {max(previous)} is intact" if previous
                else "no earlier checkpoint exists")
        return BadInput(f"writing checkpoint {step} in {str(self.directory)!r} failed "
                        f"({error}); {kept}")

    def size_bytes(self, step: int) -> int:
        """Bytes on disk of checkpoint `step` (all its files)."""
        return sum(f.stat().st_size for f in (self.directory / str(step)).rglob("*")
                   if f.is_file())

    def close(self) -> None:
        """Waits for the pending write, then releases orbax's threads."""
        try:
            self._finish()
        finally:
            self._manager.close()
