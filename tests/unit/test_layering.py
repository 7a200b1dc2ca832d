"""graphmode's packages form layers (docs/ARCHITECTURE.md, "Layers"): a package imports only
its own layer or lower ones, and no packages import each other in a cycle.

Every module's imports are read with `ast`, those inside functions (lazy imports) included,
so a deferred import cannot hide an upward arrow. A failure names the importing module, the
line, the imported module and the rule broken.
"""
from __future__ import annotations

import ast
import functools
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "graphmode"

# lowest first; a unit is a top-level package or module of graphmode ("graphmode" itself is the
# public facade: `graphmode.compile`, `graphmode.load`, ... resolved lazily)
LAYERS: list[tuple[str, ...]] = [
    ("errors", "paths", "hostmem", "openmp", "untrusted", "progress", "version"),   # foundation
    ("targets", "monitor", "client"),        # hardware descriptions; contract probes; the HTTP client
    ("ir",),                                  # graph, ops, types, interpreter
    ("verify",),                              # graph vs reference numerics, bisection (over the IR)
    ("plan",),                                # schedule, liveness, memory, ExecutionPlan
    ("passes",),                              # pass manager, registry, rewrite engine, the passes
    ("backends",),                            # lowering registry, generated kernels, executors
    ("recipe",),                              # schema, semantics, Z3 proofs (checked against what is below)
    ("parallel",),                            # tensor-parallel spec, cost, communicators, rank launcher
    ("analysis",),                            # index and padding analysis of a graph under a recipe
    ("verdict", "capture", "compile_report"),  # the one decision; importers and model sources; facts
    ("runtime",),                             # CompiledModel, plan builds, artifact cache, .gm files
    ("compiler",),                            # the pipeline driver: lower_model -> Lowered, compile
    ("decode",),                              # scheduler, runner, engine over a lowered paged graph
    ("kb", "tune"),                           # knowledge base, recipe drafting, tuning
    ("api", "graphmode"),                     # graphmode.compile (drafts, decodes); the lazy facade
    ("serve",),                               # HTTP server
    ("bench", "conformance", "coverage"),     # measurement and conformance suites
    ("cli",),                                 # the `graphmode` command: reads options, formats
    ("fuzz", "__main__"),                     # fuzz targets; `python -m graphmode`
]

# (importing unit, imported unit): why the arrow stays for now. Empty is the goal.
# parallel/ holds both declarations used below the driver (the recipe's `parallel` spec, its cost
# and checks; the communicator a collective op finds) and the rank launcher that drives the
# compiler: splitting it (declarations beside recipe/ir, the launcher above compiler) is left to
# the round after the tensor-parallel work that edits parallel/ now.
ALLOWED: dict[tuple[str, str], str] = {}


def _layer_of() -> dict[str, int]:
    return {unit: i for i, units in enumerate(LAYERS) for unit in units}


def _module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


@functools.lru_cache(maxsize=None)
def imports(root: Path = ROOT) -> list[tuple[str, int, str]]:
    """(importing module, line, imported module) for every graphmode import in the package."""
    out = []
    for path in sorted(root.rglob("*.py")):
        mod = _module_name(path, root)
        package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = ".".join(package[:len(package) - node.level + 1])
                    names = [f"{base}.{node.module}"] if node.module else [f"{base}.{a.name}" for a in node.names]
                else:
                    names = [node.module or ""]
            else:
                continue
            out += [(mod, node.lineno, n) for n in names if n == "graphmode" or n.startswith("graphmode.")]
    return out


def unit_edges() -> dict[tuple[str, str], list[str]]:
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for mod, line, target in imports():
        a, b = _unit(mod), _unit(target)
        if a != b:
            edges[(a, b)].append(f"{mod}:{line} imports {target}")
    return edges


def test_every_unit_has_a_layer():
    units = {_unit(_module_name(p)) for p in ROOT.rglob("*.py")} | {"graphmode"}
    missing = sorted(units - set(_layer_of()))
    assert not missing, f"packages with no layer in LAYERS (add each to docs/ARCHITECTURE.md and here): {missing}"


def test_no_upward_imports():
    layer = _layer_of()
    broken = []
    for (a, b), where in sorted(unit_edges().items()):
        if layer.get(b, -1) > layer.get(a, -1) and (a, b) not in ALLOWED:
            broken += [f"{w}: '{a}' (layer {layer.get(a)}) must not import '{b}' (layer {layer.get(b)}, higher); "
                       f"move the code down, pass it in as an argument, or register it" for w in where]
    assert not broken, "upward imports:\n" + "\n".join(broken)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one unit (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_package_cycles():
    edges = unit_edges()
    graph: dict[str, set[str]] = defaultdict(set)
    for (a, b) in edges:
        if (a, b) not in ALLOWED:
            graph[a].add(b)
    found = _cycles(graph)
    detail = [f"cycle {' <-> '.join(c)}: " + "; ".join(ws[0] for (a, b), ws in sorted(edges.items())
                                                        if a in c and b in c and (a, b) not in ALLOWED)
              for c in found]
    assert not found, "package cycles:\n" + "\n".join(detail)


def test_allow_list_is_current():
    """An allowed arrow that no longer exists is removed from ALLOWED (the list only shrinks)."""
    stale = sorted(set(ALLOWED) - set(unit_edges()))
    assert not stale, f"ALLOWED entries with no import left: {stale}"


def test_the_reader_sees_lazy_and_relative_imports(tmp_path):
    """Imports inside functions count, and relative ones resolve to the module they name."""
    pkg = tmp_path / "graphmode"
    (pkg / "capture").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "capture" / "__init__.py").write_text("from . import spec\n")
    (pkg / "capture" / "spec.py").write_text("def f():\n    from ..compiler import lower_model\n"
                                             "    import graphmode.kb.draft\n")
    found = {(m, t) for m, _, t in imports(pkg)}
    assert found == {("graphmode.capture", "graphmode.capture.spec"),
                     ("graphmode.capture.spec", "graphmode.compiler"),
                     ("graphmode.capture.spec", "graphmode.kb.draft")}
