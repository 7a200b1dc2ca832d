"""Pass options are declared once, as the pydantic model on each pass's declaration
(graphmode/passes/options.py, registry.py); the recipe embeds the fuse pass's model as
`optimize.fusion`, and `PassContext.opts` validates whatever a caller passes."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from graphmode.errors import PassError
from graphmode.passes import PASS_INFOS, PassContext
from graphmode.passes.options import FuseOptions, PassOptions
from graphmode.recipe import load_recipe
from graphmode.recipe.schema import OptimizeSpec

RECIPES = Path(__file__).resolve().parents[2] / "examples" / "recipes"


def test_the_recipe_embeds_the_fuse_pass_options():
    assert OptimizeSpec.model_fields["fusion"].annotation is FuseOptions
    fusion = load_recipe(RECIPES / "minilm_cpu.yaml").optimize.fusion
    assert isinstance(fusion, FuseOptions) and fusion.max_ops == 16
    assert PassContext(options={"fuse": fusion}).opts("fuse") is fusion


def test_one_default_per_option():
    assert OptimizeSpec().fusion == FuseOptions() == PassContext().opts("fuse")
    assert FuseOptions().max_ops == 32 and FuseOptions().min_ops == 2


def test_every_declared_model_has_defaults_for_every_field():
    for name, info in PASS_INFOS.items():
        if info.options is not None:
            assert issubclass(info.options, PassOptions), name
            assert PassContext().opts(name) == info.options(), name


@pytest.mark.parametrize("name,options,where", [
    ("constant_fold", {"max_bytes": 0}, "options['constant_fold'].max_bytes"),
    ("cse", {"dedupe_params": "yes"}, "options['cse'].dedupe_params"),
    ("cse", {"max_numel": 3}, "options['cse'].max_numel"),
    ("fuse", {"max_ops": 2.5}, "optimize.fusion.max_ops"),
    ("dce", {"aggressive": True}, "options['dce']"),
])
def test_bad_options_name_the_field(name, options, where):
    with pytest.raises(PassError) as e:
        PassContext(options={name: options}).opts(name)
    assert e.value.where == where and e.value.fix


def test_declarations_import_without_torch():
    """The recipe layer (and the serve sandbox that validates recipes) reads pass declarations
    and options models; that must not load torch or the passes."""
    code = ("import sys, graphmode.passes, graphmode.passes.registry, graphmode.passes.options; "
            "assert 'torch' not in sys.modules, 'torch imported'; "
            "assert 'graphmode.passes.fuse' not in sys.modules, 'passes imported'")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
