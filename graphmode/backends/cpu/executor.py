"""CPU executor: runs an ExecutionPlan over one preallocated arena.

At load time every slot becomes a fixed tensor view into the arena and every instruction a
closure bound to those views, so a run is one Python loop of calls: fused groups go to
generated C++ kernels (raw pointers), GEMM/conv to ATen (oneDNN/MKL) writing straight into
their output slot, everything else to ATen `out=` variants or the reference op + copy.
"""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Callable, Mapping

import torch

from graphmode.errors import BackendError
from graphmode.ir.fallback import run_fallback
from graphmode.ir.interpreter import run_node
from graphmode.ir.ops import get_op
from graphmode.ir.types import DTYPES
from graphmode.plan.execution import ExecutionPlan, Instruction

log = logging.getLogger("graphmode.cpu")

_BINARY_OUT = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div,
               "maximum": torch.maximum, "minimum": torch.minimum, "pow": torch.pow}
_UNARY_OUT = {"exp": torch.exp, "tanh": torch.tanh, "sqrt": torch.sqrt, "rsqrt": torch.rsqrt, "neg": torch.neg,
              "relu": None, "sigmoid": torch.sigmoid, "erf": torch.erf, "log": torch.log, "abs": torch.abs}


class KernelProvider:
    """Builds steps for a plan's fused instructions. The default provides none (every fused
    group runs through reference ops); backends/cpu/provider.py plugs in generated kernels."""

    report: dict = {}

    def build(self, plan: ExecutionPlan, views: Mapping[str, torch.Tensor],
              constants: Mapping[str, torch.Tensor]) -> dict[int, Callable[[], None]]:
        return {}


_ACTIVE = threading.local()


def active_tactics():
    """The GEMM tactics context of the executable being bound on this thread (or None)."""
    return getattr(_ACTIVE, "ctx", None)


class CpuExecutable:
    """`tactics`: GEMM tactic selection for linear/matmul (backends/cpu/tactics.py). None =
    on when the kernel provider builds generated kernels (a compiler is there), with the
    timing cache next to the provider's kernel cache; a policy name (`latency_first`,
    `throughput_first`, `heuristic`) = the same with that policy; a `TacticsContext` = that
    one; False = off (ATen runs every GEMM). `tactics_report` says what won per GEMM shape."""

    def __init__(self, plan: ExecutionPlan, constants: Mapping[str, torch.Tensor], *,
                 kernels: KernelProvider | None = None, threads: int | None = None, tactics=None):
        self.plan = plan
        self.threads = threads
        self.lock = threading.Lock()   # one arena: runs on one executable are serialised
        self.arena = torch.empty(max(plan.arena_bytes, 1), dtype=torch.uint8)
        self.consts = {k: constants[k].contiguous() for k in plan.constants if k in constants}
        self.views: dict[str, torch.Tensor] = {}
        for name, slot in plan.slots.items():
            if slot.const is not None:
                self.views[name] = self.consts[slot.const]
            else:
                raw = self.arena[slot.offset: slot.offset + slot.nbytes]
                self.views[name] = raw.view(DTYPES[slot.dtype]).view(slot.shape)
        t0 = time.perf_counter()
        provider = kernels or KernelProvider()
        self.tactics = _tactics_context(tactics, provider, threads, self.consts)
        prev = active_tactics()
        _ACTIVE.ctx = self.tactics
        try:
            self.kernel_fns = provider.build(plan, self.views, self.consts)
            self.kernel_report = dict(getattr(provider, "report", {}))
            self.kernel_build_s = time.perf_counter() - t0
            self.steps: list[Callable[[], None]] = []
            self.step_names: list[str] = []
            self.generated = 0
            for ins in plan.instructions:
                fn = self._bind(ins)
                if fn is not None:
                    self.steps.append(fn)
                    kind = "native" if ins.kind == "aten" and ins.node_index in self.kernel_fns else ins.kind
                    self.step_names.append(f"{kind}:{ins.op}")
        finally:
            _ACTIVE.ctx = prev
        self.tactics_report: dict = {}
        self.tactics_s = 0.0
        if self.tactics is not None:
            t1 = time.perf_counter()
            try:
                self.tactics.finalize()
            except Exception as e:  # noqa: BLE001 - tuning is an optimisation: every step still runs ATen
                log.warning("GEMM tactic selection failed; ATen runs every GEMM: %s", e)
                self.tactics_report["error"] = str(e)
            self.tactics_s = time.perf_counter() - t1
            self.tactics_report.update(self.tactics.report())
            self.tactics_report["seconds"] = round(self.tactics_s, 3)

    # ---- binding -------------------------------------------------------------------------
    def _bind(self, ins: Instruction) -> Callable[[], None] | None:
        v = self.views
        ins_t = [v[i] for i in ins.inputs]
        outs = [v[o] for o in ins.outputs]
        a = ins.attrs
        env = self.plan.env
        if ins.kind == "view":
            return None
        if ins.kind == "kernel":
            node = self.plan.body_graphs.get(ins.node_index)
            fn = self.kernel_fns.get(ins.node_index)
            if fn is not None:
                self.generated += 1
                return fn
            if node is None:
                raise BackendError(f"fused instruction #{ins.node_index} has no body", fix="recompile the plan")
            return _ref_step(lambda: run_node(node, ins_t, env), outs)
        if ins.kind == "fallback":
            return _ref_step(lambda: run_fallback(ins_t, a, env), outs)
        native = self.kernel_fns.get(ins.node_index)
        if native is not None:     # a generated kernel for this single op (backends/cpu/native.py)
            self.generated += 1
            return native
        return aten_step(ins.op, ins_t, outs, a, env)

    # ---- running -------------------------------------------------------------------------
    def run(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copy inputs into their slots, run every step, return copies of the outputs."""
        with self.lock, torch.inference_mode():
            for name in self.plan.inputs:
                self.views[name].copy_(inputs[name])
            for step in self.steps:
                step()
            return {o: self.views[o].clone() for o in self.plan.outputs}

    def profile(self, inputs: Mapping[str, torch.Tensor], runs: int = 5) -> list[tuple[str, float]]:
        """Median seconds per step over `runs` runs (for `graphmode profile`)."""
        import statistics
        times: list[list[float]] = [[] for _ in self.steps]
        with self.lock, torch.inference_mode():
            for _ in range(runs):
                for name in self.plan.inputs:
                    self.views[name].copy_(inputs[name])
                for i, step in enumerate(self.steps):
                    t0 = time.perf_counter()
                    step()
                    times[i].append(time.perf_counter() - t0)
        return [(n, statistics.median(t)) for n, t in zip(self.step_names, times)]


def aten_step(op: str, ins_t: list[torch.Tensor], outs: list[torch.Tensor], a: Mapping, env: Mapping[str, int],
              tactics=None, epilogue=None) -> Callable[[], None]:
    """A closure running core op `op` into preallocated `outs` (ATen out= variants where they exist).

    `linear` / `matmul` / `conv2d` go through tactic selection (backends/cpu/tactics.py) when a
    tactics context is given or active (`CpuExecutable` activates its own while it binds,
    which also covers the GEMMs of generated gemm_epilogue groups); else ATen. `epilogue`
    (a tactics.FusedEpilogue) is offered to the selected step: one that takes it has
    `fused_epilogue` set and runs the epilogue itself."""
    y = outs[0]
    if op in ("linear", "matmul"):
        fn = _gemm_closure(op, ins_t, y)
        ctx = tactics if tactics is not None else active_tactics()
        if ctx is None:
            return fn
        from graphmode.backends.cpu.tactics import select_gemm
        return select_gemm(ctx, op, ins_t, outs, a, env, default=fn, epilogue=epilogue)
    if op in _BINARY_OUT and y.dtype == torch.result_type(*ins_t):
        f, x0, x1 = _BINARY_OUT[op], ins_t[0], ins_t[1]
        return lambda: f(x0, x1, out=y)
    if op == "relu":
        x0 = ins_t[0]
        return lambda: torch.clamp_min(x0, 0, out=y)
    if op in _UNARY_OUT and _UNARY_OUT[op] is not None:
        f, x0 = _UNARY_OUT[op], ins_t[0]
        return lambda: f(x0, out=y)
    if op == "embedding":
        w, idx = ins_t
        y2, flat = y.view(-1, w.shape[1]), idx.view(-1)
        return lambda: torch.index_select(w, 0, flat, out=y2)
    if op == "softmax" and y.dtype == ins_t[0].dtype:
        x0, dim = ins_t[0], a["dim"]
        return lambda: torch._softmax(x0, dim, False, out=y)
    if op == "gelu":
        x0, approx = ins_t[0], a.get("approximate", "none")
        return lambda: torch._C._nn.gelu(x0, approximate=approx, out=y)
    if op == "conv2d":
        x0, w = ins_t[0], ins_t[1]
        b = ins_t[2] if len(ins_t) > 2 else None
        s, p, d = _pair(a.get("stride", 1)), _pair(a.get("padding", 0)), _pair(a.get("dilation", 1))
        g = a.get("groups", 1)
        conv = torch.ops.aten.convolution.out
        fn = lambda: conv(x0, w, b, s, p, d, False, [0, 0], g, out=y)  # noqa: E731
        ctx = tactics if tactics is not None else active_tactics()
        if ctx is None:
            return fn
        from graphmode.backends.cpu.tactics import select_conv
        return select_conv(ctx, ins_t, outs, a, default=fn, epilogue=epilogue)
    if op == "permute":
        x0, perm = ins_t[0], a["perm"]
        return lambda: y.copy_(x0.permute(perm))
    if op == "reshape":
        x0 = ins_t[0]
        return lambda: y.copy_(x0.reshape(y.shape))
    spec = get_op(op)
    return _ref_step(lambda: spec.ref(ins_t, a, env), outs)


def _gemm_closure(op: str, ins_t: list[torch.Tensor], y: torch.Tensor) -> Callable[[], None]:
    """The ATen GEMM step (what runs without tactics, and the `aten` tactic)."""
    if op == "linear":
        x, w = ins_t[0], ins_t[1]
        k, n = w.shape[1], w.shape[0]
        x2, y2, wt = x.view(-1, k), y.view(-1, n), w.t()
        if len(ins_t) > 2:
            b = ins_t[2]
            return lambda: torch.addmm(b, x2, wt, out=y2)
        return lambda: torch.mm(x2, wt, out=y2)
    x, w = ins_t
    if x.dim() == 3 and w.dim() == 3 and x.shape[0] == w.shape[0]:
        return lambda: torch.bmm(x, w, out=y)
    return lambda: torch.matmul(x, w, out=y)


def _tactics_context(tactics, provider: KernelProvider, threads: int | None, consts: Mapping[str, torch.Tensor]):
    """The executable's GEMM tactics context (see CpuExecutable), or None when tactics are off."""
    if tactics is False:
        return None
    from graphmode.backends.cpu.tactics import POLICIES, TacticsContext
    if isinstance(tactics, TacticsContext):
        ctx = tactics
    else:
        builder = getattr(provider, "builder", None)
        if tactics is None and builder is None:
            return None          # a provider without generated kernels: plain ATen, as before
        policy = tactics if isinstance(tactics, str) else "latency_first"
        if policy not in POLICIES:
            raise BackendError(f"unknown GEMM tactic policy {policy!r}", value=policy,
                               fix=f"one of {', '.join(POLICIES)}, or tactics=False")
        if builder is None:
            from graphmode.backends.cpu.provider import builder_for
            builder = builder_for(None, threads)
        try:
            if not builder.compiler_available():
                return None
        except Exception:  # noqa: BLE001
            return None
        ctx = TacticsContext(Path(builder.cache_dir).parent / "tactics", threads, policy=policy, builder=builder)
    ctx.add_constants(consts)
    return ctx


def _pair(v):
    return list(v) if isinstance(v, (list, tuple)) else [v, v]


def _ref_step(compute: Callable[[], list[torch.Tensor]], outs: list[torch.Tensor]) -> Callable[[], None]:
    if len(outs) == 1:
        y = outs[0]
        return lambda: y.copy_(compute()[0])

    def step() -> None:
        for o, r in zip(outs, compute()):
            o.copy_(r)
    return step
