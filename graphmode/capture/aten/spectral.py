"""torch.stft as real math: its complex result held as two real values, for the ops that read it.

graphmode has no complex dtype, so a spectrogram computed inside the model (`torch.stft(...)
.abs() ** 2`, a mel front end, Whisper's log-mel) was refused whole. The short-time transform is
frames of the signal times the window times a DFT matrix: the frames are an `index` of the
signal by `arange(frames) * hop + arange(n_fft)`, the transform two GEMMs with the cosine and
minus-sine matrices (computed in float64), so its real and imaginary parts are ordinary f32
values (within 1e-6 of torch's FFT, relative L2). The complex value is never materialised: the
ops that read it are taken on the pair (`abs`, `view_as_real`, `real`, `imag`, `slice`,
`select` on a frequency or frame axis); any other reader is refused, naming it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from graphmode.errors import CaptureError
from graphmode.ir.ops import OPS
from graphmode.ir.types import dim_str, normalize_dim

READERS = ("aten.abs.default", "aten.view_as_real.default", "aten.real.default", "aten.imag.default",
           "aten.slice.Tensor", "aten.select.int")


@dataclass(frozen=True)
class Complex:
    """A complex tensor as the IR values of its real and imaginary parts (same shape)."""

    re: str
    im: str


def takes_complex(imp: Any, node: torch.fx.Node, tname: str) -> bool:
    """Whether `node` is an stft or reads a Complex: spectral() converts it (or refuses)."""
    return tname == "aten.stft.default" or any(isinstance(imp.env.get(a), Complex) for a in node.all_input_nodes)


def spectral(imp: Any, node: torch.fx.Node, tname: str) -> None:
    if tname == "aten.stft.default":
        imp.env[node] = _stft(imp, node)
        return
    src = node.args[0]
    z = imp.env.get(src) if isinstance(src, torch.fx.Node) else None
    if not isinstance(z, Complex) or tname not in READERS or any(
            isinstance(imp.env.get(a), Complex) for a in node.all_input_nodes if a is not src):
        raise CaptureError(f"op {tname} reads the complex result of torch.stft, and graphmode holds it as its real "
                           f"and imaginary parts, which {', '.join(r.split('.')[1] for r in READERS)} read",
                           where=f"node {node.name}",
                           fix="take what the model needs from the spectrum with those (a power spectrum as "
                               "stft(...).abs() ** 2, or view_as_real), or run the model with exe_mode: eager")
    if tname == "aten.abs.default":
        power = _op(imp, "add", [_op(imp, "mul", [z.re, z.re]), _op(imp, "mul", [z.im, z.im])])
        imp.env[node] = _op(imp, "sqrt", [power], name=node.name)
    elif tname in ("aten.real.default", "aten.imag.default"):
        imp.env[node] = z.re if tname == "aten.real.default" else z.im
    elif tname == "aten.view_as_real.default":
        rank = imp.g.type_of(z.re).rank
        parts = [_op(imp, "reshape", [p], {"shape": [_size(d) for d in imp.g.type_of(p).shape] + [1]})
                 for p in (z.re, z.im)]
        imp.env[node] = _op(imp, "concat", parts, {"dim": rank}, name=node.name)
    else:                             # slice / select of the complex tensor: the same of each part
        rank = imp.g.type_of(z.re).rank
        dim = int(node.args[1]) % rank
        if tname == "aten.select.int":
            index = int(node.args[2])
            n = imp.g.type_of(z.re).shape[dim]
            if not isinstance(n, int):
                raise CaptureError(f"select of the stft's complex result along a dynamic axis ({dim_str(n)})",
                                   where=f"node {node.name}", fix="select after view_as_real, or on a fixed axis")
            index %= n
            attrs = {"dim": dim, "start": index, "end": index + 1, "step": 1}
            shape = [_size(d) for i, d in enumerate(imp.g.type_of(z.re).shape) if i != dim]
            re, im = (_op(imp, "reshape", [_op(imp, "slice", [p], attrs)], {"shape": shape}) for p in (z.re, z.im))
        else:
            args = list(node.args) + [None] * (5 - len(node.args))
            start, end, step = args[2] if args[2] is not None else 0, args[3], args[4] if args[4] is not None else 1
            n = imp.g.type_of(z.re).shape[dim]
            end = n if end is None or (isinstance(end, int) and end >= 2 ** 62) else end
            attrs = {"dim": dim, "start": imp.attr_dim(start), "end": imp.attr_dim(end), "step": int(step)}
            re, im = (_op(imp, "slice", [p], attrs) for p in (z.re, z.im))
        imp.env[node] = Complex(re, im)


def _stft(imp: Any, node: torch.fx.Node) -> Complex:
    """aten.stft(input, n_fft, hop_length, win_length, window, normalized, onesided, return_complex)
    (center's padding is outside it, in the exported program)."""
    args = list(node.args) + [None] * (8 - len(node.args))
    x_arg, n_fft, hop, win_length, window, normalized, onesided, _ = args[:8]
    hop = int(hop) if hop is not None else int(n_fft) // 4
    n_fft = int(n_fft)
    win_length = int(win_length) if win_length is not None else n_fft
    x = imp.operand(x_arg)
    xt = imp.g.type_of(x)
    if xt.dtype != "f32" or node.kwargs.get("align_to_window") or len(node.args) > 8:
        raise CaptureError(f"torch.stft of a {xt.dtype} signal, or with align_to_window", where=f"node {node.name}",
                           fix="compute stft of an f32 signal with the default framing, or run with exe_mode: eager")
    out = node.meta["val"]
    frames = imp.dim(out.shape[-1])
    bins = n_fft // 2 + 1 if onesided is None or onesided else n_fft
    # frame f, sample n: signal[f * hop + n]
    steps = _op(imp, "arange", [], {"start": 0, "end": _size(frames), "step": 1, "dtype": "i64"})
    starts = _op(imp, "mul", [_op(imp, "reshape", [steps], {"shape": [_size(frames), 1]}), _int(imp, hop)])
    offsets = imp.g.add_constant(imp.g.fresh_name(f"{node.name}_offsets"), torch.arange(n_fft).reshape(1, n_fft),
                                 role="const")
    index = _op(imp, "add", [starts, offsets])
    picked = _op(imp, "index", [x, index], {"dims": [xt.rank - 1]})          # [..., frames, n_fft]
    cos, sin = _dft(n_fft, bins, _window(imp, window, n_fft, win_length), bool(normalized))
    parts = []
    for name, matrix in (("re", cos), ("im", sin)):
        w = imp.g.add_constant(imp.g.fresh_name(f"{node.name}_{name}"), matrix, role="const")
        y = _op(imp, "matmul", [picked, w])                                      # [..., frames, bins]
        rank = imp.g.type_of(y).rank
        perm = list(range(rank - 2)) + [rank - 1, rank - 2]
        parts.append(_op(imp, "permute", [y], {"perm": perm}, name=f"{node.name}_{name}"))
    return Complex(*parts)


def _window(imp: Any, window: Any, n_fft: int, win_length: int) -> torch.Tensor:
    """The window as a float64 tensor of n_fft (a shorter one centred, as torch pads it)."""
    if window is None:
        w = torch.ones(win_length, dtype=torch.float64)
    else:
        name = imp.operand(window)
        made = imp.g.producers().get(name)
        if name in imp.g.constants:
            w = imp.g.constants[name].double().reshape(-1)
        elif made is not None and made.op == "full" and all(isinstance(d, int) for d in made.attr("shape", [None])):
            w = torch.full(tuple(made.attr("shape")), float(made.attr("value")), dtype=torch.float64).reshape(-1)
        else:
            raise CaptureError("torch.stft with a window computed in forward", where=f"value {name}",
                               fix="make the window a buffer (self.register_buffer('window', torch.hann_window(n)) "
                                   "in __init__)")
    if w.numel() < n_fft:
        left = (n_fft - w.numel()) // 2
        w = torch.nn.functional.pad(w, (left, n_fft - w.numel() - left))
    return w


def _dft(n_fft: int, bins: int, window: torch.Tensor, normalized: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[n_fft, bins] matrices taking windowed frames to the real and imaginary parts of their DFT."""
    n = torch.arange(n_fft, dtype=torch.float64)[:, None]
    k = torch.arange(bins, dtype=torch.float64)[None, :]
    angle = 2 * math.pi * ((n * k) % n_fft) / n_fft          # reduced first: exact angles for large n * k
    scale = window[:, None] * (n_fft ** -0.5 if normalized else 1.0)
    return (torch.cos(angle) * scale).float(), (-torch.sin(angle) * scale).float()


def _size(d: Any) -> Any:
    d = normalize_dim(d)
    return d if isinstance(d, int) else dim_str(d)


def _int(imp: Any, v: int) -> str:
    return imp.g.add_constant(imp.g.fresh_name("c_hop"), torch.tensor(v, dtype=torch.int64), role="const")


def _op(imp: Any, op: str, ins: list[str], attrs: dict | None = None, name: str | None = None) -> str:
    attrs = attrs or {}
    types = OPS[op].infer([imp.g.type_of(i) for i in ins], attrs)
    out, = imp.g.add_node(op, ins, types, attrs, names=[name] if name else None)
    return out
