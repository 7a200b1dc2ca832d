"""torch.stft inside a model (a power spectrum, Whisper's log-mel) compiles: its complex result
is held as real and imaginary parts (capture/aten/spectral.py), within 1e-5 of eager at each
bucket; a reader of the complex value it does not cover is refused by name."""
from __future__ import annotations

import pytest
import torch

import graphmode
from graphmode.errors import CaptureError
from graphmode.verify.numerics import rel_l2

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class _Spectra(torch.nn.Module):
    """A power spectrum in dB, view_as_real sliced, and Whisper's log-mel (n_fft 400, hop 160,
    the last frame dropped, a mel filter bank, log10 clamped and floored)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("win", torch.hann_window(64))
        self.register_buffer("win400", torch.hann_window(400))
        self.register_buffer("mel", torch.rand(20, 201))

    def forward(self, wav):
        st = torch.stft(wav, 64, 16, window=self.win, return_complex=True)
        db = torch.log(st.abs().pow(2) + 1e-6)
        parts = torch.view_as_real(st)[..., 1:-1, :, 0]
        w = torch.stft(wav, 400, 160, window=self.win400, return_complex=True)
        power = w[..., :-1].abs() ** 2
        logmel = torch.clamp(self.mel @ power, min=1e-10).log10()
        logmel = torch.maximum(logmel, logmel.amax(dim=(-2, -1), keepdim=True) - 8.0)
        return db, parts, logmel


def test_stft_spectra_match_eager_at_each_bucket(tmp_path):
    m = _Spectra().eval()
    recipe = {"version": 1, "name": "spectra",
              "inputs": [{"name": "wav", "dtype": "f32", "shape": ["batch", "samples"]}],
              "dims": {"batch": {"buckets": [2]}, "samples": {"min": 800, "buckets": [1600]}},
              "on_violation": "eager", "codegen": {"kernel_selection": "heuristic"}}
    cm = graphmode.compile(m, recipe, example_inputs={"wav": torch.randn(2, 1600)}, cache_dir=tmp_path)
    g = torch.Generator().manual_seed(0)
    for shape in [(2, 1600), (1, 1600)]:
        x = torch.randn(*shape, generator=g)
        got, want = cm(wav=x), m(x)
        assert cm.last_path["path"] == "graph", cm.last_path
        for a, b in zip(got, want):
            assert a.shape == b.shape and rel_l2(a, b) < 1e-5
    x = torch.randn(1, 999, generator=g)            # off a bucket: padding the signal moves its frames
    assert all(rel_l2(a, b) == 0 for a, b in zip(cm(wav=x), m(x)))


class _Scaled(torch.nn.Module):
    def forward(self, wav):
        return torch.view_as_real(torch.stft(wav, 32, 8, window=torch.ones(32), return_complex=True) * 2)


def test_a_complex_reader_it_does_not_cover_is_refused_by_name(tmp_path):
    with pytest.raises(CaptureError, match=r"(?s)aten\.mul\.Tensor reads the complex result of torch\.stft.*abs"):
        graphmode.compile(_Scaled().eval(), example_inputs={"wav": torch.randn(2, 256)}, cache_dir=tmp_path)
