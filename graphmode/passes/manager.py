"""The pass manager: runs the recipe's ordered pass list with instruments and a verifier."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from graphmode.errors import GraphmodeError, PassError
from graphmode.ir.graph import Graph
from graphmode.ir.verifier import verify_graph
from graphmode.passes.base import PASSES, PassContext, PassResult
from graphmode.passes.registry import PASS_INFOS, PRESETS, check_order


@dataclass
class PassRecord:
    name: str
    seconds: float
    nodes_before: int
    nodes_after: int
    modified: bool
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass
class PassReport:
    passes: list[PassRecord] = field(default_factory=list)

    @property
    def total_seconds(self) -> float:
        return sum(p.seconds for p in self.passes)

    def stats_of(self, name: str) -> dict:
        """The stats of the first run of pass `name` ({} when the pipeline has none)."""
        return next((p.stats for p in self.passes if p.name == name), {})

    def to_json(self) -> list[dict]:
        return [{"name": p.name, "seconds": round(p.seconds, 4), "nodes_before": p.nodes_before,
                 "nodes_after": p.nodes_after, "modified": p.modified, "stats": p.stats} for p in self.passes]


class DumpIR:
    """Write the IR before/after selected passes to numbered files (`003_after_fuse.txt`)."""

    def __init__(self, directory: str | Path, before: set[str] | str = (), after: set[str] | str = ()):
        self.dir = Path(directory)
        self.before = before
        self.after = after
        self.files: list[Path] = []

    def _want(self, sel, name: str) -> bool:
        return sel == "all" or name in sel

    def _write(self, tag: str, index: int, name: str, graph: Graph) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        p = self.dir / f"{index:03d}_{tag}_{name}.txt"
        p.write_text(graph.text())
        self.files.append(p)

    def before_pass(self, name, index, graph, ctx):
        if self._want(self.before, name):
            self._write("before", index, name, graph)

    def after_pass(self, name, index, result, seconds, ctx):
        if self._want(self.after, name):
            self._write("after", index, name, result.graph)


class KeepSnapshots:
    """Keep the graph after every pass in memory (used by numerics bisection)."""

    def __init__(self):
        self.snapshots: list[tuple[str, Graph]] = []

    def before_pass(self, name, index, graph, ctx):
        if not self.snapshots:
            self.snapshots.append(("<captured>", graph))

    def after_pass(self, name, index, result, seconds, ctx):
        self.snapshots.append((name, result.graph))


def expand_pipeline(passes: list[str] | None = None, preset: str | None = None) -> list[str]:
    if passes:
        return list(passes)
    name = preset or "default"
    if name not in PRESETS:
        raise PassError(f"unknown pipeline preset {name!r}", fix=f"one of {', '.join(PRESETS)}")
    return list(PRESETS[name])


class PassManager:
    def __init__(self, names: list[str], ctx: PassContext | None = None):
        problems = check_order(names)
        if problems:
            idx, msg = problems[0]
            raise PassError(msg, where=f"optimize.passes[{idx}]", value=names[idx] if idx < len(names) else None)
        missing = [n for n in names if n not in PASSES]
        if missing:
            raise PassError(f"passes {missing} are declared but have no implementation",
                            fix="add the pass module to PASS_MODULES in graphmode/passes/base.py "
                                "(its @register_pass runs when PASSES is first read)")
        self.names = names
        self.ctx = ctx or PassContext()

    def run(self, graph: Graph) -> tuple[Graph, PassReport]:
        report = PassReport()
        ran: list[str] = []
        for index, name in enumerate(self.names):
            for ins in self.ctx.instruments:
                ins.before_pass(name, index, graph, self.ctx)
            t0 = time.perf_counter()
            try:
                result: PassResult = PASSES[name](graph, self.ctx)
            except GraphmodeError as e:
                raise PassError(f"pass {name!r} failed: {e.message}", where=e.where or f"pass #{index} {name}",
                                fix=e.fix or f"passes before it: {', '.join(ran) or 'none'}; "
                                             f"remove {name!r} from optimize.passes to bypass") from e
            seconds = time.perf_counter() - t0
            if self.ctx.verify:
                try:
                    verify_graph(result.graph)
                except GraphmodeError as e:
                    raise PassError(f"pass {name!r} produced invalid IR: {e.message}", where=e.where,
                                    fix=f"this is a graphmode bug in {name!r} (ran after: "
                                        f"{', '.join(ran) or 'nothing'}); remove it from optimize.passes "
                                        f"to work around it") from e
            report.passes.append(PassRecord(name, seconds, len(graph.nodes), len(result.graph.nodes),
                                            result.modified, result.stats))
            for ins in self.ctx.instruments:
                ins.after_pass(name, index, result, seconds, self.ctx)
            graph = result.graph
            ran.append(name)
        return graph, report


__all__ = ["PassManager", "PassReport", "PassRecord", "DumpIR", "KeepSnapshots", "expand_pipeline", "PASS_INFOS"]
