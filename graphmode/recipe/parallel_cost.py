"""What communication costs: bytes each collective moves and the time a link takes for them.

Ring collectives over n ranks joined by a link of bandwidth B (bytes/s) and latency L (s),
for a tensor of `nbytes` bytes on the wire (the full tensor: the all_reduce's operand, the
all_gather's result, the reduce_scatter's operand):

    all_reduce       2 (n-1)/n * nbytes / B + 2 (n-1) L     (reduce-scatter, then all-gather)
    all_gather       (n-1)/n * nbytes / B + (n-1) L
    reduce_scatter   (n-1)/n * nbytes / B + (n-1) L
    all_reduce bf16, int8   (n-1) * nbytes / B + (n-1) L    (every rank gathers the packed operands)

Wire bytes follow `parallel.comm.dtype`: f32 4 bytes an element, bf16 2, int8 1 plus one f32
scale per row (the last axis). The recipe's constraint layer and the `shard` pass both read
these formulas, so the proof and the compiled plan count the same traffic.
No torch here: the recipe layer imports this module.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Union

import sympy

from graphmode.recipe.limits import DTYPE_SIZES

Expr = Union[sympy.Expr, int]
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
WIRE_BYTES = {"f32": 4, "bf16": 2, "int8": 1}


@dataclass(frozen=True)
class Collective:
    """One collective of a step: `elems` elements of the full tensor (rows of `row` elements)."""
    op: str
    elems: Expr
    row: int = 1
    count: int = 1
    what: str = ""

    def wire_bytes(self, comm_dtype: str) -> Expr:
        if comm_dtype == "int8":
            return self.elems + 4 * self.elems / max(self.row, 1)
        return WIRE_BYTES[comm_dtype] * self.elems


def seconds(op: str, nbytes: Expr, n: int, bandwidth_Bps: Any, latency_s: Any, comm_dtype: str = "f32") -> Expr:
    """Time one collective takes on a ring of `n` ranks (module doc)."""
    if n <= 1:
        return sympy.Integer(0)
    bw, lat = sympy.nsimplify(bandwidth_Bps), sympy.nsimplify(latency_s)
    if op == "all_reduce" and comm_dtype != "f32":
        return (n - 1) * nbytes / bw + (n - 1) * lat
    if op == "all_reduce":
        return sympy.Rational(2 * (n - 1), n) * nbytes / bw + 2 * (n - 1) * lat
    return sympy.Rational(n - 1, n) * nbytes / bw + (n - 1) * lat


@dataclass(frozen=True)
class CommTerm:
    """A collective of the step priced on the group's link."""
    collective: Collective
    link: str
    bandwidth_gbps: float
    latency_us: float
    nbytes: Expr            # wire bytes of one
    seconds: Expr           # of all `count` of them

    def describe(self, at: dict[str, int] | None = None) -> str:
        from graphmode.recipe.smt import evaluate
        b = float(evaluate(self.nbytes, at)) if at is not None else None
        c = self.collective
        size = f"{b / 1e6:.3f} MB" if b is not None else str(self.nbytes)
        return (f"{c.op} of {size}{f' x {c.count}' if c.count > 1 else ''} per step ({c.what}) over link "
                f"{self.link} ({self.bandwidth_gbps:g} GB/s, {self.latency_us:g} us)")


def price(collectives: list[Collective], spec: Any) -> list[CommTerm]:
    """Each collective on the group's slowest link (`ParallelSpec.link_for`), per step."""
    if spec is None or spec.tensor <= 1 or not collectives:
        return []
    name, link = spec.link_for()
    bw, lat = float(link.bandwidth_gbps), float(link.latency_us)
    out = []
    for c in collectives:
        nb = sympy.sympify(c.wire_bytes(spec.comm.dtype))
        s = c.count * seconds(c.op, nb, spec.tensor, sympy.nsimplify(bw) * 10**9, sympy.nsimplify(lat) / 10**6,
                              spec.comm.dtype)
        out.append(CommTerm(c, name, bw, lat, nb, sympy.sympify(s)))
    return out


# ---- the estimate from the recipe's `model` section (no compiled graph) ---------------------

def estimate_collectives(recipe: Any, sym: dict[str, sympy.Symbol]) -> list[Collective]:
    """The collectives a step of the model would run under `recipe.parallel`, from the model
    section (transformers: one all_reduce per split attention block and per split MLP, the
    vocab-parallel embedding's all_reduce and the LM head's all_gather; batch: the outputs'
    all_gather). The compiler replaces these by the sharded graph's own collectives."""
    p, m = recipe.parallel, recipe.model
    if p is None or p.tensor <= 1:
        return []
    b = sym.get(m.batch_dim if m else "batch", 1)
    if p.split() == "batch":
        outs = [_elems(axes, sym) for axes in recipe.outputs.values()] or [_elems(i.shape, sym) for i in recipe.inputs]
        return [Collective("all_gather", e, count=1, what=f"output {n} by batch")
                for n, e in zip(list(recipe.outputs) or [i.name for i in recipe.inputs], outs)]
    if not (m and m.hidden and m.layers and m.seq_dim in sym):
        return []
    s, h = sym[m.seq_dim], m.hidden
    out: list[Collective] = []
    for cls, what in (("attention", "attention output"), ("mlp", "MLP output")):
        if p.strategy[cls] == "head":
            out.append(Collective("all_reduce", b * s * h, h, m.layers, f"{what}, one per layer"))
    if p.strategy["embedding"] == "head" and m.vocab:
        out.append(Collective("all_reduce", b * s * h, h, 1, "vocab-parallel embedding"))
        if m.kind == "decoder":                  # gathered padded: ceil(vocab / tensor) columns a rank
            padded = padded_vocab(m.vocab, p.tensor)
            out.append(Collective("all_gather", b * s * padded, padded, 1, "vocab-parallel LM head logits"))
    return out


def padded_vocab(vocab: int, n: int) -> int:
    """The vocabulary the `shard` pass splits: padded up to a multiple of the `n` ranks."""
    return -(-vocab // n) * n


def _elems(axes: list, sym: dict[str, sympy.Symbol]) -> Expr:
    n: Expr = 1
    for e in axes:
        n = n * (e if isinstance(e, int) else sym.get(e, 1))
    return n


def shard_estimate(facts: Any, recipe: Any, sym: dict[str, sympy.Symbol]) -> Any:
    """One rank's share of whole-model estimated facts (`recipe.facts.ModelFacts`): batch splits
    activations and FLOPs, head splits the weights of the split classes (attention 4h^2,
    MLP 2h*intermediate, embedding vocab*h per the model section, a rank holding ceil(vocab / n)
    rows of it) while the residual stream stays whole on every rank."""
    p, m = recipe.parallel, recipe.model
    n = p.tensor
    cb = DTYPE_SIZES[recipe.precision.compute]
    if p.split() == "replicate":
        return facts
    flops = facts.flops / n if facts.flops is not None else None
    if p.split() == "batch":
        act = facts.activation_bytes / n
        return replace(facts, activation_bytes=act, flops=flops, sharded=True,
                       bytes_moved=facts.weights_bytes + (facts.bytes_moved - facts.weights_bytes) / n
                       if facts.bytes_moved is not None else None,
                       source=facts.source + f"; batch split over {n} ranks")
    w = facts.weights_bytes
    if m and m.hidden and m.layers:
        h, inter = m.hidden, m.intermediate or 4 * m.hidden
        split = vocab = 0
        if p.strategy["attention"] == "head":
            split += 4 * h * h * m.layers * cb
        if p.strategy["mlp"] == "head":
            split += 2 * h * inter * m.layers * cb
        if p.strategy["embedding"] == "head" and m.vocab:
            vocab = min(m.vocab * h * cb, w)
        split = min(split, w - vocab)
        w = w - split - vocab + -(-split // n) + (padded_vocab(m.vocab, n) // n * h * cb if vocab else 0)
    b = sym.get(m.batch_dim if m else "batch", 1)
    s = sym.get(m.seq_dim, 1) if m else 1
    resid = b * s * (m.hidden if m and m.hidden else 0) * cb
    act = facts.activation_bytes / n + resid
    moved = (w + (facts.bytes_moved - facts.weights_bytes) / n) if facts.bytes_moved is not None else None
    return replace(facts, weights_bytes=int(w), activation_bytes=act, flops=flops, bytes_moved=moved,
                   sharded=True, source=facts.source + f"; head split over {n} ranks",
                   prepared_from_bytes=None)       # (every weight of the shard, as estimated)
