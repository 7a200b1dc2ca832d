"""Capture edge cases the OpInfo conformance run found: each compiles in graph mode and
matches eager PyTorch exactly, or is refused at capture with a graphmode error naming the op."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import graphmode
from graphmode.errors import CaptureError
from graphmode.verdict import ContractRefused
from graphmode.verify.numerics import rel_l2


class Fn(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x, y):
        return self.fn(x, y)


def _recipe(x: torch.Tensor, y: torch.Tensor, mode: str = "graph") -> dict:
    return {"version": 1, "name": "edge", "exe_mode": mode, "dims": {"n": int(x.shape[0])},
            "inputs": [{"name": "x", "dtype": "f32", "shape": ["n"] + list(x.shape[1:])},
                       {"name": "y", "dtype": "f32", "shape": list(y.shape)}],
            "codegen": {"kernel_selection": "heuristic"}}


def _compiled(fn, x, y, tmp_path, mode="graph"):
    return graphmode.compile(Fn(fn), _recipe(x, y, mode), cache_dir=tmp_path)


def _i32(t):
    return (t * 50).to(torch.int32)


def _masked_rows(x, y):
    return torch.ops.aten._safe_softmax(x.masked_fill(y > 0, float("-inf")), -1)


CASES = {
    # a fully masked row gives zeros, not NaN
    "safe_softmax": (_masked_rows, torch.randn(3, 4), torch.tensor([[0.0] * 4, [1.0] * 4, [0, 1, 1, 0]])),
    # ops along dim 0 of a 0-d tensor
    "log_softmax_0d": (lambda x, y: torch.log_softmax(x.reshape(()), 0) + y, torch.randn(1), torch.randn(2)),
    "cumsum_0d": (lambda x, y: torch.cumsum(x.reshape(()), 0) * y, torch.randn(1), torch.randn(2)),
    "sum_0d": (lambda x, y: torch.sum(x.reshape(()), 0, keepdim=True) + y, torch.randn(1), torch.randn(2)),
    "mean_0d": (lambda x, y: torch.mean(x.reshape(())) + y, torch.randn(1), torch.randn(2)),
    "argmax_0d": (lambda x, y: torch.argmax(x.reshape(()), 0) + y, torch.randn(1), torch.randn(2)),
    # reductions with a dtype cast first; the divide / true_divide / subtract aliases
    "sum_mean_dtype": (lambda x, y: torch.sum(x * 4, 1, dtype=torch.int64) + torch.mean(x, dtype=torch.float64) + y,
                       torch.randn(3, 4), torch.randn(3)),
    "aliases": (lambda x, y: torch.true_divide(torch.subtract(x, y), y) + torch.divide(x, 2.0), torch.randn(3, 4),
                torch.rand(4) + 1),
    # t / transpose of a 0-d or 1-d tensor is the identity
    "t_0d": (lambda x, y: x.reshape(()).t() * y, torch.randn(1), torch.randn(2)),
    "transpose_1d": (lambda x, y: x.transpose(0, -1) + y, torch.randn(2), torch.randn(2)),
    # argmax/argmin over the flattened tensor (dim=None), keepdim a shape of ones
    "argmax_flat": (lambda x, y: torch.argmax(x * y) + y, torch.randn(3, 4), torch.randn(4)),
    "argmin_flat_keepdim": (lambda x, y: torch.argmin(x * y, keepdim=True) + y, torch.randn(3, 4), torch.randn(4)),
    # cumsum with a dtype casts first (int64: the float input truncated, then summed)
    "cumsum_dtype": (lambda x, y: torch.cumsum(x * 4, 1, dtype=torch.int64) + y, torch.randn(3, 4), torch.randn(4)),
    # ... to a narrower integer (Mixtral's routing counts): the result keeps that dtype
    "cumsum_int32": (lambda x, y: torch.cumsum(x * 4, 1, dtype=torch.int32) + torch.cumsum(x > 0, 0, dtype=torch.int32)
                     + y, torch.randn(3, 4), torch.randn(4)),
    # torch.stack along a new middle and last dim (GPT-J's rotary)
    "stack": (lambda x, y: torch.stack((-x[:, 1::2], x[:, ::2]), -1).flatten(-2) + torch.stack([x, x * y], 1).sum(1),
              torch.randn(3, 4), torch.randn(4)),
    # matmul with 1-d operands: vector-matrix, matrix-vector, batched, dot
    "matmul_mv": (torch.matmul, torch.randn(3, 4), torch.randn(4)),
    "matmul_vm_batched": (torch.matmul, torch.randn(4), torch.randn(2, 4, 5)),
    "matmul_dot": (torch.matmul, torch.randn(4), torch.randn(4)),
    # clamp with tensor bounds (maximum, minimum); ATen-reference ops, pointwise and static; padding modes
    "clamp_tensor": (lambda x, y: torch.clamp(x, min=y, max=y + 0.5), torch.randn(3, 4), torch.randn(4)),
    "aten_reference": (lambda x, y: torch.logsumexp(torch.special.erfc(x) * y, 1, keepdim=True) + torch.erfinv(y / 4),
                       torch.randn(3, 4), torch.randn(4)),
    "pad_reflect": (lambda x, y: F.pad(x.reshape(1, 3, 4), (2, 1), mode="reflect") + y[:1], torch.randn(3, 4),
                    torch.randn(4)),
    # ATen ops that reach a core op of their name (one op, one name: no ATen-reference twin)
    "core_unary": (lambda x, y: torch.floor(x * 3) + torch.ceil(x) + torch.round(x * 3) + torch.sign(x) + torch.tan(x / 2)
                   + torch.asinh(x) + torch.atan(y), torch.randn(3, 4), torch.randn(4)),
    "round_decimals": (lambda x, y: torch.round(x * 10, decimals=2) + torch.round(x * 100, decimals=-1)
                       + torch.round(x, decimals=0) + y, torch.randn(3, 4), torch.randn(4)),
    "bitwise_ints": (lambda x, y: ((_i32(x) & _i32(y)) | (_i32(x) ^ 7)) + ~_i32(x) + (_i32(x) << 2) + (_i32(y) >> 1)
                     + torch.bitwise_left_shift(3, _i32(y).abs() % 8) + torch.floor(_i32(x)), torch.randn(3, 4),
                     torch.randn(4)),
    "bitwise_bools": (lambda x, y: ((x > 0) & (y > 0)) | ~(x > y) ^ (x > 1), torch.randn(3, 4), torch.randn(4)),
    "prod": (lambda x, y: torch.prod(x) + torch.prod(x, 1, keepdim=True) + y, torch.randn(3, 4), torch.randn(4)),
    "prod_int": (lambda x, y: torch.prod(_i32(x / 20), 1) + torch.prod(x > -3) + torch.prod(y.sum(), 0),
                 torch.randn(3, 4), torch.randn(4)),
    "einsum": (lambda x, y: torch.einsum("ij,j->i", x, y), torch.randn(3, 4), torch.randn(4)),
    "conv_transpose2d_unbatched": (lambda x, y: F.conv_transpose2d(x.reshape(2, 3, 2), y.reshape(2, 1, 1, 2), stride=2),
                                   torch.randn(3, 4), torch.randn(4)),
    # dropout outside training is the identity
    "dropout_eval": (lambda x, y: F.dropout(x, 0.5, training=False) + y, torch.randn(3, 4), torch.randn(4)),
    # rounding divisions (floor: ATen's own kernel; integer trunc through fmod), torch.max(a, b), rsub
    # with alpha, addmm with beta / alpha (beta 0 drops self's NaN): graph ops, not eager islands
    "div_rounding": (lambda x, y: torch.div(x * 10, y, rounding_mode="floor")
                     + torch.div(x * 10, y, rounding_mode="trunc")
                     + torch.div(_i32(x), _i32(y).abs() + 1, rounding_mode="trunc")
                     + torch.div(-_i32(x), _i32(y).abs() + 1, rounding_mode="floor")
                     + torch.div(x, 0.3, rounding_mode="floor"), torch.randn(3, 4), torch.randn(4)),
    "max_min_other_rsub": (lambda x, y: torch.max(x, y) - torch.min(x, y) + torch.rsub(x, y, alpha=2),
                           torch.randn(3, 4), torch.tensor([0.5, float("nan"), -1.0, 2.0])),
    "eye": (lambda x, y: x @ torch.eye(4) + torch.eye(3, 4) * y, torch.randn(3, 4), torch.randn(4)),   # a constant
    "addmm_scaled": (lambda x, y: torch.addmm(y.expand(3, 4), x, x.T @ x, beta=0.5, alpha=-2.0)
                     + torch.addmm(y.reshape(1, 4) * float("nan"), x, x.T @ x, beta=0),
                     torch.randn(3, 4), torch.randn(4)),
    # avg_pool2d's divisor_override (sum / divisor), batched and unbatched; grid_sample as torch writes it
    "avg_pool_divisor": (lambda x, y: F.avg_pool2d(x.reshape(1, 1, 3, 4), 2, stride=1, padding=1, divisor_override=3)
                         .sum() + F.avg_pool2d(x.reshape(1, 3, 4), (2, 3), divisor_override=5).sum() + y,
                         torch.randn(3, 4), torch.randn(4)),
    "grid_sample": (lambda x, y: F.grid_sample(x.reshape(1, 1, 3, 4), y.reshape(1, 1, 2, 2) * 1.2, align_corners=False)
                    .sum() + F.grid_sample(x.reshape(1, 1, 3, 4), y.reshape(1, 2, 1, 2).tanh(), mode="nearest",
                                           padding_mode="border", align_corners=True).sum()
                    + F.grid_sample(x.reshape(1, 1, 1, 3, 4), y.reshape(1, 1, 1, 1, 4)[..., :3], mode="bilinear",
                                    padding_mode="reflection", align_corners=False).sum() + y,
                    torch.randn(3, 4), torch.randn(4)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_graph_mode_matches_eager(name, tmp_path):
    fn, x, y = CASES[name]
    want = fn(x, y)
    cm = _compiled(fn, x, y, tmp_path)
    assert cm.capture_report.fallbacks == []
    got = cm(x, y)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, equal_nan=True)


def test_native_dropout_outside_training_keeps_everything(tmp_path):
    x, y = torch.randn(3, 4), torch.randn(4)

    def fn(x, y):
        out, mask = torch.ops.aten.native_dropout(x, 0.3, False)
        return out + y, mask
    out, mask = _compiled(fn, x, y, tmp_path)(x, y)
    torch.testing.assert_close(out, x + y)
    assert mask.dtype == torch.bool and bool(mask.all())


def test_dropout_in_training_is_not_the_identity(tmp_path):
    """Training dropout is random: graph mode refuses it by name, hybrid runs it as an eager island."""
    x, y = torch.randn(3, 4), torch.randn(4)
    fn = lambda x, y: F.dropout(x, 0.5, training=True) + y       # noqa: E731
    with pytest.raises(ContractRefused, match="dropout"):
        _compiled(fn, x, y, tmp_path)
    cm = _compiled(fn, x, y, tmp_path, mode="hybrid")
    assert [f.target for f in cm.capture_report.fallbacks] == ["aten.native_dropout.default"]


@pytest.mark.parametrize("mode", ["graph", "hybrid"])
def test_complex_tensors_are_refused_at_capture_naming_the_op(mode, tmp_path):
    x, y = torch.randn(3, 8), torch.randn(8)
    with pytest.raises(CaptureError, match=r"aten\.fft_fft.*complex64"):
        _compiled(lambda x, y: torch.fft.fft(x).real + y, x, y, tmp_path, mode=mode)


def test_an_excluded_op_with_a_complex_result_is_refused_saying_an_island_cannot_hold_it(tmp_path):
    """Trial AF: `capture.exclude_ops: [stft]` under hybrid, which the docs call an eager island,
    gave the bare dtype refusal; an island's values cross into the graph, so none can be complex."""
    x, y = torch.randn(2, 256), torch.randn(1)
    fn = lambda x, y: torch.stft(x, 64, 16, window=torch.hann_window(64), return_complex=True).abs() + y  # noqa: E731
    r = _recipe(x, y, "hybrid")
    r["capture"] = {"exclude_ops": ["stft"]}
    with pytest.raises(CaptureError, match="(?s)stft.*complex64.*exclude_ops cannot make it an eager island") as e:
        graphmode.compile(Fn(fn), r, cache_dir=tmp_path)
    assert "exe_mode: eager" in e.value.fix


class _Counting(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(1))

    def forward(self, x, y):
        self.calls.add_(1)
        return x + y


class _BatchStats(torch.nn.Module):
    """Batch norm in training form, called directly (compile sets eval(), which a functional
    call with training=True ignores): its running statistics are updated in place."""

    def __init__(self):
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(4))
        self.register_buffer("running_var", torch.ones(4))

    def forward(self, x, y):
        return F.batch_norm(x, self.running_mean, self.running_var, training=True) + y


@pytest.mark.parametrize("mode", ["graph", "hybrid"])
@pytest.mark.parametrize("model, match", [(_Counting, r"updates its buffer 'calls' in place \(aten\.add_?\.Tensor"),
                                          (_BatchStats, r"updates its buffer 'running_.* in place \(.*batch_norm")])
def test_in_place_updates_of_buffers_are_refused_naming_the_op(model, match, mode, tmp_path):
    """torch.export returns updated buffers as extra outputs before the model's own; they are
    refused, not returned in the wrong place while the caller's buffer stays stale."""
    x, y = torch.randn(3, 4), torch.randn(4)
    with pytest.raises(CaptureError, match=match):
        graphmode.compile(model(), _recipe(x, y, mode), cache_dir=tmp_path)


def test_in_place_updates_of_inputs_are_written_back(tmp_path):
    """An input the model updates in place is copied back into the caller's tensor (buffers and
    parameters are refused above): the output and the updated input both match eager."""
    x, y = torch.randn(3, 4), torch.randn(4)
    fn = lambda x, y: x + y.mul_(2)      # noqa: E731
    want_y = y.clone()
    want = fn(x, want_y)
    got_y = y.clone()
    got = _compiled(fn, x, y.clone(), tmp_path, mode="hybrid")(x, got_y)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_y, want_y)


def test_an_op_returning_a_list_of_tensors_is_refused_naming_it(tmp_path):
    """histogramdd returns (hist, [bin edges...]): no eager island holds a nested list (was an IndexError)."""
    x, y = torch.randn(6, 2), torch.randn(2)
    with pytest.raises(CaptureError, match=r"aten\.histogramdd.*list of tensors"):
        _compiled(lambda x, y: torch.histogramdd(x + y, bins=[3, 3]).hist, x, y, tmp_path, mode="hybrid")


def test_source_locations_read_as_a_user_writes_them(tmp_path, monkeypatch):
    """A fallback's source line names the model's file relative to the working directory, or
    from the package on for an installed library (also one in a virtualenv under the working
    directory), never this machine's site-packages prefix."""
    import os
    from graphmode.capture.export_errors import shown_path
    monkeypatch.chdir(tmp_path)
    assert shown_path(str(tmp_path / "models" / "net.py")) == os.path.join("models", "net.py")
    lib = os.path.join(os.sep, "opt", "py", "lib", "site-packages", "transformers", "models", "llama.py")
    assert shown_path(lib) == os.path.join("transformers", "models", "llama.py")
    venv = str(tmp_path / ".venv" / "lib" / "python3.11" / "site-packages" / "transformers" / "x.py")
    assert shown_path(venv) == os.path.join("transformers", "x.py")
    elsewhere = os.path.join(os.sep, "srv", "code", "net.py")
    assert shown_path(elsewhere) == elsewhere


class _Branch(torch.nn.Module):
    def forward(self, x, y):
        if x.sum() > 0:                          # a branch on a value: no one graph holds it
            return x * 2 + y
        return x - y


def test_a_branch_on_a_tensor_value_names_the_line_that_branches(tmp_path, capfd):
    x, y = torch.ones(3, 4), torch.randn(3, 4)
    with pytest.raises(CaptureError) as e:
        graphmode.compile(_Branch(), _recipe(x, y, "graph"), cache_dir=tmp_path)
    msg = str(e.value)
    assert "branches on the value of a tensor at" in msg and "test_capture_edge_cases.py" in msg
    assert "`if x.sum() > 0:" in msg and "torch.where" in e.value.fix
    assert "def forward(" not in capfd.readouterr().err        # torch's partial graph is not printed


class _ReadsANumber(torch.nn.Module):
    def forward(self, x, y):
        return x[:, : int((x > 0).sum())]


def test_a_tensor_read_as_a_python_number_is_named_so_not_as_a_branch(tmp_path):
    x, y = torch.ones(3, 4), torch.randn(3, 4)
    with pytest.raises(CaptureError) as e:
        graphmode.compile(_ReadsANumber(), _recipe(x, y, "graph"), cache_dir=tmp_path)
    assert "reads the value of a tensor as a Python number at" in str(e.value) and "keep it a tensor" in e.value.fix


class _Seq2Seq(torch.nn.Module):
    def __init__(self, causal):
        super().__init__()
        self.t, self.causal = torch.nn.Transformer(d_model=16, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                                                   dim_feedforward=32, batch_first=True), causal

    def forward(self, src, tgt):
        mask = torch.nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        return self.t(src, tgt, tgt_mask=mask, tgt_is_causal=self.causal)


def test_nn_transformer_detecting_a_causal_mask_is_refused_with_the_argument_that_says_it(tmp_path):
    """nn.Transformer given a mask without tgt_is_causal compares it with a causal mask value by
    value: the refusal named the user's call and suggested torch.where, not the argument."""
    src, tgt = torch.randn(2, 7, 16), torch.randn(2, 5, 16)
    rec = {"version": 1, "name": "s2s", "codegen": {"kernel_selection": "heuristic"},
           "inputs": [{"name": "src", "dtype": "f32", "shape": [2, 7, 16]},
                      {"name": "tgt", "dtype": "f32", "shape": [2, 5, 16]}]}
    with pytest.raises(CaptureError, match="compare a mask given without is_causal") as e:
        graphmode.compile(_Seq2Seq(None).eval(), rec, cache_dir=tmp_path)
    assert "tgt_is_causal=True" in e.value.fix
    m = _Seq2Seq(True).eval()
    cm = graphmode.compile(m, rec, cache_dir=tmp_path)
    with torch.no_grad():
        assert rel_l2(cm(src, tgt), m(src, tgt)) < 1e-5


class _SquareGrid(torch.nn.Module):
    """DPT's neck: a square grid side from the token count (int(n ** 0.5)), which torch.export
    fixes at the example's value while H and W stay free."""

    def __init__(self):
        super().__init__()
        self.patch = torch.nn.Conv2d(3, 8, 4, stride=4)

    def forward(self, x):
        h = self.patch(x).flatten(2).transpose(1, 2)
        side = int(h.shape[1] ** 0.5)
        return h.reshape(h.shape[0], side, side, 8).sum((1, 2))


def test_a_view_that_holds_at_the_example_shape_only_is_refused_at_its_line(tmp_path):
    """The importer built the reshape from torch.export's shape without checking it kept the
    element count: canonicalize then failed calling itself a graphmode bug (a view whose count
    happened to agree would have moved elements between rows)."""
    from torch.export import Dim
    with pytest.raises(CaptureError, match=r"the view at .*test_capture_edge_cases.py:\d+ reshapes .* which holds "
                                           r"at the example's shape only") as e:
        graphmode.compile(_SquareGrid().eval(), example_inputs=(torch.randn(2, 3, 16, 16),),
                          dynamic_shapes={"x": {0: Dim("batch", max=8), 2: Dim("H", min=8, max=64),
                                                3: Dim("W", min=8, max=64)}})
    assert "inputs[].shape" in e.value.fix


def test_torch_cond_is_refused_naming_it(tmp_path):
    """torch.cond raised a bare KeyError (its branch graphs) from the importer; and the advice
    for a data-dependent branch suggested it."""
    class _Cond(torch.nn.Module):
        def forward(self, x):
            return torch.cond(x.sum() > 0, lambda t: t.relu(), lambda t: t.sigmoid(), (x,))
    rec = {"version": 1, "name": "c", "inputs": [{"name": "x", "dtype": "f32", "shape": [2, 8]}], "exe_mode": "hybrid"}
    with pytest.raises(CaptureError, match=r"cond at .*: graphmode captures one graph without control flow") as e:
        graphmode.compile(_Cond(), rec, cache_dir=tmp_path)
    assert "torch.where" in e.value.fix


def test_a_data_dependent_size_is_refused_in_graph_mode_and_runs_after_the_plan_in_hybrid(tmp_path):
    """x[mask] has as many rows as the mask selects: torch names that size u0, which is no
    recipe dim. Graph mode refuses it, naming the op, where the model makes it and both fixes;
    hybrid runs it and what reads it after the plan (capture/tail.py), equal to eager."""
    from graphmode.verdict import ContractRefused
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    fn = lambda x, y: x[y > 0].sum(0, keepdim=True) + x  # noqa: E731
    with pytest.raises(ContractRefused, match=r"size only its data decides \(aten\.index\.Tensor at "
                                              r".*test_capture_edge_cases\.py:\d+ and 2 op\(s\) after it\)") as e:
        _compiled(fn, x, y, tmp_path)
    assert "exe_mode: hybrid" in str(e.value) and "torch.where" in str(e.value)
    cm = _compiled(fn, x, y, tmp_path, mode="hybrid")
    assert torch.equal(cm(x, y), fn(x, y)) and cm.last_path["path"] == "graph"


@pytest.mark.slow     # ~30-50 s on a busy 2-core host: a Llama capture per rope type
def test_a_dynamic_rope_is_refused_with_its_fix(tmp_path):
    """Hugging Face's rope_type 'dynamic' recomputes its frequencies from the largest position of
    each call: the refusal names the rope and a rope type that captures (linear does)."""
    transformers = pytest.importorskip("transformers")

    def llama(rope):
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                       num_key_value_heads=1, vocab_size=64, max_position_embeddings=64,
                                       rope_scaling={"rope_type": rope, "factor": 2.0}, use_cache=False)
        cfg._attn_implementation = "sdpa"
        return transformers.LlamaForCausalLM(cfg).eval()
    rec = {"version": 1, "name": "rope", "inputs": [{"name": "input_ids", "dtype": "i64", "shape": [1, "seq"]}],
           "dims": {"seq": {"min": 2, "max": 8, "buckets": list(range(2, 9))}}, "exe_mode": "graph",
           "targets": ["host"]}
    ids = {"input_ids": torch.randint(0, 64, (1, 8))}
    with pytest.raises(CaptureError, match=r"rope_type 'dynamic' or 'longrope'") as e:
        graphmode.compile((llama("dynamic"), ids), rec, cache_dir=tmp_path)
    assert e.value.where == "model.config.rope_scaling" and "'linear'" in e.value.fix
    assert "modeling_rope_utils.py" in str(e.value) and "site-packages" not in str(e.value)
    cm = graphmode.compile((llama("linear"), ids), rec, cache_dir=tmp_path)
    assert cm(**ids).logits.shape == (1, 8, 64)


class _SymbolicTril(torch.nn.Module):
    def forward(self, x, mem):
        s, sk = x.shape[1], mem.shape[1]
        keep = torch.ones(s, sk, dtype=torch.bool).tril(diagonal=sk - s)
        return (x @ mem.transpose(1, 2)).masked_fill(~keep, 0.0)


@pytest.mark.parametrize("mode", ["graph", pytest.param("hybrid", marks=pytest.mark.slow)])
def test_an_op_argument_computed_from_two_dims_is_decomposed_not_a_broken_attribute(mode, tmp_path):
    """tril(diagonal=sk - s) over two symbolic dims: the diagonal is a size computed at run time,
    which the op's int attribute cannot hold (it became an fx node in the graph: every call then
    failed 'Object of type Node is not JSON serializable'; later an island, refused in graph
    mode). torch's decomposition of tril (an arange comparison) is lowered in both modes and
    matches eager at every bucket; padding seq would move the diagonal, so it is refused."""
    rec = {"version": 1, "name": "tril", "exe_mode": mode,
           "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", "seq", 8]},
                      {"name": "mem", "dtype": "f32", "shape": ["batch", "mseq", 8]}],
           "dims": {"batch": {"buckets": [2]}, "seq": {"min": 4, "max": 6, "buckets": [4, 5, 6]},
                    "mseq": {"min": 8, "max": 10, "buckets": [8, 9, 10]}}}
    cm = graphmode.compile(_SymbolicTril(), rec, cache_dir=tmp_path)
    assert not cm.capture_report.fallbacks
    for s, sk in [(4, 8), (5, 9), (6, 10), (4, 10)]:
        x, mem = torch.randn(2, s, 8), torch.randn(2, sk, 8)
        assert torch.allclose(cm(x=x, mem=mem), _SymbolicTril()(x, mem), rtol=1e-5, atol=1e-5)
    rec["dims"]["seq"]["buckets"] = [6]
    with pytest.raises(ContractRefused, match=r"padding seq up to its bucket can change the outputs"):
        graphmode.compile(_SymbolicTril(), rec, cache_dir=tmp_path)


def test_a_longrope_buffer_update_is_refused_as_a_rope_not_as_training_state(tmp_path):
    """Phi-3's longrope writes its inv_freq buffer in the forward (a buffer mutation, not a
    branch): the refusal names the rope type, not eval mode (the model already is in it)."""
    transformers = pytest.importorskip("transformers")
    hd = 8
    torch.manual_seed(0)
    cfg = transformers.Phi3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                  num_key_value_heads=2, vocab_size=64, max_position_embeddings=64,
                                  original_max_position_embeddings=16, sliding_window=None, pad_token_id=0,
                                  rope_scaling={"rope_type": "longrope", "original_max_position_embeddings": 16,
                                                "short_factor": [1.0] * (hd // 2), "long_factor": [2.0] * (hd // 2)})
    m = transformers.Phi3ForCausalLM(cfg).eval()
    rec = {"version": 1, "name": "longrope", "inputs": [{"name": "input_ids", "dtype": "i64", "shape": [1, "seq"]}],
           "dims": {"seq": {"buckets": [8, 32]}}, "exe_mode": "graph", "targets": ["host"]}
    with pytest.raises(CaptureError, match=r"rope_type 'dynamic' or 'longrope'") as e:
        graphmode.compile((m, {"input_ids": torch.randint(0, 64, (1, 8))}), rec, cache_dir=tmp_path)
    assert e.value.where == "model.config.rope_scaling" and "eval mode" not in e.value.fix


class _LastThree(torch.nn.Module):
    def forward(self, x):
        return x[:, -3:].sum(1)


def test_a_dim_range_export_narrows_is_refused_with_the_range_it_suggests(tmp_path):
    """A slice of the last 3 on a dynamic seq holds for seq >= 3 only: torch.export's own
    suggested range, in recipe terms, instead of its first line about its symbols."""
    rec = {"version": 1, "name": "t", "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", "seq", 16]}],
           "dims": {"batch": {"buckets": [1, 2]}, "seq": {"min": 1, "max": 16, "buckets": [4, 8, 16]}},
           "exe_mode": "graph", "targets": ["host"]}
    with pytest.raises(CaptureError) as e:
        graphmode.compile(_LastThree(), rec, cache_dir=tmp_path)
    assert e.value.where == "dims.seq" and "seq min 3, max 16" in e.value.fix and "batch" not in e.value.fix


class _FirstFour(torch.nn.Module):
    def forward(self, x):
        return x[:, :4] * 2


def test_a_range_torch_export_excludes_one_end_of_is_narrowed_past_it(tmp_path):
    """x[:, :4] holds for seq >= 4 but torch.export also guards seq != 4 (there the slice is the
    whole tensor) and suggests nothing for a range from 4: the recipe is told to start at 5, and
    a draft keeps seq dynamic from 5 instead of fixing it at the example's size."""
    rec = {"version": 1, "name": "t", "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", "seq", 16]}],
           "dims": {"batch": {"buckets": [1, 2]}, "seq": {"min": 4, "max": 16, "buckets": [8, 16]}},
           "exe_mode": "graph", "targets": ["host"]}
    with pytest.raises(CaptureError) as e:
        graphmode.compile(_FirstFour(), rec, cache_dir=tmp_path)
    assert e.value.where == "dims.seq" and "seq min 5, max 16" in e.value.fix
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = graphmode.compile((_FirstFour(), (torch.randn(2, 7, 16),), {"x": ["batch", "seq", 16]}),
                               cache_dir=tmp_path)
    assert cm.recipe.dims["seq"].min == 5
    x = torch.randn(2, 11, 16)
    assert torch.equal(cm(x), _FirstFour()(x))


@pytest.mark.parametrize("text,fix", [
    ("in the specified range 4 <= seq <= 16 satisfy the generated guard (4*L['x'].size()[1]) != 16.",
     "seq = Dim('seq', min=5, max=16)"),
    ("in the specified range seq <= 512 satisfy the generated guard (4*L['x'].size()[1]) != 8.",     # x[:, :2]
     "seq = Dim('seq', min=3, max=512)"),
    ("in the specified range seq <= 512 satisfy the generated guard 512 != L['x'].size()[1].",       # buffer[:seq]
     "seq = Dim('seq', min=2, max=511)"),
    ("in the specified range 4 <= seq <= 16 satisfy the generated guard L['x'].size()[1] != 9.", ""),  # inside
])
def test_a_guard_excluding_one_end_of_the_range_narrows_past_it(text, fix):
    from graphmode.capture.export_errors import _excluded_ends
    assert _excluded_ends(f"  - Not all values of seq = L['x'].size()[1] {text}") == fix


class _Twice(torch.nn.Module):
    def forward(self, v):
        return v.float() * 2


def test_an_example_holding_int64_max_compiles(tmp_path):
    """Samples are drawn within the example's values: randint's exclusive top overflowed at the
    type's largest value (a raw 'Overflow when unpacking long long')."""
    v = torch.tensor([[1, 2, 3, 2**63 - 1]])
    rec = {"version": 1, "name": "o", "inputs": [{"name": "v", "dtype": "i64", "shape": [1, 4]}], "exe_mode": "graph",
           "targets": ["host"]}
    cm = graphmode.compile((_Twice(), (v,)), rec, cache_dir=tmp_path)
    assert torch.equal(cm(v), _Twice()(v))


def test_a_meta_tensor_input_is_refused_naming_it(tmp_path):
    from graphmode.errors import ContractViolation
    rec = {"version": 1, "name": "o", "inputs": [{"name": "v", "dtype": "i64", "shape": [1, 4]}], "exe_mode": "graph",
           "targets": ["host"]}
    cm = graphmode.compile((_Twice(), (torch.tensor([[1, 2, 3, 4]]),)), rec, cache_dir=tmp_path)
    with pytest.raises(ContractViolation, match="meta tensor") as e:
        cm(torch.empty(1, 4, dtype=torch.int64, device="meta"))
    assert e.value.where == "inputs.v"


class _SvdBias(torch.nn.Module):
    def forward(self, x):                       # svdvals' size is min(seq, 16): torch.export's own Min
        return x + torch.linalg.svdvals(x)[:, None, :].sum(-1, keepdim=True)


def test_a_dim_of_torchs_own_min_compares_equal_to_the_irs(tmp_path):
    """torch.export sizes svdvals' output with torch's Min, a class sympy's Min is not equal to:
    the verifier found a reshape of it 'changes the element count' and blamed the first pass."""
    rec = {"version": 1, "name": "t", "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", "seq", 16]}],
           "dims": {"batch": {"buckets": [1, 2]}, "seq": {"buckets": [4, 8]}},
           "exe_mode": "hybrid", "on_violation": "eager", "targets": ["host"]}
    cm = graphmode.compile(_SvdBias(), rec, cache_dir=tmp_path)
    x = torch.randn(2, 8, 16)
    assert torch.allclose(cm(x), _SvdBias()(x), rtol=1e-5, atol=1e-5) and cm.last_path["path"] == "graph"


class _FirstTwo(torch.nn.Module):
    def forward(self, x):
        return x[:2] * 3


def test_a_constant_slice_past_the_smallest_admitted_dim_is_refused(tmp_path):
    """x[:2] over batch 1..4: torch.export proves length 2 from batch 2 up, and the plan at batch
    1 answered two rows (the second read past the input) where eager answers one."""
    from graphmode.verdict import ContractRefused
    rec = {"version": 1, "name": "b", "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", 6]}],
           "dims": {"batch": {"min": 1, "max": 4}}}
    with pytest.raises(ContractRefused) as e:
        graphmode.compile(_FirstTwo(), rec, cache_dir=tmp_path)
    assert "dims.batch.min: 2" in str(e.value)
    cm = graphmode.compile(_FirstTwo(), dict(rec, dims={"batch": {"min": 2, "max": 4}}), cache_dir=tmp_path)
    x = torch.randn(3, 6)
    assert torch.equal(cm(x), _FirstTwo()(x))


def test_an_onnx_split_with_fixed_sizes_over_a_dynamic_axis_is_refused(tmp_path):
    """ONNX Runtime and eager refuse an extent the sizes do not sum to; the plan answered."""
    from graphmode.errors import CaptureError

    class Split(torch.nn.Module):
        def forward(self, x):
            a, b = torch.split(x, [2, 2], 0)
            return a - b
    p = tmp_path / "split.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Split(), (torch.randn(4, 6),), str(p), dynamo=False, opset_version=17, input_names=["x"],
                          dynamic_axes={"x": {0: "batch"}})
    rec = {"version": 1, "name": "s", "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", 6]}],
           "dims": {"batch": {"min": 4, "max": 6}}}
    with pytest.raises(CaptureError, match=r"fix the split axis at 4"):
        graphmode.compile(str(p), rec, cache_dir=tmp_path)


def test_an_onnx_model_runs_its_fallback_requests_in_onnx_runtime(tmp_path):
    """on_violation: eager for an ONNX file (the drafter picks it for a mean over seq): a request
    the padding cannot serve ran nowhere ("needs the original torch module"); ONNX Runtime is
    its eager."""
    class SeqMean(torch.nn.Module):
        def forward(self, x):
            return x.mean(1)
    p = tmp_path / "mean.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(SeqMean(), (torch.randn(2, 5, 8),), str(p), dynamo=False, opset_version=17,
                          input_names=["x"], dynamic_axes={"x": {0: "batch", 1: "seq"}})
    rec = {"version": 1, "name": "m", "on_violation": "eager",
           "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", "seq", 8]}],
           "dims": {"batch": {"buckets": [1, 2]}, "seq": {"buckets": [4, 8], "min": 1}}}
    cm = graphmode.compile(str(p), rec, cache_dir=tmp_path)
    x = torch.randn(2, 6, 8)                                    # seq 6: between buckets, unsafe to pad
    assert torch.allclose(cm(x=x), x.mean(1), rtol=1e-5, atol=1e-6) and cm.last_path["path"] == "eager"
    x = torch.randn(2, 8, 8)
    assert torch.allclose(cm(x=x), x.mean(1), rtol=1e-5, atol=1e-6) and cm.last_path["path"] == "graph"


def test_a_module_the_recipe_declares_wrongly_is_refused_naming_the_recipe_inputs(tmp_path):
    """A module handed with a recipe runs on inputs the recipe declares: a wrong channel count,
    name or dtype was reported as 'running the model on its example inputs failed'."""
    from graphmode.errors import RecipeError
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU()).eval()

    def rec(name="input", dtype="f32", channels=3):
        return {"version": 1, "name": "r", "dims": {"batch": {"buckets": [1, 2]}},
                "inputs": [{"name": name, "dtype": dtype, "shape": ["batch", channels, 16, 16]}]}
    with pytest.raises(RecipeError, match=r"does not run on inputs as the recipe declares them "
                                          r"\(input f32 \['batch', 4, 16, 16\]\).*3 channels") as e:
        graphmode.compile(m, rec(channels=4), cache_dir=tmp_path)
    assert e.value.where == "inputs"
    with pytest.raises(RecipeError, match=r"inputs\[0\].name 'images' is not a parameter of Sequential.forward") as e:
        graphmode.compile(m, rec(name="images"), cache_dir=tmp_path)
    assert "['input']" in e.value.fix
    with pytest.raises(RecipeError, match=r"input f16"):
        graphmode.compile(m, rec(dtype="f16"), cache_dir=tmp_path)


class _Interpolate(torch.nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.kw = kw

    def forward(self, x):
        return torch.nn.functional.interpolate(x * 2, **self.kw)


@pytest.mark.parametrize("kw", [{"scale_factor": 1.5, "mode": "nearest"}, {"size": (17, 23), "mode": "nearest"},
                                {"scale_factor": 0.5, "mode": "bilinear", "align_corners": True}],
                         ids=["nearest-1.5", "to-a-size", "bilinear-0.5"])
def test_interpolate_over_dynamic_sizes_runs_in_graph_mode(tmp_path, kw):
    """F.interpolate over a dynamic H, W had no lowering (an eager island, refused in graph mode):
    torch.export's size TruncToInt(1.5 * ToFloat(H)) is floor(3H / 2) exactly."""
    rec = {"version": 1, "name": "i", "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", 3, "H", "W"]}],
           "dims": {"batch": {"buckets": [1, 2]}, "H": {"min": 8, "max": 16}, "W": {"min": 8, "max": 16}}}
    m = _Interpolate(**kw)
    cm = graphmode.compile(m, rec, cache_dir=tmp_path)
    assert not cm.capture_report.fallbacks
    for hw in [(9, 13), (16, 11)]:
        x = torch.randn(2, 3, *hw)
        torch.testing.assert_close(cm(x), m(x), rtol=1e-5, atol=1e-6)


def test_interpolate_by_a_scale_doubles_do_not_hold_exactly_stays_an_eager_island(tmp_path):
    """1/3 as a double times H rounds before torch floors it: no exact size formula, so no graph."""
    from graphmode.verdict import ContractRefused
    rec = {"version": 1, "name": "i", "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", 3, "H", "W"]}],
           "dims": {"batch": {"buckets": [1, 2]}, "H": {"min": 8, "max": 16}, "W": {"min": 8, "max": 16}}}
    with pytest.raises(ContractRefused, match="upsample_nearest2d"):
        graphmode.compile(_Interpolate(scale_factor=1 / 3, mode="nearest"), rec, cache_dir=tmp_path)


@pytest.mark.slow     # ~35 s on 2 busy cores; Whisper's encoder is in the family tests
def test_whisper_for_conditional_generation_compiles_without_example_inputs(tmp_path):
    """Its inputs from the config had no decoder_input_ids, so the example run raised (a forward
    needs decoder ids or embeddings); decoder_seq now spans the decoder's position table."""
    import transformers
    cfg = transformers.WhisperConfig(vocab_size=100, num_mel_bins=16, encoder_layers=1, encoder_attention_heads=2,
                                     decoder_layers=1, decoder_attention_heads=2, d_model=32, encoder_ffn_dim=64,
                                     decoder_ffn_dim=64, max_source_positions=30, max_target_positions=40,
                                     pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    torch.manual_seed(0)
    m = transformers.WhisperForConditionalGeneration(cfg).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = graphmode.compile(m, cache_dir=tmp_path)
    assert (cm.recipe.dims["decoder_seq"].min, cm.recipe.dims["decoder_seq"].max) == (1, 40)
    x, ids = torch.randn(3, 16, 60), torch.randint(3, 100, (3, 7))
    torch.testing.assert_close(cm(input_features=x, decoder_input_ids=ids).logits,
                               m(input_features=x, decoder_input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def _ast():
    import transformers
    torch.manual_seed(0)
    return transformers.ASTForAudioClassification(transformers.ASTConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64, num_mel_bins=16, max_length=48,
        patch_size=16, frequency_stride=8, time_stride=8, num_labels=3)).eval()


@pytest.mark.slow     # ~6 s; drafting examples from a config is tested on text models
def test_a_spectrogram_models_examples_come_from_its_config(tmp_path):
    """AST's input_values is a [batch, frames, mel bins] spectrogram: drafted as raw audio [2, 4000],
    its example run failed with 'check that module(**example_inputs) runs', examples the user never gave."""
    m = _ast()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = graphmode.compile(m, cache_dir=tmp_path)
    x = torch.randn(3, 48, 16)
    torch.testing.assert_close(cm(input_values=x).logits, m(input_values=x).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("norm,masked", [("layer", True), ("group", False)])
def test_raw_audio_examples_take_the_attention_mask_its_feature_extractor_returns(norm, masked):
    """A Wav2Vec2 with layer-normed features (large/lv60: its feature extractor returns an
    attention mask) was drafted without one, so cm(**features) was refused naming it; group-normed
    ones (base) take none (transformers' docs: do not pass it)."""
    import transformers

    from graphmode.capture.hf import example_inputs
    m = transformers.Wav2Vec2Model(transformers.Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, conv_dim=(16, 16),
        conv_stride=(5, 2), conv_kernel=(10, 3), num_feat_extract_layers=2, feat_extract_norm=norm,
        num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2))
    ex, dims = example_inputs(m)
    assert ("attention_mask" in ex) is masked and set(dims) == set(ex)
    assert all(d == ["batch", "samples"] for d in dims.values())


def test_an_hf_model_that_does_not_run_graphmodes_examples_says_they_were_graphmodes(monkeypatch):
    from graphmode.capture import hf
    monkeypatch.setattr(hf, "_is_spectrogram", lambda cfg: False)      # AST's input drafted as raw audio
    with pytest.raises(CaptureError) as e:
        graphmode.compile(_ast())
    assert "graphmode made from its config (input_values [2, 4000] float32)" in e.value.message
    assert e.value.where == "model" and "pass (model, example_inputs)" in e.value.fix


def test_an_eager_island_beside_a_bool_output_runs_at_every_batch(tmp_path):
    """index_put(accumulate=True) as an eager island on an arena view whose storage also holds a
    bool output: ATen asserted 'nbytes % dtype_size == 0' at every batch but the example's."""
    class _Scatter(torch.nn.Module):
        def forward(self, x, idx):
            y = x.clone()
            y[:, 3] = 0.0
            y = y.index_put((torch.arange(x.shape[0]), idx % 8), torch.ones(x.shape[0]), accumulate=True)
            return y, (x > 2).any(-1)
    m = _Scatter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = graphmode.compile((m, (torch.randn(4, 8), torch.tensor([1, 5, 2, 7]))), cache_dir=tmp_path)
    for b in (1, 3):
        x, idx = torch.randn(b, 8), torch.randint(0, 8, (b,))
        got, want = cm(x, idx), m(x, idx)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])



class _LegacyCat(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(20, 4)

    def forward(self, ids):
        e = self.emb(ids)
        return torch.cat([e, e.new_zeros(0)], dim=1)      # torch.cat skips a 1-d empty tensor (legacy)


@pytest.mark.slow     # ~30-50 s on a busy 2-core host: two compiles
def test_a_legacy_empty_cat_and_an_item_assert_capture_and_match_eager():
    """XLM concatenates a 1-d empty tensor (the padding analysis raised IndexError on a concat of
    two ranks) and asserts lengths.max().item() <= slen (was "unsupported python op
    <built-in function le> at le_1", without a line)."""
    import graphmode
    import transformers as T
    m = _LegacyCat().eval()
    cm = graphmode.compile((m, {"ids": torch.randint(1, 20, (2, 6))}, {"ids": ["batch", "seq"]}))
    x = torch.randint(1, 20, (3, 5))
    assert cm.mode == "graph" and cm.capture_report.fallbacks == [] and torch.allclose(cm(x), m(x), atol=1e-6)
    torch.manual_seed(0)
    xlm = T.XLMModel(T.XLMConfig(emb_dim=32, n_layers=1, n_heads=2, vocab_size=100, max_position_embeddings=64)).eval()
    cm = graphmode.compile(xlm)
    ids, mask = torch.randint(5, 100, (2, 12)), torch.ones(2, 12, dtype=torch.long)
    with torch.no_grad():
        ref = xlm(input_ids=ids, attention_mask=mask).last_hidden_state
    out = cm(input_ids=ids, attention_mask=mask).last_hidden_state
    assert float((out - ref).norm() / ref.norm()) < 1e-5


def _lin():
    torch.manual_seed(0)
    return torch.nn.Linear(16, 8).eval()


def test_wrapped_and_built_under_inference_mode_modules_at_the_front_door():
    """torch.compile's wrapper is compiled as the module it wraps (it crashed on the wrapper's
    __len__); a scripted module, weights made under inference_mode, and a compile called under
    inference_mode each get a clear answer."""
    m, x = _lin(), torch.randn(3, 16)
    cm = graphmode.compile((torch.compile(m), (torch.randn(2, 16),)))
    assert torch.allclose(cm(x), m(x), atol=1e-6)
    with pytest.raises(CaptureError, match="(?s)scripted module.*pass the nn.Module you scripted"):
        graphmode.compile((torch.jit.script(m), (torch.randn(2, 16),)))
    traced = torch.jit.trace(m, torch.randn(2, 16))
    assert torch.allclose(graphmode.compile((traced, (torch.randn(2, 16),)))(x), m(x), atol=1e-6)
    with torch.inference_mode():
        built_inside = _lin()
        cm = graphmode.compile((_lin(), (torch.randn(2, 16),)))
        assert torch.allclose(cm(x), m(x), atol=1e-6)
    with pytest.raises(CaptureError, match="(?s)inference tensors.*outside torch.inference_mode"):
        graphmode.compile((built_inside, (torch.randn(2, 16),)))


def test_hooks_are_named_at_compile_and_a_python_option_at_call():
    from graphmode.capture.spec import GraphmodeNotice
    from graphmode.errors import ContractViolation
    m = torch.nn.Sequential(_lin(), torch.nn.ReLU()).eval()
    feats = {}
    m[0].register_forward_hook(lambda mod, i, o: feats.__setitem__("h", o))
    with pytest.warns(GraphmodeNotice, match="forward hooks on module '0'.*does not happen on compiled calls"):
        graphmode.compile((m, (torch.randn(2, 16),)))

    class Option(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = _lin()

        def forward(self, x, double: bool = False):
            return self.lin(x) * (2 if double else 1)
    cm = graphmode.compile((Option().eval(), (torch.randn(2, 16),)))
    with pytest.raises(ContractViolation, match=r"(?s)\[.double.\] is an option .* wrapper module .*double=True"):
        cm(torch.randn(2, 16), double=True)


def test_a_scalar_input_leaves_the_drafted_batch_axis_to_the_others():
    """A 0-d input (a temperature) has no batch axis: the draft still makes the others' leading
    axis `batch` (it dropped the dynamic batch for every input)."""
    class Scaled(torch.nn.Module):
        def forward(self, x, t):
            return x * t
    cm = graphmode.compile((Scaled().eval(), (torch.randn(2, 16), torch.tensor(2.0))))
    assert "batch" in cm.recipe.dims and [list(i.shape) for i in cm.recipe.inputs] == [["batch", 16], []]
    x = torch.randn(5, 16)
    assert torch.equal(cm(x, torch.tensor(3.0)), x * 3) and cm.last_path["path"] == "graph"


def test_autograd_switched_on_inside_forward_is_named():
    class Grad(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = _lin()

        def forward(self, x):
            with torch.enable_grad():
                return self.lin(x)
    with pytest.raises(CaptureError, match="switches autograd on inside forward"):
        graphmode.compile((Grad().eval(), (torch.randn(2, 16),)))


def test_a_draft_starts_a_dim_where_a_slice_from_its_end_has_positions():
    """x.select(1, -2) reads two positions from the end: the draft starts seq at 2 (it refused its
    own draft, which admitted seq 1)."""
    class SecondLast(torch.nn.Module):
        def forward(self, x):
            return x.select(1, -2) * 2
    cm = graphmode.compile((SecondLast(), (torch.randn(2, 12),), {"x": ["batch", "seq"]}))
    assert cm.recipe.dim_range("seq")[0] == 2
    x = torch.randn(3, 5)
    assert torch.equal(cm(x), x[:, -2] * 2)


def test_capture_shows_no_warning_about_torch_internals(tmp_path):
    """torch.export's run_decompositions deep-copies its own pytree specs, which warned
    "`isinstance(treespec, LeafSpec)` is deprecated" twice on every PyTorch compile: about
    torch's code, nothing a user can act on."""
    import warnings
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _compiled(lambda x, y: x + y, x, y, tmp_path)
    assert not [w for w in seen if issubclass(w.category, FutureWarning)], [str(w.message) for w in seen]


class _CastsItsHead(torch.nn.Module):
    """SwitchTransformers' router casts its classifier in forward: `self.classifier = self.classifier.to(dtype)`."""

    def __init__(self, dtype):
        super().__init__()
        self.head, self.dtype = torch.nn.Linear(8, 4), dtype

    def forward(self, x):
        self.head = self.head.to(self.dtype)
        return self.head(x.to(self.dtype))


def test_a_module_cast_in_forward_to_the_dtype_it_has_compiles_and_a_real_cast_is_named(tmp_path):
    """A `.to()` that changes nothing was refused 'Couldn't swap Linear.weight' with a fix about
    dims; it is a no-op in eager and now in the capture too. A cast that changes the weights (in
    eager, for good, from the first call on) is refused naming them, not as inference tensors."""
    rec = {"version": 1, "name": "cast", "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", 8]}],
           "dims": {"batch": {"buckets": [2, 4]}}, "exe_mode": "graph", "targets": ["host"]}
    m = _CastsItsHead(torch.float32).eval()
    cm = graphmode.compile(m, rec, cache_dir=tmp_path)
    x = torch.randn(3, 8)
    assert torch.allclose(cm(x), m(x), rtol=1e-5, atol=1e-6)
    with pytest.raises(CaptureError, match=r"casts or moves its own weights .*head\.weight: float32 -> float64"):
        graphmode.compile(_CastsItsHead(torch.float64).eval(), rec, cache_dir=tmp_path)


def test_a_real_cast_met_by_the_exporter_itself_names_the_model_line():
    """Where no example run came first (the importer on its own), the cast fails inside
    torch.export; the refusal names the line in forward, not a dims problem."""
    from graphmode.capture.torch_import import import_torch
    with pytest.raises(CaptureError, match=r"moves or casts a Linear inside forward at .*test_capture_edge_cases\.py"):
        import_torch(_CastsItsHead(torch.float64).eval(), {"x": torch.randn(3, 8)}, {"x": [3, 8]}, {})


def test_the_export_time_to_wrapper_is_per_thread_and_removed_after_the_last_export():
    """Module.to is wrapped only while an export runs, and only the exporting thread's calls
    are read as the model's: another thread's cast runs as torch's own."""
    import threading
    from graphmode.capture import module_moves
    real = torch.nn.Module.to
    done = []
    with module_moves.unchanged_moves_kept():
        with module_moves.unchanged_moves_kept():
            t = threading.Thread(target=lambda: done.append(torch.nn.Linear(2, 2).to(torch.float64).weight.dtype))
            t.start()
            t.join()
        assert torch.nn.Module.to is not real
    assert torch.nn.Module.to is real and done == [torch.float64]


def test_a_derived_dim_torch_export_suggests_is_said_in_the_recipes_own_dim():
    """torch.export suggests `_samples = Dim(...)` and `samples = 10*_samples` (Wav2Vec2's conv
    strides): the refusal named a dim `_samples` with a tenth of the range, which no recipe has."""
    from graphmode.capture.export_errors import export_failure
    text = ("Constraints violated (samples)! For more information, run with TORCH_LOGS=\"+dynamic\".\n"
            "  - Not all values of samples satisfy the generated guard.\nSuggested fixes:\n"
            "  _samples = Dim('_samples', min=160, max=16000)\n  samples = 10*_samples\n")
    e = export_failure(RuntimeError(text), fix="generic")
    assert "samples a multiple of 10 in [1600, 160000]" in e.message and "_samples" not in e.message
    assert e.where == "dims.samples" and e.suggested_ranges == {}
    # trial AE: the fix repeated the message's explanation and asked to "narrow" to a multiple
    assert e.fix.startswith("give samples one size per compile") and "step" not in e.message
    # a draft tries a shorter range (its solver proves the floor guard there): Wav2Vec2's samples
    # were fixed at the example's 4000 where 1600..40000 exports
    from types import SimpleNamespace
    from graphmode.kb.draft import _export_ranges
    assert e.derived_ranges == {"samples": (1600, 160000)}
    bundle = SimpleNamespace(dim_names=["batch", "samples"], example_shape=lambda: {"batch": 2, "samples": 4000})
    assert _export_ranges(e, bundle, {})["samples"][:2] == (1600, 40000)
    assert _export_ranges(e, bundle, {"samples": (1600, 160000)}) is None        # the user's own range stays


def _levit_like_forward():
    raise RuntimeError("Expected size for first two dimensions of batch2 tensor to be: [2, 4] but got: [2, 3].")


def test_a_guard_torch_export_cannot_prove_is_named_in_the_dims_own_name():
    """XLNet with a dynamic seq: 'Constraints violated (seq)!' and nothing else, the condition the
    model needs dropped from the message."""
    from graphmode.capture.export_errors import export_failure
    text = ("Constraints violated (seq)! For more information, run with TORCH_LOGS=\"+dynamic\".\n"
            "  - Not all values of seq = L['input_ids'].size()[1] in the specified range seq <= 64 satisfy the "
            "generated guard (((-1) + 2*L['input_ids'].size()[1]) % L['input_ids'].size()[1]) != 0.\n")
    e = export_failure(RuntimeError(text), fix="generic")
    assert "holds only where (((-1) + 2*seq) % seq) != 0, which torch.export cannot prove" in e.message
    assert e.where == "dims.seq" and "make seq static" in e.fix
    # with the range it was exported over, the guard is checked at each value: XLNet's fails at seq 1 only
    e = export_failure(RuntimeError(text), fix="generic", ranges={"seq": (1, 64)})
    assert "which fails at seq = 1 in the recipe's range 1..64" in e.message, e.message
    assert e.fix.startswith("narrow dims.seq to where it holds (2..64)"), e.fix


def test_a_dim_torch_export_keeps_static_is_the_one_it_names_and_no_capture_size_is_suggested():
    """Trial AF: `torch.linspace(0, 1, T)` fixes T. The refusal led with dims.batch (static only
    in graphmode's capture range 1..2) and suggested t: {buckets: [5]}, the size of graphmode's
    capture example, not one the user serves."""
    from graphmode.capture.export_errors import export_failure
    text = ("Constraints violated (t)! For more information, run with TORCH_LOGS=\"+dynamic\".\n"
            "  - Not all values of t = L['x'].size()[1] in the specified range 4 <= t <= 40 are valid because t was "
            "inferred to be a constant (5).\nSuggested fixes:\n  batch = 2\n  t = 5\n")
    e = export_failure(RuntimeError(text), fix="generic")
    assert e.where == "dims.t" and "batch" not in e.message and "t static" in e.message, e.message
    assert "specialises the model's code on that size" in e.message
    assert "t one value (t: N, a number: N a size you serve)" in e.fix and "5" not in e.fix, e.fix


def test_a_reshape_into_pieces_of_a_dynamic_dim_says_it_needs_a_multiple():
    """Trial AF: frame stacking (`reshape(B, T // 2, 2 * D)`) under `step: 2` gave torch's bare
    'shape [s77, (s27//2), 16] is invalid' with the generic fix."""
    from graphmode.capture.export_errors import export_failure
    e = export_failure(RuntimeError("shape '[s77, (s27//2), 16]' is invalid for input of size 8*s27*s77"),
                       fix="generic")
    assert "reshapes a dynamic dim into pieces of 2" in e.message and "multiple of 2" in e.message
    assert "its step spaces the buckets" in e.message and e.fix.startswith("give that dim one size per compile")


def test_a_guard_that_holds_on_the_whole_range_is_said_to_be_torch_exports_limit():
    """Trial AF: a wav2vec2-style conv front end with a transformer over 1600..8000 samples was told
    to use 'a range on which the condition always holds', which the range already was."""
    from graphmode.capture.export_errors import export_failure
    text = ("Constraints violated (samples)! For more information, run with TORCH_LOGS=\"+dynamic\".\n"
            "  - Not all values of samples = L['wav'].size()[1] in the specified range 1600 <= samples <= 8000 "
            "satisfy the generated guard (1 % ((-1) + (L['wav'].size()[1] // 10))) != 0.\n")
    e = export_failure(RuntimeError(text), fix="generic", ranges={"samples": (1600, 8000)})
    assert "true at every value of the range it was exported over (samples 1600..8000)" in e.message, e.message
    assert "cannot prove it" in e.message and "a range on which" not in e.fix
    assert e.fix.startswith("make samples static in the recipe") and "exe_mode: eager" in e.fix
    e = export_failure(RuntimeError(text), fix="generic", ranges={"samples": (1, 8000)})
    assert "fails at samples = 1..29 in the recipe's range" in e.message and "(30..8000)" in e.fix, e.message
    assert e.suggested_ranges == {"samples": (30, None)}        # where a draft starts the dim


class _StridedCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.c2 = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.head = torch.nn.Linear(16, 10)

    def forward(self, x):
        return self.head(torch.relu(self.c2(torch.relu(self.c1(x)))).mean((2, 3)))


def test_input_dims_keyword_drafts_a_cnns_height_and_width_dynamic(tmp_path):
    """`graphmode.compile(m, example_inputs=..., input_dims=...)` was not a keyword; and a strided
    conv's guard (H // 2 + 1 != 1) refused the draft's H 1..64, so H and W were fixed at the
    example's 64 with a note that torch.export cannot keep them dynamic: they start at 3."""
    torch.manual_seed(0)
    m = _StridedCNN().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = graphmode.compile(m, example_inputs={"x": torch.randn(2, 3, 64, 64)},
                               input_dims={"x": ["batch", 3, "H", "W"]}, cache_dir=tmp_path)
    assert cm.recipe.dim_range("H") == (3, 64) and cm.recipe.dim_range("W") == (3, 64), cm.recipe.dims
    x = torch.randn(1, 3, 40, 56)
    with torch.no_grad():
        assert rel_l2(cm(x=x), m(x)) < 1e-5
    with pytest.raises(Exception, match="input_dims= names the axes of example_inputs="):
        graphmode.compile(m, input_dims={"x": ["batch", 3, "H", "W"]}, cache_dir=tmp_path)


def test_a_torch_export_failure_names_the_models_line_where_it_happened():
    """LeViT with dynamic sizes: 'torch.export failed: RuntimeError: Expected size for first two
    dimensions of batch2 ...' with no place in the model to look at."""
    from graphmode.capture.export_errors import export_failure
    try:
        _levit_like_forward()
    except RuntimeError as err:
        e = export_failure(err, fix="generic")
    assert e.message.startswith("torch.export failed: RuntimeError: Expected size")
    assert "test_capture_edge_cases.py:" in e.message and "in _levit_like_forward)" in e.message


class _FromEnd(torch.nn.Module):
    def forward(self, x):
        return x[:, x.shape[1] - 1] * 2, x[:, x.shape[1] - 3:] + 1


def test_an_index_computed_from_the_axis_size_is_taken_from_the_end(tmp_path):
    """`x[:, x.shape[1] - 1]` under a dynamic seq was refused as "no lowering for aten.select.int"
    (torch.compile(dynamic=True) runs it); it is the IR's index -1."""
    rec = {"version": 1, "name": "from-end", "exe_mode": "graph", "codegen": {"kernel_selection": "heuristic"},
           "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", "seq", 6]}],
           "dims": {"batch": {"buckets": [2]}, "seq": {"min": 4, "max": 8, "max_padding": 0}}}
    cm = graphmode.compile(_FromEnd(), rec, cache_dir=tmp_path)
    for t in (4, 6, 8):
        x = torch.randn(2, t, 6)
        assert all(torch.equal(a, b) for a, b in zip(cm(x), _FromEnd()(x)))


class _Reversed(torch.nn.Module):
    def forward(self, x):
        return x + torch.arange(x.shape[1] - 1, -1, -1)[None, :, None]


def test_an_op_refused_for_a_dim_computed_argument_says_so(tmp_path):
    rec = {"version": 1, "name": "rev", "exe_mode": "graph", "inputs": [{"name": "x", "dtype": "f32",
                                                                        "shape": ["batch", "seq", 6]}],
           "dims": {"batch": {"buckets": [2]}, "seq": {"min": 4, "max": 8, "max_padding": 0}}}
    with pytest.raises(ContractRefused, match=r"argument computed from a dynamic dim \(seq-1\)") as e:
        graphmode.compile(_Reversed(), rec, cache_dir=tmp_path)
    assert "hybrid" in e.value.render()


class _Baddbmm(torch.nn.Module):
    def forward(self, x, y):
        return torch.baddbmm(y, x, x.transpose(1, 2), beta=0.5, alpha=2.0)


def test_baddbmm_is_known_ops_so_a_padded_batch_is_proved_safe(tmp_path):
    """It ran as an opaque aten reference op, and the padding analysis refused a batch bucket
    (nn.MultiheadAttention with need_weights=True)."""
    rec = {"version": 1, "name": "baddbmm", "exe_mode": "graph", "codegen": {"kernel_selection": "heuristic"},
           "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", 5, 6]},
                      {"name": "y", "dtype": "f32", "shape": ["batch", 5, 5]}], "dims": {"batch": {"buckets": [1, 4]}}}
    cm = graphmode.compile(_Baddbmm(), rec, cache_dir=tmp_path)
    x, y = torch.randn(3, 5, 6), torch.randn(3, 5, 5)
    assert rel_l2(cm(x, y), _Baddbmm()(x, y)) < 1e-5 and cm.last_path["path"] == "graph"


class _Packed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = torch.nn.LSTM(4, 6, batch_first=True)

    def forward(self, x, lengths):
        packed = torch.nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        return torch.nn.utils.rnn.pad_packed_sequence(self.rnn(packed)[0], batch_first=True, total_length=x.shape[1])[0]


def test_packed_sequences_are_named_with_what_to_do_instead():
    """torch.export's TypeError inside zeros() came with "check the recipe's dims" (no recipe was given)."""
    with pytest.raises(CaptureError, match="packs variable-length sequences") as e:
        graphmode.compile(_Packed(), example_inputs=(torch.randn(3, 7, 4), torch.tensor([7, 3, 5])))
    assert "padded batch" in e.value.fix


def test_a_recurrent_layer_over_a_dynamic_length_says_torch_export_specializes_it():
    """It said "e.g. a slice shorter than it asks for" of an nn.GRU whose length export fixes."""
    from torch.export import Dim
    rnn = torch.nn.GRU(4, 6, batch_first=True).eval()
    with pytest.raises(CaptureError, match="nn.GRU runs the recurrence as one ATen op") as e:
        graphmode.compile(rnn, example_inputs=(torch.randn(2, 6, 4),),
                          dynamic_shapes={"input": {1: Dim("seq", min=2, max=32)}})
    assert "seq static" in e.value.message and "slice shorter" not in e.value.message


class _SparseBuffer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("adjacency", torch.eye(4).to_sparse())

    def forward(self, x):
        return self.lin(x) + (self.adjacency @ x.T).T


def test_a_sparse_buffer_the_forward_reads_is_refused_naming_it():
    """It reached the padding analysis and crashed there (RuntimeError: reshape is not implemented
    for sparse tensors), a raw traceback from graphmode.compile."""
    with pytest.raises(CaptureError, match="adjacency is a sparse_coo tensor") as e:
        graphmode.compile(_SparseBuffer().eval(), example_inputs=(torch.randn(2, 4),))
    assert "to_dense()" in e.value.fix


class _PositionsResized(torch.nn.Module):
    """DINOv2's position table resized to the image's patch grid: the resize's scale is a float
    computed from the dims (4 / floor(W / 8))."""

    def __init__(self):
        super().__init__()
        self.pos = torch.nn.Parameter(torch.randn(1, 4, 4, 4))

    def forward(self, x):
        grid = F.avg_pool2d(x, 8)
        return grid + F.interpolate(self.pos, size=(x.shape[2] // 8, x.shape[3] // 8), mode="bicubic",
                                    align_corners=False)


def _in_graph_over_images(m: torch.nn.Module, batch: int, tmp_path) -> None:
    """`m` compiled with H and W in 64..128 (buckets 64, 128) runs in graph mode as eager does."""
    hw = {"min": 64, "max": 128, "buckets": [64, 128]}
    rec = {"version": 1, "name": "images", "exe_mode": "graph", "codegen": {"kernel_selection": "heuristic"},
           "inputs": [{"name": "x", "dtype": "f32", "shape": [batch, 4, "H", "W"]}], "dims": {"H": hw, "W": hw},
           "on_violation": "eager"}
    cm = graphmode.compile(m, rec, cache_dir=tmp_path)
    for h, w in ((64, 64), (128, 64)):
        x = torch.randn(batch, 4, h, w)
        assert rel_l2(cm(x), m(x)) < 1e-5 and cm.last_path["path"] == "graph"


@pytest.mark.slow     # ~30-50 s on a busy 2-core host: a range of images
def test_a_float_computed_from_dims_is_a_float(tmp_path):
    """It was taken for an integer: compiled, then every call failed (an arange of 1/2)."""
    _in_graph_over_images(_PositionsResized(), 1, tmp_path)


class _PooledWhole(torch.nn.Module):
    """EfficientNet's head: a ceil-mode pool wider than any image of the range, then a view to
    [batch, channels]: the pooled extent floor(H/320 - ...) + 1 is 1 for every H of the range."""

    def __init__(self):
        super().__init__()
        self.pool, self.fc = torch.nn.AvgPool2d(320, ceil_mode=True), torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(self.pool(x).view(x.shape[0], 4))


def test_a_size_constant_over_the_dims_range_is_that_constant(tmp_path):
    """The view was refused as holding "at the example's shape only"."""
    _in_graph_over_images(_PooledWhole(), 2, tmp_path)


def test_a_module_without_examples_too_small_at_graphmodes_sizes_is_told_the_dims_min(tmp_path):
    """Trial AF: with `buckets:` alone a dim's min is 1, graphmode's example sizes (3, 5, ...) were
    below a conv's kernel, and the refusal blamed the recipe's inputs ('declare each input as the
    model takes it'). The examples are tried again at the smallest buckets, so torch.export's
    answer is the one given: the min the sizes hold from."""
    conv = torch.nn.Conv1d(1, 4, 10, stride=5).eval()

    class Frames(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = conv

        def forward(self, wav):
            return self.conv(wav.unsqueeze(1))
    r = {"version": 1, "name": "frames", "inputs": [{"name": "wav", "dtype": "f32", "shape": ["batch", "samples"]}],
         "dims": {"batch": {"buckets": [1, 2]}, "samples": {"buckets": [160, 320, 640]}}, "exe_mode": "graph",
         "memory": {"budget_mb": 64}, "targets": ["host"]}
    with pytest.raises(CaptureError, match=r"(?s)at samples = 1,.*conv") as e:
        graphmode.compile(Frames().eval(), r, cache_dir=tmp_path)
    assert e.value.where == "dims.samples.min" and e.value.fix.startswith("dims.samples.min: 15"), e.value
