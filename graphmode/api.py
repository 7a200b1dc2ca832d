"""`graphmode.compile`: the public entry point, above the pipeline driver.

It adds what belongs at the API boundary, not in the driver (graphmode/compiler.py): a recipe
drafted when none is given (graphmode/kb/draft.py, as `graphmode recipe init` drafts one), and
`generate` / `stream` for a model whose recipe declares a KV cache (graphmode/decode/api.py).
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from graphmode import compiler
from graphmode.progress import OnStage
from graphmode.recipe import Recipe
from graphmode.runtime.habits import AUTOCAST_NOTE, AutocastIgnored


def compile(model: Any, recipe: Recipe | str | Path | None = None, target: Any = "host", *,
            example_inputs: Any = None, input_dims: dict | None = None, dynamic_shapes: Any = None,
            mode: str | None = None,
            cache_dir: str | Path | None = None, threads: int | None = None, warmup: bool = False,
            on_stage: OnStage | None = None, rank: int | None = None):
    """Capture, optimise and wrap a model; plans are built per bucket on first use (or warm-up).
    Without a recipe, one is drafted as `graphmode recipe init` does (said once, `cm.recipe`).
    `example_inputs` (a tensor, tuple or dict of forward's keyword arguments) is the same as
    passing `(model, example_inputs)`: what TensorRT's `inputs=` and OpenVINO's `example_input=` are.
    `dynamic_shapes` (torch.export's form: `{"ids": {0: Dim("batch"), 1: Dim("seq", max=512)}}`)
    names the example's dynamic axes for the drafted recipe (graphmode/capture/dynamic_shapes.py);
    `input_dims` (`{"x": ["batch", 3, "H", "W"]}`) names them as `(model, example_inputs, input_dims)` does.
    `on_stage` hears the capture, passes, proof and plans stages (graphmode/progress.py).
    Under `parallel.tensor` N > 1: without `rank`, the N rank processes are started and the
    result is a `graphmode.parallel.launch.TensorParallelModel` (rank 0 answers), or for a recipe
    with a KV cache a `graphmode.decode.tensor_parallel.TensorParallelDecoder` (generate /
    stream); with `rank`, this process compiles that rank's shard only (its collectives need a
    bound communicator). A model under a recipe with a KV cache decodes: `cm.generate` /
    `cm.stream` (its decode engine is built on first use, graphmode/decode/api.py)."""
    if torch.is_autocast_enabled("cpu"):
        warnings.warn(AutocastIgnored(f"graphmode.compile under torch.autocast: {AUTOCAST_NOTE}"), stacklevel=2)
    with torch.autocast("cpu", enabled=False):     # the capture sees the model as its weights are
        return _compile(model, recipe, target, example_inputs=example_inputs, input_dims=input_dims,
                        dynamic_shapes=dynamic_shapes, mode=mode, cache_dir=cache_dir, threads=threads, warmup=warmup,
                        on_stage=on_stage, rank=rank)


def _compile(model: Any, recipe: Any, target: Any, *, example_inputs: Any, input_dims: dict | None,
             dynamic_shapes: Any, mode: str | None, cache_dir: Any, threads: int | None, warmup: bool,
             on_stage: OnStage | None, rank: int | None):
    tgt = compiler.resolve_target(target)
    model = _with_examples(model, recipe, example_inputs, input_dims, dynamic_shapes)
    model, ranges = _with_dynamic_shapes(model, recipe, dynamic_shapes)
    notes: dict[str, str] = {}
    if recipe is None:
        from graphmode.kb.draft import drafted
        model, recipe, notes = drafted(model, tgt, ranges=ranges)
    recipe = compiler.as_recipe(recipe)
    if (compiler.tensor_parallel(recipe) > 1 and rank is None and recipe.memory.kv_cache is not None
            and (mode or recipe.exe_mode) != "eager"):
        from graphmode.decode.tensor_parallel import launch_decoder   # the ranks decode in step
        return launch_decoder(model, recipe, tgt, cache_dir=cache_dir, threads=threads, on_stage=on_stage)
    cm = compiler.compile(model, recipe, tgt, mode=mode, cache_dir=cache_dir, threads=threads, warmup=warmup,
                          on_stage=on_stage, rank=rank)
    if getattr(cm, "decoding", False) is None and cm.recipe.memory.kv_cache is not None:
        from graphmode.decode import api as decoding
        cm.decoding = decoding
    if notes and hasattr(cm, "draft_notes"):
        cm.draft_notes = notes          # why a drafted recipe has no KV cache, for `generate` to say
        cm.drafted = True               # a request outside its guessed ranges is said once (OutsideDraft)
    return cm


def _with_examples(model: Any, recipe: Any, example_inputs: Any, input_dims: dict | None = None,
                   dynamic_shapes: Any = None) -> Any:
    """`(model, example_inputs)` when they were given apart; example inputs passed where the
    recipe goes (`graphmode.compile(model, x)`, as torch habits write it) are refused saying where
    they go: the recipe slot would otherwise read a tensor as YAML."""
    from graphmode.errors import RecipeError

    def tensors(v: Any) -> bool:
        if isinstance(v, torch.Tensor):
            return True
        if isinstance(v, (tuple, list)):
            return any(tensors(x) for x in v)
        return isinstance(v, dict) and any(tensors(x) for x in v.values())
    if recipe is not None and tensors(recipe):
        raise RecipeError("the recipe argument holds tensors: example inputs go in `example_inputs=`",
                          where="graphmode.compile(recipe=...)", value=type(recipe).__name__,
                          fix="graphmode.compile(model, example_inputs=(x,)) (or graphmode.compile((model, (x,)))); "
                              "the second positional argument is the recipe: a path, YAML text, a dict or a Recipe")
    if input_dims is not None and (example_inputs is None or dynamic_shapes is not None):
        raise RecipeError("input_dims= names the axes of example_inputs=, and goes without dynamic_shapes=",
                          where="graphmode.compile(input_dims=...)", value=sorted(input_dims),
                          fix="graphmode.compile(module, example_inputs={'x': x}, input_dims={'x': ['batch', 16]})")
    if example_inputs is None:
        return model
    if isinstance(model, torch.nn.Module):
        return (model, example_inputs) if input_dims is None else (model, example_inputs, input_dims)
    if isinstance(model, (tuple, list, str, Path)) or hasattr(model, "example_inputs"):
        raise RecipeError("example_inputs go with an nn.Module; this model already names its inputs",
                          where="graphmode.compile(example_inputs=...)", value=type(model).__name__,
                          fix="pass example_inputs with the module alone: "
                              "graphmode.compile(module, example_inputs=(x,))")
    raise RecipeError(f"graphmode compiles an nn.Module (or an ONNX file, a Hugging Face model), not a "
                      f"{type(model).__name__}", where="model", value=type(model).__name__,
                      fix="wrap the function in a module: class M(torch.nn.Module): def forward(self, x): return f(x)")


def _with_dynamic_shapes(model: Any, recipe: Any, dynamic_shapes: Any) -> tuple[Any, dict | None]:
    """((module, examples, input_dims), the ranges its Dims bound) for torch.export's
    `dynamic_shapes`; (the model as given, None) without them."""
    from graphmode.errors import RecipeError
    if dynamic_shapes is None:
        return model, None
    if recipe is not None:
        raise RecipeError("dynamic_shapes drafts a recipe's dims; this call gives a recipe, whose inputs[].shape "
                          "and dims say which axes are dynamic", where="graphmode.compile(dynamic_shapes=...)",
                          value="a recipe and dynamic_shapes", fix="leave out dynamic_shapes, or the recipe")
    if not (isinstance(model, tuple) and len(model) == 2 and isinstance(model[0], torch.nn.Module)):
        raise RecipeError("dynamic_shapes names axes of example inputs: pass the module with example_inputs=",
                          where="graphmode.compile(dynamic_shapes=...)", value=type(model).__name__,
                          fix="graphmode.compile(module, example_inputs=(x,), dynamic_shapes=...)")
    from graphmode.capture.dynamic_shapes import input_dims_from
    dims, ranges = input_dims_from(model[0], model[1], dynamic_shapes)
    return (model[0], model[1], dims), ranges


def load(path: str | Path, **kw: Any):
    """A `.gm` artifact (graphmode/runtime/artifact.py `load`: cache_dir, threads, on_stage);
    a decoder's decodes (`generate`, `stream`) with the tokenizer it was saved with, a decoder
    group's ranks start from their files (graphmode/decode/saved.py)."""
    from graphmode.runtime.artifact import load as load_artifact
    from graphmode.runtime import rank_artifacts
    if rank_artifacts.is_group(path):           # checked once (every rank file hashed), then started
        files, recipe = rank_artifacts.group_files(path)
        opts = {"cache_dir": kw.get("cache_dir"), "threads": kw.get("threads")}
        if recipe.memory.kv_cache is not None:      # a decoder's ranks, each building its engine over its file
            from graphmode.decode.saved import start_group
            return start_group(files, recipe, **opts)
        return rank_artifacts.start_group(files, recipe, **opts)
    cm = load_artifact(path, **kw)
    if (getattr(cm, "artifact", None) or {}).get("decoder") is not None:
        from graphmode.decode.saved import attach
        attach(cm)
    elif cm.artifact.get("tokenizer"):            # an encoder's: /v1/embeddings takes text with it
        from graphmode.runtime.tokenizer_files import load_tokenizer
        cm.tokenizer = load_tokenizer(cm.artifact["tokenizer"], str(path))
    return cm
