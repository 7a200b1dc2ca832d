"""A model's output structure: names for its flat outputs, and a spec to hand back what eager returns.

The compiled graph computes a flat list of tensors; the CompiledModel returns the structure
eager PyTorch returns: a Tensor, a tuple or list, a dict, or a transformers `ModelOutput`
with the same fields. Names follow that structure, so a recipe's `outputs:` can be written
without capturing first: `output` for a lone tensor, `output_0`, `output_1`, ... for a tuple,
the keys of a dict or ModelOutput, joined with `_` when nested (`hidden_states_1`).
Key/value caches in an output (transformers' `DynamicCache` and friends) are left out of the
flat list and come back as None.

The spec is plain JSON (it is stored in `.gm` artifacts): {"t": "tensor"} | {"t": "none"} |
{"t": "tuple" | "list", "items": [...]} | {"t": "dict", "keys": [...], "items": [...]} |
{"t": "model_output", "class": "module.Class", "keys": [...], "items": [...]}.
"""
from __future__ import annotations

import importlib
import re
from typing import Any

import torch

TOP = "output"


def is_cache(obj: Any) -> bool:
    """A key/value cache object in a model's output (transformers' DynamicCache and friends)."""
    return type(obj).__name__.endswith("Cache") and hasattr(obj, "get_seq_length")


def _is_mapping(obj: Any) -> bool:
    return isinstance(obj, dict) or (hasattr(obj, "to_tuple") and hasattr(obj, "keys"))


def _key_name(key: Any) -> str:
    name = re.sub(r"\W", "_", str(key))
    return name if name and not name[0].isdigit() else f"{TOP}_{name}"


def describe(out: Any) -> tuple[dict, list[tuple[str, torch.Tensor]]]:
    """(spec, [(name, tensor)]) of a model's output, in the order the spec rebuilds it from.
    Raises TypeError for an output that is not made of tensors (None and caches are allowed)."""
    flat: list[tuple[str, torch.Tensor]] = []

    def walk(obj: Any, name: str | None) -> dict:
        if isinstance(obj, torch.Tensor):
            flat.append((name or TOP, obj))
            return {"t": "tensor"}
        if obj is None or is_cache(obj):
            return {"t": "none"}
        if _is_mapping(obj):
            keys = list(obj.keys())
            items = [walk(obj[k], _key_name(k) if name is None else f"{name}_{_key_name(k)}") for k in keys]
            spec = {"t": "dict", "keys": [str(k) for k in keys], "items": items}
            if not isinstance(obj, dict) or hasattr(obj, "to_tuple"):
                spec.update(t="model_output", **{"class": f"{type(obj).__module__}.{type(obj).__qualname__}"})
            return spec
        if isinstance(obj, (tuple, list)):
            items = [walk(v, f"{name or TOP}_{i}") for i, v in enumerate(obj)]
            return {"t": "list" if isinstance(obj, list) else "tuple", "items": items}
        raise TypeError(f"model output of type {type(obj).__name__} is not a tensor, tuple, list or dict of tensors")

    spec = walk(out, None)
    names = [n for n, _ in flat]
    if len(set(names)) != len(names):         # keys that sanitise to one name: number them instead
        flat = [(f"{TOP}_{i}", t) for i, (_, t) in enumerate(flat)]
    return spec, flat


def tensors(out: Any) -> list[torch.Tensor]:
    """The flat tensors of a model's output, in `describe`'s order."""
    return [t for _, t in describe(out)[1]]


def count(spec: dict) -> int:
    t = spec["t"]
    if t == "tensor":
        return 1
    return sum(count(s) for s in spec.get("items", []))


def _class(path: str) -> Any:
    """The ModelOutput class `path` names, or None (then a plain dict is returned): only a
    transformers class with `to_tuple` is rebuilt, whatever a saved spec says."""
    mod, _, name = path.rpartition(".")
    if mod.split(".")[0] != "transformers":
        return None
    try:
        obj: Any = importlib.import_module(mod)
        for part in name.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError, ValueError):
        return None
    return obj if isinstance(obj, type) and hasattr(obj, "to_tuple") else None


def rebuild(spec: dict, flat: list[Any]) -> Any:
    """The output structure `spec` describes, filled with `flat` (one per tensor, in order)."""
    it = iter(flat)

    def build(s: dict) -> Any:
        t = s["t"]
        if t == "tensor":
            return next(it)
        if t == "none":
            return None
        items = [build(x) for x in s["items"]]
        if t == "tuple":
            return tuple(items)
        if t == "list":
            return items
        fields = {k: v for k, v in zip(s["keys"], items) if v is not None}
        cls = _class(s["class"]) if t == "model_output" else None
        return cls(**fields) if cls is not None else dict(zip(s["keys"], items))

    return build(spec)
