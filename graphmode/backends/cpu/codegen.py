"""C++ source for fused groups: one loop nest per group, shapes baked in as constants.

A plan runs each group on contiguous row-major buffers whose shapes are fixed per bucket,
so every size and stride is a compile-time constant: gcc can then collapse and vectorise
the innermost loop without runtime checks. Three generators:

- elementwise bodies: one loop nest per distinct output shape; each input indexed with its
  own broadcast strides (0 on broadcast dims); dims that are contiguous for every operand
  are merged; the outer "tile" loop gets `omp parallel for` when the work is large enough.
- reduction/norm bodies (exactly one softmax, log_softmax, layer_norm, sum, mean, amax or
  amin over the last dim): a row kernel; elementwise prologue ops are computed inside the
  first pass over the row, epilogue ops inside the last.
- gemm_epilogue bodies: only the ops after the GEMM, as an elementwise (or row) kernel that
  reads the GEMM output buffer (which may be the output buffer itself).

Anything else raises `BackendError` naming the op, and the executor runs the reference ops.
The generated text contains no value names, so identical groups (the same op chain in
every layer) produce the same symbol and are compiled once.
"""
from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

import torch

from graphmode.errors import BackendError
from graphmode.ir.graph import Node
from graphmode.ir.ops import OPS, _result_dtype, norm_axis
from graphmode.ir.types import ITEMSIZE, TensorType

PRELUDE = (Path(__file__).parent / "templates" / "prelude.h").read_text()
# defined once per shared library (the prelude only declares them)
PRELUDE_DEFS = """__attribute__((visibility("hidden"))) int gm_threads = 0;
GM_EXPORT void gm_set_threads(int n) { gm_threads = n < 0 ? 0 : n; }
GM_EXPORT int gm_get_threads(void) { return gm_nt(); }
"""

PAR_THRESHOLD = 1 << 17     # work units (elements x OpSpec.flops_per_elem, ~0.05 ns each here) below which
                            # a nest runs serially: an OpenMP fork/join costs a few microseconds
TARGET_TILES = 16           # tiles per parallel nest: enough to balance up to ~8 threads
MIN_BLOCK = 512             # never split a row into blocks smaller than this
STACK_BUF_BYTES = 32 << 10  # row buffers up to this size live on the stack
MAX_EMBED = 1 << 16         # body constants up to this many elements are embedded in the source

GEMM_OPS = ("linear", "matmul", "conv2d")
ROW_REDUCTIONS = ("softmax", "log_softmax", "layer_norm", "sum", "mean", "amax", "amin")

_CTYPE = {"f32": "float", "f64": "double", "i64": "int64_t", "i32": "int32_t", "i16": "int16_t",
          "i8": "int8_t", "u8": "uint8_t", "bool": "bool"}
_STYPE = dict(_CTYPE, bool="uint8_t")   # how a dtype is stored in memory
_FLOATS = ("f32", "f64")
_INTS = ("i64", "i32", "i16", "i8", "u8")

_FLOAT_UNARY = ("exp", "log", "sqrt", "rsqrt", "reciprocal", "tanh", "sigmoid", "erf", "sin", "cos",
                "silu", "gelu")
_OTHER_UNARY = ("neg", "abs", "relu", "logical_not", "identity", "clamp", "cast")
_ARITH = ("add", "sub", "mul", "div", "pow", "maximum", "minimum")
_CMP = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}
_LOGIC = {"logical_and": "&", "logical_or": "|"}
ELEMENTWISE_OPS = frozenset(_FLOAT_UNARY + _OTHER_UNARY + _ARITH + tuple(_CMP) + tuple(_LOGIC) + ("where",))

_MATH = {  # name -> (f32 function, f64 function)
    "exp": ("gm_expf", "__builtin_exp"), "log": ("__builtin_logf", "__builtin_log"),
    "sqrt": ("__builtin_sqrtf", "__builtin_sqrt"), "tanh": ("gm_tanhf", "__builtin_tanh"),
    "erf": ("gm_erff", "__builtin_erf"), "sin": ("__builtin_sinf", "__builtin_sin"),
    "cos": ("__builtin_cosf", "__builtin_cos"), "sigmoid": ("gm_sigmoidf", "gm_sigmoid"),
    "pow": ("__builtin_powf", "__builtin_pow"), "fabs": ("__builtin_fabsf", "__builtin_fabs"),
    "max": ("gm_maxf", "gm_max"), "min": ("gm_minf", "gm_min"),
}


@dataclass(frozen=True)
class KernelSource:
    """One generated kernel: `extern "C" void symbol(void* arg0, ...)` over `args` (inputs then
    outputs, each a contiguous row-major buffer of `types[name]`), plus `symbol_packed(void**)`.

    `source` is the kernel's own text; `translation_unit()` prepends the shared prelude.
    `may_alias[out]` lists the inputs whose buffer `out` may share (every element is read
    before it is written, and never read again). For gemm_epilogue groups `gemm` is the GEMM
    node the executor runs first, into the buffer of `inputs[0]`. `folded` lists inputs whose
    value was inlined from `constants` (they are not arguments).
    """

    symbol: str
    source: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    types: Mapping[str, TensorType]
    kind: str                                  # elementwise | rowwise | gemm | winograd | im2col | native
    may_alias: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    parallel: bool = False
    gemm: Node | None = None
    folded: tuple[str, ...] = ()
    pattern: str = ""
    status: str = ""   # set: the library exports `symbol_status()` (invalid input elements since the
                       # last call, then reset); a bound step raises this message when it is non-zero

    @property
    def args(self) -> tuple[str, ...]:
        return self.inputs + self.outputs

    @property
    def packed_symbol(self) -> str:
        return self.symbol + "_packed"

    def translation_unit(self) -> str:
        return translation_unit([self])


def translation_unit(sources: Iterable[KernelSource], *, defs: bool = True) -> str:
    """One C++ file holding the prelude and every distinct kernel (deduplicated by symbol)."""
    seen: dict[str, str] = {}
    for s in sources:
        seen.setdefault(s.symbol, s.source)
    head = PRELUDE + (PRELUDE_DEFS if defs else "")
    return head + "\n" + "\n".join(seen[k] for k in sorted(seen))


# ------------------------------------------------------------------------------ analysis

def _err(msg: str, where: str, fix: str | None = None, value=None) -> BackendError:
    return BackendError(msg, where=where, value=value,
                        fix=fix or "the executor runs this group with the reference ops")


@dataclass
class _Body:
    """A region to generate: nodes over named values with concrete types."""

    where: str
    inputs: list[str]                    # candidate argument inputs, in argument order
    outputs: list[str]
    nodes: list[Node]
    vt: dict[str, TensorType]
    known: dict[str, float | int | bool]  # numel-1 values with a known value (inlined)
    arrays: dict[str, torch.Tensor]       # body constants embedded as static arrays
    producers: dict[str, Node] = field(default_factory=dict)

    def __post_init__(self):
        self.producers = {o: n for n in self.nodes for o in n.outputs}


def _scalar_of(t: torch.Tensor):
    v = t.detach().reshape(-1)[0].item()
    return bool(v) if t.dtype == torch.bool else v


def split_gemm_epilogue(node: Node) -> tuple[Node, list[Node]]:
    """The GEMM that opens a gemm_epilogue group and the elementwise ops after it."""
    where = f"fused group -> %{node.outputs[0]}" if node.outputs else "fused group"
    if node.body is None or not node.body.nodes:
        raise _err("gemm_epilogue group has no body", where)
    first = node.body.nodes[0]
    if first.op not in GEMM_OPS:
        raise _err(f"gemm_epilogue group starts with {first.op!r}, not one of {', '.join(GEMM_OPS)}",
                   where, fix="the fusion pass must put the GEMM first")
    rest = list(node.body.nodes[1:])
    for n in rest:
        if n.op in GEMM_OPS or OPS.get(n.op) is not None and OPS[n.op].kind in ("gemm", "conv"):
            raise _err(f"a second GEMM ({n.op}) in a gemm_epilogue group", where)
    return first, rest


def _concrete_types(node: Node, types: Mapping[str, TensorType], where: str) -> dict[str, TensorType]:
    body = node.body
    vt: dict[str, TensorType] = {}
    for name in body.inputs:
        t = types.get(name) or body.values[name].type
        if not t.is_static:
            raise _err(f"input %{name} has no concrete shape ({t.text()})", where,
                       fix="pass `types` specialised to the bucket")
        vt[name] = t
    for name, tensor in body.constants.items():
        vt[name] = TensorType.of(tensor)
    for n in body.nodes:
        if n.op == "fused" or n.body is not None:
            raise _err("nested fused group", where, value=n.op)
        spec = OPS.get(n.op)
        if spec is None:
            raise _err(f"unknown op {n.op!r}", where)
        try:
            inferred = spec.infer([vt[i] for i in n.inputs], n.attrs)
        except KeyError as e:
            raise _err(f"op {n.op} reads undefined value %{e.args[0]}", where) from None
        except Exception as e:  # noqa: BLE001 - shape inference of an op we do not generate
            raise _err(f"cannot infer the type of {n.op} -> %{n.outputs[0]}: {e}", where, value=n.op) from None
        for o, t in zip(n.outputs, inferred):
            given = types.get(o)
            dtype = given.dtype if given is not None else (
                body.values[o].type.dtype if o in body.values else t.dtype)
            if given is not None and given.is_static and tuple(given.shape) != tuple(t.shape):
                raise _err(f"%{o} has shape {list(given.shape)} in `types` but {list(t.shape)} by inference",
                           where, fix="pass types of the same bucket for every value")
            vt[o] = TensorType(dtype, t.shape)
    for o in node.outputs:
        if o in types and o in vt:
            vt[o] = TensorType(types[o].dtype, vt[o].shape)
    return vt


def same_footprint(a: TensorType, b: TensorType) -> bool:
    """An output may take over an input's buffer only if shape and element size agree."""
    return tuple(a.shape) == tuple(b.shape) and ITEMSIZE[a.dtype] == ITEMSIZE[b.dtype]


def generate(node: Node, types: Mapping[str, TensorType], *,
             constants: Mapping[str, torch.Tensor] | None = None) -> KernelSource:
    """C++ for one fused group at concrete shapes.

    `types` gives concrete types for the group's inputs (and may give any other value's);
    `constants` may give the data of constant inputs: those with one element are inlined as
    literals (so `pow(x, 3)` becomes `x*x*x`) and dropped from the arguments.
    """
    where = f"fused group -> %{node.outputs[0]}" if node.outputs else "fused group"
    if node.op != "fused" or node.body is None:
        raise _err(f"expected a fused node, got {node.op!r}", where, value=node.op)
    kind = node.attrs.get("kind", "elementwise")
    if kind == "attention":
        raise _err("attention groups are not generated (sdpa runs with ATen)", where, value=kind)
    vt = _concrete_types(node, types, where)
    constants = constants or {}
    known: dict[str, float | int | bool] = {}
    arrays: dict[str, torch.Tensor] = {}
    for name, t in node.body.constants.items():
        if t.numel() == 1:
            known[name] = _scalar_of(t)
        elif t.numel() <= MAX_EMBED:
            arrays[name] = t.detach().contiguous().cpu()
        else:
            raise _err(f"body constant %{name} has {t.numel()} elements (> {MAX_EMBED})", where,
                       fix="make it an input of the fused node")
    for name in node.inputs:
        t = constants.get(name)
        if t is not None and t.numel() == 1:
            known[name] = _scalar_of(t)

    gemm = None
    if kind == "gemm_epilogue":
        gemm, nodes = split_gemm_epilogue(node)
        g_out = gemm.outputs[0]
        if not nodes:
            raise _err("gemm_epilogue group has no epilogue ops", where,
                       fix="run the GEMM alone (nothing to generate)")
        inputs = [g_out] + [i for i in node.inputs]
        outputs = [o for o in node.outputs if o != g_out]
        if not outputs:
            raise _err("the epilogue produces no output of the group", where)
    else:
        nodes = list(node.body.nodes)
        inputs = list(node.inputs)
        outputs = list(node.outputs)
    for o in outputs:
        if o in inputs:
            raise _err(f"output %{o} is also an input of the group", where)
    body = _Body(where, inputs, outputs, nodes, vt, known, arrays)
    _check_ops(body)
    reds = [n for n in _needed_nodes(body, outputs) if n.op in ROW_REDUCTIONS]
    if not reds:
        ks = _ElementwiseGen(body).run()
    elif len(reds) == 1:
        ks = _RowGen(body, reds[0]).run()
    else:
        raise _err(f"{len(reds)} reductions in one group ({', '.join(n.op for n in reds)})", where,
                   value=reds[1].op, fix="split the group: one reduction per row kernel")
    if gemm is not None and gemm.outputs[0] in node.outputs:   # the GEMM result is kept: never overwrite it
        ks.may_alias = {o: tuple(i for i in v if i != gemm.outputs[0]) for o, v in ks.may_alias.items()}
    return _finish(ks, gemm, tuple(n for n in node.inputs if n in known),
                   node.attrs.get("pattern", "") or kind)


def _check_ops(body: _Body) -> None:
    for n in body.nodes:
        if n.op in ELEMENTWISE_OPS or n.op in ROW_REDUCTIONS:
            continue
        spec = OPS.get(n.op)
        kind = spec.kind if spec else "unknown"
        raise _err(f"op {n.op!r} ({kind}) is not supported by the CPU code generator", body.where,
                   value=n.op)
    for name in set(body.inputs) | {v for n in body.nodes for v in n.inputs + n.outputs}:
        t = body.vt.get(name)
        if t is not None and t.dtype not in _CTYPE:
            raise _err(f"dtype {t.dtype} of %{name} is not supported (f32, f64, integers, bool)",
                       body.where, value=t.dtype)


def _needed_nodes(body: _Body, outs: Iterable[str]) -> list[Node]:
    need: set[str] = set()
    stack = list(outs)
    while stack:
        v = stack.pop()
        if v in need:
            continue
        need.add(v)
        n = body.producers.get(v)
        if n is not None:
            stack.extend(n.inputs)
    return [n for n in body.nodes if any(o in need for o in n.outputs)]


def _needed_leaves(body: _Body, outs: Iterable[str]) -> set[str]:
    leaves: set[str] = set()
    for n in _needed_nodes(body, outs):
        leaves.update(i for i in n.inputs if i not in body.producers)
    leaves.update(o for o in outs if o not in body.producers)
    return leaves


# ------------------------------------------------------------------------------ C++ expressions

def _lit(v, dtype: str) -> str:
    if dtype == "bool":
        return "true" if bool(v) else "false"
    if dtype in _FLOATS:
        v = float(v)
        if math.isnan(v):
            return "GM_NAN" if dtype == "f32" else "((double)GM_NAN)"
        if math.isinf(v):
            s = "GM_INF" if dtype == "f32" else "((double)GM_INF)"
            return s if v > 0 else f"(-{s})"
        if dtype == "f32":
            v = float(torch.tensor(v, dtype=torch.float32).item())
            return f"{v.hex()}f"
        return v.hex()
    v = int(v)
    if v == -(1 << 63):
        return "((int64_t)(-9223372036854775807LL - 1))"
    return f"(({_CTYPE[dtype]}){v}LL)"


@dataclass
class _Opnd:
    expr: str           # a variable name or a literal
    dtype: str
    ttype: TensorType
    value: float | int | bool | None = None   # known scalar value


def _cv(o: _Opnd, dt: str) -> str:
    if o.dtype == dt:
        return o.expr
    if o.value is not None:
        return _lit(o.value, dt)
    if dt == "bool":
        return f"({o.expr} != 0)"
    return f"(({_CTYPE[dt]}){o.expr})"


def _fn(name: str, dt: str) -> str:
    return _MATH[name][0 if dt == "f32" else 1]


def _num(v, dt: str) -> str:
    return _lit(v, dt)


def _op_expr(n: Node, ins: list[_Opnd], out_dt: str, where: str) -> str:
    op, a = n.op, n.attrs
    if op in _FLOAT_UNARY:
        if out_dt not in _FLOATS:
            raise _err(f"op {op} producing {out_dt} is not generated (float only)", where, value=op)
        x = _cv(ins[0], out_dt)
        one, half = _num(1, out_dt), _num(0.5, out_dt)
        if op in ("exp", "log", "sqrt", "tanh", "erf", "sin", "cos", "sigmoid"):
            return f"{_fn(op, out_dt)}({x})"
        if op == "rsqrt":
            return f"({one} / {_fn('sqrt', out_dt)}({x}))"
        if op == "reciprocal":
            return f"({one} / {x})"
        if op == "silu":
            return f"({x} / ({one} + {_fn('exp', out_dt)}(-{x})))"
        if op == "gelu":
            approx = a.get("approximate", "none")
            if approx == "tanh":   # torch: 0.5*x*(1+tanh(sqrt(2/pi)*(x+0.044715*x^3)))
                beta = _num(math.sqrt(2.0) * (2.0 / math.sqrt(math.pi)) * 0.5, out_dt)
                kappa = _num(0.044715, out_dt)
                return (f"(({half} * {x}) * ({one} + {_fn('tanh', out_dt)}({beta} * ({x} + {kappa} * "
                        f"({x} * {x} * {x})))))")
            if approx != "none":
                raise _err(f"gelu approximate={approx!r}", where, value=approx)
            return f"(({x} * {half}) * ({one} + {_fn('erf', out_dt)}({x} * {_num(math.sqrt(0.5), out_dt)})))"
    if op == "identity":
        return _cv(ins[0], out_dt)
    if op == "cast":
        return _cv(ins[0], out_dt)
    if op == "logical_not":
        return f"(!{_cv(ins[0], 'bool')})"
    if op == "neg":
        if out_dt == "bool":
            raise _err("neg of a bool tensor", where, value=op)
        return f"(-{_cv(ins[0], out_dt)})"
    if op == "abs":
        x = _cv(ins[0], out_dt)
        if out_dt in _FLOATS:
            return f"{_fn('fabs', out_dt)}({x})"
        return x if out_dt in ("bool", "u8") else f"({x} < 0 ? -{x} : {x})"
    if op == "relu":
        x = _cv(ins[0], out_dt)
        if out_dt == "bool":
            raise _err("relu of a bool tensor", where, value=op)
        return f"({x} < {_num(0, out_dt)} ? {_num(0, out_dt)} : {x})"
    if op == "clamp":
        lo, hi = a.get("min"), a.get("max")
        x = _cv(ins[0], out_dt)
        if out_dt == "bool":
            raise _err("clamp of a bool tensor", where, value=op)
        for b in (lo, hi):
            if b is not None and out_dt not in _FLOATS and float(b) != int(b):
                raise _err(f"clamp of an integer tensor to a fractional bound {b}", where, value=op)
        e = x
        if lo is not None:
            e = f"({e} < {_num(lo, out_dt)} ? {_num(lo, out_dt)} : {e})"
        if hi is not None:
            e = f"({e} > {_num(hi, out_dt)} ? {_num(hi, out_dt)} : {e})"
        return e
    if op in _ARITH:
        x, y = _cv(ins[0], out_dt), _cv(ins[1], out_dt)
        if op == "div" and out_dt not in _FLOATS:
            raise _err(f"div producing {out_dt}", where, value=op)
        if op in ("add", "sub", "mul", "div"):
            if out_dt == "bool" and op in ("sub", "div"):
                raise _err(f"{op} of bool tensors", where, value=op)
            sym = {"add": "+", "sub": "-", "mul": "*", "div": "/"}[op]
            if out_dt == "bool":   # torch: bool + bool = or, bool * bool = and
                return f"({x} {'|' if op == 'add' else '&'} {y})"
            return f"({x} {sym} {y})"
        if op in ("maximum", "minimum"):
            if out_dt in _FLOATS:
                return f"{_fn('max' if op == 'maximum' else 'min', out_dt)}({x}, {y})"
            cmp = ">" if op == "maximum" else "<"
            return f"({x} {cmp} {y} ? {x} : {y})"
        # pow
        if out_dt in _FLOATS:
            e = ins[1].value
            if e is not None and not isinstance(e, bool):
                e = float(e)
                one = _num(1, out_dt)
                special = {1.0: f"{x}", 2.0: f"({x} * {x})", 3.0: f"({x} * {x} * {x})",
                           4.0: f"(({x} * {x}) * ({x} * {x}))", 0.0: one,
                           0.5: f"{_fn('sqrt', out_dt)}({x})", -0.5: f"({one} / {_fn('sqrt', out_dt)}({x}))",
                           -1.0: f"({one} / {x})", -2.0: f"({one} / ({x} * {x}))"}
                if e in special:
                    return special[e]
            return f"{_fn('pow', out_dt)}({x}, {y})"
        if out_dt == "bool":
            raise _err("pow of bool tensors", where, value=op)
        return f"(({_CTYPE[out_dt]})gm_ipow((int64_t){x}, (int64_t){y}))"
    if op in _CMP:
        dt = _result_dtype([ins[0].ttype, ins[1].ttype])
        if dt not in _CTYPE:
            raise _err(f"comparison in {dt}", where, value=op)
        return f"({_cv(ins[0], dt)} {_CMP[op]} {_cv(ins[1], dt)})"
    if op in _LOGIC:
        return f"({_cv(ins[0], 'bool')} {_LOGIC[op]} {_cv(ins[1], 'bool')})"
    if op == "where":
        return f"({_cv(ins[0], 'bool')} ? {_cv(ins[1], out_dt)} : {_cv(ins[2], out_dt)})"
    raise _err(f"op {op!r} is not supported by the CPU code generator", where, value=op)


# ------------------------------------------------------------------------------ emission

class _Scope:
    """A block of statements; values emitted in it are visible to its children."""

    def __init__(self, parent: "_Scope | None", pass_id: int, in_loop: bool):
        self.parent = parent
        self.pass_id = pass_id
        self.in_loop = in_loop
        self.lines: list[str] = []
        self.memo: dict[tuple[str, str], str] = {}

    def lookup(self, key):
        s = self
        while s is not None:
            if key in s.memo:
                return s.memo[key]
            s = s.parent
        return None


@dataclass
class _Operand:
    name: str
    space: str
    ptr: str
    padded: tuple[int, ...]     # the view's shape over the domain rank
    strides: tuple[int, ...]    # element strides over the (uncollapsed) domain, 0 = broadcast
    base: str = ""


class _Gen:
    """State shared by the generators: arguments, scalars, operands, emission."""

    kind = ""

    def __init__(self, body: _Body):
        self.b = body
        self.vt = body.vt
        self.where = body.where
        self.nvar = 0
        self.arg_in: list[str] = []          # inputs read (argument order fixed at the end)
        self.scalars: dict[str, str] = {}    # numel-1 input -> local holding its value
        self.operands: dict[tuple[str, str], _Operand] = {}
        self.reads: dict[str, set[tuple[int, tuple[int, ...]]]] = {}  # input -> {(pass, view)}
        self.arrays: dict[str, str] = {}     # embedded constant -> static array name
        self.domain: tuple[int, ...] = ()

    def fresh(self, prefix: str = "t") -> str:
        self.nvar += 1
        return f"{prefix}{self.nvar}"

    # ---- views and operands -------------------------------------------------------------
    def padded(self, name: str, space: str) -> tuple[int, ...]:
        shape = tuple(int(d) for d in self.vt[name].shape)
        r = len(self.domain)
        if space == "l":   # a value reduced away (keepdim=False): aligned with the leading dims
            k = r - 1
            if len(shape) > k:
                raise _err(f"%{name} ({list(shape)}) is combined with a value reduced over the last dim",
                           self.where, fix="use keepdim=True for the reduction")
            return (1,) * (k - len(shape)) + shape + (1,)
        if len(shape) > r:
            raise _err(f"%{name} ({list(shape)}) is larger than the kernel domain {list(self.domain)}",
                       self.where)
        return (1,) * (r - len(shape)) + shape

    def strides(self, padded: tuple[int, ...], name: str) -> tuple[int, ...]:
        out = [0] * len(padded)
        acc = 1
        for d in range(len(padded) - 1, -1, -1):
            if padded[d] == self.domain[d]:
                out[d] = acc if padded[d] != 1 else 0
            elif padded[d] == 1:
                out[d] = 0
            else:
                raise _err(f"%{name} ({list(padded)}) does not broadcast to {list(self.domain)}", self.where)
            acc *= padded[d]
        return tuple(out)

    def is_scalar(self, name: str) -> bool:
        return math.prod(int(d) for d in self.vt[name].shape) == 1

    def operand(self, name: str, space: str) -> _Operand:
        key = (name, space)
        op = self.operands.get(key)
        if op is None:
            padded = self.padded(name, space)
            if name in self.b.arrays:
                ptr = self.array_ptr(name)
            else:
                ptr = self.arg_ptr(name)
            op = _Operand(name, space, ptr, padded, self.strides(padded, name))
            op.base = f"b{len(self.operands)}"
            self.operands[key] = op
        return op

    def arg_ptr(self, name: str) -> str:
        if name in self.b.outputs:
            return f"o{self.b.outputs.index(name)}"
        if name not in self.arg_in:
            self.arg_in.append(name)
        return f"@A{self.arg_in.index(name)}@"   # renamed to a positional pointer in _assemble

    def array_ptr(self, name: str) -> str:
        if name not in self.arrays:
            self.arrays[name] = f"@SYM@_c{len(self.arrays)}"
        return self.arrays[name]

    def record(self, name: str, pass_id: int, view: tuple[int, ...]) -> None:
        if name in self.b.inputs:
            self.reads.setdefault(name, set()).add((pass_id, view))

    # ---- values -----------------------------------------------------------------------
    def space_of(self, name: str) -> str:
        return "row"

    def load(self, name: str, space: str, scope: _Scope) -> str:
        """A local holding input `name` at the scope's position."""
        dt = self.vt[name].dtype
        if name in self.b.known:
            return _lit(self.b.known[name], dt)
        if self.is_scalar(name) and name not in self.b.arrays:
            if name not in self.scalars:
                self.arg_ptr(name)
                self.scalars[name] = f"s{len(self.scalars)}"
            self.record(name, -1, self.padded(name, space))
            return self.scalars[name]
        op = self.operand(name, space)
        self.record(name, scope.pass_id, op.padded)
        if scope.in_loop and self.last_stride(op):
            idx = f"{op.base} + j"
        else:
            if self.last_stride(op):
                raise _err(f"internal: %{name} varies along the row but is needed once per row", self.where)
            idx = op.base
        var = self.fresh("l")
        raw = f"{op.ptr}[{idx}]"
        expr = f"({raw} != 0)" if dt == "bool" else raw
        scope.lines.append(f"const {_CTYPE[dt]} {var} = {expr};")
        return var

    def last_stride(self, op: _Operand) -> int:
        return op.strides[-1] if op.strides else 0

    def val(self, name: str, scope: _Scope, space: str = "row") -> _Opnd:
        t = self.vt[name]
        if name in self.b.known:
            return _Opnd(_lit(self.b.known[name], t.dtype), t.dtype, t, self.b.known[name])
        n = self.b.producers.get(name)
        key = (name, space if n is None else self.space_of(name))
        hit = scope.lookup(key)
        if hit is not None:
            return _Opnd(hit, t.dtype, t)
        if n is None:
            var = self.load(name, key[1], scope)
        else:
            var = self.emit_node(n, scope)
        scope.memo[key] = var
        return _Opnd(var, t.dtype, t)

    def emit_node(self, n: Node, scope: _Scope) -> str:
        out = n.outputs[0]
        sp = self.space_of(out)
        ins = [self.val(i, scope, sp) for i in n.inputs]
        dt = self.vt[out].dtype
        expr = _op_expr(n, ins, dt, self.where)
        var = self.fresh()
        scope.lines.append(f"const {_CTYPE[dt]} {var} = ({_CTYPE[dt]}){expr};")
        return var

    def store(self, name: str, var: str, scope: _Scope) -> str:
        op = self.operand(name, self.space_of(name))
        idx = f"{op.base} + j" if scope.in_loop and self.last_stride(op) else op.base
        return f"{op.ptr}[{idx}] = ({_STYPE[self.vt[name].dtype]}){var};"

    # ---- assembly -----------------------------------------------------------------------
    def _assemble(self, body_text: str, inputs: list[str], outputs: list[str]) -> str:
        ptrs = []
        args = inputs + outputs
        for k, name in enumerate(args):
            st = _STYPE[self.vt[name].dtype]
            if k < len(inputs):
                ptrs.append(f"  const {st}* i{k} = (const {st}*)p{k};")
            else:
                ptrs.append(f"  {st}* o{k - len(inputs)} = ({st}*)p{k};")
        scal = []
        for name, var in self.scalars.items():
            k = inputs.index(name)
            dt = self.vt[name].dtype
            raw = f"i{k}[0]"
            scal.append(f"  const {_CTYPE[dt]} {var} = {'(' + raw + ' != 0)' if dt == 'bool' else raw};")
        body_text = re.sub(r"@A(\d+)@", lambda m: f"i{inputs.index(self.arg_in[int(m[1])])}", body_text)
        params = ", ".join(f"void* p{k}" for k in range(len(args)))
        arrays = []
        for name, sym in self.arrays.items():
            t = self.b.arrays[name]
            dt = self.vt[name].dtype
            vals = t.reshape(-1).tolist()
            data = ", ".join(_lit(v, dt) for v in vals)
            arrays.append(f"static const {_STYPE[dt]} {sym}[{len(vals)}] = {{{data}}};")
        unused = "".join(f"  (void)i{k};\n" for k, n in enumerate(inputs) if n in self.scalars)
        call = ", ".join(f"p[{k}]" for k in range(len(args)))
        return ("\n".join(arrays) + ("\n" if arrays else "")
                + f"GM_EXPORT void @SYM@({params}) {{\n" + "\n".join(ptrs + scal) + "\n" + unused
                + body_text + "}\n"
                + f"GM_EXPORT void @SYM@_packed(void** p) {{ @SYM@({call}); }}\n")


def _indent(lines: Sequence[str], n: int) -> list[str]:
    pad = " " * n
    return [pad + ln for ln in lines]


def _collapse(domain: Sequence[int], strides: list[Sequence[int]]) -> tuple[list[int], list[list[int]]]:
    """Drop size-1 dims and merge neighbours that are contiguous for every operand."""
    keep = [d for d in range(len(domain)) if domain[d] != 1]
    dims: list[int] = []
    st: list[list[int]] = [[] for _ in strides]
    for d in keep:
        if dims and all(s[-1] == sv[d] * domain[d] for s, sv in zip(st, strides)):
            dims[-1] *= domain[d]
            for s, sv in zip(st, strides):
                s[-1] = sv[d]
            continue
        dims.append(domain[d])
        for s, sv in zip(st, strides):
            s.append(sv[d])
    return dims, st


def _row_decomp(dims: Sequence[int], row: str, indent: int) -> tuple[list[str], list[str]]:
    """Statements splitting `row` into one index per dim (row-major)."""
    if not dims:
        return [], []
    if len(dims) == 1:
        return [], [row]
    lines = [f"int64_t q = {row};"]
    names = [f"d{d}" for d in range(len(dims))]
    for d in range(len(dims) - 1, 0, -1):
        lines.append(f"const int64_t {names[d]} = q % {dims[d]}; q /= {dims[d]};")
    lines.append(f"const int64_t {names[0]} = q;")
    return _indent(lines, indent), names


def _base_expr(idx: Sequence[str], strides: Sequence[int]) -> str:
    terms = [f"{i} * {s}" if s != 1 else i for i, s in zip(idx, strides) if s != 0]
    return " + ".join(terms) if terms else "0"


def _cost(nodes: Iterable[Node]) -> float:
    return max(1.0, sum(OPS[n.op].flops_per_elem for n in nodes))


# ------------------------------------------------------------------------------ elementwise

class _ElementwiseGen(_Gen):
    kind = "elementwise"

    def run(self) -> "_Partial":
        groups: dict[tuple[int, ...], list[str]] = {}
        for o in self.b.outputs:
            groups.setdefault(tuple(int(d) for d in self.vt[o].shape), []).append(o)
        text: list[str] = []
        parallel = False
        nest_reads: list[set[str]] = []
        writes: dict[str, int] = {}
        for k, (shape, outs) in enumerate(groups.items()):
            lines, par, reads = self.nest(shape, outs, k)
            text += lines
            parallel |= par
            nest_reads.append(reads)
            for o in outs:
                writes[o] = k
        inputs = [i for i in self.b.inputs if i in self.arg_in]
        may_alias: dict[str, tuple[str, ...]] = {}
        for o, k in writes.items():
            ok = []
            for i in inputs:
                if not same_footprint(self.vt[i], self.vt[o]):
                    continue
                if any(i in nest_reads[m] for m in range(k + 1, len(nest_reads))):
                    continue
                ok.append(i)
            may_alias[o] = tuple(ok)
        src = self._assemble("".join(text), inputs, list(self.b.outputs))
        return _Partial(src, tuple(inputs), tuple(self.b.outputs), dict(self.vt), self.kind, may_alias, parallel)

    def nest(self, shape: tuple[int, ...], outs: list[str], k: int) -> tuple[list[str], bool, set[str]]:
        self.domain = shape if shape else (1,)
        self.operands = {}
        if math.prod(self.domain) == 0:
            return [], False, set()
        nodes = _needed_nodes(self.b, outs)
        leaves = sorted(_needed_leaves(self.b, outs) - set(self.b.known),
                        key=lambda n: (self.b.inputs + list(self.b.arrays)).index(n))
        vector_leaves = [n for n in leaves if not self.is_scalar(n) or n in self.b.arrays]
        ops = [self.operand(n, "row") for n in vector_leaves] + [self.operand(o, "row") for o in outs]
        dims, st = _collapse(self.domain, [o.strides for o in ops])
        if not dims:
            dims, st = [1], [[0] for _ in ops]
        for o, s in zip(ops, st):
            o.strides = tuple(s)
        inner = dims[-1]
        lead = dims[:-1]
        rows = math.prod(lead)
        work = math.prod(self.domain) * _cost(nodes)
        parallel = work >= PAR_THRESHOLD and math.prod(dims) > 1
        nblk = 1
        if parallel and rows < TARGET_TILES:
            nblk = max(1, min(-(-TARGET_TILES // rows), inner // MIN_BLOCK))
        block = -(-inner // nblk)
        block = -(-block // 16) * 16
        nblk = -(-inner // block)
        tiles = rows * nblk
        parallel = parallel and tiles > 1

        loop = _Scope(None, k, True)
        for o in outs:
            self.val(o, loop)
        stores = [self.store(o, loop.lookup((o, "row")), loop) for o in outs]
        reads = {name for (name, _sp) in self.operands if name in self.b.inputs} | \
                {n for n in self.scalars}
        for n in leaves:
            if n in self.scalars:
                self.record(n, -1, self.padded(n, "row"))

        lines = ["  {"]
        if parallel:
            lines.append("    #pragma omp parallel for num_threads(gm_nt()) schedule(static)")
        lines.append(f"    for (int64_t tile = 0; tile < {tiles}; ++tile) {{")
        row = "tile" if nblk == 1 else f"(tile / {nblk})"
        dec, idx = _row_decomp(lead, row, 6)
        lines += dec
        for o in ops:
            lines.append(f"      const int64_t {o.base} = {_base_expr(idx, o.strides[:-1])};")
        if nblk == 1:
            lo, hi = "0", str(inner)
        else:
            lines.append(f"      const int64_t j0 = (tile % {nblk}) * {block};")
            lines.append(f"      const int64_t j1 = j0 + {block} < {inner} ? j0 + {block} : {inner};")
            lo, hi = "j0", "j1"
        lines.append("      #pragma omp simd")
        lines.append(f"      for (int64_t j = {lo}; j < {hi}; ++j) {{")
        lines += _indent(loop.lines + stores, 8)
        lines += ["      }", "    }", "  }", ""]
        return [ln + "\n" for ln in lines], parallel, reads


# ------------------------------------------------------------------------------ row kernels

class _RowGen(_Gen):
    """softmax / log_softmax / layer_norm / sum / mean / amax / amin over the last dim, with
    elementwise prologue (values not downstream of the reduction) and epilogue ops."""

    kind = "rowwise"
    PRE, PASS_A, PASS_B, POST, PASS_C = 0, 1, 2, 3, 4

    def __init__(self, body: _Body, red: Node):
        super().__init__(body)
        self.red = red
        self.X = red.inputs[0]
        self.R = red.outputs[0]
        xt = self.vt[self.X]
        if xt.rank == 0:
            raise _err(f"{red.op} of a 0-d value", self.where, value=red.op)
        r = xt.rank
        op, a = red.op, red.attrs
        if op in ("softmax", "log_softmax"):
            ok = norm_axis(a["dim"], r) == r - 1
            self.keepdim = True
        elif op == "layer_norm":
            ok = a.get("normalized_rank", 1) == 1
            self.keepdim = True
        else:
            dims = sorted({norm_axis(d, r) for d in a.get("dims", range(r))})
            ok = dims == [r - 1]
            self.keepdim = bool(a.get("keepdim", False))
        if not ok:
            raise _err(f"{op} over {dict(a)} is not over the last dim only", self.where, value=op,
                       fix="row kernels reduce the last dim; other axes run with the reference ops")
        self.acc_dt = xt.dtype
        if op in ("softmax", "log_softmax", "layer_norm", "mean") and xt.dtype not in _FLOATS:
            raise _err(f"{op} of {xt.dtype}", self.where, value=op)
        if op == "sum" and xt.dtype not in _FLOATS:
            self.acc_dt = "i64"
        self.domain = tuple(int(d) for d in xt.shape)
        self.N = self.domain[-1]
        self.multi = op in ("softmax", "log_softmax", "layer_norm")
        # which values are downstream of the reduction, and in which space they live
        self.post: set[str] = {self.R}
        for n in self.b.nodes:
            if any(i in self.post for i in n.inputs):
                self.post.update(n.outputs)
        if math.prod(self.domain) == 0:
            raise _err(f"{op} over an empty tensor {list(self.domain)}", self.where, value=op)
        self.space: dict[str, str] = {}
        self.space[self.R] = "row" if self.keepdim else "l"
        for n in _needed_nodes(self.b, self.b.outputs):
            if n is red:
                continue
            o = n.outputs[0]
            computed = [i for i in n.inputs if i in self.b.producers]
            sp = "l" if any(self.space.get(i) == "l" for i in computed) else "row"
            if sp == "l":
                bad = [i for i in computed if self.space.get(i) == "row"]
                if bad:
                    raise _err(f"{n.op} mixes %{bad[0]} with a value reduced over the last dim", self.where,
                               value=n.op, fix="use keepdim=True for the reduction")
            for out in n.outputs:
                self.space[out] = sp
        for v, sp in list(self.space.items()):   # every value must broadcast into the domain
            self.strides(self.padded(v, sp), v)
        for o in self.b.outputs:
            full = self.domain if self.jdep(o) else self.domain[:-1] + (1,)
            if self.padded(o, self.space_of(o)) != full:
                raise _err(f"output %{o} ({list(self.vt[o].shape)}) is smaller than the row domain "
                           f"{list(full)}", self.where, fix="make it a separate elementwise group")

    def space_of(self, name: str) -> str:
        return self.space.get(name, "row")

    def jdep(self, name: str) -> bool:
        if name == self.R:
            return self.multi or (self.keepdim and self.N == 1)
        sp = self.space_of(name)
        return sp == "row" and self.padded(name, sp)[-1] == self.N

    def _accumulator(self, op: str, ct: str, x: str) -> tuple[str, str, str]:
        """(initial value, omp simd clauses, update statement) of pass A's accumulator."""
        is_float = self.acc_dt in _FLOATS
        inf = "GM_INF" if ct == "float" else "((double)GM_INF)"
        if op in ("softmax", "log_softmax", "amax", "amin"):
            mx = op != "amin"
            if is_float:
                init = f"-{inf}" if mx else inf
            else:
                lim = {"i64": ("(-9223372036854775807LL - 1)", "9223372036854775807LL"),
                       "i32": ("(-2147483647 - 1)", "2147483647"), "i16": ("-32768", "32767"),
                       "i8": ("-128", "127"), "u8": ("0", "255"), "bool": ("0", "1")}[self.acc_dt]
                init = f"(({ct}){lim[0] if mx else lim[1]})"
            cmp = ">" if mx else "<"
            upd = f"acc = acc {cmp} {x} ? acc : {x};"
            clauses = f"reduction({'max' if mx else 'min'}:acc)"
            if op in ("amax", "amin") and is_float:
                clauses += " reduction(|:nan)"
                upd += f" nan |= ({x} != {x});"
            return init, clauses, upd
        return f"(({ct})0)", "reduction(+:acc)", f"acc += {x};"

    def run(self) -> "_Partial":
        b = self.b
        ct = _CTYPE[self.acc_dt] if self.acc_dt in _FLOATS else "int64_t"
        row = _Scope(None, self.PRE, False)
        outs_pre = [o for o in b.outputs if o not in self.post]
        outs_post = [o for o in b.outputs if o in self.post]
        N = self.N
        buffered = self.multi and (self.red.op == "softmax" or self.X in b.producers)

        # row-pre: per-row prologue outputs
        for o in outs_pre:
            if not self.jdep(o):
                v = self.val(o, row).expr
                row.lines.append(self.store(o, v, row))
        # pass A: the reduction input (+ prologue outputs), first accumulation
        sa = _Scope(row, self.PASS_A, True)
        x = _cv(self.val(self.X, sa), self.acc_dt)
        op = self.red.op
        pre_j = [o for o in outs_pre if self.jdep(o)]
        for o in pre_j:
            self.val(o, sa)
        init, clauses, upd = self._accumulator(op, ct, x)
        acc_lines = [f"{ct} acc = {init};"]
        if op in ("amax", "amin") and self.acc_dt in _FLOATS:
            acc_lines.append("int nan = 0;")
        body_a = list(sa.lines)
        if buffered:
            body_a.append(f"buf[j] = {x};")
        body_a.append(upd)
        body_a += [self.store(o, sa.lookup((o, self.space_of(o))), sa) for o in pre_j]
        row.lines += acc_lines
        row.lines.append(f"#pragma omp simd {clauses}")
        row.lines.append(f"for (int64_t j = 0; j < {N}; ++j) {{")
        row.lines += _indent(body_a, 2)
        row.lines.append("}")

        def xval(scope: _Scope) -> str:
            if buffered and op != "softmax":
                var = self.fresh("x")
                scope.lines.append(f"const {ct} {var} = buf[j];")
                scope.memo[(self.X, "row")] = var
                return var
            if op == "softmax" and buffered:
                return "buf[j]"
            return _cv(self.val(self.X, scope), self.acc_dt)

        red_var = "red"
        rdt = self.vt[self.R].dtype
        if op in ("softmax", "log_softmax"):
            sb = _Scope(row, self.PASS_B, True)
            xb = "buf[j]" if buffered else xval(sb)
            row.lines.append(f"{ct} ssum = (({ct})0);")
            row.lines.append("#pragma omp simd reduction(+:ssum)")
            row.lines.append(f"for (int64_t j = 0; j < {N}; ++j) {{")
            lb = list(sb.lines) + [f"const {ct} e = {_fn('exp', self.acc_dt)}({xb} - acc);"]
            if op == "softmax":
                lb.append("buf[j] = e;")
            lb.append("ssum += e;")
            row.lines += _indent(lb, 2) + ["}"]
            if op == "softmax":
                row.lines.append(f"const {ct} inv = (({ct})1) / ssum;")
            else:
                row.lines.append(f"const {ct} lse = {_fn('log', self.acc_dt)}(ssum);")
        elif op == "layer_norm":
            row.lines.append(f"const {ct} mean = acc / (({ct}){N});")
            sb = _Scope(row, self.PASS_B, True)
            xb = "buf[j]" if buffered else xval(sb)
            row.lines.append(f"{ct} sq = (({ct})0);")
            row.lines.append("#pragma omp simd reduction(+:sq)")
            row.lines.append(f"for (int64_t j = 0; j < {N}; ++j) {{")
            row.lines += _indent(list(sb.lines) + [f"const {ct} d = {xb} - mean;", "sq += d * d;"], 2) + ["}"]
            eps = float(self.red.attrs.get("eps", 1e-5))
            row.lines.append(f"const {ct} rstd = (({ct})1) / {_fn('sqrt', self.acc_dt)}(sq / (({ct}){N}) + "
                             f"{_lit(eps, self.acc_dt)});")
        else:
            if op == "sum":
                val = "acc"
            elif op == "mean":
                val = f"acc / (({ct}){N})"
            else:
                val = f"(nan ? (({ct})GM_NAN) : acc)" if self.acc_dt in _FLOATS else "acc"
            row.lines.append(f"const {_CTYPE[rdt]} {red_var} = ({_CTYPE[rdt]})({val});")
            row.memo[(self.R, self.space_of(self.R))] = red_var

        # row-post: per-row epilogue values and outputs
        row.pass_id = self.POST
        for o in outs_post:
            if not self.jdep(o):
                v = self.val(o, row).expr
                row.lines.append(self.store(o, v, row))
        jouts = [o for o in outs_post if self.jdep(o)]
        if jouts:
            sc = _Scope(row, self.PASS_C, True)
            if self.multi:
                if op == "softmax":
                    rj = f"buf[j] * inv"
                elif op == "log_softmax":
                    rj = f"({xval(sc)} - acc) - lse"
                else:
                    xc = xval(sc)
                    rj = f"({xc} - mean) * rstd"
                    ins = self.red.inputs
                    if len(ins) > 1:
                        rj = f"({rj}) * {_cv(self.val(ins[1], sc), self.acc_dt)}"
                    if len(ins) > 2:
                        rj = f"({rj}) + {_cv(self.val(ins[2], sc), self.acc_dt)}"
                var = self.fresh("r")
                sc.lines.append(f"const {_CTYPE[rdt]} {var} = ({_CTYPE[rdt]})({rj});")
                sc.memo[(self.R, "row")] = var
            for o in jouts:
                self.val(o, sc)
            lc = list(sc.lines) + [self.store(o, sc.lookup((o, self.space_of(o))), sc) for o in jouts]
            row.lines.append("#pragma omp simd")
            row.lines.append(f"for (int64_t j = 0; j < {N}; ++j) {{")
            row.lines += _indent(lc, 2) + ["}"]

        # header: rows, operand bases (leading dims collapsed over the operands used)
        ops = list(self.operands.values())
        lead = self.domain[:-1]
        rows = math.prod(lead)
        dims, st = _collapse(lead, [o.strides[:-1] for o in ops])
        dec, idx = _row_decomp(dims, "r", 0)
        head = [ln.strip() for ln in dec]
        for o, s in zip(ops, st):
            head.append(f"const int64_t {o.base} = {_base_expr(idx, s)};")
        work = rows * N * (_cost(b.nodes) + 4)
        parallel = work >= PAR_THRESHOLD and rows > 1
        buf_bytes = N * (8 if ct == "double" else 4)
        text = ["  {"]
        if parallel:
            text.append("    #pragma omp parallel num_threads(gm_nt())")
        text.append("    {")
        if buffered:
            if buf_bytes <= STACK_BUF_BYTES:
                text.append(f"      {ct} buf[{N}] __attribute__((aligned(64)));")
            else:
                text.append(f"      {ct}* buf = ({ct}*)malloc({buf_bytes});")
        if parallel:
            text.append("      #pragma omp for schedule(static)")
        text.append(f"      for (int64_t r = 0; r < {rows}; ++r) {{")
        text += _indent(head + row.lines, 8)
        text.append("      }")
        if buffered and buf_bytes > STACK_BUF_BYTES:
            text.append("      free(buf);")
        text += ["    }", "  }", ""]

        inputs = [i for i in b.inputs if i in self.arg_in]
        may_alias: dict[str, tuple[str, ...]] = {}
        for o in b.outputs:
            jd = self.jdep(o)
            wpass = (self.PASS_A if o not in self.post else self.PASS_C) if jd else \
                (self.PRE if o not in self.post else self.POST)
            view = self.padded(o, self.space_of(o))
            ok = []
            for i in inputs:
                if not same_footprint(self.vt[i], self.vt[o]):
                    continue
                rd = self.reads.get(i, set())
                if all(p == -1 or (p <= wpass and v == view) for p, v in rd):
                    ok.append(i)
            may_alias[o] = tuple(ok)
        src = self._assemble("".join(ln + "\n" for ln in text), inputs, list(b.outputs))
        return _Partial(src, tuple(inputs), tuple(b.outputs), dict(self.vt), self.kind, may_alias, parallel)


# ------------------------------------------------------------------------------ finishing

@dataclass
class _Partial:
    source: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    types: dict[str, TensorType]
    kind: str
    may_alias: dict[str, tuple[str, ...]]
    parallel: bool


def _finish(p: _Partial, gemm: Node | None, folded: tuple[str, ...], pattern: str) -> KernelSource:
    digest = hashlib.sha256(p.source.encode()).hexdigest()[:16]
    symbol = f"gm_{p.kind}_{digest}"
    types = {n: p.types[n] for n in p.inputs + p.outputs}
    return KernelSource(symbol=symbol, source=p.source.replace("@SYM@", symbol), inputs=p.inputs,
                        outputs=p.outputs, types=types, kind=p.kind, may_alias=p.may_alias,
                        parallel=p.parallel, gemm=gemm, folded=folded, pattern=pattern)


def generate_all(nodes: Sequence[Node], types: Mapping[str, TensorType], *,
                 constants: Mapping[str, torch.Tensor] | None = None,
                 on_error: Callable[[Node, BackendError], None] | None = None) -> dict[Node, KernelSource]:
    """Generate every group of a plan that the generator supports; the others are reported
    to `on_error` (the executor falls back to the reference ops for them)."""
    out: dict[Node, KernelSource] = {}
    for n in nodes:
        try:
            out[n] = generate(n, types, constants=constants)
        except BackendError as e:
            if on_error is not None:
                on_error(n, e)
    return out
