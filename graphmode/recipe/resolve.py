"""Resolve a recipe's target-relative values (`${...}`, bank names) against one Target."""
from __future__ import annotations

from typing import Any

import graphmode.recipe.symbolic as symbolic
from graphmode.errors import RecipeError, RecipeErrors
from graphmode.recipe.loader import build_recipe
from graphmode.recipe.schema import Recipe


def resolve(recipe: Recipe, target: Any) -> Recipe:
    """A new Recipe with every target-relative value replaced by its value on `target`.

    Bank names resolve to bank ids; on a target without `groups.memory_banks` the affinity
    does not apply and resolves to [] (noted in the validation report). Raises RecipeErrors.
    """
    errors: list[RecipeError] = []
    data = recipe.model_dump(mode="python")
    data["targets"] = list(recipe.targets)        # keep inline Target objects as they are

    def sub(v: Any, path: str) -> Any:
        if not symbolic.is_symbolic(v):
            return v
        try:
            x = symbolic.evaluate(v, target)
        except symbolic.SymbolicError as e:
            errors.append(RecipeError(f"cannot resolve on target {target.name!r}: {e}", where=path, value=v,
                                      line=recipe.line_of(path), fix=f"valid references: {symbolic.VALID_REFS}"))
            return v
        return int(x) if float(x).is_integer() else float(x)

    data = {k: (v if k == "targets" else symbolic.walk(v, k, sub)) for k, v in data.items()}
    banks, problems = symbolic.resolve_banks(recipe.memory.bank_affinity, target)
    for i, msg in problems:
        path = f"memory.bank_affinity[{i}]"
        errors.append(RecipeError(msg, where=path, value=recipe.memory.bank_affinity[i], line=recipe.line_of(path)))
    data["memory"]["bank_affinity"] = banks or []
    if errors:
        raise RecipeErrors(errors)
    try:
        out = build_recipe(data, recipe._lines, recipe.source)
    except RecipeErrors as e:     # a resolved value broke a range (e.g. budget_mb <= 0)
        raise RecipeErrors([RecipeError(f"{x.message} (after resolving on target {target.name!r})",
                                        where=x.where, value=x.value, line=x.line, fix=x.fix)
                            for x in e.errors]) from None
    out._resolved_on = target.name
    if banks is None:
        out._notes.append(f"memory.bank_affinity {recipe.memory.bank_affinity} does not apply: "
                          f"target {target.name!r} declares no memory_banks group")
    elif recipe.memory.bank_affinity:
        out._notes.append(f"memory.bank_affinity {recipe.memory.bank_affinity} -> banks {banks} "
                          f"on {target.name!r}")
    return out
