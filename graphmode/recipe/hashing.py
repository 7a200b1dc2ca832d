"""The recipe's content hash: its version stamp in plan cache keys, metrics and `recipe show`.

A stamp must not change when graphmode learns a new field that a recipe does not use, so
input fields added after recipes were first hashed are left out while they hold the value
every earlier recipe implicitly had. Those values are pinned here, not read from the
schema: changing a schema default later must not re-stamp old recipes.
"""
from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from graphmode.recipe.schema import Recipe

HASH_CHARS = 16
# input field -> the value it is omitted at (the value recipes had before the field existed)
INPUT_FIELDS_SINCE_V1: dict[str, Any] = {"role": "data", "mask_for": [], "range": None, "value": None}


def canonical_json(recipe: "Recipe") -> str:
    """Canonical JSON of the recipe (defaults included, keys sorted, no whitespace)."""
    data = recipe.model_dump(mode="json")
    for inp in data["inputs"]:
        for k, implicit in INPUT_FIELDS_SINCE_V1.items():
            if inp.get(k) == implicit:
                del inp[k]
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def recipe_hash(recipe: "Recipe") -> str:
    """First 16 hex digits of sha256(canonical JSON). Hash the *resolved* recipe to stamp a
    deployment: the same file resolved on two targets gets two stamps."""
    return hashlib.sha256(canonical_json(recipe).encode()).hexdigest()[:HASH_CHARS]
