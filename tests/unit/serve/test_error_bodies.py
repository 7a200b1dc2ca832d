"""Every error body carries the same top-level fields (error, message, where, fix): a recipe's
several field errors and a contract's several reasons had only their lists (`errors`,
`issues`), so a client reading `message` / `where` / `fix` got nothing for them."""
from __future__ import annotations

from graphmode.errors import RecipeError, RecipeErrors
from graphmode.serve.errors import error_dict, openai_error
from graphmode.verdict import ContractRefused, Issue


def test_a_recipes_field_errors_lead_with_the_first():
    e = RecipeErrors([RecipeError("must be >= 1", where="dims.batch.min", value=0, fix="dims.batch.min: 1"),
                      RecipeError("unknown field", where="dimz", fix="dims")])
    d = error_dict(e)
    assert d["error"] == "RecipeErrors" and d["where"] == "dims.batch.min" and d["fix"] == "dims.batch.min: 1"
    assert d["message"] == "2 error(s) in recipe; first: must be >= 1" and d["value"] == "0"
    assert [x["where"] for x in d["errors"]] == ["dims.batch.min", "dimz"]
    body = openai_error(e)
    assert body["param"] == "dims.batch.min" and "dims.batch.min: 1" in body["message"]


def test_a_contracts_reasons_lead_with_the_first():
    e = ContractRefused([Issue("padding", "padding seq can change the outputs", "dims.seq", fix="exact buckets"),
                         Issue("model", "slice reads past the axis", "dims.n.min", 2)])
    d = error_dict(e)
    assert d["error"] == "ContractRefused" and d["where"] == "dims.seq" and d["fix"] == "exact buckets"
    assert d["message"].endswith("first: padding seq can change the outputs") and len(d["issues"]) == 2
