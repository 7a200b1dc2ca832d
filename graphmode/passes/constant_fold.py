"""constant_fold: compute at compile time what does not depend on the inputs.

- A node whose inputs are all constants (including zero-input `full`/`arange`) is run once
  through its op's `ref` and becomes a constant. Only nodes with static output shapes fold
  (symbolic `full`/`arange`/`slice` need the bucket's dims), and results over `max_bytes`
  (default 64 MiB) stay nodes so the weight file does not balloon. Fused, fallback and
  graph-output nodes are left alone.
- Naming: a folded value keeps its node's output name, so no use is renamed and the graph
  hash is stable across runs. Role: `param` when any input was a `param` (weight-derived,
  e.g. a pre-transposed weight, still belongs with the weights), else `const`.
- Weight pre-transposition is the `permute`-of-a-constant case of the above (GPT-2's Conv1D
  weights, addmm's W^T): the folded constant is contiguous in the permuted order.
- Batch-norm folding: `conv2d(x, W, b?) -> batch_norm(., g, beta, mean, var, eps)` becomes
  `conv2d(x, W', b')` with s = g / sqrt(var + eps), W' = W * s (per out channel),
  b' = (b - mean) * s + beta, computed in f64 then cast back. Same for a rank-2 `linear`
  (batch_norm's channel dim 1 is then the linear's out features). Requires every weight
  and statistic to be constant and the conv/linear output to feed only the batch_norm.
  New weights are named after the conv weight (`<prefix>.weight_bn`, `<prefix>.bias_bn`).

Options (`ConstantFoldOptions`): `max_bytes`, `fold_batch_norm` (default True). One forward
walk on the rewrite engine's state (`rewrite.Rewriter`): folding evaluates, it matches no
pattern.
"""
from __future__ import annotations

import torch

from graphmode.errors import GraphmodeError
from graphmode.ir.graph import Graph, Node
from graphmode.ir.ops import get_op
from graphmode.ir.types import DTYPES, TensorType, Value
from graphmode.passes.base import PassContext, PassResult, register_pass
from graphmode.passes.rewrite import Rewriter
_SKIP_OPS = frozenset({"fused", "fallback"})


def _bump(stats: dict, key: str, n: int = 1) -> None:
    stats[key] = stats.get(key, 0) + n


def _own(t: torch.Tensor, inputs: list[torch.Tensor]) -> torch.Tensor:
    """A contiguous tensor that shares no storage with the inputs (weight files cannot hold
    aliased tensors, and a later in-place backend must not write into a weight)."""
    t = t.detach().contiguous()
    ptr = t.untyped_storage().data_ptr()
    if any(i.untyped_storage().data_ptr() == ptr for i in inputs if i.numel()):
        t = t.clone()
    return t


def _try_fold(rw: Rewriter, n: Node, max_bytes: int, stats: dict) -> list[torch.Tensor] | None:
    if n.op in _SKIP_OPS or any(o in rw.outputs for o in n.outputs):
        return None
    spec = get_op(n.op)
    if not all(i in rw.constants for i in n.inputs) or spec.has("side_effect") or spec.has("collective"):
        return None
    types = [rw.type_of(o) for o in n.outputs]
    if not all(t.is_static for t in types):
        _bump(stats, "skipped_symbolic")
        return None
    if sum(int(t.nbytes()) for t in types) > max_bytes:
        _bump(stats, "skipped_large")
        return None
    args = [rw.constants[i] for i in n.inputs]
    try:
        with torch.inference_mode(False), torch.no_grad():
            outs = get_op(n.op).ref(args, n.attrs, {})
    except (GraphmodeError, RuntimeError, ValueError, TypeError, IndexError, KeyError):
        _bump(stats, "skipped_error")
        return None
    result = []
    for t, ty in zip(outs, types):
        want = DTYPES[ty.dtype]
        t = t if t.dtype == want else t.to(want)
        if tuple(t.shape) != tuple(ty.shape):
            _bump(stats, "skipped_error")
            return None
        result.append(_own(t, args))
    return result


def _prefix(name: str) -> str:
    return name[: -len(".weight")] if name.endswith(".weight") else name


def _fold_bn(rw: Rewriter, bn: Node, stats: dict) -> bool:
    """Fold batch_norm into the conv2d/linear that produces its input (see module doc)."""
    x = bn.inputs[0]
    p = rw.producer(x)
    if p is None or p.op not in ("conv2d", "linear") or not rw.single_use(x):
        return False
    stats_in = bn.inputs[1:]
    w_name = p.inputs[1]
    consts = [w_name, *p.inputs[2:], *stats_in]
    if not all(c in rw.constants for c in consts):
        return False
    w = rw.constants[w_name]
    if not w.is_floating_point() or rw.type_of(x).dtype != rw.type_of(bn.outputs[0]).dtype:
        return False
    if p.op == "conv2d" and w.dim() != 4:
        return False
    if p.op == "linear" and rw.type_of(x).rank != 2:
        return False
    gamma, beta, mean, var = (rw.constants[c].double() for c in stats_in)
    out_ch = w.shape[0]
    if any(t.shape != (out_ch,) for t in (gamma, beta, mean, var)):
        return False
    scale = gamma / torch.sqrt(var + float(bn.attrs.get("eps", 1e-5)))
    w64 = w.double() * scale.reshape((out_ch,) + (1,) * (w.dim() - 1))
    b64 = rw.constants[p.inputs[2]].double() if len(p.inputs) > 2 else torch.zeros(out_ch, dtype=torch.float64)
    b64 = (b64 - mean) * scale + beta
    pre = _prefix(w_name)
    new_w = _add_const(rw, f"{pre}.weight_bn", w64.to(w.dtype).contiguous(), "param")
    new_b = _add_const(rw, f"{pre}.bias_bn", b64.to(w.dtype).contiguous(), "param")
    rw.erase(rw.index_of(x))
    rw.emit(p.with_(inputs=(p.inputs[0], new_w, new_b), outputs=bn.outputs))
    _bump(stats, "bn_folded")
    return True


def _add_const(rw: Rewriter, hint: str, t: torch.Tensor, role: str) -> str:
    name = rw.fresh(hint)
    rw.values[name] = Value(name, TensorType.of(t), role)
    rw.constants[name] = t
    return name


@register_pass("constant_fold")
def run(graph: Graph, ctx: PassContext) -> PassResult:
    opts = ctx.opts("constant_fold")
    rw = Rewriter(graph)
    stats: dict[str, int] = {}
    folded_by_op: dict[str, int] = {}
    for n in graph.nodes:
        if opts.fold_batch_norm and n.op == "batch_norm" and n.inputs[0] not in rw.constants \
                and _fold_bn(rw, n, stats):
            continue
        outs = _try_fold(rw, n, opts.max_bytes, stats)
        if outs is None:
            rw.emit(n)
            continue
        param = any(rw.values[i].role == "param" for i in n.inputs)
        for o, t in zip(n.outputs, outs):
            rw.constants[o] = t
            rw.values[o] = Value(o, TensorType(rw.type_of(o).dtype, tuple(t.shape), rw.type_of(o).layout),
                                 "param" if param else "const")
        folded_by_op[n.op] = folded_by_op.get(n.op, 0) + 1
        if n.op == "permute":
            _bump(stats, "pretransposed")
        rw.changed = True
    stats["folded"] = sum(folded_by_op.values())
    out = dict(sorted(stats.items()))
    out["folded_by_op"] = dict(sorted(folded_by_op.items()))
    return PassResult(rw.finish(), rw.changed, out)


__all__ = ["run"]
