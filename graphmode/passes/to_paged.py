"""The `to_paged` pass: a causal LM's captured graph onto a paged KV cache.

Each `sdpa` becomes `paged_attention` over the layer's K/V pool, taking the keys and values
before any grouped-query repeat (the cache holds `kv_heads`, not `heads`), and the
language-model head is applied to one position per sequence (`last`), not to the whole
prompt. The result is one graph whose `seq` dim is the number of new tokens (1 up): a prefill plan
per (batch, prompt-length) bucket and a decode plan per batch at seq = 1 come from it, both
memory-planned in the arena with the cache outside it.

The pools are the graph's run-time state (constants of role `state`, `kv.k.<layer>` and
`kv.v.<layer>`), allocated here once at the size of the pool the recipe's memory proof counts;
the decode engine's page tables (graphmode/decode/kvcache.py) index them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from graphmode.errors import CaptureError, PassError
from graphmode.ir.graph import Graph, Node
from graphmode.ir.interpreter import interpret
from graphmode.ir.ops import get_op
from graphmode.ir.types import DTYPES, TensorType, dim_str
from graphmode.passes.attention import scores_written
from graphmode.passes.base import PassContext, PassResult, register_pass


def _producers(g: Graph) -> dict[str, Node]:
    return {o: n for n in g.nodes for o in n.outputs}


def _before_repeat(g: Graph, name: str, prod: dict[str, Node]) -> str:
    """The value a grouped-query repeat (reshape -> expand -> [copy] -> reshape) started from."""
    cur = name
    chain = []
    for _ in range(4):
        n = prod.get(cur)
        if n is None or n.op not in ("reshape", "expand", "identity"):
            break
        chain.append(n.op)
        cur = n.inputs[0]
    if chain and chain[-1] == "reshape" and "expand" in chain and g.type_of(cur).rank == 4:
        return cur
    return name


@dataclass
class PagedLM:
    graph: Graph
    layers: int
    kv_heads: int
    head_dim: int


CAUSAL_PROBE_SEQ = 8      # the prompt length each attention's mask is evaluated at (ALiBi shows from 2 tokens)


def _masks_at(g: Graph, names: list[str], seq: int) -> dict[str, torch.Tensor]:
    """The values `names` take for one sequence of `seq` tokens at positions 0.. (the graph's
    i64 [batch, seq] inputs: `position_ids` counts, any other holds small token ids)."""
    prod = _producers(g)
    need: set[str] = set()
    todo = list(names)
    while todo:
        n = prod.get(todo.pop())
        if n is not None and n.outputs[0] not in need:
            need.update(n.outputs)
            todo.extend(n.inputs)
    sub = g.clone(nodes=[n for n in g.nodes if n.outputs[0] in need])
    sub.outputs = list(names)
    pos = torch.arange(seq).unsqueeze(0)
    feeds = {i: pos if i == "position_ids" else torch.ones_like(pos) if "mask" in i else (pos % 7 + 3)
             for i in g.inputs}
    return interpret(sub.prune_values(), feeds)


def not_causal(g: Graph) -> str | None:
    """Why the attention of an LM graph (inputs i64 [batch, seq]: ids, positions, a padding mask)
    is not the causal attention the paged cache answers, or None. See `_refuse_non_causal`."""
    if any(g.type_of(i).dtype != "i64" or g.type_of(i).rank != 2 for i in g.inputs):
        return None                                     # not a token graph this probe can feed
    try:
        _refuse_non_causal(g, [n for n in g.nodes if n.op == "sdpa"])
    except CaptureError as e:
        return e.message
    return None


def _refuse_non_causal(g: Graph, attn: list[Node]) -> None:
    """Every attention must attend causally and by nothing else: the paged attention applies the
    causal mask and drops the sdpa's own. A mask holding more (ALiBi's position biases, a
    bidirectional or chunked mask) or no mask without `is_causal` would be answered wrongly."""
    seq = CAUSAL_PROBE_SEQ
    dims = g.type_of(g.inputs[0]).shape
    if not isinstance(dims[1], int):
        seq = max(2, min(seq, g.dims.get(dim_str(dims[1]), (1, seq))[1]))
    masks = [n.inputs[3] for n in attn if len(n.inputs) > 3]
    values = _masks_at(g, masks, seq) if masks else {}
    below = torch.ones(seq, seq, dtype=torch.bool).tril()
    for layer, n in enumerate(attn):
        causal = bool(n.attrs.get("is_causal", False))
        if len(n.inputs) <= 3:
            ok = causal
        else:
            m = values[n.inputs[3]]
            if tuple(m.shape[-2:]) != (seq, seq):
                ok = False                              # one row for every query: not causal
            else:
                m = m.reshape(-1, seq, seq)
                kept = m if m.dtype == torch.bool else m == 0
                dropped = ~m if m.dtype == torch.bool else m <= -1e4
                ok = bool(kept[:, below].all()) and (causal or bool(dropped[:, ~below].all()))
        if not ok:
            raise CaptureError(f"attention layer {layer} ({n.outputs[0]}) attends by more than the causal mask "
                               "(ALiBi position biases, a bidirectional, chunked or custom mask): graphmode's paged "
                               "attention applies the causal mask only and would answer other tokens", where="model",
                               fix="this architecture does not decode on graphmode's KV cache yet; compile its "
                                   "forward pass (a recipe without memory.kv_cache)")


def to_paged(g: Graph, k_pools: list[torch.Tensor], v_pools: list[torch.Tensor], max_pages: int) -> PagedLM:
    """The captured LM graph with every sdpa on the paged cache and the head at `last` only."""
    _refuse_non_causal(g, [n for n in g.nodes if n.op == "sdpa"])
    out = g.clone()
    prod = _producers(out)
    batch = out.type_of(out.inputs[0]).shape[0]
    table = out.add_input("block_table", TensorType("i64", (batch, max_pages)))
    start = out.add_input("start", TensorType("i64", (batch,)))
    lens = out.add_input("lens", TensorType("i64", (batch,)))
    last = out.add_input("last", TensorType("i64", (batch,)))
    nodes: list[Node] = []
    layer = 0
    kv_heads = head_dim = None
    for n in out.nodes:
        if n.op != "sdpa":
            nodes.append(n)
            continue
        if layer >= len(k_pools):
            raise CaptureError(f"the model has more attention layers than the KV cache ({len(k_pools)})",
                               where="memory.kv_cache.layers", fix="set layers to the model's layer count")
        q, k, v = n.inputs[:3]
        k0, v0 = _before_repeat(out, k, prod), _before_repeat(out, v, prod)
        kt = out.type_of(k0)
        kv_heads, head_dim = kt.shape[1], kt.shape[3]
        pool_shape = tuple(k_pools[layer].shape)
        if (pool_shape[2], pool_shape[3]) != (kv_heads, head_dim):
            raise CaptureError(f"layer {layer} keeps {kv_heads} KV heads of dim {head_dim}, the cache has "
                               f"{pool_shape[2]} of dim {pool_shape[3]}", where="memory.kv_cache",
                               fix=f"set kv_heads: {kv_heads} and head_dim: {head_dim}")
        kp = out.add_constant(f"kv.k.{layer}", k_pools[layer], role="state")
        vp = out.add_constant(f"kv.v.{layer}", v_pools[layer], role="state")
        scale = n.attrs.get("scale")
        attrs = {"scale": float(scale) if scale is not None else 1.0 / math.sqrt(out.type_of(q).shape[-1])}
        nodes.append(Node("paged_attention", (q, k0, v0, kp, vp, table, start, lens), n.outputs, attrs))
        layer += 1
    if layer != len(k_pools):
        raise CaptureError(f"the model has {layer} attention layer(s), the KV cache declares {len(k_pools)}",
                           where="memory.kv_cache.layers", fix=f"set layers: {layer}")
    out.nodes = nodes
    _head_at_last(out, last, batch)
    out.prune_values()
    return PagedLM(out, layer, int(kv_heads), int(head_dim))


def _after_head(g: Graph, prod: dict[str, Node]) -> list[Node]:
    """The elementwise nodes between the LM head and the logits, last first: a scale by a
    constant (Granite's logits_scaling, Cohere's logit_scale) or a soft cap (tanh(x / c) * c)."""
    chain: list[Node] = []
    n = prod.get(g.outputs[0])
    while n is not None and n.op != "linear":
        data = _data_inputs(g, n)
        if get_op(n.op).kind != "elementwise" or len(data) != 1 or len(n.outputs) != 1:
            return []
        chain.append(n)
        n = prod.get(data[0])
    return chain


def _data_inputs(g: Graph, n: Node) -> list[str]:
    return [i for i in n.inputs if not (i in g.constants and g.constants[i].numel() == 1)]


def _head_at_last(g: Graph, last: str, batch) -> None:
    """logits = head(hidden[b, last[b]]) instead of head(hidden) over every position (and the
    constant scale or soft cap after the head, on that one position)."""
    prod = _producers(g)
    after = _after_head(g, prod)
    head = prod.get(_data_inputs(g, after[-1])[0] if after else g.outputs[0])
    if head is None or head.op != "linear":
        raise CaptureError("the model's output is not a linear head over hidden states",
                           where="model", fix="decoding needs a causal LM whose logits come from a linear head")
    h = head.inputs[0]
    ht = g.type_of(h)
    if ht.rank != 3:
        raise CaptureError(f"the LM head reads {ht.text()}, expected [batch, seq, hidden]", where="model")
    b = batch if isinstance(batch, int) else dim_str(batch)
    rows, = g.add_node("arange", [], [TensorType("i64", (batch,))], {"start": 0, "end": b, "step": 1, "dtype": "i64"})
    picked, = g.add_node("index", [h, rows, last], [ht.with_shape((batch, ht.shape[2]))], {"dims": [0, 1]})
    picked3, = g.add_node("reshape", [picked], [ht.with_shape((batch, 1, ht.shape[2]))],
                          {"shape": [b, 1, ht.shape[2]]})
    logits_t = g.type_of(g.outputs[0])
    one = logits_t.with_shape((batch, 1, logits_t.shape[2]))
    chain = [head] + after[::-1]          # head, then the elementwise nodes in order
    prev = picked3
    for k, n in enumerate(chain):
        name = "logits" if k == len(chain) - 1 else g.fresh_name("logits_head")
        ins = (picked3,) + tuple(n.inputs[1:]) if k == 0 else tuple(prev if i == chain[k - 1].outputs[0] else i
                                                                       for i in n.inputs)
        g.add_value(name, one.with_dtype(g.type_of(n.outputs[0]).dtype), "output" if name == "logits" else "intermediate")
        g.nodes.remove(n)
        g.nodes.append(n.with_(inputs=ins, outputs=(name,)))   # after the nodes that compute its new input
        prev = name
    g.outputs = ["logits"]


def _attention_as_sdpa(graph: Graph) -> Graph:
    """The graph with each attention block written out as matmul -> softmax -> matmul turned
    into one sdpa by the fuse pass's attention rules (after canonicalize drops the casts and
    copies between them), so the paged attention can take its place."""
    from graphmode.passes.attention import rules
    from graphmode.passes.canonicalize import RULES
    from graphmode.passes.rewrite import rewrite_graph
    g, _ = rewrite_graph(graph, RULES)
    g, _ = rewrite_graph(g, rules(heads_layout=False))     # the pass reads heads from q, k, v [b, h, s, d]
    return g.clone().prune_values() if g is not graph else g


@register_pass("to_paged")
def run(graph: Graph, ctx: PassContext) -> PassResult:
    o = ctx.opts("to_paged")
    if None in (o.page_size, o.pages, o.max_pages_per_seq):
        raise PassError("to_paged needs a paged KV cache", where="memory.kv_cache",
                        fix="declare memory.kv_cache {page_size, max_pages_per_seq} (a decoder recipe)")
    if o.dtype not in DTYPES:
        raise PassError(f"unknown KV cache dtype {o.dtype!r}", where="memory.kv_cache.dtype", value=o.dtype,
                        fix=f"one of {', '.join(sorted(DTYPES))}")
    sdpa = [n for n in graph.nodes if n.op == "sdpa"]
    if not sdpa:                  # attention written out (Gemma 2's eager attention): in sdpa form first
        graph = _attention_as_sdpa(graph)
        sdpa = [n for n in graph.nodes if n.op == "sdpa"]
    if not sdpa:
        written = scores_written(graph)
        if written:           # attention there, its scores rewritten (Gemma 2's soft-capping: tanh)
            capped = " (attention soft-capping: a tanh of the scores)" if "tanh" in written else ""
            raise CaptureError(f"the model's attention does not capture as one sdpa, which the KV cache is put on: "
                               f"its scores are rewritten before the softmax{written}{capped}", where="model",
                               fix="decode a model whose attention is sdpa (Gemma 2: attn_logit_softcapping=None in "
                                   "its config), or leave memory.kv_cache out of the recipe to compile the forward "
                                   "pass alone")
        raise CaptureError("the model has no attention (sdpa) to put on a KV cache", where="model",
                           fix="decoding needs a causal LM whose attention captures as sdpa")
    prod = _producers(graph)
    k0 = graph.type_of(_before_repeat(graph, sdpa[0].inputs[1], prod))
    layers = o.layers or len(sdpa)
    shape = (o.pages, o.page_size, o.kv_heads or int(k0.shape[1]), o.head_dim or int(k0.shape[3]))
    pools = [[torch.zeros(shape, dtype=DTYPES[o.dtype]) for _ in range(layers)] for _ in "kv"]
    paged = to_paged(graph, pools[0], pools[1], o.max_pages_per_seq)
    g = paged.graph
    seq = g.type_of(g.inputs[0]).shape[1]
    if not isinstance(seq, int) and dim_str(seq) in g.dims:
        g.dims[dim_str(seq)] = (1, g.dims[dim_str(seq)][1])       # a decode step feeds one token
    return PassResult(g, True, {"layers": paged.layers, "pool_pages": o.pages})
