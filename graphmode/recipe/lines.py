"""Field paths (`dims.seq.max`, `inputs[0].dtype`) and the YAML line each was read from.

Every recipe error names a field path and, when the recipe came from YAML, its line; the
loader records `{path: line}` and these two helpers build and look up those paths.
"""
from __future__ import annotations

from typing import Any


def join(path: str, part: Any) -> str:
    """`path` extended by a mapping key (`a.b`) or a list index (`a[0]`)."""
    if isinstance(part, int) and not isinstance(part, bool):
        return f"{path}[{part}]"
    return f"{path}.{part}" if path else str(part)


def nearest_line(lines: dict[str, int], path: str) -> int | None:
    """Line of `path`, else of its nearest recorded ancestor (a value written in a flow
    mapping has no line of its own), else of the document."""
    while path and path != "<root>":
        if path in lines:
            return lines[path]
        cut = max(path.rfind("."), path.rfind("["))
        path = path[:cut] if cut > 0 else ""
    return lines.get("")
