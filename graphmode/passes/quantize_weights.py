"""quantize_weights: store the constant weights of `linear` nodes narrow (recipe `precision.weights`).

Decoding at small batch reads every weight once per token and does two FLOPs per weight, so
its speed is the weights' bytes over the memory bandwidth: bf16 halves them, int8 quarters
them. Each `linear(x, W[, b])` whose W is an f32 constant becomes `qlinear(x, Wq, scale[, b])`
(see ir/ops/linalg.py): bf16 rounds W to nearest-even with a unit scale; int8 is symmetric
per output channel, scale = max|W[n, :]| / 127 and Wq = round(W / scale) (an all-zero row
keeps scale 1). Activations, bias and accumulation stay f32, so the answer changes only by
the weights' rounding: `graphmode verify` then checks logit error and top-1 flips against
the f32 model instead of the f32 tolerance (verify/numerics.py: WEIGHT_ONLY, Top1).
int4 packs two 4-bit codes a byte with an f32 scale per group of `group_size` weights along
`in` (and a zero point per group when asymmetric): ir/ops/int4.py has the format. A linear
whose `in` is not a multiple of the group stays f32 (counted in the pass's `left_f32`).
`int4_activations: q8` marks the int4 qlinears `act: q8`: x is quantized to int8 blocks for
integer dot products (ir/ops/int4.py), an explicit change of the activations' numerics.

A W shared with other nodes (GPT-2's tied embedding and LM head) keeps its f32 constant for
them; the quantized copy is a new constant `<W>.bf16` / `<W>.int8` / `<W>.int4`, made once per W.
Linears that are not over an f32 constant weight (computed weights, non-f32 inputs) stay.
"""
from __future__ import annotations

import torch

from graphmode.ir.graph import Graph
from graphmode.ir.ops import int4
from graphmode.passes.base import PassContext, PassResult, register_pass

_STORED = {"bf16": torch.bfloat16, "int8": torch.int8}


def quantize(w: torch.Tensor, weights: str, group: int = 32,
             scheme: str = "symmetric") -> tuple[torch.Tensor, torch.Tensor]:
    """(stored weight, f32 scale) for an f32 [out, in] weight: per row for bf16 / int8, per
    group of `group` for int4 (packed u8, ir/ops/int4.py)."""
    if weights == "int4":
        return int4.quantize(w, group, scheme)
    w = w.detach().float()
    if weights == "bf16":
        return w.to(torch.bfloat16).contiguous(), torch.ones(w.shape[0])
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


@register_pass("quantize_weights")
def run(graph: Graph, ctx: PassContext) -> PassResult:
    opts = ctx.opts("quantize_weights")
    weights = opts.weights
    if weights == "f32":
        return PassResult(graph, False, {"weights": weights})
    g = graph.clone()
    made: dict[str, tuple[str, str]] = {}
    nodes = []
    stored = 0
    left = 0
    kept: dict[str, int] = {}         # why a linear stays f32 -> how many
    widths: set[int] = set()          # in features no int4 group of group_size divides
    islands = sum(1 for n in g.nodes if n.op == "fallback" and "linear" in str(n.attrs.get("target", "")))
    for n in g.nodes:
        w = n.inputs[1] if n.op == "linear" and len(n.inputs) >= 2 else None
        why = _kept_f32(g, n, w)
        if why is None and weights == "int4" and g.type_of(w).shape[1] % opts.group_size:
            why = f"in features not a multiple of group_size {opts.group_size}"
            left += 1
            widths.add(int(g.type_of(w).shape[1]))
        if why is not None:
            if n.op == "linear":
                kept[why] = kept.get(why, 0) + 1
            nodes.append(n)
            continue
        if w not in made:
            q, scale = quantize(g.constants[w], weights, opts.group_size, opts.int4_scheme)
            qn = g.add_constant(g.fresh_name(f"{w}.{weights}"), q)
            sn = g.add_constant(g.fresh_name(f"{w}.scale"), scale)
            made[w] = (qn, sn)
            stored += q.numel() * q.element_size() + scale.numel() * scale.element_size()
        qn, sn = made[w]
        act = {"act": "q8"} if weights == "int4" and opts.int4_activations == "q8" else {}
        nodes.append(n.with_(op="qlinear", inputs=(n.inputs[0], qn, sn) + tuple(n.inputs[2:]),
                             attrs={**n.attrs, **act}))
    g.nodes = nodes
    g.prune_values()
    f32 = sum(graph.constants[w].numel() * 4 for w in made)
    stats = {"group_size": opts.group_size, "int4_scheme": opts.int4_scheme,
             "int4_activations": opts.int4_activations, "left_f32": left, "left_widths": sorted(widths)} \
        if weights == "int4" else {}
    return PassResult(g, bool(made), {"weights": weights, **stats, "quantized": len(made), "eager_linears": islands,
                                      "linears": sum(1 for n in nodes if n.op == "qlinear"),
                                      "bytes_before": f32, "bytes_after": stored, "kept_f32": kept})


def _kept_f32(g: Graph, n, w: str | None) -> str | None:
    """Why linear node `n` (weight `w`) cannot be stored narrow, or None when it can."""
    if w is None:
        return "not a linear"
    if not g.is_constant(w):
        return "its weight is computed, not a constant"
    if g.type_of(w).dtype != "f32" or g.type_of(w).rank != 2:
        return f"its weight is {g.type_of(w).text()}, not an f32 [out, in] matrix"
    if g.type_of(n.inputs[0]).dtype != "f32" or (len(n.inputs) > 2 and g.type_of(n.inputs[2]).dtype != "f32"):
        return "its input or bias is not f32"
    return None


def weights_summary(stats: dict) -> tuple[str, bool] | None:
    """A line on what `precision.weights` stored narrow (from this pass's stats), and whether it is
    worth a warning: a recipe asking for narrow weights that changed no linear, or left some f32
    for want of a group size that divides them (with the group size that would). None when the
    recipe keeps f32 weights."""
    weights = stats.get("weights")
    if weights in (None, "f32"):
        return None
    kept = stats.get("kept_f32") or {}
    done = int(stats.get("linears", 0))
    total = done + sum(kept.values())
    # a weight that is not f32 (an fp16 model's) stays as it is, not f32
    why = "; ".join(f"{n} {'stays' if n == 1 else 'stay'} {'f32' if 'not an f32' not in r else 'unquantized'} ({r})"
                    for r, n in kept.items())
    fix = _group_fix(stats) if stats.get("left_f32") else ""
    if done:
        return (f"precision.weights {weights}: {done} of {total} linear(s) stored {weights} "
                f"({_size(stats.get('bytes_before', 0))} -> {_size(stats.get('bytes_after', 0))})"
                + (f"; {why}{fix}" if why else ""), bool(fix))      # left f32 by the group size: worth a warning
    none = ("its linear layers run as eager islands (capture.exclude_ops), in f32" if stats.get("eager_linears")
            else "the model has no linear layer (convolutions and embeddings keep f32)")
    return (f"precision.weights {weights} stored no weight narrow: " + (why if why else none)
            + f"; it runs with its weights as they are{fix}", True)


def _group_fix(stats: dict) -> str:
    """The group size that narrows every linear left f32 by the group, or int8 where none can."""
    widths = stats.get("left_widths") or []
    fits = [g for g in (128, 64, 32) if widths and all(w % g == 0 for w in widths)]
    if fits:
        return f"; precision.group_size: {fits[0]} divides every in features ({', '.join(map(str, widths))})"
    some = [g for g in (128, 64, 32) if any(w % g == 0 for w in widths)]
    none = ", ".join(str(w) for w in widths if not some or w % some[0])
    return ((f"; precision.group_size: {some[0]} narrows in features "
             f"{', '.join(str(w) for w in widths if w % some[0] == 0)}" if some else "")
            + f"; no int4 group size (32, 64, 128) divides in features {none}: precision.weights int8 (per output "
              "channel) narrows every linear")


def _size(n: float) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


__all__ = ["quantize", "weights_summary"]
