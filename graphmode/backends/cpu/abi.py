"""The kernel ABI: what every generated kernel exports, and the one place that writes it.

A kernel is C++ text with `@SYM@` where its symbol goes. It exports

- `symbol(void* p0, ..., void* pN-1)`: the arguments are buffer addresses, the kernel's
  inputs then its outputs (`KernelSource.args`), each a contiguous row-major buffer;
- `symbol_packed(void** p)`: the same call with the addresses in one array, which is what a
  bound plan step calls (one ctypes argument instead of N);
- `symbol_status()` (only where `KernelSource.status` is set): the count of invalid input
  elements since the last call, reset on read (kernels.py raises `status` when non-zero).

The symbol is `gm_<prefix>_<sha256 of the text>`, so identical kernels (the same op chain in
every layer) are one symbol, and a changed kernel is a new one (the tactics' timing cache
keys on it). Static C++ lives in `templates/*.h`; generators write only the parts that
depend on the shapes. A shared library holds the prelude once and every distinct kernel.
"""
from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from graphmode.ir.graph import Node
from graphmode.ir.types import TensorType

SYM = "@SYM@"
TEMPLATES = Path(__file__).parent / "templates"


@functools.lru_cache(maxsize=None)
def template(name: str) -> str:
    """The C++ of `templates/<name>`. A template opens with `//` lines that document it for
    its readers; the kernel text starts after them, so editing that documentation changes no
    kernel symbol (and invalidates no cached library or timing). A line `@include other.h`
    stands for that template's text."""
    lines = (TEMPLATES / name).read_text().split("\n")
    k = 0
    while k < len(lines) and lines[k].startswith("//"):
        k += 1
    # `@include other.h` (a line of its own) is that template's text: shared headers such as
    # simd.h are written once; their own include guards keep a translation unit to one copy
    return "\n".join(template(ln.split()[1]) if ln.startswith("@include ") else ln for ln in lines[k:])


@dataclass(frozen=True)
class KernelSource:
    """One generated kernel over `args` (inputs then outputs, each a contiguous row-major
    buffer of `types[name]`); see the module doc for what it exports.

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
    kind: str                                  # elementwise | rowwise | gemm | winograd | im2col | native | attention
    may_alias: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    parallel: bool = False
    gemm: Node | None = None
    folded: tuple[str, ...] = ()
    pattern: str = ""
    status: str = ""   # set: the library exports `symbol_status()`; a bound step raises this message
    # (arg, float offset): an int the kernel sets on a call it could not compute as eager does
    # (a Winograd tile holding inf); the bound step then runs its fallback for that call
    fallback_flag: tuple[str, int] | None = None

    @property
    def args(self) -> tuple[str, ...]:
        return self.inputs + self.outputs

    @property
    def packed_symbol(self) -> str:
        return self.symbol + "_packed"

    @property
    def status_symbol(self) -> str:
        return self.symbol + "_status"

    def translation_unit(self) -> str:
        return translation_unit([self])


def kernel_source(prefix: str, text: str, **fields) -> KernelSource:
    """The KernelSource of kernel text `text` (with `@SYM@` placeholders), named by its hash."""
    symbol = f"gm_{prefix}_{hashlib.sha256(text.encode()).hexdigest()[:16]}"
    return KernelSource(symbol=symbol, source=text.replace(SYM, symbol), **fields)


def entry_point(nargs: int, body: Sequence[str]) -> list[str]:
    """The exported functions of a kernel taking `nargs` buffers: `@SYM@(void* p0, ...)`
    around `body` (lines), and `@SYM@_packed(void** p)` calling it."""
    params = ", ".join(f"void* p{i}" for i in range(nargs))
    call = ", ".join(f"p[{i}]" for i in range(nargs))
    return [f"GM_EXPORT void {SYM}({params}) {{", *body, "}",
            f"GM_EXPORT void {SYM}_packed(void** p) {{ {SYM}({call}); }}"]


def status_export(counter: str) -> str:
    """`@SYM@_status()` over the kernel's atomic count of invalid elements `counter`
    (a `static long` the kernel defines), read and reset in one exchange."""
    return (f"static long {counter} = 0;\n"
            f"GM_EXPORT long {SYM}_status(void) {{ return __atomic_exchange_n(&{counter}, 0L, __ATOMIC_RELAXED); }}")


def translation_unit(sources: Iterable[KernelSource], *, defs: bool = True) -> str:
    """One C++ file holding the prelude and every distinct kernel (deduplicated by symbol).
    `defs`: also define what the prelude only declares (once per shared library)."""
    seen: dict[str, str] = {}
    for s in sources:
        seen.setdefault(s.symbol, s.source)
    head = template("prelude.h") + (template("library.h") if defs else "")
    return head + "\n" + "\n".join(seen[k] for k in sorted(seen))


__all__ = ["KernelSource", "kernel_source", "entry_point", "status_export", "translation_unit", "template", "SYM"]
