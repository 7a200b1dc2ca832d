"""Shared by the kernel tests: a KernelBuilder for one ISA cap, or a skip saying why not."""
from __future__ import annotations

import pytest

from graphmode.backends.cpu.build import KernelBuilder


@pytest.fixture(scope="session")
def isa_builder(tmp_path_factory):
    """`isa_builder(isa, tag)`: a builder whose flags select `isa`'s code path (2 threads), in
    its own folder; skips without a C++ compiler or one that cannot build that path here."""
    def make(isa: str, tag: str) -> KernelBuilder:
        builder = KernelBuilder(tmp_path_factory.mktemp(f"{tag}-{isa}"), threads=2, isa=isa)
        if not builder.compiler_available():
            pytest.skip(f"the compiler cannot build the {isa} path here: {builder.unavailable_reason}")
        return builder
    return make
