"""The shared check for single-pass tests: parse the Input IR, run the pass, compare the
printed result with the golden Expected file, and prove semantics preserved with the
reference interpreter on random inputs at several buckets."""
from __future__ import annotations

from graphmode.ir import interpret, parse_graph, verify_graph
from graphmode.passes import PASSES, PassContext
from graphmode.verify.numerics import random_inputs, rel_l2

BUCKETS = ({"b": 1, "s": 3}, {"b": 2, "s": 5})


def check_pass(pass_name, golden, case, text, *, constants=None, buckets=BUCKETS, ctx=None):
    g = parse_graph(text, constants)
    verify_graph(g)
    before = g.structural_hash()
    n_values = len(g.values)
    res = PASSES[pass_name](g, ctx or PassContext())
    assert g.structural_hash() == before and len(g.values) == n_values, "the pass mutated its input graph"
    verify_graph(res.graph)
    assert res.graph.outputs == g.outputs and res.graph.inputs == g.inputs
    golden(f"{pass_name}/{case}", res.graph.text())
    for seed, env in enumerate(buckets):
        inputs = random_inputs(g, env, seed)
        want, got = interpret(g, inputs), interpret(res.graph, inputs)
        for name in g.outputs:
            assert rel_l2(got[name], want[name]) < 1e-5, (case, env, name)
    return res
