"""The target registry: shipped hardware description files, user files, inline dicts, `host`.

    get_target("h100_sxm")            # a shipped file (graphmode/targets/data/h100_sxm.yaml)
    get_target("host", cache_dir=d)   # detected from this machine, probe cached in d/host.json
    load_target_file("my_chip.yaml")  # a user-written file
    target_from_dict({...})           # an inline spec from a recipe

Every target goes through the same checks: the pydantic schema, then `check_target`'s
consistency rules (each listed dtype has a positive peak, memory banks and compute classes are
declared, group entries are mappings). A failure is a `TargetError` naming the field path, the
value, the line (for files) and the fix.

Named groups (`groups.memory_banks.high_bandwidth`, `groups.compute_classes.tensor_core`) are
what recipes refer to; `resolve_group` maps a symbolic name, or one of an entry's `aliases`, to
the entry of one target, so one recipe serves several chips.
"""
from __future__ import annotations

import difflib
import functools
import re
from importlib import resources
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import ValidationError

from graphmode.errors import TargetError, short_value
from graphmode.targets.schema import DTypeName, Target
from graphmode.targets.units import normalize_target_dict

HOST = "host"
KNOWN_DTYPES: tuple[str, ...] = get_args(DTypeName)
# Groups every shipped target declares (and `host` builds); recipes may rely on them.
REQUIRED_GROUPS = ("memory_banks", "compute_classes")
# Sane upper bounds (beyond any chip) keep the recipe proofs' arithmetic finite and exact.
MAX_BYTES = 2**60                 # 1 EiB
MAX_GBPS = 1e7                    # 10 PB/s
MAX_FLOPS = 1e21                  # 1 ZFLOP/s
MAX_COUNT = 2**24                 # compute units, vector bits, registers
MAX_OVERHEAD_US = 1e6             # one second per launch
_LIMITS = {"compute_units": (MAX_COUNT, "a count"), "vector_width_bits": (MAX_COUNT, "a count"),
           "registers_per_core": (MAX_COUNT, "a count"), "l1_bytes": (MAX_BYTES, "1 EiB"),
           "l2_bytes": (MAX_BYTES, "1 EiB"), "llc_bytes": (MAX_BYTES, "1 EiB"), "memory_bytes": (MAX_BYTES, "1 EiB"),
           "memory_bandwidth_gbps": (MAX_GBPS, "10 PB/s"), "launch_overhead_us": (MAX_OVERHEAD_US, "one second")}
# A target name is a registry key, a file name and a metric label (fullmatch: `$` accepts "\n").
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}")
# Other spellings people use for shipped targets.
ALIASES = {"a100": "a100_sxm", "a100_sxm4": "a100_sxm", "h100": "h100_sxm", "h100_sxm5": "h100_sxm",
           "h200_sxm": "h200", "mi250x_gcd": "mi250", "gfx90a": "mi250", "ascend910b": "ascend_910b",
           "910b": "ascend_910b", "avx2": "cpu_avx2"}


def _normalize_name(name: str) -> str:
    return name.strip().lower().replace("-", "_")


@functools.cache
def _shipped_files() -> dict[str, str]:
    """name -> YAML text of every file in graphmode/targets/data."""
    out = {}
    for entry in resources.files("graphmode.targets").joinpath("data").iterdir():
        if entry.name.endswith(".yaml"):
            out[entry.name[: -len(".yaml")]] = entry.read_text(encoding="utf-8")
    return out


def list_targets() -> list[str]:
    """Names `get_target` accepts: the shipped files, sorted, then `host`."""
    return sorted(_shipped_files()) + [HOST]


@functools.cache
def _shipped_target(name: str) -> Target:
    text = _shipped_files()[name]
    t = _target_from_text(text, source=f"graphmode/targets/data/{name}.yaml")
    if t.name != name:
        raise TargetError("target file name and its `name` field differ", where=f"{name}.yaml: name",
                          value=t.name, fix=f"set name: {name}")
    return t


def get_target(name: str, *, cache_dir: str | Path | None = None, reprobe: bool = False) -> Target:
    """The target called `name`. `host` detects this machine (probe cached under `cache_dir`,
    default `graphmode.paths.CacheLayout.targets`; `reprobe=True` measures again). Unknown name ->
    TargetError listing the known names and the nearest match."""
    key = _normalize_name(name)
    if key == HOST:
        from graphmode.targets.host import detect_host
        return detect_host(cache_dir=cache_dir, reprobe=reprobe)
    key = ALIASES.get(key, key)
    if key in _shipped_files():
        return _shipped_target(key).model_copy(deep=True)  # callers may not mutate the cached groups
    known = list_targets()
    near = difflib.get_close_matches(key, known + list(ALIASES), n=1, cutoff=0.5)
    suggestion = ALIASES.get(near[0], near[0]) if near else None
    fix = (f"did you mean {suggestion!r}? " if suggestion else "") + "known targets: " + ", ".join(known) \
        + "; or pass a hardware description file (load_target_file)"
    raise TargetError("unknown target", where="target", value=name, fix=fix)


def load_target_file(path: str | Path) -> Target:
    """Load and check a user-written hardware description YAML file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TargetError("target file not found", where=str(p), fix="check the path") from None
    except (OSError, UnicodeDecodeError) as e:
        raise TargetError(f"cannot read target file: {e}", where=str(p)) from None
    return _target_from_text(text, source=str(p))


def target_from_dict(d: dict[str, Any], *, source: str = "target") -> Target:
    """Build and check a Target from a mapping (an inline spec in a recipe, or parsed YAML).
    Sizes, bandwidths and peaks may be written with units (`80 GiB`, `2 TB/s`, `312 TFLOPS`)."""
    return _build(d, source=source, text=None)


def _target_from_text(text: str, *, source: str) -> Target:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        raise TargetError(f"not valid YAML: {getattr(e, 'problem', None) or e}", where=source,
                          line=mark.line + 1 if mark else None,
                          fix="fix the YAML syntax (indentation, a missing ':' or quote)") from None
    if not isinstance(data, dict):
        raise TargetError("a target file must be a mapping of fields", where=source,
                          value=type(data).__name__, fix="start the file with `name: ...`, `kind: ...`")
    return _build(data, source=source, text=text)


def _line_of(text: str | None, path: tuple) -> int | None:
    """1-based line of the YAML node at `path` (keys and list indices), or its deepest parent."""
    if not text:
        return None
    try:
        node = yaml.compose(text)
    except yaml.YAMLError:
        return None
    line = None
    for part in path:
        if isinstance(node, yaml.MappingNode):
            nxt = next(((k, v) for k, v in node.value if k.value == str(part)), None)
            if nxt is None:
                break
            line = nxt[0].start_mark.line + 1
            node = nxt[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            break
    return line


_FIXES = {
    "missing": "add the field",
    "extra_forbidden": "remove the field or fix its spelling (allowed: " + ", ".join(Target.model_fields) + ")",
    "literal_error": "use one of the allowed values",
    "greater_than": "use a positive number",
    "greater_than_equal": "use a number >= 0",
}


def _raise_errors(errs: list[tuple[tuple, Any, str, str]], source: str, text: str | None) -> None:
    """errs: (path tuple, value, message, fix). Raises one TargetError for the first, listing the rest."""
    path, value, msg, fix = errs[0]
    dotted = ".".join(str(p) for p in path) if path else "(top level)"
    if len(errs) > 1:
        others = ", ".join(".".join(str(p) for p in e[0]) or "(top level)" for e in errs[1:6])
        msg += f" [+{len(errs) - 1} more error(s): {others}]"
    raise TargetError(msg, where=f"{source}: {dotted}", value=short_value(value), fix=fix, line=_line_of(text, path))


def _build(data: dict[str, Any], *, source: str, text: str | None) -> Target:
    norm, unit_errors = normalize_target_dict(data)
    if unit_errors:
        _raise_errors([(tuple(p.split(".")), v, m, f) for p, v, m, f in unit_errors], source, text)
    try:
        t = Target.model_validate(norm)
    except ValidationError as e:
        errs = []
        for err in e.errors():
            loc = tuple(err["loc"])
            field = loc[0] if loc else None
            fix = _FIXES.get(err["type"], "see the Target schema (graphmode/targets/schema.py)")
            if err["type"] == "literal_error" and "expected" in err.get("ctx", {}):
                fix = f"use one of {err['ctx']['expected']}"
            if err["type"] == "missing" and len(loc) == 1:
                unknown = [k for k in norm if k not in Target.model_fields]
                near = difflib.get_close_matches(str(field), unknown, n=1, cutoff=0.6)
                if near:
                    fix = f"rename {near[0]!r} to {field!r}"
            if err["type"] == "extra_forbidden" and len(loc) == 1:
                near = difflib.get_close_matches(str(field), list(Target.model_fields), n=1, cutoff=0.6)
                if near:
                    fix = f"did you mean {near[0]!r}? " + fix
            if field in ("l1_bytes", "l2_bytes", "llc_bytes", "memory_bytes"):
                fix += "; sizes may be written like '80 GiB'"
            value = err.get("input") if err["type"] != "missing" else None
            errs.append((loc, value, err["msg"], fix))
        _raise_errors(errs, source, text)
    problems = check_target(t)
    if problems:
        _raise_errors(problems, source, text)
    return t


def check_target(t: Target) -> list[tuple[tuple, Any, str, str]]:
    """Consistency rules beyond the schema, as (field path, value, message, fix) tuples."""
    out: list[tuple[tuple, Any, str, str]] = []
    if not _NAME.fullmatch(t.name):
        out.append((("name",), t.name, "a target name is letters, digits, _ . - (at most 128)",
                    "rename it, e.g. my_chip"))
    for f, (top, what) in _LIMITS.items():
        v = getattr(t, f)
        if not (isinstance(v, (int, float)) and 0 <= v <= top):      # also inf and nan
            out.append(((f,), v, f"out of range: must be finite and <= {top:g} ({what})",
                        f"write a real value for {f}" + ("; sizes may be written like '80 GiB'" if "bytes" in f
                                                         else "")))
    for i, dt in enumerate(t.dtypes):
        if dt not in KNOWN_DTYPES:
            near = difflib.get_close_matches(dt, KNOWN_DTYPES, n=1)
            out.append((("dtypes", i), dt, "unknown dtype",
                        (f"did you mean {near[0]!r}? " if near else "") + f"known: {', '.join(KNOWN_DTYPES)}"))
        elif dt not in t.peak_flops:
            out.append((("dtypes", i), dt, "dtype listed without a peak",
                        f"add peak_flops.{dt} (e.g. '100 TFLOPS') or remove {dt} from dtypes"))
    if not t.dtypes:
        out.append((("dtypes",), t.dtypes, "no dtypes listed", "list the dtypes the target computes in, e.g. [f32]"))
    for dt, v in t.peak_flops.items():
        if dt not in KNOWN_DTYPES:
            near = difflib.get_close_matches(dt, KNOWN_DTYPES, n=1)
            out.append((("peak_flops", dt), dt, "unknown dtype",
                        (f"did you mean {near[0]!r}? " if near else "") + f"known: {', '.join(KNOWN_DTYPES)}"))
        elif not isinstance(v, (int, float)) or not 0 < v <= MAX_FLOPS:
            out.append((("peak_flops", dt), v, f"peak must be a positive FLOP/s <= {MAX_FLOPS:g}",
                        "write e.g. 19.5e12 or '19.5 TFLOPS'"))
        elif dt not in t.dtypes:
            out.append((("peak_flops", dt), dt, "peak given for a dtype not listed in dtypes",
                        f"add {dt} to dtypes or remove peak_flops.{dt}"))
    if "f32" not in t.peak_flops:
        out.append((("peak_flops",), sorted(t.peak_flops), "no f32 peak (the fallback for unlisted dtypes)",
                    "add peak_flops.f32"))
    for g in REQUIRED_GROUPS:
        if not t.groups.get(g):
            out.append((("groups", g), None, f"group {g!r} is missing or empty",
                        f"declare groups.{g} with at least one named entry (see graphmode/targets/data/*.yaml)"))
    for g, entries in t.groups.items():
        if not isinstance(entries, dict) or not entries:
            out.append((("groups", g), entries, "a group must be a non-empty mapping of names",
                        f"write groups.{g}.<name>: {{...}}"))
            continue
        if g not in REQUIRED_GROUPS:
            continue
        for name, entry in entries.items():
            if not isinstance(entry, dict):
                out.append((("groups", g, name), entry, "a group entry must be a mapping",
                            f"write groups.{g}.{name}: {{kind: ..., ...}}"))
                continue
            aliases = entry.get("aliases", [])
            if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
                out.append((("groups", g, name, "aliases"), aliases, "aliases must be a list of names",
                            "write aliases: [name1, name2]"))
            peaks = entry.get("peak_flops", {})
            if not isinstance(peaks, dict):
                out.append((("groups", g, name, "peak_flops"), peaks, "peak_flops must map dtypes to rates",
                            "write peak_flops: {f16: '100 TFLOPS'}"))
                peaks = {}
            for k, v in peaks.items():
                if k not in KNOWN_DTYPES or not isinstance(v, (int, float)) or not 0 < v <= MAX_FLOPS:
                    out.append((("groups", g, name, "peak_flops", k), v, "bad peak (unknown dtype or not positive)",
                                "use a known dtype and a positive rate like '100 TFLOPS'"))
            for k, top in (("bytes", MAX_BYTES), ("bandwidth_gbps", MAX_GBPS)):
                v = entry.get(k, 1)
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= top:
                    out.append((("groups", g, name, k), v, f"{k} must be positive and <= {top:g}",
                                "write a positive number (sizes may be written like '80 GiB')"))
    return out


def resolve_group(target: Target, group: str, name: str) -> dict[str, Any]:
    """The entry of `target.groups[group]` named `name` or carrying it in `aliases`.

    `resolve_group(h100, "memory_banks", "high_bandwidth")` -> the HBM entry;
    `resolve_group(mi250, "compute_classes", "tensor_core")` -> its matrix cores.
    Unknown group or name -> TargetError listing the names the target has."""
    entries = target.groups.get(group)
    if not entries:
        raise TargetError(f"target {target.name!r} declares no group {group!r}", where=f"groups.{group}",
                          value=group, fix=f"groups of {target.name}: {', '.join(sorted(target.groups)) or '(none)'}")
    if name in entries:
        return {"name": name, **entries[name]} if isinstance(entries[name], dict) else {"name": name, "value": entries[name]}
    for ename, entry in entries.items():
        if isinstance(entry, dict) and name in entry.get("aliases", []):
            return {"name": ename, **entry}
    names = sorted(set(entries) | {a for e in entries.values() if isinstance(e, dict) for a in e.get("aliases", [])})
    near = difflib.get_close_matches(name, names, n=1)
    raise TargetError(f"target {target.name!r} has no {group} entry {name!r}", where=f"groups.{group}",
                      value=name, fix=(f"did you mean {near[0]!r}? " if near else "") + f"available: {', '.join(names)}")


def bank_ids(target: Target, names: list[str | int]) -> list[int]:
    """Memory bank ids for a recipe's `bank_affinity` list on `target`, without duplicates.

    Ints pass through; names (or aliases) resolve through `groups.memory_banks.<name>.ids`.
    An entry without `ids` (e.g. host_pinned, on_chip) contributes none. Unknown name ->
    TargetError listing the target's bank names."""
    out: list[int] = []
    for n in names:
        ids = [n] if isinstance(n, int) else resolve_group(target, "memory_banks", n).get("ids", [])
        out.extend(i for i in ids if i not in out)
    return out
