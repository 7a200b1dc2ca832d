"""Diff and merge of recipes (field by field); the content hash is in `hashing.py`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from graphmode.recipe.loader import build_recipe
from graphmode.recipe.schema import Recipe

_MISSING = object()


@dataclass(frozen=True)
class Change:
    path: str
    old: Any          # None when added
    new: Any          # None when removed
    kind: str         # "added" | "removed" | "changed"

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "kind": self.kind, "old": self.old, "new": self.new}


def _is_named_list(v: Any) -> bool:
    if not isinstance(v, list) or not v:
        return False
    names = [x.get("name") for x in v if isinstance(x, dict)]
    return len(names) == len(v) and all(isinstance(n, str) for n in names) and len(set(names)) == len(v)


def _flatten(v: Any, path: str, out: dict[str, Any]) -> None:
    if isinstance(v, dict) and v:
        for k, x in v.items():
            _flatten(x, f"{path}.{k}" if path else str(k), out)
    elif _is_named_list(v):                         # inputs, inline targets: keyed by name
        for x in v:
            _flatten({k: y for k, y in x.items() if k != "name"}, f"{path}[{x['name']}]", out)
    elif isinstance(v, list) and any(isinstance(x, (dict, list)) for x in v):
        for i, x in enumerate(v):
            _flatten(x, f"{path}[{i}]", out)
    else:                                           # scalars and lists of scalars are leaves
        out[path] = v


def flatten(recipe: Recipe) -> dict[str, Any]:
    out: dict[str, Any] = {}
    _flatten(recipe.model_dump(mode="json"), "", out)
    return out


def diff_recipes(a: Recipe, b: Recipe) -> list[Change]:
    """Changed field paths between two recipes, in a stable order."""
    fa, fb = flatten(a), flatten(b)
    out: list[Change] = []
    for path in sorted(set(fa) | set(fb)):
        x, y = fa.get(path, _MISSING), fb.get(path, _MISSING)
        if (x is _MISSING and y is None) or (y is _MISSING and x is None):
            continue     # a whole section added or removed (sla: null beside its fields) is said by its fields
        if x is _MISSING:
            out.append(Change(path, None, y, "added"))
        elif y is _MISSING:
            out.append(Change(path, x, None, "removed"))
        elif x != y or type(x) is not type(y):
            out.append(Change(path, x, y, "changed"))
    return out


def _deep_merge(a: Any, b: Any) -> Any:
    if isinstance(a, dict) and isinstance(b, dict):
        out = dict(a)
        for k, v in b.items():
            out[k] = _deep_merge(a[k], v) if k in a else v
        return out
    return b


def merge_recipes(base: Recipe, override: Recipe | dict) -> Recipe:
    """`override` on top of `base`: mappings merge key by key, lists and scalars are replaced.

    `override` may be a partial dict (e.g. `{"memory": {"budget_mb": 4096}}`). The result is
    validated like any recipe (RecipeErrors on conflict).
    """
    top = override if isinstance(override, dict) else override.model_dump(mode="python", exclude_unset=True)
    data = _deep_merge(base.model_dump(mode="python", exclude_unset=True), top)
    return build_recipe(data, source="<merged>")
