"""Value bounds on a request's inputs, checked before any plan (or eager fallback) runs.

Two sources: the model's index tables (graphmode/analysis/indices.py: token ids against the
vocabulary, token types against the type vocabulary, positions against the position table)
and the recipe's `inputs[].range`. Each input gets at most one check, the intersection of
both (and one per column whose values index a table of their own: a recommender's sparse
features `[batch, tables]`): one vectorised min/max pass over the tensor, and only when that fails a second pass to
find the first bad position. A dim that counts positions of a table (`seq` of a position
embedding) gets a limit, checked on the request's dims.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from graphmode.errors import ContractViolation
from graphmode.recipe.limits import INT_LIMITS

_TORCH_INT = {torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8"}


@dataclass(frozen=True)
class ValueCheck:
    """Every value of `input` must lie in [lo, hi]: the model's table range and/or the recipe's."""

    input: str
    lo: int
    hi: int
    model: tuple[int, int] | None       # what the model's tables take, and why
    model_why: str
    declared: tuple[int, int] | None    # the recipe's inputs[].range
    column: tuple[int, int] | None = None     # (axis, index): only the values of that column

    def violation(self, value: int, position: list[int]) -> ContractViolation:
        declared = self.declared is not None and not self.declared[0] <= value <= self.declared[1]
        lo, hi = self.declared if declared else self.model
        why = f"the recipe's inputs.{self.input}.range" if declared else f"the model's {self.model_why}"
        what = self.input if self.column is None else f"{self.input}[{_column_index(self.column)}]"
        return ContractViolation(
            f"input {self.input!r} holds {value} at position {position}, outside its valid range [{lo}, {hi}]"
            + ("" if self.column is None else f" for column {self.column[1]} of axis {self.column[0]}")
            + f": {why}", kind="input", where=f"inputs.{self.input}" + (".range" if declared else ""), value=value,
            fix=f"send {what} values in [{self.lo}, {self.hi}]")

    def values_of(self, t: torch.Tensor) -> torch.Tensor | None:
        """The part of `t` this check covers (None: a column `t` does not have)."""
        if self.column is None:
            return t
        axis, index = self.column
        return t.select(axis, index) if axis < t.dim() and index < t.shape[axis] else None


def _column_index(column: tuple[int, int]) -> str:
    axis, index = column
    return ", ".join([":"] * axis + [str(index)])


@dataclass(frozen=True)
class DimCheck:
    dim: str
    max: int
    why: str


def value_checks(recipe: Any, index: Any) -> list[ValueCheck]:
    """One check per input with a table range (IndexReport `index`) or a declared range."""
    out = []
    for spec in recipe.inputs:
        b = index.inputs.get(spec.name) if index is not None else None
        declared = tuple(spec.range) if getattr(spec, "range", None) is not None else None
        if b is None and declared is None:
            continue
        lo, hi = INT_LIMITS.get(spec.dtype, (None, None))
        if lo is None or spec.dtype == "bool":
            continue
        model = (b.lo, b.hi) if b is not None else None
        for r in (model, declared):
            if r is not None:
                lo, hi = max(lo, r[0]), min(hi, r[1])
        out.append(ValueCheck(spec.name, lo, hi, model, b.describe() if b is not None else "", declared))
    dtypes = {spec.name: spec.dtype for spec in recipe.inputs}
    for b in (index.columns.values() if index is not None else ()):
        lo, hi = INT_LIMITS.get(dtypes.get(b.name, "bool"), (None, None))
        if lo is not None and dtypes[b.name] != "bool":
            out.append(ValueCheck(b.name, max(lo, b.lo), min(hi, b.hi), (b.lo, b.hi), b.describe(), None, b.column))
    return out


def dim_checks(index: Any) -> list[DimCheck]:
    if index is None:
        return []
    return [DimCheck(d, lim.max, lim.describe()) for d, lim in index.dims.items()]


def bounds_doc(values: list[ValueCheck], dims: list[DimCheck]) -> dict[str, Any]:
    """The checks as JSON (an artifact's manifest): a rank's shard cannot derive them again, its
    embedding holds only part of the table (runtime/artifact.py)."""
    return {"values": [{"input": c.input, "lo": c.lo, "hi": c.hi, "model": list(c.model) if c.model else None,
                        "model_why": c.model_why, "declared": list(c.declared) if c.declared else None}
                       | ({"column": list(c.column)} if c.column else {}) for c in values],
            "dims": [{"dim": c.dim, "max": c.max, "why": c.why} for c in dims]}


def bounds_from_doc(doc: Mapping[str, Any]) -> tuple[list[ValueCheck], list[DimCheck]]:
    """`bounds_doc` read back (the manifest's schema has checked its fields)."""
    def pair(v: Any) -> tuple[int, int] | None:
        return (int(v[0]), int(v[1])) if v else None
    values = [ValueCheck(c["input"], int(c["lo"]), int(c["hi"]), pair(c["model"]), c["model_why"], pair(c["declared"]),
                         pair(c.get("column"))) for c in doc["values"]]
    return values, [DimCheck(c["dim"], int(c["max"]), c["why"]) for c in doc["dims"]]


def check_values(inputs: Mapping[str, torch.Tensor], checks: list[ValueCheck]) -> None:
    """Raise ContractViolation (input, first bad value, its position, the range) on the first
    input holding a value outside its check."""
    for c in checks:
        t = inputs.get(c.input)
        if t is None or t.numel() == 0 or t.dtype not in _TORCH_INT or (v := c.values_of(t)) is None:
            continue
        dlo, dhi = INT_LIMITS[_TORCH_INT[t.dtype]]
        lo, hi = max(c.lo, dlo), min(c.hi, dhi)
        pos = None
        if lo > hi:                                          # no value of this dtype is admissible
            pos = [0] * v.dim()
        else:
            mn, mx = torch.aminmax(v)
            if int(mn) < lo or int(mx) > hi:
                pos = ((v < lo) | (v > hi)).nonzero()[0].tolist()
        if pos is not None:
            value = int(v[tuple(pos)])
            if c.column is not None:                          # the position in the whole input
                pos.insert(c.column[0], c.column[1])
            raise c.violation(value, pos)


def draw_within(inputs: Mapping[str, torch.Tensor], checks: list[ValueCheck], seed: int = 0) -> dict[str, torch.Tensor]:
    """`inputs` with every checked input that holds a value outside its check redrawn uniformly
    inside it (sample inputs for `graphmode run` and `profile`: a generator that does not know
    the model's vocabulary must still produce a request the model takes)."""
    out = dict(inputs)
    g = torch.Generator().manual_seed(seed)
    for c in checks:
        t = out.get(c.input)
        if t is None or t.numel() == 0 or t.dtype not in _TORCH_INT:
            continue
        try:
            check_values({c.input: t}, [c])
        except ContractViolation:
            hi = min(c.hi, c.lo + 2**31 - 1)
            part = c.values_of(t)
            drawn = torch.randint(c.lo, hi + 1, tuple(part.shape), generator=g, dtype=t.dtype)
            if c.column is None:
                out[c.input] = drawn
            else:
                out[c.input] = t = t.clone()
                c.values_of(t).copy_(drawn)
    return out


def check_dims(dims: Mapping[str, int], checks: list[DimCheck],
               admitted: Mapping[str, tuple[int, int]] | None = None) -> None:
    """`admitted`: the dims' ranges the recipe serves (without an eager fallback beyond them), so
    the fix names the tighter of the two limits."""
    for c in checks:
        v = dims.get(c.dim)
        if v is not None and v > c.max:
            lo, hi = (admitted or {}).get(c.dim, (1, c.max))
            fix = (f"send {c.dim} of at most {hi} (the recipe's range [{lo}, {hi}]; the model itself cannot take "
                   f"more than {c.max})" if hi < c.max else
                   f"send {c.dim} of at most {c.max}: the model itself cannot take more, in a plan or run eagerly "
                   "(PyTorch or ONNX Runtime)")
            raise ContractViolation(f"dim {c.dim!r} = {v} is past the model's {c.max} positions ({c.why})",
                                    where=f"dims.{c.dim}", value=v, fix=fix)
