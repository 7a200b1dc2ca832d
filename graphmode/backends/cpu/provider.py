"""Generated kernels for a plan's fused instructions (and the single ops of native.py),
bound to fixed arena addresses.

All kernels of one plan go into one shared library (one compiler run, cached by content).
A group the generator cannot express (BackendError), or one the compiler rejects, keeps the
reference path for that group only; the reasons are in `report["fallbacks"]`. With no C++
compiler every group takes the reference path and the report says so once.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Mapping

import torch

from graphmode.backends.cpu.build import KernelBuilder
from graphmode.backends.cpu.codegen import KernelSource, generate
from graphmode.backends.cpu.executor import KernelProvider, aten_step
from graphmode.backends.cpu.native import native_ops, native_source
from graphmode.errors import BackendError
from graphmode.ir.types import DTYPES, TensorType
from graphmode.plan.execution import ExecutionPlan

_BUILDERS: dict[tuple, KernelBuilder] = {}


def default_kernel_dir() -> Path:
    return Path.home() / ".cache" / "graphmode" / "kernels"


def builder_for(cache_dir: Path | None, threads: int | None) -> KernelBuilder:
    key = (str(cache_dir or default_kernel_dir()), threads)
    b = _BUILDERS.get(key)
    if b is None:
        b = _BUILDERS[key] = KernelBuilder(cache_dir or default_kernel_dir(), threads=threads)
    return b


class GeneratedKernels(KernelProvider):
    def __init__(self, cache_dir: Path | str | None = None, threads: int | None = None):
        self.builder = builder_for(Path(cache_dir) if cache_dir else None, threads)
        self.report: dict = {"generated": 0, "fallbacks": {}, "scratch_bytes": 0}
        self._constants: Mapping[str, torch.Tensor] = {}

    def build(self, plan: ExecutionPlan, views: Mapping[str, torch.Tensor],
              constants: Mapping[str, torch.Tensor]) -> dict[int, Callable[[], None]]:
        if not self.builder.compiler_available():
            self.report["fallbacks"]["*"] = f"no C++ compiler: {self.builder.unavailable_reason}"
            return {}
        self._constants = constants
        sources: dict[int, KernelSource] = {}
        special = {}
        natives = native_ops()
        for ins in plan.instructions:
            if ins.kind == "aten" and ins.op in natives:
                try:
                    ks = native_source(ins.op, [views[i] for i in ins.inputs], [views[o] for o in ins.outputs],
                                       ins.attrs, plan.env, ins.inputs, ins.outputs)
                except BackendError as e:
                    self.report["fallbacks"][f"%{ins.outputs[0]}"] = e.message
                    continue
                if ks is not None:
                    sources[ins.node_index] = ks
                continue
            if ins.kind != "kernel":
                continue
            node = special[ins.node_index] = specialize(plan.body_graphs[ins.node_index], plan.env)
            types = {v: TensorType(_dt(views[v]), tuple(views[v].shape)) for v in node.outputs}
            types.update({v: node.body.values[v].type if v in node.body.values else
                          TensorType(_dt(views[v]), tuple(views[v].shape)) for v in node.inputs})
            try:
                sources[ins.node_index] = generate(node, types, constants=constants)
            except BackendError as e:
                self.report["fallbacks"][f"%{node.outputs[0]}"] = e.message
        if not sources:
            return {}
        kernels = self.builder.build_many(list(sources.values()), strict=False)
        steps: dict[int, Callable[[], None]] = {}
        for idx, ks in sources.items():
            k = kernels.get(ks.symbol)
            if k is None:
                self.report["fallbacks"][f"%{ks.outputs[0]}"] = self.builder.failures.get(ks.symbol, "not built")
                continue
            if idx in special:
                steps[idx] = self._bind(ks, k, special[idx], views, plan.env)
                self.report["generated"] += 1
            else:
                steps[idx] = k.bind([views[a].data_ptr() for a in ks.args])
                self.report["native"] = self.report.get("native", 0) + 1
        return steps

    def _bind(self, ks: KernelSource, kernel, node, views, env) -> Callable[[], None]:
        buffers = dict(views)
        gemm_step = None
        if ks.gemm is not None:
            g = ks.gemm
            gemm_out = g.outputs[0]
            out = node.outputs[0]
            out_view = views[out]
            gemm_ty = node.body.values[gemm_out].type.specialize(env)
            operands = set(g.inputs)
            # the output buffer may already hold an epilogue operand (in-place residual add):
            # then the GEMM needs its own scratch buffer, or it would overwrite that operand first
            shares_operand = any(views[i].data_ptr() == out_view.data_ptr() for i in node.inputs
                                 if i not in operands and i in views)
            if (gemm_out in ks.may_alias.get(out, ()) and not shares_operand
                    and out_view.numel() == _numel(gemm_ty) and out_view.dtype == DTYPES[gemm_ty.dtype]):
                buf = out_view.view(gemm_ty.concrete(env))
            else:
                buf = torch.empty(gemm_ty.concrete(env), dtype=DTYPES[gemm_ty.dtype])
                self.report["scratch_bytes"] += buf.numel() * buf.element_size()
            buffers[gemm_out] = buf
            gemm_in = [views[i].view(node.body.values[i].type.concrete(env)) if i in node.body.values
                       else views[i] for i in g.inputs]
        run = kernel.bind([buffers[a].data_ptr() for a in ks.args])
        keep = [buffers[a] for a in ks.args]   # scratch buffers live as long as the step
        if ks.gemm is not None:
            fused = self._fused_epilogue(node, views, run)
            gemm_step = aten_step(g.op, gemm_in, [buf], g.attrs, env, epilogue=fused)
        if gemm_step is None:
            return run
        if getattr(gemm_step, "fused_epilogue", False):
            self.report["fused_epilogues"] = self.report.get("fused_epilogues", 0) + 1
            return gemm_step     # its ATen default (and so its scratch buffer) lives on the step

        def step(_keep=keep) -> None:
            gemm_step()
            run()
        return step

    def _fused_epilogue(self, node, views, run: Callable[[], None]):
        """The group's epilogue offered to its GEMM/conv step (tactics.FusedEpilogue), or None
        when it is not one a generated GEMM can apply at its store (epilogue.py). `run` is the
        group's own epilogue kernel, which the step's ATen path runs after its GEMM."""
        from graphmode.backends.cpu.epilogue import tile_epilogue
        from graphmode.backends.cpu.tactics import FusedEpilogue
        types = {v: TensorType(_dt(views[v]), tuple(views[v].shape)) for v in node.inputs if v in views}
        epi = tile_epilogue(node, types, constants=self._constants)
        if epi is None or epi.result not in views or any(o not in views for o in epi.operands):
            return None
        return FusedEpilogue(epi, [views[o] for o in epi.operands], views[epi.result], run)


_SHAPE_ATTRS = ("shape", "end")


def specialize(node, env: Mapping[str, int]):
    """The fused node with every symbolic dim (attributes and body types) evaluated at `env`."""
    from graphmode.ir.types import eval_dim, normalize_dim
    body = node.body.clone()
    body.values = {k: v.__class__(k, v.type.specialize(env), v.role) for k, v in body.values.items()}
    nodes = []
    for m in body.nodes:
        attrs = dict(m.attrs)
        if "shape" in attrs and isinstance(attrs["shape"], list):
            attrs["shape"] = [eval_dim(normalize_dim(d), env) if isinstance(d, str) else d for d in attrs["shape"]]
        if isinstance(attrs.get("end"), str):
            attrs["end"] = eval_dim(normalize_dim(attrs["end"]), env)
        nodes.append(m.with_(attrs=attrs))
    body.nodes = nodes
    _fold_reshape_after_linear(body)
    return node.with_(body=body)


def _fold_reshape_after_linear(body) -> None:
    """linear -> reshape(only the leading dims) becomes a linear on a re-viewed input: the
    bytes are the same, and the epilogue then sees one elementwise shape (GPT-2's MLP)."""
    first = body.nodes[0] if body.nodes else None
    if first is None or first.op != "linear":
        return
    g_out, x = first.outputs[0], first.inputs[0]
    users = [m for m in body.nodes if g_out in m.inputs]
    if len(users) != 1 or users[0].op != "reshape" or g_out in body.outputs:
        return
    if any(x in m.inputs for m in body.nodes[1:]):
        return
    r = users[0]
    r_out = r.outputs[0]
    rshape = body.values[r_out].type.shape
    n = body.values[g_out].type.shape[-1]
    k = body.values[x].type.shape[-1]
    if rshape[-1] != n or r_out in body.outputs:
        return
    body.values[x] = body.values[x].__class__(x, body.values[x].type.with_shape(tuple(rshape[:-1]) + (k,)),
                                              body.values[x].role)
    body.values[g_out] = body.values[g_out].__class__(g_out, body.values[r_out].type, body.values[g_out].role)
    del body.values[r_out]
    body.nodes = [m.with_(inputs=tuple(g_out if i == r_out else i for i in m.inputs))
                  for m in body.nodes if m is not r]


def _dt(t: torch.Tensor) -> str:
    from graphmode.ir.types import TORCH_TO_DTYPE
    return TORCH_TO_DTYPE[t.dtype]


def _numel(t: TensorType) -> int:
    n = 1
    for d in t.shape:
        n *= int(d)
    return n
