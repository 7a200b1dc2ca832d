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
