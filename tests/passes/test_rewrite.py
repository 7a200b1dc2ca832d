"""The rewrite engine on its own (graphmode/passes/pattern.py, rewrite.py): matching,
bindings, single use and consumption, the fixpoint, output renaming and per-rule counts.
Every rewritten graph is verified and run through the interpreter against its input."""
from __future__ import annotations

import pytest
import torch

from graphmode.errors import PassError
from graphmode.ir import interpret, parse_graph, verify_graph
from graphmode.passes.pattern import Pat
from graphmode.passes.rewrite import Rule, RuleSet, rewrite_graph
from graphmode.verify.numerics import random_inputs, rel_l2


def source(rw, m):
    return m["x"]


DOUBLE_NEG = Rule("double_neg", Pat("neg", Pat("neg", Pat.var("x"))), source)
DOUBLE_NEG_OWNED = Rule("double_neg", Pat("neg", Pat("neg", Pat.var("x"), single_use=True)), source)
IDENTITY = Rule("identity", Pat("identity", Pat.var("x")), source)


def rewrite(text: str, *rules: Rule):
    g = parse_graph(text)
    verify_graph(g)
    before = g.text()
    out, stats = rewrite_graph(g, RuleSet(list(rules)))
    verify_graph(out)
    assert g.text() == before, "the engine mutated its input graph"
    assert out.outputs == g.outputs and out.inputs == g.inputs
    for seed, env in enumerate(({"b": 1}, {"b": 3})):
        ins = random_inputs(g, env, seed)
        want, got = interpret(g, ins), interpret(out, ins)
        for name in g.outputs:
            assert rel_l2(got[name], want[name]) < 1e-6, name
    return out, stats


def body(g) -> list[str]:
    """The node lines of a graph's text."""
    return [line.strip() for line in g.text().splitlines() if " = " in line and not line.strip().startswith(("const", "param"))]


# ------------------------------------------------------------------------------- matching

def test_op_and_operand_patterns():
    out, stats = rewrite("""
graph @t(%a: f32[b,4]) -> (%p, %q) {
  %n: f32[b,4] = neg(%a)
  %y: f32[b,4] = neg(%n)
  %m: f32[b,4] = abs(%a)
  %z: f32[b,4] = neg(%m)
  %p: f32[b,4] = exp(%y)
  %q: f32[b,4] = exp(%z)
  return %p, %q
}""", DOUBLE_NEG)
    assert stats == {"double_neg": 1}
    # neg(abs(a)) is not neg(neg(a)); the inner neg is not single-use-matched, so it stays for dce
    assert body(out) == ["%n: f32[b,4] = neg(%a)", "%m: f32[b,4] = abs(%a)", "%z: f32[b,4] = neg(%m)",
                         "%p: f32[b,4] = exp(%a)", "%q: f32[b,4] = exp(%z)"]


def test_op_sets_and_alternatives_in_order():
    """abs of a non-negative value is the value: either(relu(x), exp(x)) names the alternatives,
    an op set (abs, relu) the roots; the bound value is the alternative's."""
    nonneg = Pat.either(Pat("relu", Pat.var()), Pat("exp", Pat.var()), name="x")
    rule = Rule("drop_abs", Pat(("abs", "relu"), nonneg), source)
    out, stats = rewrite("""
graph @t(%a: f32[b,4]) -> (%o) {
  %r: f32[b,4] = relu(%a)
  %a1: f32[b,4] = abs(%r)
  %e: f32[b,4] = exp(%a)
  %a2: f32[b,4] = relu(%e)
  %t: f32[b,4] = tanh(%a)
  %a3: f32[b,4] = abs(%t)
  %s: f32[b,4] = add(%a1, %a2)
  %o: f32[b,4] = add(%s, %a3)
  return %o
}""", rule)
    assert stats == {"drop_abs": 2}
    assert "%s: f32[b,4] = add(%r, %e)" in body(out) and "%a3: f32[b,4] = abs(%t)" in body(out)


@pytest.mark.parametrize("commute,expected", [(True, 2), (False, 1)])
def test_commute_and_constant_predicates(commute, expected):
    one = Pat.const("c", where=lambda m: m.scalar("c") == 1.0)
    rule = Rule("mul_1", Pat("mul", Pat.var("x"), one, commute=commute), source)
    out, stats = rewrite("""
graph @t(%a: f32[b,4]) -> (%o) {
  const %one: f32[] = 1.0
  const %two: f32[] = 2.0
  %y1: f32[b,4] = mul(%a, %one)
  %y2: f32[b,4] = mul(%one, %y1)
  %o: f32[b,4] = mul(%y2, %two)
  return %o
}""", rule)
    assert stats == {"mul_1": expected}
    assert body(out)[-1] == ("%o: f32[b,4] = mul(%a, %two)" if commute else "%o: f32[b,4] = mul(%y2, %two)")


def test_a_name_bound_twice_binds_one_value():
    """add(x, x) -> mul(x, 2): a built value takes the root's name, a built constant gets a fresh one."""
    def double(rw, m):
        return rw.add("mul", [m["x"], rw.add_const("two", torch.tensor(2.0))])
    out, stats = rewrite("""
graph @t(%a: f32[b,4], %c: f32[b,4]) -> (%y, %z) {
  %y: f32[b,4] = add(%a, %a)
  %z: f32[b,4] = add(%a, %c)
  return %y, %z
}""", Rule("double", Pat("add", Pat.var("x"), Pat.var("x")), double))
    assert stats == {"double": 1}
    assert body(out) == ["%y: f32[b,4] = mul(%a, %two)", "%z: f32[b,4] = add(%a, %c)"]
    assert out.values["two"].role == "const" and float(out.constants["two"]) == 2.0


def test_where_sees_the_operand_bindings():
    same_type = Rule("cast_noop", Pat("cast", Pat.var("x"), name="y", where=lambda m: m.type("x").matches(m.type("y"))),
                     source)
    out, stats = rewrite("""
graph @t(%a: f32[b,4]) -> (%o) {
  %c1: f32[b,4] = cast(%a) {"dtype": "f32"}
  %c2: f16[b,4] = cast(%c1) {"dtype": "f16"}
  %o: f32[b,4] = cast(%c2) {"dtype": "f32"}
  return %o
}""", same_type)
    assert stats == {"cast_noop": 1} and body(out)[0] == "%c2: f16[b,4] = cast(%a) {\"dtype\": \"f16\"}"


# ------------------------------------------------------------------------------ single use

NEG_CHAINS = """
graph @t(%a: f32[b,4], %c: f32[b,4]) -> (%y, %z, %w2, %n3, %u) {
  %n1: f32[b,4] = neg(%a)
  %y: f32[b,4] = neg(%n1)
  %z: f32[b,4] = exp(%n1)
  %n2: f32[b,4] = neg(%c)
  %w: f32[b,4] = neg(%n2)
  %w2: f32[b,4] = exp(%w)
  %n3: f32[b,4] = neg(%a)
  %u: f32[b,4] = neg(%n3)
  return %y, %z, %w2, %n3, %u
}"""


def test_single_use_operands_are_matched_and_consumed():
    out, stats = rewrite(NEG_CHAINS, DOUBLE_NEG_OWNED)
    # n1 has two readers and n3 is a graph output: only the n2 chain is single-use; its inner
    # neg is consumed (erased with the root), the others stay untouched
    assert stats == {"double_neg": 1}
    assert body(out) == ["%n1: f32[b,4] = neg(%a)", "%y: f32[b,4] = neg(%n1)", "%z: f32[b,4] = exp(%n1)",
                         "%w2: f32[b,4] = exp(%c)", "%n3: f32[b,4] = neg(%a)", "%u: f32[b,4] = neg(%n3)"]


def test_operands_matched_without_single_use_stay():
    out, stats = rewrite(NEG_CHAINS, DOUBLE_NEG)
    # every chain matches; the outputs y and u cannot be renamed to the input a (kept), and the
    # inner negs are left for dce
    assert stats == {"double_neg": 1, "kept_for_output": 2}
    assert "%n2: f32[b,4] = neg(%c)" in body(out) and "%w2: f32[b,4] = exp(%c)" in body(out)


def test_only_nodes_on_a_single_use_path_from_the_root_are_consumed():
    """neg(abs(neg(x))) -> neg(abs(x)): the inner neg is single-use, but its reader (the abs)
    has another reader and stays, so the inner neg must stay too."""
    def rebuild(rw, m):
        return rw.add("neg", [rw.add("abs", [m["x"]])])
    rule = Rule("abs_neg", Pat("neg", Pat("abs", Pat("neg", Pat.var("x"), single_use=True))), rebuild)
    out, stats = rewrite("""
graph @t(%a: f32[b,4]) -> (%y, %z) {
  %n: f32[b,4] = neg(%a)
  %m: f32[b,4] = abs(%n)
  %y: f32[b,4] = neg(%m)
  %z: f32[b,4] = exp(%m)
  return %y, %z
}""", rule)
    assert stats == {"abs_neg": 1}
    assert body(out) == ["%n: f32[b,4] = neg(%a)", "%m: f32[b,4] = abs(%n)", "%abs: f32[b,4] = abs(%a)",
                         "%y: f32[b,4] = neg(%abs)", "%z: f32[b,4] = exp(%m)"]


def test_a_consumed_name_is_reused_only_when_its_old_node_dies():
    """neg(exp(neg(neg(x)))) -> neg(exp(x)), rebuilding the exp under its own name: if the old
    exp still has a reader the rewrite is declined, not applied half-way."""
    def rebuild(rw, m):
        e = m.node("e")
        rw.claim(e)
        return rw.add("neg", [rw.add("exp", [m["x"]], name=e.outputs[0])])
    rule = Rule("rebuild", Pat("neg", Pat("exp", Pat("neg", Pat("neg", Pat.var("x"))), name="e")), rebuild)
    shared = """
graph @t(%a: f32[b,4]) -> (%y, %z) {
  %n1: f32[b,4] = neg(%a)
  %n2: f32[b,4] = neg(%n1)
  %e: f32[b,4] = exp(%n2)
  %y: f32[b,4] = neg(%e)
  %z: f32[b,4] = tanh(%e)
  return %y, %z
}"""
    out, stats = rewrite(shared, rule)
    assert stats == {} and body(out) == body(parse_graph(shared))
    out, stats = rewrite(shared.replace("tanh(%e)", "tanh(%a)"), rule)
    assert stats == {"rebuild": 1}
    assert body(out) == ["%n1: f32[b,4] = neg(%a)", "%n2: f32[b,4] = neg(%n1)", "%e: f32[b,4] = exp(%a)",
                         "%y: f32[b,4] = neg(%e)", "%z: f32[b,4] = tanh(%a)"]


# ------------------------------------------------------------------------------- the walk

def test_new_nodes_are_matched_at_once():
    """abs(neg(x)) -> abs(x) builds an abs whose operand is an abs: the second rule sees it in
    the same sweep, and the final node keeps the root's name."""
    def abs_of(rw, m):
        return rw.add("abs", [m["x"]])
    rules = [Rule("abs_neg", Pat("abs", Pat("neg", Pat.var("x"), single_use=True)), abs_of),
             Rule("abs_abs", Pat("abs", Pat("abs", Pat.var("x"), single_use=True)), abs_of)]
    out, stats = rewrite("""
graph @t(%a: f32[b,4]) -> (%o) {
  %i: f32[b,4] = abs(%a)
  %n: f32[b,4] = neg(%i)
  %y: f32[b,4] = abs(%n)
  %o: f32[b,4] = exp(%y)
  return %o
}""", *rules)
    assert stats == {"abs_neg": 1, "abs_abs": 1}
    assert body(out) == ["%y: f32[b,4] = abs(%a)", "%o: f32[b,4] = exp(%y)"]


def test_fixpoint_across_sweeps():
    """A later rewrite (dropping a dead identity) makes an earlier value single-use: the next
    sweep folds the chain before it."""
    out, stats = rewrite("""
graph @t(%a: f32[b,4]) -> (%o) {
  %n: f32[b,4] = neg(%a)
  %y: f32[b,4] = neg(%n)
  %w: f32[b,4] = identity(%n)
  %o: f32[b,4] = tanh(%y)
  return %o
}""", DOUBLE_NEG_OWNED, IDENTITY)
    assert stats == {"identity": 1, "double_neg": 1}
    assert body(out) == ["%o: f32[b,4] = tanh(%a)"]


def test_rules_that_undo_each_other_are_a_pass_error():
    def swap(op):
        return lambda rw, m: rw.add(op, [m["x"]])
    rules = [Rule("to_abs", Pat("neg", Pat.var("x")), swap("abs")),
             Rule("to_neg", Pat("abs", Pat.var("x")), swap("neg"))]
    g = parse_graph("""
graph @t(%a: f32[b,4]) -> (%o) {
  %y: f32[b,4] = neg(%a)
  %o: f32[b,4] = exp(%y)
  return %o
}""")
    with pytest.raises(PassError, match="fixpoint"):
        rewrite_graph(g, RuleSet(rules))


def test_unchanged_graph_is_returned_as_is():
    g = parse_graph("""
graph @t(%a: f32[b,4]) -> (%o) {
  %o: f32[b,4] = exp(%a)
  return %o
}""")
    out, stats = rewrite_graph(g, RuleSet([DOUBLE_NEG]))
    assert out is g and stats == {}


# ---------------------------------------------------------------------------- output names

def test_graph_outputs_keep_their_names():
    out, stats = rewrite("""
graph @t(%x: f32[b,4]) -> (%o1, %o2, %o3, %o4) {
  %o1: f32[b,4] = identity(%x)
  %r: f32[b,4] = relu(%x)
  %o2: f32[b,4] = identity(%r)
  %o3: f32[b,4] = identity(%r)
  %t: f32[b,4] = tanh(%x)
  %i: f32[b,4] = identity(%t)
  %o4: f32[b,4] = neg(%i)
  return %o1, %o2, %o3, %o4
}""", IDENTITY)
    # o1 would take an input's name and o3 a value that already became o2: both kept (and
    # counted once, however many sweeps run); r takes o2's name, and o3 reads it under it
    assert stats == {"identity": 2, "kept_for_output": 2}
    assert body(out) == ["%o1: f32[b,4] = identity(%x)", "%o2: f32[b,4] = relu(%x)", "%o3: f32[b,4] = identity(%o2)",
                         "%t: f32[b,4] = tanh(%x)", "%o4: f32[b,4] = neg(%t)"]
    assert "r" not in out.values and "i" not in out.values


def test_a_replacement_of_another_type_is_a_pass_error():
    rule = Rule("bad", Pat("cast", Pat.var("x")), source)   # no same-type condition: a bug in the rule
    g = parse_graph("""
graph @t(%a: f32[b,4]) -> (%o) {
  %c: f16[b,4] = cast(%a) {"dtype": "f16"}
  %o: f16[b,4] = neg(%c)
  return %o
}""")
    with pytest.raises(PassError, match="f16"):
        rewrite_graph(g, RuleSet([rule]))


def test_rule_sets_and_patterns_refuse_mistakes():
    with pytest.raises(ValueError, match="unique"):
        RuleSet([IDENTITY, IDENTITY])
    with pytest.raises(ValueError, match="two operand"):
        Pat("neg", Pat.var(), commute=True)
