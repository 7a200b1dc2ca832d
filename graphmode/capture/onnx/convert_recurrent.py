"""ONNX RNN, GRU and LSTM unrolled over a static sequence length into core ops.

Per direction: the input projection of every step in one matmul, then one step per time index,
h = f(x_t W^T + h R^T + Wb + Rb) for RNN (GRU and LSTM: their gates, `_gru_step`, `_lstm_step`),
in ONNX's order (reversed for the backward direction), the steps concatenated into Y and the last
one into Y_h (LSTM: the last cell state into Y_c). What this does not cover (clip, activations
with alpha/beta, LSTM's input_forget) is refused by name. sequence_lens: past its length a
sequence's state is kept and its output is 0; the backward direction starts at its last step.
"""
from __future__ import annotations

from graphmode.capture.onnx.convert_composite import _bind, _static
from graphmode.capture.onnx.convert_select import reversed_by_length
from graphmode.capture.onnx.importer import _Importer, _handles, _shape_attr, as_text

_ACTIVATIONS = ("Tanh", "Relu", "Sigmoid")


def _row(imp: _Importer, v: str, d: int, hint: str) -> str:
    """v[d] of a [num_directions, ...] value, the leading axis dropped."""
    t = imp.g.type_of(v)
    part = imp.emit("slice", [v], {"dim": 0, "start": d, "end": d + 1, "step": 1}, hint=hint)
    return imp.emit("reshape", [part], {"shape": _shape_attr(list(t.shape[1:]))}, hint=hint)


def _check_common(imp: _Importer, n, dirs: list, acts_per_dir: int, defaults: list[bytes]) -> list[str]:
    """The activations of every direction; refusals of what the unrolling does not cover."""
    op = n.op_type
    if imp.attr(n, "clip", None) is not None:
        raise imp.fail(f"{op} clip is not supported", fix="export without clip")
    if imp.attr(n, "activation_alpha", None) or imp.attr(n, "activation_beta", None):
        raise imp.fail(f"{op} activation_alpha / activation_beta are not supported")
    acts = [as_text(a) for a in imp.attr(n, "activations", defaults * len(dirs))]
    if len(acts) != acts_per_dir * len(dirs) or any(a not in _ACTIVATIONS for a in acts):
        raise imp.fail(f"{op} activations {acts}: {acts_per_dir} per direction, each of {', '.join(_ACTIVATIONS)}",
                       value=acts)
    return acts


def _act(imp: _Importer, name: str, v: str, hint: str) -> str:
    return imp.emit("tanh" if name == "Tanh" else "relu" if name == "Relu" else "sigmoid", [v], {}, hint=hint)


def _gate(imp: _Importer, v: str, k: int, hidden, hint: str) -> str:
    """Gate k of a [batch, gates * hidden] value."""
    return imp.emit("slice", [v], {"dim": 1, "start": k * hidden, "end": (k + 1) * hidden, "step": 1}, hint=hint)


def _unroll(imp: _Importer, n, gates: int, cell: dict) -> None:
    """The frame RNN, GRU and LSTM share: directions, layout, the input projection, one step per
    time index (`_<op>_step`: state = (h, c), c unused but by LSTM) and the outputs. `cell`: the
    op's activations and options."""
    h = next(o for o in n.output if o)
    direction = imp.attr_text(n, "direction", "forward")
    dirs = {"forward": [False], "reverse": [True], "bidirectional": [False, True]}.get(direction)
    if dirs is None:
        raise imp.fail(f"{n.op_type} direction={direction!r} is not forward, reverse or bidirectional",
                       value=direction)
    layout = int(imp.attr(n, "layout", 0))
    x = imp.operand(n.input[0])
    if layout:
        x = imp.emit("permute", [x], {"perm": [1, 0, 2]}, hint=f"{h}_x")
    xt = imp.g.type_of(x)
    seq = _static(imp, xt.shape[0], f"{n.op_type} sequence length")
    batch = xt.shape[1]
    lens = _lengths(imp, n, seq, h)
    w, r = imp.operand(n.input[1]), imp.operand(n.input[2])
    hidden = imp.g.type_of(r).shape[2]
    bias = imp.operand(n.input[3]) if imp.opt_in(n, 3) else None
    init = []
    for i in (5, 6):
        v = imp.operand(n.input[i]) if imp.opt_in(n, i) else None
        if v is not None and layout:
            v = imp.emit("permute", [v], {"perm": [1, 0, 2]}, hint=f"{h}_init")
        init.append(v)
    zero = imp.emit("full", [], {"shape": _shape_attr([batch, hidden]), "value": 0.0, "dtype": xt.dtype},
                    hint=f"{h}_zero")
    step_shape = _shape_attr([1, batch, hidden])
    ys, lasts, cells = [], [], []
    for d, backward in enumerate(dirs):
        wd = imp.emit("permute", [_row(imp, w, d, h)], {"perm": [1, 0]}, hint=h)
        rd = imp.emit("permute", [_row(imp, r, d, h)], {"perm": [1, 0]}, hint=h)
        # with lengths, the backward direction reads each sequence from its own last step: reversed
        # by length, run forward with the steps past its length masked, and its outputs reversed back
        flip = backward and lens is not None
        xd = reversed_by_length(imp, x, lens, 0, 1, f"{h}_rx") if flip else x
        proj = imp.emit("matmul", [xd, wd], {}, hint=f"{h}_xw")
        rb = None
        if bias is not None:
            b = _row(imp, bias, d, h)
            wb = imp.emit("slice", [b], {"dim": 0, "start": 0, "end": gates * hidden, "step": 1}, hint=h)
            rb = imp.emit("slice", [b], {"dim": 0, "start": gates * hidden, "end": 2 * gates * hidden, "step": 1},
                          hint=h)
            proj = imp.emit("add", [proj, wb], {}, hint=f"{h}_xw")
        state = tuple(_row(imp, v, d, h) if v is not None else zero for v in init)
        steps = []
        for t in (reversed(range(seq)) if backward and not flip else range(seq)):
            pre = imp.emit("slice", [proj], {"dim": 0, "start": t, "end": t + 1, "step": 1}, hint=h)
            pre = imp.emit("reshape", [pre], {"shape": _shape_attr([batch, gates * hidden])}, hint=h)
            rec = imp.emit("matmul", [state[0], rd], {}, hint=h)
            if n.op_type == "GRU":
                new = _gru_step(imp, cell, d, pre, rec, state, rd, rb, hidden, h)
            elif n.op_type == "LSTM":
                new = _lstm_step(imp, cell, d, pre, rec, state, rb, hidden, h)
            else:
                new = _rnn_step(imp, cell, d, pre, rec, state, rb, h)
            out = new[0]
            if lens is not None:           # past a sequence's length: its state stays, its output is 0
                live = imp.emit("reshape", [imp.emit("lt", [imp.scalar(t, "i64", f"{h}_t"), lens], {}, hint=h)],
                                {"shape": _shape_attr([batch, 1])}, hint=f"{h}_live")
                new = tuple(imp.emit("where", [live, v, old], {}, hint=h) for v, old in zip(new, state))
                out = imp.emit("where", [live, new[0], zero], {}, hint=h)
            state = new
            steps.append((t, imp.emit("reshape", [out], {"shape": step_shape}, hint=h)))
        steps.sort()
        y = imp.emit("concat", [s for _, s in steps], {"dim": 0}, hint=h) if seq > 1 else steps[0][1]
        if flip:
            y = reversed_by_length(imp, y, lens, 0, 1, f"{h}_ry")
        ys.append(imp.emit("reshape", [y], {"shape": _shape_attr([seq, 1, batch, hidden])}, hint=h))
        lasts.append(imp.emit("reshape", [state[0]], {"shape": step_shape}, hint=h))
        cells.append(imp.emit("reshape", [state[1]], {"shape": step_shape}, hint=h))
    outs = [ys[0] if len(ys) == 1 else imp.emit("concat", ys, {"dim": 1}, hint=h)]
    outs += [v[0] if len(v) == 1 else imp.emit("concat", v, {"dim": 0}, hint=h) for v in (lasts, cells)]
    if layout:
        outs = [imp.emit("permute", [outs[0]], {"perm": [2, 0, 1, 3]}, hint=h)] + \
               [imp.emit("permute", [v], {"perm": [1, 0, 2]}, hint=h) for v in outs[1:]]
    for name, v in zip(n.output, outs):
        if name:
            _bind(imp, name, v)


def _lengths(imp: _Importer, n, seq: int, h: str) -> str | None:
    """sequence_lens as i64 [batch], or None where it is absent or every entry is the full length."""
    if not imp.opt_in(n, 4):
        return None
    k = imp.kn(n.input[4])
    if k is not None and k.concrete and all(int(v) == seq for v in k.tensor().reshape(-1).tolist()):
        return None
    lens = imp.operand(n.input[4])
    return lens if imp.g.type_of(lens).dtype == "i64" else imp.emit("cast", [lens], {"dtype": "i64"},
                                                                     hint=f"{h}_lens")


@_handles("GRU")
def _gru(imp: _Importer, n) -> None:
    """z = f(x Wz + h Rz + b), r = f(x Wr + h Rr + b), h~ = g(x Wh + (r h) Rh + b) (with
    linear_before_reset: g(x Wh + r (h Rh + Rbh) + Wbh)), h' = (1 - z) h~ + z h."""
    dirs = [0, 1] if imp.attr_text(n, "direction", "forward") == "bidirectional" else [0]
    cell = {"acts": _check_common(imp, n, dirs, 2, [b"Sigmoid", b"Tanh"]),
            "before_reset": bool(imp.attr(n, "linear_before_reset", 0))}
    _unroll(imp, n, 3, cell)


@_handles("LSTM")
def _lstm(imp: _Importer, n) -> None:
    """i = f(x Wi + h Ri + Pi c + b), f = f(x Wf + h Rf + Pf c + b), c~ = g(x Wc + h Rc + b),
    c' = f c + i c~, o = f(x Wo + h Ro + Po c' + b), h' = o h(c') (ONNX gate order i, o, f, c)."""
    dirs = [0, 1] if imp.attr_text(n, "direction", "forward") == "bidirectional" else [0]
    cell = {"acts": _check_common(imp, n, dirs, 3, [b"Sigmoid", b"Tanh", b"Tanh"]),
            "peep": imp.operand(n.input[7]) if imp.opt_in(n, 7) else None}
    if imp.attr(n, "input_forget", 0):
        raise imp.fail("LSTM input_forget is not supported", fix="export without coupled input and forget gates")
    _unroll(imp, n, 4, cell)


@_handles("RNN")
def _rnn(imp: _Importer, n) -> None:
    """h' = f(x W + h R + Wb + Rb)."""
    dirs = [0, 1] if imp.attr_text(n, "direction", "forward") == "bidirectional" else [0]
    _unroll(imp, n, 1, {"acts": _check_common(imp, n, dirs, 1, [b"Tanh"])})


def _rnn_step(imp: _Importer, cell: dict, d: int, pre: str, rec: str, state: tuple, rb, h: str) -> tuple:
    pre = imp.emit("add", [pre, rec], {}, hint=h)
    if rb is not None:
        pre = imp.emit("add", [pre, rb], {}, hint=h)
    return (_act(imp, cell["acts"][d], pre, f"{h}_h"), state[1])


def _gru_step(imp: _Importer, cell: dict, d: int, pre: str, rec: str, state: tuple, rd: str, rb, hid: int,
              h: str) -> tuple:
    f, g = cell["acts"][2 * d], cell["acts"][2 * d + 1]
    if rb is not None:
        rb_h = imp.emit("slice", [rb], {"dim": 0, "start": 2 * hid, "end": 3 * hid, "step": 1}, hint=h)
        rec = imp.emit("add", [rec, rb], {}, hint=h)        # gate h's bias is added below, not here
    z = _act(imp, f, imp.emit("add", [_gate(imp, pre, 0, hid, h), _gate(imp, rec, 0, hid, h)], {}, hint=h), h)
    r = _act(imp, f, imp.emit("add", [_gate(imp, pre, 1, hid, h), _gate(imp, rec, 1, hid, h)], {}, hint=h), h)
    if cell["before_reset"]:
        cand = imp.emit("mul", [r, _gate(imp, rec, 2, hid, h)], {}, hint=h)
    else:
        rdh = imp.emit("slice", [rd], {"dim": 1, "start": 2 * hid, "end": 3 * hid, "step": 1}, hint=h)
        cand = imp.emit("matmul", [imp.emit("mul", [r, state[0]], {}, hint=h), rdh], {}, hint=h)
        if rb is not None:
            cand = imp.emit("add", [cand, rb_h], {}, hint=h)
    hc = _act(imp, g, imp.emit("add", [_gate(imp, pre, 2, hid, h), cand], {}, hint=h), h)
    keep = imp.emit("mul", [z, state[0]], {}, hint=h)
    new = imp.emit("sub", [hc, imp.emit("mul", [z, hc], {}, hint=h)], {}, hint=h)
    return (imp.emit("add", [new, keep], {}, hint=f"{h}_h"), state[1])


def _peephole(imp: _Importer, cell: dict, d: int, k: int, c: str, pre: str, hid: int, h: str) -> str:
    if cell["peep"] is None:
        return pre
    p = imp.emit("slice", [_row(imp, cell["peep"], d, h)], {"dim": 0, "start": k * hid, "end": (k + 1) * hid,
                                                             "step": 1}, hint=h)
    return imp.emit("add", [pre, imp.emit("mul", [p, c], {}, hint=h)], {}, hint=h)


def _lstm_step(imp: _Importer, cell: dict, d: int, pre: str, rec: str, state: tuple, rb, hid: int,
               h: str) -> tuple:
    f, g, hh = cell["acts"][3 * d:3 * d + 3]
    gates = imp.emit("add", [pre, rec], {}, hint=h)
    if rb is not None:
        gates = imp.emit("add", [gates, rb], {}, hint=h)
    c = state[1]
    i = _act(imp, f, _peephole(imp, cell, d, 0, c, _gate(imp, gates, 0, hid, h), hid, h), h)
    fg = _act(imp, f, _peephole(imp, cell, d, 2, c, _gate(imp, gates, 2, hid, h), hid, h), h)
    cand = _act(imp, g, _gate(imp, gates, 3, hid, h), h)
    c = imp.emit("add", [imp.emit("mul", [fg, c], {}, hint=h), imp.emit("mul", [i, cand], {}, hint=h)], {},
                 hint=f"{h}_c")
    o = _act(imp, f, _peephole(imp, cell, d, 1, c, _gate(imp, gates, 1, hid, h), hid, h), h)
    return (imp.emit("mul", [o, _act(imp, hh, c, h)], {}, hint=f"{h}_h"), c)
