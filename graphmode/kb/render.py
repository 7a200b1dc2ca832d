"""Recipe YAML with a comment on each value saying where it came from.

Drafted and tuned recipes are read by people before they are trusted, so every value that
graphmode chose carries its reason on its own line (`# from config.max_position_embeddings`).
Mappings of mappings are written in block style, everything else in flow style on one line,
so the comment stays next to the value it explains; the text loads back to the same data.
"""
from __future__ import annotations

import re
from typing import Any

import yaml

# what must not reach a terminal raw: C0/C1 controls (escape sequences, bells, carriage returns)
# and the bidirectional overrides that reorder what is shown
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def shown(v: Any, unit: str = "") -> str:
    """A measured number as tables and comments show it: 4 significant digits, "-" when missing."""
    return "-" if v is None else f"{v:.4g}{unit}"


def terminal_safe(text: Any, limit: int | None = None, *, lines: bool = True) -> str:
    """`text` as a terminal may show it: control characters written as escapes (an imported
    name cannot recolour, move or clear the screen), cut to `limit` characters; tabs and
    newlines kept only with `lines`."""
    s = str(text)
    if limit is not None and len(s) > limit:
        s = s[:limit] + f"... ({len(s) - limit} more characters)"
    keep = "\t\n" if lines else ""
    return _UNSAFE.sub(lambda m: m.group() if m.group() in keep else repr(m.group())[1:-1], s)


def _flow(v: Any) -> str:
    text = yaml.safe_dump(v, default_flow_style=True, width=1 << 30, sort_keys=False).strip()
    return text[: -len("\n...")] if text.endswith("\n...") else text       # a scalar document's end marker


def _is_leaf(v: Any) -> bool:
    """Written on one line: scalars, lists, and mappings without nested mappings."""
    if isinstance(v, dict):
        return all(not isinstance(x, dict) for x in v.values()) and len(_flow(v)) <= 100
    return True


def _comment(note: str | None) -> str:
    return f"  # {' '.join(note.split())}" if note else ""


def _within(notes: dict[str, str], path: str) -> str | None:
    """The notes of `path` and of everything inside it: a one-line value carries them all."""
    found = [n if not k.startswith(f"{path}.") else f"{k[len(path) + 1:]}: {n}"     # whose note it is
             for k, n in notes.items() if k == path or k.startswith((f"{path}.", f"{path}["))]
    return "; ".join(found) or None


def _emit(data: dict[str, Any], path: str, indent: int, notes: dict[str, str], out: list[str]) -> None:
    pad = "  " * indent
    for key, v in data.items():
        p = f"{path}.{key}" if path else str(key)
        note = notes.get(p)
        if isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            out.append(f"{pad}{key}:{_comment(note)}")
            for i, item in enumerate(v):
                out.append(f"{pad}  - {_flow(item)}{_comment(_within(notes, f'{p}[{i}]'))}")
        elif _is_leaf(v):
            out.append(f"{pad}{key}: {_flow(v)}{_comment(_within(notes, p))}")
        else:
            out.append(f"{pad}{key}:{_comment(note)}")
            _emit(v, p, indent + 1, notes, out)


def render(data: dict[str, Any], notes: dict[str, str], header: list[str]) -> str:
    """`data` as YAML text: `header` lines first (as comments), then each value with its note."""
    out = [f"# {' '.join(h.split())}" for h in header]
    _emit(data, "", 0, notes, out)
    return "\n".join(out) + "\n"
