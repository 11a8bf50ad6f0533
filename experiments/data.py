"""Byte-level text data: corpus loading, a deterministic train/eval split, and batches.

Every byte is a token (vocab 256), so any text file works with no tokenizer.
The default corpus is the `.py` sources of the running Python's standard
library, found with `sysconfig`, so `make demo` needs no download.
"""

from __future__ import annotations

import codecs
import dataclasses
import pathlib
import sysconfig
import zlib
from collections.abc import Callable

import numpy as np

# Every byte value is a token: the model's vocabulary needs at least this many ids.
VOCAB_SIZE = 256
# The default corpus is capped so that loading stays fast and its size is the
# same on every machine with the same Python.
DEFAULT_MAX_BYTES = 32 * 2**20
# Share of files (by hash of their relative path) held out for evaluation.
EVAL_PERCENT = 5
# Share of bytes held out when a corpus is too few files to split by file.
EVAL_FRACTION = 0.1


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Train and eval bytes.

    Attributes:
      train, eval: uint8 [n] arrays of concatenated file contents.
      source: where the text came from, for logs.
      files: number of files read.
    """

    train: np.ndarray
    eval: np.ndarray
    source: str
    files: int


def stdlib_files() -> tuple[pathlib.Path, list[pathlib.Path]]:
    """The running Python's standard-library `.py` files, sorted by relative path.

    Third-party packages (site-packages, dist-packages) are left out so the
    corpus is the same for every install of one Python version.
    Returns (stdlib root, files).
    """
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = [f for f in root.rglob("*.py") if f.is_file()
             and not {"site-packages", "dist-packages"} & set(f.relative_to(root).parts)]
    return root, sorted(files, key=lambda f: f.relative_to(root).as_posix())


def is_text(path: pathlib.Path) -> bool:
    """Whether the first 8 KiB of the file hold no NUL byte and decode as UTF-8."""
    with path.open("rb") as fh:
        head = fh.read(8192)
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head)  # a cut last character is fine
    except UnicodeDecodeError:
        return False
    return b"\0" not in head


def text_files(path: pathlib.Path) -> list[pathlib.Path]:
    """All text files under `path` (or `path` itself), recursively, sorted.

    Hidden files and folders are skipped, and so are binary files (`is_text`).

    Raises:
      ValueError: `path` is a file that is not text.
    """
    if path.is_file():
        if not is_text(path):
            raise ValueError(f"data file {str(path)!r} is not text (its start holds NUL bytes "
                             "or is not UTF-8)")
        return [path]
    return [f for f in sorted(path.rglob("*"), key=lambda f: f.relative_to(path).as_posix())
            if f.is_file() and not any(p.startswith(".") for p in f.relative_to(path).parts)
            and is_text(f)]


def _is_eval(relative: str) -> bool:
    # crc32 of the path, not Python's salted hash(), so the split is stable across runs.
    return zlib.crc32(relative.encode()) % 100 < EVAL_PERCENT


def load_corpus(data: str = "", max_bytes: int = DEFAULT_MAX_BYTES) -> Corpus:
    """Reads the corpus and splits it into train and eval bytes.

    Args:
      data: a text file or a folder of text files; "" means the standard
        library's `.py` sources.
      max_bytes: stop reading files once this many bytes are read (files in
        sorted order, so the cut is deterministic).

    Files are split by a hash of their relative path (about EVAL_PERCENT% to
    eval). When that leaves either side empty (e.g. a single file), the last
    EVAL_FRACTION of the bytes is held out instead.

    Raises:
      FileNotFoundError: `data` does not exist.
      ValueError: `data` is a file that is not text, holds no text, or too
        little to split.
    """
    if data:
        root = pathlib.Path(data).expanduser()
        if not root.exists():
            raise FileNotFoundError(f"data path {data!r} does not exist")
        files = text_files(root)
        base = root if root.is_dir() else root.parent
        source = str(root)
    else:
        base, files = stdlib_files()
        source = f"Python {sysconfig.get_python_version()} stdlib .py files ({base})"
    train, held, total = [], [], 0
    for f in files:
        if total >= max_bytes:
            break
        blob = f.read_bytes()[: max_bytes - total]
        total += len(blob)
        (held if _is_eval(f.relative_to(base).as_posix()) else train).append(blob)
    if total == 0:
        raise ValueError(f"data path {data or str(base)!r} holds no text")
    if not train or not held:
        blob = b"".join(train + held)
        cut = int(len(blob) * (1 - EVAL_FRACTION))
        train, held = [blob[:cut]], [blob[cut:]]
    as_array = lambda parts: np.frombuffer(b"".join(parts), dtype=np.uint8)
    return Corpus(train=as_array(train), eval=as_array(held), source=source,
                  files=len(files))


def _windows(text: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    window = text[idx].astype(np.int32)
    return window[:, :-1], window[:, 1:]


def _check_len(text: np.ndarray, seq_len: int, split: str) -> None:
    if len(text) < seq_len + 1:
        raise ValueError(f"the {split} split has {len(text)} bytes, fewer than "
                         f"seq_len + 1 = {seq_len + 1}; use more data or a shorter seq_len")


def train_batches(text: np.ndarray, batch_size: int, seq_len: int,
                  seed: int) -> Callable[[int], tuple[np.ndarray, np.ndarray]]:
    """Random windows of `text`, addressed by batch number.

    Returns batch(i) -> (inputs, targets), each int32 [batch_size, seq_len],
    targets shifted by one byte. Batch i is a pure function of (seed, i), not
    of the batches drawn before it, so a run resumed at step i sees exactly
    the batches an uninterrupted run would.

    Raises:
      ValueError: `text` is shorter than seq_len + 1 bytes (raised here, not
        at the first batch).
    """
    _check_len(text, seq_len, "train")

    def batch(index: int) -> tuple[np.ndarray, np.ndarray]:
        # A SeedSequence of (seed, index) gives independent streams per batch.
        rng = np.random.default_rng((seed, index))
        return _windows(text, rng.integers(0, len(text) - seq_len, size=batch_size), seq_len)
    return batch


def eval_batches(text: np.ndarray, batch_size: int, seq_len: int,
                 num_batches: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """`num_batches` fixed batches of windows spread evenly over `text`.

    Returns a list of (inputs, targets), each int32 [batch_size, seq_len]. The
    windows overlap when `text` is short.

    Raises:
      ValueError: `text` is shorter than seq_len + 1 bytes.
    """
    _check_len(text, seq_len, "eval")
    starts = np.linspace(0, len(text) - seq_len - 1, num_batches * batch_size).astype(np.int64)
    return [_windows(text, s, seq_len) for s in starts.reshape(num_batches, batch_size)]
