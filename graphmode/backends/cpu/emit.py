"""Loop nests for fused groups: the emission machinery, and the elementwise generator.

Every size and stride is a compile-time constant, so gcc can collapse and vectorise the
innermost loop without runtime checks. An elementwise group gets one loop nest per distinct
output shape; each input is indexed with its own broadcast strides (0 on broadcast dims);
dims that are contiguous for every operand are merged; the outer "tile" loop gets
`omp parallel for` when the work is large enough. Row kernels (rowwise.py) build on the
same `Gen`. Generators run only on claimed groups (codegen.py): what they cannot write was
refused before, so an error raised here is a generator bug.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Iterable, Sequence

from graphmode.backends.cpu.abi import entry_point
from graphmode.backends.cpu.cexpr import CTYPE, STYPE, CValue, lit, op_expr, op_refusal
from graphmode.backends.cpu.groups import (Body, broadcast_strides, fit_refusal, needed_leaves, needed_nodes,
                                           padded, same_footprint, shape_of)
from graphmode.backends.cpu.lowering import Claim, refused
from graphmode.backends.cpu.omp_loops import omp_for
from graphmode.errors import BackendError
from graphmode.ir.graph import Node
from graphmode.ir.ops import OPS
from graphmode.ir.types import TensorType

PAR_THRESHOLD = 1 << 17     # work units (elements x OpSpec.flops_per_elem, ~0.05 ns each here) below which
                            # a nest runs serially: an OpenMP fork/join costs a few microseconds
TARGET_TILES = 16           # tiles per parallel nest: enough to balance up to ~8 threads
MIN_BLOCK = 512             # never split a row into blocks smaller than this
STACK_BUF_BYTES = 32 << 10  # row buffers up to this size live on the stack


def _bug(msg: str, where: str) -> BackendError:
    return BackendError(f"internal: {msg}", where=where, fix="a code generator bug: claims must refuse what the "
                                                              "generator cannot write")


def node_refusal(body: Body, n: Node) -> Claim | None:
    """Why elementwise node `n` of `body` cannot be written as a C expression."""
    why = op_refusal(n, [body.vt[i] for i in n.inputs], body.vt[n.outputs[0]].dtype)
    return None if why is None else refused(why, value=n.op)


class Scope:
    """A block of statements; values emitted in it are visible to its children."""

    def __init__(self, parent: "Scope | None", pass_id: int, in_loop: bool):
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
class Operand:
    name: str
    space: str
    ptr: str
    padded: tuple[int, ...]     # the view's shape over the domain rank
    strides: tuple[int, ...]    # element strides over the (uncollapsed) domain, 0 = broadcast
    base: str = ""


@dataclass
class Partial:
    """A generated kernel before it is named (codegen.py finishes it into a KernelSource)."""

    source: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    types: dict[str, TensorType]
    kind: str
    may_alias: dict[str, tuple[str, ...]]
    parallel: bool


class Gen:
    """State shared by the generators: arguments, scalars, operands, emission."""

    kind = ""

    def __init__(self, body: Body):
        self.b = body
        self.vt = body.vt
        self.where = body.where
        self.nvar = 0
        self.arg_in: list[str] = []          # inputs read (argument order fixed at the end)
        self.scalars: dict[str, str] = {}    # numel-1 input -> local holding its value
        self.operands: dict[tuple[str, str], Operand] = {}
        self.reads: dict[str, set[tuple[int, tuple[int, ...]]]] = {}  # input -> {(pass, view)}
        self.arrays: dict[str, str] = {}     # embedded constant -> static array name
        self.domain: tuple[int, ...] = ()

    def fresh(self, prefix: str = "t") -> str:
        self.nvar += 1
        return f"{prefix}{self.nvar}"

    # ---- views and operands -------------------------------------------------------------
    def padded(self, name: str, space: str) -> tuple[int, ...]:
        p = padded(shape_of(self.vt[name]), self.domain, space)
        if p is None:
            raise _bug(f"%{name} does not fit the kernel domain {list(self.domain)}", self.where)
        return p

    def strides(self, pshape: tuple[int, ...], name: str) -> tuple[int, ...]:
        s = broadcast_strides(pshape, self.domain)
        if s is None:
            raise _bug(f"%{name} ({list(pshape)}) does not broadcast to {list(self.domain)}", self.where)
        return s

    def is_scalar(self, name: str) -> bool:
        return math.prod(int(d) for d in self.vt[name].shape) == 1

    def operand(self, name: str, space: str) -> Operand:
        key = (name, space)
        op = self.operands.get(key)
        if op is None:
            pshape = self.padded(name, space)
            ptr = self.array_ptr(name) if name in self.b.arrays else self.arg_ptr(name)
            op = Operand(name, space, ptr, pshape, self.strides(pshape, name))
            op.base = f"b{len(self.operands)}"
            self.operands[key] = op
        return op

    def arg_ptr(self, name: str) -> str:
        if name in self.b.outputs:
            return f"o{self.b.outputs.index(name)}"
        if name not in self.arg_in:
            self.arg_in.append(name)
        return f"@A{self.arg_in.index(name)}@"   # renamed to a positional pointer in assemble

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

    def load(self, name: str, space: str, scope: Scope) -> str:
        """A local holding input `name` at the scope's position."""
        dt = self.vt[name].dtype
        if name in self.b.known:
            return lit(self.b.known[name], dt)
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
                raise _bug(f"%{name} varies along the row but is needed once per row", self.where)
            idx = op.base
        var = self.fresh("l")
        raw = f"{op.ptr}[{idx}]"
        expr = f"({raw} != 0)" if dt == "bool" else raw
        scope.lines.append(f"const {CTYPE[dt]} {var} = {expr};")
        return var

    def last_stride(self, op: Operand) -> int:
        return op.strides[-1] if op.strides else 0

    def val(self, name: str, scope: Scope, space: str = "row") -> CValue:
        t = self.vt[name]
        if name in self.b.known:
            return CValue(lit(self.b.known[name], t.dtype), t.dtype, t, self.b.known[name])
        n = self.b.producers.get(name)
        key = (name, space if n is None else self.space_of(name))
        hit = scope.lookup(key)
        if hit is not None:
            return CValue(hit, t.dtype, t)
        if n is None:
            var = self.load(name, key[1], scope)
        else:
            var = self.emit_node(n, scope)
        scope.memo[key] = var
        return CValue(var, t.dtype, t)

    def emit_node(self, n: Node, scope: Scope) -> str:
        out = n.outputs[0]
        sp = self.space_of(out)
        ins = [self.val(i, scope, sp) for i in n.inputs]
        dt = self.vt[out].dtype
        expr = op_expr(n, ins, dt, self.where)
        var = self.fresh()
        scope.lines.append(f"const {CTYPE[dt]} {var} = ({CTYPE[dt]}){expr};")
        return var

    def store(self, name: str, var: str, scope: Scope) -> str:
        op = self.operand(name, self.space_of(name))
        idx = f"{op.base} + j" if scope.in_loop and self.last_stride(op) else op.base
        return f"{op.ptr}[{idx}] = ({STYPE[self.vt[name].dtype]}){var};"

    # ---- assembly -----------------------------------------------------------------------
    def assemble(self, body_lines: Sequence[str], inputs: list[str], outputs: list[str]) -> str:
        """The kernel text: embedded constant arrays, then the entry point over `inputs` then
        `outputs` holding typed pointers, the scalar inputs' values and `body_lines`."""
        head = []
        args = inputs + outputs
        for k, name in enumerate(args):
            st = STYPE[self.vt[name].dtype]
            if k < len(inputs):
                head.append(f"  const {st}* i{k} = (const {st}*)p{k};")
            else:
                head.append(f"  {st}* o{k - len(inputs)} = ({st}*)p{k};")
        for name, var in self.scalars.items():
            k = inputs.index(name)
            dt = self.vt[name].dtype
            raw = f"i{k}[0]"
            head.append(f"  const {CTYPE[dt]} {var} = {'(' + raw + ' != 0)' if dt == 'bool' else raw};")
        head += [f"  (void)i{k};" for k, n in enumerate(inputs) if n in self.scalars]
        body = [re.sub(r"@A(\d+)@", lambda m: f"i{inputs.index(self.arg_in[int(m[1])])}", ln) for ln in body_lines]
        arrays = []
        for name, sym in self.arrays.items():
            t = self.b.arrays[name]
            dt = self.vt[name].dtype
            vals = t.reshape(-1).tolist()
            arrays.append(f"static const {STYPE[dt]} {sym}[{len(vals)}] = {{{', '.join(lit(v, dt) for v in vals)}}};")
        return "\n".join(arrays + entry_point(len(args), head + body)) + "\n"


def indent(lines: Sequence[str], n: int) -> list[str]:
    pad = " " * n
    return [pad + ln for ln in lines]


def collapse(domain: Sequence[int], strides: list[Sequence[int]]) -> tuple[list[int], list[list[int]]]:
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


def row_decomp(dims: Sequence[int], row: str, ind: int) -> tuple[list[str], list[str]]:
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
    return indent(lines, ind), names


def base_expr(idx: Sequence[str], strides: Sequence[int]) -> str:
    terms = [f"{i} * {s}" if s != 1 else i for i, s in zip(idx, strides) if s != 0]
    return " + ".join(terms) if terms else "0"


def cost(nodes: Iterable[Node]) -> float:
    return max(1.0, sum(OPS[n.op].flops_per_elem for n in nodes))


# ------------------------------------------------------------------------------ elementwise

def _output_groups(body: Body) -> dict[tuple[int, ...], list[str]]:
    groups: dict[tuple[int, ...], list[str]] = {}
    for o in body.outputs:
        groups.setdefault(shape_of(body.vt[o]), []).append(o)
    return groups


def elementwise_refusal(body: Body) -> Claim | None:
    """Why the elementwise generator cannot write `body`: a node with no C expression, or an
    input that does not broadcast to the shape of the outputs that need it."""
    for n in needed_nodes(body, body.outputs):
        why = node_refusal(body, n)
        if why is not None:
            return why
    for shape, outs in _output_groups(body).items():
        domain = shape if shape else (1,)
        if math.prod(domain) == 0:
            continue
        for leaf in sorted(needed_leaves(body, outs) - set(body.known)):
            scalar = math.prod(shape_of(body.vt[leaf])) == 1 and leaf not in body.arrays
            why = fit_refusal(leaf, shape_of(body.vt[leaf]), domain, "row", broadcast=not scalar)
            if why is not None:
                return why
    return None


class ElementwiseGen(Gen):
    kind = "elementwise"

    def run(self) -> Partial:
        text: list[str] = []
        parallel = False
        nest_reads: list[set[str]] = []
        writes: dict[str, int] = {}
        for k, (shape, outs) in enumerate(_output_groups(self.b).items()):
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
        src = self.assemble(text, inputs, list(self.b.outputs))
        return Partial(src, tuple(inputs), tuple(self.b.outputs), dict(self.vt), self.kind, may_alias, parallel)

    def nest(self, shape: tuple[int, ...], outs: list[str], k: int) -> tuple[list[str], bool, set[str]]:
        self.domain = shape if shape else (1,)
        self.operands = {}
        if math.prod(self.domain) == 0:
            return [], False, set()
        nodes = needed_nodes(self.b, outs)
        leaves = sorted(needed_leaves(self.b, outs) - set(self.b.known),
                        key=lambda n: (self.b.inputs + list(self.b.arrays)).index(n))
        vector_leaves = [n for n in leaves if not self.is_scalar(n) or n in self.b.arrays]
        ops = [self.operand(n, "row") for n in vector_leaves] + [self.operand(o, "row") for o in outs]
        dims, st = collapse(self.domain, [o.strides for o in ops])
        if not dims:
            dims, st = [1], [[0] for _ in ops]
        for o, s in zip(ops, st):
            o.strides = tuple(s)
        inner = dims[-1]
        lead = dims[:-1]
        rows = math.prod(lead)
        work = math.prod(self.domain) * cost(nodes)
        parallel = work >= PAR_THRESHOLD and math.prod(dims) > 1
        nblk = 1
        if parallel and rows < TARGET_TILES:
            nblk = max(1, min(-(-TARGET_TILES // rows), inner // MIN_BLOCK))
        block = -(-inner // nblk)
        block = -(-block // 16) * 16
        nblk = -(-inner // block)
        tiles = rows * nblk
        parallel = parallel and tiles > 1

        loop = Scope(None, k, True)
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
            lines.append("    " + omp_for(tiles, work))
        lines.append(f"    for (int64_t tile = 0; tile < {tiles}; ++tile) {{")
        row = "tile" if nblk == 1 else f"(tile / {nblk})"
        dec, idx = row_decomp(lead, row, 6)
        lines += dec
        for o in ops:
            lines.append(f"      const int64_t {o.base} = {base_expr(idx, o.strides[:-1])};")
        if nblk == 1:
            lo, hi = "0", str(inner)
        else:
            lines.append(f"      const int64_t j0 = (tile % {nblk}) * {block};")
            lines.append(f"      const int64_t j1 = j0 + {block} < {inner} ? j0 + {block} : {inner};")
            lo, hi = "j0", "j1"
        lines.append("      #pragma omp simd")
        lines.append(f"      for (int64_t j = {lo}; j < {hi}; ++j) {{")
        lines += indent(loop.lines + stores, 8)
        lines += ["      }", "    }", "  }", ""]
        return lines, parallel, reads


__all__ = ["PAR_THRESHOLD", "Gen", "Scope", "Operand", "Partial", "ElementwiseGen", "elementwise_refusal",
           "node_refusal", "indent", "collapse", "row_decomp", "base_expr", "cost"]
