"""A writer process of the knowledge-base concurrency test. Spawned: it imports only the store."""
from __future__ import annotations

import sys
import time

from graphmode.kb.store import KnowledgeBase


def write_many(path: str, recipe_name: str, n: int, barrier) -> None:
    """Wait at `barrier` for the other writer, then record `n` measurements, one transaction
    (and one open of the file) each; exits non-zero unless every one was new."""
    hw = {"fingerprint": "hw-shared", "name": "host", "kind": "cpu", "cpu_model": "test cpu", "isa": "x86_64",
          "arch": "zen3", "cores": 2, "simd": ["avx2"], "bandwidth_gbps": 10.0, "peak_f32_gflops": 100.0,
          "target": {"name": "host"}, "created": time.time()}
    model = {"fingerprint": "model-shared", "name": "mlp", "family": "mlp", "params": 10, "op_histogram": {"linear": 2},
             "layer_shapes": [[[4, 4], 2]], "inputs": {"x": ["f32", ["*", 4]]}, "created": time.time()}
    recipe = {"hash": f"hash-{recipe_name}", "name": recipe_name, "body": {"name": recipe_name}, "ir_hash": None,
              "graphmode_version": "0", "torch_version": "0", "origin": "measured", "parent": None,
              "created": time.time()}
    barrier.wait(timeout=300)
    added = 0
    for i in range(n):
        perf = {"uid": f"{recipe_name}-{i}", "source": "bench", "status": "ok", "reason": None, "bucket": {"batch": i},
                "p50_ms": float(i), "p99_ms": float(i) * 2, "p99_over_p50": 2.0, "throughput": 1.0,
                "peak_memory_mb": 1.0, "compile_s": 0.1, "numerics_err": 0.0, "threads": 1, "graphmode_version": "0",
                "torch_version": "0", "extra": {}, "created": time.time()}
        with KnowledgeBase(path) as kb:
            added += kb.add(hw, model, recipe, perf)
    sys.exit(0 if added == n else 1)
