"""recipe/ is layered: no import cycle between its modules (imports inside functions count), no
module imports the package's own names, and the schema depends only on the leaves it delegates to.
Imports under `if TYPE_CHECKING:` are annotations and do not count."""
from __future__ import annotations

import ast
from pathlib import Path

import graphmode.recipe
from graphmode.recipe import load_recipe
from graphmode.recipe.buckets import all_buckets, bucket_for, dim_buckets, dim_range, plans_count
from graphmode.recipe.hashing import recipe_hash
from graphmode.recipe.symbolic import has_symbolic

PKG = Path(graphmode.recipe.__file__).parent
MODULES = sorted(p.stem for p in PKG.glob("*.py") if p.stem != "__init__")
SCHEMA_MAY_IMPORT = {"limits", "lines", "hashing", "symbolic", "buckets", "parallel_spec"}


def _runtime_nodes(tree: ast.AST):
    """Every node except those under `if TYPE_CHECKING:` (annotations only, never run)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            continue
        yield node
        yield from _runtime_nodes(node)


def _imports(module: str) -> tuple[set[str], list[int]]:
    """(recipe modules `module` imports anywhere in its body, lines importing the package itself)."""
    deps: set[str] = set()
    package_lines: list[int] = []
    for node in _runtime_nodes(ast.parse((PKG / f"{module}.py").read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            if node.module == "graphmode.recipe":
                package_lines.append(node.lineno)
        else:
            continue
        deps |= {n.split(".")[2] for n in names if n.startswith("graphmode.recipe.") and n.split(".")[2] in MODULES}
    return deps - {module}, package_lines


GRAPH = {m: _imports(m)[0] for m in MODULES}


def _cycle() -> list[str] | None:
    state: dict[str, int] = {}          # 1 = on the current path, 2 = done

    def visit(m: str, path: list[str]) -> list[str] | None:
        state[m] = 1
        for d in sorted(GRAPH[m]):
            if state.get(d) == 1:
                return path[path.index(d):] + [m, d] if d in path else [m, d]
            if d not in state:
                found = visit(d, path + [m])
                if found:
                    return found
        state[m] = 2
        return None
    for m in MODULES:
        if m not in state:
            found = visit(m, [])
            if found:
                return found
    return None


def test_no_import_cycle_inside_recipe():
    assert "schema" in GRAPH and GRAPH["resolve"] >= {"loader", "symbolic"}    # the scan sees imports
    cycle = _cycle()
    assert cycle is None, " -> ".join(cycle)


def test_modules_import_modules_not_the_package():
    bad = {m: lines for m in MODULES for lines in [_imports(m)[1]] if lines}
    assert not bad, f"`from graphmode.recipe import ...` (runs the package __init__) at {bad}"


def test_schema_depends_only_on_leaves():
    assert GRAPH["schema"] <= SCHEMA_MAY_IMPORT, GRAPH["schema"] - SCHEMA_MAY_IMPORT
    for leaf in GRAPH["schema"]:
        assert "schema" not in GRAPH[leaf], f"{leaf} imports schema"


def test_recipe_methods_delegate_to_the_functions():
    r = load_recipe({"version": 1, "name": "views", "inputs": [{"name": "x", "dtype": "f32", "shape": ["b", "s"]}],
                     "dims": {"b": {"buckets": [1, 4]}, "s": {"min": 2, "max": 64, "max_padding": 0.5}},
                     "memory": {"budget_mb": "${target.memory_mb * 0.5}"}})
    assert r.dim_buckets() == dim_buckets(r) and r.buckets() == all_buckets(r)
    assert r.plans_count() == plans_count(r) == len(all_buckets(r)) == 2 * len(dim_buckets(r)["s"])
    assert r.bucket_for({"b": 3, "s": 5}) == bucket_for(r, {"b": 3, "s": 5}) == {"b": 4, "s": 10}
    assert r.dim_range("s") == dim_range(r.dims["s"]) == (2, 64)
    assert r.hash() == recipe_hash(r) and r.is_symbolic() == has_symbolic(r) is True
