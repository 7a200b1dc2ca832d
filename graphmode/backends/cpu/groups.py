"""A fused group at concrete shapes, as the code generators see it (no C here).

A plan runs each group on contiguous row-major buffers whose shapes are fixed per bucket.
These helpers give the group's values concrete types, split a gemm_epilogue group into its
GEMM and the ops after it, and say how a value broadcasts into a kernel's loop domain. Each
answers a question a claim check asks: what does not fit comes back as a refusal
(lowering.Claim), never as an exception.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import torch

from graphmode.backends.cpu.lowering import Claim, refused
from graphmode.errors import BackendError
from graphmode.ir.graph import Node
from graphmode.ir.ops import OPS, ops_with
from graphmode.ir.types import ITEMSIZE, TensorType, eval_dim, normalize_dim

GEMM_OPS = ops_with("gemm")                   # what may open a gemm_epilogue group
ROW_REDUCTIONS = ops_with("row_reduction")    # what makes a group a row kernel (rowwise.py says which it writes)


@dataclass
class Body:
    """A region to generate: nodes over named values with concrete types."""

    where: str
    inputs: list[str]                    # candidate argument inputs, in argument order
    outputs: list[str]
    nodes: list[Node]
    vt: dict[str, TensorType]
    known: dict[str, float | int | bool]  # numel-1 values with a known value (inlined)
    arrays: dict[str, torch.Tensor]       # body constants embedded as static arrays
    producers: dict[str, Node] = field(default_factory=dict)

    def __post_init__(self):
        self.producers = {o: n for n in self.nodes for o in n.outputs}


def group_where(node: Node) -> str:
    return f"fused group -> %{node.outputs[0]}" if node.outputs else "fused group"


def scalar_of(t: torch.Tensor):
    v = t.detach().reshape(-1)[0].item()
    return bool(v) if t.dtype == torch.bool else v


def gemm_epilogue_refusal(node: Node) -> Claim | None:
    """Why `node` is not a GEMM followed by non-GEMM ops (what `split_gemm_epilogue` needs)."""
    if node.body is None or not node.body.nodes:
        return refused("gemm_epilogue group has no body")
    first = node.body.nodes[0]
    if first.op not in GEMM_OPS:
        return refused(f"gemm_epilogue group starts with {first.op!r}, not one of {', '.join(sorted(GEMM_OPS))}",
                       fix="the fusion pass must put the GEMM first")
    for n in node.body.nodes[1:]:
        if n.op in GEMM_OPS:
            return refused(f"a second GEMM ({n.op}) in a gemm_epilogue group")
    return None


def split_gemm_epilogue(node: Node) -> tuple[Node, list[Node]]:
    """The GEMM that opens a gemm_epilogue group and the elementwise ops after it."""
    why = gemm_epilogue_refusal(node)
    if why is not None:
        raise BackendError(why.why, where=group_where(node), fix=why.fix or "the executor runs this group with "
                                                                            "the reference ops")
    return node.body.nodes[0], list(node.body.nodes[1:])


def concrete_types(node: Node, types: Mapping[str, TensorType]) -> dict[str, TensorType] | Claim:
    """Every value of the group's body at the concrete shapes `types` pins (inputs must be
    given or static; the rest by shape inference), or why not."""
    body = node.body
    vt: dict[str, TensorType] = {}
    for name in body.inputs:
        t = types.get(name) or body.values[name].type
        if not t.is_static:
            return refused(f"input %{name} has no concrete shape ({t.text()})", fix="pass `types` specialised "
                                                                                   "to the bucket")
        vt[name] = t
    for name, tensor in body.constants.items():
        vt[name] = TensorType.of(tensor)
    for n in body.nodes:
        if n.op == "fused" or n.body is not None:
            return refused("nested fused group", value=n.op)
        spec = OPS.get(n.op)
        if spec is None:
            return refused(f"unknown op {n.op!r}")
        missing = next((i for i in n.inputs if i not in vt), None)
        if missing is not None:
            return refused(f"op {n.op} reads undefined value %{missing}")
        try:
            inferred = spec.infer([vt[i] for i in n.inputs], n.attrs)
        except Exception as e:  # noqa: BLE001 - the op table's inference: an op the group cannot hold
            return refused(f"cannot infer the type of {n.op} -> %{n.outputs[0]}: {e}", value=n.op)
        for o, t in zip(n.outputs, inferred):
            given = types.get(o)
            dtype = given.dtype if given is not None else (
                body.values[o].type.dtype if o in body.values else t.dtype)
            if given is not None and given.is_static and tuple(given.shape) != tuple(t.shape):
                return refused(f"%{o} has shape {list(given.shape)} in `types` but {list(t.shape)} by inference",
                               fix="pass types of the same bucket for every value")
            vt[o] = TensorType(dtype, t.shape)
    for o in node.outputs:
        if o in types and o in vt:
            vt[o] = TensorType(types[o].dtype, vt[o].shape)
    return vt


def same_footprint(a: TensorType, b: TensorType) -> bool:
    """An output may take over an input's buffer only if shape and element size agree."""
    return tuple(a.shape) == tuple(b.shape) and ITEMSIZE[a.dtype] == ITEMSIZE[b.dtype]


def needed_nodes(body: Body, outs: Iterable[str]) -> list[Node]:
    need: set[str] = set()
    stack = list(outs)
    while stack:
        v = stack.pop()
        if v in need:
            continue
        need.add(v)
        n = body.producers.get(v)
        if n is not None:
            stack.extend(n.inputs)
    return [n for n in body.nodes if any(o in need for o in n.outputs)]


def needed_leaves(body: Body, outs: Iterable[str]) -> set[str]:
    leaves: set[str] = set()
    for n in needed_nodes(body, outs):
        leaves.update(i for i in n.inputs if i not in body.producers)
    leaves.update(o for o in outs if o not in body.producers)
    return leaves


def shape_of(t: TensorType) -> tuple[int, ...]:
    return tuple(int(d) for d in t.shape)


def numel(t: TensorType) -> int:
    return math.prod(shape_of(t))


def padded(shape: Sequence[int], domain: Sequence[int], space: str) -> tuple[int, ...] | None:
    """`shape` aligned with a kernel's loop `domain`: from the right ("row" space), or, for a
    value reduced away along the last dim with keepdim=False ("l" space), with the leading
    dims and a unit last dim. None when it has more dims than that."""
    shape, r = tuple(shape), len(domain)
    if space == "l":
        if len(shape) > r - 1:
            return None
        return (1,) * (r - 1 - len(shape)) + shape + (1,)
    if len(shape) > r:
        return None
    return (1,) * (r - len(shape)) + shape


def broadcast_strides(pshape: Sequence[int], domain: Sequence[int]) -> tuple[int, ...] | None:
    """Element strides of a value of padded shape `pshape` over `domain` (0 on broadcast
    dims), or None when it does not broadcast to the domain."""
    out = [0] * len(pshape)
    acc = 1
    for d in range(len(pshape) - 1, -1, -1):
        if pshape[d] == domain[d]:
            out[d] = acc if pshape[d] != 1 else 0
        elif pshape[d] != 1:
            return None
        acc *= pshape[d]
    return tuple(out)


def fit_refusal(name: str, shape: Sequence[int], domain: Sequence[int], space: str, *,
                broadcast: bool = True) -> Claim | None:
    """Why value `name` of `shape` cannot be read over `domain` in `space` (`broadcast`:
    also as an array, not only as a scalar)."""
    p = padded(shape, domain, space)
    if p is None:
        if space == "l":
            return refused(f"%{name} ({list(shape)}) is combined with a value reduced over the last dim",
                           fix="use keepdim=True for the reduction")
        return refused(f"%{name} ({list(shape)}) is larger than the kernel domain {list(domain)}")
    if broadcast and broadcast_strides(p, domain) is None:
        return refused(f"%{name} ({list(p)}) does not broadcast to {list(domain)}")
    return None


def specialize(node, env: Mapping[str, int]):
    """The fused node with every symbolic dim (attributes and body types) evaluated at `env`."""
    body = node.body.clone()
    body.values = {k: v.__class__(k, v.type.specialize(env), v.role) for k, v in body.values.items()}
    nodes = []
    for m in body.nodes:
        attrs = dict(m.attrs)
        if "shape" in attrs and isinstance(attrs["shape"], list):
            attrs["shape"] = [eval_dim(normalize_dim(d), env) if isinstance(d, str) else d for d in attrs["shape"]]
        if isinstance(attrs.get("end"), str):
            attrs["end"] = eval_dim(normalize_dim(attrs["end"]), env)
        nodes.append(m.with_(attrs=attrs))
    body.nodes = nodes
    _fold_reshape_after_linear(body)
    return node.with_(body=body)


def _fold_reshape_after_linear(body) -> None:
    """linear -> reshape(only the leading dims) becomes a linear on a re-viewed input: the
    bytes are the same, and the epilogue then sees one elementwise shape (GPT-2's MLP)."""
    first = body.nodes[0] if body.nodes else None
    if first is None or first.op != "linear":
        return
    g_out, x = first.outputs[0], first.inputs[0]
    users = [m for m in body.nodes if g_out in m.inputs]
    if len(users) != 1 or users[0].op != "reshape" or g_out in body.outputs:
        return
    if any(x in m.inputs for m in body.nodes[1:]):
        return
    r = users[0]
    r_out = r.outputs[0]
    rshape = body.values[r_out].type.shape
    n = body.values[g_out].type.shape[-1]
    k = body.values[x].type.shape[-1]
    if rshape[-1] != n or r_out in body.outputs:
        return
    body.values[x] = body.values[x].__class__(x, body.values[x].type.with_shape(tuple(rshape[:-1]) + (k,)),
                                              body.values[x].role)
    body.values[g_out] = body.values[g_out].__class__(g_out, body.values[r_out].type, body.values[g_out].role)
    del body.values[r_out]
    body.nodes = [m.with_(inputs=tuple(g_out if i == r_out else i for i in m.inputs))
                  for m in body.nodes if m is not r]


__all__ = ["specialize", "Body", "GEMM_OPS", "ROW_REDUCTIONS", "group_where", "scalar_of", "gemm_epilogue_refusal",
           "split_gemm_epilogue", "concrete_types", "same_footprint", "needed_nodes", "needed_leaves", "padded",
           "broadcast_strides", "fit_refusal", "shape_of", "numel"]
