"""Ops with no graphmode lowering that torch decomposes (graphmode/capture/decompose.py): tile,
roll, nanmean, inner, fftshift, argsort, a training-form batch norm and friends become graph ops and
match eager; an op whose decomposition would make a size only the data decides, or refuses at
import (a complex intermediate), or that the recipe excludes, stays as it was."""
from __future__ import annotations

import pytest
import torch

import graphmode
from graphmode.verdict import ContractRefused
from graphmode.verify.numerics import rel_l2


class Composite(torch.nn.Module):
    """Each op here was an eager island in hybrid mode and a refusal in graph mode."""

    def forward(self, x):
        return (torch.tile(x, (1, 2)), torch.roll(x, 3, dims=1), torch.diff(x, dim=-1),
                torch.nanmean(x, dim=-1), torch.inner(x, x), x.repeat_interleave(2, dim=1),
                torch.linalg.vecdot(x, x), torch.fft.fftshift(x, dim=-1))


def _recipe(shape, mode="graph", dims=None, **extra) -> dict:
    return {"version": 1, "name": "d", "exe_mode": mode, "inputs": [{"name": "x", "dtype": "f32", "shape": shape}],
            "dims": dims or {}, "targets": ["host"], **extra}


@pytest.mark.parametrize("mode", ["graph", "hybrid"])
def test_composite_ops_are_decomposed_into_graph_ops_that_match_eager(mode, tmp_path):
    rec = _recipe(["batch", 8], mode, {"batch": {"min": 1, "max": 4, "buckets": [2, 4]}})
    cm = graphmode.compile(Composite(), rec, cache_dir=tmp_path)
    assert not cm.capture_report.fallbacks
    ops = set(cm.capture_report.aten_ops)
    assert not ops & {"aten.tile.default", "aten.nanmean.default", "aten.inner.default", "aten.fft_fftshift.default"}
    x = torch.randn(3, 8)
    x[1, 2] = float("nan")                  # nanmean's decomposition tells NaN by x != x
    for got, want in zip(cm(x), Composite()(x)):
        assert got.shape == want.shape and torch.equal(got.isnan(), want.isnan())
        assert rel_l2(torch.nan_to_num(got), torch.nan_to_num(want)) < 1e-6


class Sorted(torch.nn.Module):
    def forward(self, x):
        return torch.argsort(x, dim=-1), torch.msort(x), torch.nn.functional.batch_norm(x, None, None, training=True)


def test_ops_decomposed_into_static_reference_ops_compile_at_static_shapes(tmp_path):
    """argsort and msort become sort, a batch norm without running stats its mean/var: graph
    ops at static shapes, equal to eager (indices exactly)."""
    cm = graphmode.compile(Sorted(), _recipe([5, 6]), cache_dir=tmp_path)
    assert not cm.capture_report.fallbacks
    x = torch.randn(5, 6)
    got, want = cm(x), Sorted()(x)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and rel_l2(got[2], want[2]) < 1e-5


class Kept(torch.nn.Module):
    def forward(self, x, r):
        return x.repeat_interleave(r, dim=0) * 2, torch.fft.irfft(x, dim=-1)


def test_what_a_decomposition_would_make_worse_stays_as_it_was(tmp_path):
    """repeat_interleave with tensor repeats stays the data-dependent tail it was; irfft, whose
    decomposition goes through complex tensors, stays an eager island; both match eager."""
    rec = _recipe([4, 8], "hybrid")
    rec["inputs"].append({"name": "r", "dtype": "i64", "shape": [4]})
    cm = graphmode.compile(Kept(), rec, cache_dir=tmp_path)
    assert [f.target for f in cm.capture_report.fallbacks] == ["aten.fft_irfft.default"]
    x, r = torch.randn(4, 8), torch.tensor([1, 0, 3, 2])
    for got, want in zip(cm(x=x, r=r), Kept()(x, r)):
        assert got.shape == want.shape and rel_l2(got, want) < 1e-6


def test_an_op_the_recipe_excludes_is_not_decomposed(tmp_path):
    rec = _recipe([2, 8], "hybrid", capture={"exclude_ops": ["tile"]})
    cm = graphmode.compile(Composite(), rec, cache_dir=tmp_path)
    fb = cm.capture_report.fallbacks
    assert [f.target for f in fb] == ["aten.tile.default"] and fb[0].excluded
    x = torch.randn(2, 8)
    assert torch.equal(cm(x)[0], torch.tile(x, (1, 2)))


class Indexed(torch.nn.Module):
    def forward(self, x, i, v):
        y = x.clone()
        y[i] = v                                  # index_put
        z = x.clone()
        z[:, i] += 1.0                            # index_put, accumulate through a view
        q = x.clone()
        q[x > 0] = 0.0                            # index_put with a boolean mask
        return y, z, x.index_put((i,), v, accumulate=True), q, x.put(i, v[0, :3], accumulate=True)


def test_index_put_and_put_are_graph_ops_at_static_shapes(tmp_path):
    """x[i] = v (index_put, an ATen-reference op now) runs in graph mode, repeated indices and
    accumulation as eager does them; over a padded dim it is refused (an index could point into
    the padding), not guessed."""
    rec = _recipe([6, 8])
    rec["inputs"] += [{"name": "i", "dtype": "i64", "shape": [3]}, {"name": "v", "dtype": "f32", "shape": [3, 8]}]
    cm = graphmode.compile(Indexed(), rec, cache_dir=tmp_path)
    assert not cm.capture_report.fallbacks
    x, i, v = torch.randn(6, 8), torch.tensor([1, 3, 1]), torch.randn(3, 8)
    for got, want in zip(cm(x=x, i=i, v=v), Indexed()(x, i, v)):
        assert torch.equal(got, want)
    rec["inputs"][0]["shape"] = ["batch", 8]
    rec["dims"] = {"batch": {"min": 4, "max": 8, "buckets": [6, 8]}}
    with pytest.raises(ContractRefused, match=r"padding batch up to its bucket can change the outputs: index_put"):
        graphmode.compile(Indexed(), rec, cache_dir=tmp_path)


class NormStatistics(torch.nn.Module):
    def forward(self, x, w, b):
        out, mean, rstd = torch.native_layer_norm(x, [8], w, b, 1e-5)
        return out, mean, rstd


def test_a_norm_whose_statistics_are_read_is_decomposed(tmp_path):
    """native_layer_norm's mean and rstd outputs (read by the model) have no place in the IR's
    layer_norm: it failed at capture ('output 1 ... which graphmode holds as 3 values'); now
    torch's decomposition makes all three, in graph mode, equal to eager."""
    rec = _recipe([3, 8])
    rec["inputs"] += [{"name": "w", "dtype": "f32", "shape": [8]}, {"name": "b", "dtype": "f32", "shape": [8]}]
    cm = graphmode.compile(NormStatistics(), rec, cache_dir=tmp_path)
    assert not cm.capture_report.fallbacks
    x, w, b = torch.randn(3, 8), torch.randn(8), torch.randn(8)
    for got, want in zip(cm(x=x, w=w, b=b), NormStatistics()(x, w, b)):
        assert got.shape == want.shape and rel_l2(got, want) < 1e-5


class Router(torch.nn.Module):
    """A mixture-of-experts router over a dynamic token count: topk over the experts, a sort,
    a median and a tile along static axes (ATen-reference ops with a symbolic dim)."""

    def forward(self, x):
        w, idx = torch.topk(x.softmax(-1), 2, dim=-1)
        s, order = torch.sort(x, dim=-1, descending=True)
        return w, idx, s, order, torch.median(x, dim=-1).values, x.repeat(1, 2), torch.cummax(x, -1).values


def test_aten_reference_ops_follow_a_symbolic_dim_and_pad_along_the_other_axes(tmp_path):
    """Their types follow the token dim (torch's types at three sizes, checked against
    torch.export's); padding tokens is proved safe as for an island calling the same op (each
    token's row is read alone); a graph that reads along the padded dim is refused."""
    rec = _recipe(["tokens", 8], dims={"tokens": {"min": 1, "max": 64, "buckets": [16, 64]}})
    cm = graphmode.compile(Router(), rec, cache_dir=tmp_path)
    assert not cm.capture_report.fallbacks
    assert {"aten.topk.default", "aten.sort.default", "aten.median.dim"} <= set(cm.capture_report.aten_ops)
    for n in (1, 10, 40):
        x = torch.randn(n, 8)
        for got, want in zip(cm(x), Router()(x)):
            assert torch.equal(got, want)
    with pytest.raises(ContractRefused, match=r"aten\.sort\.stable along padded dim tokens"):
        graphmode.compile(lambda_module(lambda x: torch.sort(x, dim=0, stable=True).values), rec, cache_dir=tmp_path)
    with pytest.raises(ContractRefused, match=r"padding tokens up to its bucket can change the outputs"):
        graphmode.compile(lambda_module(lambda x: x.repeat(2, 1)), rec, cache_dir=tmp_path)   # tokens tiled


def lambda_module(fn) -> torch.nn.Module:
    class Fn(torch.nn.Module):
        def forward(self, x):
            return fn(x)
    return Fn()


@pytest.mark.parametrize("fn, shape", [(lambda x: torch.nn.functional.adaptive_avg_pool2d(x, (5, 5)), [8, 9, 7]),
                                       (lambda x: torch.nn.functional.adaptive_avg_pool1d(x, 3), [8, 7])])
def test_unbatched_adaptive_pools_compile(fn, shape, tmp_path):
    """adaptive_avg_pool2d of an unbatched [C, H, W] input (and adaptive_avg_pool1d of [C, L],
    which torch decomposes into it) failed the IR check after canonicalize (a PassError: the
    IR op is [N, C, H, W]); it now runs on the [1, C, H, W] view."""
    cm = graphmode.compile(lambda_module(fn), _recipe(shape), cache_dir=tmp_path)
    x = torch.randn(*shape)
    assert torch.equal(cm(x), fn(x))
