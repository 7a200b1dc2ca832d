"""Why torch.export refused a model, said in the user's terms.

torch.export's first line is often about its own symbols: "Could not guard on data-dependent
expression Eq(u0, 1)" names a symbol no recipe dim is called, and the line of model code that
raised it is further down the message ("The following call raised this error"). A branch on a
tensor's value cannot be one graph, so the error names that line, shows it, and says what
to change; Hugging Face's rotary embeddings that recompute their frequencies from the
positions of each call (rope_type `dynamic`, `longrope`) get their own fix. While export runs,
torch's fake-tensor and symbolic-shape loggers are quieted and its stderr is held back: a
failing export logs a traceback and prints a whole partial graph, and the CaptureError says
what matters.
"""
from __future__ import annotations

import ast
import contextlib
import functools
import io
import linecache
import logging
import operator
import os
import re
import sys
import threading
import warnings
from typing import Any, Iterator

import torch

from graphmode.errors import CaptureError

_DATA_DEPENDENT = ("GuardOnDataDependentSymNode", "DataDependentOutputException", "PendingUnbackedSymbolNotFound")
_CALL = re.compile(r'The following call raised this error:\s*\n\s*File "([^"]+)", line (\d+), in (\S+)')
_ROPE = re.compile(r"dynamic_frequency_update|longrope_frequency_update|dynamic_rope_update")
_QUIET = ("torch._subclasses.fake_tensor", "torch.fx.experimental.symbolic_shapes")
# torch.export's "Suggested fixes:" lines: a narrower range (`seq = Dim('seq', min=3, max=16)`) or a value
_RANGE_FIX = re.compile(r"^\s*(\w+) = Dim\('\w+'(?:, min=(\d+))?(?:, max=(\d+))?\)\s*$", re.M)
_VALUE_FIX = re.compile(r"^\s*(\w+) = (\d+)\s*$", re.M)
_DERIVED_FIX = re.compile(r"^\s*(\w+) = (\d+)\*(\w+)(?: \+ (\d+))?\s*$", re.M)


# One trace at a time in the process: torch.export and make_fx keep their modes (the proxy and
# fake-tensor dispatch modes, the symbolic-shape environment) process-wide, so two threads
# tracing at once failed ('ProxyTorchDispatchMode slot already occupied', 'pop empty mode stack')
# and a draft's probe that failed that way fixed its dims silently (trial AC: three threads each
# compiling a BERT). The stderr redirect and the warning filters below are process-wide too.
EXPORT_LOCK = threading.RLock()


@contextlib.contextmanager
def quiet_export_logs() -> Iterator[None]:
    """The process's one trace (EXPORT_LOCK held), with torch's fake-tensor and symbolic-shape
    loggers at CRITICAL while it runs and what it prints to stderr held back: written out after a
    successful export, dropped after a failed one (torch prints the failed trace's partial graph
    there, hundreds of lines)."""
    with EXPORT_LOCK:
        yield from _quiet()


def _quiet() -> Iterator[None]:
    loggers = [logging.getLogger(n) for n in _QUIET]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    held = io.StringIO()
    try:
        with contextlib.redirect_stderr(held), warnings.catch_warnings():
            # torch's own deepcopy of its pytree specs in run_decompositions warns about torch's API
            warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                                    category=FutureWarning)
            yield
        sys.stderr.write(held.getvalue())
    finally:
        for lg, lv in zip(loggers, levels):
            lg.setLevel(lv)


def shown_path(path: str) -> str:
    """A source path as a user reads it: relative to the working directory when the model's code
    is there, from the package on for an installed library (transformers/models/...), else whole."""
    p = os.path.abspath(path)
    for marker in ("site-packages", "dist-packages"):
        head, sep, tail = p.partition(os.sep + marker + os.sep)
        if sep:
            return tail
    cwd = os.getcwd()
    if p.startswith(cwd + os.sep):
        return os.path.relpath(p, cwd)
    return path


# "Not all values of seq = L['x'].size()[1] in the specified range 4 <= seq <= 64 satisfy the
# generated guard (16*L['x'].size()[1]) != 64.": a guard that holds everywhere but at one value
_EXCLUDED = re.compile(r"Not all values of (\w+) = (\S+) in the specified range (?:(\d+) <= )?\1 <= (\d+) "
                       r"satisfy the generated guard (.+) != (.+?)\.?$", re.M)
_EXPORT_MIN = 2         # a range torch.export prints without a minimum starts at 2 (it specialises 0 and 1)


def _excluded_ends(text: str) -> str:
    """torch.export's fixes, as its "Suggested fixes:" lines, for a guard `size != v` where v is
    an end of the dim's range: `x[:, :4]` guards seq != 4 (there the slice is the whole tensor),
    and torch suggests nothing once the range starts at 4; `buffer[:seq]` of a 512-row buffer
    guards seq != 512. The range without that end holds."""
    import sympy
    fixes = []
    for d, source, lo, hi, lhs, rhs in _EXCLUDED.findall(text):
        x = sympy.Symbol(d, integer=True, positive=True)
        try:
            eq = sympy.sympify(lhs.replace(source, d), locals={d: x}) - sympy.sympify(rhs.replace(source, d),
                                                                                       locals={d: x})
            roots = [r for r in sympy.solve(eq, x) if r.is_Integer]
        except (sympy.SympifyError, SyntaxError, TypeError, NotImplementedError):
            continue
        lo, hi = int(lo or _EXPORT_MIN), int(hi)
        if roots == [lo] and lo < hi:
            fixes.append(f"{d} = Dim('{d}', min={lo + 1}, max={hi})")
        elif roots == [hi] and lo < hi:
            fixes.append(f"{d} = Dim('{d}', min={lo}, max={hi - 1})")
    return "\n".join(fixes)


def _derived(text: str) -> dict[str, tuple[str, int, int]]:
    """torch.export's derived dims (`samples = 10*_samples`, `W = 2*_W + 1`): {base: (dim, k, c)}."""
    return {base: (d, int(k), int(c or 0)) for d, k, base, c in _DERIVED_FIX.findall(text)}


def _constraint_fixes(text: str) -> list[str]:
    """torch.export's suggested dim ranges and values, as recipe terms ("seq min 3, max 16"); a
    range of a derived dim's base (`_samples`, no dim of the recipe) as the dim's own terms."""
    derived = _derived(text)
    out = []
    for d, lo, hi in _RANGE_FIX.findall(text):
        if d in derived:            # samples = 10*_samples: what it asks of samples itself
            dim, k, c = derived[d]
            span = " in [" + ", ".join(str(k * int(v) + c) if v else "?" for v in (lo, hi)) + "]"
            out.append(f"{dim} a multiple of {k}" + (f" plus {c}" if c else "") + span)
            continue
        out.append(f"{d} " + ", ".join(f"{k} {v}" for k, v in (("min", lo), ("max", hi)) if v))
    # a value alone only when no range is suggested: beside one, it is the capture's own narrow
    # example range for another dim (graphmode exports batch 1..2 as 2..2), not the model's need
    # the value is the size of graphmode's example, not one the model needs: the dim is static
    return out or [f"{d} static (torch.export keeps it at {v}, the size of graphmode's capture example, inside the "
                   "recipe's range)" for d, v in _VALUE_FIX.findall(text)]


def _narrow_fix(suggested: str, narrowed: list[str]) -> str:
    """What to write: the ranges torch.export holds one graph over, or for a dim it keeps static
    one value per recipe (the value is the capture's, not one the model needs)."""
    multiples = [n.split()[0] for n in narrowed if " a multiple of " in n]
    if multiples:                 # no recipe term says "multiples only": a dim takes every size in its range
        return (f"give {' and '.join(multiples)} one size per compile, a multiple as said (e.g. "
                f"{multiples[0]}: 64, a number: one size; a recipe per size you serve): a recipe's dim takes every "
                "size in [min, max] (its `step` spaces the buckets, not the sizes requests bring); or run the model "
                "with exe_mode: eager")
    if _RANGE_FIX.findall(suggested):
        return "narrow the recipe's dims to " + "; ".join(narrowed) + " (or run the model with exe_mode: eager)"
    return ("give " + " and ".join(f"{d} one value ({d}: N, a number: N a size you serve)"
                                   for d in [n.split()[0] for n in narrowed])
            + ": a recipe per size you serve, or run the model with exe_mode: eager")


ROPE_WHY = ("This rotary embedding (Hugging Face rope_type 'dynamic' or 'longrope') recomputes its frequencies "
            "from the largest position of each call, which one graph cannot hold")
ROPE_FIX = ("compile the model with a rope type whose frequencies are fixed (rope_scaling rope_type 'linear', "
            "'yarn' or 'llama3', or none), or run it with exe_mode: eager")


# torch.export failures whose cause is in how the model was built, not in the recipe's dims:
# (text in the error, what it means, fix)
_KNOWN_CAUSES = (
    ("inference tensor", "the model's weights are inference tensors (made under torch.inference_mode()), which "
     "torch.export cannot trace", "build or load the model outside torch.inference_mode() and wrap only the calls "
     "in it"),
    ("__obj_flatten__", "the model holds packed quantized weights (torch.ao quantize_dynamic / prepacked "
     "linear params), which torch.export cannot trace", "compile the float model with precision.weights: int8 in "
     "the recipe (graphmode's own weight-only int8)"),
    ("lifted_custom", "the model makes a script object in forward (a torch.Generator, a packed parameter), which "
     "torch.export cannot trace", "create it outside forward, or draw random numbers without a generator object"),
)


# "shape '[s77, (s27//2), 16]' is invalid for input of size 8*s27*s77": a reshape into pieces of 2
_SPLIT_RESHAPE = re.compile(r"shape '\[[^\]]*\(\w+//(\d+)\)[^\]]*\]' is invalid for input of size")
_UNMET = re.compile(r"Not all values of (\w+) = (\S+) in the specified range .*? satisfy the generated guard (.+?)\.?$",
                    re.MULTILINE)


def _unmet_guards(text: str) -> list[tuple[str, str]]:
    """(dim, condition) for each guard torch.export states but cannot prove over a dim's range
    (XLNet's `((-1) + 2*seq) % seq != 0`), its size expression written as the dim's name."""
    return [(d, guard.replace(expr, d)) for d, expr, guard in _UNMET.findall(text)]


def _guards_hold(unmet: list[tuple[str, str]], ranges: Any) -> CaptureError | None:
    """The refusal for guards that hold at every value of their dim's range, which torch.export
    states but its solver cannot prove (`1 % (samples // 10 - 1) != 0`: it does not reason about
    % over a range), or that fail at values named: checked one value at a time (ranges up to
    100,000 values). None: a guard this cannot evaluate."""
    failing: dict[str, list[int]] = {}
    for d, guard in unmet:
        if d not in ranges or (ranges[d][1] - ranges[d][0]) > 100_000:
            return None
        lo, hi = ranges[d]
        bad = []
        for v in range(lo, hi + 1):
            ok = _evaluate(guard, {d: v})
            if ok is None:
                return None
            if not ok:
                bad.append(v)
        failing[d] = sorted(set(failing.get(d, [])) | set(bad))
    guards = "; ".join(g for _, g in unmet)
    dims = sorted(failing)
    if any(failing.values()):
        d = next(d for d in dims if failing[d])
        lo, hi = ranges[d]
        bad = failing[d]
        good = [v for v in range(lo, hi + 1) if v not in set_bad] if (set_bad := set(bad)) else []
        err = CaptureError(f"torch.export failed: the model's graph holds only where {guards}, which fails at "
                           f"{d} = {_values(bad)} in the recipe's range {lo}..{hi}", where=f"dims.{d}", value=bad[0],
                           fix=(f"narrow dims.{d} to where it holds ({_values(good)})" if good else
                                f"make {d} static in the recipe") + ", or run the model with exe_mode: eager")
        # where it holds from some size to the top (a strided conv's extent of 1 below H 3): the range a
        # drafter takes ({dim: (min, max)}, as torch.export's own suggestions)
        err.suggested_ranges = {}
        for x in (x for x in dims if failing[x]):
            top = max(failing[x]) + 1          # holds from just above its last failing size to the top
            if top <= ranges[x][1] and len(failing[x]) == top - ranges[x][0]:
                err.suggested_ranges[x] = (top, None)
        return err
    spans = ", ".join(f"{d} {ranges[d][0]}..{ranges[d][1]}" for d in dims)
    return CaptureError(f"torch.export failed: the model's graph holds only where {guards}, which is true at every "
                        f"value of the range it was exported over ({spans}), but torch.export's solver cannot "
                        f"prove it over a range (it does not reason about % and // of a dim), so it keeps no "
                        f"dynamic {', '.join(dims)}", where=f"dims.{dims[0]}", value=dims,
                        fix=f"make {', '.join(dims)} static in the recipe (min = max: one compiled model per size; pad "
                            "requests to it, with a mask the model reads), or run the model with exe_mode: eager")


def _values(vs: list[int]) -> str:
    """`3, 5..9, 12` for sorted integers, the first runs only."""
    runs: list[list[int]] = []
    for v in vs:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    text = ", ".join(str(a) if a == b else f"{a}..{b}" for a, b in runs[:4])
    return text + (", ..." if len(runs) > 4 else "")


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
        ast.Mod: operator.mod, ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt,
        ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge}


@functools.lru_cache(maxsize=64)
def _parsed(expr: str) -> ast.AST | None:
    try:
        return ast.parse(expr, mode="eval").body
    except SyntaxError:
        return None


def _evaluate(expr: str, env: dict[str, int]) -> bool | None:
    """A guard torch.export prints (integer arithmetic, comparisons, and/or) at one value of its
    dims: True/False, False where it divides by zero, None for anything else it holds."""
    tree = _parsed(expr)
    if tree is None:
        return None

    def ev(n: ast.AST) -> Any:
        if isinstance(n, ast.Constant) and isinstance(n.value, int):
            return n.value
        if isinstance(n, ast.Name) and n.id in env:
            return env[n.id]
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, (ast.USub, ast.Not)):
            v = ev(n.operand)
            return -v if isinstance(n.op, ast.USub) else not v
        if isinstance(n, ast.BinOp) and type(n.op) in _OPS:
            return _OPS[type(n.op)](ev(n.left), ev(n.right))
        if isinstance(n, ast.Compare) and all(type(o) in _OPS for o in n.ops):
            left, ok = ev(n.left), True
            for o, c in zip(n.ops, n.comparators):
                right = ev(c)
                ok, left = ok and _OPS[type(o)](left, right), right
            return ok
        if isinstance(n, ast.BoolOp):
            vals = [ev(v) for v in n.values]
            return all(vals) if isinstance(n.op, ast.And) else any(vals)
        raise ValueError(ast.dump(n))
    try:
        return bool(ev(tree))
    except ZeroDivisionError:
        return False
    except (ValueError, TypeError, RecursionError):
        return None


def _recurrent(module: Any) -> str | None:
    """Why a sequence dim stays static when the model runs nn.LSTM/GRU/RNN: torch.export
    specializes their one fused ATen op (the recurrence) on the sequence length."""
    rnn = next((m for m in module.modules() if isinstance(m, torch.nn.RNNBase)), None) \
        if isinstance(module, torch.nn.Module) else None
    return None if rnn is None else (f"its nn.{type(rnn).__name__} runs the recurrence as one ATen op, which "
                                     "torch.export specializes on the sequence length")


def export_failure(e: BaseException, fix: str, where: str | None = None, module: Any = None,
                   ranges: Any = None) -> CaptureError:
    """The CaptureError for torch.export's exception `e`: its first line, or for a branch on a
    tensor's value the model line that branches (with `fix` replaced by what to change there).
    `module`: the model exported, where known (its recurrent layers say why a dim stayed static);
    `ranges`: the dims' (min, max) it was exported over (a guard is checked on them)."""
    text = str(e).strip()
    first = text.splitlines()[0] if text else ""
    name = type(e).__name__
    call = _CALL.search(text)
    if "Constraints violated" in first and ("Suggested fixes:" in text or _excluded_ends(text)):
        suggested = text.partition("Suggested fixes:")[2] + "\n" + _excluded_ends(text)
        narrowed = _constraint_fixes(suggested)
        violated = re.search(r"Constraints violated \(([^)]*)\)", first)
        named = [d.strip() for d in violated.group(1).split(",")] if violated else []
        if any(n.split()[0] in named for n in narrowed) and any(" static (" in n for n in narrowed):
            # a dim kept static only beside the one torch.export names (graphmode's capture range of batch,
            # 1..2, exported as 2): the model's need is the named one
            narrowed = [n for n in narrowed if n.split()[0] in named or " static (" not in n]
        if narrowed:
            static = any("static (torch.export keeps it" in n for n in narrowed)
            why = (static and _recurrent(module)) or (
                "torch.export specialises the model's code on that size, e.g. torch.linspace(..., steps=T) or a "
                "Python number computed from it" if static else
                "elsewhere the model takes another path, e.g. a slice shorter than it asks for")
            err = CaptureError(f"torch.export failed: one graph of this model holds for part of the recipe's "
                               f"dims only, {'; '.join(narrowed)} ({why}; torch.export: {first})",
                               where=f"dims.{narrowed[0].split()[0]}",
                               fix=_narrow_fix(suggested, narrowed))
            # the ranges themselves, for a drafter that can take them ({dim: (min, max)}, None: not said)
            derived = _derived(suggested)
            err.suggested_ranges = {d: (int(lo) if lo else None, int(hi) if hi else None)
                                    for d, lo, hi in _RANGE_FIX.findall(suggested) if d not in derived}
            # a dim torch.export keeps only as a multiple (its solver gave up on a floor guard over the
            # range): the range it spans, for a drafter that may try a shorter one
            err.derived_ranges = {derived[b][0]: (derived[b][1] * int(lo) + derived[b][2],
                                                  derived[b][1] * int(hi) + derived[b][2])
                                  for b, lo, hi in _RANGE_FIX.findall(suggested) if b in derived and lo and hi}
            return err
    unmet = _unmet_guards(text) if "Constraints violated" in first else []
    if unmet:
        dims = sorted({d for d, _ in unmet})
        held = _guards_hold(unmet, ranges or {})
        if held is not None:
            return held
        return CaptureError(f"torch.export failed: the model's graph holds only where "
                            f"{'; '.join(g for _, g in unmet)}, which torch.export cannot prove "
                            f"for every value of the recipe's range ({first})", where=where or f"dims.{dims[0]}",
                            value=dims, fix=f"make {', '.join(dims)} static in the recipe (min = max, or the model's "
                                            "example size), or a range on which the condition always holds")
    frame = (call.group(1), int(call.group(2)), call.group(3)) if call is not None else _model_frame(e)
    line_src = linecache.getline(frame[0], frame[1]) if frame is not None else ""
    if "packed_sequence" in line_src or "pack_padded_sequence" in line_src or \
            {"pack_padded_sequence", "pad_packed_sequence"} & _frame_names(e):
        at = f" at {shown_path(frame[0])}:{frame[1]} in {frame[2]}" if frame is not None else ""
        return CaptureError(f"torch.export failed: the model packs variable-length sequences (nn.utils.rnn."
                            f"pack_padded_sequence){at}, whose per-step batch sizes come from the lengths' values, "
                            f"which torch.export cannot trace ({name}: {first})", where=where,
                            fix="run the recurrent layer on the padded batch and take each sequence's outputs at "
                                "its length (a mask or a gather), or run the model with exe_mode: eager")
    split = _SPLIT_RESHAPE.search(first)
    if split is not None:
        k = split.group(1)
        at = f" at {shown_path(frame[0])}:{frame[1]} in {frame[2]}" if frame is not None else ""
        return CaptureError(f"torch.export failed: the model reshapes a dynamic dim into pieces of {k}{at} ({name}: "
                            f"{first}): one graph holds only where that dim is a multiple of {k}, which torch.export "
                            f"cannot prove over a range, and a recipe's dim takes every size in [min, max] (its step "
                            f"spaces the buckets, not the sizes requests bring)", where=where,
                            fix=f"give that dim one size per compile (a multiple of {k}: dims.<dim>: N, a number, "
                                f"a recipe per size you serve), pad it to a multiple of {k} before the model, or run "
                                "the model with exe_mode: eager")
    for needle, why, cause_fix in _KNOWN_CAUSES:
        if needle in text:
            at = f" at {shown_path(frame[0])}:{frame[1]} in {frame[2]}" if frame is not None else ""
            return CaptureError(f"torch.export failed: {why}{at} ({name}: {first})", where=where, fix=cause_fix)
    if not (name in _DATA_DEPENDENT or "data-dependent" in first) or frame is None:
        at = f" (at {shown_path(frame[0])}:{frame[1]} in {frame[2]})" if frame is not None else ""
        return CaptureError(f"torch.export failed: {name}: {first}{at}", where=where, fix=fix)
    path, line, fn = frame
    src = linecache.getline(path, line).strip()
    at = f"{shown_path(path)}:{line} in {fn}" + (f": `{src}`" if src else "")
    reads = re.search(r"\b(int|float|bool)\(|\.item\(\)|\.tolist\(\)", src)
    msg = (f"torch.export failed: the model reads the value of a tensor as a Python number at {at} (a size or "
           f"branch that depends on the data; torch.export: {first})" if reads else
           f"torch.export failed: the model branches on the value of a tensor at {at} (data-dependent control "
           f"flow; torch.export: {first})")
    if _ROPE.search(fn) or "rope" in path.rsplit(os.sep, 1)[-1]:
        return CaptureError(msg + ". " + ROPE_WHY, where=where or "model.config.rope_scaling", fix=ROPE_FIX)
    if "_detect_is_causal_mask" in _frame_names(e):
        return CaptureError(msg + ". nn.Transformer's layers compare a mask given without is_causal with a causal "
                            "mask, value by value, to detect one", where=where,
                            fix="say it in the call: tgt_is_causal=True (nn.Transformer, TransformerDecoder) or "
                                "is_causal=True (TransformerEncoder) with a causal mask, False with another")
    return CaptureError(msg, where=where,
                        fix=("keep it a tensor (a mask, torch.where, or a slice of a fixed size), or run the model "
                             "with exe_mode: eager") if reads else
                        "write that branch without reading tensor values (both paths, picked with "
                        "torch.where), or run the model with exe_mode: eager")


def _frame_names(e: BaseException) -> set[str]:
    """The functions `e`'s traceback passed through (torch's own included)."""
    names, tb = set(), e.__traceback__
    while tb is not None:
        names.add(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    return names


def _model_frame(e: BaseException) -> tuple[str, int, str] | None:
    """(file, line, function) of the innermost traceback frame in the model's code, not torch's or
    graphmode's (a branch on a size only the data decides is raised from inside torch, whose
    message names torch's module call)."""
    import torch
    skip = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(os.path.dirname(__file__)) + os.sep)
    found, tb = None, e.__traceback__
    while tb is not None:
        path = os.path.abspath(tb.tb_frame.f_code.co_filename)
        if not path.startswith(skip) and not path.startswith("<"):
            found = (path, tb.tb_lineno, tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    return found


__all__ = ["export_failure", "quiet_export_logs", "EXPORT_LOCK", "shown_path", "ROPE_WHY", "ROPE_FIX"]
