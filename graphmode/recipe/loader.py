"""Load a recipe from YAML (or a dict) into a `Recipe`, with field-level errors.

Every error is a `RecipeError` naming the field path (`dims.seq.max`), the offending value,
the YAML line and what would be valid; all of them are collected into one `RecipeErrors`.
Line numbers come from PyYAML's composed node marks (path -> line).
"""
from __future__ import annotations

import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any, Union

import yaml
from pydantic import BaseModel, ValidationError

from graphmode.errors import RecipeError, RecipeErrors
from graphmode.errors import short_value as _short
from graphmode.recipe.lines import join, nearest_line
from graphmode.recipe.schema import Recipe

MAX_BYTES = 256 << 10        # a recipe is a small file (the shipped ones are ~2 KB); parsing is bounded by it
MAX_NODES = 50_000           # guards against alias bombs
_MERGE_TAG = "tag:yaml.org,2002:merge"


class _Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):   # libyaml: the pure-Python one takes seconds
    """YAML 1.1 reads `1e9` (an exponent without a dot) as a string; YAML 1.2, JSON and every
    user read it as a number."""


_Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9]+[eE][-+]?[0-9]+$"),
                              list("-+0123456789"))
_LOADER = _Loader


# ---- YAML -----------------------------------------------------------------------------------

def _line(node: yaml.Node) -> int:
    return node.start_mark.line + 1


def _walk(node: yaml.Node, path: str, lines: dict[str, int], errors: list[RecipeError],
          stack: set[int], count: list[int]) -> None:
    count[0] += 1
    if count[0] > MAX_NODES:
        raise RecipeError(f"document expands to more than {MAX_NODES} nodes (alias bomb?)",
                          where=path or "<root>", line=_line(node), fix="write the recipe out without deep aliases")
    if id(node) in stack:
        raise RecipeError("recursive alias: a node contains itself", where=path or "<root>", line=_line(node),
                          fix="remove the self-referencing anchor/alias")
    lines.setdefault(path, _line(node))
    if isinstance(node, yaml.SequenceNode):
        stack.add(id(node))
        for i, child in enumerate(node.value):
            _walk(child, join(path, i), lines, errors, stack, count)
        stack.discard(id(node))
    elif isinstance(node, yaml.MappingNode):
        stack.add(id(node))
        seen: dict[Any, int] = {}
        for knode, vnode in node.value:
            if knode.tag == _MERGE_TAG:
                merged = vnode.value if isinstance(vnode, yaml.SequenceNode) else [vnode]
                for m in merged:
                    _walk(m, path, lines, errors, stack, count)
                continue
            if not isinstance(knode, yaml.ScalarNode):
                raise RecipeError("mapping keys must be plain scalars (names)", where=path or "<root>",
                                  line=_line(knode), fix="use `name: value` pairs")
            key = knode.value
            if knode.tag != "tag:yaml.org,2002:str":
                errors.append(RecipeError(f"mapping key must be a name, not {knode.tag.rsplit(':', 1)[-1]} "
                                          f"{key!r}", where=join(path, key), line=_line(knode),
                                          fix="use a name (quote it if it looks like a number)"))
                continue
            if key in seen:
                errors.append(RecipeError(f"duplicate key {key!r} (first at line {seen[key]})",
                                          where=join(path, key), line=_line(knode),
                                          fix="keep only one of them"))
            seen[key] = _line(knode)
            child = join(path, key)
            lines[child] = _line(knode)
            _walk(vnode, child, lines, errors, stack, count)
        stack.discard(id(node))


def _strip(data: Any) -> Any:
    """Drop non-string keys (already reported) and top-level `x-...` extension keys (anchors)."""
    def clean(v: Any, depth: int) -> Any:
        if isinstance(v, dict):
            return {k: clean(x, depth + 1) for k, x in v.items()
                    if isinstance(k, str) and not (depth == 0 and k.startswith("x-"))}
        if isinstance(v, list):
            return [clean(x, depth + 1) for x in v]
        return v
    return clean(data, 0)


def parse_yaml(text: str | bytes, source: str | None = None) -> tuple[Any, dict[str, int], list[RecipeError]]:
    """YAML text -> (data, {path: line}, [duplicate-key errors]); raises RecipeError."""
    where = source or "<recipe>"
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise RecipeError(f"recipe is not UTF-8 text (byte {e.start})", where=where, line=1,
                              fix="save the recipe as UTF-8") from None
    if len(text) > MAX_BYTES:
        raise RecipeError(f"recipe larger than {MAX_BYTES} bytes", where=where, line=1,
                          fix="write long bucket lists as a range with max_padding, not value by value")
    loader = None
    try:
        loader = _LOADER(text)
        node = loader.get_single_node()
        if node is None:
            raise RecipeError("empty recipe", where=where, line=1,
                              fix="start with `version: 1` and `name: ...` (see examples/recipes/)")
        if not isinstance(node, yaml.MappingNode):
            raise RecipeError(f"top level must be a mapping of recipe fields, not a {node.id}",
                              where=where, line=_line(node), fix="write `version: 1`, `name: ...`, `inputs: ...`")
        lines: dict[str, int] = {}
        dup_errors: list[RecipeError] = []
        _walk(node, "", lines, dup_errors, set(), [0])
        data = loader.construct_document(node)
        data = _strip(data)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = mark.line + 1 if mark is not None else None
        problem = " ".join(str(x) for x in (e.context, e.problem) if x) or str(e)
        at = text.splitlines()[line - 1] if line and line <= len(text.splitlines()) else ""
        tab = "'\\t'" in problem or "tab" in problem or "\t" in at[: len(at) - len(at.lstrip())]
        fix = "indent with spaces, not tabs" if tab else \
            "check the YAML syntax (indentation, colons, quotes) at that line"
        raise RecipeError(f"YAML syntax error: {problem}", where=where, line=line, fix=fix) from None
    except yaml.reader.ReaderError as e:
        line = text[: e.position].count("\n") + 1
        raise RecipeError(f"YAML error: character {e.character!r} not allowed ({e.reason})", where=where,
                          line=line, fix="remove control characters from the file") from None
    except yaml.YAMLError as e:
        raise RecipeError(f"YAML error: {e}", where=where, line=1, fix="check the YAML syntax") from None
    except RecursionError:
        raise RecipeError("YAML nested too deeply", where=where, line=1) from None
    except ValueError as e:                 # PyYAML's int(): more than 4300 digits
        raise RecipeError(f"YAML value cannot be read: {str(e)[:120]}", where=where, line=1,
                          fix="write numbers within the documented ranges (examples/recipes/README.md)") from None
    finally:
        if loader is not None:
            loader.dispose()
    return data, lines, dup_errors


# ---- pydantic error mapping -------------------------------------------------------------------

def _unwrap(tp: Any) -> list[Any]:
    """The concrete types an annotation may hold (Annotated/Optional/Union peeled)."""
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return _unwrap(typing.get_args(tp)[0])
    if origin in (Union, types.UnionType):
        return [t for a in typing.get_args(tp) for t in _unwrap(a)]
    return [tp]


def _model_at(parts: list[Any]) -> type[BaseModel] | None:
    """The pydantic model class that validates the mapping at `parts` (data keys)."""
    candidates: list[Any] = [Recipe]
    for part in parts:
        nxt: list[Any] = []
        for tp in candidates:
            origin = typing.get_origin(tp)
            if isinstance(tp, type) and issubclass(tp, BaseModel):
                f = tp.model_fields.get(part) if isinstance(part, str) else None
                if f is not None:
                    nxt.extend(_unwrap(f.annotation))
            elif origin is list and isinstance(part, int):
                nxt.extend(_unwrap(typing.get_args(tp)[0]))
            elif origin is dict:
                nxt.extend(_unwrap(typing.get_args(tp)[1]))
        candidates = nxt
    for tp in candidates:
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            return tp
    return None


def _data_path(data: Any, loc: tuple) -> tuple[list[Any], Any, bool]:
    """Follow a pydantic loc through the data, skipping union tags; -> (parts, value, found)."""
    parts: list[Any] = []
    cur, found = data, True
    for part in loc:
        if isinstance(cur, dict) and part in cur:
            cur = cur[part]
            parts.append(part)
        elif isinstance(cur, list) and isinstance(part, int) and 0 <= part < len(cur):
            cur = cur[part]
            parts.append(part)
        elif isinstance(part, str) and ("[" in part or "-" in part):
            continue                 # "[key]" or a union tag ("target-spec"): not a data key
        elif isinstance(cur, dict) or not found:
            parts.append(part)       # a missing key
            found = False
    return parts, cur, found


def _path_str(parts: list[Any]) -> str:
    path = ""
    for p in parts:
        path = join(path, p)
    return path


def _describe(model: type[BaseModel] | None) -> str:
    if model is None:
        return ""
    return ", ".join(model.model_fields)


def map_validation_error(exc: ValidationError, data: Any, lines: dict[str, int],
                         lookup_line=None) -> list[RecipeError]:
    """pydantic errors -> RecipeErrors with field path, value, YAML line and fix."""
    line_of = lookup_line or (lambda p: nearest_line(lines, p))
    out: list[RecipeError] = []
    seen: set[tuple[str, str]] = set()
    for err in exc.errors(include_url=False):
        loc = tuple(err["loc"])
        parts, value, found = _data_path(data, loc)
        path = _path_str(parts) or "<root>"
        typ, msg = err["type"], err["msg"]
        fix = None
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        if typ == "extra_forbidden":
            key = parts[-1]
            model = _model_at(parts[:-1])
            valid = list(model.model_fields) if model else []
            close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.5)
            msg = f"unknown key {key!r}"
            fix = (f"did you mean {close[0]!r}? " if close else "") + \
                (f"valid keys here: {', '.join(valid)}" if valid else "remove it")
            value = _short(value)
        elif typ == "missing":
            key = parts[-1]
            model = _model_at(parts[:-1])
            msg = f"missing required key {key!r}"
            fix = f"add `{key}:`" + (f" (keys here: {_describe(model)})" if model else "")
            value = None
        elif typ == "literal_error":
            fix = msg.replace("Input should be", "one of:")
            msg = "invalid value"
        elif typ in ("model_type", "dict_type"):
            model = _model_at(parts)
            msg = "expected a mapping" + (f" with keys: {_describe(model)}" if model else "")
            if path.startswith("targets["):
                fix = "a target name from the registry (e.g. host) or an inline target spec"
        elif typ == "list_type":
            msg = "expected a list"
        elif typ == "too_short":
            msg = "must not be empty"
        if "; valid: " in msg and fix is None:
            msg, fix = msg.split("; valid: ", 1)
            fix = "valid: " + fix
        elif "; fix: " in msg and fix is None:
            msg, fix = msg.split("; fix: ", 1)
        key = (path, msg)
        if key in seen:
            continue
        seen.add(key)
        out.append(RecipeError(msg, where=path, value=_short(value) if value is not None else None,
                               line=line_of(path), fix=fix))
    return out


# ---- entry points -----------------------------------------------------------------------------

def build_recipe(data: Any, lines: dict[str, int] | None = None, source: str | None = None,
                 extra_errors: list[RecipeError] | None = None) -> Recipe:
    """Validate a dict into a Recipe; raises RecipeErrors with every field error."""
    lines = lines or {}
    errors = list(extra_errors or [])
    if not isinstance(data, dict):
        raise RecipeError("recipe must be a mapping of fields", where=source or "<recipe>", line=1,
                          value=_short(data))
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as e:
        errors.extend(map_validation_error(e, data, lines))
        recipe = None
    except RecursionError:
        raise RecipeError("recipe nested too deeply", where=source or "<recipe>", line=1) from None
    if errors:
        raise RecipeErrors(sorted(errors, key=lambda e: e.line or 0))
    recipe._lines = dict(lines)
    recipe._source = source
    return recipe


def _looks_like_path(source: str) -> bool:
    if "\n" in source or len(source) > 4096:
        return False
    if source.endswith((".yaml", ".yml")) and ": " not in source:
        return True
    if "/" in source and ": " not in source and not source.lstrip().startswith(("{", "[", "-", "#")):
        return True               # a path that is missing or not a file: said so, not parsed as YAML
    try:
        return Path(source).is_file()
    except OSError:
        return False


MAX_RECIPE_BYTES = 4 << 20        # a recipe is a page of YAML: more is not one


def load_recipe(source: Union[str, Path, bytes, dict, Recipe]) -> Recipe:
    """Load a recipe from a path, YAML text, bytes or a dict (`resolve.resolve` then binds its
    target-relative values to one target).

    Raises `RecipeErrors` (all field errors) or `RecipeError` (unreadable / not YAML).
    """
    if isinstance(source, Recipe):
        return source
    if isinstance(source, dict):
        return build_recipe(source, source="<dict>")
    if not isinstance(source, (str, bytes, Path)):
        raise RecipeError("a recipe is a path, YAML text, bytes, a dict or a Recipe", where="recipe",
                          value=type(source).__name__,
                          fix="pass the recipe's path (examples/recipes/*.yaml) or leave it out to have one drafted")
    name = None
    if isinstance(source, Path) or (isinstance(source, str) and _looks_like_path(source)):
        name = str(source)
        from graphmode.untrusted import UntrustedFileError, read_bytes
        try:      # a regular file of a recipe's size: not /dev/zero, not a FIFO that blocks
            source = read_bytes(source, limit=MAX_RECIPE_BYTES)
        except UntrustedFileError as e:
            raise RecipeError(f"cannot read recipe: {e.message}", where=name,
                              fix="give the path of a recipe YAML file") from None
    data, lines, dups = parse_yaml(source, name)
    return build_recipe(data, lines, name, dups)
