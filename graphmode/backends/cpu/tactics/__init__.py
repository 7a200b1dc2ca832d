"""GEMM and conv tactic selection: for every GEMM / conv shape of a plan, ATen or a generated kernel.

candidates.py (what may run a shape, how they are built, and the check against ATen each
must pass), narrowing.py (the candidates a plan rules out before building), timing.py (how
candidates are timed), tuning.py (one shape's winner: from the cache, or checked and timed),
cache.py (the timing cache on disk), selection.py (the policies, what was decided, the
report), steps.py (the plan steps tuning switches), weights.py (prepared weights and binding),
host.py (the machine tuned for), context.py (one executable's context, handed explicitly to
the lowerings that bind its GEMM/conv steps).
"""
from graphmode.backends.cpu.tactics.cache import CACHE_VERSION, TimingCache
from graphmode.backends.cpu.tactics.candidates import CONFIGS, candidate_names, candidate_sources
from graphmode.backends.cpu.tactics.context import TacticsContext, tactics_context
from graphmode.backends.cpu.tactics.selection import (MARGIN_CAP, POLICIES, Margin, Selection, margin_text,
                                                      report_lines, timing_doubts)
from graphmode.backends.cpu.tactics.steps import ATEN, ConvStep, FusedEpilogue, GemmStep, problem_of
from graphmode.backends.cpu.tactics.timing import CALIBRATION_CALLS, measure

__all__ = ["TacticsContext", "tactics_context", "Selection", "GemmStep", "ConvStep", "FusedEpilogue", "problem_of",
           "report_lines", "Margin", "margin_text", "timing_doubts", "MARGIN_CAP", "POLICIES", "CONFIGS", "ATEN",
           "CALIBRATION_CALLS", "CACHE_VERSION", "TimingCache", "measure", "candidate_names", "candidate_sources"]
