"""Recipe semantics of the dims and inputs: buckets, value ranges, constants, attention masks.

Part of layer 2 (semantics.py): each check adds its problems to a `Findings`.
"""
from __future__ import annotations

from typing import Any

from graphmode.errors import RecipeError
from graphmode.recipe.buckets import count_plans, dim_range, dim_synthesis
from graphmode.recipe.findings import Findings
from graphmode.recipe.limits import FLOAT_LIMITS, INT_LIMITS


def check_dims(f: Findings) -> None:
    """Each dim's buckets (explicit, or synthesised from min/max/step/padding) are well formed
    and the plans they make together stay under MAX_PLANS."""
    per_dim: dict[str, list[int]] = {}
    for name, d in f.r.dims.items():
        p = f"dims.{name}"
        if d.buckets:
            b = d.buckets
            if b != sorted(set(b)):
                shown = sorted(set(b)) if len(b) <= 32 else "sorted(set(...))"
                f.err(f"{p}.buckets", "buckets must be sorted ascending and unique", _brief(b),
                      fix=f"buckets: {shown}")
            lo, hi = dim_range(d)
            idx = range(len(b))
            f.err_first(f"{p}.buckets", [i for i in idx if b[i] < lo], b, f"bucket below min {lo}",
                        fix=f"buckets >= {lo}")
            if d.max is not None:
                f.err_first(f"{p}.buckets", [i for i in idx if b[i] > d.max], b, f"bucket above max {d.max}",
                            fix=f"buckets <= {d.max}")
            if d.step > 1:
                f.err_first(f"{p}.buckets", [i for i in idx if b[i] % d.step], b,
                            f"bucket not a multiple of step {d.step}")
            if d.max is not None and d.max > max(b):
                f.err(f"{p}.max", f"values {max(b) + 1}..{d.max} are above the largest bucket "
                                  f"{max(b)} and would have no bucket", d.max,
                      fix=f"add bucket {d.max} or set max: {max(b)}")
            if d.max_buckets is not None and len(set(b)) > d.max_buckets:
                f.err(f"{p}.max_buckets", f"{len(set(b))} explicit buckets exceed max_buckets",
                      d.max_buckets)
            if not _plans(f, per_dim, name, dim_synthesis(d).buckets):
                return
            continue
        if d.min is None or d.max is None:
            missing = "min" if d.min is None else "max"
            f.err(f"{p}.{missing}", "a range dim needs both min and max (or explicit buckets)",
                  fix=f"add `{missing}:` or `buckets: [...]`")
            continue
        if d.min > d.max:
            f.err(f"{p}.max", f"max is below min {d.min}", d.max, fix=f"set max >= {d.min}")
            continue
        if d.max % d.step:
            lo_, hi_ = (d.max // d.step) * d.step, -(-d.max // d.step) * d.step
            f.err(f"{p}.max", f"max is not a multiple of step {d.step} (buckets are step-aligned)",
                  d.max, fix=f"max: {hi_}" + (f" or {lo_}" if lo_ >= d.min else ""))
            continue
        try:
            s = dim_synthesis(d)
        except RecipeError as e:
            f.err(p, e.message, fix=e.fix)
            continue
        if not s.feasible:
            fixes = []
            if s.min_buckets_for_padding is not None:
                fixes.append(f"max_buckets: {s.min_buckets_for_padding}")
            if s.min_padding_for_buckets is not None:
                fixes.append(f"max_padding: {s.min_padding_for_buckets}")
            f.err(f"{p}.max_padding", s.explain(), d.max_padding,
                  fix=" or ".join(fixes) or "relax max_padding or use a smaller step")
        elif not _plans(f, per_dim, name, s.buckets):
            return


def _plans(f: Findings, per_dim: dict[str, list[int]], name: str, buckets: list[int]) -> bool:
    """Add a dim's buckets to the plan count; False (and an error) once it passes MAX_PLANS,
    so the remaining dims are not synthesised for nothing."""
    per_dim[name] = buckets
    try:
        count_plans(per_dim)
    except RecipeError as e:
        f.err(e.where or "dims", e.message, e.value, fix=e.fix)
        return False
    return True


def check_inputs(f: Findings) -> None:
    """Inputs and outputs name declared dims, every dim is used, and each input's pad value,
    range, constant value and mask fit its dtype and shape."""
    used: set[str] = set()
    for i, inp in enumerate(f.r.inputs):
        for j, e in enumerate(inp.shape):
            if isinstance(e, str):
                used.add(e)
                if e not in f.r.dims:
                    f.err(f"inputs[{i}].shape[{j}]", f"dim {e!r} is not declared under dims", e,
                          fix=f"declare dims.{e} or use one of: {', '.join(f.r.dims)}")
        bad = _pad_problem(inp.dtype, inp.pad_value)
        if bad is not None:
            f.err(f"inputs[{i}].pad_value", f"pad value does not fit dtype {inp.dtype}: {bad[0]}",
                  inp.pad_value, fix=bad[1])
        _value_range(f, i, inp)
        _mask(f, i, inp)
        if inp.value is not None:
            _constant(f, i, inp)
    for name in f.r.dims:
        if name not in used:
            f.err(f"dims.{name}", f"dim {name!r} is declared but no input uses it", name,
                  fix="remove it or use it in an input shape")
    for name, axes in f.r.outputs.items():
        for j, a in enumerate(axes):
            if isinstance(a, str) and a != "*" and a not in f.r.dims:
                f.err(f"outputs.{name}[{j}]", f"dim {a!r} is not declared under dims", a,
                      fix=f"one of: {', '.join(f.r.dims)}, an int, or '*'")


def _value_range(f: Findings, i: int, inp: Any) -> None:
    """`range: [lo, hi]` is for integer inputs, inside the dtype, and holds the pad value."""
    if inp.range is None:
        return
    p = f"inputs[{i}].range"
    lo, hi = inp.range
    if inp.dtype not in INT_LIMITS or inp.dtype == "bool":
        f.err(p, f"a value range is for integer inputs, this input is {inp.dtype}", inp.range,
              fix="remove range (float and bool inputs are not checked against one)")
        return
    dlo, dhi = INT_LIMITS[inp.dtype]
    if lo < dlo or hi > dhi:
        f.err(p, f"[{lo}, {hi}] is not inside {inp.dtype}'s [{dlo}, {dhi}]", inp.range,
              fix=f"bounds within [{dlo}, {dhi}]")
    elif not lo <= inp.pad_value <= hi:
        f.err(f"inputs[{i}].pad_value", f"pad value {inp.pad_value} is outside the input's range "
                                        f"[{lo}, {hi}]: padded positions would hold a value the "
                                        "contract excludes", inp.pad_value,
              fix=f"a pad_value in [{lo}, {hi}]")


def _constant(f: Findings, i: int, inp: Any) -> None:
    """A constant input has a fixed shape, its value has that shape and fits the dtype."""
    import numpy as np
    p = f"inputs[{i}]"
    if any(isinstance(e, str) for e in inp.shape):
        f.err(f"{p}.value", "an input with a constant value needs a fixed shape (ints only)", inp.shape,
              fix="write the shape as ints, or remove value")
        return
    arr = np.array(inp.value)
    if list(arr.shape) != list(inp.shape):
        f.err(f"{p}.value", f"the value has shape {list(arr.shape)}, the input's shape is {inp.shape}",
              fix=f"give a value of shape {inp.shape}")
        return
    flat = arr.reshape(-1).tolist()
    for k, v in enumerate(flat):
        bad = _pad_problem(inp.dtype, v)
        if bad is not None:
            f.err(f"{p}.value", f"element {k} ({v}) does not fit dtype {inp.dtype}: {bad[0]}", fix=bad[1])
            return


def _mask(f: Findings, i: int, inp: Any) -> None:
    """An attention mask names the padded dims it covers, and pads with 0 (masked out)."""
    p = f"inputs[{i}]"
    if inp.mask_for and inp.role != "attention_mask":
        f.err(f"{p}.mask_for", f"mask_for is only meaningful on an attention_mask input (role is "
                               f"{inp.role!r})", inp.mask_for,
              fix="set `role: attention_mask` or remove mask_for")
        return
    if inp.role != "attention_mask":
        return
    sym = [e for e in inp.shape if isinstance(e, str)]
    for j, d in enumerate(inp.mask_for):
        if d not in sym:
            f.err(f"{p}.mask_for[{j}]", f"{d!r} is not a dim of input {inp.name!r} (shape {inp.shape})", d,
                  fix=f"one of: {', '.join(dict.fromkeys(sym)) or '(no symbolic dims)'}")
        elif d in inp.mask_for[:j]:
            f.err(f"{p}.mask_for[{j}]", f"{d!r} listed twice", d, fix="list each dim once")
    if inp.pad_value != 0:
        f.err(f"{p}.pad_value", "an attention_mask input must pad with 0 (False), so padded positions "
                                "are masked out", inp.pad_value, fix="pad_value: 0")
    if not inp.masked_dims():
        f.warn(f"{p}.role", f"attention_mask {inp.name!r} covers no symbolic dim (axis 0 is the batch): "
                            "padding never reaches it")


def _brief(values: list[Any], n: int = 32) -> Any:
    return values if len(values) <= n else f"[{', '.join(map(str, values[:n]))}, ...] ({len(values)} entries)"


def _pad_problem(dtype: str, v: int | float) -> tuple[str, str] | None:
    """(why, fix) when `v` is not exactly a value of `dtype`; None when it is."""
    if dtype in INT_LIMITS:
        lo, hi = INT_LIMITS[dtype]
        fix = "0 or 1 (false or true)" if dtype == "bool" else f"an integer in [{lo}, {hi}]"
        if isinstance(v, float) and not v.is_integer():
            return f"{dtype} holds integers only", fix
        if not lo <= v <= hi:
            return f"outside [{lo}, {hi}]", fix
        return None
    top, bits = FLOAT_LIMITS[dtype]
    if not abs(v) <= top:
        return f"outside its finite range +-{top:g}", f"a value within +-{top:g}"
    if isinstance(v, int) or v.is_integer():
        n = abs(int(v))
        if n and (n >> ((n & -n).bit_length() - 1)).bit_length() > bits:   # more significant bits than it keeps
            ulp = 1 << (n.bit_length() - bits)
            below, sign = n // ulp * ulp, -1 if v < 0 else 1
            return (f"{dtype} keeps {bits} significant bits, so it would be rounded",
                    f"an exactly representable value such as {sign * below} or {sign * (below + ulp)}")
    return None


def shape_errors(recipe: Any) -> list[RecipeError]:
    """The dims' and inputs' own problems (no target, no model): what capture checks first, as
    it exports the model with the dims' ranges (a min above max read as the model's fault)."""
    f = Findings(recipe, None)
    check_dims(f)
    check_inputs(f)
    return f.errors


__all__ = ["check_dims", "check_inputs", "shape_errors"]
