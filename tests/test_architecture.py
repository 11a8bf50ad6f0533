"""The layout: each part says what it is, no import circle among the package's modules, a
target parsed only where it comes in, and no function over 80 lines or module over 500
in the package and the research scripts.

The order of the parts is kept by import-linter's contracts (pyproject.toml,
run by `make test`); these tests keep what the contracts cannot say.
"""

import ast
import pathlib
import re

import grimp
import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "remat_kit"
PARTS = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())


def test_the_parts_are_the_documented_ones():
    assert PARTS == ["api", "cli", "decide", "flax", "measure", "models", "policy", "trace", "ui"]


@pytest.mark.parametrize("part", PARTS)
def test_each_part_opens_with_what_it_is_and_what_it_may_import(part):
    doc = ast.get_docstring(ast.parse((PACKAGE / part / "__init__.py").read_text())) or ""
    assert doc.startswith(f"{part}: "), f"remat_kit/{part}/__init__.py must open with '{part}: ...'"
    assert "May import:" in doc and "Public names:" in doc


def _cycles(adjacency: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan 1972)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in adjacency[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(adjacency):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_among_modules():
    graph = grimp.build_graph("remat_kit")  # function-level imports count too
    adjacency = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    assert _cycles(adjacency) == []


def test_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# Where a target may still be text: the edge, which parses it once (`parse_target`) into a
# `Target` that everything below takes. Module -> the functions that may call it (None: any
# function of the module, an entry point whose steps are its own business).
TARGET_EDGES = {
    "cli/common.py": {"targets_of"},  # the --target flag of every command
    "measure/targets.py": None,  # defines it; rk.targets' helpers take text for scripts
    "measure/lowering.py": {"compile_for"},  # the documented compile entry (docs/targets.md)
    "measure/cluster.py": {"compile_figures"},  # a Ray task: the target arrives as its text
    "decide/plan.py": None,  # rk.plan, rk.Planner
    "decide/fit.py": None,  # rk.fit
    "decide/step.py": {"step_memory"},  # rk.step_memory
}
FRONT_FLOOR = ("api/",)  # parses what the user typed, everywhere in it


def _parse_target_calls(source: str, name: str = "parse_target") -> list[str]:
    """The qualified names of the functions ("Planner.__init__", "<module>") that call
    `name(` (a bare name or an attribute) in `source`, once per call."""
    found = []

    def visit(node, where):
        for child in ast.iter_child_nodes(node):
            inner = where
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = child.name if where == "<module>" else f"{where}.{child.name}"
            if isinstance(child, ast.Call) and name in (
                    getattr(child.func, "id", None), getattr(child.func, "attr", None)):
                found.append(where)
            visit(child, inner)

    visit(ast.parse(source), "<module>")
    return found


def test_a_target_is_parsed_only_at_the_edge():
    stray = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        allowed = None if name.startswith(FRONT_FLOOR) else TARGET_EDGES.get(name, set())
        stray += [f"remat_kit/{name}: {where}" for where in _parse_target_calls(path.read_text())
                  if allowed is not None and where not in allowed]
    assert stray == [], ("parse_target below the edge: take a targets.Target there and parse "
                         "where the target comes in (the CLI, a public function)")


def test_parse_target_calls_are_found_where_they_are():
    source = ("from remat_kit.measure import targets\n"
              "T = targets.parse_target(None)\n"
              "class Planner:\n"
              "    def __init__(self, target):\n"
              "        def inner():\n"
              "            return parse_target(target)\n"
              "        self.target = targets.parse_target(target)\n"
              "def chip(target):\n"
              "    return target.chip  # parse_target( in a comment is no call\n")
    assert _parse_target_calls(source) == ["<module>", "Planner.__init__.inner",
                                           "Planner.__init__"]


MAX_FUNCTION_LINES, MAX_MODULE_LINES = 80, 500


def _too_long(root: pathlib.Path) -> list[str]:
    """Every function over MAX_FUNCTION_LINES lines (def to last line, docstring included)
    and every module over MAX_MODULE_LINES lines under `root`, named."""
    found = []
    for path in sorted(root.rglob("*.py")):
        source = path.read_text()
        where, length = path.relative_to(root.parent), source.count("\n")
        if length > MAX_MODULE_LINES:
            found.append(f"module {where}: {length} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    found.append(f"function {where}:{node.name}: {lines} lines")
    return found


@pytest.mark.parametrize("root", ["remat_kit", "experiments"])
def test_no_long_function_or_module(root):
    # One idea per module, one step per function: split rather than grow.
    found = _too_long(PACKAGE.parent / root)
    assert found == [], "split these:\n" + "\n".join(found)


def test_long_finder_names_a_long_function_and_module(tmp_path):
    (tmp_path / "pkg").mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "pkg" / "long.py").write_text("def f():\n" + body + "\n" * MAX_MODULE_LINES)
    (tmp_path / "pkg" / "short.py").write_text("def g():\n    return 1\n")
    assert _too_long(tmp_path / "pkg") == [
        f"module pkg/long.py: {MAX_FUNCTION_LINES + 1 + MAX_MODULE_LINES} lines",
        f"function pkg/long.py:f: {MAX_FUNCTION_LINES + 1} lines"]


MODULES = {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts[:-1]
                    if p.name == "__init__.py" else p.relative_to(PACKAGE.parent)
                    .with_suffix("").parts) for p in PACKAGE.rglob("*.py")}


def _module_names(tree: ast.Module) -> dict[str, str]:
    """{local name: dotted module} for the package's modules `tree` imports as modules."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("remat_kit") and a.asname:
                    names[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("remat_kit"):
            for a in node.names:
                dotted = f"{node.module}.{a.name}"
                if dotted in MODULES:
                    names[a.asname or a.name] = dotted
    return names


def _private_imports(source: "str | ast.Module") -> list[str]:
    """Each `_`-name of another of the package's modules that `source` (text or its tree)
    imports (`from remat_kit.x import _y`) or reaches through an imported module (`x._y`)."""
    tree = ast.parse(source) if isinstance(source, str) else source
    found = []
    modules = _module_names(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("remat_kit"):
            found += [f"{node.module}.{a.name}" for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__")]
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
              and node.value.id in modules and node.attr.startswith("_")
              and not node.attr.startswith("__")):
            found.append(f"{modules[node.value.id]}.{node.attr}")
    return found


def test_each_module_imports_only_public_names():
    # A name another module needs is public in its own module: `_jax_private`
    # is a module whose names are public (its `__all__`); its own `_` says it wraps JAX's
    # private API, and it is the one module that imports `jax._src`.
    stray, jax_private = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        name, tree = path.relative_to(PACKAGE).as_posix(), ast.parse(path.read_text())
        stray += [f"remat_kit/{name}: {what}" for what in _private_imports(tree)]
        imported = [a.name if isinstance(n, ast.Import) else n.module or ""
                    for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                    for a in n.names]
        if name != "_jax_private.py" and any(m.startswith("jax._src") for m in imported):
            jax_private.append(name)
    assert stray == [], "make these public in their own module, named for what they are"
    assert jax_private == [], "import JAX's private API only in remat_kit/_jax_private.py"


def test_private_imports_are_found():
    source = ("from remat_kit.measure import residuals, _hidden\n"
              "from remat_kit.errors import _closest, BadInput\n"
              "import remat_kit.trace.workload as wl\n"
              "x = residuals._stage(1) + wl._as_factory + residuals.stage\n"
              "self._mine = BadInput._cls\n")
    assert sorted(_private_imports(source)) == [
        "remat_kit.errors._closest", "remat_kit.measure._hidden",
        "remat_kit.measure.residuals._stage", "remat_kit.trace.workload._as_factory"]


# Below the front floor (`api/`, which parses each spec once; `ui/` and `cli/` above it; `policy/`,
# which defines `parse`) a spec is parsed only where it comes in as text: these
# edges parse it once and hand the value on. Module -> the functions that parse it.
POLICY_EDGES = {
    "decide/plan_cache.py": {"cached_plan"},  # a plan cache file's spec text, where it is read
    "flax/linen.py": {"remat", "apply_remat"},  # rk.linen's public wrappers take specs
    "flax/nnx.py": {"remat", "apply_remat"},  # rk.nnx's, likewise
    # rk.remat_model: a spec, a plan dict or plan file; checked for a typo or an auto spec
    # before the model is traced (the model's own tags, once known, count in the full parse).
    "flax/measured.py": {"remat_model"},
    # TransformerConfig(remat=...), a public constructor: its `policy` hands the value on.
    "models/config.py": {"TransformerConfig.__post_init__"},
    "_jax_private.py": {"compile_module"},  # MLIR's ir.Module.parse of a program, no spec
}


def test_a_policy_is_parsed_at_the_front_floor():
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        if name.startswith(("ui/", "api/", "cli/", "policy/")) or name == "__init__.py":
            continue
        calls = set(_parse_target_calls(path.read_text(), "parse"))
        if calls:
            found[name] = calls
    stray = {m: c - POLICY_EDGES.get(m, set()) for m, c in found.items()}
    gone = {m: c - found.get(m, set()) for m, c in POLICY_EDGES.items()}
    assert {m: c for m, c in stray.items() if c} == {}, (
        "parse a policy spec in api/ and hand the Policy down")
    assert {m: c for m, c in gone.items() if c} == {}, (
        "take these off POLICY_EDGES")


def test_the_root_imports_the_front_floor_and_the_value_types():
    # Every function and namespace from `remat_kit.api`; from elsewhere only classes (the
    # value types, the errors) and the vocabulary's constants; never the CLI.
    import remat_kit
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    assert not any(isinstance(n, ast.Import) for n in tree.body)
    elsewhere = [a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom)
                 and n.module != "remat_kit.api" for a in n.names]
    assert [n for n in elsewhere if not (isinstance(getattr(remat_kit, n), type)
                                         or n.isupper())] == []
    assert set(remat_kit.__all__) <= set(elsewhere) | set(remat_kit.api.__all__)


PLANNER_MODULES = {"decide/plan.py", "decide/planner_compiles.py", "decide/planner_costs.py"}


def test_the_planner_is_used_through_its_public_methods():
    # search.py, the offload probe, fit, the CLI: `planner.x`, never `planner._x`.
    stray = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        if name in PLANNER_MODULES:
            continue
        stray += [f"remat_kit/{name}:{n.lineno}: planner.{n.attr}"
                  for n in ast.walk(ast.parse(path.read_text()))
                  if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                  and n.value.id == "planner" and n.attr.startswith("_")]
    assert stray == []


# The parts top to bottom, as pyproject.toml's layers (flax and models side by side).
PART_ORDER = {"api": 0, "decide": 1, "measure": 2, "flax": 3, "models": 3, "trace": 4,
              "policy": 5}


def _walk(text: str) -> list[str]:
    """The modules of docs/architecture.md's walk: the `path.py`s before each numbered
    line's first ": "."""
    section = text.split("## The walk", 1)[1].split("\n## ", 1)[0]
    return [path for line in section.splitlines() if re.match(r"\d+\. ", line)
            for path in re.findall(r"`([\w/]+\.py)`", line.split(": ", 1)[0])]


def test_the_walk_lists_real_modules_in_the_parts_order():
    walk = _walk((PACKAGE.parent / "docs" / "architecture.md").read_text())
    assert len(walk) > 10 and len(set(walk)) == len(walk), "each module once"
    assert [p for p in walk if not (PACKAGE / p).exists()] == []
    rank = [PART_ORDER.get(p.split("/")[0], len(PART_ORDER)) for p in walk]
    assert rank == sorted(rank), list(zip(walk, rank))


def test_the_walk_names_every_module_rk_measure_enters():
    # The walk is a description kept true: run it under a profiler and every module of the
    # package it enters is named in the section.
    import sys
    import remat_kit as rk
    work = rk.models.workload(rk.models.get_config("tiny", num_layers=1), 1, 16)
    entered = set()

    def profile(frame, event, arg):
        name = frame.f_code.co_filename
        if event == "call" and str(PACKAGE) in name:
            entered.add(pathlib.Path(name).relative_to(PACKAGE).as_posix())

    sys.setprofile(profile)
    try:
        rk.measure(work, policies=["none", "full"], per_layer=False)
    finally:
        sys.setprofile(None)
    section = (PACKAGE.parent / "docs" / "architecture.md").read_text().split(
        "## The walk", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`([\w/]+\.py)`", section))
    assert len(entered) > 15 and sorted(entered - named) == []


MAX_MODULE_DOC_LINES = 8
_DOCS_PAGE = re.compile(r"(docs/\w+\.md|README\.md)(?: \(([^)]*)\))?")


def _docstring_problems(root: pathlib.Path) -> list[str]:
    """Module docstrings that are essays or lead nowhere: over MAX_MODULE_DOC_LINES lines;
    or, in a module with public names (a public top-level def or class, or a package's
    `__init__.py`), naming no page (docs/*.md or README.md); or naming a page, or a quoted
    section of it (a heading or a bold paragraph label), that is not there."""
    found = []
    for path in sorted(root.rglob("*.py")):
        where = path.relative_to(root.parent).as_posix()
        tree = ast.parse(path.read_text())
        doc = ast.get_docstring(tree) or ""
        if len(doc.splitlines()) > MAX_MODULE_DOC_LINES:
            found.append(f"{where}: {len(doc.splitlines())} lines")
        public = path.name == "__init__.py" or any(
            isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and not n.name.startswith("_") for n in tree.body)
        pages = _DOCS_PAGE.findall(" ".join(doc.split()))
        if public and not pages:
            found.append(f"{where}: names no docs page")
        for page, sections in pages:
            if not (root.parent / page).exists():
                found.append(f"{where}: {page} does not exist")
                continue
            text = (root.parent / page).read_text()
            for section in re.findall(r'"([^"]+)"', sections):
                label = re.escape(section.rstrip(". "))
                if not re.search(rf"^(#+ |\s*(- )?\*\*)?{label}", text, re.M):
                    found.append(f"{where}: no section {section!r} in {page}")
    return found


def test_module_docstrings_are_short_and_point_to_their_docs_page():
    # A module docstring says what the module is for and where its reference is; the
    # reference itself lives in docs/.
    found = _docstring_problems(PACKAGE)
    assert found == [], "cut or point these to docs/:\n" + "\n".join(found)


def test_docstring_checker_names_an_essay_a_dead_end_and_a_missing_section(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("# Page\n\n## Real section\n\n**Label.** x\n")
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    essay = "\n".join(f"line {i}" for i in range(MAX_MODULE_DOC_LINES + 1))
    (pkg / "__init__.py").write_text('"""pkg: see docs/page.md."""\n')
    (pkg / "essay.py").write_text(f'"""{essay}\ndocs/page.md\n"""\n')
    (pkg / "nowhere.py").write_text('"""Does a thing."""\n\ndef thing():\n    pass\n')
    (pkg / "private.py").write_text('"""Helpers."""\n\ndef _helper():\n    pass\n')
    (pkg / "good.py").write_text('"""Good.\n\nDocs: docs/page.md ("Real section"),\n'
                                 'docs/page.md ("Label").\n"""\n\ndef f():\n    pass\n')
    (pkg / "dead.py").write_text('"""Docs: docs/gone.md, docs/page.md ("Imagined").\n"""\n\n'
                                 'class C:\n    pass\n')
    assert _docstring_problems(pkg) == [
        "pkg/dead.py: docs/gone.md does not exist",
        "pkg/dead.py: no section 'Imagined' in docs/page.md",
        f"pkg/essay.py: {MAX_MODULE_DOC_LINES + 2} lines",
        "pkg/nowhere.py: names no docs page"]
