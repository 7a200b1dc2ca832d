"""Dtype tables and the documented ranges of recipe values (examples/recipes/README.md).

A leaf module: the schema checks values against these ranges, and bucket synthesis,
semantics and the cost facts read the same numbers without importing the schema.
"""
from __future__ import annotations

DTYPE_SIZES: dict[str, int] = {"f64": 8, "f32": 4, "tf32": 4, "f16": 2, "bf16": 2, "fp8_e4m3": 1,
                               "fp8_e5m2": 1, "i64": 8, "i32": 4, "i16": 2, "i8": 1, "u64": 8, "u32": 4,
                               "u16": 2, "u8": 1, "bool": 1}
FLOAT_DTYPES = ("f64", "f32", "tf32", "f16", "bf16", "fp8_e4m3", "fp8_e5m2")
DTYPE_ALIASES = {"float64": "f64", "fp64": "f64", "double": "f64", "float32": "f32", "fp32": "f32",
                 "float": "f32", "float16": "f16", "fp16": "f16", "half": "f16", "bfloat16": "bf16",
                 "fp8": "fp8_e4m3", "int64": "i64", "long": "i64", "int32": "i32", "int": "i32",
                 "int16": "i16", "int8": "i8", "uint8": "u8", "uint16": "u16", "uint32": "u32", "uint64": "u64"}

# Finite representable ranges of the float dtypes, and significand bits (integers up to
# 2**bits are exact): a pad value outside them would be written as inf or rounded.
FLOAT_LIMITS: dict[str, tuple[float, int]] = {
    "f64": (1.7976931348623157e308, 53), "f32": (3.4028234663852886e38, 24), "tf32": (3.4028234663852886e38, 24),
    "f16": (65504.0, 11), "bf16": (3.3895313892515355e38, 8), "fp8_e4m3": (448.0, 4), "fp8_e5m2": (57344.0, 3)}
INT_LIMITS: dict[str, tuple[int, int]] = {
    "i64": (-2**63, 2**63 - 1), "i32": (-2**31, 2**31 - 1), "i16": (-2**15, 2**15 - 1), "i8": (-128, 127),
    "u64": (0, 2**64 - 1), "u32": (0, 2**32 - 1), "u16": (0, 2**16 - 1), "u8": (0, 255), "bool": (0, 1)}

# ---- documented ranges (examples/recipes/README.md); each keeps the proofs' arithmetic exact and fast
MAX_DIM = 2**31 - 1          # a dim value, bucket or fixed extent: tensor extents are int32 in kernels
MAX_RANK = 8                 # input/output rank, as ONNX runtimes, TensorRT and cuDNN descriptors allow
MAX_BUCKETS = 65_536         # buckets of one dim (explicit, synthesised or a step grid); one plan each
MAX_INPUTS = 256
MAX_VALUE_ELEMS = 4096       # inputs[].value: a constant input is shape-like data (axes, sizes, pads), not weights
MAX_DIMS = 64                # symbolic dims: each is a variable of every proof, with a cover proof of its own
MAX_LIST = 256               # ops, passes, alias groups, bank ids: hand-written lists
MAX_SLA_ENTRIES = 64         # sla.per_bucket: each entry is one Z3 proof
MAX_TARGETS = 16
MAX_NAME_CHARS = 128         # the recipe name is a file name and a metric label
MAX_MB = 2.0**30             # 1 PiB: budgets and weights larger than any machine's memory
MAX_PARAMS_M = 1e7           # 10 trillion parameters
MAX_GFLOPS = 1e9             # 1 EFLOP per batch item
MAX_MS = 86_400_000.0        # one day: latency bounds
MAX_FACTOR = 1e6             # activation_factor (x input bytes)
