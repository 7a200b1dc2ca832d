"""Options several commands share. The cache root is not read here: a command passes
--cache-dir on as it came (None when not given) and graphmode.paths.cache_root resolves it
(--cache-dir, else GRAPHMODE_CACHE_DIR, else the platform cache folder), the same way the
Python API does, so both share one cache.

    cache_dir: Optional[Path] = CacheDir
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

def _cache_folder(value: Optional[Path]) -> Optional[Path]:
    """A --cache-dir that is (or sits under) a file is refused here: the commands would run
    uncached with only a log line saying so."""
    from graphmode.paths import file_in_the_way
    if value is not None:
        blocker = file_in_the_way(value)
        if blocker is not None:
            raise typer.BadParameter(f"not a folder: {blocker} is a file (the cache root is a folder, created if "
                                     "missing)")
    return value


CacheDir = typer.Option(None, "--cache-dir", show_default=False, callback=_cache_folder,
                        help="cache root: plans, kernels, timing cache, host probe, calibration, ONNX exports, "
                             "knowledge base (default: $GRAPHMODE_CACHE_DIR, else $XDG_CACHE_HOME/graphmode or "
                             "~/.cache/graphmode; the Python API uses the same one)")

MODEL_SPEC_HELP = ("minilm | gpt2 | resnet18 | path.onnx | a folder save_pretrained() wrote (config.json, "
                   "weights, tokenizer) | path/file.py:function | package.module:function")

KbPath = typer.Option(None, "--kb", envvar="GRAPHMODE_KB", show_envvar=True,
                      help="knowledge base file, shareable by a team (default <cache root>/kb/kb.sqlite)")


def kb_file(kb: Optional[Path], cache_dir: Optional[Path]) -> Path:
    """The knowledge base every measuring command records into."""
    from graphmode.paths import cache_layout
    return kb if kb is not None else cache_layout(cache_dir).kb_file

THREADS_HELP = ("kernel threads (default: the cores this process may use); under parallel.tensor, each rank's "
                "(default: cores / ranks)")


def model_bundle(model: str) -> Any:
    from graphmode.capture.spec import BareModuleError, as_model, resolve_model_spec
    try:
        return resolve_model_spec(model)
    except BareModuleError as e:    # 'pkg.mod:fn' returning the module alone: a causal LM's config
        return as_model(e.module)   # names its inputs, as `compile`, `run` and `verify` take it


def drafted(model: str) -> Any:
    """The draft `graphmode.compile(model)` makes without a recipe (kb/draft.py), for a command's model spec."""
    from graphmode.kb.draft import draft_recipe
    return draft_recipe(model_bundle(model), target="host", record=False)


def recipe_or_draft(recipe: Optional[str], model: str, log) -> Any:
    """The recipe at `recipe`, or without one the recipe `graphmode.compile(model)` would draft
    (as `generate`, `profile` and the Python API do); `log` hears which."""
    from graphmode.recipe import load_recipe
    if recipe is not None:
        return load_recipe(recipe)
    d = drafted(model)
    log(f"no --recipe: drafted {d.recipe.name} ({d.recipe.hash()}); `graphmode recipe init --model {model} "
        "-o r.yaml` writes it out with where each value came from")
    return d.recipe
