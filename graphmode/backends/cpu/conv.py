"""Convolutions for the generated-kernel tactics: the problem, and pieces the kernels share.

A conv2d step is a `ConvProblem` (NCHW, fp32, constant weight); its candidates are ATen and
the generated kernels of winograd.py (3x3 stride 1: fewer multiplies) and im2col.py (any
ungrouped conv: a patch matrix times the packed weight on the GEMM micro-kernel). Every
candidate is a `ConvConfig`: it names itself, prepares the weight once (transformed and/or
packed), says how much zeroed workspace a step needs and generates its kernel
`symbol(x, w', [bias,] ws, y)`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Protocol, Sequence

import torch

from graphmode.backends.cpu.abi import KernelSource
from graphmode.backends.cpu.attrs import pair
from graphmode.backends.cpu.epilogue import Epilogue, conv_load
from graphmode.backends.cpu.omp_loops import omp_for
from graphmode.errors import BackendError


@dataclass(frozen=True)
class ConvProblem:
    """One conv2d instance as the executor sees it (NCHW, fp32, constant weight)."""

    n: int
    cin: int
    h: int
    w: int
    cout: int
    kh: int
    kw: int
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int] = (1, 1)
    groups: int = 1
    bias: bool = False
    dtype: str = "f32"
    op: str = "conv2d"
    epi: Epilogue | None = None     # an elementwise epilogue applied in the output stage (epilogue.py)

    @property
    def ho(self) -> int:
        return (self.h + 2 * self.padding[0] - self.dilation[0] * (self.kh - 1) - 1) // self.stride[0] + 1

    @property
    def wo(self) -> int:
        return (self.w + 2 * self.padding[1] - self.dilation[1] * (self.kw - 1) - 1) // self.stride[1] + 1

    @property
    def flops(self) -> float:
        """Direct-convolution FLOPs (what the GFLOP/s of every candidate are quoted against)."""
        return 2.0 * self.n * self.cout * self.ho * self.wo * self.cin // self.groups * self.kh * self.kw

    @property
    def text(self) -> str:
        s = f"s{self.stride[0]}" if self.stride[0] == self.stride[1] else f"s{self.stride[0]}x{self.stride[1]}"
        p = f"p{self.padding[0]}" if self.padding[0] == self.padding[1] else f"p{self.padding[0]}x{self.padding[1]}"
        extra = "+bias" if self.bias else ""
        extra += f"+{self.epi.text}" if self.epi is not None else ""
        return (f"conv2d {self.n}x{self.cin}x{self.h}x{self.w} * {self.cout}x{self.cin // self.groups}x{self.kh}x"
                f"{self.kw} {s} {p}{extra} {self.dtype}")

    def key(self) -> dict:
        return {"op": self.op, "n": self.n, "cin": self.cin, "h": self.h, "w": self.w, "cout": self.cout,
                "kh": self.kh, "kw": self.kw, "stride": list(self.stride), "padding": list(self.padding),
                "dilation": list(self.dilation), "groups": self.groups, "bias": self.bias, "dtype": self.dtype,
                **({"epilogue": self.epi.digest, "epilogue_kinds": list(self.epi.kinds)} if self.epi else {})}

    @property
    def b_packed(self) -> bool:
        """The weight is a constant transformed ahead of time (what GemmProblem calls packed)."""
        return True

    @property
    def winograd_ok(self) -> bool:
        return (self.kh, self.kw) == (3, 3) and self.stride == (1, 1) and self.dilation == (1, 1) \
            and self.groups == 1 and self.dtype == "f32" and self.ho > 0 and self.wo > 0 \
            and max(self.padding) <= 2


def conv_problem_of(ins_t: Sequence[torch.Tensor], outs: Sequence[torch.Tensor], attrs: Mapping,
                    constant_ptrs: Mapping[int, Any] | set[int] | None = None) -> ConvProblem | None:
    """The conv a step computes, or None when only ATen can run it (non-f32, non-contiguous,
    a weight that is not a constant, not 4-d)."""
    x, wt, y = ins_t[0], ins_t[1], outs[0]
    tensors = list(ins_t) + [y]
    if any(t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu" for t in tensors):
        return None
    if x.dim() != 4 or wt.dim() != 4 or wt.data_ptr() not in (constant_ptrs or ()):
        return None
    groups = int(attrs.get("groups", 1) or 1)
    stride, padding, dilation = (pair(attrs.get(k, d)) for k, d in (("stride", 1), ("padding", 0), ("dilation", 1)))
    if stride is None or padding is None or dilation is None:
        return None
    p = ConvProblem(x.shape[0], x.shape[1], x.shape[2], x.shape[3], wt.shape[0], wt.shape[2], wt.shape[3],
                    stride, padding, dilation, groups, bias=len(ins_t) > 2 and ins_t[2] is not None)
    if tuple(y.shape) != (p.n, p.cout, p.ho, p.wo) or wt.shape[1] * groups != p.cin:
        return None
    return p


class ConvConfig(Protocol):
    """What tactic selection (tactics/) needs of a generated conv candidate."""

    @property
    def name(self) -> str: ...

    def applies(self, p: ConvProblem) -> bool: ...

    def prepare_weight(self, w: torch.Tensor) -> torch.Tensor: ...

    def weight_key(self) -> tuple: ...

    def workspace_numel(self, p: ConvProblem) -> int: ...

    def generate(self, p: ConvProblem, threads: int) -> KernelSource: ...


@dataclass(frozen=True)
class WholeWeightConfig:
    """A conv candidate of one schedule that reads its weight as it is (the depthwise and 1x1
    kernels): a subclass names itself (NAME, WHAT) and says which convs it covers and how it is
    generated."""

    NAME: ClassVar[str] = ""
    WHAT: ClassVar[str] = ""

    @property
    def name(self) -> str:
        return self.NAME

    @classmethod
    def parse(cls, name: str) -> "WholeWeightConfig":
        if name != cls.NAME:
            raise BackendError(f"not a {cls.WHAT} candidate name: {name!r}", value=name, fix=cls.NAME)
        return cls()

    def prepare_weight(self, w: torch.Tensor) -> torch.Tensor:
        """The weight as it is (a channel's weights contiguous)."""
        return w.contiguous().reshape(-1)

    def weight_key(self) -> tuple:
        return (self.NAME,)

    def workspace_numel(self, p: ConvProblem) -> int:
        return 0


def nhwc_pack_lines(p: ConvProblem, cp: int, hp: int, wp: int, par: bool) -> list[str]:
    """C++ for `@SYM@_pack(x, xp)`: NCHW input -> zero-padded NHWC [N][hp][wp][cp], through
    16x16 stack tiles so that both sides are read/written in runs. It writes the padding border
    and the channels >= C too (zeros), so a workspace needs no zeroing and one buffer serves
    every conv of a plan (tactics/context.py): a zero border kept from allocation used to pin
    one workspace per conv shape (150 MB for ResNet-18 at batch 8). `par`: rows in parallel."""
    ph, pw = p.padding
    return [
        "void @SYM@_pack(const float* __restrict x, float* __restrict xp) {",
        f"  constexpr long N = {p.n}, C = {p.cin}, H = {p.h}, W = {p.w}, CP = {cp}, HP = {hp}, WP = {wp};",
        f"  constexpr long PH = {ph}, PW = {pw}, RIGHT = WP - PW - W > 0 ? WP - PW - W : 0;",
        "  " + omp_for(p.n * hp, p.n * hp * wp * cp) if par else "",
        "  for (long r = 0; r < N * HP; ++r) {",
        "    const long n = r / HP, iy = r % HP - PH;",
        "    float* row = xp + r * WP * CP;",
        "    if (iy < 0 || iy >= H) {",
        "      for (long i = 0; i < WP * CP; ++i) row[i] = 0.0f;",
        "      continue;",
        "    }",
        "    for (long i = 0; i < PW * CP; ++i) row[i] = 0.0f;",
        "    for (long i = 0; i < RIGHT * CP; ++i) row[(PW + W) * CP + i] = 0.0f;",
        "    if (CP > C)",
        "      for (long i = 0; i < W; ++i)",
        "        for (long c = C; c < CP; ++c) row[(PW + i) * CP + c] = 0.0f;",
        "    const float* xs = x + (n * C * H + iy) * W;",
        "    float* xd = row + PW * CP;",
        "    for (long c0 = 0; c0 < C; c0 += 16) {",
        "      const long cn = C - c0 < 16 ? C - c0 : 16;",
        "      for (long x0 = 0; x0 < W; x0 += 16) {",
        "        const long xn = W - x0 < 16 ? W - x0 : 16;",
        "        float tile[16][16];",
        "        for (long c = 0; c < cn; ++c)",
        "          for (long i = 0; i < xn; ++i) tile[i][c] = xs[(c0 + c) * H * W + x0 + i];",
        "        for (long i = 0; i < xn; ++i)",
        "          for (long c = 0; c < cn; ++c) xd[(x0 + i) * CP + c0 + c] = tile[i][c];",
        "      }",
        "    }",
        "  }",
        "}",
    ]


def epilogue_store(p: ConvProblem, dst: str, acc: str, indent: str) -> list[str]:
    """C++ storing one output element `acc` to `dst` through the problem's epilogue (if any);
    `idx` (flat NCHW index) and `co` (channel) must be in scope, operands are `e<k>`."""
    if p.epi is None:
        return [f"{indent}{dst} = {acc};"]
    loads = [conv_load(k, i) for i, k in enumerate(p.epi.kinds)]
    return [f"{indent}{{", *p.epi.render(acc, loads, indent + "  "), f"{indent}  {dst} = res;", f"{indent}}}"]


def epilogue_types(p: ConvProblem) -> dict:
    from graphmode.ir.types import TensorType
    shapes = {"full": (p.n, p.cout, p.ho, p.wo), "chan": (p.cout,), "scalar": (1,)}
    return {f"e{i}": TensorType("f32", shapes[k]) for i, k in enumerate(p.epi.kinds if p.epi is not None else ())}


@dataclass(frozen=True)
class ConvArgs:
    """The arguments every conv kernel takes, `symbol(x, w', [bias,] e0.., ws, y)` (the
    entry point itself is abi.entry_point's), and the C fragments its body needs to address
    them."""

    inputs: tuple[str, ...]   # KernelSource.inputs (y is the only output)
    bias: str                 # the bias pointer expression (or nullptr)
    ws: str                   # the workspace parameter
    out: str                  # the output pointer expression
    stage_params: str         # ", const float* e0, ..." for the stage that applies the epilogue
    stage_args: str           # ", (const float*)pK, ..." to pass the epilogue operands to that stage

    @property
    def nargs(self) -> int:
        return len(self.inputs) + 1


def conv_args(p: ConvProblem, weight: str) -> ConvArgs:
    n = len(p.epi.kinds) if p.epi is not None else 0
    inputs = ("x", weight) + (("bias",) if p.bias else ()) + tuple(f"e{i}" for i in range(n)) + ("ws",)
    first = len(inputs) - 1 - n
    return ConvArgs(inputs, "(const float*)p2" if p.bias else "nullptr", f"p{len(inputs) - 1}",
                    f"(float*)p{len(inputs)}", "".join(f", const float* __restrict e{i}" for i in range(n)),
                    "".join(f", (const float*)p{first + i}" for i in range(n)))


__all__ = ["ConvProblem", "ConvConfig", "conv_problem_of", "nhwc_pack_lines", "epilogue_store", "epilogue_types",
           "ConvArgs", "conv_args"]
