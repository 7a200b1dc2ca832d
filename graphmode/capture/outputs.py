"""A model's output structure: names for its flat outputs, and a spec to hand back what eager returns.

The compiled graph computes a flat list of tensors; the CompiledModel returns the structure
eager PyTorch returns: a Tensor, a tuple or list, a dict, or a transformers `ModelOutput`
with the same fields. Names follow that structure, so a recipe's `outputs:` can be written
without capturing first: `output` for a lone tensor, `output_0`, `output_1`, ... for a tuple,
the keys of a dict or ModelOutput, joined with `_` when nested (`hidden_states_1`).
Key/value caches in an output (transformers' `DynamicCache` and friends) are left out of the
flat list and come back as None.

The spec is plain JSON (it is stored in `.gm` artifacts): {"t": "tensor"} | {"t": "none"} |
{"t": "tuple" | "list", "items": [...]} | {"t": "dict", "keys": [...], "items": [...][, "key_kind":
"int" | "key_kinds": ["int", "str", ...]][, "ordered": true]} | {"t": "model_output" | "namedtuple",
"class": "module.Class", "keys": [...], "items": [...]} | {"t": "structseq", "class":
"torch.return_types.sort", "items": [...]}: a NamedTuple,
torch's (values, indices) results, an OrderedDict and int keys come back as eager returns them.
"""
from __future__ import annotations

import importlib
import re
from collections import OrderedDict, namedtuple
from typing import Any

import torch

TOP = "output"
_KEY_KINDS = {str: "str", int: "int"}


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
                spec.update(t="model_output", **{"class": _path(type(obj))})
                _LIVE[_path(type(obj))] = type(obj)      # a model's own ModelOutput subclass too
            else:
                kinds = [_KEY_KINDS.get(type(k)) for k in keys]
                if None in kinds:
                    bad = keys[kinds.index(None)]
                    raise TypeError(f"model output dict key {bad!r} is a {type(bad).__name__}; graphmode hands "
                                    "back dicts keyed by str or int (return those keys)")
                if keys and set(kinds) == {"int"}:
                    spec["key_kind"] = "int"
                elif len(set(kinds)) > 1:        # str and int together: each key as it was ({0: .., "0": ..})
                    spec["key_kinds"] = kinds
                if isinstance(obj, OrderedDict):
                    spec["ordered"] = True
            return spec
        if isinstance(obj, (tuple, list)):
            fields = getattr(type(obj), "_fields", None)
            keys = list(fields) if isinstance(obj, tuple) and isinstance(fields, tuple) else None
            items = [walk(v, f"{name or TOP}_{keys[i] if keys else i}") for i, v in enumerate(obj)]
            if keys is not None:                         # a NamedTuple: rebuilt with its fields
                _LIVE[_path(type(obj))] = type(obj)
                return {"t": "namedtuple", "class": _path(type(obj)), "keys": keys, "items": items}
            if type(obj).__module__ == "torch.return_types":    # sort / topk / max(dim): .values, .indices
                return {"t": "structseq", "class": _path(type(obj)), "items": items}
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


def _path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


# NamedTuple and ModelOutput classes seen in this process's outputs: rebuilt as themselves; a
# loaded artifact's are rebuilt as a namedtuple of the same name and fields, or as a transformers
# class (no other module is imported for them: an artifact's spec is untrusted)
_LIVE: dict[str, type] = {}


def _tuple_class(s: dict) -> Any:
    path, fields = s["class"], tuple(s["keys"])
    live = _LIVE.get(path)
    if live is not None and getattr(live, "_fields", None) == fields:
        return live
    name = path.rpartition(".")[2].split(".")[-1]
    return namedtuple(name if name.isidentifier() else "Output", fields, rename=True)


def _structseq(path: str) -> Any:
    mod, _, name = path.rpartition(".")
    cls = getattr(torch.return_types, name, None) if mod == "torch.return_types" else None
    return cls if isinstance(cls, type) else tuple


def _class(path: str) -> Any:
    """The ModelOutput class `path` names, or None (then a plain dict is returned): a class this
    process's model returned, or a transformers class with `to_tuple`, whatever a saved spec says."""
    live = _LIVE.get(path)
    if live is not None and hasattr(live, "to_tuple"):
        return live
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
        if t == "namedtuple":
            return _tuple_class(s)(*items)
        if t == "structseq":
            cls = _structseq(s["class"])
            return cls(items) if cls is not tuple else tuple(items)
        fields = {k: v for k, v in zip(s["keys"], items) if v is not None}
        cls = _class(s["class"]) if t == "model_output" else None
        if cls is not None:
            return cls(**fields)
        kinds = s.get("key_kinds") or [s.get("key_kind", "str")] * len(s["keys"])
        keys = [int(k) if kind == "int" else k for k, kind in zip(s["keys"], kinds)]
        return (OrderedDict if s.get("ordered") else dict)(zip(keys, items))

    return build(spec)
