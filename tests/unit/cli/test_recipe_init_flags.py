"""`recipe init` says a refusal's fix in its own flags: the user wrote --max-buckets and --dim,
not dims.batch.max_buckets."""
from __future__ import annotations

from graphmode.cli.recipe_init_cmd import _in_flags
from graphmode.errors import RecipeError


def test_a_bucket_policy_fix_names_the_flags_that_set_it():
    e = _in_flags(RecipeError("no bucket set over [1, 4] has at most 2 bucket(s) with padding <= 0.25",
                              where="dims.batch.max_padding", fix="max_buckets: 3 or max_padding: 0.5"), None)
    assert e.fix == "--max-buckets 3 or --max-padding 0.5, or --dim batch=MIN:MAX"


def test_a_range_fix_names_the_dim_flag():
    e = _in_flags(RecipeError("min above max", where="dims.seq.min", fix="a min <= max"), None)
    assert e.fix == "a min <= max (here: --dim seq=MIN:MAX)"


def test_an_out_of_range_flag_is_named_as_the_flag():
    """`recipe init --max-padding 2` was told to fix '--dim batch=MIN:MAX' (trial S)."""
    e = _in_flags(RecipeError("out of range: must be >= 0 and < 1", where="dims.batch.max_padding",
                              fix="use a value >= 0 and < 1"), None)
    assert e.fix == "use a value >= 0 and < 1 (here: --max-padding)"

