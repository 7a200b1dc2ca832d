"""Seeded mutation sweep over the shipped and test recipes: every outcome is a verdict or a
GraphmodeError (never another exception), each case ends well within a generous ceiling, and
mutations known to make a recipe invalid are never accepted.

Mutations: huge / negative / NaN / inf numbers, type swaps, `${...}` bombs, long lists,
unicode / newline / NUL names, deleted keys, wide range dims, high ranks, huge fixed extents,
pad values outside the input dtype. Each case goes through the dict and the YAML path.
`test_sweep_fast` runs a slice by default; `test_sweep_full` (~1,500 cases) is `slow`.
"""
from __future__ import annotations

import copy
import json
import math
import random
import signal
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from graphmode.errors import GraphmodeError
from graphmode.recipe import Environment, diff_recipes, load_recipe, validate
from graphmode.targets import load_target_file

ROOT = Path(__file__).resolve().parents[3]
DATA = Path(__file__).resolve().parents[1] / "data" / "recipes"
SEED_FILES = [ROOT / "examples/recipes/minilm_cpu.yaml", ROOT / "examples/recipes/gpt2_decoder.yaml",
              ROOT / "examples/recipes/resnet18_cpu.yaml", DATA / "minilm_over_budget.yaml",
              DATA / "range_decoder.yaml", DATA / "symbolic.yaml"]
SEEDS = {p.stem: yaml.safe_load(p.read_text()) for p in SEED_FILES}
CPU = load_target_file(DATA / "cpu_target.yaml")
ENV = Environment(python="3.11.7", torch="2.13.0+cpu", graphmode="0.1.0")
TIMEOUT_MS = 500          # per Z3 proof; all proofs of a recipe share 3x this
CEILING_S = 60            # per case, generous: a correct validation takes well under a few seconds


class Hang(Exception):
    pass


@contextmanager
def ceiling(seconds: float, label: str):
    """Fail a case that runs past `seconds` instead of hanging the test run (SIGALRM)."""
    def on_alarm(signum, frame):
        raise Hang(f"{label}: still running after {seconds} s")
    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def outcome(source: Any, label: str) -> str:
    """'malformed' | 'refused' | 'unproved' | 'valid'; any exception other than a
    GraphmodeError escapes (and fails the test)."""
    with ceiling(CEILING_S, label):
        try:
            recipe = load_recipe(source)
            recipe.hash()
            diff_recipes(recipe, recipe)
            report = validate(recipe, CPU, env=ENV, timeout_ms=TIMEOUT_MS)
            json.dumps(report.to_dict(), default=str)        # what `recipe validate --json` prints
            report.raise_for_errors()
            return report.verdict
        except GraphmodeError as e:
            e.render()
            return "malformed" if e.exit_code == 2 else "refused"


# ---- mutations -------------------------------------------------------------------------------

INVALID_NUMBERS = [10**400, 1e308, -1e308, math.nan, math.inf, -math.inf]     # no field accepts these
ODD_NUMBERS = [-1, 0, 2**63, 2**31, 10**20, 1e20, 0.5, -0.0, 1e-300, 65536, 2**100]
ODD_VALUES = [None, True, "x", "", [], {}, [1, 2], {"a": 1}, "1e400", ".inf", "${target.memory_mb}", 1.5]
BAD_NAMES = ["name\n", "dim\n", "名前", "a\x00b", "", "x" * 1000, " lead", "tab\t", "$x", "a-b"]
EXPRS = ["${((((9**64)**64)**64)**64)**64}", "${9**64**64}", "${1e999}", "${target.memory_mb * 1e300}",
         "${" + "(" * 90 + "1" + ")" * 90 + "}", "${" + "1+" * 60 + "1}", "${-(2**64)}", "${0**-1}",
         "${1e300 * 1e300}", "${round(1e100) * 10}", "${nope.x}", "${" + "9" * 5000 + "}", "${(1/3)**-64}"]
DIM_SPECS = [{"min": 1, "max": 65536}, {"min": 1, "max": 16384}, {"min": 1, "max": 2**31 - 1, "max_padding": 0.01},
             {"min": 1, "max": 2**31 - 1, "max_buckets": 10**8}, {"min": 2, "max": 65536, "max_buckets": 10**6},
             {"min": 1, "max": 2**31 - 1, "max_padding": 0.0001}, {"min": 1, "max": 2**31 - 1, "max_padding": 0.0},
             {"buckets": list(range(1, 60000, 3))}, {"min": 1, "max": 10**6, "step": 1},
             {"min": 1, "max": 2**31 - 1, "max_padding": 0.001, "max_buckets": 60000}, 10**9]


def paths(v: Any, path: tuple = ()) -> list[tuple]:
    out = [path] if path else []
    if isinstance(v, dict):
        for k, x in v.items():
            out += paths(x, path + (k,))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            out += paths(x, path + (i,))
    return out


def get(d: Any, path: tuple) -> Any:
    for p in path:
        d = d[p]
    return d


def put(d: Any, path: tuple, value: Any) -> None:
    get(d, path[:-1])[path[-1]] = value


def _numeric(d: dict) -> list[tuple]:
    return [p for p in paths(d) if isinstance(get(d, p), (int, float)) and not isinstance(get(d, p), bool)]


@dataclass
class Case:
    label: str
    data: Any
    invalid: bool = False            # a mutation that no valid recipe survives

    def sources(self) -> list[Any]:
        out = [self.data]
        try:
            out.append(yaml.safe_dump(self.data, allow_unicode=True, sort_keys=False))
        except (ValueError, RecursionError, yaml.YAMLError):   # too many digits for repr; nested too deep to dump
            pass
        return out


def m_number(rng, d):
    p = rng.choice(_numeric(d))
    if rng.random() < 0.5:
        v = rng.choice(INVALID_NUMBERS)
        put(d, p, v)
        return f"{p}={v!r:.30}", True
    v = rng.choice(ODD_NUMBERS)
    put(d, p, v)
    return f"{p}={v!r:.30}", False


def m_retype(rng, d):
    p = rng.choice(paths(d))
    v = copy.deepcopy(rng.choice(ODD_VALUES))
    put(d, p, v)
    return f"{p}:={v!r:.30}", False


def m_expr(rng, d):
    p = rng.choice(_numeric(d))
    v = rng.choice(EXPRS)
    put(d, p, v)
    return f"{p}={v:.40}", False


def m_long(rng, d):
    lists = [p for p in paths(d) if isinstance(get(d, p), list) and get(d, p)]
    p = rng.choice(lists)
    n = rng.choice([300, 1000, 10000])
    lst = get(d, p)
    put(d, p, [copy.deepcopy(lst[i % len(lst)]) for i in range(n)])
    return f"{p} x{n}", False


def m_name(rng, d):
    v = rng.choice(BAD_NAMES)
    where = rng.choice(["name", "input", "dim", "output"])
    if where == "name":
        d["name"] = v
    elif where == "input":
        d["inputs"][0]["name"] = v
    elif where == "dim":
        old = next(iter(d["dims"]))
        d["dims"] = {v if k == old else k: x for k, x in d["dims"].items()}
        for inp in d["inputs"]:
            inp["shape"] = [v if e == old else e for e in inp["shape"]]
    else:
        d.setdefault("outputs", {})[v] = ["*"]
    valid = (where == "name" and v == "a-b") or (where != "name" and v == "x" * 1000)  # identifiers have no cap
    return f"{where} name {v!r:.20}", not valid


def m_delete(rng, d):
    p = rng.choice([p for p in paths(d) if isinstance(get(d, p[:-1]), dict)])
    del get(d, p[:-1])[p[-1]]
    return f"del {p}", False


def m_dim(rng, d):
    name = rng.choice(list(d["dims"]))
    spec = copy.deepcopy(rng.choice(DIM_SPECS))
    d["dims"][name] = spec
    return f"dims.{name}={str(spec)[:50]}", False


def m_rank(rng, d):
    inp = rng.choice(d["inputs"])
    n = rng.choice([9, 65, 300])
    inp["shape"] = list(inp["shape"]) + [1] * (n - len(inp["shape"]))
    return f"{inp['name']} rank {n}", True


def m_extent(rng, d):
    inp = rng.choice(d["inputs"])
    v = rng.choice([10**9, 2**31, 2**63, 10**20, 10**400])
    inp["shape"] = list(inp["shape"]) + [v]
    return f"{inp['name']} extent {v!r:.20}", True       # 10**9 is refused by the memory proof


def m_pad(rng, d):
    i = rng.randrange(len(d["inputs"]))
    inp = d["inputs"][i]
    dtype, v = rng.choice([("u8", -1), ("u8", 256), ("i8", 300), ("i8", -129), ("f16", 1e300), ("f16", 65520),
                           ("bool", 2), ("i64", 0.5), ("i64", 2**63), ("f16", 2049), ("bf16", 1e39),
                           ("fp8_e4m3", 449), ("i32", 1e300)])
    inp["dtype"], inp["pad_value"] = dtype, v
    return f"{inp['name']} {dtype} pad {v!r}", True


INLINE = {"name": "chip", "kind": "cpu", "vendor": "v", "arch": "a", "compute_units": 4, "vector_width_bits": 256,
          "l1_bytes": "32 KiB", "l2_bytes": "1 MiB", "llc_bytes": "8 MiB", "memory_bytes": "16 GiB",
          "memory_bandwidth_gbps": 40, "peak_flops": {"f32": "200 GFLOPS"}, "dtypes": ["f32"],
          "groups": {"memory_banks": {"dram": {"ids": [0]}}, "compute_classes": {"vector": {"units": 4}}}}
TARGET_BREAKS = [("memory_bytes", "1e400"), ("memory_bytes", 10**400), ("memory_bytes", math.inf),
                 ("memory_bandwidth_gbps", math.inf), ("memory_bandwidth_gbps", math.nan), ("compute_units", 10**30),
                 ("peak_flops", {"f32": "1e400 TFLOPS"}), ("peak_flops", {"f32": 10**400}), ("l2_bytes", "9e99 TiB"),
                 ("groups", {"memory_banks": {"dram": {"bytes": "1e400"}},
                             "compute_classes": {"v": {"peak_flops": 5}}}),
                 ("launch_overhead_us", math.inf), ("name", "chip\n")]


def m_target(rng, d):
    t = copy.deepcopy(INLINE)
    k, v = rng.choice(TARGET_BREAKS)
    t[k] = copy.deepcopy(v)
    d["targets"] = [t]
    return f"inline target {k}={v!r:.30}", True


def m_deep(rng, d):
    v: Any = 1
    for _ in range(rng.choice([200, 5000])):
        v = [v] if rng.random() < 0.5 else {"a": v}
    p = rng.choice(paths(d))
    put(d, p, v)
    return f"{p} nested", False


def m_wide(rng, d):
    """Many dims, each used by an extra input: plans multiply."""
    n = rng.choice([20, 64, 200])
    for i in range(n):
        d["dims"][f"w{i}"] = {"buckets": [1, 2]}
    d["inputs"].append({"name": "wide", "dtype": "f32", "shape": [f"w{i}" for i in range(min(n, 8))]})
    for j in range(8, n, 8):
        d["inputs"].append({"name": f"wide{j}", "dtype": "f32", "shape": [f"w{i}" for i in range(j, min(n, j + 8))]})
    return f"{n} more dims", n >= 20                              # 2**20 plans > MAX_PLANS


def m_sla(rng, d):
    n = rng.choice([65, 1000, 10000])
    dim = next(iter(d["dims"]))
    d["sla"] = {"p99_ms": 1000, "per_bucket": [{"match": {dim: [1, 1 + i % 7]}, "p50_ms": 100 + i} for i in range(n)]}
    return f"{n} sla.per_bucket entries", True


def m_many(rng, d):
    """Several of the above at once: whatever happens must still be typed."""
    labels = []
    for _ in range(rng.randint(2, 4)):
        f = rng.choice([m_number, m_retype, m_expr, m_delete, m_dim, m_long])
        try:
            labels.append(f(rng, d)[0])
        except (KeyError, IndexError, TypeError, ValueError, AttributeError):
            continue             # an earlier mutation removed what this one needs
    return "+".join(labels), False


MUTATIONS: list[Callable] = [m_number, m_number, m_retype, m_expr, m_long, m_name, m_delete, m_dim, m_dim,
                             m_rank, m_extent, m_pad, m_target, m_deep, m_wide, m_sla, m_many, m_many]


def cases(n: int, seed: int) -> list[Case]:
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        name = rng.choice(sorted(SEEDS))
        d = copy.deepcopy(SEEDS[name])
        f = rng.choice(MUTATIONS)
        try:
            label, invalid = f(rng, d)
        except (KeyError, IndexError, TypeError, ValueError, AttributeError):
            continue
        out.append(Case(f"{name}: {f.__name__[2:]} {label}", d, invalid))
    return out


def run_cases(batch: list[Case]) -> dict[str, int]:
    """Verdict counts; fails on an untyped exception, a case past CEILING_S, or an invalid
    mutation accepted."""
    counts: dict[str, int] = {}
    for case in batch:
        for src in case.sources():
            verdict = outcome(src, case.label)
            counts[verdict] = counts.get(verdict, 0) + 1
            if case.invalid:
                assert verdict != "valid", f"accepted an invalid recipe: {case.label}"
    return counts


def test_seeds_are_valid():
    for name, d in SEEDS.items():
        assert outcome(copy.deepcopy(d), name) in ("valid", "refused"), name


def test_sweep_fast():
    counts = run_cases(cases(40, seed=1))
    assert counts.get("malformed", 0) > 0


@pytest.mark.slow
def test_sweep_full():
    counts = run_cases(cases(750, seed=2026))     # x2 sources (dict and YAML): ~1,500 validations
    assert counts.get("malformed", 0) > 0 and counts.get("valid", 0) > 0
