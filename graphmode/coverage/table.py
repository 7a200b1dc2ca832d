"""The op coverage table: for every op of the database, who imports it (torch.export ATen
overloads, ONNX op types), whether the interpreter runs it and has samples to check it
with, how the CPU backend lowers it, its traits, its padding rule and whether it names an
eager ATen call; plus the gaps that follow.

Every column is read from a registry, never from a list kept here: the importers' converter
registries (through converters.py), the op database, the CPU backend's lowering registry
(`native` / `aten` tiers) and the group generators' own op sets (`generated`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Any

from graphmode.backends.cpu import catalog  # noqa: F401 - loads every lowering into the registry
from graphmode.backends.cpu.codegen import ELEMENTWISE_OPS, GENERATED_OPS
from graphmode.backends.cpu.lowering import ATEN, GENERATED, NATIVE, lowerings, ops_in
from graphmode.backends.cpu.rowwise import ROW_KERNELS
from graphmode.coverage.converters import onnx_emits, torch_emits
from graphmode.coverage.samples import cpu_claims, runs_as, sample_inputs
from graphmode.ir.ops import OPS, flops_of, get_op, ops_with
from graphmode.ir.types import TensorType


@dataclass(frozen=True)
class OpRow:
    op: str
    kind: str
    torch: tuple[str, ...]       # ATen overloads whose conversion emits the op
    onnx: tuple[str, ...]        # ONNX op types whose conversion emits it
    interpreter: str             # how the reference interpreter runs it
    samples: int                 # sample inputs (the op coverage test runs each one on every path)
    lowering: tuple[str, ...]    # CPU tiers with a lowering for it: native, aten, generated (none: reference op)
    traits: tuple[str, ...]
    padding: str                 # its padding rule (ir/ops PADDING_RULES), "undeclared" when it names none
    aten_fallback: bool          # it names an eager ATen call (OpSpec.aten_call): it can run as an eager fallback

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _lowering(op: str) -> tuple[str, ...]:
    tiers = [t for t in (NATIVE, ATEN) if op in ops_in(t)]
    if op in GENERATED_OPS or op in ops_in(GENERATED):
        tiers.append(GENERATED)
    return tuple(tiers)


def _interpreter(op: str) -> str:
    return {"fused": "its body", "fallback": "torch.ops (eager)"}.get(op, "reference")


@lru_cache(maxsize=1)
def coverage() -> tuple[OpRow, ...]:
    """One row per op, sorted by kind then name."""
    by_aten, by_onnx = _producers(torch_emits()), _producers(onnx_emits())
    rows = []
    for name in sorted(OPS, key=lambda n: (OPS[n].kind, n)):
        s = OPS[name]
        rows.append(OpRow(name, s.kind, tuple(by_aten.get(name, ())), tuple(by_onnx.get(name, ())),
                          _interpreter(name), len(s.samples()) if s.samples else 0, _lowering(name),
                          tuple(sorted(s.traits)), s.padding or "undeclared", s.aten_call is not None))
    return tuple(rows)


def _producers(emits) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for key in sorted(emits):
        for op in emits[key].ops:
            out.setdefault(op, []).append(key)
    return out


def unresolved() -> dict[str, list[str]]:
    """Converter op arguments the table could not evaluate, by importer (kept empty by a test:
    an entry means a column may be missing a producer)."""
    return {imp: sorted({u for e in emits.values() for u in e.unresolved})
            for imp, emits in (("torch", torch_emits()), ("onnx", onnx_emits()))}


def gaps(rows: tuple[OpRow, ...] | None = None) -> dict[str, tuple[str, tuple[str, ...]]]:
    """name -> (what it means, the ops in it): where an op is imported but not compiled,
    compiled but not imported, or not checked."""
    rows = rows if rows is not None else coverage()
    imported = [r for r in rows if r.torch or r.onnx]

    def pick(rs, cond) -> tuple[str, ...]:
        return tuple(r.op for r in rs if cond(r))
    return {
        "reference_only": ("imported, but no CPU lowering claims it: the executor runs the reference op and "
                           "copies its result", pick(imported, lambda r: not r.lowering)),
        "aten_only": ("imported, and the CPU backend only runs it as an ATen step, with no native or generated "
                      "kernel (a GEMM or conv step may still switch to a generated kernel by tactic selection)",
                      pick(imported, lambda r: r.lowering == (ATEN,))),
        "torch_only": ("emitted by the torch importer, not by the ONNX importer", pick(rows, lambda r: r.torch
                                                                                        and not r.onnx)),
        "onnx_only": ("emitted by the ONNX importer, not by the torch importer", pick(rows, lambda r: r.onnx
                                                                                      and not r.torch)),
        "not_imported": ("no importer emits it (passes or the decode engine create it)",
                         pick(rows, lambda r: not r.torch and not r.onnx)),
        "no_samples": ("no sample inputs: the op coverage test cannot check it", pick(rows, lambda r: not r.samples)),
        "elementwise_not_generated": ("elementwise, but no C expression: a fused group holding it is not generated",
                                      tuple(sorted(ops_with("elementwise") - ELEMENTWISE_OPS))),
        "row_reduction_not_generated": ("a row reduction without a row kernel",
                                        tuple(sorted(ops_with("row_reduction") - set(ROW_KERNELS)))),
        "padding_opaque": ("padding rule `opaque` (or none declared): a padded dim reaching it is reported unsafe",
                           pick(rows, lambda r: r.padding in ("opaque", "undeclared"))),
        "no_aten_fallback": ("no eager ATen call: a backend or recipe that does not compile it cannot fall back",
                             pick(rows, lambda r: not r.aten_fallback)),
    }


def _registered(row: OpRow) -> list[dict[str, str]]:
    """The claim functions that may take the op: its own per tier, and the fused-group
    generator's when the op can sit in a generated group."""
    lows = [low for t in (NATIVE, ATEN, GENERATED) for low in lowerings(t, row.op)]
    if GENERATED in row.lowering and row.op != "fused":
        lows += lowerings(GENERATED, "fused")
    return [{"tier": low.tier, "claim": f"{low.claim.__module__}.{low.claim.__qualname__}"} for low in lows]


def op_details(name: str) -> dict[str, Any]:
    """Everything `graphmode ops --op NAME` shows: the row, the op's semantics and attributes,
    its registered lowerings, and per sample its types, cost and which CPU lowering takes it."""
    spec = get_op(name)
    row = next(r for r in coverage() if r.op == name)
    out: dict[str, Any] = row.to_json()
    out.update({"doc": spec.doc, "arity": list(spec.arity), "attrs": list(spec.attrs),
                "flops_per_elem": spec.flops_per_elem,
                "lowerings": _registered(row),
                "samples": []})     # the row's count becomes the list of samples
    for i, sample in enumerate(spec.samples() if spec.samples else []):
        ins = sample_inputs(sample, i)
        in_types = [TensorType.of(t) for t in ins]
        out_types = spec.infer(in_types, dict(sample.attrs))
        claims = cpu_claims(name, ins, sample.attrs)
        shapes = [t.concrete({}) for t in in_types]
        out["samples"].append({
            "inputs": [t.text() for t in in_types], "attrs": dict(sample.attrs),
            "outputs": [t.text() for t in out_types],
            "flops": flops_of(name, shapes, [t.concrete({}) for t in out_types], sample.attrs),
            "runs_as": runs_as(claims),
            "claims": {t: "claimed" if c else f"refused: {c.why}" for t, c in claims.items()}})
    return out


__all__ = ["OpRow", "coverage", "gaps", "unresolved", "op_details"]
