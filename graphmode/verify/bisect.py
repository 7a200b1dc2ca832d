"""Graph vs eager numerics, and bisection of a mismatch to the first diverging node and the
pass that introduced it.

Value names survive passes (passes rename nothing they keep), so the reference interpreter's
values on the captured graph can be compared name by name with any later graph's values.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from graphmode.ir.graph import Graph
from graphmode.ir.interpreter import interpret
from graphmode.verify.numerics import (TOLERANCE, UNJUDGED_WEIGHT_ONLY, WEIGHT_ONLY, Top1, nonfinite_count, rel_l2,
                                       top1_agreement)


@dataclass
class OutputCheck:
    """One output against eager. `top1` is set where the recipe stores weights narrow; for
    logits (`judge_top1`) a confident top-1 flip then fails the check (numerics.Top1)."""

    name: str
    dtype: str
    rel_l2: float
    tolerance: float
    top1: Top1 | None = None
    judge_top1: bool = False
    eager_nonfinite: int = 0       # eager's own NaN/inf values: compared only as "there too"
    size: int = 0

    @property
    def vacuous(self) -> bool:
        """Eager is NaN/inf at every value: a rel L2 of 0 then vouches for nothing."""
        return self.size > 0 and self.eager_nonfinite == self.size

    @property
    def ok(self) -> bool:
        flips = self.top1.flips if (self.judge_top1 and self.top1 is not None) else 0
        return self.rel_l2 <= self.tolerance and flips == 0 and not self.vacuous

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "rel_l2": self.rel_l2, "tolerance": self.tolerance}
        if self.eager_nonfinite:
            d["eager_nonfinite"] = {"count": self.eager_nonfinite, "of": self.size}
        if self.top1 is not None:
            d["top1"] = {"share": self.top1.share, "agree": self.top1.agree, "positions": self.top1.positions,
                         "confident_flips": self.top1.flips, "judged": self.judge_top1,
                         "max_changed_lead": round(self.top1.max_lead, 4)}
        return d


def top1_cell(top1: Mapping[str, Any]) -> str:
    """An output's top-1 check as a table cell: agreement, confident flips and, where picks
    changed, the f32 model's largest lead over one as odds (a changed pick it led 3.9:1)."""
    lead = float(top1.get("max_changed_lead") or 0.0)
    odds = f", f32 led <= {math.exp(lead):.1f}:1" if lead > 0 else ""
    return f"{top1['share']:.1%}, {top1['confident_flips']} flip(s){odds}"


@dataclass
class Divergence:
    pass_name: str | None            # the first pass after which the graph disagrees with eager
    node: str | None                 # "%value = op(...)" of the first diverging node
    op: str | None
    rel_l2: float
    stage: str             # "pass" | "plan" | "capture" | "padding" | "weights" | "parallel" | "reference" | "decode"
    detail: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        where = f"first diverging node {self.node}" if self.node else "no single node isolated"
        if self.stage == "pass":
            own = self.detail.get("node_rel_l2")
            at = f" (its own rel L2 {own:.2e})" if self.node and own is not None else ""
            return f"introduced by pass {self.pass_name!r}: {where}{at}; the outputs' rel L2 {self.rel_l2:.2e}"
        if self.stage == "padding":
            return (f"a padded request differs from eager (rel L2 {self.rel_l2:.2e}) although the bucket itself "
                    "matches: padding changes this model's outputs")
        if self.stage == "weights":
            return (f"{self.detail.get('weights')} weights change the top-1 of {self.detail.get('flips')} of "
                    f"{self.detail.get('positions')} position(s) that the f32 model decided (led by more than the "
                    f"rounding noise, or by 4:1 or more) (error within bound: rel L2 {self.rel_l2:.2e})")
        if self.stage == "parallel":
            wire = self.detail.get("comm", "f32")
            return (f"the {self.detail.get('ranks')} ranks' outputs differ from eager (rel L2 {self.rel_l2:.2e}; the "
                    f"wire in {wire}); no bisection runs across ranks: verify the recipe without its parallel "
                    "section (tensor: 1) to bisect the passes" + (", or widen parallel.comm.dtype" if wire != "f32"
                                                                    else ""))
        if self.stage == "decode" and self.detail.get("refused"):
            return f"decoding was refused with the KV cache in {self.detail.get('kv')}: {self.detail['refused']}"
        if self.stage == "decode":
            flips = self.detail.get("flips") or 0
            return (f"the decode steps' logits differ from eager's (rel L2 {self.rel_l2:.2e} against "
                    f"{self.detail.get('tolerance'):.0e}" + (f", {flips} confident top-1 flip(s)" if flips else "")
                    + f"; worst at step {self.detail.get('step')} of prompt {self.detail.get('prompt')}) with the "
                    f"KV cache in {self.detail.get('kv')}, though the whole-sequence graph matches")
        if self.stage == "reference":
            return (f"eager's own output {self.detail.get('output')!r} is NaN or inf at all of its "
                    f"{self.detail.get('count')} values, so nothing was compared (graphmode's agree, which proves "
                    "nothing): look for NaN/inf in the model's weights or buffers, or an overflow at the inputs "
                    "verify draws (standard normal; --seed picks others)")
        if self.stage == "plan":
            return f"introduced by the backend plan (all passes match): {where} (rel L2 {self.rel_l2:.2e})"
        return f"the captured graph already differs from eager: {where} (rel L2 {self.rel_l2:.2e})"


def tolerance_for(dtype: str, compute: str = "f32") -> float:
    return max(TOLERANCE.get(dtype, 1e-5), TOLERANCE.get(compute, 1e-5))


def output_labels(source: Any, graph: Graph | None, count: int) -> list[str]:
    """Names for `count` outputs: the model's own (`logits`, as transformers names them) where
    the source knows them, else the graph's value names, else positions. What a check reports
    and judges by."""
    for names in (list(getattr(source, "output_names", None) or []), list(graph.outputs) if graph else []):
        if len(names) == count:
            return names
    return [str(i) for i in range(count)]


def logit_outputs(graph: Graph | None, count: int) -> list[bool]:
    """Which of `count` outputs are logits over a vocabulary, whatever they are called: as long
    on their last axis as the model's token table (the rows of the largest table an `embedding`
    looks up), as an LM head's output is. An ONNX export names it `out` or `output_0`; its
    top-1 is judged as a `logits` output's."""
    if graph is None or len(graph.outputs) != count:
        return [False] * count
    tables = [graph.values[n.inputs[0]].type.shape for n in graph.iter_nodes(True)
              if n.op == "embedding" and n.inputs[0] in graph.values]
    rows = [s[0] for s in tables if len(s) == 2 and isinstance(s[0], int)]
    vocab = max(rows, default=None)
    out = []
    for o in graph.outputs:
        t = graph.values[o].type
        out.append(vocab is not None and vocab > 1 and t.rank >= 2 and t.dtype.startswith(("f", "bf"))
                   and isinstance(t.shape[-1], int) and t.shape[-1] == vocab)
    return out


def checked_precision(recipe: Any) -> tuple[str, str]:
    """(compute, weights) the outputs are judged at: the recipe's precision, with a tensor-parallel
    group's narrow wire dtype (parallel.comm.dtype bf16 / int8, rounding every collective) judged
    as weights that narrow are, when it rounds more than they do."""
    compute, weights = recipe.precision.compute, recipe.precision.weights
    par = getattr(recipe, "parallel", None)
    comm = par.comm.dtype if par is not None and par.tensor > 1 else "f32"
    if WEIGHT_ONLY.get(comm, 0.0) > WEIGHT_ONLY.get(weights, 0.0):
        weights = comm
    return compute, weights


def compare_outputs(names: list[str], got: list[torch.Tensor], want: list[torch.Tensor],
                    compute: str = "f32", weights: str = "f32", logits: Sequence[bool] = ()) -> list[OutputCheck]:
    """Each output against eager at its dtype's tolerance; with narrow weights
    (precision.weights) at numerics.WEIGHT_ONLY's error bound, and logits (named so, or flagged
    in `logits`: logit_outputs) also on top-1; an output with narrow weights that no top-1 check
    judges at UNJUDGED_WEIGHT_ONLY's bound where the weights' own is looser."""
    out = []
    flagged = list(logits) + [False] * (len(names) - len(logits))
    for n, g, w, is_logits in zip(names, got, want, flagged):
        dt = str(w.dtype).replace("torch.", "")
        short = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "float64": "f64"}.get(dt, dt)
        tol = tolerance_for(short, compute)
        narrow = weights in WEIGHT_ONLY and torch.is_floating_point(w)
        top1 = top1_agreement(g, w) if narrow else None
        judged = top1 is not None and ("logits" in n or is_logits)
        if narrow:
            tol = max(tol, WEIGHT_ONLY[weights] if judged else min(WEIGHT_ONLY[weights], UNJUDGED_WEIGHT_ONLY))
        bad = nonfinite_count(w)
        out.append(OutputCheck(n, short, rel_l2(g, w), tol, top1, judge_top1=judged, eager_nonfinite=bad,
                               size=w.numel() if torch.is_floating_point(w) else 0))
    return out


def reference_divergence(checks: Sequence[OutputCheck]) -> Divergence | None:
    """The failure of a case whose eager outputs are NaN/inf throughout: nothing was compared."""
    empty = next((c for c in checks if c.vacuous), None)
    if empty is None:
        return None
    return Divergence(None, None, None, empty.rel_l2, "reference", {"output": empty.name, "count": empty.size})


def _first_bad_node(reference: Graph, ref_vals: Mapping[str, torch.Tensor], candidate: Graph,
                    cand_vals: Mapping[str, torch.Tensor], tol: float) -> tuple[str | None, str | None, float]:
    """The first node of `candidate` (in order) whose output differs from the same-named
    reference value; fused nodes are checked through their outputs."""
    for n in candidate.nodes:
        for o in n.outputs:
            if o in ref_vals and o in cand_vals and torch.is_floating_point(ref_vals[o]):
                e = rel_l2(cand_vals[o], ref_vals[o])
                if e > tol:
                    args = ", ".join(f"%{i}" for i in n.inputs)
                    return f"%{o} = {n.op}({args})", n.op if n.op != "fused" else f"fused[{n.attrs.get('kind')}]", e
    return None, None, 0.0


def bisect(snapshots: list[tuple[str, Graph]], inputs: Mapping[str, torch.Tensor],
           eager_outputs: list[torch.Tensor], tol: float = 1e-5) -> Divergence | None:
    """Find the first pass snapshot whose outputs leave tolerance, then its first bad node."""
    base_name, base = snapshots[0]
    base_vals = interpret(base, inputs, keep_all=True)
    base_out = [base_vals[o] for o in base.outputs]
    worst = max(rel_l2(a, b) for a, b in zip(base_out, eager_outputs))
    if worst > tol:
        return Divergence(None, None, None, worst, "capture")
    prev_vals = base_vals
    prev_graph = base
    for name, g in snapshots[1:]:
        vals = interpret(g, inputs, keep_all=True)
        err = max(rel_l2(vals[o], e) for o, e in zip(g.outputs, eager_outputs))
        if err > tol:
            node, op, e = _first_bad_node(prev_graph, prev_vals, g, vals, tol)
            return Divergence(name, node, op, err, "pass", {"node_rel_l2": e})
        prev_vals, prev_graph = vals, g
    return None


def bisect_plan(graph: Graph, executable, inputs: Mapping[str, torch.Tensor], tol: float = 1e-5) -> Divergence:
    """All passes agree: run the plan step by step and compare each slot with the interpreter."""
    ref = interpret(graph, inputs, keep_all=True)
    exe = executable
    with torch.inference_mode():
        for name in exe.plan.inputs:
            exe.views[name].copy_(inputs[name])
        steps = iter(zip(exe.steps, exe.step_names))
        for ins in exe.plan.instructions:
            if ins.kind != "view":
                step, _ = next(steps)
                step()
            for o in ins.outputs:
                if o in ref and torch.is_floating_point(ref[o]):
                    e = rel_l2(exe.views[o], ref[o])
                    if e > tol:
                        args = ", ".join(f"%{i}" for i in ins.inputs)
                        return Divergence(None, f"%{o} = {ins.op}({args})", ins.op, e, "plan",
                                          {"instruction": ins.kind})
    return Divergence(None, None, None, 0.0, "plan")
