"""PyTorch OpInfo conformance: the f32 samples of `op_db`, each as a one-op module, through
`graphmode.compile` in graph mode and in hybrid mode, beside torch.compile (inductor).

A sample is named `op[.variant]#k`: the k-th float32 CPU sample of that OpInfo entry, generated
under a seed fixed by the entry's name, so a name always means the same tensors. Up to
`per_op` samples per entry are taken, spread over its list. Each is wrapped as a small
`nn.Module` (`SampleModule`) whose tensor arguments are its inputs, and compiled with a recipe
whose shapes are the sample's own (static, 0-d and empty axes included; its one dim is the
first nonempty axis, pinned; where every input is 0-d, the first comes in as [1] and is viewed
as 0-d inside).

Every sample is two cases, `graph:<sample>` and `hybrid:<sample>` (tags `graph`, `hybrid`).
graph mode passes only with 0 eager islands (its verdict refuses a graph with any); hybrid
runs what has no lowering as eager islands. A pass matches eager PyTorch: same count, dtypes
and shapes; floats rel L2 <= 1e-5 with NaN and inf at the same places; integers and bools
exact. torch.compile's verdict on the same module is recorded beside graph mode's on one
sample in `inductor_every` (an inductor compile takes seconds).

What is not a case (counted in `skipped`, never classified): a sample whose op draws random
numbers (OpInfo fixes the seed inside its call; a compiled model cannot reproduce that
stream), returns no tensor (or a sparse one), or has no tensor argument, and a sample that
eager PyTorch itself fails on.
"""
from __future__ import annotations

import functools
import hashlib
import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

REL_L2 = 1e-5


@functools.lru_cache(maxsize=1)
def op_db() -> list:
    """OpInfo entries that support float32 on CPU (importing the database needs `expecttest`:
    `pip install -e .[conformance]`)."""
    from torch.testing._internal.common_methods_invocations import op_db as db
    return [op for op in db if torch.float32 in op.supported_dtypes("cpu")]


def op_key(op) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def _seed(key: str) -> int:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "little")


def samples_of(op) -> list:
    """The op's f32 CPU samples, generated under a seed fixed by the op's name."""
    return list(_samples(op_key(op)))


@functools.lru_cache(maxsize=2)
def _samples(key: str) -> tuple:
    op = find_op(key)
    state = torch.random.get_rng_state()
    torch.manual_seed(_seed(key))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return tuple(op.sample_inputs("cpu", torch.float32, requires_grad=False))
    finally:
        torch.random.set_rng_state(state)


def case_names(per_op: int = 2, ops: list | None = None) -> list[str]:
    """Up to `per_op` samples of every op, spread over its sample list (first, last, between)."""
    out = []
    for op in ops if ops is not None else op_db():
        try:
            n = len(samples_of(op))
        except Exception:  # noqa: BLE001 - a sample generator that fails is not a graphmode case
            continue
        picks = sorted({round(i * (n - 1) / max(per_op - 1, 1)) for i in range(min(per_op, n))})
        out += [f"{op_key(op)}#{k}" for k in picks]
    return out


def find_op(key: str):
    ops = {op_key(op): op for op in op_db()}
    if key not in ops:
        raise KeyError(f"no OpInfo entry {key!r}")
    return ops[key]


# ---------------------------------------------------------------------------------- one case

class SampleModule(torch.nn.Module):
    """`fn(sample.input, *sample.args, **sample.kwargs)` with the sample's tensors as inputs."""

    def __init__(self, fn: Callable, leaves: list, spec, tensor_at: list[int], lifted: int | None = None):
        super().__init__()
        self.fn, self.leaves, self.spec, self.tensor_at, self.lifted = fn, leaves, spec, tensor_at, lifted

    def call(self, xs: dict) -> Any:
        leaves = list(self.leaves)
        for j, i in enumerate(self.tensor_at):
            t = xs[f"x{j}"]
            leaves[i] = t.reshape(()) if j == self.lifted else t
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        out = self.fn(*args, **kwargs)
        flat = pytree.tree_leaves(out)
        return tuple(flat) if len(flat) != 1 else flat[0]


def sample_module(fn: Callable, leaves: list, spec, tensor_at: list[int], lifted: int | None) -> SampleModule:
    """A SampleModule whose forward names its inputs x0, x1, ... (graphmode binds by the signature)."""
    names = [f"x{j}" for j in range(len(tensor_at))]
    ns: dict[str, Any] = {}
    exec(f"def forward(self, {', '.join(names)}):\n    return self.call({{{', '.join(f'{n!r}: {n}' for n in names)}}})",
         ns)
    cls = type("SampleModule", (SampleModule,), {"forward": ns["forward"]})
    return cls(fn, leaves, spec, tensor_at, lifted)


@dataclass
class Built:
    module: SampleModule
    inputs: dict[str, torch.Tensor]       # as the module takes them (0-d ones as [1])
    recipe: dict
    want: list[torch.Tensor]


class NotACase(Exception):
    """The sample cannot be a conformance case (random op, non-tensor output)."""


# ops whose result is uninitialized memory: two eager calls agree by chance only (a sample then
# passed its admission in one process and failed it in the worker)
UNINITIALIZED = frozenset({"empty", "empty_like", "empty_strided", "empty_permuted", "new_empty",
                           "new_empty_strided"})


def build(name: str) -> Built:
    key, _, k = name.rpartition("#")
    op = find_op(key)
    if op.name in UNINITIALIZED:
        raise NotACase("the op returns uninitialized memory")
    sample = samples_of(op)[int(k)]
    leaves, spec = pytree.tree_flatten(((sample.input, *sample.args), dict(sample.kwargs)))
    tensor_at = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
    # a recipe's dim must be some input's axis: when no input has a nonempty axis, the first 0-d
    # input comes in as shape [1] and is viewed as 0-d inside
    lifted = None
    if not any(s >= 1 for i in tensor_at for s in leaves[i].shape):
        lifted = next((j for j, i in enumerate(tensor_at) if leaves[i].dim() == 0), None)
    inputs = {f"x{j}": (leaves[i].reshape(1) if j == lifted else leaves[i]).detach().clone()
              for j, i in enumerate(tensor_at)}
    if not inputs:
        raise NotACase("the sample has no tensor argument")
    module = sample_module(op.op, leaves, spec, tensor_at, lifted).eval()
    want = _eager(module, inputs)
    again = _eager(module, inputs)
    if len(want) != len(again) or not all(_same_bits(a, b) for a, b in zip(want, again)):
        raise NotACase("eager results differ between two calls (a random op)")
    return Built(module, inputs, recipe_for(inputs), want)


class _RandomOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the ATen ops a call runs that draw from the random generator."""

    def __init__(self):
        super().__init__()
        self.seen: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.seen.add(str(func))
        return func(*args, **(kwargs or {}))


def _eager(module: SampleModule, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    rec = _RandomOps()
    with torch.no_grad(), rec:
        out = module(**{k: v.clone() for k, v in inputs.items()})
    if rec.seen:
        raise NotACase(f"a random op ({', '.join(sorted(rec.seen))}): OpInfo fixes its seed, a compiled model cannot")
    flat = pytree.tree_leaves(out)
    if not flat or not all(isinstance(t, torch.Tensor) for t in flat):
        raise NotACase(f"the op returns {type(out).__name__}, not tensors")
    if any(t.layout != torch.strided for t in flat):
        raise NotACase("the op returns a sparse tensor")
    return flat


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and (a.numel() == 0 or torch.equal(
        torch.nan_to_num(a) if a.is_floating_point() else a, torch.nan_to_num(b) if b.is_floating_point() else b))


_DTYPE_NAMES = {torch.float32: "f32", torch.float64: "f64", torch.float16: "f16", torch.bfloat16: "bf16",
                torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
                torch.bool: "bool"}


def recipe_for(inputs: dict[str, torch.Tensor]) -> dict:
    """The sample's own shapes, static (0-d inputs as shape [], empty axes as 0), the first axis
    of extent >= 1 named `n` and pinned at its extent (a recipe with a dim, as most users write);
    a sample whose every axis is empty gets a recipe without dims (fully static)."""
    specs = [{"name": name, "dtype": _DTYPE_NAMES.get(t.dtype, str(t.dtype).replace("torch.", "")),
              "shape": [int(s) for s in t.shape]} for name, t in inputs.items()]
    dims = {}
    pinned = next(((sp, ax) for sp in specs for ax, e in enumerate(sp["shape"]) if e >= 1), None)
    if pinned is not None:
        sp, ax = pinned
        dims["n"], sp["shape"][ax] = sp["shape"][ax], "n"
    return {"version": 1, "name": "opinfo-case", "inputs": specs, "dims": dims,
            "codegen": {"kernel_selection": "heuristic"}, "memory": {"budget_mb": 1024}}


def compare(got: list[torch.Tensor], want: list[torch.Tensor]) -> str:
    """'' when `got` matches eager's `want`, else what differs."""
    if len(got) != len(want):
        return f"{len(got)} outputs, eager has {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        if not isinstance(g, torch.Tensor):
            return f"output {i} is a {type(g).__name__}"
        if g.dtype != w.dtype or tuple(g.shape) != tuple(w.shape):
            return f"output {i}: {g.dtype} {tuple(g.shape)}, eager {w.dtype} {tuple(w.shape)}"
        if w.numel() == 0:
            continue
        if not w.is_floating_point():
            if not torch.equal(g, w):
                return f"output {i}: {int((g != w).sum())} of {w.numel()} elements differ"
            continue
        g, w = g.double(), w.double()
        nan = torch.isnan(w)
        if not torch.equal(torch.isnan(g), nan):
            return f"output {i}: NaN at {int((torch.isnan(g) != nan).sum())} positions where eager differs"
        g, w = g[~nan], w[~nan]
        inf = torch.isinf(w)
        if not torch.equal(g[inf], w[inf]) or torch.isinf(g[~inf]).any():
            return f"output {i}: infinities differ"
        g, w = g[~inf], w[~inf]
        ref = float(torch.linalg.vector_norm(w))
        err = float(torch.linalg.vector_norm(g - w))
        if err > REL_L2 * ref and err > 1e-6 * math.sqrt(max(w.numel(), 1)):
            return f"output {i}: rel L2 {err / ref if ref else math.inf:.3g}"
    return ""


def run_graphmode(b: Built, mode: str, cache_dir: str | None = None) -> str | None:
    """`b` through graphmode.compile in `mode`: None when it matches eager, else how it differs
    (graphmode errors propagate: the runner's `judge` classifies them)."""
    import graphmode
    # the sample itself is the example a user would hand in (index ops need in-range values)
    example = {k: v.clone() for k, v in b.inputs.items()}
    cm = graphmode.compile((b.module, example), dict(b.recipe, exe_mode=mode), cache_dir=cache_dir, threads=1)
    islands = sorted({f.target for f in cm.capture_report.fallbacks}) if cm.capture_report else []
    if mode == "graph" and islands:
        return f"graph mode ran eager islands {islands}"
    with torch.no_grad():
        got = pytree.tree_leaves(cm(**{k: v.clone() for k, v in b.inputs.items()}))
    return compare(got, b.want) or None


def run_inductor(b: Built) -> str | None:
    torch._dynamo.reset()
    fn = torch.compile(b.module, backend="inductor")
    with torch.no_grad():
        got = pytree.tree_leaves(fn(**{k: v.clone() for k, v in b.inputs.items()}))
    return compare(got, b.want) or None


# ---------------------------------------------------------------------------------- the suite

class OpInfoSuite:
    """`runner.Suite` over OpInfo's f32 samples (see the module docstring). `ops`: take only
    that many OpInfo entries, spread over the database in a fixed order, one sample each (the
    CI-sized run); None: every entry, `per_op` samples each. `ids`: exactly these cases
    (`graph:atan#0`), listed without importing the database (a sample that is no case is then
    the case's crash, not a skip)."""

    name = "opinfo"
    title = "PyTorch OpInfo samples (f32)"
    subsets = {"graph": "graph mode, 0 eager islands", "hybrid": "hybrid mode (eager islands allowed)"}
    others = ("torch.compile",)

    def __init__(self, cache_dir: str | None = None, per_op: int = 2, inductor_every: int = 8,
                 ops: int | None = None, ids: list[str] | None = None):
        self.cache_dir, self.per_op, self.inductor_every, self.ops = cache_dir, per_op, inductor_every, ops
        self.ids = ids
        self.skipped: dict[str, str] = {}          # sample -> why it is not a case

    def cases(self) -> list:
        from graphmode.conformance.runner import Case
        if self.ids is not None:
            odd = [i for i in self.ids if i.partition(":")[0] not in self.subsets or "#" not in i]
            if odd:
                raise ValueError(f"OpInfo case ids {odd} are not MODE:OP#K with MODE graph or hybrid")
            return [Case(i, name.rpartition("#")[0], (mode,), (name, mode))
                    for i in self.ids for mode, _, name in [i.partition(":")]]
        return [Case(f"{mode}:{name}", name.rpartition("#")[0], (mode,), (name, mode))
                for name in self.sample_names() for mode in ("graph", "hybrid")]

    def sample_names(self) -> list[str]:
        """The samples that are cases, in op order."""
        if self.ops is None:
            names = case_names(self.per_op)
        else:
            entries = sorted(op_db(), key=lambda op: hashlib.sha256(op_key(op).encode()).hexdigest())
            names = []
            for op in entries:               # the first `ops` entries with a sample that is a case
                if len(names) >= self.ops:
                    break
                names += [n for n in case_names(1, [op]) if self._is_case(n)]
            return sorted(names)
        return [n for n in names if self._is_case(n)]

    def _is_case(self, name: str) -> bool:
        try:
            build(name)
        except NotACase as e:
            self.skipped[name] = str(e)
            return False
        except Exception as e:  # noqa: BLE001 - a sample eager PyTorch fails on is no graphmode case
            self.skipped[name] = f"eager PyTorch fails on it: {type(e).__name__}"
            return False
        return True

    def run_case(self, case):
        from graphmode.conformance.runner import judge
        name, mode = case.payload
        b = build(name)
        judged = judge(lambda: run_graphmode(b, mode, self.cache_dir))
        if mode == "graph" and self.inductor_every and _seed(name) % self.inductor_every == 0:
            try:
                judged.others["torch.compile"] = "pass" if run_inductor(b) is None else "fail"
            except Exception:  # noqa: BLE001 - torch.compile failing on a case is its verdict
                judged.others["torch.compile"] = "fail"
        return judged

    def versions(self) -> dict[str, str]:
        from importlib.metadata import version
        return {"expecttest": version("expecttest")}
