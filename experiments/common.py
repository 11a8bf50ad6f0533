"""Command-line plumbing shared by `experiments.train` and `experiments.sweep`.

Bad input to either script (a flag that does not parse, a missing required
flag, a config file that does not load, an unknown config field, extra
arguments) is one line on stderr and exit code 2, before any compiling.
"""

from __future__ import annotations

import contextlib
import re
import sys
import warnings
from collections.abc import Iterator
from typing import NoReturn

from absl import flags, logging

from remat_kit.errors import BadInput
from remat_kit.ui.sources import load_config_file

# What the scripts' user sets the shape with, for a --model that fails at it.
SIZE_FIELDS = "config.batch_size and config.seq_len"


def fail(message: str, code: int = 2, label: str = "error") -> NoReturn:
    """Prints `label: message` as one line on stderr (the first and last of the
    message's lines: libraries put the summary first and the cause last) and
    exits with `code` (2: bad input)."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    print(f"{label}: " + " ".join(lines[:1] + lines[1:][-1:]), file=sys.stderr)
    sys.exit(code)


def warn_line(message: str) -> None:
    """Prints `warning: message` as one line on stderr."""
    print("warning: " + " ".join(message.splitlines()), file=sys.stderr, flush=True)


@contextlib.contextmanager
def one_line_warnings() -> Iterator[None]:
    """Inside, Python warnings (remat_kit's notes on the policy, a library's) print as
    `warn_line` does, not with the file and line that raised them."""
    with warnings.catch_warnings():
        warnings.showwarning = lambda message, *_, **__: warn_line(str(message))
        yield


def _config_argument(argv: list[str]) -> str | None:
    """The value of the last --config (or -config) in argv, as absl reads it;
    None if absent."""
    value = None
    for i, arg in enumerate(argv[1:], 1):
        if arg == "--":
            break
        match = re.match(r"^--?config(=(.*))?$", arg)
        if match and match.group(1) is not None:
            value = match.group(2)
        elif match and i + 1 < len(argv):
            value = argv[i + 1]
    return value


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing (for `app.run(..., flags_parser=parse_flags)`), with
    every bad flag, config file or config value as one stderr line and exit 2.

    The --config file is loaded once first (`remat_kit.ui.sources.load_config_file`):
    ml_collections would report its failures as a traceback, or not at all
    until the first field access.
    """
    path = _config_argument(argv)
    if path is not None:
        try:
            load_config_file(*path.split(":", 1))  # FILE[:ARG], as ml_collections reads it
        except BadInput as e:
            fail(str(e))
    try:
        rest = flags.FLAGS(argv)
    except flags.Error as e:
        fail(str(e))
    except AttributeError as e:  # ml_collections: --config.FIELD names no field
        cause = e.args[0].args[0] if e.args and isinstance(e.args[0], KeyError) else str(e)
        fail(f"unknown config field {cause}")
    except (OSError, TypeError, ValueError) as e:  # ml_collections: the config did not load
        fail(str(e))
    if len(rest) > 1:
        fail(f"unexpected arguments {rest[1:]}")
    # absl would raise the default verbosity to INFO, which floods the output with
    # JAX's backend probing; keep WARNING unless --verbosity is given.
    if flags.FLAGS["verbosity"].using_default_value:
        flags.FLAGS.verbosity = logging.WARNING
    return rest
