"""Dim values too small for a model's windows (graphmode/analysis/extents.py): refused by the
verdict naming the smallest value that fits, and started there by the drafter."""
import warnings

import pytest
import torch

import graphmode
from graphmode.verdict import ContractRefused


class _Windows(torch.nn.Module):
    """Windows that need h, w >= 11: a 5x5 conv (-4), a dilated 3x3 (-4), a 3x3 max pool (-2)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.c1 = torch.nn.Conv2d(3, 4, 5)
        self.c2 = torch.nn.Conv2d(4, 4, 3, dilation=2)
        self.p = torch.nn.MaxPool2d(3, stride=1)

    def forward(self, x):
        return torch.nn.functional.adaptive_avg_pool2d(self.p(torch.relu(self.c2(torch.relu(self.c1(x))))),
                                                       1).flatten(1)


def _onnx(tmp_path, size=16):
    p = tmp_path / "windows.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(_Windows().eval(), (torch.randn(1, 3, size, size),), str(p), dynamo=False,
                          opset_version=17, input_names=["x"], dynamic_axes={"x": {0: "batch", 2: "h", 3: "w"}})
    return str(p)


def _recipe(h_min, w_min):
    return {"version": 1, "name": "w", "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", 3, "h", "w"]}],
            "dims": {"batch": {"min": 1, "max": 2}, "h": {"min": h_min, "max": 16}, "w": {"min": w_min, "max": 16}}}


def test_a_minimum_the_windows_cannot_take_is_refused_naming_the_one_that_fits(tmp_path):
    """An ONNX file's dynamic axes carry no range: h = 4 reached ATen's conv, which raised."""
    path = _onnx(tmp_path)
    with pytest.raises(ContractRefused) as e:
        graphmode.compile(path, _recipe(4, 8), cache_dir=tmp_path)
    text = str(e.value)
    assert "dims.h.min: 11" in text and "dims.w.min: 11" in text
    assert "max_pool2d" in text and "window is wider" in text
    cm = graphmode.compile(path, _recipe(11, 11), cache_dir=tmp_path)
    x = torch.randn(1, 3, 11, 11)
    torch.testing.assert_close(cm(x), _Windows().eval()(x), rtol=1e-5, atol=1e-6)


def test_a_draft_for_an_onnx_cnn_starts_its_spatial_dims_where_the_windows_fit(tmp_path):
    """h and w from 11, not 1; and, unsafe to pad with 54 values each, not every value a bucket
    (5,832 plans for warm-up): a few buckets, ONNX Runtime off them, recurring sizes made plans."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = graphmode.compile(_onnx(tmp_path), cache_dir=tmp_path)
    assert cm.recipe.dims["h"].min == 11 and cm.recipe.dims["w"].min == 11
    assert len(cm.recipe.buckets()) <= 16 and cm.recipe.on_violation == "eager"
    assert cm.recipe.dims["h"].exact_plans == 16
    # h and w serve exact values only: one bucket each (an ONNX file's example size: the range's max),
    # and batch takes the plan budget (it had [1, 32]: 8 padded to 32, 3 ran as 1 + 1 + 1)
    buckets = cm.recipe.dim_buckets()
    assert buckets["h"] == buckets["w"] == [cm.recipe.dims["h"].max] and len(buckets["batch"]) > 2
    model = _Windows().eval()
    for _ in range(3):                        # a size off the buckets: eager, then its own plan
        x = torch.randn(1, 3, 11, 13)
        torch.testing.assert_close(cm(x), model(x), rtol=1e-5, atol=1e-6)
    assert cm.last_path["path"] == "graph"
    # outside the contract on_violation: eager runs ONNX Runtime, which the model refuses too
    with pytest.raises(graphmode.errors.GraphmodeError, match=r"ONNX Runtime fails on these inputs.*1, 3, 10, 13"):
        cm(torch.randn(1, 3, 10, 13))


def test_a_draft_for_a_torch_cnn_keeps_its_spatial_dims_dynamic_from_where_export_holds(tmp_path):
    """torch.export refused the range 1..16 (a 5x5 kernel may not fit); the drafter used to fix h
    and w at the example's size. It probes the graph from the example down and takes the sizes
    whose window outputs are 2 or more (torch.export keeps no extent of 1 dynamic)."""
    model = _Windows().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = graphmode.compile((model, (torch.randn(1, 3, 16, 16),), {"x": ["batch", 3, "h", "w"]}),
                               cache_dir=tmp_path)
    assert (cm.recipe.dims["h"].min, cm.recipe.dims["h"].max) == (12, 16)
    x = torch.randn(2, 3, 12, 15)
    torch.testing.assert_close(cm(x), model(x), rtol=1e-5, atol=1e-6)


class _Strided(torch.nn.Module):
    """Two stride-2 convs and a global pool: torch.export keeps one graph for H, W >= 5 only
    (below, a conv's output is 1, which it specialises)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Conv2d(3, 4, 3, stride=2, padding=1)
        self.b = torch.nn.Conv2d(4, 4, 3, stride=2, padding=1)

    def forward(self, x):
        return torch.nn.functional.adaptive_avg_pool2d(self.b(self.a(x)), 1).flatten(1)


def test_a_range_torch_export_refuses_for_small_sizes_is_refused_naming_where_it_holds(tmp_path):
    """Buckets [16, 32] with no min (1): torch.export's suggestion around graphmode's small
    example (5) was "H max 4", the side the buckets are not on."""
    from graphmode.errors import CaptureError
    hw = {"buckets": [16, 32]}
    rec = {"version": 1, "name": "s", "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", 3, "H", "W"]}],
           "dims": {"batch": {"buckets": [1, 2]}, "H": hw, "W": hw}, "on_violation": "eager"}
    with pytest.raises(CaptureError) as e:
        graphmode.compile(_Strided(), rec, cache_dir=tmp_path)
    assert e.value.where == "dims.H.min" and "dims.H.min: 5; dims.W.min: 5" in e.value.fix
    hw = {"buckets": [16, 32], "min": 5}
    cm = graphmode.compile(_Strided(), dict(rec, dims={"batch": {"buckets": [1, 2]}, "H": hw, "W": hw}),
                           cache_dir=tmp_path)
    x = torch.randn(2, 3, 16, 32)
    torch.testing.assert_close(cm(x), _Strided()(x), rtol=1e-5, atol=1e-6)


class _Pyramid(torch.nn.Module):
    """A feature pyramid: three stride-2 convs, each level resized to the one above and added."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.c = torch.nn.ModuleList(torch.nn.Conv2d(3 if i == 0 else 4, 4, 3, stride=2, padding=1) for i in range(3))

    def forward(self, x):
        f1 = self.c[0](x)
        f2 = self.c[1](f1)
        f3 = self.c[2](f2)
        p2 = f2 + torch.nn.functional.interpolate(f3, size=f2.shape[-2:], mode="nearest")
        return f1 + torch.nn.functional.interpolate(p2, size=f1.shape[-2:], mode="nearest")


def test_a_pyramid_whose_small_sizes_torch_export_refuses_is_told_the_min_it_holds_from(tmp_path):
    """Trial AE: torch.export's own answer ("H min 3, max 4; W min 5, max 8") was the fix, which
    rules out both buckets; the sizes above it do not hold one graph either (H 5..8 ends at an
    extent of 1). The refusal names where they do: H and W from 9."""
    from graphmode.errors import CaptureError
    hw = {"buckets": [32, 64]}
    rec = {"version": 1, "name": "p", "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", 3, "H", "W"]}],
           "dims": {"batch": {"buckets": [1, 2]}, "H": hw, "W": hw}, "on_violation": "eager"}
    with pytest.raises(CaptureError) as e:
        graphmode.compile(_Pyramid(), rec, cache_dir=tmp_path)
    assert e.value.where == "dims.H.min" and "dims.H.min: 9; dims.W.min: 9" in e.value.fix, e.value


def test_an_onnx_resize_whose_indices_follow_the_dims_imports_them_as_a_tree_of_concats(tmp_path):
    """nearest-exact to a fixed 5x7 from a dynamic H, W (dynamo's ONNX export): 70 index values
    computed from the dims made one concat of 71 inputs, past the op's 64, reported as a
    graphmode bug in canonicalize."""
    from torch.export import Dim

    class _Resize(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.interpolate(x, size=(5, 7), mode="nearest-exact")
    p = tmp_path / "resize.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(_Resize(), (torch.randn(2, 3, 13, 11),), str(p), dynamo=True, input_names=["x"],
                          dynamic_shapes={"x": {2: Dim("H", min=8, max=40), 3: Dim("W", min=8, max=40)}})
    rec = {"version": 1, "name": "r", "inputs": [{"name": "x", "dtype": "f32", "shape": [2, 3, "H", "W"]}],
           "dims": {"H": {"min": 8, "max": 40}, "W": {"min": 8, "max": 40}}}          # every value a plan
    cm = graphmode.compile(str(p), rec, cache_dir=tmp_path)
    x = torch.randn(2, 3, 13, 11)
    assert torch.equal(cm(x), _Resize()(x))


def test_verify_reports_the_plan_each_request_ran_in(tmp_path):
    """An unsafe-to-pad dim under on_violation: eager: a request off its buckets runs eagerly at
    its own shape (the report named the bucket it would pad to)."""
    import json

    import yaml
    from typer.testing import CliRunner

    from graphmode.cli.app import _register, app
    _register()
    rec = _recipe(11, 11)
    rec.update(on_violation="eager", dims={"batch": {"buckets": [1]}, "h": {"min": 11, "max": 16, "buckets": [11, 16]},
                                           "w": {"min": 11, "max": 11}})
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(rec))
    res = CliRunner().invoke(app, ["verify", "--model", _onnx(tmp_path), "--recipe", str(tmp_path / "r.yaml"),
                                   "--cache-dir", str(tmp_path / "c"), "--json"])
    assert res.exit_code == 0, res.output
    cases = json.loads(res.stdout)["cases"]
    off = [c for c in cases if c["shape"]["h"] not in (11, 16)]
    assert off and all(c["path"] == "eager" and c["bucket"] == c["shape"] for c in off), cases


def test_a_draft_for_an_onnx_file_whose_op_needs_a_static_axis_says_how_to_write_the_recipe(tmp_path):
    """The fix pointed at 'the recipe's inputs[].shape' of a recipe the user never wrote."""
    from graphmode.errors import CaptureError

    class _Up(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.interpolate(x, scale_factor=2, mode="nearest")
    p = tmp_path / "up.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(_Up(), (torch.randn(1, 3, 8, 8),), str(p), dynamo=False, opset_version=17,
                          input_names=["x"], dynamic_axes={"x": {0: "batch", 2: "H", 3: "W"}})
    with pytest.raises(CaptureError, match="must be static") as e:
        graphmode.compile(str(p), cache_dir=tmp_path)
    assert "a drafted recipe keeps the file's dynamic axes (x: ['batch', 3, 'H', 'W'])" in e.value.fix


def test_a_range_spanning_two_graphs_is_refused_naming_both_parts(tmp_path):
    """H 3..16: at 3..4 a stride-2 conv's output is 1 (torch.export specialises it), from 5 on
    another graph holds. torch.export named the part around the example only ("H min 3, max 4");
    a ConvNeXt at 48..96 was told to narrow to 48..63, leaving out its own image size 64."""
    from graphmode.errors import CaptureError
    hw = {"min": 3, "max": 16, "buckets": [3, 16]}
    rec = {"version": 1, "name": "s", "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", 3, "H", "W"]}],
           "dims": {"batch": {"buckets": [1, 2]}, "H": hw, "W": hw}, "on_violation": "eager"}
    with pytest.raises(CaptureError, match="one graph of this model for H 3..4, W 3..4 and another for H 5..16") as e:
        graphmode.compile(_Strided(), rec, cache_dir=tmp_path)
    assert "H 5..16, W 5..16, or H 3..4, W 3..4" in e.value.fix


def test_a_draft_over_many_sizes_unsafe_to_pad_plans_the_recurring_ones():
    """--dim H=64:160 on a CNN (97 values, unsafe to pad): the draft ran every size off its
    buckets eagerly, for good; it now keeps the range's ends as buckets and plans the sizes that
    recur (exact_plans), leaving the plan budget to batch."""
    from graphmode.kb.draft import draft_recipe
    model = _Windows().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        d = draft_recipe((model, (torch.randn(1, 3, 64, 64),), {"x": ["batch", 3, "h", "w"]}), record=False,
                         ranges={"h": (64, 160), "w": (64, 160)})
    assert d.data["on_violation"] == "eager" and d.report.plans <= 16       # batch gets what h and w leave
    for k in ("h", "w"):
        assert d.data["dims"][k]["exact_plans"] == 16 and d.data["dims"][k]["buckets"] == [64, 160], d.data["dims"]
