"""The backends grow in one direction: no import cycle among their modules (counting imports
inside functions too), nothing above them imported, no thread-local state, and the runtime
reaching a backend only through the registry."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3] / "graphmode"
BACKENDS = ROOT / "backends"
ABOVE = ("graphmode.runtime", "graphmode.cli", "graphmode.serve", "graphmode.compiler", "graphmode.bench",
         "graphmode.monitor")


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every graphmode module `path` imports, anywhere in the file (`from pkg import mod`
    counts as importing pkg.mod when that is a module)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("graphmode"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("graphmode"):
            out.add(node.module)
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                if (ROOT.parent / Path(*sub.split("."))).with_suffix(".py").exists() or \
                        (ROOT.parent / Path(*sub.split("."))).is_dir():
                    out.add(sub)
    return out


def _graph() -> dict[str, set[str]]:
    mods = {_module(p): p for p in BACKENDS.rglob("*.py")}
    return {m: {i for i in _imports(p) if i in mods and i != m} for m, p in mods.items()}


def test_no_import_cycle_among_backend_modules():
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(n):] + [n]))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2
    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert "graphmode.backends.cpu.catalog" in graph and len(graph) > 30


def test_backends_import_nothing_above_them():
    for p in BACKENDS.rglob("*.py"):
        up = sorted(i for i in _imports(p) if i.startswith(ABOVE))
        assert not up, f"{p.relative_to(ROOT)} imports {up}"


def test_cpu_backend_does_not_reach_the_registry():
    """A backend is registered, it does not look others up: the CPU package imports neither
    the registry nor the package that re-exports it."""
    for p in (BACKENDS / "cpu").rglob("*.py"):
        bad = {"graphmode.backends", "graphmode.backends.registry"} & _imports(p)
        assert not bad, f"{p.relative_to(ROOT)} imports {bad}"


def test_no_thread_local_state():
    for p in BACKENDS.rglob("*.py"):
        assert "threading.local" not in p.read_text(), p


def test_runtime_reaches_backends_through_the_registry():
    for name in ("build.py", "compiled.py"):
        deep = sorted(i for i in _imports(ROOT / "runtime" / name) if i.startswith("graphmode.backends."))
        assert all(i in ("graphmode.backends.registry", "graphmode.backends.base") for i in deep), (name, deep)
