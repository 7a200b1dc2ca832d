"""The one decision every entry point reaches about a captured model under a recipe.

`compile`, `verify`, `run`, `serve`, `recipe validate --model` and the Python API all call
`decide()` on the captured graph, so they refuse (or accept) the same models for the same
reasons: recipe/model mismatches, ops that cannot run in the requested exe_mode, index
tables the recipe's values or dims cannot stay inside (analysis/indices.py), and padding
that could change a real output. A refusal names the field or op, the value, the model
source line and the fix.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Sequence

from graphmode.analysis.indices import IndexReport, analyze_indices
from graphmode.analysis.padding import PaddingReport, analyze_padding
from graphmode.errors import GraphmodeError
from graphmode.ir.graph import Graph
from graphmode.ir.types import dim_str


@dataclass(frozen=True)
class Issue:
    """One reason to refuse (or restrict) a compilation."""

    kind: str          # mismatch | model | fallback | index | padding
    message: str
    where: str
    value: Any = None
    fix: str = ""
    loc: str | None = None

    def render(self) -> str:
        head = f"{self.where}: {self.message}"
        if self.value is not None:
            head += f" (got {self.value!r})"
        if self.loc:
            head += f"\n  at {self.loc}"
        return head + (f"\n  fix: {self.fix}" if self.fix else "")


class ContractRefused(GraphmodeError):
    """The recipe and the captured model together cannot keep the contract."""

    def __init__(self, issues: Sequence[Issue]):
        self.issues = list(issues)
        # a recipe that does not describe the model is malformed input (2); an unsafe model is refused (1)
        self.exit_code = 2 if any(i.kind in ("mismatch", "model") for i in self.issues) else 1
        first = self.issues[0]
        super().__init__(f"{len(self.issues)} reason(s) to refuse this recipe for this model",
                         where=first.where, fix=first.fix or None)

    def render(self) -> str:
        return "\n".join(i.render() for i in getattr(self, "issues", [])) or self.message

    def to_dict(self) -> dict[str, Any]:
        """Every error's fields (the first reason's, as the summary), and each reason in `issues`."""
        first = self.issues[0]
        return {**super().to_dict(), "message": f"{self.message}; first: {first.message}",
                "issues": [i.__dict__ for i in self.issues]}


@dataclass
class Verdict:
    mode: str
    refusals: list[Issue] = field(default_factory=list)
    restrictions: list[Issue] = field(default_factory=list)   # accepted, with requests steered to eager
    padding: PaddingReport | None = None
    exact_dims: list[str] = field(default_factory=list)       # never padded: off-bucket values run eagerly
    masked_dims: list[str] = field(default_factory=list)      # padded unless a request masks a row whole
    query_key_dims: list[str] = field(default_factory=list)   # ... or, along these, holds its pad value at all
    mask_sources: list[str] = field(default_factory=list)     # the inputs a request's mask is read from
    index: IndexReport | None = None                          # index inputs and position dims (runtime checks)

    @property
    def ok(self) -> bool:
        return not self.refusals

    def raise_for_refusal(self) -> None:
        if self.refusals:
            raise ContractRefused(self.refusals)

    def lines(self) -> list[str]:
        out = []
        if self.padding is not None:
            for d, v in self.padding.dims.items():
                note = (" (requests off a bucket value run eagerly)" if d in self.exact_dims else
                        " (the model masks the padded positions itself, e.g. a causal mask: later positions, "
                        "where padding goes, do not reach earlier ones)"
                        if d in self.masked_dims and not self.mask_sources else
                        f" (the mask hides padded positions, but the model builds a query x key mask: a request whose "
                        f"mask hides any position and whose {d} is off a bucket value is not padded)"
                        if d in self.masked_dims and d in self.query_key_dims else
                        " (the mask hides padded positions; a request whose mask hides a whole row is not padded: "
                        "off a bucket value it runs eagerly under on_violation: eager, and is refused under error)"
                        if d in self.masked_dims else "")
                out.append(f"padding {d}: {v.status}{note}")
        out += [f"refused: {i.render()}" for i in self.refusals]
        out += [f"restricted: {i.render()}" for i in self.restrictions]
        return out

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "mode": self.mode, "refusals": [i.__dict__ for i in self.refusals],
                "restrictions": [i.__dict__ for i in self.restrictions], "exact_dims": self.exact_dims,
                "masked_dims": self.masked_dims,
                "padding": self.padding.to_json() if self.padding else None,
                "index": self.index.to_json() if self.index else None}


def mask_inputs(recipe: Any) -> list[str]:
    """The inputs that mask (role attention_mask, or named like a mask): runtime/shaping.py checks them."""
    return [i.name for i in recipe.inputs if i.role == "attention_mask" or "mask" in i.name.lower()]


def _mask_sources(recipe: Any, graph: Graph, pads: list[str], capture_report: Any, masked: list[str]) -> list[str]:
    """The inputs whose pad value the masked verdict rests on: the declared masks, and any integer
    or bool input the model builds its mask from itself (`ids == 0`, as XLM-style models do),
    found by analysing again with that input's padding unknown: a dim no longer masked-safe then
    is one its mask comes from. runtime/shaping.py checks a request's rows in each of them."""
    named = mask_inputs(recipe)
    out = list(named)
    locs = getattr(capture_report, "locs", {}) or {}
    pad_values = {j.name: j.pad_value for j in recipe.inputs}
    for i in recipe.inputs:
        dims = {d for d in i.shape if isinstance(d, str)}
        if i.name in named or i.name not in graph.inputs or i.dtype.startswith(("f", "bf")) or not dims & set(masked):
            continue
        alt = analyze_padding(graph, pad_values, pads, locs=locs, masks=named, unknown={i.name})
        if any(d not in alt.masked for d in masked if d in dims):
            out.append(i.name)
    return out


def padded_dims(recipe: Any) -> list[str]:
    """Dims along which some admissible request is padded up to a larger bucket."""
    out = []
    for d, vals in recipe.dim_buckets().items():
        lo, hi = recipe.dim_range(d)
        if len({v for v in vals if lo <= v <= hi}) < hi - lo + 1:
            out.append(d)
    return out


def decide(recipe: Any, graph: Graph | None, capture_report: Any, source: Any, mode: str) -> Verdict:
    """Check the captured `graph` against the recipe for running in `mode`."""
    v = Verdict(mode)
    if mode == "eager" or graph is None:
        return v
    v.refusals += _mismatches(recipe, graph, capture_report)
    v.refusals += _fallbacks(capture_report, mode)
    if v.refusals:      # a model the recipe does not describe is not analysed further
        return v
    v.index = analyze_indices(graph)
    v.refusals += _index_issues(recipe, v.index)
    v.refusals += _short_slices(recipe, graph, capture_report)
    v.refusals += _short_extents(recipe, graph, capture_report)
    if v.refusals or getattr(source, "masks_padding", False):
        return v        # a decode graph masks its own padding (the KV cache's lengths)
    pads = padded_dims(recipe)
    v.padding = analyze_padding(graph, {i.name: i.pad_value for i in recipe.inputs}, pads,
                                locs=getattr(capture_report, "locs", {}) or {}, masks=mask_inputs(recipe))
    v.masked_dims = list(v.padding.masked)
    v.query_key_dims = list(v.padding.query_key)
    v.mask_sources = _mask_sources(recipe, graph, pads, capture_report, v.masked_dims)
    engine = "ONNX Runtime" if _is_onnx(source) else "eager PyTorch"     # what runs a request the plans do not take
    for d in v.padding.unsafe_dims:
        findings = v.padding.dims[d].findings
        first = findings[0]
        lo, hi = recipe.dim_range(d)
        where = f"dims.{d}"
        msg = (f"padding {d} up to its bucket can change the outputs: {first.op} -> %{first.value}: {first.reason}"
               + (f" (and {len(findings) - 1} more place(s))" if len(findings) > 1 else ""))
        if recipe.on_violation == "eager":
            v.exact_dims.append(d)
            v.restrictions.append(Issue("padding", msg, where, loc=first.loc,
                                        fix=f"requests whose {d} is not a bucket value run eagerly (on_violation: "
                                            f"eager: {engine}); "
                                            "declare a mask or exact buckets to avoid it"))
            continue
        masks = [i.name for i in recipe.inputs if getattr(i, "role", "data") == "attention_mask"]
        fixes = [f"give dims.{d} exact buckets (every admissible value a bucket: {hi - lo + 1} plan(s) for "
                 f"[{lo}, {hi}]) so {d} is never padded"]
        if not masks:
            fixes.append(f"if the model takes a mask over {d}, declare it (inputs[].role: attention_mask, "
                         "pad_value: 0) and make sure the model uses it where it reduces over the padding")
        fixes.append(f"set on_violation: eager so requests that would need padding on {d} run in {engine}")
        v.refusals.append(Issue("padding", msg, where, loc=first.loc, fix="; or ".join(fixes)))
    return v


def _is_onnx(source: Any) -> bool:
    return getattr(source, "module", None) is None and getattr(source, "onnx_path", None) is not None


# ---------------------------------------------------------------------------------- checks


def _mismatches(recipe: Any, graph: Graph, cap: Any) -> list[Issue]:
    issues: list[Issue] = []
    declared = [i.name for i in recipe.inputs]
    model_inputs = list(graph.inputs)
    for i, spec in enumerate(recipe.inputs):
        where = f"inputs[{i}]"
        if spec.name not in graph.values or spec.name not in model_inputs:
            issues.append(Issue("mismatch", f"the model has no input {spec.name!r}", f"{where}.name", spec.name,
                                fix=f"the model's inputs are {model_inputs}"))
            continue
        ty = graph.values[spec.name].type
        if ty.dtype != spec.dtype:
            issues.append(Issue("mismatch", f"input {spec.name!r} is {ty.dtype} in the model, the recipe declares "
                                            f"{spec.dtype}", f"{where}.dtype", spec.dtype,
                                fix=f"set dtype: {ty.dtype} (or export the model with {spec.dtype} inputs)"))
        if len(ty.shape) != len(spec.shape):
            issues.append(Issue("mismatch", f"input {spec.name!r} has rank {len(ty.shape)} in the model "
                                            f"({ty.text()}), the recipe declares {list(spec.shape)}",
                                f"{where}.shape", list(spec.shape), fix="declare one entry per axis"))
            continue
        for ax, (want, got) in enumerate(zip(spec.shape, ty.shape)):
            if isinstance(want, int):
                if not isinstance(got, int) or got != want:
                    issues.append(Issue("mismatch", f"input {spec.name!r} axis {ax} is {dim_str(got)} in the model, "
                                                    f"the recipe fixes it at {want}", f"{where}.shape[{ax}]", want,
                                        fix=f"use {dim_str(got)} there"))
            elif isinstance(got, int):
                lo, hi = recipe.dim_range(want)
                if not lo == hi == got:
                    issues.append(Issue("mismatch", f"input {spec.name!r} axis {ax} is fixed at {got} in the model, "
                                                    f"but dim {want!r} ranges over [{lo}, {hi}]",
                                        f"{where}.shape[{ax}]", want, fix=f"use {got} there, or export the model "
                                                                          f"with a dynamic axis {ax}"))
    extra = [n for n in model_inputs if n not in declared]
    if extra:
        issues.append(Issue("mismatch", f"the model takes inputs {extra} that the recipe does not declare", "inputs",
                            fix=f"declare every model input: {model_inputs}"))
    names = list(getattr(cap, "output_names", None) or graph.outputs)
    by_name = dict(zip(names, user_output_types(graph, cap)))
    for name, axes in recipe.outputs.items():
        where = f"outputs.{name}"
        if name not in by_name:
            issues.append(Issue("mismatch", f"the model has no output {name!r}", where,
                                fix=f"name one of the model's outputs {names} (named by the structure forward "
                                    "returns: `output` for one tensor, `output_0`, ... for a tuple, the keys of a "
                                    "dict or ModelOutput)"))
            continue
        ty = by_name[name]
        if len(axes) != len(ty.shape):
            issues.append(Issue("mismatch", f"output {name!r} has rank {len(ty.shape)} in the model ({ty.text()}), "
                                            f"the recipe declares {list(axes)}", where, list(axes),
                                fix=f"declare {len(ty.shape)} axes: " + str([dim_str(d) for d in ty.shape])))
            continue
        for ax, (want, got) in enumerate(zip(axes, ty.shape)):
            if want == "*":
                continue
            ok = (got == want) if isinstance(want, int) else (not isinstance(got, int) and dim_str(got) == want)
            if not ok:
                data = not isinstance(got, int) and any(re.fullmatch(r"data_u\d+", x.name) for x in got.free_symbols)
                issues.append(Issue("mismatch", f"output {name!r} axis {ax} is {dim_str(got)} in the model, the recipe "
                                                f"declares {want}", f"{where}[{ax}]", want,
                                    fix="use '*' there: its length only the data decides (x[mask], nonzero, unique)"
                                        if data else f"use {dim_str(got)!r} there (or '*' for an axis that is not "
                                                     "sliced back)"))
    return issues


def example_mismatches(recipe: Any, example_inputs: dict[str, Any], input_dims: dict[str, list]) -> list[Issue]:
    """Before capture: the recipe against the inputs the model was handed with, so a wrong dtype
    or fixed size is named as a recipe field instead of surfacing as an export failure."""
    from graphmode.ir.types import TORCH_TO_DTYPE
    issues = []
    for i, spec in enumerate(recipe.inputs):
        t = example_inputs.get(spec.name)
        if t is None:
            continue
        where = f"inputs[{i}]"
        got = TORCH_TO_DTYPE.get(t.dtype, str(t.dtype))
        if got != spec.dtype:
            issues.append(Issue("mismatch", f"the model's example input {spec.name!r} is {got}, the recipe declares "
                                            f"{spec.dtype}", f"{where}.dtype", spec.dtype, fix=f"set dtype: {got}"))
        if t.dim() != len(spec.shape):
            issues.append(Issue("mismatch", f"the model's example input {spec.name!r} has shape {list(t.shape)}, "
                                            f"the recipe declares rank {len(spec.shape)}: {list(spec.shape)}",
                                f"{where}.shape", list(spec.shape), fix=f"declare {t.dim()} axes"))
            continue
        declared = input_dims.get(spec.name, [])
        for ax, want in enumerate(spec.shape):
            if isinstance(want, int) and int(t.shape[ax]) != want and (
                    ax >= len(declared) or isinstance(declared[ax], int)):
                issues.append(Issue("mismatch", f"input {spec.name!r} axis {ax} is {int(t.shape[ax])} in the model, "
                                                f"the recipe fixes it at {want}", f"{where}.shape[{ax}]", want,
                                    fix=f"use {int(t.shape[ax])} there, or a dim name if it varies"))
    return issues


def _index_issues(recipe: Any, rep: IndexReport) -> list[Issue]:
    """Index tables against the recipe: no table may be empty, pad values and declared ranges
    must index inside the table, and no bucket may count more positions than the model has."""
    out = []
    for u in rep.empty_tables:
        out.append(Issue("model", f"{u.op} %{u.output} reads rows of %{u.table}, which has 0 rows on axis {u.axis}: "
                                  "every index is out of range", "model", u.table,
                         fix="export the model with a non-empty table (ONNX Runtime refuses this model too)"))
    for i, spec in enumerate(recipe.inputs):
        b = rep.inputs.get(spec.name)
        if b is None:
            continue
        if not b.lo <= spec.pad_value <= b.hi:
            out.append(Issue("index", f"padding {spec.name!r} with {spec.pad_value} would index out of range: "
                                      f"its values must be in [{b.lo}, {b.hi}] ({b.describe()})",
                             f"inputs[{i}].pad_value", spec.pad_value, fix=f"a pad_value in [{b.lo}, {b.hi}]"))
        rng = getattr(spec, "range", None)
        if rng is not None and not (b.lo <= rng[0] and rng[1] <= b.hi):
            out.append(Issue("index", f"the recipe admits values of {spec.name!r} the model cannot index: it "
                                      f"takes [{b.lo}, {b.hi}] ({b.describe()})", f"inputs[{i}].range", list(rng),
                             fix=f"range: [{max(rng[0], b.lo)}, {min(rng[1], b.hi)}]"))
    for d, lim in rep.dims.items():
        if d not in recipe.dims:
            continue
        top = max(recipe.dim_buckets()[d] + [recipe.dim_range(d)[1]])
        if top > lim.max:
            out.append(Issue("index", f"{d} reaches {top} but the model has {lim.max} positions ({lim.describe()})",
                             f"dims.{d}", top, fix=f"keep dims.{d} (its max and buckets) at most {lim.max}"))
    return out


def describe(tail: Graph) -> str:
    """A data-dependent tail's (capture/tail.py) first op, where the model makes it, and how many follow."""
    first = tail.nodes[0]
    more = len(tail.nodes) - 1
    return f"{first.attrs.get('target')} at {first.attrs.get('loc')}" + (f" and {more} op(s) after it" if more else "")


def user_output_types(graph: Graph, cap: Any) -> list:
    """The types of the outputs the model returns: the tail's where it has one (a data-dependent
    axis is a `data_u*` dim there), else the graph's first outputs (before in-place updates)."""
    tail = getattr(cap, "tail", None)
    if tail is not None:
        return [tail.values[o].type for o in tail.outputs]
    users = graph.outputs[:len(graph.outputs) - len(getattr(cap, "mutated_inputs", None) or [])]
    return [graph.values[o].type for o in users]


def _fallbacks(cap: Any, mode: str) -> list[Issue]:
    if mode != "graph" or cap is None:
        return []
    out = []
    tail = getattr(cap, "tail", None)
    if tail is not None and tail.nodes:
        out.append(Issue("fallback", f"the model makes a size only its data decides ({describe(tail)}): graphmode "
                                     "plans every buffer from the recipe's dims, so exe_mode 'graph' cannot run it",
                         "exe_mode", mode, fix="set exe_mode: hybrid (the plan runs up to that op, the rest runs "
                                               "eagerly on the plan's outputs), or keep the shape fixed: "
                                               "torch.where(mask, x, 0) or a masked sum instead of x[mask]",
                         loc=tail.nodes[0].attrs.get("loc")))
    for f in cap.fallbacks:
        excluded = getattr(f, "excluded", False)
        fix = ("remove it from capture.exclude_ops, or set exe_mode: hybrid to run it as an eager island"
               if excluded else
               "set exe_mode: hybrid to run it as an eager island (graphmode has no lowering for it yet)")
        out.append(Issue("fallback", f"op {f.target} (x{f.count}) cannot run in exe_mode 'graph': {f.reason}",
                         "exe_mode", mode, fix=fix, loc=f.loc))
    return out


def _short_slices(recipe: Any, graph: Graph, cap: Any) -> list[Issue]:
    """Slices with constant bounds over a dynamic axis that some admissible dim value makes
    shorter than the bound: the plan would read past the axis (x[:2] at batch 1 answered two
    rows, the second one garbage)."""
    from graphmode.analysis.extents import short_slices
    out = []
    for s in short_slices(graph, {d: recipe.dim_range(d) for d in recipe.dims}):
        lo = recipe.dim_range(s.dim)[0]
        loc = (getattr(cap, "locs", {}) or {}).get(s.output)
        out.append(Issue("model", f"slice {s.start}:{'' if s.end >= 2 ** 31 else s.end} of an axis of {s.extent} "
                                  f"positions takes {s.need}, but the recipe admits {s.dim} = {lo}, where the axis "
                                  f"has {s.at_low}: that plan would read past it", f"dims.{s.dim}.min", lo,
                         fix=(f"dims.{s.dim}.min: {s.fits} (and no smaller bucket)" if s.fits is not None else
                              f"keep dims.{s.dim} where the axis holds {s.need}") + ", or exe_mode: eager", loc=loc))
    return out


def _short_extents(recipe: Any, graph: Graph, cap: Any) -> list[Issue]:
    """Dim minimums the graph cannot take: a window wider than its input (analysis/extents.py)."""
    from graphmode.analysis.extents import short_extents
    out = []
    for s in short_extents(graph, {d: recipe.dim_range(d) for d in recipe.dims}):
        lo, _ = recipe.dim_range(s.dim)
        loc = (getattr(cap, "locs", {}) or {}).get(s.output)
        out.append(Issue("model", s.reason(lo), f"dims.{s.dim}.min", lo, loc=loc,
                         fix=(f"dims.{s.dim}.min: {s.fits} (and no smaller bucket): the smallest {s.dim} the model "
                              "takes" if s.fits is not None else f"no {s.dim} in the recipe's range fits: widen it")
                             + ", or exe_mode: eager"))
    return out
