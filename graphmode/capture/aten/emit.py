"""Emission helpers shared by the ATen converters: a core op emitted only where its inferred
type is torch.export's, dim ops on 0-d tensors, ATen-reference ops, repeated axes and heads."""
from __future__ import annotations

import operator

import torch
import torch.utils._pytree as pytree

from graphmode.errors import GraphmodeError
from graphmode.ir.graph import clean_name
from graphmode.ir.ops import OPS
from graphmode.ir.types import dims_equal


def axis(d, rank: int) -> int:
    """A dim argument as an index in [0, rank); a 0-d tensor takes dim 0 or -1 (as torch does)."""
    return int(d) % rank if rank else 0


def emit_on_rank1(imp, node, op: str, x: str, attrs: dict) -> None:
    """An op along a dim of a 0-d tensor, run on its [1] view and viewed back as 0-d (torch
    treats a 0-d tensor as one element along dim 0), so no later stage meets a dim op on rank 0."""
    xt = imp.g.type_of(x)
    x1, = imp.g.add_node("reshape", [x], [xt.with_shape((1,))], {"shape": [1]})
    out_t = imp.ttype(node.meta["val"])
    y1, = imp.g.add_node(op, [x1], [out_t.with_shape((1,))], attrs)
    imp.emit(node, "reshape", [y1], {"shape": []})


def aten_reference(imp, node: torch.fx.Node, op: str) -> bool:
    """An ATen-reference op (ir/ops/aten_ref.py) with the call's own arguments as attributes."""
    ins, args, kwargs = imp.encode_call(node)
    return emit_aten_reference(imp, node, op, ins, {"overload": node.target._overloadname, "args": args,
                                                    "kwargs": kwargs})


def emit_aten_reference(imp, node: torch.fx.Node, op: str, ins: list[str], attrs: dict) -> bool:
    """Emit ATen-reference op `op` for `node` once the types its inference derives match
    torch.export's (any difference, a symbolic size argument, or an inference that refuses
    keeps the op an eager island: False)."""
    if "$dim" in str((attrs["args"], attrs["kwargs"])):
        return False
    vals = [v for v in pytree.tree_leaves(node.meta["val"]) if isinstance(v, torch.Tensor)]
    want = [imp.ttype(v) for v in vals]
    try:
        got = OPS[op].infer([imp.g.type_of(i) for i in ins], attrs)
    except GraphmodeError:
        return False
    read = _read_outputs(node, len(want))
    if len(got) != len(want) or not all(g.dtype == w.dtype and len(g.shape) == len(w.shape)
                                        and all(dims_equal(x, y) for x, y in zip(g.shape, w.shape))
                                        for k, (g, w) in enumerate(zip(got, want)) if k in read):
        return False
    want = [w if k in read else g for k, (g, w) in enumerate(zip(got, want))]
    outs = imp.g.add_node(op, ins, want, attrs,
                          names=[clean_name(node.name if i == 0 else f"{node.name}_{i}") for i in range(len(want))])
    imp.env[node] = outs[0] if len(outs) == 1 and not isinstance(node.meta["val"], (tuple, list)) else tuple(outs)
    return True


def _read_outputs(node: torch.fx.Node, n: int) -> set[int]:
    """The outputs of a multi-output call the program reads: only their types must be torch.export's.
    An output nothing reads keeps the type inference gives it and is never written (an ATen call's
    extra results, such as embedding_bag's bag_size, whose fake and real sizes differ)."""
    if n == 1 or not isinstance(node.meta["val"], (tuple, list)):
        return set(range(n))
    if any(u.target is not operator.getitem for u in node.users):
        return set(range(n))
    return {u.args[1] for u in node.users}


def emit_checked(imp, node: torch.fx.Node, op: str, ins: list[str], attrs: dict | None = None) -> bool:
    """Emit core op `op` for `node` only where its inferred output type is torch.export's (dtype
    and shape): where the core op's type rules differ from the ATen call's, False keeps the call
    an eager island instead of a different answer."""
    want = imp.ttype(node.meta["val"])
    try:
        got, = OPS[op].infer([imp.g.type_of(i) for i in ins], attrs or {})
    except GraphmodeError:
        return False
    if got.dtype != want.dtype or len(got.shape) != len(want.shape) or \
            not all(dims_equal(x, y) for x, y in zip(got.shape, want.shape)):
        return False
    imp.emit(node, op, ins, attrs)
    return True


def repeat_axis(imp, x: str, dim: int, r: int, name: str | None = None) -> str:
    """Each slice along `dim` repeated r times in place: reshape [.., n, 1, ..], expand r, merge."""
    xt = imp.g.type_of(x)
    shape = list(xt.shape)
    wide = shape[:dim + 1] + [1] + shape[dim + 1:]
    y, = imp.g.add_node("reshape", [x], [xt.with_shape(wide)], {"shape": [imp.attr_dim(d) for d in wide]})
    wide[dim + 1] = r
    y, = imp.g.add_node("expand", [y], [xt.with_shape(wide)], {"shape": [imp.attr_dim(d) for d in wide]})
    shape[dim] = shape[dim] * r
    out, = imp.g.add_node("reshape", [y], [xt.with_shape(shape)], {"shape": [imp.attr_dim(d) for d in shape]},
                          names=[name] if name else None)
    return out


def repeat_heads(imp, kv: str, q_type) -> str | None:
    """Grouped-query attention: kv heads repeated to q's head count (axis -3)."""
    kt = imp.g.type_of(kv)
    hq, hk = q_type.shape[-3], kt.shape[-3]
    if not isinstance(hq, int) or not isinstance(hk, int) or hq % hk:
        return None
    return kv if hq == hk else repeat_axis(imp, kv, kt.rank - 3, hq // hk)
