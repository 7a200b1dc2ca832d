"""The rewrite engine every rewriting pass uses, in the spirit of MLIR's RewritePatternSet
with its greedy driver and tinygrad's PatternMatcher.

A pass is a list of named `Rule`s: a pattern (pattern.py) rooted at a node's output, and a
rewrite function `fn(rw, m) -> value | None` that returns the value replacing the root (an
existing one, or one it built with `rw.add`), or None to decline. `rewrite_graph` runs the
rules to a fixpoint and owns everything a rule should not have to think about:

- use-def maps (producers, readers) kept current while the graph changes, so `single_use`
  is a fact of the graph as it is now;
- the walk: forward sweeps in program order; nodes a rewrite creates are matched as soon as
  they are placed (at the root's position), so chains collapse in one sweep; sweeps repeat
  until none fires (a rewrite can make an earlier value single-use);
- replacement: uses of the root read the new value; a value the rule built takes the
  root's name (names stay stable across passes); a graph output keeps its name by renaming
  the value that replaces it, and where that is impossible (the replacement is an input,
  a constant or another output) the rewrite is refused and counted as `kept_for_output`;
- erasure of the nodes the rule consumed (single-use matches, `rw.claim`) once nothing
  reads them; other nodes the rewrite leaves unused stay for `dce`;
- per-rule statistics: how often each rule fired, for the pass report.

`Rewriter` is also the state of passes that walk the graph once in their own way (cse,
constant_fold): `resolved`, `emit`, `replace` and `finish` are the substitute-and-rename
machinery without rules.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

import torch

from graphmode.errors import PassError
from graphmode.ir.graph import Graph, Node, clean_name
from graphmode.ir.ops import get_op
from graphmode.ir.types import TensorType, Value
from graphmode.passes.pattern import Match, Pat, match_root

MAX_SWEEPS = 100


# ------------------------------------------------------------------------------- renaming

def rename_body(body: Graph, mapping: Mapping[str, str]) -> Graph:
    """A copy of a fused body with its boundary/inner names renamed (body inputs mirror the
    outer node's inputs, so an outer substitution has to reach inside)."""
    if not any(k in body.values for k in mapping):
        return body
    values: dict[str, Value] = {}
    for name, v in body.values.items():
        new = mapping.get(name, name)
        if new not in values:
            values[new] = Value(new, v.type, v.role)
    nodes = [rename_node(n, mapping) for n in body.nodes]
    return Graph(body.name, values, [mapping.get(i, i) for i in body.inputs],
                 [mapping.get(o, o) for o in body.outputs], nodes, dict(body.constants), dict(body.dims))


def rename_node(n: Node, mapping: Mapping[str, str]) -> Node:
    ins = tuple(mapping.get(i, i) for i in n.inputs)
    outs = tuple(mapping.get(o, o) for o in n.outputs)
    if ins == n.inputs and outs == n.outputs:
        return n
    body = rename_body(n.body, mapping) if n.body is not None else None
    return n.with_(inputs=ins, outputs=outs, body=body)


def live_values(values: Mapping[str, Value], inputs, constants, nodes: Iterable[Node]) -> dict[str, Value]:
    """The values something still defines (inputs, constants, node outputs): a dropped
    node's outputs must not linger as typed-but-undefined names."""
    defined = set(inputs) | set(constants)
    for n in nodes:
        defined.update(n.outputs)
    return {k: v for k, v in values.items() if k in defined}


# ------------------------------------------------------------------------------- the state

class Rewriter:
    """One forward walk over a graph: the nodes emitted so far, substitutions for the nodes
    still to come, and the use-def maps of the whole graph as it stands. The input graph is
    never touched: `finish` returns a new Graph."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.values: dict[str, Value] = dict(graph.values)
        self.constants: dict[str, torch.Tensor] = dict(graph.constants)
        self.outputs = set(graph.outputs)
        self.subst: dict[str, str] = {}           # value -> value its uses read from now on
        self.rename: dict[str, str] = {}          # value -> graph output name it takes over
        self.nodes: list[Node | None] = []        # emitted so far; None: erased
        self._at: dict[str, int] = {}             # value -> index of its producer in `nodes`
        self._readers: Counter[str] = Counter()   # value -> nodes reading it (emitted or not)
        for n in graph.nodes:
            self._readers.update(set(n.inputs))
        self.changed = False
        self._reset_pending()

    def _reset_pending(self) -> None:
        self._new: list[Node] = []
        self._new_values: dict[str, Value] = {}
        self._new_consts: dict[str, torch.Tensor] = {}
        self._claimed: list[Node] = []

    # ---- queries (the pattern.GraphView protocol) ------------------------------------
    def index_of(self, value: str) -> int | None:
        """Where the producer of `value` sits in `nodes` (None: an input, constant or pending)."""
        return self._at.get(value)

    def producer(self, value: str) -> Node | None:
        idx = self._at.get(value)
        if idx is not None:
            return self.nodes[idx]
        return next((n for n in self._new if value in n.outputs), None)

    def type_of(self, value: str) -> TensorType:
        v = self._new_values.get(value) or self.values[value]
        return v.type

    def constant(self, value: str) -> torch.Tensor | None:
        t = self._new_consts.get(value)
        return t if t is not None else self.constants.get(value)

    def role(self, value: str) -> str:
        return (self._new_values.get(value) or self.values[value]).role

    def is_output(self, value: str) -> bool:
        return value in self.outputs or value in self.rename

    def readers(self, value: str) -> int:
        return self._readers[value]

    def single_use(self, value: str) -> bool:
        """Exactly one node reads `value`, and it is not (about to be) a graph output."""
        return self._readers[value] == 1 and not self.is_output(value)

    # ---- the walk ------------------------------------------------------------------------
    def resolve(self, name: str) -> str:
        seen = 0
        while name in self.subst:
            name = self.subst[name]
            seen += 1
            if seen > 1_000_000:  # a cycle would be a bug in a pass
                raise RuntimeError(f"substitution cycle at %{name}")
        return name

    def resolved(self, n: Node) -> Node:
        ins = tuple(self.resolve(i) for i in n.inputs)
        if ins == n.inputs:
            return n
        body = rename_body(n.body, dict(zip(n.inputs, ins))) if n.body is not None else None
        return n.with_(inputs=ins, body=body)

    def emit(self, n: Node) -> int:
        self.nodes.append(n)
        idx = len(self.nodes) - 1
        for o in n.outputs:
            self._at[o] = idx
        return idx

    def erase(self, idx: int) -> None:
        n = self.nodes[idx]
        assert n is not None
        self.nodes[idx] = None
        for o in n.outputs:
            if self._at.get(o) == idx:
                del self._at[o]
        for i in set(n.inputs):
            self._readers[self.resolve(i)] -= 1
        self.changed = True

    def _output_name(self, value: str) -> str | None:
        return value if value in self.outputs else self.rename.get(value)

    def can_replace(self, old: str, new: str) -> bool:
        if self._output_name(old) is None:
            return True
        new = self.resolve(new)
        return (not self.is_output(new) and new in self._at and new not in self.constants
                and new not in self.graph.inputs)

    def replace(self, old: str, new: str) -> bool:
        """Uses of `old` read `new` (same type) from now on. False: `old` is a graph output
        that `new` cannot take the name of, and the caller must keep old's node."""
        new = self.resolve(new)
        if not self.can_replace(old, new):
            return False
        out = self._output_name(old)
        if out is not None:
            self.rename.pop(old, None)
            self.rename[new] = out
        self.subst[old] = new
        self._readers[new] += self._readers.pop(old, 0)
        self.changed = True
        return True

    def finish(self) -> Graph:
        nodes = [n for n in self.nodes if n is not None]
        if self.rename:
            nodes = [rename_node(n, self.rename) for n in nodes]
        values = live_values(self.values, self.graph.inputs, self.constants, nodes)
        return Graph(self.graph.name, values, list(self.graph.inputs), list(self.graph.outputs),
                     nodes, self.constants, dict(self.graph.dims))

    # ---- building (inside a rule's rewrite function) --------------------------------------
    def fresh(self, hint: str) -> str:
        base = clean_name(hint)
        name, i = base, 1
        while name in self.values or name in self._new_values:
            name = f"{base}_{i}"
            i += 1
        return name

    def add(self, op: str, inputs: Sequence[str], attrs: Mapping | None = None, *, name: str | None = None) -> str:
        """A new node computing `op`; its type comes from the op set. `name` may reuse the
        name of a value whose producer the rule consumes (it is redefined)."""
        ins = tuple(self.resolve(i) for i in inputs)
        attrs = dict(attrs or {})
        types = get_op(op).infer([self.type_of(i) for i in ins], attrs)
        out = name if name is not None else self.fresh(op)
        if out in self._new_values:
            raise PassError(f"a rewrite defined %{out} twice", fix="this is a graphmode bug in a rewrite rule")
        self._new.append(Node(op, ins, (out,), attrs))
        self._new_values[out] = Value(out, types[0])
        return out

    def add_const(self, hint: str, tensor: torch.Tensor, role: str = "const") -> str:
        name = self.fresh(hint)
        self._new_consts[name] = tensor
        self._new_values[name] = Value(name, TensorType.of(tensor), role)
        return name

    def claim(self, node: Node) -> None:
        """Consume `node` (erased once the rewrite leaves it unread), beyond the pattern's
        single-use nodes: for rules that walk variable-length chains."""
        self._claimed.append(node)

    # ---- committing one rewrite -----------------------------------------------------------
    def commit(self, idx: int, consumed: Iterable[Node], repl: str) -> tuple[list[Node] | None, bool]:
        """Replace the root (the node at `idx`) by `repl`. Returns (nodes to place at the
        root's position, refused-for-an-output); (None, _) leaves the graph as it was."""
        root = self.nodes[idx]
        assert root is not None
        out = root.outputs[0]
        want = self.values[out].type
        made = {o for n in self._new for o in n.outputs}
        built = repl in made
        if not built:
            repl = self.resolve(repl)
            if repl == out:
                return None, False
        got = self.type_of(repl)
        if not got.matches(want):
            raise PassError(f"a rewrite of %{out} produced {got.text()}, not {want.text()}",
                            fix="this is a graphmode bug in a rewrite rule; remove the pass from optimize.passes")
        if not built and not self.can_replace(out, repl):
            return None, True
        if built and repl != out:   # the value the rule built takes the root's name
            self._new = [rename_node(n, {repl: out}) for n in self._new]
            del self._new_values[repl]
            self._new_values[out] = self.values[out]
            repl = out
        redefined = {o for n in self._new for o in n.outputs if o in self.values and o != out}
        # readers after the rewrite: the new nodes read, the root and dead consumed nodes don't
        delta: Counter[str] = Counter()
        for n in self._new:
            delta.update(i for i in set(n.inputs) if i not in redefined)
        delta.subtract(self.resolve(i) for i in set(root.inputs))
        dead: list[int] = []
        victims = {self._at[v.outputs[0]] for v in (*consumed, *self._claimed)
                   if self._at.get(v.outputs[0]) is not None and self.nodes[self._at[v.outputs[0]]] is v}
        for vi in sorted(victims - {idx}, reverse=True):
            v = self.nodes[vi]
            if all(self._readers[o] + delta[o] == 0 and not self.is_output(o) and o != repl for o in v.outputs):
                dead.append(vi)
                delta.subtract(self.resolve(i) for i in set(v.inputs))
        freed = {o for vi in dead for o in self.nodes[vi].outputs}
        if redefined - freed:   # a name the rule reuses still has readers: not this rewrite
            return None, False
        self.erase(idx)
        for vi in dead:
            self.erase(vi)
        self.values.update(self._new_values)
        self.constants.update(self._new_consts)
        for n in self._new:
            self._readers.update(set(n.inputs))
        if not built:
            self.replace(out, repl)
        new = self._new
        self._reset_pending()
        self.changed = True
        return new, False


# ------------------------------------------------------------------------------- rules

RewriteFn = Callable[[Rewriter, Match], "str | None"]


@dataclass(frozen=True)
class Rule:
    """A named rewrite: where `pattern` matches a node's output, `rewrite(rw, m)` returns the
    value that replaces it (or None: not this time)."""
    name: str
    pattern: Pat
    rewrite: RewriteFn


class RuleSet:
    """Rules in priority order, indexed by the op of their root."""

    def __init__(self, rules: Sequence[Rule]):
        names = [r.name for r in rules]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"rule names must be unique: {dup}")
        self.rules = list(rules)
        self._by_op: dict[str, list[Rule]] = {}

    def for_op(self, op: str) -> list[Rule]:
        hit = self._by_op.get(op)
        if hit is None:
            hit = self._by_op[op] = [r for r in self.rules
                                     if r.pattern.root_ops is None or op in r.pattern.root_ops]
        return hit


def rewrite_graph(graph: Graph, rules: RuleSet, *, max_sweeps: int = MAX_SWEEPS) -> tuple[Graph, dict[str, int]]:
    """Apply `rules` greedily until none fires. Returns the new graph (the input graph itself
    when nothing changed) and per-rule counts (plus `kept_for_output`: roots left in place
    because they define a graph output the replacement cannot be renamed to).

    Rules that undo each other would never stop: past `max_sweeps` sweeps, or 100 rewrites
    per node of the input graph, that is a PassError."""
    fired: Counter[str] = Counter()
    kept: set[str] = set()
    budget = 100 * (len(graph.nodes) + 1)
    for _ in range(max_sweeps):
        rw = Rewriter(graph)
        if not _sweep(rw, rules, fired, kept, budget):
            break
        graph = rw.finish()
    else:
        _no_fixpoint(fired, f"{max_sweeps} sweeps")
    stats = {r.name: fired[r.name] for r in rules.rules if fired[r.name]}
    if kept:
        stats["kept_for_output"] = len(kept)
    return graph, stats


def _no_fixpoint(fired: Counter, after: str) -> None:
    raise PassError(f"rewrite rules did not reach a fixpoint after {after} (rewrites so far: {dict(fired)})",
                    fix="this is a graphmode bug (rules that undo each other); remove the pass from "
                        "optimize.passes to work around it")


def _sweep(rw: Rewriter, rules: RuleSet, fired: Counter, kept: set[str], budget: int) -> bool:
    any_fired = False
    for n in rw.graph.nodes:
        todo = [n]
        while todo:
            node = rw.resolved(todo.pop())
            idx = rw.emit(node)
            if node.body is not None or len(node.outputs) != 1:
                continue
            for rule in rules.for_op(node.op):
                new = _apply(rw, rule, idx, node, kept)
                if new is not None:
                    fired[rule.name] += 1
                    any_fired = True
                    if sum(fired.values()) > budget:
                        _no_fixpoint(fired, f"{budget} rewrites")
                    todo.extend(reversed(new))
                    break
    return any_fired


def _apply(rw: Rewriter, rule: Rule, idx: int, node: Node, kept: set[str]) -> list[Node] | None:
    for m in match_root(rule.pattern, node, rw):
        repl = rule.rewrite(rw, m)
        if repl is not None:
            new, refused = rw.commit(idx, m.consumed, repl)
            if new is not None:
                return new
            if refused:
                kept.add(node.outputs[0])
        rw._reset_pending()
    return None
