"""Index inputs are found in the IR and checked against their tables before a plan (or an eager
fallback) runs: analysis/indices.py, runtime/bounds.py, the verdict's refusals, the recipe's
`range` and `pad_value` checks, and `graphmode run` / `profile` on models whose tables are
smaller than a generic input generator assumes."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.utils._pytree as pytree
import torch.nn as nn

import graphmode
from graphmode.analysis.indices import analyze_indices
from graphmode.compiler import capture
from graphmode.errors import ContractViolation, RecipeError
from graphmode.recipe import load_recipe
from graphmode.verdict import ContractRefused

E2E = Path(__file__).resolve().parents[2] / "e2e"
sys.path.insert(0, str(E2E))
from tiny_models import INDEXED_INPUTS, indexed, recipe  # noqa: E402

SPEC = f"{E2E / 'tiny_models.py'}:indexed"
DIMS = {"batch": {"buckets": [1, 2]}, "seq": {"buckets": [4, 8], "min": 2}}


def _recipe(inputs=None, dims=None, **over):
    return recipe("indexed", inputs or [dict(i) for i in INDEXED_INPUTS], dims or DIMS, **over)


@pytest.fixture(scope="module")
def cm(tmp_path_factory):
    return graphmode.compile(SPEC, _recipe(), cache_dir=tmp_path_factory.mktemp("cache"))


def _ok_inputs(batch=2, seq=5):
    g = torch.Generator().manual_seed(1)
    return {"ids": torch.randint(0, 50, (batch, seq), generator=g),
            "token_type_ids": torch.randint(0, 2, (batch, seq), generator=g),
            "mask": torch.ones(batch, seq, dtype=torch.long)}


# ---- the analysis ----------------------------------------------------------------------------------

class _Shifted(nn.Module):
    """Every trail the analysis follows (a view, a cast, +/- a constant) and one it must not
    (a product), next to index_select, gather and advanced indexing."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.register_buffer("rows", torch.randn(7, 4))
        self.register_buffer("cols", torch.randn(3, 6))

    def forward(self, a, b, c, d, e):
        x = self.emb((a + 1).reshape(a.shape[0], -1))           # a + 1 in [0, 9]: a in [-1, 8]
        y = torch.index_select(self.rows, 0, (b - 2).to(torch.int32).reshape(-1))   # b in [2, 8]
        z = torch.gather(self.cols, 1, c)                        # c in [0, 5]
        w = self.rows[d]                                         # index: d in [-7, 6]
        v = self.emb(e * 2)                                      # not a shift: no check on e
        return x.sum() + y.sum() + z.sum() + w.sum() + v.sum()


def test_analysis_follows_views_casts_and_constant_shifts_only():
    ex = {"a": torch.zeros(2, 3, dtype=torch.long), "b": torch.full((3,), 2, dtype=torch.long),
          "c": torch.zeros(3, 2, dtype=torch.long), "d": torch.zeros(4, dtype=torch.long),
          "e": torch.zeros(2, dtype=torch.long)}
    from graphmode.capture.spec import bundle_from_module
    dims = {k: (["n", 3] if k == "a" else list(v.shape)) for k, v in ex.items()}
    bundle = bundle_from_module(_Shifted(), ex, dims)
    inputs = [{"name": k, "dtype": "i64", "shape": d} for k, d in dims.items()]
    g, _, _ = capture(bundle, recipe("shifted", inputs, {"n": {"buckets": [2, 4]}}))
    rep = analyze_indices(g)
    got = {n: (b.lo, b.hi) for n, b in rep.inputs.items()}
    assert got == {"a": (-1, 8), "b": (2, 8), "c": (0, 5), "d": (-7, 6)}, rep.to_json()
    assert rep.inputs["d"].uses[0].negative_ok and not rep.inputs["a"].uses[0].negative_ok


class _Columns(nn.Module):
    """One input of sparse features, a table per column (a recommender's `x[:, i]`), and one of
    categorical features sharing a table through per-column offsets (FT-Transformer's
    `x + offsets[None]`); a column read after a reshape is not the input's column: no check."""

    def __init__(self):
        super().__init__()
        self.tables = nn.ModuleList([nn.Embedding(n, 4) for n in (100, 50, 10)])
        self.shared = nn.Embedding(22, 4)
        self.register_buffer("offsets", torch.tensor([0, 7, 10]))

    def forward(self, sparse, cat, flat):
        a = sum(self.tables[i](sparse[:, i]).sum() for i in range(3))
        b = self.shared(cat + self.offsets[None]).sum()
        c = self.tables[2](flat.reshape(-1, 3)[:, 1]).sum()
        return a + b + c


def test_analysis_bounds_each_column_that_indexes_a_table_of_its_own():
    ex = {k: torch.zeros(4, 3, dtype=torch.long) for k in ("sparse", "cat", "flat")}
    from graphmode.capture.spec import bundle_from_module
    dims = {k: ["n", 3] for k in ex}
    bundle = bundle_from_module(_Columns(), ex, dims)
    inputs = [{"name": k, "dtype": "i64", "shape": d} for k, d in dims.items()]
    g, _, _ = capture(bundle, recipe("columns", inputs, {"n": {"buckets": [2, 4]}}))
    rep = analyze_indices(g)
    assert not rep.inputs, rep.to_json()
    got = {(name, axis, col): (b.lo, b.hi) for (name, axis, col), b in rep.columns.items()}
    assert got == {("sparse", 1, 0): (0, 99), ("sparse", 1, 1): (0, 49), ("sparse", 1, 2): (0, 9),
                   ("cat", 1, 0): (0, 21), ("cat", 1, 1): (-7, 14), ("cat", 1, 2): (-10, 11)}, rep.to_json()

    from graphmode.runtime.bounds import check_values, draw_within, value_checks
    checks = value_checks(load_recipe(recipe("columns", inputs, {"n": {"buckets": [2, 4]}})), rep)
    ok = {"sparse": torch.tensor([[99, 49, 9], [0, 0, 0]]), "cat": torch.tensor([[21, 14, 11]])}
    check_values(ok, checks)                          # each column up to its own table's last row
    with pytest.raises(ContractViolation, match=r"holds 50 at position \[1, 1\].*column 1 of axis 1") as e:
        check_values({"sparse": torch.tensor([[0, 0, 0], [0, 50, 0]])}, checks)
    assert "sparse[:, 1] values in [0, 49]" in e.value.fix
    drawn = draw_within({"sparse": torch.full((64, 3), 99)}, checks)["sparse"]
    assert drawn[:, 0].eq(99).all() and drawn[:, 1].max() <= 49 and drawn[:, 2].max() <= 9
    check_values({"sparse": drawn}, checks)


class _Writes(nn.Module):
    """KV-cache style writes: rows copied in at given positions, steps written from a start
    index (w + arange over its own axis: each start writes 3 rows), and a sum the analysis
    must not read as one (u + arange along the same axis pairs each value with one step)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.zeros(2, 8, 4))

    def forward(self, pos, k, w, v, u):
        a = self.cache.index_copy(1, pos, k)
        idx = (w[:, None] + torch.arange(3))[:, :, None].expand(-1, -1, 4)
        b = torch.scatter(self.cache, 1, idx, v)
        c = self.cache.index_copy(1, u + torch.arange(2), v[:, :2])
        return a + b + c


def test_analysis_bounds_the_positions_a_write_takes():
    ex = {"pos": torch.tensor([0, 3]), "k": torch.randn(2, 2, 4), "w": torch.tensor([0, 5]),
          "v": torch.randn(2, 3, 4), "u": torch.tensor([0, 2])}
    from graphmode.capture.spec import bundle_from_module
    dims = {k: (["n"] + list(v.shape[1:]) if k == "pos" else ["2", "n", 4] if k == "k" else list(v.shape))
            for k, v in ex.items()}
    dims["k"] = [2, "n", 4]
    bundle = bundle_from_module(_Writes(), ex, dims)
    inputs = [{"name": k, "dtype": "i64" if v.dtype == torch.long else "f32", "shape": dims[k]} for k, v in ex.items()]
    g, _, _ = capture(bundle, recipe("writes", inputs, {"n": {"min": 1, "max": 8}}))
    assert not [n for n in g.nodes if n.op == "fallback"], "a write over a symbolic dim is a graph op"
    rep = analyze_indices(g)
    got = {n: (b.lo, b.hi) for n, b in rep.inputs.items()}
    assert got == {"pos": (0, 7), "w": (0, 5)}, rep.to_json()
    assert "writes into the 8 rows" in rep.inputs["w"].describe()


def test_analysis_finds_ids_token_types_and_the_position_limit():
    g, _, _ = capture(SPEC, _recipe())
    rep = analyze_indices(g)
    assert {n: (b.lo, b.hi) for n, b in rep.inputs.items()} == {"ids": (0, 49), "token_type_ids": (0, 1)}
    assert "mask" not in rep.inputs
    assert rep.dims["seq"].max == 16 and rep.dims["seq"].rows == 16


class _CountedPositions(nn.Module):
    """RoBERTa's positions: counted from the ids that are not padding, from pad + 1."""

    def __init__(self, pad: int = 1, rows: int = 20):
        super().__init__()
        self.pad = pad
        self.pos = nn.Embedding(rows, 4, padding_idx=pad)

    def forward(self, ids, scale):
        keep = ids.ne(self.pad).int()
        positions = (torch.cumsum(keep, dim=1).type_as(keep) * keep).long() + self.pad
        counted = torch.cumsum(keep, dim=1) + 3      # + a constant after the count: still a count, from 3
        return self.pos(positions).sum(-1) * scale + counted * (keep + 1)     # keep + 1 is no longer 0/1


@pytest.mark.parametrize("onnx", [False, True])
def test_positions_counted_from_the_ids_bound_the_seq_dim(onnx, tmp_path):
    """0..seq counted by a cumsum of a bool cast (times it) and shifted by the pad id pick rows
    1..seq+1: seq <= rows - 2. An XLM-R ONNX draft went to the table's 128 rows, and every request
    padded to that bucket failed in the gather kernel."""
    from graphmode.capture.spec import bundle_from_module
    ex = {"ids": torch.randint(2, 9, (2, 6)), "scale": torch.ones(2, 6)}
    bundle = bundle_from_module(_CountedPositions().eval(), ex, {"ids": ["batch", "seq"], "scale": ["batch", "seq"]})
    model = bundle
    if onnx:
        from graphmode.capture.onnx_export import export_onnx
        model = export_onnx(bundle, tmp_path / "counted.onnx").path
    inputs = [{"name": "ids", "dtype": "i64", "shape": ["batch", "seq"]},
              {"name": "scale", "dtype": "f32", "shape": ["batch", "seq"]}]
    g, _, _ = capture(model, recipe("counted", inputs, {"batch": {"buckets": [1, 2]}, "seq": {"buckets": [4, 8]}}))
    rep = analyze_indices(g)
    assert rep.dims["seq"].max == 18 and rep.dims["seq"].rows == 20, rep.to_json()
    if onnx:                                        # an ONNX file has no config: the draft stops there too
        from graphmode.kb.draft import draft_recipe
        d = draft_recipe(model, kb_path=None)
        assert d.recipe.dims["seq"].max == 18 and "20 rows" in d.notes["dims.seq"], d.notes["dims.seq"]


# ---- the runtime check -----------------------------------------------------------------------------

@pytest.mark.parametrize("name,bad", [("ids", 50), ("ids", -1), ("ids", 10**9), ("ids", 2**63 - 1),
                                      ("ids", -2**63), ("token_type_ids", 2)])
def test_out_of_range_values_are_refused_with_input_value_position_and_range(cm, name, bad):
    x = _ok_inputs()
    x[name][1, 3] = bad
    with pytest.raises(ContractViolation) as e:
        cm(**x)
    err = e.value
    hi = 49 if name == "ids" else 1
    assert err.kind == "input" and err.where == f"inputs.{name}" and err.value == bad
    assert f"holds {bad} at position [1, 3]" in err.message and f"[0, {hi}]" in err.message, err.message
    assert f"values in [0, {hi}]" in err.fix
    assert cm.last_path.get("path") != "graph" or cm.events["violated_calls"] >= 1


def test_values_at_the_edges_of_the_range_run_and_match_eager(cm):
    x = _ok_inputs()
    x["ids"][0, 0], x["ids"][1, 4] = 0, 49
    x["token_type_ids"][0, 1] = 1
    out = torch.utils._pytree.tree_leaves(cm(**x))[0]
    ref = torch.utils._pytree.tree_leaves(cm.source.reference(x))[0]
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)


def test_the_checks_travel_in_an_artifact_and_load_back_equal(cm, tmp_path):
    from graphmode.runtime.bounds import bounds_doc, bounds_from_doc
    values, dims = cm.bounds()
    assert bounds_from_doc(json.loads(json.dumps(bounds_doc(values, dims)))) == (values, dims)
    cm.save(tmp_path / "indexed.gm")
    loaded = graphmode.load(tmp_path / "indexed.gm", cache_dir=tmp_path / "cache")
    assert loaded.bounds() == (values, dims)          # read from the manifest, not derived again
    x = _ok_inputs()
    x["ids"][1, 3] = 50
    with pytest.raises(ContractViolation, match=r"holds 50 at position \[1, 3\]"):
        loaded(**x)


def test_a_declared_range_is_checked_and_named(tmp_path):
    inputs = [dict(i) for i in INDEXED_INPUTS]
    inputs[0]["range"] = [0, 39]
    m = graphmode.compile(SPEC, _recipe(inputs=inputs), cache_dir=tmp_path)
    x = _ok_inputs()
    x["ids"][0, 2] = 45                               # inside the table, outside the recipe's range
    with pytest.raises(ContractViolation) as e:
        m(**x)
    assert e.value.where == "inputs.ids.range" and "[0, 39]" in e.value.message
    assert "the recipe's inputs.ids.range" in e.value.message


def test_a_dim_past_the_models_positions_is_refused_before_the_eager_fallback(tmp_path):
    m = graphmode.compile(SPEC, _recipe(on_violation="eager"), cache_dir=tmp_path)
    x = _ok_inputs(1, 12)                             # outside the contract: eager would run it
    m(**x)
    assert m.last_path["path"] == "eager"
    x = _ok_inputs(1, 20)                             # past the 16 positions: eager would fail
    with pytest.raises(ContractViolation) as e:
        m(**x)
    assert e.value.where == "dims.seq" and "16 positions" in e.value.message and e.value.value == 20
    assert e.value.fix.startswith("send seq of at most 16: the model itself")


def test_past_the_positions_the_fix_names_the_recipes_tighter_range(cm):
    """The fix said "at most 16" where the recipe admits 8: following it met another refusal."""
    with pytest.raises(ContractViolation) as e:
        cm(**_ok_inputs(1, 20))
    assert e.value.fix.startswith("send seq of at most 8 (the recipe's range [2, 8]"), e.value.fix


def test_sample_inputs_are_drawn_inside_the_tables(cm):
    x = cm.source.make_inputs({"batch": 2, "seq": 8}, seed=0)
    x["ids"] += 1000                                   # what a generic generator may produce
    from graphmode.runtime.bounds import draw_within
    y = draw_within(x, cm.bounds()[0], seed=0)
    assert int(y["ids"].max()) <= 49 and int(y["ids"].min()) >= 0
    assert torch.equal(y["mask"], x["mask"])
    cm(**cm.sample_inputs({"batch": 2, "seq": 8}))


# ---- the verdict -----------------------------------------------------------------------------------

def test_verdict_refuses_pad_values_ranges_and_dims_the_tables_cannot_take():
    inputs = [dict(i) for i in INDEXED_INPUTS]
    inputs[0]["pad_value"] = 50
    inputs[1]["range"] = [0, 2]
    r = _recipe(inputs=inputs, dims={"batch": {"buckets": [1, 2]}, "seq": {"buckets": [4, 32], "min": 2}})
    with pytest.raises(ContractRefused) as e:
        graphmode.compile(SPEC, r)
    where = {i.where: i for i in e.value.issues}
    assert set(where) == {"inputs[0].pad_value", "inputs[1].range", "dims.seq"}, e.value.render()
    assert "[0, 49]" in where["inputs[0].pad_value"].message
    assert where["inputs[1].range"].fix == "range: [0, 1]"
    assert "16 positions" in where["dims.seq"].message and e.value.exit_code == 1


# ---- the recipe --------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["i64", "f32"])
def test_a_boolean_pad_value_is_refused_on_a_non_bool_input(dtype):
    r = recipe("p", [{"name": "x", "dtype": dtype, "shape": ["b"], "pad_value": True}], {"b": {"buckets": [1]}})
    with pytest.raises(RecipeError) as e:
        load_recipe(r)
    assert "inputs[0].pad_value" in str(e.value) and "write the number (1)" in str(e.value)
    ok = recipe("p", [{"name": "x", "dtype": "bool", "shape": ["b"], "pad_value": True}], {"b": {"buckets": [1]}})
    assert load_recipe(ok).inputs[0].pad_value == 1


@pytest.mark.parametrize("inp,needle", [
    ({"dtype": "f32", "range": [0, 3]}, "for integer inputs"),
    ({"dtype": "i8", "range": [0, 300]}, "inside i8"),
    ({"dtype": "i64", "range": [5, 9]}, "pad value 0 is outside"),
    ({"dtype": "i64", "range": [9, 5]}, "lo 9 is above hi 5"),
    ({"dtype": "i64", "range": [1]}, "two integers")])
def test_recipe_range_is_validated(inp, needle):
    r = recipe("p", [{"name": "x", "shape": ["b"], **inp}], {"b": {"buckets": [1]}})
    with pytest.raises(RecipeError, match=needle):
        from graphmode.recipe import validate
        rec = load_recipe(r)
        validate(rec, "host").raise_for_errors()


def test_a_range_leaves_the_hash_of_recipes_without_one_unchanged():
    base = recipe("p", [{"name": "x", "dtype": "i64", "shape": ["b"]}], {"b": {"buckets": [1]}})
    with_range = recipe("p", [{"name": "x", "dtype": "i64", "shape": ["b"], "range": [0, 9]}], {"b": {"buckets": [1]}})
    assert "range" not in json.loads(load_recipe(base).model_dump_json(exclude_none=True))["inputs"][0]
    assert load_recipe(base).hash() != load_recipe(with_range).hash()


# ---- ONNX ----------------------------------------------------------------------------------------

def _onnx_embedding(rows: int):
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    emb = np.random.default_rng(0).standard_normal((rows, 4)).astype(np.float32)
    g = helper.make_graph([helper.make_node("Gather", ["emb", "ids"], ["y"], name="embed")], "g",
                          [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 4])],
                          initializer=[numpy_helper.from_array(emb, "emb")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


ONNX_RECIPE = """version: 1
name: onnx-embed
inputs: [{name: ids, dtype: i64, shape: [batch, seq]}]
dims: {batch: {buckets: [1, 2]}, seq: {buckets: [4, 8], min: 2}}
codegen: {kernel_selection: heuristic}
"""


def test_graphmode_run_on_an_onnx_model_with_a_small_table_runs_and_refuses_bad_ids(tmp_path, capsys):
    import onnx

    from graphmode.cli import main
    path = tmp_path / "embed.onnx"
    onnx.save(_onnx_embedding(30), str(path))       # run's generic ids go up to 1000
    rec = tmp_path / "r.yaml"
    rec.write_text(ONNX_RECIPE)
    with pytest.raises(SystemExit) as e:
        main(["run", "--model", str(path), "--recipe", str(rec), "--iters", "1", "--json",
              "--cache-dir", str(tmp_path / "c")])
    out = capsys.readouterr()
    assert e.value.code == 0, out.out + out.err
    assert json.loads(out.out)["numerics_ok"]
    m = graphmode.compile(str(path), ONNX_RECIPE, cache_dir=tmp_path / "c")
    with pytest.raises(ContractViolation, match=r"holds 30 at position \[0, 1\]"):
        m(ids=torch.tensor([[0, 30, 2, 3]]))
    # ONNX Gather counts negative indices from the end: -30..29 is valid, -31 is not
    last, first = m(ids=torch.tensor([[-1, -30, 2, 3]])), m(ids=torch.tensor([[29, 0, 2, 3]]))
    assert torch.equal(pytree.tree_leaves(last)[0], pytree.tree_leaves(first)[0])
    with pytest.raises(ContractViolation, match="-31"):
        m(ids=torch.tensor([[0, -31, 2, 3]]))


def test_an_onnx_model_with_an_empty_table_is_refused_at_compile(tmp_path, capsys):
    import onnx

    from graphmode.cli import main
    path = tmp_path / "empty.onnx"
    onnx.save(_onnx_embedding(0), str(path))
    rec = tmp_path / "r.yaml"
    rec.write_text(ONNX_RECIPE)
    with pytest.raises(Exception) as e:
        graphmode.compile(str(path), ONNX_RECIPE, cache_dir=tmp_path / "c")
    assert "0 rows" in str(e.value), str(e.value)
    with pytest.raises(SystemExit) as x:
        main(["run", "--model", str(path), "--recipe", str(rec), "--cache-dir", str(tmp_path / "c")])
    text = "".join(capsys.readouterr())
    assert x.value.code == 2 and "Traceback" not in text and "0 rows" in text


def test_graphmode_run_refuses_a_shape_past_the_models_positions_with_exit_2(tmp_path, capsys):
    """With on_violation: eager a shape outside the dims runs in eager PyTorch, but one past the
    model's 16 positions would fail there: refused first (#30: an IndexError traceback)."""
    import yaml

    from graphmode.cli import main
    rec = tmp_path / "r.yaml"
    rec.write_text(yaml.safe_dump(_recipe(on_violation="eager")))
    with pytest.raises(SystemExit) as e:
        main(["run", "--model", SPEC, "--recipe", str(rec), "--shape", "1x20", "--cache-dir", str(tmp_path / "c")])
    text = "".join(capsys.readouterr())
    assert e.value.code == 2 and "Traceback" not in text and "16 positions" in text, text


def test_a_loaded_artifact_checks_the_same_inputs(cm, tmp_path):
    """A `.gm` artifact has no captured graph: its optimized graph (fused regions included)
    gives the same checks."""
    cm.save(tmp_path / "m.gm")
    loaded = graphmode.load(tmp_path / "m.gm", cache_dir=tmp_path / "c")
    assert [(c.input, c.lo, c.hi) for c in loaded.bounds()[0]] == [(c.input, c.lo, c.hi) for c in cm.bounds()[0]]
    x = _ok_inputs()
    x["token_type_ids"][0, 4] = 7
    with pytest.raises(ContractViolation, match=r"holds 7 at position \[0, 4\]"):
        loaded(**x)


def test_profile_shows_the_cost_of_the_checks(cm):
    from graphmode.bench.profile import profile_bucket
    prof = profile_bucket(cm, cm.recipe, {"batch": 1, "seq": 4}, cm.target, runs=3, eager=False)
    assert prof.checked_inputs == ["ids", "token_type_ids"] and prof.check_s is not None and prof.check_s > 0
    assert prof.to_json()["check_ms"] is not None
