"""Which Target a recipe is checked against.

A reference is: a Target object; the name of an inline spec in the recipe's `targets`;
a path to a target YAML file; or a name in the target registry (`host`, `h100_sxm`, ...).
Default: the first entry of the recipe's `targets`, else `host`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from graphmode.targets.registry import get_target, load_target_file
from graphmode.targets.schema import Target


def pick_target(recipe: Any, ref: Any = None, *, cache_dir: str | Path | None = None) -> Target:
    """Resolve `ref` (or the recipe's default) to a Target; raises TargetError.

    `cache_dir` is where the registry keeps the `host` probe (its default when None)."""
    if isinstance(ref, Target):
        return ref
    if ref is None:
        ref = recipe.targets[0] if recipe.targets else "host"
        if isinstance(ref, Target):
            return ref
    for t in recipe.targets:
        if isinstance(t, Target) and t.name == ref:
            return t
    if str(ref).endswith((".yaml", ".yml")):
        return load_target_file(ref)
    return get_target(str(ref), cache_dir=cache_dir)
