"""Recipe schema version 1 (pydantic, strict, unknown keys rejected): the recipe as data.

Layer 1 of verification: types, per-field ranges, power-of-two alignment, known names.
Cross-field rules (min <= max, dims declared, pass order...) live in `semantics.py`,
and the for-every-shape proofs in `constraints.py`. What is computed from a recipe (its
buckets, hash, symbolic values) lives in functions of `buckets.py`, `hashing.py` and
`symbolic.py`, none of which imports this module; `Recipe`'s methods only delegate to them.
"""
from __future__ import annotations

import math
import re
from typing import Annotated, Any, ClassVar, Literal, Mapping, Optional

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, PrivateAttr, Tag,
                      ValidationInfo, field_validator, model_serializer, model_validator)

import graphmode.recipe.buckets as bucketing
import graphmode.recipe.symbolic as symbolic
from graphmode.errors import TargetError
from graphmode.recipe.hashing import recipe_hash
from graphmode.recipe.limits import (DTYPE_ALIASES, DTYPE_SIZES, FLOAT_DTYPES, FLOAT_LIMITS, MAX_BUCKETS, MAX_DIM,
                                     MAX_DIMS, MAX_FACTOR, MAX_GFLOPS, MAX_INPUTS, MAX_LIST, MAX_MB, MAX_MS,
                                     MAX_NAME_CHARS, MAX_PARAMS_M, MAX_RANK, MAX_SLA_ENTRIES, MAX_TARGETS,
                                     MAX_VALUE_ELEMS)
from graphmode.recipe.lines import nearest_line
from graphmode.targets.registry import target_from_dict
from graphmode.targets.schema import Target
from graphmode.targets.units import number_hint

SCHEMA_VERSION = 1

FUSION_PATTERNS = ("elementwise", "reduction", "gemm_epilogue", "attention")   # = passes/fuse.py PATTERNS

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")        # matched with fullmatch: `$` accepts a trailing newline
_OPNAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")
# a model input's or output's name as the IR spells it: "input.1" (torch.onnx) as is; other
# characters of an ONNX name as "_" ("x:0" -> "x_0", graphmode.ir.graph.clean_name)
_VALUE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")


# ---- scalar types with teaching messages -------------------------------------------------

def _dtype(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError(f"expected a dtype name, one of: {', '.join(DTYPE_SIZES)}")
    v = DTYPE_ALIASES.get(v.strip().lower(), v.strip().lower())
    if v not in DTYPE_SIZES:
        raise ValueError(f"unknown dtype; valid: {', '.join(DTYPE_SIZES)} "
                         f"(aliases: {', '.join(sorted(DTYPE_ALIASES))})")
    return v


def _float_dtype(v: Any) -> str:
    v = _dtype(v)
    if v not in FLOAT_DTYPES:
        raise ValueError(f"expected a floating-point dtype, one of: {', '.join(FLOAT_DTYPES)}")
    return v


KV_DTYPES = ("f64", "f32", "f16", "bf16")      # what a paged pool stores (passes/to_paged.py): no fp8 or tf32 tensors


def _kv_dtype(v: Any) -> str:
    v = _float_dtype(v)
    if v not in KV_DTYPES:
        raise ValueError(f"a KV cache stores {', '.join(KV_DTYPES)}; {v} has no tensor type a pool could hold "
                         "(bf16 halves the f32 pool)")
    return v


def _pattern(rx: re.Pattern, what: str, max_chars: int | None = None):
    def check(v: Any) -> str:
        if not isinstance(v, str) or not rx.fullmatch(v):
            raise ValueError(f"expected {what}; fix: use only those characters (no spaces, newlines or unicode)")
        if max_chars is not None and len(v) > max_chars:
            raise ValueError(f"longer than {max_chars} characters; fix: shorten it")
        return v
    return check


def _fmt(x: float) -> str:
    if isinstance(x, int):
        return str(x)
    return str(int(x)) if x.is_integer() and abs(x) < 1e16 else f"{x:g}"


def _number(kind: type | None, *, gt: float | None = None, ge: float | None = None, lt: float | None = None,
            le: float | None = None, why: str = "", symbolic_ok: bool = False, unit: str = ""):
    """A number (int or float per `kind`; None keeps the type), optionally a `${...}` expression.
    The range is checked before any conversion, so 10**400 is an error, not an OverflowError."""
    def check(v: Any) -> Any:
        if symbolic_ok and symbolic.is_symbolic(v):
            try:
                symbolic.parse(v)
            except symbolic.SymbolicError as e:
                raise ValueError(str(e)) from None
            return v.strip()
        alt = " or a ${target...} expression" if symbolic_ok else ""
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not isinstance(v, int)):
            hint = f"; fix: {number_hint(v, unit or 'units')}" if isinstance(v, str) else ""
            raise ValueError(f"expected {'an integer' if kind is int else 'a number'}{alt}{hint}")
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError("expected a finite number; fix: write a number (not .inf or .nan)")
        bounds = [f"> {_fmt(gt)}" if gt is not None else "", f">= {_fmt(ge)}" if ge is not None else "",
                  f"< {_fmt(lt)}" if lt is not None else "", f"<= {_fmt(le)}" if le is not None else ""]
        if ((gt is not None and not v > gt) or (ge is not None and not v >= ge) or (lt is not None and not v < lt)
                or (le is not None and not v <= le)):
            rng = " and ".join(b for b in bounds if b)
            raise ValueError(f"out of range: must be {rng}" + (f" ({why})" if why else "")
                             + f"; fix: use a value {rng}")
        return v if kind is None else kind(v)
    return check


def _pow2(v: Any) -> int:
    v = _number(int, ge=1, le=MAX_DIM)(v)
    if v & (v - 1):
        lo = 1 << (v.bit_length() - 1)
        raise ValueError(f"must be a power of two (nearest: {lo} or {lo * 2})")
    return v


def _extent(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_DIM


def _shape_entry(v: Any) -> int | str:
    if _extent(v) or (isinstance(v, int) and not isinstance(v, bool) and v == 0):   # 0: an empty axis
        return v
    if isinstance(v, str) and _IDENT.fullmatch(v):
        return v
    if isinstance(v, int) and not isinstance(v, bool) and v > MAX_DIM:
        raise ValueError(f"fixed extent above {MAX_DIM} (tensor extents are int32 in kernels); "
                         f"fix: use an extent <= {MAX_DIM}")
    raise ValueError("expected a dim name (identifier declared under `dims`) or an integer >= 0")


def _constant(v: Any) -> Any:
    """An input's constant value: a number, a bool, or nested lists of them (rectangular)."""
    import numpy as np
    if v is None:
        return None
    try:
        arr = np.array(v)
    except ValueError:
        raise ValueError("expected a number or nested lists of numbers of one shape (ragged lists given)") from None
    if arr.dtype.kind not in "biuf":
        raise ValueError("expected a number, a bool or nested lists of them")
    if arr.size > MAX_VALUE_ELEMS:
        raise ValueError(f"{arr.size} elements, at most {MAX_VALUE_ELEMS} (a constant input is shape-like data: "
                         "axes, sizes, pads); fix: make larger constants initializers of the model")
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        raise ValueError("expected finite numbers; fix: write numbers (not .inf or .nan)")
    return arr.tolist()


def _bounded_list(n: int, why: str):
    """At most `n` entries (longer lists would make validation slow for no use)."""
    def check(v: Any) -> Any:
        if isinstance(v, (list, dict)) and len(v) > n:
            raise ValueError(f"{len(v)} entries, at most {n} allowed ({why}); fix: shorten the list")
        return v
    return check


def _pad_value(v: Any) -> int | float:
    """A fill value: booleans become 0/1; its fit in the input's dtype is checked in semantics."""
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, int) and abs(v) > FLOAT_LIMITS["f64"][0]:
        raise ValueError("no dtype holds this value; fix: a value in the input dtype's range")
    return _number(None)(v)


def _value_range(v: Any) -> list[int]:
    """`range: [lo, hi]` of an integer input: both ends included, lo <= hi (its fit in the
    input's dtype is checked in semantics)."""
    if (not isinstance(v, list) or len(v) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in v)):
        raise ValueError("expected [lo, hi]: two integers, both ends included")
    if v[0] > v[1]:
        raise ValueError(f"lo {v[0]} is above hi {v[1]}; fix: write [lo, hi] with lo <= hi")
    if abs(v[0]) > 2**64 or abs(v[1]) > 2**64:
        raise ValueError("no integer dtype holds these values; fix: bounds within the input dtype's range")
    return v


def _out_axis(v: Any) -> int | str:
    if v == "*":
        return v
    try:
        return _shape_entry(v)
    except ValueError:
        raise ValueError("expected a dim name (the axis follows it), a positive integer (fixed), "
                         "or '*' (any extent, not checked)") from None


def _bank(v: Any) -> int | str:
    if isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_DIM:
        return v
    if isinstance(v, str) and _IDENT.fullmatch(v):
        return v
    raise ValueError("expected a bank group name of the target (e.g. high_bandwidth) or a bank id >= 0")


def _specifier(v: Any) -> str:
    from packaging.specifiers import InvalidSpecifier, SpecifierSet
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        v = f">={v}"
    if not isinstance(v, str):
        raise ValueError("expected a version constraint string like '>=2.13,<2.14'")
    try:
        SpecifierSet(v)
    except InvalidSpecifier:
        raise ValueError("invalid version constraint; write e.g. '>=2.13,<2.14' or '==3.11.*'") from None
    return v


def _select(v: Any) -> int | list[int]:
    if _extent(v) or (isinstance(v, list) and len(v) == 2 and all(_extent(x) for x in v)):
        return v
    raise ValueError(f"expected a dim value (an int in [1, {MAX_DIM}]) or an inclusive range [lo, hi]")


def _version(v: Any) -> int:
    if v != SCHEMA_VERSION or isinstance(v, bool):
        raise ValueError(f"unsupported recipe version; this graphmode reads version {SCHEMA_VERSION}")
    return SCHEMA_VERSION


DType = Annotated[str, BeforeValidator(_dtype)]
FloatDType = Annotated[str, BeforeValidator(_float_dtype)]
KVDType = Annotated[str, BeforeValidator(_kv_dtype)]
Ident = Annotated[str, BeforeValidator(_pattern(_IDENT, "an identifier (letters, digits, _)"))]
OpName = Annotated[str, BeforeValidator(_pattern(_OPNAME, "an op name (letters, digits, _ and .)"))]
ValueName = Annotated[str, BeforeValidator(_pattern(_VALUE_NAME, "a name of letters, digits, _ and . (an ONNX "
                                                                 "name's other characters as _)", MAX_NAME_CHARS))]
PosInt = Annotated[int, BeforeValidator(_number(int, ge=1, le=MAX_DIM, why="int32"))]
MAX_EXACT_PLANS = 64      # values of one dim with plans of their own (each value: a plan per other bucket)
SymPosInt = Annotated[Any, BeforeValidator(_number(int, ge=1, le=MAX_DIM, why="int32", symbolic_ok=True))]
SymMB = Annotated[Any, BeforeValidator(_number(float, gt=0, le=MAX_MB, why="1 PiB", symbolic_ok=True, unit="MB"))]
SymMs = Annotated[Any, BeforeValidator(_number(float, gt=0, le=MAX_MS, why="one day", symbolic_ok=True, unit="ms"))]
Megabytes = Annotated[float, BeforeValidator(_number(float, gt=0, le=MAX_MB, why="1 PiB", unit="MB"))]
Ratio = Annotated[float, BeforeValidator(_number(float, ge=0, lt=1))]
Pow2 = Annotated[int, BeforeValidator(_pow2)]
PadValue = Annotated[Any, BeforeValidator(_pad_value)]      # int stays int, float stays float
ValueRange = Annotated[list[int], BeforeValidator(_value_range)]
ShapeEntry = Annotated[Any, BeforeValidator(_shape_entry)]
OutAxis = Annotated[Any, BeforeValidator(_out_axis)]
BankRef = Annotated[Any, BeforeValidator(_bank)]
Specifier = Annotated[str, BeforeValidator(_specifier)]
Selector = Annotated[Any, BeforeValidator(_select)]


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    # fields added after recipes were first hashed -> the value at which they are left out of
    # the serialized recipe, so the stamps of recipes that do not use them do not change
    _LATE: ClassVar[Mapping[str, Any]] = {}

    @model_serializer(mode="wrap")
    def _omit_late_defaults(self, handler: Any) -> Any:
        out = handler(self)
        if self._LATE and isinstance(out, dict):
            for k, v in self._LATE.items():
                if k in out and out[k] == v:
                    del out[k]
        return out


# ---- field groups ---------------------------------------------------------------------------

def _limited(n: int, why: str) -> Any:
    return BeforeValidator(_bounded_list(n, why))


class InputSpec(_Spec):
    """One model input: `shape` entries are dim names (declared under `dims`) or fixed ints
    (`[]` is a scalar, a 0 extent an empty axis).

    `role: attention_mask` marks a mask whose padded positions must read "masked out"
    (`pad_value` 0) along `mask_for` (default: every symbolic dim of the shape after axis 0,
    the batch axis); the padding-safety analysis relies on it. `value` declares the input
    constant (shape-like data a model takes as an input: axes, sizes, pads): the model is
    compiled for that value, and a call with another value is a contract violation."""
    name: ValueName
    dtype: DType
    shape: Annotated[list[ShapeEntry], _limited(MAX_RANK, f"rank at most {MAX_RANK}, as ONNX runtimes, "
                                                          "TensorRT and cuDNN allow")]
    pad_value: PadValue = 0
    role: Literal["data", "attention_mask"] = "data"
    mask_for: list[Ident] = []   # role, mask_for, range, value came after version 1: see hashing.INPUT_FIELDS_SINCE_V1
    range: Optional[ValueRange] = None    # integer inputs: every value in [lo, hi], checked at run time
    value: Annotated[Any, BeforeValidator(_constant)] = None

    @field_validator("pad_value", mode="before")
    @classmethod
    def _pad_bool_needs_bool(cls, v: Any, info: ValidationInfo) -> Any:
        """`true`/`false` pads a bool input only: on an i64 or f32 input it is a typo for a number."""
        dtype = info.data.get("dtype")
        if isinstance(v, bool) and dtype is not None and dtype != "bool":
            raise ValueError(f"a boolean ({str(v).lower()}) pads a bool input, this input is {dtype}; "
                             f"fix: write the number ({int(v)})")
        return v

    def masked_dims(self) -> list[str]:
        """Dims whose padded positions this mask covers ([] unless role is attention_mask)."""
        if self.role != "attention_mask":
            return []
        if self.mask_for:
            return list(self.mask_for)
        return list(dict.fromkeys(e for e in self.shape[1:] if isinstance(e, str)))


class DimSpec(_Spec):
    """A symbolic dim. Exactly one way of naming its buckets:
    explicit `buckets`; or `min`/`max` (+`step`) synthesised with `max_padding`/`max_buckets`;
    or `min`/`max`/`step` alone, where every grid value min, min+step, ..., max is a bucket."""
    min: Optional[PosInt] = None
    max: Optional[PosInt] = None
    step: PosInt = 1
    buckets: Optional[Annotated[list[PosInt], _limited(MAX_BUCKETS, "one plan per bucket")]] = None
    max_padding: Optional[Ratio] = None
    max_buckets: Optional[PosInt] = None
    # up to this many values of a synthesised dim that requests keep sending get plans of their
    # own, built on a value's third request (runtime/exact.py): the buckets graphmode chose, refined
    exact_plans: Optional[Annotated[int, BeforeValidator(_number(int, ge=1, le=MAX_EXACT_PLANS))]] = None
    _LATE = {"exact_plans": None}


OpList = Annotated[list[OpName], _limited(MAX_LIST, "a hand-written op list")]


class CaptureSpec(_Spec):
    include_ops: OpList = []
    exclude_ops: OpList = []


# `optimize.fusion` is the fuse pass's own options model: declared once, with one default per field
from graphmode.passes.options import FuseOptions as FusionSpec  # noqa: E402
# `parallel` (tensor parallelism) is declared beside the code that runs it, as `fusion` is
from graphmode.recipe.parallel_spec import ParallelSpec  # noqa: E402


class OptimizeSpec(_Spec):
    preset: Optional[str] = None
    passes: Optional[Annotated[list[str], _limited(MAX_LIST, "a pass pipeline")]] = None
    fusion: FusionSpec = FusionSpec()
    memory_reuse: bool = True

    def pipeline(self) -> list[str]:
        from graphmode.passes.registry import PRESETS
        if self.passes is not None:
            return list(self.passes)
        return list(PRESETS.get(self.preset or "default", []))


class CodegenSpec(_Spec):
    """How backends choose kernels: `latency_first` and `throughput_first` time the candidate
    GEMM kernels once per shape (results kept in a timing cache); `heuristic` never times.
    `isa` caps the instruction set generated kernels run (= backends/cpu/isa.py CAPS): auto
    is the host's best; a lower one runs that code path on a bigger host (an AVX2 table
    from an AVX-512 machine); one the target lacks is refused (semantics.py). `schedule`: how
    generated kernels' parallel loops hand out iterations (= backends/cpu/omp_loops.py
    SCHEDULES): static shares, or chunks claimed dynamically (dynamic, guided), which a busy
    host's descheduled thread cannot hold up, or `claim`: chunks claimed on graphmode's own
    pool, whose join does not wait for a thread that claimed nothing; auto = the measured
    default."""
    kernel_selection: Literal["latency_first", "throughput_first", "heuristic"] = "latency_first"
    isa: Literal["auto", "avx512", "avx2", "portable"] = "auto"
    schedule: Literal["auto", "static", "dynamic", "guided", "claim"] = "auto"
    _LATE = {"isa": "auto", "schedule": "auto"}


class PrecisionSpec(_Spec):
    """`weights`: how constant linear weights are stored (the quantize_weights pass): f32, or
    bf16 / int8 (per-output-channel scale) / int4 read narrow by the kernels, activations f32.
    int4: 4-bit codes with a scale per `group_size` weights along the input axis, `int4_scheme`
    symmetric (codes -8..7, scale only) or asymmetric (a zero point per group too).
    `int4_activations`: f32 (the answer is dequantize-then-matmul) or q8: x quantized to int8
    per block of 32 (llama.cpp q8_0) for integer dot products with the codes, symmetric group 32
    only (ir/ops/int4.py)."""
    compute: FloatDType = "f32"
    accumulate: Optional[FloatDType] = None
    overrides: Annotated[dict[OpName, FloatDType], _limited(MAX_LIST, "per-op overrides")] = {}
    weights: Literal["f32", "bf16", "int8", "int4"] = "f32"
    group_size: Literal[32, 64, 128] = 32
    int4_scheme: Literal["symmetric", "asymmetric"] = "symmetric"
    int4_activations: Literal["f32", "q8"] = "f32"
    _LATE = {"weights": "f32", "group_size": 32, "int4_scheme": "symmetric", "int4_activations": "f32"}

    def accumulate_dtype(self) -> str:
        if self.accumulate:
            return self.accumulate
        return self.compute if self.compute in ("f32", "f64") else "f32"


class KVCacheSpec(_Spec):
    """Paged KV cache: a pool of `pages` pages of page_size tokens (K and V of every layer),
    allocated once; a sequence holds up to max_pages_per_seq of them. Default pool: every
    sequence of the largest batch at its longest (batch max x max_pages_per_seq).
    `prefix_caching`: share the pages of computed prompt prefixes (graphmode/decode/prefix_cache.py);
    None: on, except under determinism batch_invariant."""
    page_size: Pow2 = 16
    max_pages_per_seq: SymPosInt
    pages: Optional[PosInt] = None
    dtype: Optional[KVDType] = None
    layers: Optional[PosInt] = None
    kv_heads: Optional[PosInt] = None
    head_dim: Optional[PosInt] = None
    batch_dim: Ident = "batch"
    seq_dim: Ident = "seq"
    prefix_caching: Optional[bool] = None


class MemorySpec(_Spec):
    """`weight_growth`: the prepared copies kernels read their constant weights from (packed
    panels, Winograd-transformed: F(2x2) is 16/9 of a 3x3 conv's weight, F(4x4) 4x) may take
    at most this multiple of the weights they are prepared from; tactic selection rules out
    the candidates that would pass it (backends/cpu/tactics/context.py fit_weight_budget).
    2.5 admits F(2x2) everywhere and F(4x4) where it buys most."""
    budget_mb: Optional[SymMB] = None
    kv_cache: Optional[KVCacheSpec] = None
    bank_affinity: Annotated[list[BankRef], _limited(MAX_LIST, "memory bank names")] = []
    weight_growth: Annotated[float, BeforeValidator(_number(float, ge=1, le=MAX_FACTOR))] = 2.5
    _LATE = {"weight_growth": 2.5}


class SpeculativeSpec(_Spec):
    """Prompt-lookup (n-gram) speculative decoding (graphmode/decode/speculative.py): up to
    `num_tokens` draft tokens per sequence and step, copied from after the latest earlier
    occurrence of its last n tokens (n from `ngram_max` down to `ngram_min`), verified in one
    batched step; the tokens are the ones decoding without it chooses."""
    method: Literal["ngram"] = "ngram"
    num_tokens: Annotated[int, BeforeValidator(_number(int, ge=1, le=64, why="drafts per step"))] = 4
    ngram_max: Annotated[int, BeforeValidator(_number(int, ge=1, le=64, why="tokens matched"))] = 3
    ngram_min: Annotated[int, BeforeValidator(_number(int, ge=1, le=64, why="tokens matched"))] = 1

    @model_validator(mode="after")
    def _ngram_order(self) -> "SpeculativeSpec":
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min {self.ngram_min} is above ngram_max {self.ngram_max}; "
                             "fix: ngram_min <= ngram_max")
        return self


class DecodeSpec(_Spec):
    """How the decode engine runs a causal LM's steps (a decoder recipe: memory.kv_cache)."""
    speculative: Optional[SpeculativeSpec] = None


class SlaBucket(_Spec):
    match: dict[Ident, Selector] = Field(min_length=1)
    p50_ms: Optional[SymMs] = None
    p99_ms: Optional[SymMs] = None


class SlaSpec(_Spec):
    p50_ms: Optional[SymMs] = None
    p99_ms: Optional[SymMs] = None
    per_bucket: Annotated[list[SlaBucket], _limited(MAX_SLA_ENTRIES, "each entry is one Z3 proof; "
                                                                     "match ranges, not single buckets")] = []
    # determinism: P99/P50 of measured latencies (bench, tune and serve measure it; graphmode/kb/measure.py)
    max_p99_over_p50: Optional[Annotated[float, BeforeValidator(_number(float, ge=1, le=MAX_FACTOR))]] = None
    _LATE = {"max_p99_over_p50": None}


class Requires(_Spec):
    torch: Optional[Specifier] = None
    python: Optional[Specifier] = None
    graphmode: Optional[Specifier] = None
    driver: Optional[Specifier] = None
    cuda: Optional[Specifier] = None


class ModelSpec(_Spec):
    """What is known about the model without compiling it; feeds the crude cost model."""
    kind: Literal["encoder", "decoder", "cnn", "generic"] = "generic"
    params_m: Optional[Annotated[float, BeforeValidator(_number(float, gt=0, le=MAX_PARAMS_M,
                                                                why="10 trillion parameters"))]] = None
    weights_mb: Optional[Megabytes] = None
    layers: Optional[PosInt] = None
    hidden: Optional[PosInt] = None
    heads: Optional[PosInt] = None
    kv_heads: Optional[PosInt] = None
    head_dim: Optional[PosInt] = None
    intermediate: Optional[PosInt] = None
    vocab: Optional[PosInt] = None
    gflops_per_item: Optional[Annotated[float, BeforeValidator(_number(float, gt=0, le=MAX_GFLOPS,
                                                                       why="1 EFLOP per item"))]] = None
    activation_mb_per_item: Optional[Megabytes] = None
    activation_factor: Annotated[float, BeforeValidator(_number(float, gt=0, le=MAX_FACTOR))] = 8.0
    n_ops: Optional[PosInt] = None
    batch_dim: Ident = "batch"
    seq_dim: Ident = "seq"


def _inline_target(v: Any) -> Any:
    """Inline target specs go through the registry's checks (units like '80 GiB' allowed)."""
    if isinstance(v, dict):
        try:
            return target_from_dict(v, source="inline target")
        except TargetError as e:
            raise ValueError(e.render().replace("\n  fix:", "; fix:")) from None
    return v


def _target_tag(v: Any) -> str:
    return "target-name" if isinstance(v, str) else "target-spec"


TargetRef = Annotated[Annotated[str, Tag("target-name")]
                      | Annotated[Target, BeforeValidator(_inline_target), Tag("target-spec")],
                      Discriminator(_target_tag)]


def _dim_before(v: Any) -> Any:
    if isinstance(v, int) and not isinstance(v, bool):   # `beam: 4` is a fixed dim
        return {"buckets": [v], "min": v}
    return v


# ---- the recipe -----------------------------------------------------------------------------

class Recipe(_Spec):
    """A typed, versioned contract. Build with `load_recipe(...)` to get field-level errors."""

    version: Annotated[int, BeforeValidator(_version)]
    name: Annotated[str, BeforeValidator(_pattern(_NAME, "a name of letters, digits, _ . -", MAX_NAME_CHARS))]
    description: str = ""
    model: Optional[ModelSpec] = None
    inputs: Annotated[list[InputSpec], _limited(MAX_INPUTS, "model inputs")] = Field(min_length=1)
    outputs: Annotated[dict[ValueName, Annotated[list[OutAxis], _limited(MAX_RANK, f"rank at most {MAX_RANK}")]],
                       _limited(MAX_INPUTS, "model outputs")] = {}
    dims: Annotated[dict[Ident, Annotated[DimSpec, BeforeValidator(_dim_before)]],
                    _limited(MAX_DIMS, "each dim is a variable of every proof")] = {}
    exe_mode: Literal["eager", "graph", "hybrid"] = "graph"
    on_violation: Literal["error", "eager"] = "error"
    # batch_invariant: a decoded sequence's logits are bit-identical whether it runs alone or
    # beside others (the decode engine computes every sequence on its own; see decode/engine.py)
    determinism: Literal["default", "batch_invariant"] = "default"
    capture: CaptureSpec = CaptureSpec()
    optimize: OptimizeSpec = OptimizeSpec()
    codegen: CodegenSpec = CodegenSpec()
    precision: PrecisionSpec = PrecisionSpec()
    memory: MemorySpec = MemorySpec()
    sla: Optional[SlaSpec] = None
    targets: Annotated[list[TargetRef], _limited(MAX_TARGETS, "targets to check against")] = []
    alias_groups: Annotated[list[Annotated[list[Ident], _limited(MAX_LIST, "one alias group")]],
                            _limited(MAX_LIST, "alias groups")] = []
    replayable: bool = True
    requires: Requires = Requires()
    parallel: Optional[ParallelSpec] = None
    decode: Optional[DecodeSpec] = None

    _lines: dict[str, int] = PrivateAttr(default_factory=dict)
    _source: Optional[str] = PrivateAttr(default=None)
    _resolved_on: Optional[str] = PrivateAttr(default=None)
    _notes: list[str] = PrivateAttr(default_factory=list)

    _LATE = {"determinism": "default", "parallel": None, "decode": None}

    @field_validator("inputs")
    @classmethod
    def _unique_inputs(cls, v: list[InputSpec]) -> list[InputSpec]:
        seen = [i.name for i in v]
        dup = sorted({n for n in seen if seen.count(n) > 1})
        if dup:
            raise ValueError(f"duplicate input name(s): {', '.join(dup)}")
        return v

    @field_validator("decode")
    @classmethod
    def _decode_needs_a_decoder(cls, v: Optional[DecodeSpec], info: ValidationInfo) -> Optional[DecodeSpec]:
        memory = info.data.get("memory")
        if v is not None and (memory is None or memory.kv_cache is None):
            raise ValueError("decode configures the decode engine, which needs memory.kv_cache; fix: add "
                             "memory.kv_cache (a decoder recipe) or remove decode")
        if v is not None and v.speculative is not None and info.data.get("determinism") == "batch_invariant":
            raise ValueError("decode.speculative verifies drafts as extra batch rows, so determinism: "
                             "batch_invariant cannot hold; fix: remove one of them")
        return v

    def __eq__(self, other: object) -> bool:       # content equality: where it was loaded from is not content
        return isinstance(other, Recipe) and self.model_dump() == other.model_dump()

    def __hash__(self) -> int:
        return hash(recipe_hash(self))

    # -- provenance: where the recipe was read from and what resolution did (not content) --
    def line_of(self, path: str) -> int | None:
        """YAML line of `path` (or its nearest ancestor) when loaded from YAML."""
        return nearest_line(self._lines, path)

    @property
    def source(self) -> str | None:
        return self._source

    @property
    def resolved_on(self) -> str | None:
        """Name of the target the symbolic values were resolved against, if any."""
        return self._resolved_on

    @property
    def notes(self) -> list[str]:
        """What resolution did (e.g. bank names -> ids, or why an affinity does not apply)."""
        return list(self._notes)

    # -- derived views, computed by functions (buckets.py, hashing.py, symbolic.py) that new code
    #    calls directly; these methods delegate for the callers written against them --
    def hash(self) -> str:
        return recipe_hash(self)

    def pipeline(self) -> list[str]:
        return self.optimize.pipeline()

    def dim_buckets(self) -> dict[str, list[int]]:
        return bucketing.dim_buckets(self)

    def buckets(self) -> list[dict[str, int]]:
        return bucketing.all_buckets(self)

    def plans_count(self) -> int:
        return bucketing.plans_count(self)

    def bucket_for(self, shape: dict[str, int]) -> dict[str, int] | None:
        return bucketing.bucket_for(self, shape)

    def dim_range(self, dim: str) -> tuple[int, int]:
        return bucketing.dim_range(self.dims[dim])

    def is_symbolic(self) -> bool:
        return symbolic.has_symbolic(self)
