"""`graphmode.compile`: the public entry point, above the pipeline driver.

It adds what belongs at the API boundary, not in the driver (graphmode/compiler.py): a recipe
drafted when none is given (graphmode/kb/draft.py, as `graphmode recipe init` drafts one), and
`generate` / `stream` for a model whose recipe declares a KV cache (graphmode/decode/api.py).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from graphmode import compiler
from graphmode.progress import OnStage
from graphmode.recipe import Recipe


def compile(model: Any, recipe: Recipe | str | Path | None = None, target: Any = "host", *, mode: str | None = None,
            cache_dir: str | Path | None = None, threads: int | None = None, warmup: bool = False,
            on_stage: OnStage | None = None, rank: int | None = None):
    """Capture, optimise and wrap a model; plans are built per bucket on first use (or warm-up).
    Without a recipe, one is drafted as `graphmode recipe init` does (said once, `cm.recipe`).
    `on_stage` hears the capture, passes, proof and plans stages (graphmode/progress.py).
    Under `parallel.tensor` N > 1: without `rank`, the N rank processes are started and the
    result is a `graphmode.parallel.launch.TensorParallelModel` (rank 0 answers), or for a recipe
    with a KV cache a `graphmode.decode.tensor_parallel.TensorParallelDecoder` (generate /
    stream); with `rank`, this process compiles that rank's shard only (its collectives need a
    bound communicator). A model under a recipe with a KV cache decodes: `cm.generate` /
    `cm.stream` (its decode engine is built on first use, graphmode/decode/api.py)."""
    tgt = compiler.resolve_target(target)
    notes: dict[str, str] = {}
    if recipe is None:
        from graphmode.kb.draft import drafted
        model, recipe, notes = drafted(model, tgt)
    recipe = compiler.as_recipe(recipe)
    if (compiler.tensor_parallel(recipe) > 1 and rank is None and recipe.memory.kv_cache is not None
            and (mode or recipe.exe_mode) != "eager"):
        from graphmode.decode.tensor_parallel import launch_decoder   # the ranks decode in step
        return launch_decoder(model, recipe, tgt, cache_dir=cache_dir, threads=threads)
    cm = compiler.compile(model, recipe, tgt, mode=mode, cache_dir=cache_dir, threads=threads, warmup=warmup,
                          on_stage=on_stage, rank=rank)
    if getattr(cm, "decoding", False) is None and cm.recipe.memory.kv_cache is not None:
        from graphmode.decode import api as decoding
        cm.decoding = decoding
    if notes and hasattr(cm, "draft_notes"):
        cm.draft_notes = notes          # why a drafted recipe has no KV cache, for `generate` to say
        cm.drafted = True               # a request outside its guessed ranges is said once (OutsideDraft)
    return cm


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
    return cm
