"""The snippets of README.md and docs/*.md run, and the commands they show parse.

- Every ```python fence runs, each in a fresh namespace (no snippet builds on
  another), in this process: under conftest's 8 host CPU devices, which the
  sharded snippet of docs/meshes.md needs. A `print(...)` whose line ends in a
  comment, or is followed by a comment-only line, must print that comment:
  `...` stands for any text, and a remark in parentheses after two spaces is
  not part of it.
- A fence preceded by `<!-- no-test: reason -->` is not run; the reason must
  be given.
- Every other fence (shell, console) and every inline `remat-kit ...` span is
  not run; its flags are checked: `remat-kit` / `python -m remat_kit.cli`
  commands in fences are parsed whole by the CLI's own argparse parser, inline
  ones flag by flag; `experiments.train` / `experiments.sweep` flags must be
  defined by the module, and each `--config.FIELD` must be a field of the
  config file the command names.
- Every relative link points at a file that exists, and an `#anchor` at a
  heading of that file.
"""

import builtins
import contextlib
import importlib.util
import io
import re
import shlex
import sys
from pathlib import Path

import pytest

from remat_kit.cli import commands as cli

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>\S*)\n(?P<body>.*?)^(?P=indent)```$",
                   re.M | re.S)
NO_TEST = re.compile(r"<!--\s*no-test:\s*(?P<reason>.*?)\s*-->\s*$")


def _fences(page: Path):
    """(lang, first line number of the body, body, no-test reason or None) per fence."""
    text = page.read_text()
    for m in FENCE.finditer(text):
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skip = NO_TEST.search(before)
        indent = len(m["indent"])
        body = "\n".join(line[indent:] for line in m["body"].split("\n"))
        yield m["lang"], text.count("\n", 0, m.start("body")) + 1, body, (
            skip["reason"] if skip else None)


def _snippets():
    for page in PAGES:
        for lang, line, body, skip in _fences(page):
            if lang == "python":
                yield pytest.param(page, line, body, skip,
                                   id=f"{page.relative_to(ROOT)}:{line}")


def test_the_pages_have_snippets():
    assert len(list(_snippets())) >= 9


def _expected_prints(body: str) -> dict[int, str]:
    """Line number (within the snippet) of each print with an expected output -> a regex."""
    lines = body.split("\n")
    expected = {}
    for i, line in enumerate(lines):
        if not line.lstrip().startswith("print("):
            continue
        code, _, comment = line.partition("  # ")
        if not comment and i + 1 < len(lines) and lines[i + 1].lstrip().startswith("# "):
            comment = lines[i + 1].lstrip()[2:]
        comment = re.sub(r"\s{2,}\(.*\)$", "", comment.strip())
        if comment:
            expected[i + 1] = ".*".join(re.escape(part) for part in comment.split("..."))
    return expected


@pytest.mark.parametrize("page, line, body, skip", list(_snippets()))
def test_python_snippet_runs(page, line, body, skip, tmp_path, monkeypatch):
    monkeypatch.setenv("REMAT_KIT_CACHE", str(tmp_path / "plans.json"))  # not the user's cache
    if skip is not None:
        assert skip, f"{page}:{line}: a no-test comment must give its reason"
        pytest.skip(skip)
    printed = {}  # snippet line -> what the prints on it wrote

    def recording_print(*args, **kwargs):
        out = io.StringIO()
        builtins.print(*args, **{**kwargs, "file": out})
        printed.setdefault(sys._getframe(1).f_lineno - line + 1, []).append(
            out.getvalue().rstrip("\n"))

    # Padded so tracebacks name the page's own line numbers.
    code = compile("\n" * (line - 1) + body, str(page), "exec")
    with contextlib.redirect_stdout(io.StringIO()):
        exec(code, {"__name__": "__snippet__", "print": recording_print})
    for at, pattern in _expected_prints(body).items():
        got = printed.get(at)
        assert got, f"{page}:{line + at - 1}: the print did not run"
        for text in got:
            assert re.fullmatch(pattern, text), (
                f"{page}:{line + at - 1}: printed {text!r}, the page says {pattern!r}")


# -- commands: flags checked, nothing run ------------------------------------------

def _commands(body: str):
    """Each shell command of a fence, continuation lines joined and comments
    dropped; in a fence with `$ ` prompts, only the prompted lines (the rest is
    output)."""
    lines = re.sub(r"\\\n\s*", " ", body).split("\n")
    prompted = any(line.startswith("$ ") for line in lines)
    for raw in lines:
        if prompted and not raw.startswith("$ "):
            continue
        text = raw.strip().removeprefix("$ ")
        # `for ...; do CMD & done; wait`, `CMD; CMD`: one command per piece.
        for piece in re.split(r";|&(?!&)|\bdo\b|\bdone\b", text):
            if "remat-kit " in piece or "remat_kit.cli " in piece or "experiments." in piece:
                yield piece


def _tokens(command: str) -> tuple[str, list[str]]:
    """('cli' | 'experiments.train' | 'experiments.sweep', the arguments), with
    env assignments and `[optional]` brackets dropped."""
    words = shlex.split(command.replace("[", " ").replace("]", " "), comments=True)
    for i, word in enumerate(words):
        if word.endswith("remat-kit") or word == "remat_kit.cli":
            return "cli", words[i + 1:]
        if word in ("experiments.train", "experiments.sweep"):
            return word, words[i + 1:]
    raise AssertionError(f"no command in {command!r}")


def _shell_commands():
    for page in PAGES:
        for lang, line, body, _ in _fences(page):
            if lang != "python":
                for command in _commands(body):
                    yield pytest.param(page, command, id=f"{page.relative_to(ROOT)}:{line}")


def _inline_commands():
    for page in PAGES:
        text = FENCE.sub("", page.read_text())
        for span in re.findall(r"`((?:\.venv/bin/)?remat-kit [^`]+)`", text):
            yield pytest.param(page, span, id=f"{page.relative_to(ROOT)}:{span[:40]}")


def test_the_pages_show_commands():
    assert len(list(_shell_commands())) >= 20 and len(list(_inline_commands())) >= 10


def _module_flags(module: str) -> set[str]:
    source = (ROOT / (module.replace(".", "/") + ".py")).read_text()
    return set(re.findall(r"DEFINE_\w+\(\s*\"(\w+)\"", source))


def _config_fields(path: str) -> set[str]:
    spec = importlib.util.spec_from_file_location("doc_config", ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return set(module.get_config().keys())


def _check_experiment(module: str, args: list[str]) -> None:
    known = _module_flags(module)
    options = dict(a.split("=", 1) if "=" in a else (a, "") for a in args if a.startswith("--"))
    for name in options:
        flag = name[2:]
        if flag.startswith("config."):
            assert "--config" in options, f"--{flag} without --config"
            field = flag.split(".")[1]
            assert field in _config_fields(options["--config"]), (
                f"{module}: {options['--config']} has no field {field!r}")
        else:
            assert flag in known, f"{module} has no flag --{flag}; it has {sorted(known)}"


@pytest.mark.parametrize("page, command", list(_shell_commands()))
def test_shell_command_flags_exist(page, command, capsys):
    kind, args = _tokens(command)
    if kind != "cli":
        _check_experiment(kind, args)
        return
    try:
        cli._parser().parse_args(args)
    except SystemExit:
        pytest.fail(f"{page}: {command!r} does not parse: {capsys.readouterr().err.strip()}")


@pytest.mark.parametrize("page, span", list(_inline_commands()))
def test_inline_command_flags_exist(page, span):
    _, args = _tokens(span)
    parser = cli._parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    assert args and args[0] in commands, f"{page}: {span!r}: unknown command"
    known = commands[args[0]]._option_string_actions
    for arg in args[1:]:
        if arg.startswith("--"):
            assert arg.split("=")[0] in known, f"{page}: {span!r}: no flag {arg}"


# -- links ---------------------------------------------------------------------------

def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {_slug(h) for h in re.findall(r"^#+ (.*)$", text, re.M)}


def _links():
    for page in PAGES:
        text = FENCE.sub("", page.read_text())
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if not re.match(r"\w+://", target):
                yield pytest.param(page, target, id=f"{page.relative_to(ROOT)}->{target}")


@pytest.mark.parametrize("page, target", list(_links()))
def test_relative_links_resolve(page, target):
    path, _, anchor = target.partition("#")
    linked = (page.parent / path).resolve() if path else page
    assert linked.exists(), f"{page}: link to {target}: no such file"
    if anchor:
        assert anchor in _anchors(linked), f"{page}: link to {target}: no such heading"
