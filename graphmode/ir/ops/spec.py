"""The op database's record type, registry and the shape/dtype helpers every op family uses.

One `OpSpec` holds everything graphmode knows about an op that is not backend code: type
inference, reference semantics (eager PyTorch, the numeric oracle), the ATen overloads the
torch importer maps onto it, traits that passes and planners query instead of keeping their
own op lists, and sample inputs for the OpInfo-style test that runs every op through every
path (interpreter, CPU executor, generated kernels, ONNX round trip).
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from graphmode.errors import IRError
from graphmode.ir.types import DTYPES, TORCH_TO_DTYPE, Dim, TensorType, dims_equal, eval_dim, normalize_dim

Env = Mapping[str, int]
InferFn = Callable[[list[TensorType], Mapping[str, Any]], list[TensorType]]
RefFn = Callable[[list[torch.Tensor], Mapping[str, Any], Env], list[torch.Tensor]]

# What an op is, for the passes, planners and analyses that ask (instead of keeping lists):
TRAITS = {
    "elementwise": "one output element from the same-index elements of the (broadcast) inputs",
    "commutative": "the two inputs can be swapped (CSE canonicalises their order)",
    "row_reduction": "reduces or normalises along trailing axes (fusable as a row kernel)",
    "gemm": "a contraction lowered to GEMM (linear, matmul, conv); may take an epilogue",
    "epilogue_safe": "elementwise and cheap enough to apply in a GEMM's store",
    "precision_sensitive": "loses accuracy first under reduced precision (first fp32-override candidate)",
    "compute_dtype": "does its arithmetic in the recipe's compute dtype (the precision pass casts its float inputs); "
                     "ops without it move data and keep the dtype they receive",
    "keep_f32": "stays in f32 when the tuner tries reduced compute precision (its candidate's per-op overrides)",
    "view": "output re-interprets input 0's bytes",
    "inplace": "output may reuse input 0's buffer (same shape and dtype)",
    "index_dependent": "reads positions chosen by data or by position (gathers, scans, pads, rolls)",
    "side_effect": "writes a `state` input in place (a KV cache): never removed, merged or reordered",
    "collective": "exchanges data with the other ranks of a tensor-parallel group: never folded, and every rank "
                  "runs the same collectives in the same order",
    "aten_reference": "runs as the ATen op it is named after; capture checks its types against torch.export's",
}
# op kinds whose ops do arithmetic (the `compute_dtype` trait); the others move data
COMPUTE_KINDS = frozenset({"elementwise", "reduction", "norm", "gemm", "conv", "pool", "attention"})

# How the padding analysis (graphmode/analysis/padding.py) follows padded positions through an
# op; every op names one (`OpSpec.padding`), `opaque` when it does not model the op's reads:
PADDING_RULES = {
    "pointwise": "each output position reads the same position of its (broadcast) inputs",
    "reduce": "reduces over `dims`: safe over a padded dim whose padding is the op's identity (0 for sum, "
              "masked for amax)",
    "along": "softmax / log_softmax / cumsum along `dim`: safe over masked logits (softmax) or padding at "
             "the end (scan)",
    "argreduce": "argmax / argmin along `dim`: safe when a padded position can never win",
    "norm": "normalises over its trailing axes (layer_norm) or channels (batch_norm): a padded one is unsafe",
    "linear": "contracts the last axis with a weight: safe when the padded positions are zero",
    "matmul": "contracts a[-1] with b[-2]: safe when either side's padded positions are zero",
    "einsum": "letters kept in the output pass their padding through; a letter summed over is safe when an "
              "operand's padded positions are zero",
    "attention": "attention: padded keys must be masked (a mask input, or causal with padding at the end)",
    "window": "convolution / pooling: samples (axis 0) independent, a window over every other axis",
    "reshape": "follows padded factors through merged axes; a split of a padded axis is unsafe",
    "permute": "moves axes (and the padding with them)",
    "expand": "broadcasts new axes, keeping the padded ones",
    "slice": "keeps padding at the end; a slice that can read padding is unsafe",
    "concat": "padding along the concat axis lands in the middle (not sliceable); other axes kept",
    "shift": "pad / roll move positions: along a padded axis, unsafe",
    "triangle": "triu / tril keep or zero positions by index (a causal mask's padded columns are known)",
    "gather": "reads positions chosen by an index: safe where the index reads real positions only",
    "full": "a constant made with (possibly padded) extents",
    "arange": "an index along a padded extent (its padded positions are past the real end)",
    "island": "an eager fallback: pointwise or per-dim ATen ops from their tags and schema, else opaque",
    "aten": "an ATen-reference op of a static kind: read as an island calling the same ATen op would be",
    "region": "a fused region: analysed through its body",
    "opaque": "not modelled: any padded dim reaching the op is reported unsafe",
}
# The padded content that leaves a reduction over padded positions unchanged (`OpSpec.pad_identity`):
PAD_IDENTITIES = {
    "zero": "zeros (a sum)",
    "masked": "masked values, at or below -1e4 (a max, a softmax's logits, argmax)",
    "one": "ones (a product)",
}


@dataclass(frozen=True)
class Sample:
    """One sample call: input tensors (made on demand, seeded) and attributes."""
    make: Callable[[torch.Generator], list[torch.Tensor]]
    attrs: Mapping[str, Any] = field(default_factory=dict)
    note: str = ""


@dataclass(frozen=True)
class OpSpec:
    name: str
    kind: str                      # elementwise | reduction | norm | gemm | conv | pool | attention | shape | data | collective | fused | fallback
    arity: tuple[int, int]         # min, max number of inputs
    infer: InferFn
    ref: RefFn
    attrs: tuple[str, ...] = ()    # attribute names the op understands
    inplace: bool = False          # output may reuse input 0's buffer (same shape/dtype)
    view: bool = False             # output is a re-interpretation of input 0's bytes (reshape)
    doc: str = ""
    flops_per_elem: float = 1.0    # elementwise cost, per output element
    traits: frozenset[str] = frozenset()
    aten: tuple[str, ...] = ()     # ATen overloads captured 1:1 (arguments normalised by the op schema)
    samples: Callable[[], list[Sample]] | None = None
    padding: str | None = None     # its padding rule (PADDING_RULES); None: undeclared, analysed as opaque
    # what the padding analysis reads about the op's values (analysis/padding_rules/):
    pad_identity: str | None = None   # PAD_IDENTITIES: padding that leaves a reduction over it unchanged
    at_masked: float | None = None    # its value at a masked (hugely negative) input (-inf: still masked)
    value_floor: float | None = None  # no output is below this (kept through argmax over padding)
    pad_why: str = ""                 # why padding what it reduces changes it, beyond a missing pad_identity
    # (attrs, input types) -> its eager equivalent as a fallback node's (target, args, kwargs): ir/ops/aten_calls.py
    aten_call: Callable[[Mapping[str, Any], Sequence[TensorType]], tuple[str, list, dict]] | None = None

    def has(self, trait: str) -> bool:
        return trait in self.traits


OPS: dict[str, OpSpec] = {}


def register(spec: OpSpec) -> OpSpec:
    unknown = set(spec.traits) - set(TRAITS)
    if unknown:
        raise IRError(f"op {spec.name!r} declares unknown traits {sorted(unknown)}", fix=f"one of {sorted(TRAITS)}")
    if spec.padding is not None and spec.padding not in PADDING_RULES:
        raise IRError(f"op {spec.name!r} declares unknown padding rule {spec.padding!r}",
                      fix=f"one of {sorted(PADDING_RULES)}")
    if spec.pad_identity is not None and spec.pad_identity not in PAD_IDENTITIES:
        raise IRError(f"op {spec.name!r} declares unknown pad_identity {spec.pad_identity!r}",
                      fix=f"one of {sorted(PAD_IDENTITIES)}")
    traits = set(spec.traits)
    if spec.inplace:
        traits.add("inplace")
    if spec.view:
        traits.add("view")
    if spec.kind == "elementwise":
        traits.add("elementwise")
    if spec.kind in COMPUTE_KINDS:
        traits.add("compute_dtype")
    object.__setattr__(spec, "traits", frozenset(traits))
    OPS[spec.name] = spec
    return spec


def get_op(name: str) -> OpSpec:
    spec = OPS.get(name)
    if spec is None:
        near = difflib.get_close_matches(name, OPS, n=3)
        raise IRError(f"unknown op {name!r}", fix=f"did you mean {', '.join(near)}?" if near else
                      "see docs/ops.md for the core op set")
    return spec


def ops_with(trait: str) -> frozenset[str]:
    """Names of the ops that declare `trait` (the one source of op-class lists)."""
    if trait not in TRAITS:
        raise IRError(f"unknown trait {trait!r}", fix=f"one of {sorted(TRAITS)}")
    return frozenset(n for n, s in OPS.items() if trait in s.traits)


def aten_table() -> dict[str, str]:
    """ATen overload -> core op, for ops captured one-to-one."""
    return {a: name for name, s in OPS.items() for a in s.aten}


# ---------------------------------------------------------------------------------- helpers

def eval_shape(shape: Sequence, env: Env) -> list[int]:
    return [eval_dim(normalize_dim(d), env) for d in shape]


def broadcast_shapes(*shapes: Sequence[Dim]) -> tuple[Dim, ...]:
    rank = max(len(s) for s in shapes)
    out: list[Dim] = []
    for i in range(rank):
        cur: Dim = 1
        for s in shapes:
            j = i - (rank - len(s))
            if j < 0:
                continue
            d = s[j]
            if isinstance(d, int) and d == 1:
                continue
            if isinstance(cur, int) and cur == 1:
                cur = d
            elif not dims_equal(cur, d):
                raise _no_broadcast(shapes, i, cur, d)
        out.append(cur)
    return tuple(out)


def _no_broadcast(shapes: Sequence[Sequence[Dim]], i: int, a: Dim, b: Dim) -> IRError:
    what = f"shapes {[list(map(str, s)) for s in shapes]} do not broadcast at dim {i}"
    if isinstance(a, int) or isinstance(b, int):
        return IRError(what, fix="insert an explicit expand/reshape")
    err = IRError(f"{what}: sizes {a} and {b} meet here, and graphmode cannot know they are equal (every recipe "
                   "dim varies on its own, and a size made of two dims, such as a mask over a KV cache's past + "
                   "seq, cannot be a recipe dim)",
                   fix="where the two axes always have the same size, give them one dim name in the recipe's "
                       "inputs; where one is a sum of dims (past + seq), make those dims static (min = max) or "
                       "export the model without the cache inputs")
    err.meeting = (str(a), str(b))       # a draft ties the two axes into one dim (kb/onnx_axes.tied)
    return err


def result_dtype(types: list[TensorType]) -> str:
    """torch's type promotion, where 0-d tensors act like scalars (same category rules)."""
    tensors = [torch.empty((1,) * t.rank if t.rank else (), dtype=DTYPES[t.dtype], device="meta") for t in types]
    dt = tensors[0]
    for t in tensors[1:]:
        dt = torch.empty((1,) * max(dt.dim(), t.dim()) if (dt.dim() or t.dim()) else (),
                         dtype=torch.result_type(dt, t), device="meta")
    return TORCH_TO_DTYPE[dt.dtype]


_result_dtype = result_dtype      # the name older modules import


def norm_axis(axis: int, rank: int) -> int:
    a = axis + rank if axis < 0 else axis
    if not 0 <= a < max(rank, 1):
        raise IRError(f"axis {axis} out of range for rank {rank}")
    return a


def pair(v, n: int = 2) -> list:
    """An int or a sequence as an n-list (kernel sizes, strides, paddings)."""
    return list(v) if isinstance(v, (list, tuple)) else [v] * n


def same(ins, attrs):
    return [ins[0]]


def randn(*shapes: Sequence[int]) -> Callable[[torch.Generator], list[torch.Tensor]]:
    """Sample maker: float tensors of the given shapes."""
    return lambda g: [torch.randn(*s, generator=g) for s in shapes]
