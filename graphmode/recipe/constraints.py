"""Layer 3 of verification: Z3 proofs over every admissible shape.

For each property, Z3 searches for an admissible shape that breaks it. `unsat` means the
property holds for every admissible shape (proved); `sat` gives a counter-example, which
is re-checked by evaluating the sympy expressions exactly (refuted); `unknown`/timeout is
"unproved" and never counts as valid.

Admissible shapes: each dim ranges over its bucket values (explicit, synthesised, or the
step grid of a range) because the runtime pads a request up to its bucket, and memory and
latency are those of the padded bucket. Bucket cover/padding proofs range over every
request value in [min, max].

Memory model (bytes):  weights + prepared_weights + activations(dims) + workspace(dims) + kv_cache(dims)
                       prepared_weights = memory.weight_growth x weights: the copies generated
                       kernels read (packed panels, Winograd-transformed), which tactic selection
                       keeps under that multiple of the GEMM and conv weights (a lookup table,
                       never prepared, is left out of it where the graph shows one: a token
                       embedding counted 2.5x more asked budgets for memory nothing uses);
                       counted beside the originals, which a plan
                       releases to a file mapping where it can but which stay readable (and
                       resident where the cache folder cannot hold the mapping)
Latency model (s):     max(flops / peak_flops[compute dtype], bytes_moved / bandwidth)
                       + n_ops * launch_overhead          (roofline, from the Target)
                       + communication                    (under `parallel`: each collective's
                         bytes / link bandwidth + latency, graphmode/recipe/parallel_cost.py)
Under `parallel` every term is per device: one rank's weights, activations and KV-cache share.
"""
from __future__ import annotations

import bisect
import itertools
import math
import time
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Optional

import sympy
import z3

import graphmode.recipe.smt as smt
from graphmode.errors import TargetError
from graphmode.recipe.buckets import Synthesis, dim_buckets, dim_range, dim_synthesis, exact, runs, worst_padding
from graphmode.recipe.facts import MB, ModelFacts, estimate_facts, kv_cache_bytes, kv_params
from graphmode.recipe.schema import Recipe
from graphmode.recipe.parallel_cost import CommTerm, estimate_collectives, price, shard_estimate

DEFAULT_TIMEOUT_MS = 5000
BUDGET_PROOFS = 3            # all proofs of one recipe share BUDGET_PROOFS x the per-proof timeout
ENUMERATE_LIMIT = 20_000
PREPARED = "prepared_weights"   # the memory term of the kernels' prepared weight copies
EXACT_RUNS = 64              # bucket runs a Z3 formula lists one by one; more: see _solve, prove_cover


@dataclass
class Proof:
    """Outcome of one property. status: proved | refuted | unproved | skipped."""
    name: str
    status: str
    message: str
    counterexample: Optional[dict[str, int]] = None
    seconds: float = 0.0
    detail: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "message": self.message,
                "counterexample": self.counterexample, "seconds": round(self.seconds, 4),
                "detail": self.detail}


@dataclass
class Budget:
    """Time all proofs of one recipe share: each Z3 call gets min(timeout, what is left)."""
    total_ms: float
    t0: float = field(default_factory=time.perf_counter)

    def left_ms(self, timeout_ms: float) -> int:
        return int(min(timeout_ms, self.total_ms - (time.perf_counter() - self.t0) * 1000))


@dataclass
class SlaBound:
    path: str                          # "sla" or "sla.per_bucket[i]"
    which: str                         # "p50" | "p99"
    bound_ms: float
    select: dict[str, tuple[int, int]]  # dim -> inclusive range of *bucket values* the bound applies to
    requests: dict[str, tuple[int, int]] = field(default_factory=dict)  # the request ranges declared


@dataclass
class ConstraintModel:
    """Everything the proofs need, as sympy expressions over the dim symbols."""
    domains: dict[str, list[int]]
    memory_terms: dict[str, Any]
    budget_bytes: Optional[int]
    budget_source: str
    flops: Optional[Any] = None
    bytes_moved: Optional[Any] = None
    n_ops: Any = 0
    peak_flops: Optional[Fraction] = None       # FLOP/s in the compute dtype
    bandwidth: Optional[Fraction] = None        # bytes/s
    launch_overhead_s: Fraction = Fraction(0)
    compute_dtype: str = "f32"
    sla: list[SlaBound] = field(default_factory=list)
    kv_pages: Optional[tuple[str, int, int]] = None     # (seq dim, page_size, max_pages_per_seq)
    facts_source: str = ""
    comm: list[CommTerm] = field(default_factory=list)  # the step's collectives under `parallel`
    ranks: int = 1                                      # memory terms are per rank when > 1
    weights_unknown: bool = False                       # no model loaded or declared: weights counted as 0
    lookup_bytes: int = 0              # weights only indexed (embedding tables): precision.weights keeps them

    def comm_s(self) -> Any:
        return sympy.Add(*[t.seconds for t in self.comm])

    @property
    def memory_bytes(self) -> Any:
        return sum(self.memory_terms.values())

    @property
    def resident_once_bytes(self) -> Any:
        """The memory terms without the prepared copies: what one run reads at most once (a
        kernel reads a weight's prepared copy instead of the original, not beside it)."""
        return sum(v for k, v in self.memory_terms.items() if k != PREPARED)

    def latency_s(self) -> Optional[Any]:
        if self.flops is None or not self.peak_flops or not self.bandwidth:
            return None
        r = lambda f: sympy.Rational(f.numerator, f.denominator)  # noqa: E731
        moved = self.bytes_moved if self.bytes_moved is not None else self.resident_once_bytes
        return (sympy.Max(sympy.sympify(self.flops) / r(self.peak_flops), sympy.sympify(moved) / r(self.bandwidth))
                + sympy.sympify(self.n_ops) * r(self.launch_overhead_s) + self.comm_s())


def build_constraint_model(recipe: Recipe, target: Any, facts: ModelFacts | None = None, *,
                           calibration: Any = None) -> ConstraintModel:
    """Assemble the memory and latency models of a resolved recipe on `target`.

    `facts=None` uses `estimate_facts(recipe)`; the KV-cache term always comes from the recipe.
    `calibration` (a `graphmode.targets.cost.Calibration` of `target`) corrects the roofline
    latency with measured efficiency and per-instruction overhead (`apply_calibration`).
    """
    facts = facts or estimate_facts(recipe)
    par = recipe.parallel if recipe.parallel is not None and recipe.parallel.tensor > 1 else None
    if par is not None:
        sym = {d: sympy.Symbol(d, integer=True, positive=True) for d in recipe.dims}
        if not facts.sharded:
            facts = shard_estimate(facts, recipe, sym)
        comm = price(list(facts.collectives) or estimate_collectives(recipe, sym), par)
    prepared_from = facts.prepared_from_bytes if facts.prepared_from_bytes is not None else facts.weights_bytes
    terms: dict[str, Any] = {"weights": sympy.Integer(int(facts.weights_bytes)),
                             PREPARED: sympy.Integer(math.ceil(int(prepared_from) * recipe.memory.weight_growth)),
                             "activations": sympy.sympify(facts.activation_bytes)}
    if sympy.sympify(facts.workspace_bytes) != 0:
        terms["workspace"] = sympy.sympify(facts.workspace_bytes)
    kv = kv_params(recipe)
    if kv is not None:
        terms["kv_cache"] = kv_cache_bytes(recipe)
        if par is not None and par.split() == "head" and par.strategy["attention"] == "head":   # by KV heads
            terms["kv_cache"] = sympy.ceiling(sympy.sympify(terms["kv_cache"]) / par.tensor)
    budget = recipe.memory.budget_mb
    if isinstance(budget, (int, float)):
        budget_bytes, src = int(exact(budget) * MB), f"{budget:g} MB budget"
    else:
        budget_bytes, src = int(target.memory_bytes), f"target {target.name!r} memory"
    cm = ConstraintModel(domains=dim_buckets(recipe), memory_terms=terms, budget_bytes=budget_bytes,
                         budget_source=src, flops=facts.flops, bytes_moved=facts.bytes_moved,
                         n_ops=facts.n_ops or 0, compute_dtype=recipe.precision.compute,
                         facts_source=facts.source,
                         weights_unknown=not facts.weights_bytes and any("counted as 0" in n for n in facts.notes),
                         lookup_bytes=max(0, int(facts.weights_bytes) - int(prepared_from)))
    if par is not None:
        cm.comm, cm.ranks = comm, par.tensor
        cm.budget_source += f" per device ({par.tensor} ranks)"
    peak = target.peak(recipe.precision.compute)
    cm.peak_flops = exact(peak) if peak else None
    cm.bandwidth = exact(target.memory_bandwidth_gbps) * 10**9
    cm.launch_overhead_s = exact(target.launch_overhead_us) / 10**6
    if recipe.sla is not None:
        entries = [("sla", recipe.sla.p50_ms, recipe.sla.p99_ms, {}, {})]
        for i, b in enumerate(recipe.sla.per_bucket):
            sel = {}
            for d, v in b.match.items():      # requests in [lo, hi] land in buckets lo..bucket(hi)
                lo, hi = (v, v) if isinstance(v, int) else (v[0], v[1])
                dom = cm.domains.get(d, [])
                at = bisect.bisect_left(dom, hi)
                sel[d] = (lo, dom[at] if at < len(dom) else hi)
            entries.append((f"sla.per_bucket[{i}]", b.p50_ms, b.p99_ms, sel,
                            {d: ((v, v) if isinstance(v, int) else tuple(v)) for d, v in b.match.items()}))
        for path, p50, p99, sel, req in entries:
            # the cost model predicts a typical run: it must meet p50 (or p99 when no p50 is given)
            if p50 is not None:
                cm.sla.append(SlaBound(path, "p50", float(p50), sel, req))
            elif p99 is not None:
                cm.sla.append(SlaBound(path, "p99", float(p99), sel, req))
    if kv is not None and isinstance(kv["max_pages_per_seq"], int):
        cm.kv_pages = (kv["seq_dim"], kv["page_size"], kv["max_pages_per_seq"])
    return apply_calibration(cm, target, calibration)


def apply_calibration(cm: ConstraintModel, target: Any, calibration: Any) -> ConstraintModel:
    """Latency with a measured calibration: the whole-model roofline (on the peak and bandwidth
    the calibration was fitted against, when it records them) divided by the fitted
    `model_efficiency` (else `default_efficiency`), plus the fitted per-instruction overhead.
    Scaling peak and bandwidth by the efficiency is the same as dividing max(...) by it."""
    if calibration is None:
        return cm
    if calibration.target != getattr(target, "name", None):
        raise TargetError("calibration belongs to another target", where="calibration.target",
                          value=calibration.target, fix=f"use the calibration of {getattr(target, 'name', target)!r}")
    eff = exact(calibration.model_efficiency or calibration.default_efficiency)
    if cm.peak_flops:   # the roofline the calibration was fitted against, scaled by its efficiency
        cm.peak_flops = exact(calibration.peak(target, cm.compute_dtype)) * eff
    if cm.bandwidth:
        cm.bandwidth = exact(calibration.bandwidth_gbps(target)) * 10**9 * eff
    if calibration.overhead_us is not None:
        cm.launch_overhead_s = exact(calibration.overhead_us) / 10**6
    return cm


# ---- Z3 plumbing ----------------------------------------------------------------------------

def _domain(var: z3.ArithRef, values: list[int]) -> z3.BoolRef:
    """var is one of `values`: one term per arithmetic run (a step grid is a single range)."""
    terms = []
    for first, d, last in runs(values):
        if first == last:
            terms.append(var == first)
        elif last - first == d:
            terms += [var == first, var == last]
        else:
            terms.append(z3.And(var >= first, var <= last, (var - first) % d == 0))
    return z3.Or(terms)


def _refine(var: z3.ArithRef, rs: list[tuple[int, int, int]], firsts: list[int], x: int) -> z3.BoolRef | None:
    """A constraint excluding `x` and the values around it that are no bucket either (the gap
    between two runs, or a run's off-grid values), or None when x is a bucket."""
    first, d, last = rs[bisect.bisect_right(firsts, x) - 1]
    if x > last:                                           # between two runs: exclude the gap
        return z3.Or(var <= last, var >= firsts[bisect.bisect_right(firsts, x)])
    if (x - first) % d:                                    # inside a run, off its grid
        return z3.Implies(z3.And(var >= first, var <= last), (var - first) % d == 0)
    return None


def _solve(constraints: list[z3.BoolRef], variables: dict[str, z3.ArithRef], timeout_ms: int,
           domains: dict[str, list[int]] | None = None):
    """Satisfy `constraints` with each variable in its domain of bucket values. A small domain
    is listed exactly (one term per run); a large one starts as its interval hull and is refined
    only where Z3's model falls between buckets (CEGAR), since a Z3 disjunction of thousands of
    runs does not finish. -> ("sat", values) | ("unsat", None) | ("unknown", reason)."""
    s = z3.Solver()
    s.add(*constraints)
    large: dict[str, tuple[list, list[int]]] = {}
    for k, vals in (domains or {}).items():
        rs = runs(vals)
        if len(rs) <= EXACT_RUNS:
            s.add(_domain(variables[k], vals))
        else:
            s.add(variables[k] >= rs[0][0], variables[k] <= rs[-1][2])
            large[k] = (rs, [r[0] for r in rs])
    end = time.perf_counter() + timeout_ms / 1000
    while True:
        left = int((end - time.perf_counter()) * 1000)
        if left <= 0:
            return "unknown", "timeout"
        s.set("timeout", left)
        r = s.check()
        if r == z3.unsat:
            return "unsat", None
        if r != z3.sat:
            return "unknown", s.reason_unknown() or "unknown"
        m = s.model()
        ce = {k: m.eval(v, model_completion=True).as_long() for k, v in variables.items()}
        cuts = [c for k, (rs, firsts) in large.items() if (c := _refine(variables[k], rs, firsts, ce[k])) is not None]
        if not cuts:
            return "sat", ce
        s.add(*cuts)


def _fmt_shape(ce: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in ce.items())


def _small(x: float, places: int = 2) -> str:
    """Fixed places, or 3 significant digits where that would print 0 (a 2 us plan's 0.00 ms)."""
    return f"{x:.{places}f}" if x == 0 or abs(x) >= 10.0 ** (1 - places) else f"{x:.3g}"


def _mb(x) -> str:
    """Bytes in MB: one decimal, and three significant digits below 10 MB (a tiny budget and what it
    refuses would both read 0.0 MB)."""
    v = float(x) / MB
    return f"{v:.1f} MB" if v >= 10 or v == 0 else f"{v:.3g} MB"


def _vars(cm: ConstraintModel) -> dict[str, z3.ArithRef]:
    return {d: z3.Int(d) for d in cm.domains}


def _table(expr, domains: dict[str, list[int]]) -> list[tuple[float, dict[str, int]]] | None:
    """expr at every bucket, largest first (for reporting headroom), or None past ENUMERATE_LIMIT
    buckets; built once per expression, however many SLA entries read it."""
    names = list(domains)
    n = 1
    for d in names:
        n *= len(domains[d])
    if n == 0 or n > ENUMERATE_LIMIT:
        return None
    syms = [sympy.Symbol(d) for d in names]
    e = sympy.sympify(expr).xreplace({s: sympy.Symbol(str(s)) for s in sympy.sympify(expr).free_symbols})
    f = sympy.lambdify(syms, e, modules="math")
    rows = [(float(f(*combo)), combo) for combo in itertools.product(*(domains[d] for d in names))]
    rows.sort(key=lambda r: -r[0])
    return [(v, dict(zip(names, combo))) for v, combo in rows]


def _worst(table, select: dict[str, tuple[int, int]] | None = None) -> tuple[float, dict[str, int]] | None:
    """The largest row of `table` whose dims lie in `select`, or None."""
    for v, at in table or []:
        if not select or all(lo <= at[d] <= hi for d, (lo, hi) in select.items() if d in at):
            return v, at
    return None


# ---- the proofs -------------------------------------------------------------------------------

def prove_memory(cm: ConstraintModel, timeout_ms: int = DEFAULT_TIMEOUT_MS) -> Proof:
    t0 = time.perf_counter()
    v = _vars(cm)
    total = cm.memory_bytes
    try:
        z, d = smt.to_z3(total, v)
    except smt.SmtError as e:
        return Proof("memory", "unproved", f"unproved: {e}", seconds=time.perf_counter() - t0)
    budget = cm.budget_bytes
    status, res = _solve([z > budget * d], v, timeout_ms, cm.domains)
    dt = time.perf_counter() - t0
    if status == "sat":
        ce = res
        parts = {k: smt.evaluate(e, ce) for k, e in cm.memory_terms.items()}
        need = sum(parts.values())
        if not need > budget:
            raise AssertionError(f"internal: Z3 memory counter-example {ce} does not reproduce ({need} <= {budget})")
        breakdown = " + ".join(f"{k} {_mb(x)}" for k, x in parts.items())
        per = f" per device (rank of {cm.ranks})" if cm.ranks > 1 else ""
        shown = f"{budget / MB:g}" if budget >= 10 * MB else f"{budget / MB:.3g}"     # no float noise below 10
        msg = f"{_fmt_shape(ce)}: needs {_mb(need)} > {shown} MB budget{per} ({breakdown})"
        return Proof("memory", "refuted", msg, ce, dt,
                     {"needed_bytes": int(need), "budget_bytes": budget, "lookup_bytes": cm.lookup_bytes,
                      "terms": {k: float(x) for k, x in parts.items()}})
    table = _table(total, cm.domains)
    if status == "unknown":
        if table is None:
            return Proof("memory", "unproved", f"unproved ({res})", seconds=dt)
        # plans exist at the buckets only: every one of them, evaluated exactly, decides it
        need, at = table[0]
        if need > budget:
            parts = {k: smt.evaluate(e, at) for k, e in cm.memory_terms.items()}
            return Proof("memory", "refuted", f"{_fmt_shape(at)}: needs {_mb(need)} > {budget / MB:.3g} MB budget "
                         f"(Z3: {res}; decided at each of the {len(table)} buckets)", at, time.perf_counter() - t0,
                         {"needed_bytes": int(need), "budget_bytes": budget, "lookup_bytes": cm.lookup_bytes,
                          "terms": {k: float(x) for k, x in parts.items()}})
    worst = _worst(table)
    detail = {"budget_bytes": budget}
    msg = f"fits {cm.budget_source} for every bucket" + (
        f" (Z3: {res}; decided at each of the {len(table)} buckets)" if status == "unknown" else "")
    if worst:
        detail.update(worst_bytes=worst[0], worst_at=worst[1])
        msg += f" (worst {_mb(worst[0])} at {_fmt_shape(worst[1])})"
    if cm.weights_unknown:
        msg += (", without the weights (no model given or declared): `recipe validate --model` or "
                "model.weights_mb counts them")
    return Proof("memory", "proved", msg, seconds=time.perf_counter() - t0, detail=detail)


def _latency_breakdown(cm: ConstraintModel, ce: dict[str, int]) -> str:
    fl = smt.evaluate(cm.flops, ce)
    moved = smt.evaluate(cm.bytes_moved if cm.bytes_moved is not None else cm.resident_once_bytes, ce)
    n = smt.evaluate(cm.n_ops, ce)
    c = float(fl) / float(cm.peak_flops) * 1e3
    m = float(moved) / float(cm.bandwidth) * 1e3
    out = (f"compute {_small(float(fl) / 1e9)} GFLOP at {float(cm.peak_flops) / 1e9:.1f} GFLOP/s {cm.compute_dtype} "
           f"= {_small(c)} ms, memory {_small(float(moved) / 1e9, 3)} GB at {float(cm.bandwidth) / 1e9:.1f} GB/s = "
           f"{_small(m)} ms, "
           f"{int(n)} launches x {float(cm.launch_overhead_s) * 1e6:g} us")
    top = _largest_comm(cm, ce)
    if top is not None:
        out += (f", communication {float(smt.evaluate(cm.comm_s(), ce)) * 1e3:.2f} ms; largest: "
                f"{top.describe(ce)} = {float(smt.evaluate(top.seconds, ce)) * 1e3:.2f} ms")
    return out


def _largest_comm(cm: ConstraintModel, ce: dict[str, int]) -> CommTerm | None:
    """The collective that takes longest at `ce` (the counter-example's collective and link)."""
    return max(cm.comm, key=lambda t: float(smt.evaluate(t.seconds, ce)), default=None)


def comm_detail(cm: ConstraintModel, at: dict[str, int]) -> dict[str, Any]:
    """The step's communication at one shape: total ms, bytes and the largest collective."""
    top = _largest_comm(cm, at)
    if top is None:
        return {}
    return {"comm_ms": float(smt.evaluate(cm.comm_s(), at)) * 1e3,
            "comm_bytes": sum(float(smt.evaluate(t.nbytes, at)) * t.collective.count for t in cm.comm),
            "collective": top.collective.op, "collective_what": top.collective.what,
            "collective_bytes": float(smt.evaluate(top.nbytes, at)), "link": top.link,
            "link_gbps": top.bandwidth_gbps, "link_latency_us": top.latency_us}


def _spent(name: str, budget: Budget) -> Proof:
    return Proof(name, "unproved", f"unproved: the recipe's proof time budget ({budget.total_ms / 1000:g} s) is "
                                   f"spent before this proof", detail={"budget_ms": budget.total_ms})


def prove_latency(cm: ConstraintModel, timeout_ms: int = DEFAULT_TIMEOUT_MS,
                  budget: Budget | None = None) -> list[Proof]:
    out: list[Proof] = []
    lat = cm.latency_s()
    budget = budget or Budget(BUDGET_PROOFS * timeout_ms)
    table = _table(lat, cm.domains) if lat is not None and cm.sla else None
    for b in cm.sla:
        name = f"{b.path}.{b.which}_ms"
        t0 = time.perf_counter()
        left = budget.left_ms(timeout_ms)
        if left <= 0 and lat is not None:
            out.append(_spent(name, budget))
            continue
        if lat is None:
            why = ("no FLOP count: declare model.gflops_per_item or a transformer model section, "
                   "or pass ModelFacts from the compiler") if cm.flops is None else \
                f"target has no peak FLOP/s for {cm.compute_dtype}"
            out.append(Proof(name, "unproved", f"unproved: {why}"))
            continue
        v = _vars(cm)
        thr = sympy.Rational(str(b.bound_ms)) / 1000
        try:
            z, d = smt.to_z3(lat - thr, v)
        except smt.SmtError as e:
            out.append(Proof(name, "unproved", f"unproved: {e}", seconds=time.perf_counter() - t0))
            continue
        cons = [z3.And(v[k] >= lo, v[k] <= hi) for k, (lo, hi) in b.select.items() if k in v]
        status, res = _solve(cons + [z > 0], v, left, cm.domains)
        dt = time.perf_counter() - t0
        scope = "" if not b.requests else " for requests " + ", ".join(
            f"{k}={lo}" if lo == hi else f"{k} in [{lo}, {hi}]" for k, (lo, hi) in b.requests.items())
        if status == "sat":
            ce = res
            pred = smt.evaluate(lat, ce)
            if not pred > thr:
                raise AssertionError(f"internal: Z3 latency counter-example {ce} does not reproduce")
            msg = (f"{_fmt_shape(ce)}: predicted {_small(float(pred) * 1e3)} ms > {b.which} {b.bound_ms:g} ms{scope} "
                   f"({_latency_breakdown(cm, ce)})")
            out.append(Proof(name, "refuted", msg, ce, dt, {"predicted_ms": float(pred) * 1e3,
                                                              "bound_ms": b.bound_ms, **comm_detail(cm, ce)}))
        elif status == "unknown":
            out.append(Proof(name, "unproved", f"unproved ({res})", seconds=dt))
        else:
            worst = _worst(table, b.select)
            msg = f"predicted latency <= {b.which} {b.bound_ms:g} ms{scope}"
            detail: dict[str, Any] = {"bound_ms": b.bound_ms}
            if worst:
                msg += f" (worst {worst[0] * 1e3:.2f} ms at {_fmt_shape(worst[1])})"
                detail.update(worst_ms=worst[0] * 1e3, worst_at=worst[1])
            out.append(Proof(name, "proved", msg, seconds=time.perf_counter() - t0, detail=detail))
    return out


def prove_kv_pages(cm: ConstraintModel, timeout_ms: int = DEFAULT_TIMEOUT_MS) -> Proof | None:
    if cm.kv_pages is None:
        return None
    seq, page, max_pages = cm.kv_pages
    t0 = time.perf_counter()
    s = z3.Int(seq)
    pages = -((-(s + 1)) / page)           # the prompt and at least one new token
    status, res = _solve([pages > max_pages], {seq: s}, timeout_ms, {seq: cm.domains[seq]})
    dt = time.perf_counter() - t0
    if status == "sat":
        res = {seq: max(cm.domains[seq])}      # pages grow with the prompt: the longest one says what is needed
        need = -(-(res[seq] + 1) // page)
        assert need > max_pages
        return Proof("memory.kv_cache.max_pages_per_seq", "refuted",
                     f"{seq}={res[seq]}: a prompt of {res[seq]} tokens and one new token need {need} pages of {page} "
                     f"tokens > max_pages_per_seq {max_pages}", res, dt,
                     {"pages": need, "fix": f"memory.kv_cache.max_pages_per_seq >= {need}, or dims.{seq} at most "
                                            f"{max_pages * page - 1}"})
    if status == "unknown":
        return Proof("memory.kv_cache.max_pages_per_seq", "unproved", f"unproved ({res})", seconds=dt)
    top = max(cm.domains[seq])
    return Proof("memory.kv_cache.max_pages_per_seq", "proved",
                 f"every {seq} and one new token fit in {max_pages} pages (longest {top} + 1 needs "
                 f"{-(-(top + 1) // page)})", seconds=dt)


def _cover_breaks(v: z3.ArithRef, buckets: list[int], p: Fraction | None) -> z3.BoolRef:
    """v has no bucket, or its bucket (the smallest >= v) pads it by more than p. One pair of
    terms per arithmetic run of buckets: in a run (first, d, last), v in (first, last] pads to
    first + d * ceil((v - first) / d), and v in (previous bucket, first] pads to first."""
    bad = [v > max(buckets)]
    if p is None:
        return z3.Or(bad)
    num, den = p.numerator, p.denominator

    def over(chosen: Any) -> z3.BoolRef:
        return (chosen - v) * den > num * chosen
    prev = None
    for first, d, last in runs(buckets):
        below = v <= first if prev is None else z3.And(v > prev, v <= first)
        bad.append(z3.And(below, over(z3.IntVal(first))))
        if last > first:
            bad.append(z3.And(v > first, v <= last, over(first + d * ((v - first + d - 1) / d))))
        prev = last
    return z3.Or(bad)


def _cover_exact(lo: int, hi: int, buckets: list[int], p: Fraction | None) -> tuple[str, Any]:
    """The cover property checked gap by gap in exact integers: within (previous bucket, b] the
    padding is largest at the gap's first value, so these values are all that can break it."""
    if hi > max(buckets):
        return "sat", max(buckets) + 1
    if p is not None:
        w, at = worst_padding(buckets, lo, hi)
        if w > p:
            return "sat", at
    return "unsat", None


def prove_cover(dim: str, lo: int, hi: int, buckets: list[int], max_padding: float | Fraction | None,
                timeout_ms: int = DEFAULT_TIMEOUT_MS) -> Proof:
    """Prove every request value in [lo, hi] has a bucket, padded with ratio <= max_padding:
    by Z3 over up to EXACT_RUNS runs of buckets, by the exact gap check beyond (a Z3 formula
    of thousands of runs does not finish; the gap check is linear and just as complete)."""
    t0 = time.perf_counter()
    name = f"dims.{dim}.buckets"
    v = z3.Int(dim)
    p = Fraction(0)
    if max_padding is not None:
        p = Fraction(str(max_padding)) if not isinstance(max_padding, Fraction) else max_padding
    how = ""
    if len(runs(buckets)) <= EXACT_RUNS:
        status, res = _solve([v >= lo, v <= hi, _cover_breaks(v, buckets, p if max_padding is not None else None)],
                             {dim: v}, timeout_ms)
    else:
        status, x = _cover_exact(lo, hi, buckets, p if max_padding is not None else None)
        res, how = ({dim: x} if status == "sat" else None), f" (exact check of {len(set(buckets))} bucket gaps)"
    dt = time.perf_counter() - t0
    bound = f", padding <= {float(p):.4g}" if max_padding is not None else ""
    if status == "sat":
        x = res[dim]
        above = [b for b in sorted(buckets) if b >= x]
        if not above:
            return Proof(name, "refuted", f"{dim}={x}: no bucket holds it (largest {max(buckets)})", res, dt)
        b = above[0]
        pad = Fraction(b - x, b)
        assert pad > p
        return Proof(name, "refuted", f"{dim}={x}: padded to {b}, padding {float(pad):.4f} > {float(p):.4g}",
                     res, dt, {"bucket": b, "padding": float(pad)})
    if status == "unknown":
        return Proof(name, "unproved", f"unproved ({res})", seconds=dt)
    return Proof(name, "proved", f"every {dim} in [{lo}, {hi}] has a bucket{bound}{how}", seconds=dt)


def prove_all(recipe: Recipe, target: Any, facts: ModelFacts | None = None,
              timeout_ms: int = DEFAULT_TIMEOUT_MS, *, calibration: Any = None
              ) -> tuple[ConstraintModel, list[Proof]]:
    """Every layer-3 proof for a resolved, semantically valid recipe (`calibration`: see
    `build_constraint_model`). All of them share BUDGET_PROOFS x `timeout_ms`: a proof that
    finds the budget spent is "unproved", so validation ends in bounded time. One recipe's
    proofs at a time in the process (smt.Z3_LOCK: Z3's default context is not thread-safe)."""
    with smt.Z3_LOCK:
        return _prove_all(recipe, target, facts, timeout_ms, calibration)


def _prove_all(recipe: Recipe, target: Any, facts: ModelFacts | None, timeout_ms: int, calibration: Any
               ) -> tuple[ConstraintModel, list[Proof]]:
    budget = Budget(BUDGET_PROOFS * timeout_ms)
    proofs: list[Proof] = []

    def run(name: str, prove, *args) -> Proof:
        left = budget.left_ms(timeout_ms)
        return prove(*args, left) if left > 0 else _spent(name, budget)
    for name, spec in recipe.dims.items():
        s: Synthesis = dim_synthesis(spec)
        lo, hi = dim_range(spec)
        bound = spec.max_padding if spec.max_padding is not None else (
            s.worst_padding if spec.max_buckets is not None else None)
        proofs.append(run(f"dims.{name}.buckets", prove_cover, name, lo, hi, s.buckets, bound))
    cm = build_constraint_model(recipe, target, facts, calibration=calibration)
    if cm.kv_pages is not None:
        proofs.append(run("memory.kv_cache.max_pages_per_seq", prove_kv_pages, cm))
    proofs.append(run("memory", prove_memory, cm))
    proofs.extend(prove_latency(cm, timeout_ms, budget))
    return cm, proofs
