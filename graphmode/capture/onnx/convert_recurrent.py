"""ONNX RNN unrolled over a static sequence length into core ops.

Per direction: the input projection of every step in one matmul, then one step per time index,
h = f(x_t W^T + h R^T + Wb + Rb), in ONNX's order (reversed for the backward direction), the
steps concatenated into Y and the last one into Y_h. What this does not cover (clip, activations
with alpha/beta, sequence_lens shorter than the sequence) is refused by name.
"""
from __future__ import annotations

from graphmode.capture.onnx.convert_composite import _bind, _s, _static
from graphmode.capture.onnx.importer import _Importer, _handles, _shape_attr

_ACTIVATIONS = ("Tanh", "Relu", "Sigmoid")


def _row(imp: _Importer, v: str, d: int, hint: str) -> str:
    """v[d] of a [num_directions, ...] value, the leading axis dropped."""
    t = imp.g.type_of(v)
    part = imp.emit("slice", [v], {"dim": 0, "start": d, "end": d + 1, "step": 1}, hint=hint)
    return imp.emit("reshape", [part], {"shape": _shape_attr(list(t.shape[1:]))}, hint=hint)


@_handles("RNN")
def _rnn(imp: _Importer, n) -> None:
    h = n.output[0] or n.output[1]
    direction = _s(imp.attr(n, "direction", b"forward"))
    dirs = {"forward": [False], "reverse": [True], "bidirectional": [False, True]}.get(direction)
    if dirs is None:
        raise imp.fail(f"RNN direction={direction!r} is not forward, reverse or bidirectional", value=direction)
    if imp.attr(n, "clip", None) is not None:
        raise imp.fail("RNN clip is not supported", fix="export without clip")
    if imp.attr(n, "activation_alpha", None) or imp.attr(n, "activation_beta", None):
        raise imp.fail("RNN activation_alpha / activation_beta are not supported")
    acts = [_s(a) for a in imp.attr(n, "activations", [b"Tanh"] * len(dirs))]
    if len(acts) != len(dirs) or any(a not in _ACTIVATIONS for a in acts):
        raise imp.fail(f"RNN activations {acts}: one per direction, each of {', '.join(_ACTIVATIONS)}", value=acts)
    layout = int(imp.attr(n, "layout", 0))
    x = imp.operand(n.input[0])
    if layout:
        x = imp.emit("permute", [x], {"perm": [1, 0, 2]}, hint=f"{h}_x")
    xt = imp.g.type_of(x)
    seq = _static(imp, xt.shape[0], "RNN sequence length")
    batch = xt.shape[1]
    lens = imp.opt_in(n, 4)
    if lens:
        k = imp.kn(lens)
        if k is None or not k.concrete or any(int(v) != seq for v in k.tensor().reshape(-1).tolist()):
            raise imp.fail("RNN sequence_lens shorter than the sequence (or known only at run time) is not supported",
                           fix="pad every sequence to the full length, or drop sequence_lens")
    w, r = imp.operand(n.input[1]), imp.operand(n.input[2])
    hidden = imp.g.type_of(r).shape[2]
    bias = imp.operand(n.input[3]) if imp.opt_in(n, 3) else None
    h0 = imp.operand(n.input[5]) if imp.opt_in(n, 5) else None
    if h0 is not None and layout:
        h0 = imp.emit("permute", [h0], {"perm": [1, 0, 2]}, hint=f"{h}_h0")
    step_shape = _shape_attr([1, batch, hidden])
    ys, lasts = [], []
    for d, backward in enumerate(dirs):
        wd = imp.emit("permute", [_row(imp, w, d, h)], {"perm": [1, 0]}, hint=h)
        rd = imp.emit("permute", [_row(imp, r, d, h)], {"perm": [1, 0]}, hint=h)
        proj = imp.emit("matmul", [x, wd], {}, hint=f"{h}_xw")
        if bias is not None:
            b = _row(imp, bias, d, h)
            wb = imp.emit("slice", [b], {"dim": 0, "start": 0, "end": hidden, "step": 1}, hint=h)
            rb = imp.emit("slice", [b], {"dim": 0, "start": hidden, "end": 2 * hidden, "step": 1}, hint=h)
            proj = imp.emit("add", [proj, imp.emit("add", [wb, rb], {}, hint=h)], {}, hint=f"{h}_xw")
        state = _row(imp, h0, d, h) if h0 is not None else None
        steps = []
        for t in (reversed(range(seq)) if backward else range(seq)):
            pre = imp.emit("slice", [proj], {"dim": 0, "start": t, "end": t + 1, "step": 1}, hint=h)
            pre = imp.emit("reshape", [pre], {"shape": _shape_attr([batch, hidden])}, hint=h)
            if state is not None:
                pre = imp.emit("add", [pre, imp.emit("matmul", [state, rd], {}, hint=h)], {}, hint=h)
            act = acts[d]
            state = imp.emit("tanh" if act == "Tanh" else "relu" if act == "Relu" else "sigmoid", [pre], {},
                             hint=f"{h}_h")
            steps.append((t, imp.emit("reshape", [state], {"shape": step_shape}, hint=h)))
        steps.sort()
        y = imp.emit("concat", [s for _, s in steps], {"dim": 0}, hint=h) if seq > 1 else steps[0][1]
        ys.append(imp.emit("reshape", [y], {"shape": _shape_attr([seq, 1, batch, hidden])}, hint=h))
        lasts.append(imp.emit("reshape", [state], {"shape": step_shape}, hint=h))
    y = ys[0] if len(ys) == 1 else imp.emit("concat", ys, {"dim": 1}, hint=h)
    y_h = lasts[0] if len(lasts) == 1 else imp.emit("concat", lasts, {"dim": 0}, hint=h)
    if layout:
        y = imp.emit("permute", [y], {"perm": [2, 0, 1, 3]}, hint=h)
        y_h = imp.emit("permute", [y_h], {"perm": [1, 0, 2]}, hint=h)
    if n.output[0]:
        _bind(imp, n.output[0], y)
    if len(n.output) > 1 and n.output[1]:
        _bind(imp, n.output[1], y_h)
