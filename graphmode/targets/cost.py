"""Roofline cost model over a Target.

    seconds(op) = max(flops / peak[dtype], bytes / bandwidth) / efficiency[kind] + overhead

`peak` and `bandwidth` come from the target (theoretical peaks for shipped chips; for `host`
theoretical FLOP/s and measured copy bandwidth). `efficiency` (per op kind) and `overhead`
(per instruction) come from an optional `Calibration`; without one, efficiency is 1 and the
overhead is the target's `launch_overhead_us`. A later stage fits calibrations from
measurements (`Calibration.fit`) and stores one JSON file per target.

End-to-end: describe each instruction as an `OpCost` (helpers `matmul_cost`,
`elementwise_cost`) and call `predict_seconds(target, ops)`; the `Prediction` keeps the
per-op breakdown (compute / memory / overhead, which bound applies).
"""
from __future__ import annotations

import datetime as _dt
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from graphmode.errors import TargetError
from graphmode.targets.schema import Target

DTYPE_BYTES = {"f64": 8, "f32": 4, "tf32": 4, "f16": 2, "bf16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1,
               "i64": 8, "i32": 4, "i8": 1, "u8": 1, "bool": 1}


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise TargetError("unknown dtype", where="dtype", value=dtype,
                          fix=f"use one of {', '.join(DTYPE_BYTES)}") from None


@dataclass(frozen=True)
class OpCost:
    """The work of one instruction: FLOPs (or int OPs) and bytes read + written."""
    kind: str                # calibration key: matmul, elementwise, reduction, softmax, copy, ...
    flops: float
    bytes_moved: float
    dtype: str = "f32"       # compute dtype (selects the peak)
    name: str = ""


@dataclass(frozen=True)
class OpPrediction:
    name: str
    kind: str
    compute_s: float         # flops / peak
    memory_s: float          # bytes / bandwidth
    overhead_s: float
    efficiency: float
    seconds: float           # max(compute_s, memory_s) / efficiency + overhead_s
    bound: Literal["compute", "memory", "overhead"]


@dataclass(frozen=True)
class Prediction:
    target: str
    ops: tuple[OpPrediction, ...]
    total_s: float

    def by_kind(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for p in self.ops:
            out[p.kind] = out.get(p.kind, 0.0) + p.seconds
        return out

    def bound_counts(self) -> dict[str, int]:
        out = {"compute": 0, "memory": 0, "overhead": 0}
        for p in self.ops:
            out[p.bound] += 1
        return out


class Calibration(BaseModel):
    """Per-target corrections fitted from measurements (one JSON file per target, by default
    `graphmode.paths.CacheLayout.calibration(target)`, written by `graphmode profile --calibrate`).

    `op_efficiency[kind]` is the achieved fraction of the roofline time for that op kind
    (may exceed 1 when e.g. data stays in cache; refined kinds use `|`, see `efficiency`);
    `default_efficiency` covers other kinds;
    `overhead_us` replaces the target's per-instruction `launch_overhead_us` when set;
    `model_efficiency` scales a whole-model roofline (see `graphmode.recipe.constraints`)."""

    model_config = ConfigDict(extra="forbid")

    target: str
    op_efficiency: dict[str, float] = {}
    default_efficiency: float = Field(default=1.0, gt=0)
    overhead_us: float | None = Field(default=None, ge=0)
    # whole-model roofline efficiency, for predictors that only know a model's total FLOPs and
    # bytes (the recipe's Z3 latency model): max(flops/peak, bytes/bw) / model_efficiency + n * overhead
    model_efficiency: float | None = Field(default=None, gt=0)
    # the roofline the efficiencies were fitted against (a re-probed `host` may measure another
    # bandwidth under load); predictions with this calibration use these instead of the target's
    reference_peak_flops: dict[str, float] = {}
    reference_bandwidth_gbps: float | None = Field(default=None, gt=0)
    samples: int = Field(default=0, ge=0)
    created: str = ""
    note: str = ""

    def efficiency(self, kind: str | None) -> float:
        """Kinds may be refined with `|` (`gemm|ai4-16|small`): the most specific key present
        wins (`gemm|ai4-16|small`, then `gemm|ai4-16`, then `gemm`), else `default_efficiency`."""
        key = kind
        while key:
            if key in self.op_efficiency:
                return self.op_efficiency[key]
            key = key.rpartition("|")[0]
        return self.default_efficiency

    @staticmethod
    def reference_of(target: Target) -> dict:
        """The fields that pin a calibration to `target`'s current roofline numbers."""
        return {"reference_peak_flops": dict(target.peak_flops),
                "reference_bandwidth_gbps": target.memory_bandwidth_gbps}

    def peak(self, target: Target, dtype: str) -> float:
        return self.reference_peak_flops.get(dtype) or target.peak(dtype)

    def bandwidth_gbps(self, target: Target) -> float:
        return self.reference_bandwidth_gbps or target.memory_bandwidth_gbps

    def overhead_seconds(self, target: Target) -> float:
        us = self.overhead_us if self.overhead_us is not None else target.launch_overhead_us
        return us * 1e-6

    @classmethod
    def load(cls, path: str | Path) -> "Calibration":
        p = Path(path)
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise TargetError("calibration file not found", where=str(p), fix="check the path") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise TargetError(f"calibration file is not valid JSON: {e}", where=str(p),
                              fix="delete it and calibrate again") from None
        try:
            cal = cls.model_validate(data)
        except ValidationError as e:
            err = e.errors()[0]
            raise TargetError(err["msg"], where=f"{p}: " + ".".join(str(x) for x in err["loc"]),
                              value=err.get("input"), fix="see graphmode.targets.cost.Calibration") from None
        bad = {k: v for k, v in cal.op_efficiency.items() if v <= 0}
        if bad:
            k = next(iter(bad))
            raise TargetError("efficiency must be positive", where=f"{p}: op_efficiency.{k}", value=bad[k],
                              fix="use the measured fraction of the roofline, e.g. 0.6")
        return cal

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(self.model_dump_json(indent=2), encoding="utf-8")
        return p

    @classmethod
    def fit(cls, target: Target, samples: Iterable[tuple[OpCost, float]], *,
            overhead_us: float | None = None, note: str = "") -> "Calibration":
        """Per kind, the median of roofline_time / (measured - overhead) over the samples.
        Samples whose measured time does not exceed the overhead are skipped."""
        over = (overhead_us if overhead_us is not None else target.launch_overhead_us) * 1e-6
        ratios: dict[str, list[float]] = {}
        n = 0
        for op, measured_s in samples:
            n += 1
            roof = _roofline(target, op)[2]
            if measured_s - over > 0 and roof > 0:
                ratios.setdefault(op.kind, []).append(roof / (measured_s - over))
        eff = {k: round(statistics.median(v), 4) for k, v in ratios.items()}
        return cls(target=target.name, op_efficiency=eff, overhead_us=overhead_us, samples=n,
                   created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), note=note,
                   **cls.reference_of(target))


def _roofline(target: Target, op: OpCost, calibration: Calibration | None = None) -> tuple[float, float, float]:
    peak = calibration.peak(target, op.dtype) if calibration else target.peak(op.dtype)
    bw = calibration.bandwidth_gbps(target) if calibration else target.memory_bandwidth_gbps
    compute = op.flops / peak if op.flops > 0 else 0.0
    memory = op.bytes_moved / (bw * 1e9) if op.bytes_moved > 0 else 0.0
    return compute, memory, max(compute, memory)


def saved_calibration(target: Target, cache_dir: str | Path | None = None,
                      path: str | Path | None = None) -> tuple[Calibration | None, str]:
    """(the calibration an SLA proof uses, a note saying which): `path`, else the one `graphmode
    profile --calibrate` saved for `target` under the cache, else none (the roofline alone then
    predicts a time this host may not reach). compile and `recipe validate` both prove with it."""
    from graphmode.paths import cache_layout
    saved = cache_layout(cache_dir).calibration(target.name)
    use = path if path is not None else saved if saved.is_file() else None
    if use is None:
        return None, ("sla: predicted with the target's roofline, uncalibrated: `graphmode profile --model M "
                      "--calibrate` fits it to this host (the proof then uses it); `graphmode run` names a measured "
                      "p50/p99 over the bound")
    return Calibration.load(use), f"sla: predicted with the calibration {use}"


def _check_calibration(target: Target, calibration: Calibration | None) -> None:
    if calibration is not None and calibration.target != target.name:
        raise TargetError("calibration belongs to another target", where="calibration.target",
                          value=calibration.target, fix=f"use the calibration of {target.name!r}")


def predict_op(target: Target, op: OpCost, calibration: Calibration | None = None) -> OpPrediction:
    """Roofline time of one instruction, with its breakdown."""
    _check_calibration(target, calibration)
    if op.flops < 0 or op.bytes_moved < 0:
        raise TargetError("negative work", where=f"op {op.name or op.kind}",
                          value=(op.flops, op.bytes_moved), fix="flops and bytes_moved must be >= 0")
    compute, memory, roof = _roofline(target, op, calibration)
    eff = calibration.efficiency(op.kind) if calibration else 1.0
    over = calibration.overhead_seconds(target) if calibration else target.launch_overhead_us * 1e-6
    work = roof / eff
    bound = "overhead" if over >= work else ("compute" if compute >= memory else "memory")
    return OpPrediction(name=op.name, kind=op.kind, compute_s=compute, memory_s=memory, overhead_s=over,
                        efficiency=eff, seconds=work + over, bound=bound)


def predict_op_seconds(target: Target, flops: float, bytes_moved: float, dtype: str = "f32", *,
                       op_kind: str | None = None, calibration: Calibration | None = None) -> float:
    """max(flops / peak[dtype], bytes / bandwidth) [/ efficiency] + per-launch overhead, seconds."""
    return predict_op(target, OpCost(kind=op_kind or "", flops=flops, bytes_moved=bytes_moved, dtype=dtype),
                      calibration).seconds


def predict_seconds(target: Target, ops: Iterable[OpCost], *, calibration: Calibration | None = None) -> Prediction:
    """End-to-end time of a sequence of instructions run one after another."""
    preds = tuple(predict_op(target, op, calibration) for op in ops)
    return Prediction(target=target.name, ops=preds, total_s=sum(p.seconds for p in preds))


def arithmetic_intensity(flops: float, bytes_moved: float) -> float:
    """FLOP per byte (inf when no bytes move)."""
    return flops / bytes_moved if bytes_moved else float("inf")


def ridge_point(target: Target, dtype: str = "f32") -> float:
    """The arithmetic intensity (FLOP/byte) above which an op is compute-bound on `target`."""
    return target.peak(dtype) / (target.memory_bandwidth_gbps * 1e9)


def matmul_cost(m: int, n: int, k: int, dtype: str = "f32", *, batch: int = 1, shared_b: bool = False,
                bias: bool = False, name: str = "") -> OpCost:
    """[batch] x (m x k) @ (k x n): 2mnk FLOPs per batch; reads A, B (one B when `shared_b`,
    e.g. a linear layer's weight) and the bias, writes C once."""
    b = dtype_bytes(dtype)
    flops = 2.0 * batch * m * n * k + (batch * m * n if bias else 0)
    moved = b * (batch * m * k + (1 if shared_b else batch) * k * n + batch * m * n + (n if bias else 0))
    return OpCost(kind="matmul", flops=flops, bytes_moved=moved, dtype=dtype, name=name)


def elementwise_cost(numel: int, dtype: str = "f32", *, inputs: int = 1, outputs: int = 1,
                     flops_per_element: float = 1.0, kind: str = "elementwise", name: str = "") -> OpCost:
    """An elementwise (or fused elementwise chain) op over `numel` elements."""
    return OpCost(kind=kind, flops=flops_per_element * numel, bytes_moved=dtype_bytes(dtype) * numel * (inputs + outputs),
                  dtype=dtype, name=name)
