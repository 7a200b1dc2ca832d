"""The lowering registry: every op instance is claimed or refused explicitly (with a reason)
before anything is generated, and what a claim check lets through always generates."""
from __future__ import annotations

import itertools

import pytest
import torch

from graphmode.backends.cpu import catalog, pool
from graphmode.backends.cpu.cexpr import CTYPE, ELEMENTWISE_OPS, CValue, op_expr, op_refusal
from graphmode.backends.cpu.codegen import claim_group, generate
from graphmode.backends.cpu.lowering import ATEN, GENERATED, NATIVE, OpCall, claim, lowers, ops_in
from graphmode.errors import BackendError
from graphmode.ir import parse_graph
from graphmode.ir.graph import Node
from graphmode.ir.types import TensorType


def _group(text: str):
    g = parse_graph(text)
    return g.nodes[0], {k: v.type for k, v in g.values.items()}


def test_every_tier_has_its_lowerings():
    assert {"max_pool2d", "avg_pool2d", "adaptive_avg_pool2d", "permute", "slice", "index", "cast",
            "logical_and", "logical_or", "arange", "sdpa"} <= ops_in(NATIVE)
    assert {"linear", "matmul", "conv2d", "add", "relu", "softmax", "gelu", "embedding"} <= ops_in(ATEN)
    assert ops_in(GENERATED) == {"fused"}
    with pytest.raises(BackendError, match="unknown lowering tier 'gpu'"):
        lowers("relu", tier="gpu")


def test_a_refused_group_says_why_without_raising():
    node, types = _group("""graph @g(%x: f32[4,8]) -> (%y) {
  %y: f32[4,8] = fused(%x) {"kind": "reduction"} {
    %y: f32[4,8] = softmax(%x) {"dim": 0}
  }
  return %y
}""")
    c = claim_group(node, types)
    assert not c and c.make is None and "not over the last dim" in c.why and c.value == "softmax"
    low, c2 = catalog.claim_fused(node, types, {})
    assert low is None and c2.why == c.why
    with pytest.raises(BackendError, match="not over the last dim"):     # the same reason, as an error
        generate(node, types)


def test_a_claimed_group_generates_what_generate_returns():
    node, types = _group("""graph @g(%x: f32[4,8], %b: f32[8]) -> (%y) {
  %y: f32[4,8] = fused(%x, %b) {"kind": "elementwise"} {
    %a: f32[4,8] = add(%x, %b)
    %y: f32[4,8] = gelu(%a)
  }
  return %y
}""")
    c = claim_group(node, types)
    assert c and c.make().source == generate(node, types).source


def test_a_value_that_does_not_fit_the_row_domain_is_refused():
    node, types = _group("""graph @g(%x: f32[4,8], %z: f32[4,4]) -> (%y) {
  %y: f32[4,4] = fused(%x, %z) {"kind": "reduction"} {
    %r: f32[4] = amax(%x) {"dims": [-1], "keepdim": false}
    %y: f32[4,4] = add(%r, %z)
  }
  return %y
}""")
    c = claim_group(node, types)
    assert not c and "%y ([4, 4]) is combined with a value reduced over the last dim" in c.why
    assert c.fix == "use keepdim=True for the reduction"


def test_native_claims_refuse_with_reasons():
    x = torch.randn(1, 2, 8, 8)
    attrs = {"kernel": [2, 2], "stride": [2, 2]}
    low, c = catalog.claim_native(OpCall("max_pool2d", [x], [torch.empty(1, 2, 4, 4)], attrs, {}, ["x"], ["y"]))
    assert c and low.claim is pool.max_pool2d and low.tier == NATIVE
    _low, c = catalog.claim_native(OpCall("max_pool2d", [x.double()], [torch.empty(1, 2, 4, 4).double()], attrs, {},
                                          ["x"], ["y"]))
    assert not c and "float64" in c.why
    _low, c = catalog.claim_native(OpCall("permute", [x.transpose(2, 3)], [torch.empty(1, 2, 8, 8)],
                                          {"perm": [0, 1, 3, 2]}, {}, ["x"], ["y"]))
    assert not c and "contiguous" in c.why
    _low, c = catalog.claim_native(OpCall("exp", [x], [torch.empty_like(x)], {}, {}, ["x"], ["y"]))
    assert not c and "no native lowering for exp" in c.why


def test_an_op_aten_refuses_runs_with_the_reference_op():
    a, b = torch.randn(4, 8), torch.randn(4, 8)
    y = torch.empty(4, 8, dtype=torch.float64)       # ATen's out= would cast: refused, reference runs it
    _low, c = claim(ATEN, "add", OpCall("add", [a, b], [y], {}, {}))
    assert not c and "cast" in c.why
    catalog.op_step(OpCall("add", [a, b], [y], {}, {}))()
    assert torch.equal(y, (a + b).double())
    z = torch.empty(4, 8)
    catalog.op_step(OpCall("add", [a, b], [z], {}, {}))()   # claimed: torch.add(out=z)
    assert torch.equal(z, a + b)


DTYPES = sorted(CTYPE)


@pytest.mark.parametrize("op", sorted(ELEMENTWISE_OPS))
def test_op_refusal_is_exactly_what_op_expr_cannot_write(op):
    """The claim check and the generator agree for every op and dtype: an expression where
    op_refusal says nothing, an internal error (never reached by claimed groups) where it
    refuses."""
    arity = 3 if op == "where" else 2 if op in ("add", "sub", "mul", "div", "pow", "maximum", "minimum", "eq",
                                                 "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or") else 1
    attrs = {"min": 0.5, "max": 2.0} if op == "clamp" else {}
    for ins_dt, out_dt in itertools.product(DTYPES, DTYPES):
        n = Node(op, tuple(f"i{k}" for k in range(arity)), ("y",), attrs)
        ins = [CValue(f"i{k}", ins_dt, TensorType(ins_dt, (4,))) for k in range(arity)]
        why = op_refusal(n, [i.ttype for i in ins], out_dt)
        if why is None:
            assert isinstance(op_expr(n, ins, out_dt, "test"), str)
        else:
            with pytest.raises(BackendError, match="internal"):
                op_expr(n, ins, out_dt, "test")


@pytest.mark.parametrize("k,n", [(0, 4), (3, 0)])
def test_aten_linear_with_an_empty_inner_or_output_dim(k, n):
    """An empty k or n: the GEMM's 2-d views give the row count (view(-1, 0) is ambiguous)."""
    from graphmode.backends.cpu.aten import gemm_closure
    x, w, b = torch.randn(2, 5, k), torch.randn(n, k), torch.randn(n)
    y = torch.empty(2, 5, n)
    gemm_closure("linear", [x, w, b], y)()
    assert torch.equal(y, torch.nn.functional.linear(x, w, b))


def test_aten_matmul_into_a_slot_whose_unit_axes_differ_is_not_resized():
    """Mamba at batch 1: a [128, 8] x [1, 8, 1] product into a [128, 1] slot made torch resize
    `out` (deprecated: a later torch refuses it, or writes elsewhere than the arena)."""
    import warnings
    from graphmode.backends.cpu.aten import gemm_closure
    x, w, y = torch.randn(128, 8), torch.randn(1, 8, 1), torch.empty(128, 1)
    ptr = y.data_ptr()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gemm_closure("matmul", [x, w], y)()
    assert y.shape == (128, 1) and y.data_ptr() == ptr and torch.equal(y, torch.matmul(x, w).view(128, 1))
