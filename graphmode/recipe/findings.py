"""The problems a recipe check finds: errors (a RecipeError naming the field path, value,
YAML line and fix) and warnings (legal but probably not meant)."""
from __future__ import annotations

from typing import Any

from graphmode.errors import RecipeError
from graphmode.recipe.schema import Recipe


class Findings:
    """What the checks of `recipe` (against `target`, or None) found so far."""

    def __init__(self, recipe: Recipe, target: Any):
        self.r = recipe
        self.t = target
        self.errors: list[RecipeError] = []
        self.warnings: list[str] = []

    def err(self, path: str, msg: str, value: Any = None, fix: str | None = None) -> None:
        self.errors.append(RecipeError(msg, where=path, value=value, line=self.r.line_of(path), fix=fix))

    def warn(self, path: str, msg: str) -> None:
        line = self.r.line_of(path)
        self.warnings.append(f"{path}{f', line {line}' if line else ''}: {msg}")

    def err_first(self, path: str, bad: list[int], values: list[Any], msg: str, fix: str | None = None) -> None:
        """One error for the first of the offending list entries `bad` (and how many more)."""
        if bad:
            more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
            self.err(f"{path}[{bad[0]}]", msg + more, values[bad[0]], fix=fix)


__all__ = ["Findings"]
