"""layout: remove transposes the core op set can absorb, and keep weights in the layout
the kernels want. Deliberately modest: every rule removes a `permute` or a copy, never adds
one, and stays inside the core op set.

Rules, to a fixpoint:
- `matmul_to_linear`: matmul(a, permute(W, [1, 0])) with W a 2-d constant -> linear(a, W).
  `linear` reads W as [out, in], so the transpose disappears without copying W.
- `permute_cancel`: permute(p) -> a chain of elementwise ops -> permute(q), where the ops
  are unary or combine with rank-0 values (permutation-invariant) and every intermediate
  has one user: the chain runs on the unpermuted tensor and the two permutes compose into
  one (or none, when the composition is the identity). An empty chain is canonicalize's
  permute-chain rule, repeated here for the pairs the binary rule creates.
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

from graphmode.errors import PassError
from graphmode.ir.graph import Graph, Node
from graphmode.ir.ops import OPS, get_op
from graphmode.ir.types import Value
from graphmode.passes.base import PassContext, PassResult, register_pass
from graphmode.passes.canonicalize import is_identity_perm, live_values, rename_node, types_equal

MAX_ROUNDS = 10_000


def _maps(nodes: list[Node]) -> tuple[dict[str, int], dict[str, list[int]]]:
    prod: dict[str, int] = {}
    users: dict[str, list[int]] = {}
    for idx, n in enumerate(nodes):
        for i in n.inputs:
            users.setdefault(i, []).append(idx)
        for o in n.outputs:
            prod[o] = idx
    return prod, users


class _State:
    def __init__(self, graph: Graph):
        self.graph = graph
        self.nodes = list(graph.nodes)
        self.values = dict(graph.values)
        self.constants = dict(graph.constants)
        self.outputs = set(graph.outputs)
        self.prod, self.users = _maps(self.nodes)

    def refresh(self):
        self.prod, self.users = _maps(self.nodes)

    def single_use(self, name: str) -> bool:
        return len(self.users.get(name, [])) == 1 and name not in self.outputs

    def producer(self, name: str) -> Node | None:
        idx = self.prod.get(name)
        return None if idx is None else self.nodes[idx]

    def fresh(self, hint: str) -> str:
        name, i = hint, 1
        while name in self.values:
            name = f"{hint}_{i}"
            i += 1
        return name

    def retype(self, n: Node) -> None:
        """Re-infer the output types of a rewritten node (its inputs changed shape)."""
        types = get_op(n.op).infer([self.values[i].type for i in n.inputs], n.attrs)
        for o, t in zip(n.outputs, types):
            self.values[o] = Value(o, t, self.values[o].role if o in self.values else "intermediate")


def _matmul_to_linear(st: _State, idx: int, n: Node) -> bool:
    if n.op != "matmul":
        return False
    p = st.producer(n.inputs[1])
    if p is None or p.op != "permute" or list(p.attrs["perm"]) != [1, 0]:
        return False
    w = p.inputs[0]
    if w not in st.constants or st.values[w].type.rank != 2:
        return False
    a = st.values[n.inputs[0]].type
    if a.dtype != st.values[w].type.dtype:
        return False
    new = Node("linear", (n.inputs[0], w), n.outputs, {k: v for k, v in n.attrs.items() if k in ("loc", "precision")})
    if not types_equal(get_op("linear").infer([a, st.values[w].type], {})[0], st.values[n.outputs[0]].type):
        return False
    st.nodes[idx] = new
    return True


def _elementwise_main(st: _State, n: Node) -> int | None:
    """Index of the input that carries the (permuted) tensor through elementwise op `n`,
    when every other input is rank 0; None when `n` does not commute with a permute."""
    spec = OPS.get(n.op)
    if spec is None or spec.kind != "elementwise" or len(n.outputs) != 1:
        return None
    ranked = [k for k, i in enumerate(n.inputs) if st.values[i].type.rank != 0]
    return ranked[0] if len(ranked) == 1 else None


def _permute_cancel(st: _State, idx: int, q: Node) -> bool:
    if q.op != "permute":
        return False
    chain: list[tuple[int, int]] = []   # (node index, main input position), from q upwards
    cur = q.inputs[0]
    while True:
        if not st.single_use(cur):
            return False
        pi = st.prod.get(cur)
        if pi is None:
            return False
        pn = st.nodes[pi]
        if pn.op == "permute":
            break
        k = _elementwise_main(st, pn)
        if k is None:
            return False
        chain.append((pi, k))
        cur = pn.inputs[k]
    p_idx = st.prod[cur]
    p = st.nodes[p_idx]
    x = p.inputs[0]
    perm_p, perm_q = list(p.attrs["perm"]), list(q.attrs["perm"])
    composed = [perm_p[i] for i in perm_q]
    if not chain:  # permute(permute(x)): canonicalize's rule, repeated for chains this pass made
        w = q.outputs[0]
        if is_identity_perm(composed):
            if w not in st.outputs:
                old, new = w, x
            elif x in st.prod and x not in st.outputs:
                old, new = x, w  # an output keeps its name: x's producer now defines it
            else:
                return False
            st.nodes = [rename_node(m, {old: new}) for i, m in enumerate(st.nodes) if i not in (idx, p_idx)]
            st.values.pop(old, None)
        else:
            st.nodes[idx] = q.with_(inputs=(x,), attrs={**q.attrs, "perm": composed})
            st.nodes = [m for i, m in enumerate(st.nodes) if i != p_idx]
        st.values.pop(p.outputs[0], None)
        return True
    # rewrite the chain bottom-up from p: each op reads the unpermuted tensor
    src = x
    for ci, k in reversed(chain):
        m = st.nodes[ci]
        ins = list(m.inputs)
        ins[k] = src
        m = m.with_(inputs=ins)
        st.nodes[ci] = m
        st.retype(m)
        src = m.outputs[0]
    last_idx = chain[0][0]
    st.nodes[p_idx] = None  # type: ignore[assignment]
    st.values.pop(p.outputs[0], None)
    if is_identity_perm(composed):
        # the chain's last op now produces q's output directly
        last = st.nodes[last_idx]
        z, w = last.outputs[0], q.outputs[0]
        if not types_equal(st.values[z].type, st.values[w].type):
            raise PassError(f"permute_cancel would change the type of %{w}", where="pass layout",
                            fix="this is a graphmode bug; remove 'layout' from optimize.passes")
        st.nodes[last_idx] = rename_node(last, {z: w})
        st.values.pop(z, None)
        st.nodes[idx] = None  # type: ignore[assignment]
    else:
        st.nodes[idx] = q.with_(attrs={**q.attrs, "perm": composed})
    st.nodes = [m for m in st.nodes if m is not None]
    return True


def _sink_binary(st: _State, idx: int, n: Node) -> bool:
    spec = OPS.get(n.op)
    if spec is None or spec.kind != "elementwise" or len(n.inputs) != 2 or len(n.outputs) != 1:
        return False
    a_name, b_name = n.inputs
    pa, pb = st.producer(a_name), st.producer(b_name)
    if pa is None or pb is None or pa.op != "permute" or pb.op != "permute":
        return False
    if list(pa.attrs["perm"]) != list(pb.attrs["perm"]):
        return False
    if a_name == b_name:
        if len(st.users.get(a_name, [])) != 2 or a_name in st.outputs:
            return False
    elif not (st.single_use(a_name) and st.single_use(b_name)):
        return False
    a, b = pa.inputs[0], pb.inputs[0]
    if st.values[a].type.rank != st.values[b].type.rank:
        return False
    out = n.outputs[0]
    t = st.fresh(f"{out}_unpermuted")
    st.values[t] = Value(t, st.values[out].type)
    inner = n.with_(inputs=(a, b), outputs=(t,))
    st.retype(inner)
    perm = Node("permute", (t,), (out,), {"perm": list(pa.attrs["perm"])})
    drop = {id(pa), id(pb)}
    st.values.pop(a_name, None)
    st.values.pop(b_name, None)
    new_nodes = []
    for m in st.nodes:
        if m is n:
            new_nodes += [inner, perm]
        elif id(m) not in drop:
            new_nodes.append(m)
    st.nodes = new_nodes
    return True


def _target_prefs(st: _State, ctx: PassContext, stats: dict) -> None:
    kind = getattr(ctx.target, "kind", None)
    stats["target_kind"] = kind
    contiguous = made = kept_perm = 0
    for n in st.nodes:
        if n.op != "linear":
            continue
        w = n.inputs[1]
        if w in st.constants:
            t = st.constants[w]
            if not t.is_contiguous():
                st.constants[w] = t.contiguous()
                made += 1
            contiguous += 1
        else:
            p = st.producer(w)
            if p is not None and p.op == "permute":
                kept_perm += 1
    if contiguous or made or kept_perm:
        stats["linear_weights_out_in_contiguous"] = contiguous
    if made:
        stats["linear_weights_made_contiguous"] = made
    if kept_perm:
        stats["linear_weights_permute_kept"] = kept_perm
    if any(n.op == "conv2d" for n in st.nodes):
        stats["conv_layout"] = "nchw"


@register_pass("layout")
def run(graph: Graph, ctx: PassContext) -> PassResult:
    st = _State(graph)
    stats: dict = {}
    changed = False
    rules = (("matmul_to_linear", _matmul_to_linear), ("permute_cancel", _permute_cancel),
             ("permute_sink_binary", _sink_binary))
    for _ in range(MAX_ROUNDS):
        fired = False
        for idx, n in enumerate(st.nodes):
            for name, rule in rules:
                if rule(st, idx, n):
                    stats[name] = stats.get(name, 0) + 1
                    fired = True
                    break
            if fired:
                break
        if not fired:
            break
        changed = True
        st.refresh()
    kept = 0
    for n in st.nodes:
        if n.op == "matmul":
            p = st.producer(n.inputs[1])
            if p is not None and p.op == "permute":
                kept += 1
    if kept:
        stats["matmul_permute_kept"] = kept
    before = dict(st.constants)
    _target_prefs(st, ctx, stats)
    changed = changed or any(st.constants[k] is not before[k] for k in before)
    values = live_values(st.values, graph.inputs, st.constants, st.nodes)
    g = Graph(graph.name, values, list(graph.inputs), list(graph.outputs), st.nodes, st.constants,
              dict(graph.dims))
    return PassResult(g, changed, stats)
