"""A loaded artifact under on_violation: eager has no eager model: a request its plans do not
take is refused with a fix that does not offer on_violation: eager again."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from graphmode.errors import ContractViolation
from graphmode.runtime.compiled import _fallback


def test_the_fix_for_a_loaded_artifact_does_not_offer_the_setting_it_has():
    """Trial AE: 'compile the model again ... with dims.H changed or on_violation: eager' for a
    .gm whose recipe already had on_violation: eager."""
    cm = SimpleNamespace(source=SimpleNamespace(module=None), artifact={"path": "m.gm"})
    err = ContractViolation("dim 'H' = 200 is outside the recipe's range [33, 97]", where="dims.H", value=200,
                            fix="send H in [33, 97], or compile the model again from its source with dims.H changed "
                                "or on_violation: eager")
    with pytest.raises(ContractViolation) as e:
        _fallback(cm, {}, err, "outside")
    assert "on_violation" not in e.value.fix and "dims.H" in e.value.fix and "a model loaded from an artifact" \
        in e.value.message


def test_a_padding_refusal_of_a_loaded_artifact_names_the_buckets_not_the_range():
    """Trial AF: a request inside the range whose mask hides a whole row (padding would change
    it) was told to 'send a request dims.frames admits' or to widen dims.frames, neither of which
    helps: at a bucket value nothing is padded."""
    recipe = SimpleNamespace(dim_buckets=lambda: {"frames": [32, 100], "batch": [1, 4]})
    cm = SimpleNamespace(source=SimpleNamespace(module=None), artifact={"path": "m.gm"}, recipe=recipe)
    err = ContractViolation("input 'attention_mask' masks a whole row along frames", kind="padding",
                            where="dims.frames", value=50,
                            fix="send frames equal to a bucket value [32, 100], or set on_violation: eager")
    with pytest.raises(ContractViolation) as e:
        _fallback(cm, {}, err, "unsafe padding on frames")
    assert e.value.fix.startswith("send frames equal to a bucket value [32, 100] (nothing is padded there)")
    assert "widened" not in e.value.fix and "on_violation" not in e.value.fix
