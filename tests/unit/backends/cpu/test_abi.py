"""The kernel ABI is written in one place: entry points, symbols named by content, templates
whose documentation is not kernel text, translation units holding each kernel once."""
from __future__ import annotations

import re

import torch

from graphmode.backends.cpu.abi import TEMPLATES, entry_point, kernel_source, template, translation_unit
from graphmode.backends.cpu.attention import AttnProblem, attention_source
from graphmode.backends.cpu.catalog import native_source
from graphmode.backends.cpu.codegen import generate
from graphmode.backends.cpu.conv import ConvProblem
from graphmode.backends.cpu.gemm import GemmConfig, GemmProblem, generate_gemm
from graphmode.backends.cpu.im2col import Im2colConfig
from graphmode.backends.cpu.winograd import WinogradConfig
from graphmode.ir import parse_graph
from graphmode.ir.types import TensorType


def test_entry_point_and_symbol():
    lines = entry_point(3, ["  body;"])
    assert lines == ["GM_EXPORT void @SYM@(void* p0, void* p1, void* p2) {", "  body;", "}",
                     "GM_EXPORT void @SYM@_packed(void** p) { @SYM@(p[0], p[1], p[2]); }"]
    a = kernel_source("k", "\n".join(lines), inputs=("x", "y"), outputs=("z",), types={}, kind="native")
    b = kernel_source("k", "\n".join(lines) + " ", inputs=("x", "y"), outputs=("z",), types={}, kind="native")
    assert re.fullmatch(r"gm_k_[0-9a-f]{16}", a.symbol) and a.symbol != b.symbol and "@SYM@" not in a.source
    assert a.packed_symbol == a.symbol + "_packed" and a.args == ("x", "y", "z")


def test_templates_are_documented_and_their_documentation_is_not_kernel_text():
    names = sorted(p.name for p in TEMPLATES.glob("*.h"))
    assert {"prelude.h", "library.h", "gemm.h", "attention.h", "attention_task.h", "pool.h", "winograd.h"} <= set(names)
    for name in names:
        raw = (TEMPLATES / name).read_text()
        assert raw.startswith("//"), name           # every template says what it is for
        text = template(name)
        lines = raw.split("\n")
        body = "\n".join(lines[next(i for i, ln in enumerate(lines) if not ln.startswith("//")):])
        for ln in body.split("\n"):
            if ln.startswith("@include "):
                body = body.replace(ln, template(ln.split()[1]))
        assert not text.startswith("//") and text == body, name


def test_an_included_template_is_its_text_once_per_translation_unit():
    """`@include simd.h` is simd.h's text; its guard keeps the intrinsics header to one copy."""
    simd = template("simd.h")
    assert "#include <immintrin.h>" in simd and "#ifndef GM_SIMD_H" in simd
    for name in ("gemm.h", "attention.h", "wgemm.h"):
        assert simd in template(name) and "immintrin" not in (TEMPLATES / name).read_text().replace(
            "<immintrin.h> comes", ""), name


def _sources():
    g = parse_graph("""graph @g(%x: f32[4,8]) -> (%y) {
  %y: f32[4,8] = fused(%x) {"kind": "elementwise"} {
    %y: f32[4,8] = tanh(%x)
  }
  return %y
}""")
    x = torch.randn(2, 3, 8, 8)
    conv = ConvProblem(1, 4, 8, 8, 4, 3, 3, (1, 1), (1, 1), bias=True)
    gemm = GemmConfig("portable", 4, 16)
    q = TensorType("f32", (1, 2, 16, 8))
    return [generate(g.nodes[0], {k: v.type for k, v in g.values.items()}),
            generate_gemm(GemmProblem("linear", 1, 8, 16, 8, bias=True), gemm, 2),
            WinogradConfig(2, gemm).generate(conv, 2), Im2colConfig(gemm).generate(conv, 2),
            attention_source(AttnProblem(1, 2, 16, 16, 8, 8, 0.35, False), ["q", "k", "v"], ["o"],
                             {"q": q, "k": q, "v": q, "o": q}),
            native_source("max_pool2d", [x], [torch.empty(2, 3, 4, 4)], {"kernel": [2, 2]}, {}, ["x"], ["y"]),
            native_source("permute", [x], [torch.empty(2, 8, 8, 3)], {"perm": [0, 2, 3, 1]}, {}, ["x"], ["y"])]


def test_every_generator_exports_the_abi_entry_points():
    for ks in _sources():
        n = len(ks.args)
        params = ", ".join(f"void* p{i}" for i in range(n))
        call = ", ".join(f"p[{i}]" for i in range(n))
        assert ks.source.count(f"GM_EXPORT void {ks.symbol}({params}) {{") == 1, ks.kind
        assert ks.source.count(f"GM_EXPORT void {ks.symbol}_packed(void** p) {{ {ks.symbol}({call}); }}") == 1


def test_translation_unit_holds_the_prelude_once_and_each_kernel_once():
    srcs = _sources()
    tu = translation_unit(srcs + srcs[:2])
    assert tu.count(template("prelude.h")) == 1 and tu.count("gm_set_threads") == 1
    for ks in srcs:
        assert tu.count(f"GM_EXPORT void {ks.symbol}_packed(") == 1
    assert "gm_set_threads" not in translation_unit(srcs, defs=False)      # a library's later parts
