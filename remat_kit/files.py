"""Files the toolkit writes (reports, plots, the plan cache): written whole or not at all.

`atomic_write` writes to a temporary file in the destination's folder that replaces it in one
`os.replace`: a reader never sees half a file, and a failed write leaves the old one. `problem`
says before any long work why a path could not be written (`OutputError`); `read_regular` reads
only a regular file, up to a limit. Docs: docs/compare.md ("Flags"), docs/training.md.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile

# What a non-regular file is, for the messages.
_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


class OutputError(OSError):
    """A file could not be written (or read); the message is one line naming the path."""


def _kind(mode: int) -> str | None:
    """'a FIFO (named pipe)' etc. for a file mode that is not a regular file, else None."""
    return next((name for test, name in _KINDS if test(mode)), None)


def problem(path: str) -> str | None:
    """Why `path` cannot be written as a regular file, one line; None if it can.

    Checked: the path is not empty, is not a folder, FIFO, device or socket
    (after following symlinks), its folder exists and a file can be created
    in it (by creating and removing one), and an existing file is writable.
    Nothing is left behind. A disk that fills up later is only caught by the
    write itself (`atomic_write`).
    """
    if not path or not path.strip():
        return "the path is empty"
    real = os.path.realpath(path)
    try:
        mode = os.stat(real).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as e:
        return f"{path!r} cannot be read ({e.strerror or e})"
    if mode is not None and (kind := _kind(mode)):
        return f"{path!r} is {kind}, not a regular file"
    folder = os.path.dirname(real)
    if not os.path.isdir(folder):
        return f"folder {os.path.dirname(os.path.abspath(path))!r} does not exist"
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        return f"cannot write in folder {folder!r} ({e.strerror or e})"
    if mode is not None and not os.access(real, os.W_OK):
        return f"{path!r} is not writable"
    return None


@contextlib.contextmanager
def atomic_write(path: str, mode: str = "w"):
    """`with atomic_write(path) as f: f.write(...)`: `path` holds all of it or is untouched.

    Writes a temporary file next to `path` (following symlinks, so a link
    keeps pointing at the new file), flushes it to disk and renames it over
    `path`. A new file gets the usual permissions (0o666 less the umask), a
    replaced one keeps its own.

    Args:
      mode: "w" (text, UTF-8) or "wb".
    Raises:
      OutputError: `path` is a folder, FIFO, device or socket, or the write
        fails (e.g. no space left); the temporary file is removed and an
        existing `path` is left as it was. Exceptions raised inside the
        block also remove the temporary file, and propagate unchanged.
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_write mode must be 'w' or 'wb', got {mode!r}")
    real = os.path.realpath(path)
    try:
        old = os.stat(real).st_mode
    except FileNotFoundError:
        old = None
    except OSError as e:
        raise OutputError(f"cannot write {path!r}: {e.strerror or e}") from None
    if old is not None and (kind := _kind(old)):
        raise OutputError(f"cannot write {path!r}: it is {kind}, not a regular file")
    folder, name = os.path.split(real)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, stat.S_IMODE(old) if old is not None else 0o666 & ~umask)
        text = {"encoding": "utf-8", "newline": ""} if mode == "w" else {}  # bytes as given
        with os.fdopen(fd, mode, **text) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, real)
        tmp = None
    except OSError as e:
        raise OutputError(f"cannot write {path!r}: {e.strerror or e}; nothing was written"
                          + (", the old file is left as it was" if old is not None else "")) \
            from None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def same_file(a: str, b: str) -> bool:
    """Whether paths `a` and `b` name one file: the same inode where both exist (a
    hard link, a symlink, ./x and x), else the same path once symlinks are resolved."""
    try:
        return os.path.samefile(a, b)
    except OSError:  # one does not exist yet (or cannot be read)
        return os.path.realpath(a) == os.path.realpath(b)


def read_regular(path: str, limit: int) -> bytes:
    """The bytes of the regular file `path`, refusing to read more than `limit`.

    The file is opened without blocking and checked before reading, so a FIFO
    (which would wait for a writer) or a device such as /dev/zero (which never
    ends) is refused at once.

    Raises:
      FileNotFoundError: there is no file at `path`.
      OutputError: `path` is a folder, FIFO, device or socket, cannot be
        read, or holds more than `limit` bytes.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise
    except IsADirectoryError:
        raise OutputError(f"{path!r} is a folder, not a regular file") from None
    except OSError as e:
        raise OutputError(f"cannot read {path!r}: {e.strerror or e}") from None
    kind = _kind(os.fstat(fd).st_mode)  # before fdopen, which refuses a folder's fd itself
    if kind:
        os.close(fd)
        raise OutputError(f"{path!r} is {kind}, not a regular file")
    with os.fdopen(fd, "rb") as f:
        try:
            data = f.read(limit + 1)
        except OSError as e:
            raise OutputError(f"cannot read {path!r}: {e.strerror or e}") from None
    if len(data) > limit:
        raise OutputError(f"{path!r} holds more than {limit:,} bytes, the most read")
    return data


__all__ = ["OutputError", "atomic_write", "problem", "read_regular", "same_file"]
