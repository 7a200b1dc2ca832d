"""What the constraint layer knows about a model: `ModelFacts`.

The proofs need, as expressions over the recipe's dim symbols (sympy Symbols named like
the dims; assumptions do not matter, names do):
  weights_bytes     constant bytes of parameters/constants resident during a run
  activation_bytes  peak bytes of activations (the planner's arena size) per shape
  flops, bytes_moved, n_ops   for the roofline latency model (optional)
  collectives       the step's collectives under `parallel` (graphmode/recipe/parallel_cost.py)
  sharded           True when the facts describe one rank (a sharded graph), not the model

The compiler passes exact facts (the memory planner's arena-size expression, summed
FLOPs/bytes of the plan, the instruction count). Without a compiled model,
`estimate_facts(recipe)` derives crude ones from the recipe's `model` section. The KV
cache is always added from `memory.kv_cache` (`kv_cache_bytes`), never from the facts.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import sympy

from graphmode.recipe.buckets import dim_range
from graphmode.recipe.limits import DTYPE_SIZES
from graphmode.recipe.schema import Recipe

MB = 2**20
Expr = Union[sympy.Expr, int]


@dataclass(frozen=True)
class ModelFacts:
    """Model-side terms of the memory and latency models (see module doc)."""
    weights_bytes: int
    activation_bytes: Expr
    flops: Optional[Expr] = None
    bytes_moved: Optional[Expr] = None
    n_ops: Optional[Expr] = None
    workspace_bytes: Expr = 0
    source: str = "compiler"
    notes: list[str] = field(default_factory=list)
    collectives: tuple = ()
    sharded: bool = False
    # the weights kernels may prepare copies of (all but lookup tables: analysis/indices.py);
    # None: every weight (an estimate from the recipe's `model` section)
    prepared_from_bytes: Optional[int] = None


def dim_symbol(name: str) -> sympy.Symbol:
    return sympy.Symbol(name, integer=True, positive=True)


def dim_symbols(recipe: Recipe) -> dict[str, sympy.Symbol]:
    return {d: dim_symbol(d) for d in recipe.dims}


def _mb(x: float) -> int:
    return int(round(x * MB))


def kv_params(recipe: Recipe) -> dict[str, object] | None:
    """layers/kv_heads/head_dim/dtype of the KV cache, filled from `model` where omitted.

    None when there is no kv_cache; missing entries are None (semantics reports them).
    """
    kv = recipe.memory.kv_cache
    if kv is None:
        return None
    m = recipe.model
    head_dim = kv.head_dim or (m.head_dim if m else None)
    if head_dim is None and m and m.hidden and m.heads:
        head_dim = m.hidden // m.heads
    return {"layers": kv.layers or (m.layers if m else None),
            "kv_heads": kv.kv_heads or (m.kv_heads or m.heads if m else None),
            "head_dim": head_dim,
            "dtype": kv.dtype or recipe.precision.compute,
            "page_size": kv.page_size, "max_pages_per_seq": kv.max_pages_per_seq,
            "batch_dim": kv.batch_dim, "seq_dim": kv.seq_dim}


def kv_page_bytes(recipe: Recipe) -> int:
    p = kv_params(recipe)
    return 2 * p["layers"] * p["kv_heads"] * p["head_dim"] * DTYPE_SIZES[p["dtype"]] * p["page_size"]


def kv_pool_pages(recipe: Recipe) -> int:
    """Pages in the pool the runtime allocates (the memory proof counts exactly these)."""
    kv = recipe.memory.kv_cache
    if kv.pages is not None:
        return int(kv.pages)
    p = kv_params(recipe)
    batch = dim_range(recipe.dims[p["batch_dim"]])[1] if p["batch_dim"] in recipe.dims else 1
    return int(batch) * int(p["max_pages_per_seq"])


def kv_cache_bytes(recipe: Recipe) -> Expr:
    """The KV pool: allocated once at its full size, whatever the request shapes."""
    p = kv_params(recipe)
    if p is None:
        return 0
    return kv_page_bytes(recipe) * kv_pool_pages(recipe)


def _elems(axes: list, sym: dict[str, sympy.Symbol]) -> Expr:
    n: Expr = 1
    for e in axes:
        if isinstance(e, int):
            n = n * e
        elif e in sym:                     # "*" (any extent) counts as 1: a lower bound
            n = n * sym[e]
    return n


def _input_elems(recipe: Recipe, sym: dict[str, sympy.Symbol]) -> list[tuple[Expr, int]]:
    return [(_elems(inp.shape, sym), DTYPE_SIZES[inp.dtype]) for inp in recipe.inputs]


def io_floor(recipe: Recipe, sym: dict[str, sympy.Symbol]) -> Expr:
    """Bytes any run holds at once whatever the model: all padded inputs (live at the start), or
    all declared outputs in the compute dtype (live at the end). The estimates below model the
    layers, not the tensors the recipe declares, so a fixed extent of 10**9 would slip past them."""
    cb = DTYPE_SIZES[recipe.precision.compute]
    ins = sympy.Add(*[n * size for n, size in _input_elems(recipe, sym)])       # Add(*...): sum() is quadratic
    outs = sympy.Add(*[_elems(axes, sym) * cb for axes in recipe.outputs.values()])
    return sympy.Max(sympy.expand(ins), sympy.expand(outs)) if recipe.outputs else sympy.expand(ins)


def linear_params(m) -> int:
    """Weights of a transformer's linear layers (attention q/k/v/o, a two-matrix MLP) from the
    `model` section: the part `precision.weights` stores narrow. A gated MLP's third matrix and an
    LM head are left out, so the estimate errs towards more f32 bytes, never fewer."""
    if not (m and m.layers and m.hidden):
        return 0
    h = m.hidden
    kv = (m.kv_heads * (m.head_dim or h // (m.heads or max(1, h // 64)))) if m.kv_heads else h
    return m.layers * (2 * h * h + 2 * h * kv + 2 * h * (m.intermediate or 4 * h))


def stored_bytes_per_weight(recipe: Recipe) -> sympy.Rational:
    """Bytes one linear weight takes as `precision.weights` stores it, its scales included
    (quantize_weights: a f32 scale per output row for bf16/int8, per group for int4, and a
    zero point per group for asymmetric int4); an upper bound (rows of at least `hidden`)."""
    p, m = recipe.precision, recipe.model
    if p.weights == "f32":
        return sympy.Integer(DTYPE_SIZES[p.compute])
    if p.weights == "int4":
        rows = [d for d in (m.hidden, m.intermediate) if d] if m else []
        if not rows or any(d % p.group_size for d in rows):   # a linear whose in features split no group stays f32
            return sympy.Integer(DTYPE_SIZES[p.compute])
        return sympy.Rational(1, 2) + sympy.Rational(4 if p.int4_scheme == "symmetric" else 8, p.group_size)
    row = min(m.hidden, m.intermediate or m.hidden) if m and m.hidden else 1
    return sympy.Integer(2 if p.weights == "bf16" else 1) + sympy.Rational(4, row)


def stored_weights_bytes(recipe: Recipe, notes: list[str]) -> int:
    """The model's resident weights before it is loaded: `model.weights_mb` (the weights as the
    model holds them, at the compute dtype) or `params_m` or a transformer's count, with the
    linear part at the bytes `precision.weights` stores it in. A decoder's LM head counts twice:
    tied to the embedding, it keeps the f32 table for the lookup beside its narrow copy."""
    m = recipe.model
    cb = DTYPE_SIZES[recipe.precision.compute]
    if m and m.weights_mb:
        total = _mb(m.weights_mb) // cb
    elif m and m.params_m:
        total = int(round(m.params_m * 1e6))
    elif m and m.layers and m.hidden:
        total = 12 * m.layers * m.hidden**2 + (m.vocab or 0) * m.hidden
    else:
        notes.append("no model.weights_mb/params_m: weights counted as 0 MB")
        return 0
    if recipe.precision.weights == "f32":
        return _mb(m.weights_mb) if m.weights_mb else total * cb
    linear = min(linear_params(m), total)
    if not linear:
        notes.append(f"precision.weights {recipe.precision.weights} stores linear weights narrow, but without "
                     "model.layers and model.hidden every weight is counted at the compute dtype")
    head = m.vocab * m.hidden if m.kind == "decoder" and m.vocab and m.hidden else 0    # a tied LM head's narrow copy
    return int(sympy.ceiling((linear + head) * stored_bytes_per_weight(recipe))) + (total - linear) * cb


def estimate_facts(recipe: Recipe) -> ModelFacts:
    """Crude facts from the recipe's `model` section (and inputs) when no compiled model exists."""
    m = recipe.model
    sym = dim_symbols(recipe)
    cb = DTYPE_SIZES[recipe.precision.compute]
    fused = recipe.optimize.fusion.enabled and "fuse" in recipe.pipeline()
    b = sym.get(m.batch_dim, 1) if m else sym.get("batch", 1)
    notes: list[str] = []

    weights = stored_weights_bytes(recipe, notes)

    if m and m.kind in ("encoder", "decoder") and m.hidden and m.layers and m.seq_dim in sym:
        s = sym[m.seq_dim]
        h, n_layers = m.hidden, m.layers
        heads = m.heads or max(1, h // 64)
        inter = m.intermediate or 4 * h
        per_layer = b * s * (4 * h + inter) + 2 * b * heads * s**2          # elements live in one layer
        act = cb * per_layer
        flops = 2 * 12 * n_layers * h**2 * b * s + 4 * n_layers * b * s**2 * h
        if m.kind == "decoder" and m.vocab:
            act = act + cb * b * s * m.vocab                                  # logits
            flops = flops + 2 * b * s * m.vocab * h
        act = sympy.Max(sympy.expand(act), io_floor(recipe, sym))
        moved = weights + 2 * n_layers * act
        n_ops = m.n_ops or n_layers * (12 if fused else 24) + 4
        src = f"transformer estimate from model ({m.kind}, {n_layers} layers, hidden {h})"
        return ModelFacts(weights, act, sympy.expand(flops), sympy.expand(moved), n_ops,
                          source=src, notes=notes)

    if m and m.activation_mb_per_item:
        act = _mb(m.activation_mb_per_item) * b
        src = "per-item estimate from model.activation_mb_per_item"
    else:
        factor = sympy.Rational(str(m.activation_factor)) if m else 8
        act = sympy.Add(*[factor * n * max(cb, size) for n, size in _input_elems(recipe, sym)])
        act = sympy.ceiling(act) if not sympy.sympify(act).is_integer else act
        src = f"crude estimate: {factor} x input bytes (declare model.* or pass ModelFacts for better)"
    act = sympy.Max(sympy.expand(act), io_floor(recipe, sym))
    flops = int(round(m.gflops_per_item * 1e9)) * b if m and m.gflops_per_item else None
    moved = weights + 2 * act
    n_ops = (m.n_ops if m and m.n_ops else (m.layers * (2 if fused else 4) + 2 if m and m.layers else 64))
    if flops is None:
        notes.append("no FLOP count (model.gflops_per_item or a transformer model section): "
                     "latency cannot be predicted")
    return ModelFacts(weights, act, flops, sympy.expand(moved), n_ops, source=src, notes=notes)
