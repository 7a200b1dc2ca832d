"""A CI-sized sample of the robustness sweep (`make fuzz`, graphmode/fuzz): every fuzzer runs
a few seeded cases end to end (real compiles, real SQLite, a real server) and none may end in a
traceback, hang, signal, HTTP 5xx, or an invalid input accepted."""
from __future__ import annotations

import pytest

from graphmode.fuzz.run import run_family

SEED = 20261203
# a kernel rebuild costs seconds: the library cases run in test_build and test_cache_tamper
CACHE_SAMPLE = {("file", "plan", "fifo"), ("file", "meta", "dev-zero"), ("file", "plan", "sparse-huge"),
                ("file", "seal", "garbage"), ("folder", None, "entry-is-link"), ("plan-edit", None, None)}
SAMPLES = {  # fuzzer -> (cases generated, which of them run)
    "recipes": (40, None),
    "kb": (40, None),
    "artifacts": (60, lambda c: c["kind"] in ("flip", "special", "manifest", "add") and int(c["id"][:3]) % 3 == 0
                  or c["kind"] == "special"),
    "caches": (100, lambda c: (c["kind"], c.get("target"), c.get("damage")) in CACHE_SAMPLE and not c.get("cli")
               and (c["kind"] != "plan-edit" or c["seed"] % 8 == 0)),
    "onnx": (9, lambda c: c["kind"] != "proto" or c["edit"] in ("init-dims", "op-unknown", "input-dim-0")),
    "http": (60, lambda c: c["server"] == "encoder"),
}


@pytest.mark.parametrize("family", sorted(SAMPLES))
def test_fuzz_sample_has_no_failure(family, tmp_path):
    n, keep = SAMPLES[family]
    results = run_family(family, n, SEED, tmp_path, select=keep)
    assert results
    failed = [f"{r.case}: {r.outcome}: {r.detail}" for r in results if r.failed]
    assert not failed, "\n".join(failed)
