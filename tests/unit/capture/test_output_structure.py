"""Output structure (graphmode/capture/outputs.py): names by structure, a JSON spec that rebuilds
what eager returned, caches left out."""
from __future__ import annotations

import json
from collections import OrderedDict
from typing import NamedTuple

import torch
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from graphmode.capture.outputs import count, describe, rebuild


def test_names_follow_the_structure():
    t = torch.ones(2)
    assert [n for n, _ in describe(t)[1]] == ["output"]
    assert [n for n, _ in describe((t, t))[1]] == ["output_0", "output_1"]
    assert [n for n, _ in describe({"a": t, "b": (t, [t, t]), "c d": t})[1]] == ["a", "b_0", "b_1_0", "b_1_1", "c_d"]
    assert [n for n, _ in describe({"1": t, "output_1": t})[1]] == ["output_0", "output_1"]   # clash: numbered


def test_the_spec_rebuilds_the_same_structure_through_json():
    a, b, c = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)
    out = {"x": a, "y": (b, None, [c])}
    spec, flat = describe(out)
    spec = json.loads(json.dumps(spec))
    assert count(spec) == 3
    back = rebuild(spec, [t for _, t in flat])
    assert back.keys() == out.keys() and back["y"][1] is None and isinstance(back["y"][2], list)
    assert back["y"][2][0] is c


def test_a_model_output_comes_back_as_its_class_and_its_cache_as_none():
    logits = torch.randn(1, 2, 5)
    out = CausalLMOutputWithPast(logits=logits, past_key_values=DynamicCache())
    spec, flat = describe(out)
    assert [n for n, _ in flat] == ["logits"] and spec["t"] == "model_output"
    back = rebuild(json.loads(json.dumps(spec)), [logits])
    assert type(back) is CausalLMOutputWithPast and back.logits is logits and back.past_key_values is None
    assert list(back.keys()) == ["logits"]


def test_a_saved_spec_imports_only_transformers_model_outputs():
    """An artifact's manifest carries the spec: a class it names outside transformers (or one
    that is not a ModelOutput) is never imported or called; the outputs come back as a dict."""
    from graphmode.capture.outputs import rebuild
    x = torch.ones(1)
    for cls in ("os.system", "subprocess.Popen", "transformers.AutoModel", "collections.OrderedDict"):
        spec = {"t": "model_output", "class": cls, "keys": ["logits"], "items": [{"t": "tensor"}]}
        assert rebuild(spec, [x]) == {"logits": x}


class Stats(NamedTuple):
    mean: torch.Tensor
    std: torch.Tensor


def test_named_tuples_return_types_ordered_and_int_keyed_dicts_come_back_as_eager_returns_them():
    """They came back as a plain tuple (no `.mean`, no `.values`), a dict, and str keys."""
    a, b = torch.ones(2), torch.zeros(2)
    out = {"stats": Stats(a, b), "sort": torch.sort(torch.tensor([3.0, 1.0])),
           "by_id": {0: a, 1: b}, "ordered": OrderedDict([("z", a), ("y", b)])}
    spec, flat = describe(out)
    assert [n for n, _ in flat][:2] == ["stats_mean", "stats_std"]
    from graphmode.runtime.manifest import OutputSpec
    OutputSpec.model_validate(spec)
    back = rebuild(json.loads(json.dumps(spec)), [t for _, t in flat])
    assert type(back["stats"]) is Stats and back["stats"].mean is a
    assert type(back["sort"]) is torch.return_types.sort and torch.equal(back["sort"].values, torch.tensor([1.0, 3.0]))
    assert list(back["by_id"]) == [0, 1] and type(back["ordered"]) is OrderedDict and list(back["ordered"]) == ["z", "y"]
    elsewhere = dict(spec, items=[dict(spec["items"][0], **{"class": "not.loaded.Stats"})] + spec["items"][1:])
    other = rebuild(elsewhere, [t for _, t in flat])["stats"]       # a .gm loaded where the class is not defined
    assert type(other).__name__ == "Stats" and other._fields == ("mean", "std") and other.std is b


def test_str_and_int_keys_together_come_back_as_eager_returns_them():
    """{0: .., "a": ..} came back keyed "0"; {"0": .., 0: ..} came back as one key holding the
    wrong value: silently, both."""
    from graphmode.runtime.manifest import OutputSpec
    a, b = torch.ones(2), torch.zeros(2)
    for out in ({0: a, "a": b}, {"0": a, 0: b}):
        spec, flat = describe(out)
        OutputSpec.model_validate(spec)             # a .gm's manifest holds it: saved, then never loadable
        back = rebuild(json.loads(json.dumps(spec)), [t for _, t in flat])
        assert list(back) == list(out) and all(back[k] is out[k] for k in out)
    import pytest
    with pytest.raises(TypeError, match="key 1.5 is a float"):
        describe({1.5: a})
