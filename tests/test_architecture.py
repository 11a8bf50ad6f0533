"""The layout: each part says what it is, and no import circle among the package's modules.

The order of the parts is kept by import-linter's contracts (pyproject.toml,
run by `make test`); these tests keep what the contracts cannot say.
"""

import ast
import pathlib

import grimp
import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "remat_kit"
PARTS = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())


def test_the_parts_are_the_documented_ones():
    assert PARTS == ["cli", "decide", "flax", "measure", "models", "policy", "trace"]


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
