"""layout: remove transposes the core op set can absorb, and keep weights in the layout
the kernels want. Deliberately modest: every rule removes a `permute` or a copy, never adds
one, and stays inside the core op set.

Rules (rewrite engine, to a fixpoint):
- `matmul_to_linear`: matmul(a, permute(W, [1, 0])) with W a 2-d constant -> linear(a, W).
  `linear` reads W as [out, in], so the transpose disappears without copying W.
- `permute_cancel`: permute(p) -> a chain of elementwise ops -> permute(q), where the ops
  are unary or combine with rank-0 values (permutation-invariant) and every intermediate
  has one user: the chain runs on the unpermuted tensor and the two permutes compose into
  one (or none, when the composition is the identity). An empty chain is canonicalize's
  permute-chain rule, repeated here for the pairs the binary rule creates. The chain has
  no fixed length, so the rule walks it in code; the pattern only roots it.
- `permute_sink_binary`: binary(permute(a, p), permute(b, p)) with a, b of equal rank and
  single-use permutes -> permute(binary(a, b), p): two permutes become one (and may then
  cancel with a later one).
Target preferences (`ctx.target.kind`, recorded in stats): linear weights stay [out, in]
and contiguous (ATen's and our kernels' preferred form; a non-contiguous constant weight is
made contiguous, its values and digest unchanged); conv stays NCHW/OIHW, the only conv
layout of the core op set. `permute(k)` feeding a matmul of non-constants is kept: the core
op set has no transposed matmul.
"""
from __future__ import annotations

from graphmode.ir.graph import Graph
from graphmode.ir.ops import OPS, get_op
from graphmode.passes.base import PassContext, PassResult, register_pass
from graphmode.passes.canonicalize import is_identity_perm
from graphmode.passes.pattern import Match, Pat
from graphmode.passes.rewrite import Rewriter, Rule, RuleSet, rewrite_graph

BINARY_ELEMENTWISE = frozenset(name for name, spec in OPS.items() if spec.kind == "elementwise" and spec.arity == (2, 2))


def _to_linear(rw: Rewriter, m: Match) -> str | None:
    a, w = m.type("a"), m.type("w")
    if w.rank != 2 or a.dtype != w.dtype:
        return None
    if not get_op("linear").infer([a, w], {})[0].matches(m.type("root")):
        return None
    attrs = {k: v for k, v in m.root.attrs.items() if k in ("loc", "precision")}
    return rw.add("linear", [m["a"], m["w"]], attrs)


def _carrier(rw: Rewriter, n) -> int | None:
    """Index of the input that carries the (permuted) tensor through elementwise op `n`,
    when every other input is rank 0; None when `n` does not commute with a permute."""
    spec = OPS.get(n.op)
    if spec is None or spec.kind != "elementwise" or n.body is not None or len(n.outputs) != 1:
        return None
    ranked = [k for k, i in enumerate(n.inputs) if rw.type_of(i).rank != 0]
    return ranked[0] if len(ranked) == 1 else None


def _cancel(rw: Rewriter, m: Match) -> str | None:
    q = m.root
    chain = []                       # (node, carrier input index), from q upwards
    cur = m["src"]
    while True:
        p = rw.producer(cur)
        if p is None or not rw.single_use(cur):
            return None
        if p.op == "permute":
            break
        k = _carrier(rw, p)
        if k is None:
            return None
        chain.append((p, k))
        cur = p.inputs[k]
    composed = [p.attrs["perm"][i] for i in q.attrs["perm"]]
    rw.claim(p)
    src = p.inputs[0]
    for n, k in reversed(chain):     # each op now reads the unpermuted tensor (and keeps its name)
        rw.claim(n)
        ins = list(n.inputs)
        ins[k] = src
        src = rw.add(n.op, ins, n.attrs, name=n.outputs[0])
    if is_identity_perm(composed):
        return src
    return rw.add("permute", [src], {**q.attrs, "perm": composed})


def _sink(rw: Rewriter, m: Match) -> str | None:
    if m.type("a").rank != m.type("b").rank:
        return None
    out = m.root.outputs[0]
    inner = rw.add(m.root.op, [m["a"], m["b"]], m.root.attrs, name=rw.fresh(f"{out}_unpermuted"))
    return rw.add("permute", [inner], {"perm": list(m.node("pa").attrs["perm"])})


RULES = RuleSet([
    Rule("matmul_to_linear",
         Pat("matmul", Pat.var("a"), Pat("permute", Pat.const("w"), where=lambda m: m.node("wt").attrs["perm"] == [1, 0],
                                         name="wt"), name="root"),
         _to_linear),
    Rule("permute_cancel", Pat("permute", Pat.var("src")), _cancel),
    Rule("permute_sink_binary",
         Pat(BINARY_ELEMENTWISE, Pat("permute", Pat.var("a"), name="pa", single_use=True),
             Pat("permute", Pat.var("b"), name="pb", single_use=True), name="root",
             where=lambda m: list(m.node("pa").attrs["perm"]) == list(m.node("pb").attrs["perm"])),
         _sink),
])


def _target_prefs(g: Graph, ctx: PassContext, stats: dict) -> Graph:
    stats["target_kind"] = getattr(ctx.target, "kind", None)
    out = g.clone()
    producers = g.producers()
    contiguous = made = kept_perm = 0
    constants = out.constants
    for n in g.nodes:
        if n.op != "linear":
            continue
        w = n.inputs[1]
        if w in constants:
            t = constants[w]
            if not t.is_contiguous():
                constants[w] = t.contiguous()
                made += 1
            contiguous += 1
        elif w in producers and producers[w].op == "permute":
            kept_perm += 1
    if contiguous or made or kept_perm:
        stats["linear_weights_out_in_contiguous"] = contiguous
    if made:
        stats["linear_weights_made_contiguous"] = made
    if kept_perm:
        stats["linear_weights_permute_kept"] = kept_perm
    if any(n.op == "conv2d" for n in g.nodes):
        stats["conv_layout"] = "nchw"
    return out


@register_pass("layout")
def run(graph: Graph, ctx: PassContext) -> PassResult:
    g, stats = rewrite_graph(graph, RULES)
    changed = g is not graph
    producers = g.producers()
    kept = sum(1 for n in g.nodes if n.op == "matmul" and n.inputs[1] in producers
               and producers[n.inputs[1]].op == "permute")
    if kept:
        stats["matmul_permute_kept"] = kept
    out = _target_prefs(g, ctx, stats)
    changed = changed or any(out.constants[k] is not g.constants[k] for k in g.constants)
    return PassResult(out, changed, stats)
