"""The padding analysis's rules, by name: the op table (`OpSpec.padding`, see
`graphmode.ir.ops.PADDING_RULES`) says which rule each op follows, and the analyzer
(analysis/padding.py) dispatches through this registry. A rule takes the analyzer, the node,
its inputs' states and the taint collected so far, and returns one state per output."""
from __future__ import annotations

from typing import Callable

from graphmode.errors import IRError
from graphmode.ir.ops import PADDING_RULES

Rule = Callable[..., list]
RULES: dict[str, Rule] = {}


def rule(name: str) -> Callable[[Rule], Rule]:
    if name not in PADDING_RULES:
        raise IRError(f"padding rule {name!r} is not in the op table's vocabulary",
                      fix=f"one of {sorted(PADDING_RULES)}")

    def deco(fn: Rule) -> Rule:
        RULES[name] = fn
        return fn
    return deco


from graphmode.analysis.padding_rules import contract, data, layout, pointwise, reduce  # noqa: E402,F401 - registers
