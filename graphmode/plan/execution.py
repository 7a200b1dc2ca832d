"""ExecutionPlan: the compiled form of one shape bucket.

An ordered list of instructions over arena slots and constants, with the arena size. It is
plain data (JSON round-trip) so it can be cached, shown (`graphmode plan show`) and handed
to any backend; the backend decides how each instruction runs (generated kernel, ATen op).
A plan read back from the artifact cache is never trusted as it is: `load_plan` re-derives it
from the graph and keeps only the arena offsets, after checking them as a memory plan.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Sequence

from graphmode.errors import PlanError
from graphmode.ir.graph import Graph, Node
from graphmode.ir.ops import OPS, flops_of
from graphmode.ir.printer import format_attrs
from graphmode.ir.types import ITEMSIZE
from graphmode.plan.liveness import analyze_liveness
from graphmode.plan.memory import MemoryPlan, bucket_key


@dataclass(frozen=True)
class Slot:
    """Where a value lives: an arena byte offset, or a named constant."""

    dtype: str
    shape: tuple[int, ...]
    offset: int | None = None     # arena byte offset
    const: str | None = None      # constant name

    @property
    def nbytes(self) -> int:
        n = ITEMSIZE[self.dtype]
        for d in self.shape:
            n *= d
        return n

    def text(self) -> str:
        ty = f"{self.dtype}[{','.join(map(str, self.shape))}]"
        return f"const:{self.const} {ty}" if self.const is not None else f"arena+{self.offset} {ty}"

    def to_json(self) -> dict:
        d = {"dtype": self.dtype, "shape": list(self.shape)}
        if self.const is not None:
            d["const"] = self.const
        else:
            d["offset"] = self.offset
        return d

    @staticmethod
    def from_json(d: Mapping) -> "Slot":
        return Slot(d["dtype"], tuple(d["shape"]), d.get("offset"), d.get("const"))


@dataclass
class Instruction:
    kind: str                 # view | op | kernel | fallback (how the backend runs an op is its own choice)
    op: str                   # core op name, or fused kind
    inputs: list[str]         # value names (resolved through ExecutionPlan.slots)
    outputs: list[str]
    attrs: dict[str, Any] = field(default_factory=dict)
    node_index: int = -1      # index of the IR node it came from (for profiling/bisection)
    flops: float = 0.0
    bytes: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class ExecutionPlan:
    graph_name: str
    graph_hash: str
    env: dict[str, int]
    arena_bytes: int
    lower_bound_bytes: int
    slots: dict[str, Slot]
    instructions: list[Instruction]
    inputs: list[str]
    outputs: list[str]
    constants: list[str]
    body_graphs: dict[int, Node] = field(default_factory=dict, repr=False)  # node_index -> fused node (in-memory)
    built_for: dict[str, str] = field(default_factory=dict)   # the cache key it was built under (if any)

    @property
    def bucket_key(self) -> str:
        return ",".join(f"{k}={v}" for k, v in sorted(self.env.items()))

    def to_json(self) -> dict:
        return {"graph": self.graph_name, "graph_hash": self.graph_hash, "env": self.env,
                "arena_bytes": self.arena_bytes, "lower_bound_bytes": self.lower_bound_bytes,
                "slots": {k: v.to_json() for k, v in self.slots.items()},
                "instructions": [i.to_json() for i in self.instructions],
                "inputs": self.inputs, "outputs": self.outputs, "constants": self.constants,
                "built_for": dict(self.built_for)}

    @staticmethod
    def from_json(d: Mapping) -> "ExecutionPlan":
        return ExecutionPlan(d["graph"], d["graph_hash"], dict(d["env"]), d["arena_bytes"], d["lower_bound_bytes"],
                             {k: Slot.from_json(v) for k, v in d["slots"].items()},
                             [Instruction(**i) for i in d["instructions"]], list(d["inputs"]), list(d["outputs"]),
                             list(d["constants"]), built_for=dict(d.get("built_for", {})))

    def text(self) -> str:
        lines = [f"plan @{self.graph_name} bucket {self.bucket_key}  arena {self.arena_bytes / 2**20:.2f} MiB "
                 f"(lower bound {self.lower_bound_bytes / 2**20:.2f} MiB)  {len(self.instructions)} instructions"]
        for name in self.inputs:
            lines.append(f"  input  %{name}: {self.slots[name].text()}")
        for idx, ins in enumerate(self.instructions):
            outs = ", ".join(f"%{o}@{self.slots[o].offset}" for o in ins.outputs)
            args = ", ".join(f"%{i}" for i in ins.inputs)
            attrs = {k: v for k, v in ins.attrs.items() if k not in ("source",)}
            a = f" {format_attrs(attrs)}" if attrs else ""
            lines.append(f"  {idx:4d} {ins.kind:8s} {outs} = {ins.op}({args}){a}   "
                         f"[{ins.flops / 1e6:.2f} MFLOP, {ins.bytes / 1e6:.2f} MB]")
        for name in self.outputs:
            lines.append(f"  output %{name}: {self.slots[name].text()}")
        return "\n".join(lines)


def _node_kind(n: Node, plan_alias: Mapping[str, str]) -> str:
    spec = OPS[n.op]
    if n.op == "fused":
        return "kernel"
    if n.op == "fallback":
        return "fallback"
    if spec.view and plan_alias.get(n.outputs[0]) == n.inputs[0]:
        return "view"
    return "op"


def lower(graph: Graph, memory_plan, order: list[int] | None = None, *,
          graph_hash: str | None = None) -> ExecutionPlan:
    """Turn an optimised graph + its memory plan for one bucket into an ExecutionPlan.
    `graph_hash`: graph.structural_hash() when the caller has it (it costs a print of the graph)."""
    env = dict(memory_plan.env)
    slots: dict[str, Slot] = {}
    for name, v in graph.values.items():
        if name in graph.constants:
            t = graph.constants[name]
            slots[name] = Slot(v.type.dtype, tuple(t.shape), const=name)
            continue
        if name not in memory_plan.offsets:
            continue
        slots[name] = Slot(v.type.dtype, v.type.concrete(env), offset=memory_plan.offsets[name])
    order = order if order is not None else list(memory_plan.order)
    alias = getattr(memory_plan, "alias_of", {}) or {}
    instructions: list[Instruction] = []
    bodies: dict[int, Node] = {}
    for idx in order:
        n = graph.nodes[idx]
        for v in (*n.inputs, *n.outputs):
            if v not in slots:
                raise PlanError(f"value %{v} has no slot in the memory plan", where=f"node #{idx} {n.op}",
                                fix="run the memory_plan pass after the last graph rewrite")
        in_shapes = [slots[i].shape for i in n.inputs]
        out_shapes = [slots[o].shape for o in n.outputs]
        kind = _node_kind(n, alias)
        if n.op == "fused":
            flops = sum(flops_of(m.op, [n.body.values[i].type.concrete(env) for i in m.inputs],
                                 [n.body.values[o].type.concrete(env) for o in m.outputs], m.attrs)
                        for m in n.body.nodes)
            op = n.attrs.get("kind", "fused")
            bodies[idx] = n
        else:
            flops = flops_of(n.op, in_shapes, out_shapes, n.attrs)
            op = n.op
        nbytes = sum(slots[v].nbytes for v in (*n.inputs, *n.outputs)) if kind != "view" else 0
        attrs = dict(n.attrs)
        if n.op == "fused":
            attrs = {k: v for k, v in attrs.items()}
            attrs["body_ops"] = [m.op for m in n.body.nodes]
        instructions.append(Instruction(kind, op, list(n.inputs), list(n.outputs), attrs, idx, flops, nbytes))
    return ExecutionPlan(graph.name, graph_hash or graph.structural_hash(), env, memory_plan.arena_bytes,
                         memory_plan.lower_bound_bytes, slots, instructions, list(graph.inputs),
                         list(graph.outputs), sorted(graph.constants), bodies)


def load_plan(data: Any, graph: Graph, env: Mapping[str, int], *, built_for: Mapping[str, str],
              reuse: bool = True, alias_groups: Sequence[Sequence[str]] = ()) -> ExecutionPlan:
    """The plan for `graph` at `env` that a cached plan JSON describes, or PlanError.

    A cache entry can be swapped, edited or stale however good its checksum looks, so nothing
    in it is used as read: the instruction order must be a schedule of `graph`, the arena
    offsets must pass `MemoryPlan.check` under the liveness that order implies (inside the
    arena, aligned, no two live buffers overlapping, in-place writes safe), and the JSON must
    equal what `lower` makes of the graph with those offsets, `built_for` included. The plan
    returned is that lowering, so a field the comparison missed could not reach the executor.
    `reuse` / `alias_groups`: the recipe's, as the plan was built with."""
    where = f"cached plan @{graph.name} {bucket_key(env)}"
    if not isinstance(data, Mapping):
        raise PlanError(f"the plan is a JSON {type(data).__name__}, not an object", where=where)
    if data.get("built_for") != dict(built_for):
        raise PlanError("the plan was built for another key (copied from another entry?)", where=where,
                        value={k: v for k, v in _as_dict(data.get("built_for")).items()
                               if built_for.get(k) != v} or data.get("built_for"))
    instructions = data.get("instructions")
    if not isinstance(instructions, list) or not all(isinstance(i, Mapping) for i in instructions):
        raise PlanError("the plan has no instruction list", where=where)
    order = [i.get("node_index") for i in instructions]
    if not all(_is_int(i) for i in order):
        raise PlanError("an instruction has no integer node_index", where=where)
    env = {k: int(v) for k, v in env.items()}
    groups = [list(g) for g in alias_groups]
    liv = analyze_liveness(graph, order, reuse=reuse, alias_groups=groups)   # order: a schedule of graph
    slots = _as_dict(data.get("slots"))
    offsets: dict[str, int] = {}
    for v in liv.values:
        off = _as_dict(slots.get(v)).get("offset")
        if not _is_int(off):
            raise PlanError(f"%{v} has no integer arena offset", where=where, value=off)
        offsets[v] = off
    arena = data.get("arena_bytes")
    if not _is_int(arena):
        raise PlanError("arena_bytes is not an integer", where=where, value=arena)
    types = {v: graph.values[v].type for v in liv.values}
    size_of = {v: Slot(t.dtype, t.concrete(env)).nbytes for v, t in types.items()}
    mp = MemoryPlan(graph.name, env, list(order), offsets, size_of, dict(liv.alias_of),
                    {v: (liv.first[v], liv.last[v]) for v in liv.values}, arena,
                    max(liv.live_steps(size_of), default=0), reuse=reuse, alias_kind=dict(liv.alias_kind),
                    shared_slots=[list(s) for s in liv.slots], alias_groups=groups,
                    honoured_groups=[list(g) for g in liv.honoured], notes=list(liv.notes))
    mp.check()      # what the graph part of check() looks at is derived here, not read from the cache
    used = max((b["offset"] + b["size"] for b in mp.buffers().values() if b["size"] > 0), default=0)
    if arena != used:      # the planner's arena ends exactly where its last buffer does
        raise PlanError(f"arena_bytes is {arena} but the buffers end at byte {used}", where=where)
    plan = lower(graph, mp, graph_hash=built_for.get("graph_hash"))
    plan.built_for = dict(built_for)
    want = json.dumps(plan.to_json(), sort_keys=True)   # text: a NaN attribute equals itself
    try:
        # the graph's name is a label, not in its hash: a plan cached under another name for the
        # same graph (graphmode.compile names a model after its class, --model m.py:fn after fn) is
        # this graph's plan, not damage
        got = json.dumps({**data, "graph": plan.graph_name} if isinstance(data, dict) else data, sort_keys=True)
    except (ValueError, TypeError, RecursionError) as e:
        raise PlanError(f"the plan is not plain JSON: {e}", where=where) from None
    if want != got:
        at = _first_difference(json.loads(want), json.loads(got))
        raise PlanError(f"the plan differs from the graph's lowering at {at}", where=where)
    return plan


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _as_dict(x: Any) -> Mapping:
    return x if isinstance(x, Mapping) else {}


def _first_difference(want: Mapping, got: Mapping) -> str:
    for k in sorted(set(want) | set(got)):
        a, b = want.get(k), got.get(k)
        if a == b:
            continue
        if isinstance(a, list) and isinstance(b, list):
            for i, (x, y) in enumerate(zip(a, b)):
                if x != y:
                    return f"{k}[{i}]"
            return f"{k} (length {len(b)}, expected {len(a)})"
        if isinstance(a, dict) and isinstance(b, dict):
            return f"{k}.{next(n for n in sorted(set(a) | set(b)) if a.get(n) != b.get(n))}"
        return k
    return "?"
