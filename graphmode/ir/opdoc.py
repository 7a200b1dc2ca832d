"""Render docs/ops.md from the op table, so the documentation cannot drift from the code."""
from __future__ import annotations

from graphmode.ir.ops import OPS

HEADER = """# The graphmode core op set

Generated from `graphmode/ir/ops.py` by `python -m graphmode.ir.opdoc > docs/ops.md`
(a test checks it is current). Semantics follow the PyTorch eager function each op's
reference implementation calls; both importers (torch.export, ONNX) lower into these ops.

- Dims in attributes (`reshape.shape`, `expand.shape`, `slice.end`, `arange.end`, `full.shape`)
  are ints or expressions over the recipe's dims (e.g. `"seq*12"`), evaluated per bucket.
- Elementwise binary ops broadcast like NumPy and promote dtypes like torch (0-d constants act
  as scalars). `inplace` ops may write their output over input 0; `view` ops alias input 0.
- `fused` nodes carry a body (a region of these ops) run as one kernel; `fallback` nodes keep an
  op graphmode does not compile and run it eagerly through `torch.ops` (hybrid mode).

| op | kind | inputs | attributes | in-place | semantics |
|---|---|---|---|---|---|
"""


def render() -> str:
    rows = []
    for name in sorted(OPS, key=lambda n: (OPS[n].kind, n)):
        s = OPS[name]
        lo, hi = s.arity
        arity = str(lo) if lo == hi else f"{lo}..{hi}"
        flags = "view" if s.view else ("yes" if s.inplace else "")
        rows.append(f"| `{name}` | {s.kind} | {arity} | {', '.join(s.attrs)} | {flags} | {s.doc} |")
    return HEADER + "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(render(), end="")
