"""Sizes only the data decides (x[mask], nonzero, unique, masked_select, where(cond)): under
exe_mode hybrid the plan runs up to them and the rest runs eagerly after it (capture/tail.py,
runtime/tail.py), with answers equal to eager at padded batches, from a draft and from a .gm."""
from __future__ import annotations

import pytest
import torch

import graphmode
from graphmode.errors import CaptureError
from graphmode.runtime.artifact import ArtifactError


class Select(torch.nn.Module):
    """The heavy part (a linear, tanh) in the plan; what the masks select after it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, ids, x):
        h = torch.tanh(self.proj(x))
        vals, counts = torch.unique(ids, return_counts=True)
        rows, cols = torch.where(h[..., 0] > 0)
        picked = h[h > 0.2] * 2 + 1                           # ops after the size: in the tail too
        found = torch.nonzero(h > 0.5)
        ones = torch.ones(found.shape[0], 2)                  # a size read from a tail tensor
        return {"vals": vals, "counts": counts, "rows": rows, "cols": cols, "picked": picked,
                "found": found, "ones": ones, "masked": torch.masked_select(x, x > 0), "h": h}


RECIPE = {"version": 1, "name": "select", "exe_mode": "hybrid",
          "inputs": [{"name": "ids", "dtype": "i64", "shape": ["batch", 6], "range": [0, 9]},
                     {"name": "x", "dtype": "f32", "shape": ["batch", 6, 4]}],
          "dims": {"batch": {"buckets": [4, 8]}}}


def _inputs(batch: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"ids": torch.randint(0, 10, (batch, 6), generator=g), "x": torch.randn(batch, 6, 4, generator=g)}


def _same(cm, model, inputs) -> None:
    want, got = model(**inputs), cm(**inputs)
    assert list(got) == list(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-6)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    model = Select().eval()
    return model, graphmode.compile((model, _inputs(4, 0)), RECIPE, cache_dir=tmp_path_factory.mktemp("c"))


def test_the_tail_answers_as_eager_at_padded_batches(compiled):
    model, cm = compiled
    for batch, seed in ((1, 1), (3, 2), (4, 3), (5, 4), (8, 5)):
        _same(cm, model, _inputs(batch, seed))
        assert cm.last_path["path"] == "graph" and cm.last_path["bucket"]["batch"] in (4, 8)
    tail = cm.tail.text()
    assert "data_u0" in tail and "aten.nonzero.default" in tail and "aten._unique2.default" in tail
    # the plan outputs what the tail reads (h, the masks), the tail's outputs are the model's
    assert set(cm.graph.outputs) == set(cm.tail.inputs) - {"ids", "x"}
    assert cm.output_names == ["vals", "counts", "rows", "cols", "picked", "found", "ones", "masked", "h"]
    # the tail is not analysed: requests are neither merged nor cut along the batch
    assert not cm.independent_along("batch")


def test_a_saved_tail_runs_from_the_artifact_and_a_damaged_one_is_named(compiled, tmp_path):
    model, cm = compiled
    path = tmp_path / "select.gm"
    cm.save(path)
    loaded = graphmode.load(path, cache_dir=tmp_path / "cache")
    _same(loaded, model, _inputs(6, 7))
    data = path.read_bytes()
    assert data.count(b"aten.nonzero.default") == 1
    (tmp_path / "edited.gm").write_bytes(data.replace(b"aten.nonzero.default", b"aten.nonzerp.default"))
    with pytest.raises(ArtifactError, match=r"tail\.ir is damaged or edited"):
        graphmode.load(tmp_path / "edited.gm", cache_dir=tmp_path / "cache2")


def test_the_draft_runs_a_tail_in_hybrid_and_graph_mode_refuses_it(tmp_path):
    class Rows(torch.nn.Module):
        def forward(self, x):
            return torch.relu(x)[x[:, 0] > 0]
    x = torch.randn(5, 3)
    cm = graphmode.compile((Rows(), (x,)), cache_dir=tmp_path)
    assert cm.recipe.exe_mode == "hybrid" and "aten.index.Tensor" in cm.draft_notes["exe_mode"]
    for batch in (1, 5, 9):
        x = torch.randn(batch, 3)
        assert torch.equal(cm(x), torch.relu(x)[x[:, 0] > 0])
    from graphmode.verdict import ContractRefused
    with pytest.raises(ContractRefused, match=r"exe_mode: the model makes a size only its data decides") as e:
        graphmode.compile((Rows(), (x,)), cache_dir=tmp_path, mode="graph")
    assert "exe_mode: hybrid" in str(e.value)


def test_a_number_read_out_of_the_data_is_refused_naming_the_op(tmp_path):
    class Scaled(torch.nn.Module):
        def forward(self, x):
            return x * (x > 0).sum().item()
    with pytest.raises(CaptureError, match=r"aten\.(item|_local_scalar_dense)\S* at .*test_data_dependent_tail\.py:"
                                           r"\d+ turns tensor data into a Python number") as e:
        graphmode.compile((Scaled(), (torch.randn(2, 5),)), cache_dir=tmp_path, mode="hybrid")
    assert "x * t.sum()" in e.value.fix


def _save(graph, path) -> None:
    import onnx
    from onnx import helper
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))


def _onnx_select(path) -> None:
    """y = relu(x @ W); the positions of y > 0.5 (NonZero) and the rows of x whose y peaks
    above 1 (Compress along the batch), as exporters write x[mask]."""
    import numpy as np
    from onnx import TensorProto, helper
    w = np.random.default_rng(0).standard_normal((4, 4)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Relu", ["h"], ["y"]),
             helper.make_node("Greater", ["y", "half"], ["m"]), helper.make_node("NonZero", ["m"], ["nz"]),
             helper.make_node("Transpose", ["nz"], ["nzt"], perm=[1, 0]),
             helper.make_node("GatherND", ["y", "nzt"], ["sel"]),
             helper.make_node("ReduceMax", ["y"], ["peak"], axes=[1, 2], keepdims=0),
             helper.make_node("Greater", ["peak", "one"], ["keep"]),
             helper.make_node("Compress", ["x", "keep"], ["rows"], axis=0)]
    graph = helper.make_graph(
        nodes, "select", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 6, 4])],
        [helper.make_tensor_value_info("sel", TensorProto.FLOAT, ["n"]),
         helper.make_tensor_value_info("nz", TensorProto.INT64, [3, "n"]),
         helper.make_tensor_value_info("rows", TensorProto.FLOAT, ["k", 6, 4])],
        [helper.make_tensor("W", TensorProto.FLOAT, [4, 4], w.flatten()),
         helper.make_tensor("half", TensorProto.FLOAT, [], [0.5]),
         helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])])
    _save(graph, path)


def test_an_onnx_nonzero_and_compress_run_after_the_plan_as_onnx_runtime_answers(tmp_path):
    import numpy as np
    import onnxruntime as ort
    path = tmp_path / "select.onnx"
    _onnx_select(path)
    from graphmode.kb.draft import draft_recipe
    drafted = draft_recipe(str(path))
    assert drafted.data["exe_mode"] == "hybrid" and "aten.nonzero.default" in drafted.notes["exe_mode"]
    recipe = {"version": 1, "name": "select", "exe_mode": "hybrid", "dims": {"batch": {"buckets": [4, 8]}},
              "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", 6, 4]}]}
    cm = graphmode.compile(str(path), recipe, cache_dir=tmp_path)
    cm.save(tmp_path / "select.gm")
    loaded = graphmode.load(tmp_path / "select.gm", cache_dir=tmp_path / "cache")
    sess = ort.InferenceSession(str(path))
    rng = np.random.default_rng(1)
    for batch in (1, 3, 7):
        x = rng.standard_normal((batch, 6, 4)).astype(np.float32)
        want = sess.run(None, {"x": x})
        for model in (cm, loaded):
            got = model(torch.from_numpy(x))
            got = list(got.values()) if isinstance(got, dict) else list(got)
            assert [tuple(g.shape) for g in got] == [w.shape for w in want]
            for g, w in zip(got, want):
                np.testing.assert_allclose(g.numpy(), w, rtol=1e-5, atol=1e-6)
        assert cm.last_path == {"path": "graph", "bucket": {"batch": 4 if batch <= 4 else 8}}


def _onnx_detector(path) -> None:
    """Boxes and class scores from the plan; NonMaxSuppression, the kept boxes' rows, and the
    distinct classes kept (Unique, first-occurrence order) after it, as a detector's export ends."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper
    rng = np.random.default_rng(0)
    consts = {"Wb": rng.standard_normal((8, 4)).astype(np.float32),
              "Ws": rng.standard_normal((8, 2)).astype(np.float32),
              "max_out": np.array([3], np.int64), "iou": np.array([0.3], np.float32),
              "score": np.array([0.4], np.float32)}
    nodes = [helper.make_node("MatMul", ["x", "Wb"], ["boxes"]), helper.make_node("MatMul", ["x", "Ws"], ["logits"]),
             helper.make_node("Sigmoid", ["logits"], ["prob"]),
             helper.make_node("Transpose", ["prob"], ["scores"], perm=[0, 2, 1]),
             helper.make_node("NonMaxSuppression", ["boxes", "scores", "max_out", "iou", "score"], ["sel"],
                              center_point_box=1),
             helper.make_node("Gather", ["sel", "one"], ["cls"], axis=1),
             helper.make_node("Unique", ["cls"], ["classes"], sorted=0)]
    graph = helper.make_graph(
        nodes, "detector", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 10, 8])],
        [helper.make_tensor_value_info("sel", TensorProto.INT64, ["n", 3]),
         helper.make_tensor_value_info("classes", TensorProto.INT64, ["k"])],
        [onnx.numpy_helper.from_array(v, k) for k, v in consts.items()]
        + [helper.make_tensor("one", TensorProto.INT64, [], [1])])
    _save(graph, path)


def test_an_onnx_detector_ends_in_nms_and_unique_and_its_gm_loads_in_a_fresh_process(tmp_path):
    import subprocess
    import sys
    import numpy as np
    import onnxruntime as ort
    path = tmp_path / "detector.onnx"
    _onnx_detector(path)
    recipe = {"version": 1, "name": "detector", "exe_mode": "hybrid", "dims": {"batch": {"buckets": [2, 4]}},
              "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", 10, 8]}]}
    cm = graphmode.compile(str(path), recipe, cache_dir=tmp_path)
    sess = ort.InferenceSession(str(path))
    rng = np.random.default_rng(2)
    xs = [rng.standard_normal((b, 10, 8)).astype(np.float32) for b in (1, 3, 4)]
    for x in xs:
        got, want = cm(torch.from_numpy(x)), sess.run(None, {"x": x})
        assert [g.tolist() for g in got] == [w.tolist() for w in want]
        assert len(want[0]) > 0 and cm.last_path["path"] == "graph"
    cm.save(tmp_path / "detector.gm")
    np.save(tmp_path / "x.npy", xs[1])
    script = ("import graphmode, numpy, torch, sys; m = graphmode.load(sys.argv[1], cache_dir=sys.argv[2]); "
              "print([t.tolist() for t in m(torch.from_numpy(numpy.load(sys.argv[3])))])")
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "detector.gm"), str(tmp_path / "c2"),
                          str(tmp_path / "x.npy")], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == str([w.tolist() for w in sess.run(None, {"x": xs[1]})])


class MutatesAfter(torch.nn.Module):
    def forward(self, x):
        y = x[x > 0]        # selected from the x the model received
        x.mul_(2)           # then updated in place (computed in the plan)
        return y


def test_an_input_updated_after_the_selection_is_read_as_received(tmp_path):
    """The tail read the caller's x after the plan's update was copied into it: twice eager's."""
    cm = graphmode.compile((MutatesAfter(), (torch.randn(4, 8),)), cache_dir=tmp_path)
    for batch in (1, 3, 6):
        x = torch.randn(batch, 8)
        xe, xg = x.clone(), x.clone()
        assert torch.equal(cm(xg), MutatesAfter()(xe)) and torch.equal(xg, xe)


class Pooled(torch.nn.Module):
    """A view of the selection (BART's eos pooling: x[mask].view(b, -1, d)) and a reduction over
    it: torch's own checks on the data-dependent size (mod, not, and) were 'unsupported python op'."""

    def forward(self, x, ids):
        h = torch.tanh(x)
        sel = h[ids.eq(2), :]
        return sel.view(-1, 2, 4).sum(1), sel.argmax(0)


MODEL_FILE = '''
import torch
from test_data_dependent_tail import Pooled

def make():
    ids = torch.randint(2, 4, (4, 6)); ids[:, -1] = 2
    return Pooled().eval(), {"x": torch.randn(4, 6, 8), "ids": ids}
'''
POOLED = {"version": 1, "name": "pooled", "exe_mode": "hybrid",
          "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", 6, 8]},
                     {"name": "ids", "dtype": "i64", "shape": ["batch", 6], "range": [2, 3], "pad_value": 3}],
          "dims": {"batch": {"buckets": [2, 4]}}}


def test_a_tail_through_the_cli_and_the_v2_metadata(tmp_path, monkeypatch):
    """compile names the tail, verify and `run FILE.gm` compare the model's outputs (not the plan's
    inner ones), and the KServe metadata lists the model's outputs."""
    import json
    import sys

    import httpx
    import yaml
    from typer.testing import CliRunner

    from graphmode.cli.app import _register, app
    from graphmode.serve import ModelServer, ServeConfig, ServerThread
    (tmp_path / "pooled_model.py").write_text(MODEL_FILE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parent))
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(POOLED))
    spec, rec, gm, cache = f"{tmp_path}/pooled_model.py:make", str(tmp_path / "r.yaml"), str(tmp_path / "p.gm"), \
        str(tmp_path / "cache")
    _register()
    runner = CliRunner()
    res = runner.invoke(app, ["compile", "--model", spec, "--recipe", rec, "--save", gm, "--cache-dir", cache])
    assert res.exit_code == 0, res.output
    assert "eager tail (sizes only the data decides, run after the plan): " in res.output
    res = runner.invoke(app, ["verify", "--model", spec, "--recipe", rec, "--json", "--cache-dir", cache])
    assert res.exit_code == 0 and json.loads(res.stdout)["ok"], res.output
    res = runner.invoke(app, ["run", "--model", gm, "--shape", "3", "--iters", "1", "--json", "--cache-dir", cache])
    assert res.exit_code == 0, res.output
    outs = json.loads(res.stdout)["outputs"]
    assert [o["output"] for o in outs] == ["output_0", "output_1"] and all(o["rel_l2_vs_eager"] == 0 for o in outs)
    sys.modules.pop("pooled_model", None)
    from graphmode.capture.spec import resolve_model_spec
    server = ModelServer(resolve_model_spec(spec), POOLED, config=ServeConfig(cache_dir=cache))
    running = ServerThread(server).start()
    try:
        running.wait_ready(600)
        with httpx.Client(base_url=running.url, timeout=300) as client:
            meta = client.get("/v2/models/pooled").json()
    finally:
        running.stop()
    assert [(o["name"], o["shape"]) for o in meta["outputs"]] == [("output_0", [-1, 4]), ("output_1", [8])]


def test_a_branch_on_a_data_dependent_size_names_its_line_and_an_output_axis_asks_for_star(tmp_path):
    from graphmode.verdict import ContractRefused

    class Branches(torch.nn.Module):
        def forward(self, x):
            a = torch.argwhere(x > 1.0)
            if a.shape[0] > 0:
                return a.float().mean(0)
            return a.float().sum(0)
    with pytest.raises(CaptureError, match=r"branches on the value of a tensor at .*test_data_dependent_tail\.py:\d+ "
                                           r"in forward: `if a\.shape\[0\] > 0:`"):
        graphmode.compile((Branches(), (torch.randn(4, 3),)), cache_dir=tmp_path, mode="hybrid")

    class Doubled(torch.nn.Module):
        def forward(self, x):
            return x[x > 0] * 2
    recipe = {"version": 1, "name": "doubled", "exe_mode": "hybrid", "outputs": {"output": ["batch"]},
              "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", 8]}], "dims": {"batch": {"min": 1, "max": 8}}}
    with pytest.raises(ContractRefused, match=r"(?s)outputs\.output\[0\].*fix: use '\*' there: its length only"):
        graphmode.compile((Doubled(), (torch.randn(4, 8),)), recipe, cache_dir=tmp_path)
    cm = graphmode.compile((Doubled(), (torch.randn(4, 8),)), dict(recipe, outputs={"output": ["*"]}),
                           cache_dir=tmp_path)
    x = torch.randn(5, 8)
    assert torch.equal(cm(x), x[x > 0] * 2)


def _onnx_cases():
    """ONNX graphs as exporters write them around a NonZero (helper-found: each crashed at every
    call or was refused), by name: (nodes, outputs, initializers)."""
    import numpy as np
    from onnx import TensorProto as T, helper
    n = helper.make_node
    f32 = lambda v: np.array(v, np.float32)  # noqa: E731
    mask = [n("Relu", ["x"], ["h"]), n("Greater", ["h", "thr"], ["m"])]
    return {
        # the count of a selection as a value: Size(NonZero(m)) * 2 (a size the plan could not evaluate)
        "count": (mask + [n("NonZero", ["m"], ["nz"]), n("Size", ["nz"], ["c"]), n("Mul", ["c", "two"], ["y"])],
                  [("y", T.INT64, [])], {"thr": f32(0.1), "two": np.array(2, np.int64)}),
        # only the count is read (Range over it): the NonZero itself was dropped as dead code
        "shape_only": (mask + [n("NonZero", ["m"], ["nz"]), n("Shape", ["nz"], ["s"]),
                               n("Gather", ["s", "one"], ["k"], axis=0), n("Range", ["zero", "k", "one"], ["y"])],
                       [("y", T.INT64, ["k"])], {"thr": f32(0.1), "zero": np.array(0, np.int64),
                                                 "one": np.array(1, np.int64)}),
        # two NonZero of one mask (TorchScript's x[m] * y[m]): one length, broadcasting together
        "same_mask": (mask + [n("NonZero", ["m"], ["a"]), n("NonZero", ["m"], ["b"]),
                              n("Transpose", ["a"], ["at"], perm=[1, 0]), n("Transpose", ["b"], ["bt"], perm=[1, 0]),
                              n("GatherND", ["x", "at"], ["xa"]), n("GatherND", ["h", "bt"], ["hb"]),
                              n("Mul", ["xa", "hb"], ["y"])], [("y", T.FLOAT, ["k"])], {"thr": f32(0.1)}),
        # Compress without an axis (its flatten was an eager island the padding analysis refused)
        "compress_flat": (mask + [n("Reshape", ["m", "minus1"], ["mf"]), n("Compress", ["x", "mf"], ["y"])],
                          [("y", T.FLOAT, ["k"])], {"thr": f32(0.1), "minus1": np.array([-1], np.int64)}),
        # the max minus the min of what a mask kept: -inf - inf where it kept nothing, as ONNX defines
        "max_min_empty": (mask + [n("NonZero", ["m"], ["nz"]), n("Transpose", ["nz"], ["t"], perm=[1, 0]),
                                  n("GatherND", ["h", "t"], ["s"]), n("ReduceMax", ["s"], ["hi"], keepdims=0),
                                  n("ReduceMin", ["s"], ["lo"], keepdims=0), n("Sub", ["hi", "lo"], ["y"])],
                          [("y", T.FLOAT, [])], {"thr": f32(100.0)}),
        # sorting what a mask kept (TopK with K = its length, as exporters write sort) and torchvision's
        # pre-NMS top-n (K = min(3, length)): refused as 'K must be concrete' before
        "sort_topn": (mask + [n("NonZero", ["m"], ["nz"]), n("Transpose", ["nz"], ["t"], perm=[1, 0]),
                              n("GatherND", ["h", "t"], ["s"]), n("Shape", ["s"], ["len"]),
                              n("TopK", ["s", "len"], ["sorted", "order"]), n("Min", ["len", "three"], ["k"]),
                              n("TopK", ["sorted", "k"], ["top", "top_i"], largest=0),
                              n("Cast", ["order"], ["order_f"], to=T.FLOAT),
                              n("ReduceSum", ["top"], ["tsum"], keepdims=0),
                              n("ReduceSum", ["order_f"], ["o2"], keepdims=0),
                              n("Add", ["o2", "tsum"], ["y"])],
                      [("y", T.FLOAT, [])], {"thr": f32(0.1), "three": np.array([3], np.int64)}),
        # a float multiple of the batch size (x.shape[0] * 0.25) as a threshold: no tail at all
        "float_size": ([n("Shape", ["x"], ["s"]), n("Gather", ["s", "zero"], ["b"], axis=0),
                        n("Cast", ["b"], ["bf"], to=T.FLOAT), n("Mul", ["bf", "quarter"], ["t"]),
                        n("Sigmoid", ["x"], ["g"]), n("Greater", ["g", "t"], ["m"]),
                        n("Cast", ["m"], ["mf"], to=T.FLOAT), n("Mul", ["x", "mf"], ["y"])],
                       [("y", T.FLOAT, ["batch", 3])], {"zero": np.array(0, np.int64), "quarter": f32(0.25)}),
    }


@pytest.mark.parametrize("name", ["count", "shape_only", "same_mask", "compress_flat", "max_min_empty", "sort_topn",
                                  "float_size"])
def test_onnx_graphs_around_nonzero_answer_as_onnx_runtime_at_padded_batches(name, tmp_path):
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper
    nodes, outs, inits = _onnx_cases()[name]
    graph = helper.make_graph(nodes, name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])],
                              [helper.make_tensor_value_info(*o) for o in outs],
                              [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    path = tmp_path / f"{name}.onnx"
    _save(graph, path)
    # the batch size as a value changes with padding (refused so): every batch its own bucket there
    buckets = [1, 2, 3, 4] if name == "float_size" else [2, 4]
    recipe = {"version": 1, "name": name, "exe_mode": "hybrid", "dims": {"batch": {"buckets": buckets}},
              "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", 3]}]}
    cm = graphmode.compile(str(path), recipe, cache_dir=tmp_path)
    sess = ort.InferenceSession(str(path))
    for batch in (1, 3, 4):
        x = np.random.default_rng(batch).standard_normal((batch, 3)).astype(np.float32)
        want = sess.run(None, {"x": x})[0]
        got = cm(torch.from_numpy(x)).numpy()
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_allclose(got, want, rtol=1e-6)
        assert cm.last_path["path"] == "graph"


def test_a_recipe_dim_named_data_something_is_no_data_dependent_length(tmp_path):
    """The tail names its lengths data_u0, data_u1...: a model's own dim named data_len is a recipe
    dim (planned, padded), not a length to run after the plan."""
    from onnx import TensorProto, helper
    graph = helper.make_graph([helper.make_node("ReduceMax", ["x"], ["y"], axes=[1], keepdims=0)], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "data_len"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch"])])
    _save(graph, tmp_path / "m.onnx")
    cm = graphmode.compile(str(tmp_path / "m.onnx"), cache_dir=tmp_path)
    assert cm.tail is None and [n.op for n in cm.graph.nodes] == ["amax"]
    x = torch.randn(3, 5)
    assert torch.equal(cm(x), x.amax(1))
