"""Output structure (graphmode/capture/outputs.py): names by structure, a JSON spec that rebuilds
what eager returned, caches left out."""
from __future__ import annotations

import json

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
