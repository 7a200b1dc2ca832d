"""Human-readable quantities in target files: `80 GiB`, `2039 GB/s`, `312 TFLOPS`.

YAML 1.1 (PyYAML) reads `312e12` as a string, so target files may write every size, bandwidth
and peak either as a plain number or as a number with a unit. `normalize_target_dict` turns
those strings into the numbers `Target` stores (bytes, GB/s, FLOP/s) and reports a bad value
with its field path.
"""
from __future__ import annotations

import math
import re
from typing import Any

_NUM = r"([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)"
_QTY = re.compile(rf"\s*{_NUM}\s*([A-Za-z/]*)\s*")      # fullmatch

BYTE_UNITS = {"": 1, "b": 1,
              "k": 1024, "kb": 1000, "kib": 1024,
              "m": 1024**2, "mb": 1000**2, "mib": 1024**2,
              "g": 1024**3, "gb": 1000**3, "gib": 1024**3,
              "t": 1024**4, "tb": 1000**4, "tib": 1024**4}
# bandwidth is stored in GB/s (10^9 bytes per second)
BANDWIDTH_UNITS = {"": 1.0, "gb/s": 1.0, "gbps": 1.0, "gbs": 1.0, "mb/s": 1e-3, "tb/s": 1e3,
                   "gib/s": 1.073741824, "tib/s": 1099.511627776}
_FLOP_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15}
_FLOP_UNIT = re.compile(r"^([kmgtp]?)(?:flops?|flop/s|ops|op/s|iops)?$")


class UnitError(ValueError):
    """A quantity string that could not be read; carries the accepted forms as `fix`."""

    def __init__(self, message: str, fix: str):
        self.fix = fix
        super().__init__(message)


def _split(value: Any, what: str, fix: str) -> tuple[float, str]:
    if isinstance(value, bool):
        raise UnitError(f"{what} must be a number, not a boolean", fix)
    if not isinstance(value, (int, float, str)):
        raise UnitError(f"{what} must be a number or a string with a unit", fix)
    m = _QTY.fullmatch(value) if isinstance(value, str) else None
    if isinstance(value, str) and not m:
        raise UnitError(f"cannot read {what}", fix)
    try:
        num = float(m.group(1)) if m else float(value)
    except OverflowError:                     # an int beyond float range
        num = math.inf
    if not math.isfinite(num):
        raise UnitError(f"{what} is not a finite number", fix)
    return num, m.group(2).lower() if m else ""


def _scaled(num: float, scale: float, what: str, fix: str) -> float:
    x = num * scale
    if not math.isfinite(x):
        raise UnitError(f"{what} is beyond any finite number", fix)
    return x


def parse_bytes(value: Any) -> int:
    """`80 GiB`, `40MiB`, `32K` (sysfs style, binary), `48 GB` (decimal), or an int -> bytes."""
    fix = "write an integer number of bytes or a size like '80 GiB', '40 MiB', '48 GB'"
    num, unit = _split(value, "size", fix)
    if unit not in BYTE_UNITS:
        raise UnitError(f"unknown size unit {unit!r}", fix)
    return int(round(_scaled(num, BYTE_UNITS[unit], "size", fix)))


def parse_bandwidth_gbps(value: Any) -> float:
    """`2039 GB/s`, `3.35 TB/s` or a number (already GB/s) -> GB/s."""
    fix = "write GB/s as a number or a bandwidth like '2039 GB/s', '3.35 TB/s'"
    num, unit = _split(value, "bandwidth", fix)
    if unit not in BANDWIDTH_UNITS:
        raise UnitError(f"unknown bandwidth unit {unit!r}", fix)
    return _scaled(num, BANDWIDTH_UNITS[unit], "bandwidth", fix)


def parse_flops(value: Any) -> float:
    """`19.5 TFLOPS`, `624 TOPS`, `1.979 PFLOPS`, `19.5e12` or a number -> FLOP/s."""
    fix = "write FLOP/s as a number or a rate like '19.5 TFLOPS', '624 TOPS', '1.98 PFLOPS'"
    num, unit = _split(value, "peak rate", fix)
    m = _FLOP_UNIT.match(unit)
    if not m:
        raise UnitError(f"unknown rate unit {unit!r}", fix)
    return _scaled(num, _FLOP_PREFIX[m.group(1)], "peak rate", fix)


def _conv(parse, value: Any, path: str, errors: list) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return parse(value)
    except UnitError as e:
        errors.append((path, value, str(e), e.fix))
        return value


def _normalize_group_value(key: str, value: Any, path: str, errors: list) -> Any:
    if isinstance(value, dict):
        if key == "peak_flops":
            return {k: _conv(parse_flops, v, f"{path}.{k}", errors) for k, v in value.items()}
        return {k: _normalize_group_value(k, v, f"{path}.{k}", errors) for k, v in value.items()}
    if key == "bytes" or key.endswith("_bytes"):
        return _conv(parse_bytes, value, path, errors)
    if key.endswith("_gbps"):
        return _conv(parse_bandwidth_gbps, value, path, errors)
    return value


def normalize_target_dict(d: dict[str, Any]) -> tuple[dict[str, Any], list[tuple[str, Any, str, str]]]:
    """Convert unit strings in a raw target mapping to numbers.

    Returns the converted copy and a list of `(field_path, value, message, fix)` for values that
    could not be read (the caller turns them into a `TargetError`). Keys inside `groups` follow
    a naming convention: `bytes`/`*_bytes` are sizes, `*_gbps` bandwidths, `peak_flops` rates.
    """
    out = dict(d)
    errors: list[tuple[str, Any, str, str]] = []
    for key in ("l1_bytes", "l2_bytes", "llc_bytes", "memory_bytes"):
        if key in out:
            out[key] = _conv(parse_bytes, out[key], key, errors)
    if "memory_bandwidth_gbps" in out:
        out["memory_bandwidth_gbps"] = _conv(parse_bandwidth_gbps, out["memory_bandwidth_gbps"],
                                             "memory_bandwidth_gbps", errors)
    if isinstance(out.get("peak_flops"), dict):
        out["peak_flops"] = {k: _conv(parse_flops, v, f"peak_flops.{k}", errors)
                             for k, v in out["peak_flops"].items()}
    if isinstance(out.get("groups"), dict):
        out["groups"] = {g: _normalize_group_value(g, v, f"groups.{g}", errors) if isinstance(v, dict) else v
                         for g, v in out["groups"].items()}
    return out, errors


def number_hint(value: Any, unit: str) -> str:
    """The fix for a string where a recipe field takes a plain number of `unit` ("MB" = 2^20
    bytes, "GB/s", "ms", "us"): the number to write, when the string says it."""
    s = str(value).strip()
    try:
        x = float(s)
    except ValueError:
        x = None
    if x is not None and math.isfinite(x):
        return f"write the number without quotes: {s}"
    try:
        if unit == "MB":                        # the recipe's MB is 2^20 bytes: a G, GB or GiB is 1024 of them
            num, u = _split(s, "size", "")
            power = "kmgt".find(u[:1]) if u in BYTE_UNITS and u not in ("", "b") else -1
            if power >= 0:
                return f"write {num * 1024 ** (power - 1):.6g} (the field takes a number of MB, 1 MB = 2^20 bytes)"
        if unit == "GB/s" and re.search(r"B/s|Bps", s):            # bytes, not bits (Gb/s)
            return f"write {parse_bandwidth_gbps(s):.6g} ({s} in GB/s; the field takes a number of GB/s)"
    except UnitError:
        pass
    return f"write a plain number of {unit}, without units or quotes"
