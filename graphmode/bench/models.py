"""What the benchmark and the profiler run: model specs, shapes, and the recipe graphmode gets.

A *case* is one model at one shape. Shapes are written like the model's first input
(`1x128` for MiniLM/GPT-2 `[batch, seq]`, `8x3x224x224` for ResNet-18), or as just the
symbolic dims in order (`8` for ResNet-18's batch), or as `batch=8,seq=128`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence

from graphmode.errors import GraphmodeError

# The default matrix: model -> shapes of the first input.
DEFAULT_SHAPES: dict[str, list[tuple[int, ...]]] = {
    "minilm": [(1, 16), (1, 128), (8, 128)],
    "gpt2": [(1, 16), (1, 128)],
    "resnet18": [(1, 3, 224, 224), (8, 3, 224, 224)],
}
DEFAULT_MODELS = list(DEFAULT_SHAPES)
PRETTY = {"minilm": "all-MiniLM-L6-v2", "gpt2": "GPT-2 small", "resnet18": "ResNet-18"}


@dataclass
class ModelCase:
    """One model (a resolved ModelBundle) and the dim values of each benchmarked shape."""

    spec: str                       # what the user typed (`minilm`, `pkg.mod:fn`)
    name: str                       # short name used in rows (`minilm`)
    bundle: Any                     # graphmode.capture.zoo.ModelBundle
    envs: list[dict[str, int]]      # one {dim: value} per shape
    load_s: float = 0.0

    def shape_of(self, env: dict[str, int]) -> list[int]:
        """The first input's concrete shape (what rows report as `shape`)."""
        first = self.bundle.input_names[0]
        return self.bundle.input_shape(first, env)


def resolve_bundle(spec: str):
    """A built-in name or `package.module:function` / `file.py:function` -> ModelBundle.
    ONNX files are refused: every engine is compared with the eager torch module."""
    from graphmode.capture.spec import OnnxModelSpec, resolve_model_spec
    b = resolve_model_spec(spec)
    if isinstance(b, OnnxModelSpec):
        raise GraphmodeError("the benchmark needs a PyTorch model (eager is the reference)",
                             where="--model", value=spec,
                             fix="give a built-in name or 'package.module:function' returning "
                                 "(module, example_inputs[, input_dims])")
    return b


def canonical_name(spec: str, bundle: Any = None) -> str:
    """Built-ins by their short name (`minilm`), other models by the bundle's name."""
    from graphmode.capture import zoo
    key = zoo.ALIASES.get(spec.lower(), spec.lower())
    if key in zoo.BUILTINS:
        return key
    return getattr(bundle, "name", None) or spec


def parse_shape(text: str, bundle: Any) -> dict[str, int] | None:
    """`1x128` / `8` / `batch=8,seq=128` -> {dim: value} for `bundle`, or None when the text
    does not fit this model (wrong rank, or a fixed axis that differs)."""
    t = text.strip().lower()
    dims = bundle.dim_names
    first = bundle.input_dims[bundle.input_names[0]]
    try:
        if "=" in t:
            env = {k.strip(): int(v) for k, v in (p.split("=", 1) for p in t.split(","))}
            return env if set(env) == set(dims) and all(v >= 1 for v in env.values()) else None
        vals = [int(v) for v in re.split(r"[x,]", t) if v]
    except ValueError:
        raise GraphmodeError(f"cannot parse shape {text!r}", where="--shape",
                             fix="write it like the first input's shape (1x128, 8x3x224x224), "
                                 "the symbolic dims only (8) or batch=1,seq=128") from None
    if any(v < 1 for v in vals):
        return None
    if len(vals) == len(first):
        env: dict[str, int] = {}
        for d, v in zip(first, vals):
            if isinstance(d, int):
                if d != v:
                    return None
            elif env.setdefault(d, v) != v:
                return None
        return env if set(env) == set(dims) else None
    if len(vals) == len(dims):
        return dict(zip(dims, vals))
    return None


def default_envs(name: str, bundle: Any) -> list[dict[str, int]]:
    shapes = DEFAULT_SHAPES.get(name)
    if shapes is None:
        return [bundle.example_shape()]
    return [parse_shape("x".join(map(str, s)), bundle) for s in shapes]


def load_cases(models: Sequence[str], shapes: Sequence[str], *, quick: bool = False) -> list[ModelCase]:
    """Build every selected model once; attach the shapes that fit it (or its defaults)."""
    import time
    cases = []
    unused = list(shapes)
    for spec in models:
        t0 = time.perf_counter()
        bundle = resolve_bundle(spec)
        load_s = time.perf_counter() - t0
        name = canonical_name(spec, bundle)
        if shapes:
            envs = []
            for s in shapes:
                env = parse_shape(s, bundle)
                if env is not None:
                    envs.append(env)
                    if s in unused:
                        unused.remove(s)
            if not envs:
                first = bundle.input_names[0]
                raise GraphmodeError(f"no --shape fits model {spec!r}", where="--shape", value=list(shapes),
                                     fix=f"its first input {first!r} is {bundle.input_dims[first]}; e.g. "
                                         f"{'x'.join(str(x) for x in bundle.input_shape(first, bundle.example_shape()))}")
        else:
            envs = default_envs(name, bundle)
        if quick:
            envs = envs[:1]
        cases.append(ModelCase(spec, name, bundle, envs, load_s))
    if unused:
        raise GraphmodeError(f"shape(s) {unused} fit none of the models {list(models)}", where="--shape",
                             fix="write shapes like the first input of a selected model")
    return cases


# ---- the recipe graphmode gets ---------------------------------------------------------------------

def auto_recipe(bundle: Any, envs: Sequence[dict[str, int]], name: str | None = None) -> dict:
    """A graph-mode recipe whose buckets are exactly the benchmarked dim values (no padding)."""
    from graphmode.ir.types import TORCH_TO_DTYPE
    dims: dict[str, dict] = {}
    for d in bundle.dim_names:
        vals = sorted({int(e[d]) for e in envs})
        dims[d] = {"buckets": vals}
    inputs = [{"name": n, "dtype": TORCH_TO_DTYPE[bundle.example_inputs[n].dtype], "shape": list(bundle.input_dims[n])}
              for n in bundle.input_names]
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name or f"bench-{bundle.name}")
    return {"version": 1, "name": safe, "description": "generated by graphmode bench/profile: buckets at the "
            "benchmarked shapes", "inputs": inputs, "dims": dims, "exe_mode": "graph", "targets": ["host"]}

