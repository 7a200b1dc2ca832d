"""Region ops: `fused` (a body run as one kernel) and `fallback` (an op run eagerly)."""
from __future__ import annotations

from graphmode.errors import IRError
from graphmode.ir.ops.spec import OpSpec, register


def _fused_infer(ins, a):  # types are carried by the body; the verifier checks them there
    raise IRError("fused nodes take their types from their body")


def _fused_ref(ins, a, env):
    raise IRError("fused nodes are interpreted through their body")


register(OpSpec("fused", "fused", (0, 1024), _fused_infer, _fused_ref, attrs=("kind", "pattern"),
                doc="a region of ops (its body) executed as one kernel; kind: elementwise | reduction | "
                    "gemm_epilogue | attention | norm", padding="region"))


def _fallback_infer(ins, a):
    raise IRError("fallback nodes carry their output types")


def _fallback_ref(ins, a, env):
    from graphmode.ir.fallback import run_fallback
    return run_fallback(ins, a, env)


register(OpSpec("fallback", "fallback", (0, 1024), _fallback_infer, _fallback_ref, attrs=("target", "args", "loc"),
                doc="an op graphmode does not compile (excluded or unsupported): runs eagerly via torch.ops",
                padding="island"))
