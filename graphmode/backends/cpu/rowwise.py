"""Row kernels for fused groups: one reduction over the last dim, with the elementwise ops
before it (computed inside the first pass over a row) and after it (inside the last).

The reductions it writes are `ROW_KERNELS` (a subset of the op database's `row_reduction`
trait, which is what makes codegen treat a group as a row group). `row_plan` is the claim
check: which values are downstream of the reduction, in which space each lives ("row": the
full row domain; "l": reduced away with keepdim=False), and why a group does not fit one
row kernel. `RowGen` writes the kernel for a plan that fits.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from graphmode.backends.cpu.cexpr import CTYPE, FLOATS, cv, fn, lit
from graphmode.backends.cpu.emit import (PAR_THRESHOLD, STACK_BUF_BYTES, Gen, Partial, Scope, base_expr, collapse,
                                         cost, indent, node_refusal, row_decomp)
from graphmode.backends.cpu.groups import Body, fit_refusal, needed_nodes, padded, same_footprint, shape_of
from graphmode.backends.cpu.lowering import Claim, refused
from graphmode.backends.cpu.omp_loops import omp_for
from graphmode.ir.graph import Node
from graphmode.ir.ops import norm_axis

# The row_reduction ops this generator writes, by the attribute that names their axis: `dims`
# reduces it away (one pass over a row), `dim` / `normalized_rank` normalise along it (two or
# three passes). Other row_reduction ops are refused here and run with the reference ops.
ROW_KERNELS = {"softmax": "dim", "log_softmax": "dim", "layer_norm": "normalized_rank",
               "sum": "dims", "mean": "dims", "amax": "dims", "amin": "dims"}


@dataclass
class RowPlan:
    """How one reduction `red` lays out its group (see the module doc)."""

    red: Node
    keepdim: bool
    acc_dt: str
    domain: tuple[int, ...]
    multi: bool            # softmax / log_softmax / layer_norm: more than one pass over the row
    post: set[str]         # values downstream of the reduction
    space: dict[str, str]


def row_plan(b: Body, red: Node) -> RowPlan | Claim:
    """The layout of a group around its reduction `red`, or why one row kernel cannot run it."""
    X, R = red.inputs[0], red.outputs[0]
    xt = b.vt[X]
    if xt.rank == 0:
        return refused(f"{red.op} of a 0-d value", value=red.op)
    r = xt.rank
    op, a = red.op, red.attrs
    axis = ROW_KERNELS.get(op)
    if axis is None:
        return refused(f"no row kernel for {op}", value=op, fix="it runs with the reference ops")
    if axis == "dim":
        ok = norm_axis(a["dim"], r) == r - 1
        keepdim = True
    elif axis == "normalized_rank":
        ok = a.get("normalized_rank", 1) == 1
        keepdim = True
    else:
        dims = sorted({norm_axis(d, r) for d in a.get("dims", range(r))})
        ok = dims == [r - 1]
        keepdim = bool(a.get("keepdim", False))
    if not ok:
        return refused(f"{op} over {dict(a)} is not over the last dim only", value=op,
                       fix="row kernels reduce the last dim; other axes run with the reference ops")
    acc_dt = xt.dtype
    if op in ("softmax", "log_softmax", "layer_norm", "mean") and xt.dtype not in FLOATS:
        return refused(f"{op} of {xt.dtype}", value=op)
    if op == "sum" and xt.dtype not in FLOATS:
        acc_dt = "i64"
    domain = shape_of(xt)
    post: set[str] = {R}
    for n in b.nodes:
        if any(i in post for i in n.inputs):
            post.update(n.outputs)
    if math.prod(domain) == 0:
        return refused(f"{op} over an empty tensor {list(domain)}", value=op)
    space: dict[str, str] = {R: "row" if keepdim else "l"}
    needed = [n for n in needed_nodes(b, b.outputs) if n is not red]
    for n in needed:
        computed = [i for i in n.inputs if i in b.producers]
        sp = "l" if any(space.get(i) == "l" for i in computed) else "row"
        if sp == "l":
            bad = [i for i in computed if space.get(i) == "row"]
            if bad:
                return refused(f"{n.op} mixes %{bad[0]} with a value reduced over the last dim", value=n.op,
                               fix="use keepdim=True for the reduction")
        for out in n.outputs:
            space[out] = sp
    for v, sp in space.items():   # every value must broadcast into the domain
        why = fit_refusal(v, shape_of(b.vt[v]), domain, sp)
        if why is not None:
            return why
    plan = RowPlan(red, keepdim, acc_dt, domain, axis != "dims", post, space)
    for o in b.outputs:
        full = domain if _jdep(plan, b, o) else domain[:-1] + (1,)
        if padded(shape_of(b.vt[o]), domain, plan.space.get(o, "row")) != full:
            return refused(f"output %{o} ({list(b.vt[o].shape)}) is smaller than the row domain {list(full)}",
                           fix="make it a separate elementwise group")
    # the inputs each node reads, in the space it computes in (the reduction's in the row's)
    reads = [(i, space.get(n.outputs[0], "row")) for n in needed for i in n.inputs] + \
            [(i, "row") for i in red.inputs]
    for leaf, sp in reads:
        if leaf in b.producers or leaf in b.known:
            continue
        scalar = math.prod(shape_of(b.vt[leaf])) == 1 and leaf not in b.arrays
        why = fit_refusal(leaf, shape_of(b.vt[leaf]), domain, sp, broadcast=not scalar)
        if why is not None:
            return why
    for n in needed:
        why = node_refusal(b, n)
        if why is not None:
            return why
    return plan


def _jdep(plan: RowPlan, b: Body, name: str) -> bool:
    """Whether `name` varies along the reduced (last) dim."""
    n = plan.domain[-1]
    if name == plan.red.outputs[0]:
        return plan.multi or (plan.keepdim and n == 1)
    sp = plan.space.get(name, "row")
    p = padded(shape_of(b.vt[name]), plan.domain, sp)
    return sp == "row" and p is not None and p[-1] == n


class RowGen(Gen):
    """The row kernel of a claimed group (`row_plan` returned `plan`)."""

    kind = "rowwise"
    PRE, PASS_A, PASS_B, POST, PASS_C = 0, 1, 2, 3, 4

    def __init__(self, body: Body, plan: RowPlan):
        super().__init__(body)
        self.plan = plan
        self.red = plan.red
        self.X = plan.red.inputs[0]
        self.R = plan.red.outputs[0]
        self.keepdim = plan.keepdim
        self.acc_dt = plan.acc_dt
        self.domain = plan.domain
        self.N = self.domain[-1]
        self.multi = plan.multi
        self.post = plan.post
        self.space = plan.space

    def space_of(self, name: str) -> str:
        return self.space.get(name, "row")

    def jdep(self, name: str) -> bool:
        return _jdep(self.plan, self.b, name)

    def _accumulator(self, op: str, ct: str, x: str) -> tuple[str, str, str]:
        """(initial value, omp simd clauses, update statement) of pass A's accumulator."""
        is_float = self.acc_dt in FLOATS
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

    def run(self) -> Partial:
        b = self.b
        ct = CTYPE[self.acc_dt] if self.acc_dt in FLOATS else "int64_t"
        row = Scope(None, self.PRE, False)
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
        sa = Scope(row, self.PASS_A, True)
        x = cv(self.val(self.X, sa), self.acc_dt)
        op = self.red.op
        pre_j = [o for o in outs_pre if self.jdep(o)]
        for o in pre_j:
            self.val(o, sa)
        init, clauses, upd = self._accumulator(op, ct, x)
        acc_lines = [f"{ct} acc = {init};"]
        if op in ("amax", "amin") and self.acc_dt in FLOATS:
            acc_lines.append("int nan = 0;")
        body_a = list(sa.lines)
        if buffered:
            body_a.append(f"buf[j] = {x};")
        body_a.append(upd)
        body_a += [self.store(o, sa.lookup((o, self.space_of(o))), sa) for o in pre_j]
        row.lines += acc_lines
        row.lines.append(f"#pragma omp simd {clauses}")
        row.lines.append(f"for (int64_t j = 0; j < {N}; ++j) {{")
        row.lines += indent(body_a, 2)
        row.lines.append("}")

        def xval(scope: Scope) -> str:
            if buffered and op != "softmax":
                var = self.fresh("x")
                scope.lines.append(f"const {ct} {var} = buf[j];")
                scope.memo[(self.X, "row")] = var
                return var
            if op == "softmax" and buffered:
                return "buf[j]"
            return cv(self.val(self.X, scope), self.acc_dt)

        red_var = "red"
        rdt = self.vt[self.R].dtype
        if op in ("softmax", "log_softmax"):
            sb = Scope(row, self.PASS_B, True)
            xb = "buf[j]" if buffered else xval(sb)
            row.lines.append(f"{ct} ssum = (({ct})0);")
            row.lines.append("#pragma omp simd reduction(+:ssum)")
            row.lines.append(f"for (int64_t j = 0; j < {N}; ++j) {{")
            lb = list(sb.lines) + [f"const {ct} e = {fn('exp', self.acc_dt)}({xb} - acc);"]
            if op == "softmax":
                lb.append("buf[j] = e;")
            lb.append("ssum += e;")
            row.lines += indent(lb, 2) + ["}"]
            if op == "softmax":
                row.lines.append(f"const {ct} inv = (({ct})1) / ssum;")
            else:
                row.lines.append(f"const {ct} lse = {fn('log', self.acc_dt)}(ssum);")
        elif op == "layer_norm":
            row.lines.append(f"const {ct} mean0 = acc / (({ct}){N});")
            sb = Scope(row, self.PASS_B, True)
            xb = "buf[j]" if buffered else xval(sb)
            row.lines.append(f"{ct} sq = (({ct})0), sd = (({ct})0);")
            row.lines.append("#pragma omp simd reduction(+:sq, sd)")
            row.lines.append(f"for (int64_t j = 0; j < {N}; ++j) {{")
            row.lines += indent(list(sb.lines) + [f"const {ct} d = {xb} - mean0;", "sq += d * d;", "sd += d;"],
                                2) + ["}"]
            eps = float(self.red.attrs.get("eps", 1e-5))
            # the corrected two-pass moments: the first mean's rounding error (a row far from zero,
            # |mean| >> its spread: 1e4 + randn) is taken out of the mean and the variance
            row.lines.append(f"const {ct} mean = mean0 + sd / (({ct}){N});")
            # a variance past f32's range: eager (ATen's moments in f32) gives the row NaN, not b
            row.lines.append(f"const {ct} var0 = (sq - sd * (sd / (({ct}){N}))) / (({ct}){N});")
            row.lines.append(f"const {ct} var = var0 < (({ct})0) ? (({ct})0) : var0;")     # rounding; NaN stays
            row.lines.append(f"const {ct} rstd = var <= (({ct})3.4028234663852886e+38) ? (({ct})1) / "
                             f"{fn('sqrt', self.acc_dt)}(var + {lit(eps, self.acc_dt)}) : "
                             f"(({ct})__builtin_nan(\"\"));")
        else:
            if op == "sum":
                val = "acc"
            elif op == "mean":
                val = f"acc / (({ct}){N})"
            else:
                val = f"(nan ? (({ct})GM_NAN) : acc)" if self.acc_dt in FLOATS else "acc"
            row.lines.append(f"const {CTYPE[rdt]} {red_var} = ({CTYPE[rdt]})({val});")
            row.memo[(self.R, self.space_of(self.R))] = red_var

        # row-post: per-row epilogue values and outputs
        row.pass_id = self.POST
        for o in outs_post:
            if not self.jdep(o):
                v = self.val(o, row).expr
                row.lines.append(self.store(o, v, row))
        jouts = [o for o in outs_post if self.jdep(o)]
        if jouts:
            sc = Scope(row, self.PASS_C, True)
            if self.multi:
                if op == "softmax":
                    rj = "buf[j] * inv"
                elif op == "log_softmax":
                    rj = f"({xval(sc)} - acc) - lse"
                else:
                    xc = xval(sc)
                    rj = f"({xc} - mean) * rstd"
                    ins = self.red.inputs
                    if len(ins) > 1:
                        rj = f"({rj}) * {cv(self.val(ins[1], sc), self.acc_dt)}"
                    if len(ins) > 2:
                        rj = f"({rj}) + {cv(self.val(ins[2], sc), self.acc_dt)}"
                var = self.fresh("r")
                sc.lines.append(f"const {CTYPE[rdt]} {var} = ({CTYPE[rdt]})({rj});")
                sc.memo[(self.R, "row")] = var
            for o in jouts:
                self.val(o, sc)
            lc = list(sc.lines) + [self.store(o, sc.lookup((o, self.space_of(o))), sc) for o in jouts]
            row.lines.append("#pragma omp simd")
            row.lines.append(f"for (int64_t j = 0; j < {N}; ++j) {{")
            row.lines += indent(lc, 2) + ["}"]

        # header: rows, operand bases (leading dims collapsed over the operands used)
        ops = list(self.operands.values())
        lead = self.domain[:-1]
        rows = math.prod(lead)
        dims, st = collapse(lead, [o.strides[:-1] for o in ops])
        dec, idx = row_decomp(dims, "r", 0)
        head = [ln.strip() for ln in dec]
        for o, s in zip(ops, st):
            head.append(f"const int64_t {o.base} = {base_expr(idx, s)};")
        work = rows * N * (cost(b.nodes) + 4)
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
            text.append("      " + omp_for(rows, work, region=False))
        text.append(f"      for (int64_t r = 0; r < {rows}; ++r) {{")
        text += indent(head + row.lines, 8)
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
        src = self.assemble(text, inputs, list(b.outputs))
        return Partial(src, tuple(inputs), tuple(b.outputs), dict(self.vt), self.kind, may_alias, parallel)


__all__ = ["ROW_KERNELS", "RowPlan", "RowGen", "row_plan"]
