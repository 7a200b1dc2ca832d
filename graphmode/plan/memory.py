"""The memory planner: one arena per bucket holding every non-constant value.

Graph inputs (the runtime copies the padded request into their slots), intermediates and
outputs get byte offsets into a single arena; constants stay outside it. Buffers (after
aliasing, see liveness.py) are placed greedily — largest first into the lowest (or the
tightest) gap among already-placed buffers whose lifetimes overlap, as TFLite's and MNN's
planners do — trying a few orderings and keeping the smallest arena. The lower bound is
the largest total of simultaneously live bytes over the schedule; `activation_peak_expr`
is the same quantity as a sympy expression over the dims, for the recipe's Z3 proof.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import sympy

from graphmode.errors import IRError, PlanError
from graphmode.ir.graph import Graph
from graphmode.ir.ops import OPS
from graphmode.ir.types import eval_dim
from graphmode.plan.liveness import Liveness, analyze_liveness, validate_order
from graphmode.plan.schedule import reference_env, schedule


def bucket_key(env: Mapping[str, int]) -> str:
    """The same key as ExecutionPlan.bucket_key: "batch=1,seq=16"."""
    return ",".join(f"{k}={v}" for k, v in sorted(env.items()))


def _align(x: int, a: int) -> int:
    return -(-x // a) * a


@dataclass
class MemoryPlan:
    """Arena offsets for one bucket. Steps are positions in `order`; lifetimes are inclusive."""

    graph_name: str
    env: dict[str, int]
    order: list[int]
    offsets: dict[str, int]                   # every non-constant value -> byte offset
    nbytes: dict[str, int]
    alias_of: dict[str, str]                  # value -> the (input) value whose buffer it uses
    lifetimes: dict[str, tuple[int, int]]     # value -> (defining step, last step it is read)
    arena_bytes: int
    lower_bound_bytes: int
    alignment: int = 64
    reuse: bool = True
    alias_kind: dict[str, str] = field(default_factory=dict)       # value -> "view" | "inplace"
    shared_slots: list[list[str]] = field(default_factory=list)    # buffers put at one offset by alias_groups
    alias_groups: list[list[str]] = field(default_factory=list)    # as requested
    honoured_groups: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)                 # why a group was not honoured
    peak_step: int = 0
    strategy: str = ""

    # ---- queries -------------------------------------------------------------------------
    @property
    def bucket_key(self) -> str:
        return bucket_key(self.env)

    @property
    def ratio(self) -> float:
        return self.arena_bytes / self.lower_bound_bytes if self.lower_bound_bytes else 1.0

    def root(self, v: str) -> str:
        """The value that owns `v`'s buffer (follows alias_of)."""
        seen = 0
        while v in self.alias_of:
            v = self.alias_of[v]
            seen += 1
            if seen > len(self.alias_of):
                raise PlanError(f"alias cycle through %{v}", fix="this is a planner bug")
        return v

    def buffers(self) -> dict[str, dict[str, Any]]:
        """root -> {offset, size, start, end, members}."""
        out: dict[str, dict[str, Any]] = {}
        for v, (s, e) in self.lifetimes.items():
            r = self.root(v)
            b = out.setdefault(r, {"offset": self.offsets[r], "size": 0, "start": s, "end": e, "members": []})
            b["size"] = max(b["size"], self.nbytes[v])
            b["start"], b["end"] = min(b["start"], s), max(b["end"], e)
            b["members"].append(v)
        return out

    def live_at(self, step: int) -> list[str]:
        return [r for r, b in self.buffers().items() if b["start"] <= step <= b["end"]]

    # ---- invariants ----------------------------------------------------------------------
    def check(self, graph: Graph | None = None) -> None:
        """Raise PlanError unless no two buffers with overlapping lifetimes overlap in memory,
        every buffer is aligned and inside the arena, and (with `graph`) every value has a
        slot, lifetimes cover every read, and every in-place write is safe."""
        bufs = self.buffers()
        for v in self.lifetimes:
            if v not in self.offsets or v not in self.nbytes:
                raise PlanError(f"%{v} has a lifetime but no offset/size", fix="planner bug")
            r = self.root(v)
            if self.offsets[v] != self.offsets[r]:
                raise PlanError(f"%{v} aliases %{r} but sits at {self.offsets[v]}, not {self.offsets[r]}")
        for r, b in bufs.items():
            if b["offset"] % self.alignment:
                raise PlanError(f"buffer of %{r} at offset {b['offset']} is not {self.alignment}-byte aligned")
            if b["offset"] < 0 or b["offset"] + b["size"] > self.arena_bytes:
                raise PlanError(f"buffer of %{r} [{b['offset']}, {b['offset'] + b['size']}) lies outside the "
                                f"{self.arena_bytes}-byte arena")
        items = sorted(((b["start"], b["end"], b["offset"], b["offset"] + b["size"], r)
                        for r, b in bufs.items() if b["size"] > 0))
        for i, (s1, e1, lo1, hi1, r1) in enumerate(items):
            for s2, e2, lo2, hi2, r2 in items[i + 1:]:
                if s2 > e1:
                    break
                if lo1 < hi2 and lo2 < hi1:
                    raise PlanError(f"buffers of %{r1} (steps {s1}..{e1}, bytes [{lo1}, {hi1})) and %{r2} "
                                    f"(steps {s2}..{e2}, bytes [{lo2}, {hi2})) are live together and overlap",
                                    where=f"plan @{self.graph_name} {self.bucket_key}", fix="planner bug")
        if self.lower_bound_bytes > self.arena_bytes:
            raise PlanError(f"lower bound {self.lower_bound_bytes} exceeds the arena {self.arena_bytes}")
        if graph is not None:
            self._check_against(graph, bufs)

    def _check_against(self, graph: Graph, bufs: dict[str, dict[str, Any]]) -> None:
        where = f"plan @{self.graph_name} {self.bucket_key}"
        validate_order(graph, self.order)
        n = len(self.order)
        end = max(n - 1, 0)
        needed = {v for v in graph.inputs if v not in graph.constants}
        for v in needed:
            if self.nbytes.get(v) != _concrete_bytes(graph, v, self.env):
                raise PlanError(f"graph input %{v} has {self.nbytes.get(v)} bytes in the plan, "
                                f"{_concrete_bytes(graph, v, self.env)} in the graph", where=where)
        for s, idx in enumerate(self.order):
            node = graph.nodes[idx]
            for i in node.inputs:
                if i in graph.constants:
                    continue
                lo, hi = self.lifetimes.get(i, (None, None))
                if lo is None or not lo <= s <= hi:
                    raise PlanError(f"%{i} is read at step {s} outside its lifetime {lo}..{hi}", where=where)
            for o in node.outputs:
                needed.add(o)
                if self.lifetimes.get(o, (None,))[0] != s:
                    raise PlanError(f"%{o} is defined at step {s} but its lifetime says "
                                    f"{self.lifetimes.get(o)}", where=where)
                if self.nbytes[o] != _concrete_bytes(graph, o, self.env):
                    raise PlanError(f"%{o} has {self.nbytes[o]} bytes in the plan, "
                                    f"{_concrete_bytes(graph, o, self.env)} in the graph", where=where)
        for v in graph.inputs:
            if v not in graph.constants and self.lifetimes[v][0] != 0:
                raise PlanError(f"graph input %{v} must be live from step 0", where=where)
        for v in graph.outputs:
            if v not in graph.constants and self.lifetimes[v][1] != end:
                raise PlanError(f"graph output %{v} must be live until the last step", where=where)
        extra = set(self.offsets) - needed
        missing = needed - set(self.offsets)
        if extra or missing:
            raise PlanError("the plan's values differ from the graph's non-constant values", where=where,
                            value={"extra": sorted(extra)[:8], "missing": sorted(missing)[:8]})
        comp = _group_components(self.alias_groups)
        for v, u in self.alias_of.items():
            s = self.lifetimes[v][0]
            node = graph.nodes[self.order[s]]
            if u not in node.inputs or u in graph.constants:
                raise PlanError(f"%{v} aliases %{u}, which is not a non-constant input of the node "
                                f"defining it", where=where)
            if self.alias_kind.get(v) == "view" or OPS[node.op].view:
                continue
            r = self.root(u)
            if r in graph.inputs and not (u in comp and comp.get(v) == comp[u]):
                raise PlanError(f"%{v} is written over graph input %{r}", where=where,
                                fix="graph inputs are only overwritten when an alias group asks for it")
            for m in bufs[r]["members"]:
                if m != v and self.lifetimes[m][0] < s and self.lifetimes[m][1] > s:
                    raise PlanError(f"%{v} is written at step {s} over the buffer of %{r}, but %{m} (same "
                                    f"buffer) is still read at step {self.lifetimes[m][1]}", where=where)

    # ---- serialisation / display ---------------------------------------------------------
    def to_json(self) -> dict:
        return {"graph": self.graph_name, "env": dict(self.env), "order": list(self.order),
                "arena_bytes": self.arena_bytes, "lower_bound_bytes": self.lower_bound_bytes,
                "ratio": round(self.ratio, 4), "alignment": self.alignment, "reuse": self.reuse,
                "peak_step": self.peak_step, "strategy": self.strategy,
                "offsets": dict(self.offsets), "nbytes": dict(self.nbytes), "alias_of": dict(self.alias_of),
                "alias_kind": dict(self.alias_kind),
                "lifetimes": {k: list(v) for k, v in self.lifetimes.items()},
                "shared_slots": self.shared_slots, "alias_groups": self.alias_groups,
                "honoured_groups": self.honoured_groups, "notes": list(self.notes)}

    @staticmethod
    def from_json(d: Mapping) -> "MemoryPlan":
        return MemoryPlan(d["graph"], dict(d["env"]), list(d["order"]), dict(d["offsets"]), dict(d["nbytes"]),
                          dict(d["alias_of"]), {k: (int(v[0]), int(v[1])) for k, v in d["lifetimes"].items()},
                          int(d["arena_bytes"]), int(d["lower_bound_bytes"]), int(d.get("alignment", 64)),
                          bool(d.get("reuse", True)), dict(d.get("alias_kind", {})),
                          [list(s) for s in d.get("shared_slots", [])], [list(g) for g in d.get("alias_groups", [])],
                          [list(g) for g in d.get("honoured_groups", [])], list(d.get("notes", [])),
                          int(d.get("peak_step", 0)), d.get("strategy", ""))

    def text(self, limit: int = 40) -> str:
        lines = [f"memory plan @{self.graph_name} {self.bucket_key}: arena {self.arena_bytes} B "
                 f"({self.arena_bytes / 2**20:.2f} MiB), lower bound {self.lower_bound_bytes} B, "
                 f"ratio {self.ratio:.3f}, peak at step {self.peak_step}, {len(self.order)} steps"]
        bufs = sorted(self.buffers().items(), key=lambda kv: (kv[1]["offset"], kv[1]["start"]))
        for r, b in bufs[:limit]:
            al = [m for m in b["members"] if m != r]
            lines.append(f"  [{b['offset']:>12}, {b['offset'] + b['size']:>12})  steps {b['start']:>4}..{b['end']:<4} "
                         f"%{r}" + (f"  (+ {', '.join('%' + a for a in al)})" if al else ""))
        if len(bufs) > limit:
            lines.append(f"  ... {len(bufs) - limit} more buffers")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)


@dataclass
class MemoryPlanSet:
    """What the memory_plan pass leaves in ctx.analyses["memory_plan"]."""

    plans: dict[str, MemoryPlan]
    activation_expr: sympy.Expr
    order: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def plan_for(self, env: Mapping[str, int]) -> MemoryPlan | None:
        return self.plans.get(bucket_key(env))

    @property
    def worst_ratio(self) -> float:
        return max((p.ratio for p in self.plans.values()), default=1.0)

    def to_json(self) -> dict:
        return {"activation_expr": str(self.activation_expr), "order": list(self.order), "notes": self.notes,
                "plans": {k: p.to_json() for k, p in self.plans.items()}}


def _group_components(groups: Iterable[Sequence[str]]) -> dict[str, int]:
    """value -> component id, alias groups that share a value being one component."""
    comp: dict[str, int] = {}
    for gi, g in enumerate(groups):
        ids = {comp[v] for v in g if v in comp} | {gi}
        target = min(ids)
        for v, c in list(comp.items()):
            if c in ids:
                comp[v] = target
        for v in g:
            comp[v] = target
    return comp


# ---------------------------------------------------------------------------------- sizes

def _concrete_bytes(graph: Graph, v: str, env: Mapping[str, int]) -> int:
    nb = graph.values[v].type.nbytes()
    if isinstance(nb, int):
        return nb
    try:
        return eval_dim(nb, env)
    except IRError as e:
        raise PlanError(f"cannot size %{v} ({graph.values[v].type.text()}) at {dict(env)}: {e.message}",
                        where=f"graph @{graph.name}", fix="give a value for every dim the graph uses") from None


# ---------------------------------------------------------------------------------- placement

def _conflicts(spans: list[list[tuple[int, int]]]) -> list[set[int]]:
    """Items (lists of lifetime intervals) whose lifetimes overlap."""
    ivs = sorted((s, e, k) for k, sp in enumerate(spans) for s, e in sp)
    out: list[set[int]] = [set() for _ in spans]
    active: list[tuple[int, int]] = []     # (end, item)
    for s, e, k in ivs:
        active = [(ae, ak) for ae, ak in active if ae >= s]
        for _, ak in active:
            if ak != k:
                out[k].add(ak)
                out[ak].add(k)
        active.append((e, k))
    return out


_STRATEGIES = ("size_first_fit", "size_best_fit", "start_first_fit", "area_first_fit")


def _place(sizes: list[int], spans: list[list[tuple[int, int]]], conflicts: list[set[int]],
           alignment: int, strategy: str) -> tuple[list[int], int]:
    n = len(sizes)
    if strategy.startswith("size"):
        key = (lambda k: (-sizes[k], spans[k][0][0], k))
    elif strategy.startswith("start"):
        key = (lambda k: (spans[k][0][0], -sizes[k], k))
    else:
        key = (lambda k: (-sizes[k] * sum(e - s + 1 for s, e in spans[k]), k))
    best_fit = strategy.endswith("best_fit")
    offsets = [-1] * n
    arena = 0
    for k in sorted(range(n), key=key):
        size = sizes[k]
        if size == 0:
            offsets[k] = 0
            continue
        placed = sorted((offsets[j], sizes[j]) for j in conflicts[k] if offsets[j] >= 0 and sizes[j] > 0)
        cand, chosen, gap_best = 0, None, None
        for off, sz in placed:
            gap = off - cand
            if gap >= size:
                if not best_fit:
                    chosen = cand
                    break
                if gap_best is None or gap < gap_best[0]:
                    gap_best = (gap, cand)
            cand = max(cand, _align(off + sz, alignment))
        if chosen is None:
            chosen = gap_best[1] if gap_best is not None else cand
        offsets[k] = chosen
        arena = max(arena, chosen + size)
    return offsets, arena


# ---------------------------------------------------------------------------------- planning

def check_alignment(alignment: Any) -> int:
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0 \
            or alignment & (alignment - 1):
        raise PlanError("memory_plan.alignment must be a positive power of two", value=alignment,
                        fix="e.g. 64 (a cache line) or 256")
    return alignment


def plan_memory(graph: Graph, env: Mapping[str, int], *, reuse: bool = True, alignment: int = 64,
                alias_groups: Iterable[Sequence[str]] = (), order: Sequence[int] | None = None,
                liveness: Liveness | None = None) -> MemoryPlan:
    """Offsets for every non-constant value of `graph` at the concrete dims `env`."""
    alignment = check_alignment(alignment)
    groups = [list(g) for g in alias_groups]
    order = schedule(graph) if order is None else list(order)
    liv = liveness or analyze_liveness(graph, order, reuse=reuse, alias_groups=groups)
    env = {k: int(v) for k, v in env.items()}
    size_of = {v: _concrete_bytes(graph, v, env) for v in liv.values}
    bufs = liv.buffers()
    bsize = liv.buffer_sizes(size_of)
    live = liv.live_steps(size_of)
    lower = max(live, default=0)
    peak_step = live.index(lower) if live else 0

    # placement items: one per buffer, or one per alias-group slot of buffers (at one offset)
    in_slot = {r for s in liv.slots for r in s}
    item_roots: list[list[str]] = [list(s) for s in liv.slots] + [[r] for r in bufs if r not in in_slot]
    if not reuse:
        offsets_i, cur = [], 0
        for roots in item_roots:
            offsets_i.append(cur)
            cur = _align(cur + max(bsize[r] for r in roots), alignment)
        arena = max((o + max(bsize[r] for r in roots) for o, roots in zip(offsets_i, item_roots)), default=0)
        strategy = "no_reuse"
    else:
        sizes = [max(bsize[r] for r in roots) for roots in item_roots]
        spans = [[bufs[r] for r in roots] for roots in item_roots]
        conf = _conflicts(spans)
        best = None
        for strat in _STRATEGIES:
            offs, arena = _place(sizes, spans, conf, alignment, strat)
            if best is None or arena < best[1]:
                best = (offs, arena, strat)
            if arena == lower:
                break
        offsets_i, arena, strategy = best
    root_off = {r: off for off, roots in zip(offsets_i, item_roots) for r in roots}
    offsets = {v: root_off[liv.root[v]] for v in liv.values}
    plan = MemoryPlan(graph.name, env, list(order), offsets, size_of, dict(liv.alias_of),
                      {v: (liv.first[v], liv.last[v]) for v in liv.values}, int(arena), int(lower),
                      alignment, bool(reuse), dict(liv.alias_kind), [list(s) for s in liv.slots], groups,
                      [list(g) for g in liv.honoured], list(liv.notes), peak_step, strategy)
    return plan


# ---------------------------------------------------------------------------------- symbolic peak

def _terms(expr) -> dict[sympy.Expr, sympy.Rational]:
    """expr as {basis: coefficient}; a basis is a product of dims (or one opaque term)."""
    if isinstance(expr, int):
        return {sympy.S.One: sympy.Integer(expr)} if expr else {}
    out: dict[sympy.Expr, sympy.Rational] = {}
    for t in sympy.Add.make_args(sympy.expand(expr)):
        c, m = t.as_coeff_Mul()
        out[m] = out.get(m, 0) + c
    return {k: v for k, v in out.items() if v != 0}


def _dominates(a: Mapping, b: Mapping, nonneg) -> bool:
    """a >= b for every dim value >= 1, proved cheaply: each coefficient difference is zero
    or positive on a basis that is never negative (products of positive dims are not); failing
    that, a polynomial difference whose coefficients are all >= 0 after shifting every dim
    to 1 + t (t >= 0) — e.g. 1550*b*s - 8*b - s = 1541 + 1542*t_b + 1549*t_s + 1550*t_b*t_s."""
    diff = {k: a.get(k, 0) - b.get(k, 0) for k in set(a) | set(b)}
    if all(d == 0 or (d > 0 and nonneg(k)) for k, d in diff.items()):
        return True
    diff = {k: d for k, d in diff.items() if d != 0}
    if any(not k.is_Number and not (k.is_Symbol or k.is_Pow or k.is_Mul) for k in diff):
        return False
    expr = sympy.Add(*[d * k for k, d in diff.items()])
    gens = sorted(expr.free_symbols, key=lambda x: x.name)
    if not gens or not expr.is_polynomial(*gens):
        return bool(expr.is_number and expr >= 0)
    if expr.xreplace({g: 1 for g in gens}) < 0:      # fails at the smallest dims: cannot dominate
        return False
    shifted = sympy.Poly(sympy.expand(expr.xreplace({g: g + 1 for g in gens})), *gens)
    return all(c >= 0 for c in shifted.coeffs())


def activation_peak_expr(graph: Graph, *, order: Sequence[int] | None = None, reuse: bool = True,
                         alias_groups: Iterable[Sequence[str]] = (), liveness: Liveness | None = None) -> sympy.Expr:
    """Peak simultaneously-live bytes over the schedule, as an expression over the dims.

    Evaluated at a bucket it equals that bucket's `MemoryPlan.lower_bound_bytes`. Steps whose
    live total is dominated for every dim value (coefficient comparison) are dropped.
    """
    order = schedule(graph) if order is None else list(order)
    liv = liveness or analyze_liveness(graph, order, reuse=reuse, alias_groups=[list(g) for g in alias_groups])
    sym_size = {v: graph.values[v].type.nbytes() for v in liv.values}
    terms = {r: _terms(sym_size[r]) for r in liv.buffers()}
    n = max(liv.n_steps, 1)
    starts: list[list[str]] = [[] for _ in range(n + 1)]
    ends: list[list[str]] = [[] for _ in range(n + 1)]
    for r, (s, e) in liv.buffers().items():
        starts[s].append(r)
        ends[e + 1].append(r)
    cur: dict = {}
    sums: dict[frozenset, dict] = {}
    for s in range(n):
        for r in ends[s]:
            for k, c in terms[r].items():
                cur[k] = cur[k] - c
        for r in starts[s]:
            for k, c in terms[r].items():
                cur[k] = cur.get(k, 0) + c
        snap = {k: c for k, c in cur.items() if c != 0}
        sums.setdefault(frozenset(snap.items()), snap)

    ref = reference_env(graph)
    nonneg_cache: dict = {}

    def nonneg(k) -> bool:
        if k not in nonneg_cache:
            nonneg_cache[k] = bool(k == 1 or k.is_nonnegative)
        return nonneg_cache[k]

    def at_ref(t: Mapping) -> float:
        return float(sum(c * (1 if k == 1 else k.xreplace({x: ref.get(x.name, 64) for x in k.free_symbols}))
                         for k, c in t.items()))

    cands = sorted(sums.values(), key=lambda t: -at_ref(t))
    kept: list[dict] = []
    for t in cands:
        if any(_dominates(k, t, nonneg) for k in kept):
            continue
        kept = [k for k in kept if not _dominates(t, k, nonneg)] + [t]
    exprs = [sympy.Add(*[c * k for k, c in sorted(t.items(), key=lambda kc: sympy.default_sort_key(kc[0]))])
             for t in kept]
    if not exprs:
        return sympy.Integer(0)
    if len(exprs) == 1:
        return exprs[0]
    return sympy.Max(*exprs)


__all__ = ["MemoryPlan", "MemoryPlanSet", "plan_memory", "activation_peak_expr", "bucket_key"]
