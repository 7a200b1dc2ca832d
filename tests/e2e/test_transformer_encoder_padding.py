"""nn.TransformerEncoder with a key padding mask, compiled and compared with eager in eval mode.

Eager runs the layers on a nested tensor of the real positions when the mask's padding is at
the end of every row, and returns zeros in the padded rows (then its final norm of them);
torch.export traces the padded path, which computes those rows. The capture puts the zeroing
back (graphmode/capture/fast_paths.py): before it, a right-padded request answered rel L2 0.48
off eager."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import graphmode
from graphmode.errors import GraphmodeError


class Encoder(torch.nn.Module):
    def __init__(self, norm: bool = False, mask_check: bool = True):
        super().__init__()
        torch.manual_seed(0)
        layer = torch.nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, batch_first=True)
        self.enc = torch.nn.TransformerEncoder(layer, num_layers=2, norm=torch.nn.LayerNorm(32) if norm else None,
                                               mask_check=mask_check)

    def forward(self, x, src_key_padding_mask):
        return self.enc(x, src_key_padding_mask=src_key_padding_mask)


def _recipe(batch, seq, **extra):
    return {"version": 1, "name": "encoder",
            "inputs": [{"name": "x", "shape": [batch, seq, 32], "dtype": "f32"},
                       {"name": "src_key_padding_mask", "shape": [batch, seq], "dtype": "bool", "pad_value": 1}],
            **extra}


def _rel(out, ref):
    return float((out - ref).norm() / ref.norm())


def _masks(b, s):
    none = torch.zeros(b, s, dtype=torch.bool)
    right = none.clone()
    right[0, s - 3:] = True            # padding at the end of a row: eager's nested-tensor path
    left = none.clone()
    left[0, :3] = True                 # padding first: eager's padded path
    return {"none": none, "right": right, "left": left}


@pytest.mark.parametrize("norm", [False, True])
def test_padded_rows_match_eager_in_graph_mode(norm):
    m = Encoder(norm).eval()
    cm = graphmode.compile(m, _recipe(3, 8))
    assert cm.mode == "graph"
    x = torch.randn(3, 8, 32)
    for name, mask in _masks(3, 8).items():
        with torch.no_grad():
            ref = m(x, mask)
        out = cm(x, mask)
        assert _rel(out, ref) < 1e-5, name
        if name == "right" and not norm:
            assert bool((out[0, 5:] == 0).all())       # the rows eager zeroes


def test_a_request_between_buckets_runs_padded_in_graph_mode():
    """Bucket padding adds masked rows and positions: the padding analysis proves the
    alignment check and the zeroing unchanged by them, so batch and seq pad to their buckets."""
    m = Encoder().eval()
    cm = graphmode.compile(m, _recipe("batch", "seq", dims={"batch": {"buckets": [1, 2, 4]},
                                                           "seq": {"buckets": [8, 16]}}))
    assert cm.mode == "graph"
    _matches_in_graph_mode(m, cm, ((2, 8), (3, 5), (2, 12), (3, 8)))


def _matches_in_graph_mode(m, cm, shapes) -> None:
    for b, s in shapes:
        x = torch.randn(b, s, 32)
        for name, mask in _masks(b, s).items():
            with torch.no_grad():
                ref = m(x, mask)
            assert _rel(cm(x, mask), ref) < 1e-5, (b, s, name)
            assert cm.last_path["path"] == "graph", (b, s, name, cm.last_path)


def test_a_drafted_recipe_pads_the_key_padding_mask_as_padding():
    """Without a recipe: the mask (true marks padding) pads with true, not as an attention mask
    (0 would unmask the padded keys and every padded request would run eager)."""
    m = Encoder().eval()
    x, mask = torch.randn(2, 8, 32), torch.zeros(2, 8, dtype=torch.bool)
    cm = graphmode.compile((m, {"x": x, "src_key_padding_mask": mask},
                            {"x": ["batch", "seq", 32], "src_key_padding_mask": ["batch", "seq"]}))
    spec = {i.name: i for i in cm.recipe.inputs}["src_key_padding_mask"]
    assert spec.pad_value == 1 and spec.role == "data"
    _matches_in_graph_mode(m, cm, ((1, 7), (3, 5)))


def test_mask_check_off_is_refused_with_the_reason():
    with pytest.raises(GraphmodeError) as e:
        graphmode.compile(Encoder(mask_check=False).eval(), _recipe(3, 8))
    assert "mask_check" in str(e.value)


def build_encoder():
    """`graphmode verify --model` spec: the encoder alone (the recipe declares its inputs)."""
    return Encoder().eval()


@pytest.mark.slow     # ~7 s; the mask model's padding is checked against eager in this file's other tests
def test_graphmode_verify_on_a_key_padding_mask_model(tmp_path):
    """verify's samples give a key padding mask nothing padded (all true masked every key, and
    eager's fast path failed on them before graphmode was compared at all)."""
    import yaml
    from typer.testing import CliRunner

    from graphmode.cli.app import _register, app
    _register()
    (tmp_path / "enc.py").write_text("import sys\nsys.path.insert(0, %r)\n"
                                     "from test_transformer_encoder_padding import build_encoder\n" % str(Path(__file__).parent))
    (tmp_path / "enc.yaml").write_text(yaml.safe_dump(_recipe(2, 8)))
    res = CliRunner().invoke(app, ["--no-progress", "verify", "--model", f"{tmp_path / 'enc.py'}:build_encoder",
                                   "--recipe", str(tmp_path / "enc.yaml"), "--cache-dir", str(tmp_path / "cache")])
    assert res.exit_code == 0 and "all shapes match eager" in res.output, res.output


class SelfAttention(torch.nn.Module):
    def __init__(self, need_weights: bool, causal: bool = False, bias: bool = True):
        super().__init__()
        torch.manual_seed(0)
        self.attn = torch.nn.MultiheadAttention(32, 4, batch_first=True, bias=bias)
        self.need_weights, self.causal = need_weights, causal

    def forward(self, x, src_key_padding_mask):
        rows = torch.arange(x.shape[1])
        am = (rows[None, :] > rows[:, None]) | (rows[:, None] == 0) if self.causal else None   # row 0 sees no key
        return self.attn(x, x, x, key_padding_mask=src_key_padding_mask, attn_mask=am, need_weights=self.need_weights)[0]


def _whole_rows_masked(b, s):
    mask = torch.zeros(b, s, dtype=torch.bool)
    mask[1, :] = True               # every key of batch item 1 masked
    mask[0, s - 3:] = True
    return mask


@pytest.mark.parametrize("model", [SelfAttention(False), SelfAttention(True), SelfAttention(False, causal=True),
                                   SelfAttention(False, bias=False), Encoder(), Encoder(norm=True)],
                         ids=["mha", "mha-weights", "mha-causal", "mha-no-bias", "encoder", "encoder-norm"])
@pytest.mark.parametrize("nested", [True, False])
def test_rows_with_every_key_masked_are_nan_as_in_eager(model, nested):
    """Eager's native attention kernels (nn.MultiheadAttention as self-attention with boolean masks,
    an encoder layer in eval) answer NaN in a query row whose keys are all masked, where the traced
    path's scaled_dot_product_attention answered finite values: a wrong answer in graph mode until
    the capture put the NaN back (graphmode/capture/fast_paths.py)."""
    model.eval()
    if isinstance(model, Encoder):
        model.enc.use_nested_tensor = nested
    elif not nested:
        pytest.skip("no nested-tensor path outside nn.TransformerEncoder")
    cm = graphmode.compile(model, _recipe(3, 8, name="masked"))
    assert cm.mode == "graph"
    x, mask = torch.randn(3, 8, 32), _whole_rows_masked(3, 8)
    with torch.no_grad():
        ref = model(x, mask)
    out = cm(x, mask)
    assert cm.last_path["path"] == "graph"
    assert torch.equal(torch.isnan(out), torch.isnan(ref))          # none without a bias: no native kernel
    live = ~torch.isnan(ref).any(-1)
    assert live.any() and _rel(out[live], ref[live]) < 1e-5


def test_a_declared_pad_value_gives_the_example_nothing_padded():
    """A module handed without examples runs on inputs from the recipe: a bool input whose
    pad_value is 1 gets all zeros (nothing padded); all ones masked every key, and the encoder's
    eager nested-tensor path failed on them, whatever the input's name."""
    class Named(Encoder):
        def forward(self, x, mask):
            return self.enc(x, src_key_padding_mask=mask)
    rec = _recipe(2, 8)
    rec["inputs"][1]["name"] = "mask"
    m = Named().eval()
    cm = graphmode.compile(m, rec)
    x, mask = torch.randn(2, 8, 32), _masks(2, 8)["right"]
    with torch.no_grad():
        assert _rel(cm(x, mask), m(x, mask)) < 1e-5
