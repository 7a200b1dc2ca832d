"""canonicalize: remove no-op ops and merge view chains so later passes see one form.

Rules (rewrite engine, to a fixpoint; a rewritten node is matched again at once, so chains
collapse in one sweep):

- identity ops disappear: `identity`, `cast` to the same type, `reshape`/`expand` to the
  same shape, `permute` by the identity perm, `slice` with step 1 that keeps the whole dim;
  a reshape of a reshape, and a permute of a permute, that give the source back do too;
- `reshape(reshape(x))` -> `reshape(x)`;
- `permute(permute(x, p), q)` -> `permute(x, [p[i] for i in q])`;
- algebraic identities with an all-ones/all-zeros constant: x*1, 1*x, x+0, 0+x, x-0, x/1,
  only when the result has exactly x's type (so broadcasting or type promotion by the
  constant keeps the node), and only for `const` literals: a `param` that happens to be
  zero today (a freshly initialised bias) is data, not program structure.
- a product by a constant matrix is a `linear`, whatever way the model wrote it:
  `matmul(x, permute(W, [1, 0]))` (Falcon's `x @ self.weight.T`) -> `linear(x, W)`, and
  `matmul(x, W)` -> `linear(x, permute(W))` (constant_fold stores W^T); then
  `add(linear(x, W), b)` with a 1-d constant bias of the output's width -> `linear(x, W, b)`.
  Weight-only precision, linear merging, tensor-parallel sharding and the GEMM tactics all
  work on `linear`: a matmul by a weight was left f32 under `precision.weights: int8`.

"Same type" is `TensorType.matches` (dtype, symbolic dims and layout), so rules hold on
symbolic shapes. Nodes a rule leaves unused (the inner reshape of a chain) stay for `dce`.
Fused regions and fallback nodes are not looked into. A graph output keeps its name (the
engine renames the value that replaces it, or keeps the node: `kept_for_output`).
"""
from __future__ import annotations

from graphmode.ir.graph import Graph
from graphmode.ir.types import FLOAT_DTYPES, same_dims
from graphmode.passes.base import PassContext, PassResult, register_pass
from graphmode.passes.pattern import Match, Pat
from graphmode.passes.rewrite import Rewriter, Rule, RuleSet, rewrite_graph


def is_identity_perm(perm) -> bool:
    return list(perm) == list(range(len(perm)))


def _same_type_as_root(m: Match) -> bool:
    return m.type("x").matches(m.type("root"))


def _source(rw: Rewriter, m: Match) -> str:
    return m["x"]


def _perm(m: Match) -> list[int]:
    """The permutation from x to the root (through the inner permute when there is one)."""
    perm = list(m.root.attrs["perm"])
    inner = m.node("inner")
    return [inner.attrs["perm"][i] for i in perm] if inner is not None else perm


def _constant_all(value: float, zero_sign: bool | None = None):
    """The constant holds only `value`; a float zero also of sign `zero_sign` (True: -0.0): x + 0.0
    is not x where x is -0.0 (IEEE gives +0.0: 1/(x + 0.0) is +inf), x + (-0.0) and x - 0.0 are."""
    def check(m: Match) -> bool:
        t = m.const("c")
        if m.role("c") != "const" or t.numel() == 0 or not bool((t == value).all().item()):
            return False
        return zero_sign is None or not t.is_floating_point() or bool((t.signbit() == zero_sign).all().item())
    return check


def _noop(op: str, *, where=None, through: str | None = None) -> Pat:
    """`op(x)` (or `op(through(x))`) whose result has x's type and, with `where`, more."""
    src = Pat.either(Pat(through, Pat.var("x"), name="inner"), Pat.var("x")) if through else Pat.var("x")
    cond = _same_type_as_root if where is None else (lambda m: _same_type_as_root(m) and where(m))
    return Pat(op, src, name="root", where=cond)


def _chain(rw: Rewriter, m: Match) -> str:
    attrs = dict(m.root.attrs)
    if m.root.op == "permute":
        attrs["perm"] = _perm(m)
    return rw.add(m.root.op, [m["x"]], attrs)


def _algebra(op: str, value: float, commute: bool, zero_sign: bool | None = None) -> Rule:
    pat = Pat(op, Pat.var("x"), Pat.const("c", where=_constant_all(value, zero_sign)), commute=commute, name="root",
              where=_same_type_as_root)
    return Rule(f"{op}_{value}", pat, _source)


def _by_matrix(m: Match) -> bool:
    """x [.., in] times a 2-d constant of x's float dtype: what linear computes."""
    x, w = m.type("x"), m.type("w")
    return m.role("w") in ("param", "const") and w.rank == 2 and x.rank >= 2 and x.dtype == w.dtype and \
        x.dtype in FLOAT_DTYPES


def _linear_of_transposed(rw: Rewriter, m: Match) -> str:
    return rw.add("linear", [m["x"], m["w"]])


def _linear_of_matrix(rw: Rewriter, m: Match) -> str:
    wt = rw.add("permute", [m["w"]], {"perm": [1, 0]}, name=rw.fresh(f"{m['w']}_t"))
    return rw.add("linear", [m["x"], wt])


def _bias_of_width(m: Match) -> bool:
    lin, b = m.type("lin"), m.type("b")
    return len(m.node("lin").inputs) == 2 and b.rank == 1 and b.dtype == lin.dtype and \
        m.type("root").matches(lin) and same_dims(b.shape, lin.shape[-1:])


_TRANSPOSED = Pat("permute", Pat.const("w"), name="wt", where=lambda m: list(m.node("wt").attrs["perm"]) == [1, 0])

RULES = RuleSet([
    Rule("linear_of_transposed", Pat("matmul", Pat.var("x"), _TRANSPOSED, name="root", where=_by_matrix),
         _linear_of_transposed),
    Rule("linear_of_matrix", Pat("matmul", Pat.var("x"), Pat.const("w"), name="root", where=_by_matrix),
         _linear_of_matrix),
    Rule("linear_bias", Pat("add", Pat("linear", Pat.var("x"), Pat.var("w"), name="lin", single_use=True),
                            Pat.const("b"), commute=True, name="root", where=_bias_of_width),
         lambda rw, m: rw.add("linear", [m["x"], m["w"], m["b"]])),
    Rule("identity", Pat("identity", Pat.var("x")), _source),
    Rule("cast_noop", _noop("cast"), _source),
    Rule("reshape_noop", _noop("reshape", through="reshape"), _source),
    Rule("reshape_chain", Pat("reshape", Pat("reshape", Pat.var("x")), name="root"), _chain),
    Rule("permute_noop", _noop("permute", through="permute", where=lambda m: is_identity_perm(_perm(m))), _source),
    Rule("permute_chain", Pat("permute", Pat("permute", Pat.var("x"), name="inner"), name="root"), _chain),
    Rule("expand_noop", _noop("expand"), _source),
    Rule("slice_noop", _noop("slice", where=lambda m: m.root.attrs.get("step", 1) == 1), _source),
    _algebra("mul", 1, commute=True),
    _algebra("add", 0, commute=True, zero_sign=True),
    _algebra("sub", 0, commute=False, zero_sign=False),
    _algebra("div", 1, commute=False),
])


@register_pass("canonicalize")
def run(graph: Graph, ctx: PassContext) -> PassResult:
    g, stats = rewrite_graph(graph, RULES)
    return PassResult(g, g is not graph, stats)
