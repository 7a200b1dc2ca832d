"""`load_plan`: a cached plan JSON is re-derived from the graph and its key, never trusted.

Hand-built graphs; a genuine plan loads back unchanged (with and without reuse, with alias
groups), and every way of damaging one (other key, other bucket, offsets, order, attrs,
types, shapes of the JSON itself) is a PlanError naming what is wrong.
"""
from __future__ import annotations

import copy
import json

import pytest
import torch

from graphmode.backends.cpu.executor import CpuExecutable
from graphmode.errors import PlanError
from graphmode.ir.interpreter import interpret
from graphmode.ir.parser import parse_graph
from graphmode.plan.execution import lower, load_plan
from graphmode.plan.memory import plan_memory
from graphmode.runtime.cache import make_key
from graphmode.verify.numerics import rel_l2

TEXT = """graph @t(%x: f32[batch,16]) -> (%y) {
  dims batch=1..4
  param %w: f32[16] = [%s]
  %a: f32[batch,16] = relu(%x)
  %b: f32[batch,16] = softmax(%a) {"dim": -1}
  %c: f32[batch,16] = add(%b, %a)
  %r: f32[batch,4,4] = reshape(%c) {"shape": ["batch", 4, 4]}
  %f: f32[batch,16] = reshape(%r) {"shape": ["batch", 16]}
  %y: f32[batch,16] = mul(%f, %w)
  return %y
}""".replace("%s", ", ".join(str(0.5 + i / 16) for i in range(16)))


@pytest.fixture(scope="module")
def graph():
    return parse_graph(TEXT)


def key_for(graph, env) -> dict[str, str]:
    return make_key(graph.structural_hash(), "recipe0", "host", env)


def stored(graph, env, *, reuse=True, alias_groups=()) -> dict:
    """The plan JSON as the cache holds it."""
    plan = lower(graph, plan_memory(graph, env, reuse=reuse, alias_groups=alias_groups))
    plan.built_for = key_for(graph, env)
    return json.loads(json.dumps(plan.to_json()))


def load(graph, data, env, **kw):
    return load_plan(data, graph, env, built_for=key_for(graph, env), **kw)


@pytest.mark.parametrize("reuse", [True, False])
@pytest.mark.parametrize("groups", [[], [["x", "y"]]])
@pytest.mark.parametrize("batch", [1, 3])
def test_genuine_plan_loads_back_unchanged(graph, reuse, groups, batch):
    env = {"batch": batch}
    data = stored(graph, env, reuse=reuse, alias_groups=groups)
    plan = load(graph, copy.deepcopy(data), env, reuse=reuse, alias_groups=groups)
    assert plan.to_json() == data and plan.built_for == key_for(graph, env)


def test_loaded_plan_runs_like_the_interpreter(graph):
    env = {"batch": 3}
    plan = load(graph, stored(graph, env), env)
    x = torch.randn(3, 16)
    got = CpuExecutable(plan, graph.constants, tactics=False).run({"x": x})["y"]
    assert rel_l2(got, interpret(graph, {"x": x})["y"]) < 1e-6


def _offsets(data, fn):
    for slot in data["slots"].values():
        if "offset" in slot:
            slot["offset"] = fn(slot["offset"])


def _swap_first_two(data):
    ins = data["instructions"]
    ins[0], ins[1] = ins[1], ins[0]


def _set(path, value):
    def edit(data):
        *head, last = path
        d = data
        for k in head:
            d = d[k]
        d[last] = value
    return edit


TAMPERS = {
    "other_key": (_set(["built_for", "recipe_hash"], "recipe1"), "built for another key"),
    "no_key": (lambda d: d.pop("built_for"), "built for another key"),
    "zeroed_offsets": (lambda d: _offsets(d, lambda o: 0), "live together and overlap"),
    "offset_past_arena": (lambda d: _offsets(d, lambda o: o + (1 << 20)), "outside the"),
    "alias_moved": (_set(["slots", "f", "offset"], 1 << 20), r"aliases %\w+ but sits at"),
    "negative_offset": (_set(["slots", "x", "offset"], -64), "outside the|overlap"),
    "misaligned_offset": (lambda d: _offsets(d, lambda o: o + 4), "aligned"),
    "offset_not_int": (_set(["slots", "a", "offset"], 64.0), "integer arena offset"),
    "offset_bool": (_set(["slots", "a", "offset"], True), "integer arena offset"),
    "offset_missing": (lambda d: d["slots"]["b"].pop("offset"), "integer arena offset"),
    "arena_grown": (lambda d: d.update(arena_bytes=d["arena_bytes"] + 64), "arena_bytes is"),
    "arena_huge": (lambda d: d.update(arena_bytes=10**15), "arena_bytes is"),
    "arena_shrunk": (lambda d: d.update(arena_bytes=1), "outside the|exceeds the arena"),
    "arena_str": (lambda d: d.update(arena_bytes="4096"), "not an integer"),
    "lower_bound": (lambda d: d.update(lower_bound_bytes=0), "at lower_bound_bytes"),
    "dropped_instruction": (lambda d: d["instructions"].pop(2), "each of the 6 nodes once"),
    "duplicated_instruction": (lambda d: d["instructions"].append(d["instructions"][0]), "each of the 6 nodes"),
    "reordered": (_swap_first_two, "before any step defines it"),
    "node_index_str": (_set(["instructions", 0, "node_index"], "0"), "integer node_index"),
    "attrs": (_set(["instructions", 1, "attrs", "dim"], 0), r"at instructions\[1\]"),
    "op": (_set(["instructions", 2, "op"], "sub"), r"at instructions\[2\]"),
    "kind_view_to_aten": (_set(["instructions", 3, "kind"], "aten"), r"at instructions\[3\]"),
    "inputs": (_set(["instructions", 2, "inputs"], ["a", "a"]), r"at instructions\[2\]"),
    "slot_shape": (_set(["slots", "y", "shape"], [1, 16]), "at slots.y"),
    "slot_dtype": (_set(["slots", "c", "dtype"], "f16"), "at slots.c"),
    "const_slot": (_set(["slots", "w", "const"], "x"), "at slots.w"),
    "extra_slot": (_set(["slots", "z"], {"dtype": "f32", "shape": [1], "offset": 0}), "at slots.z"),
    "env": (_set(["env", "batch"], 4), "at env"),
    "outputs": (_set(["outputs"], ["c"]), "at outputs"),
    "graph_hash": (_set(["graph_hash"], "0" * 16), "at graph_hash"),
    "instructions_dict": (_set(["instructions"], {}), "no instruction list"),
    "slots_list": (_set(["slots"], []), "integer arena offset"),
}


@pytest.mark.parametrize("name", sorted(TAMPERS))
def test_tampered_plan_is_refused(graph, name):
    env = {"batch": 3}
    data = stored(graph, env)
    edit, message = TAMPERS[name]
    edit(data)
    with pytest.raises(PlanError, match=message):
        load(graph, data, env)


def test_plan_of_another_bucket_is_refused_even_relabelled(graph):
    data = stored(graph, {"batch": 4})
    with pytest.raises(PlanError, match="built for another key"):
        load(graph, copy.deepcopy(data), {"batch": 1})
    data["built_for"] = key_for(graph, {"batch": 1})
    with pytest.raises(PlanError):
        load(graph, data, {"batch": 1})


@pytest.mark.parametrize("data", [[], "plan", None, 3])
def test_plan_that_is_not_an_object_is_refused(graph, data):
    with pytest.raises(PlanError, match="not an object"):
        load(graph, data, {"batch": 1})


def test_plan_built_with_other_reuse_setting_is_refused(graph):
    env = {"batch": 3}
    data = stored(graph, env, reuse=False)
    if data == stored(graph, env, reuse=True):
        pytest.skip("this graph plans the same either way")
    with pytest.raises(PlanError):
        load(graph, data, env, reuse=True)
