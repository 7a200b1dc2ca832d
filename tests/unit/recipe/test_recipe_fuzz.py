"""Property-based fuzz: any mutation of a valid recipe gives a Recipe or a RecipeError, nothing else.

Mutations: deleted lines/keys, wrong-typed values, random bytes, bad indentation and tabs,
duplicated lines, truncation. Recipes that still load go through semantics and the proofs,
which may refuse them but must not crash.
"""
import copy
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphmode.errors import ConstraintError, RecipeError
from graphmode.recipe import Environment, load_recipe, validate
from graphmode.targets import load_target_file

ROOT = Path(__file__).resolve().parents[3]
DATA = Path(__file__).resolve().parents[1] / "data" / "recipes"
TEXT = (ROOT / "examples" / "recipes" / "gpt2_decoder.yaml").read_text()
LINES = TEXT.splitlines(keepends=True)
BASE = yaml.safe_load(TEXT)
CPU = load_target_file(DATA / "cpu_target.yaml")
ENV = Environment(python="3.11.7", torch="2.13.0+cpu", graphmode="0.1.0")
SETTINGS = settings(max_examples=60, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(allow_nan=True),
                    st.text(max_size=12), st.sampled_from(["${target.memory_mb}", "${nope}", "f16", "*", "1e3",
                                                           "batch", "seq", "-1", "0x10", ".inf"]))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                      max_leaves=6)


def check(source) -> None:
    """The only exceptions allowed anywhere on the load -> validate path are the typed ones."""
    try:
        recipe = load_recipe(source)
    except RecipeError:
        return
    try:
        report = validate(recipe, CPU, env=ENV, timeout_ms=500)
        report.raise_for_errors()
    except (RecipeError, ConstraintError):
        pass


@SETTINGS
@given(data=st.data())
def test_text_mutations(data):
    lines = list(LINES)
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, len(lines) - 1))
        op = data.draw(st.sampled_from(["delete", "indent", "tab", "dup", "bytes", "replace", "truncate"]))
        if op == "delete":
            del lines[i]
        elif op == "indent":
            lines[i] = " " * data.draw(st.integers(1, 5)) + lines[i].lstrip(" ")
        elif op == "tab":
            lines[i] = "\t" + lines[i]
        elif op == "dup":
            lines.insert(i, lines[i])
        elif op == "bytes":
            junk = data.draw(st.binary(min_size=1, max_size=8)).decode("latin-1")
            pos = data.draw(st.integers(0, len(lines[i])))
            lines[i] = lines[i][:pos] + junk + lines[i][pos:]
        elif op == "replace" and ":" in lines[i]:
            key = lines[i].split(":", 1)[0]
            junk = ["[", "{", "-1", "", "null", "[1, 2", "&a", "*a", "!!binary x", "|"]
            lines[i] = f"{key}: {data.draw(st.sampled_from(junk))}\n"
        elif op == "truncate":
            lines = lines[:i]
        if not lines:
            lines = [""]
    text = "".join(lines)
    check(text)
    check(text.encode("utf-8", "surrogatepass"))


def _paths(v, path=()):
    yield path
    if isinstance(v, dict):
        for k, x in v.items():
            yield from _paths(x, path + (k,))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            yield from _paths(x, path + (i,))


PATHS = [p for p in _paths(BASE) if p]


@SETTINGS
@given(data=st.data())
def test_structural_mutations(data):
    d = copy.deepcopy(BASE)
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(PATHS))
        parent = d
        try:
            for p in path[:-1]:
                parent = parent[p]
            op = data.draw(st.sampled_from(["delete", "retype", "retype", "add"]))
            if op == "delete":
                del parent[path[-1]]
            elif op == "retype":
                parent[path[-1]] = data.draw(values)
            elif isinstance(parent, dict):
                parent[data.draw(st.text(min_size=1, max_size=8))] = data.draw(values)
        except (KeyError, IndexError, TypeError):
            continue                      # an earlier mutation removed the path
    check(d)
    check(yaml.safe_dump(d, allow_unicode=True))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.binary(max_size=200))
def test_random_bytes(blob):
    check(blob)
    check(blob.decode("latin-1"))
