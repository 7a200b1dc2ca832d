"""Decoders as `.gm` artifacts: `cm.save("lm.gm")` of a model compiled under a decoder recipe,
`graphmode.load("lm.gm")` to generate, stream or serve it without the model's code.

What a decode engine runs is the paged graph (`to_paged` and the recipe's passes over the
captured `(input_ids, position_ids) -> logits`), one plan per prefill bucket (batch, prompt
length) and per decode bucket (batch, seq 1); so that is what is saved, through the same
artifact format as any compiled model (runtime/artifact.py), with the model's sizes the engine
needs besides the graph (layers, KV heads, vocabulary, positions, end-of-sequence ids) and its
tokenizer's files when it has one. The KV pools are run-time state: only their types are
stored, and they load as zeros, so the file holds the weights once and the pool's size is
still the recipe's proof. The engine over a loaded artifact is the one `DecodeEngine.build`
assembles (`DecodeEngine.over`): token-exact with the model it was saved from.
"""
from __future__ import annotations

from typing import Any

from graphmode.errors import GraphmodeError
from graphmode.runtime.tokenizer_files import load_tokenizer, tokenizer_files, tokenizer_of

_FACTS = ("layers", "heads", "kv_heads", "head_dim", "vocab", "context", "eos", "pad")


def save(cm: Any, path: Any, *, tokenizer: Any = None, rank: int | None = None) -> dict[str, Any]:
    """Build the decode engine's every plan and write its paged graph as one `.gm` file; the
    tokenizer is `tokenizer`, or the model bundle's when it has one."""
    from graphmode.decode.api import engine_of
    if rank is not None:
        raise GraphmodeError("a rank's decode engine is saved by its group", where="parallel.tensor",
                             fix="save the group: graphmode.compile(lm, recipe).save(path)")
    return save_engine(engine_of(cm), path, tokenizer=tokenizer if tokenizer is not None else tokenizer_of(cm))


def save_engine(eng: Any, path: Any, *, tokenizer: Any = None, rank: int | None = None) -> dict[str, Any]:
    """`eng`'s paged graph, every plan of it and its sizes as one `.gm` (under `rank`: that rank's
    shard, written by its group: runtime/rank_artifacts.py)."""
    from graphmode.runtime.artifact import save as save_artifact
    with tokenizer_files(tokenizer) as folder:
        return save_artifact(eng.runner.cm, path, rank=rank, envs=eng.runner.envs(), decoder=facts(eng.cfg),
                             tokenizer=folder)


def facts(cfg: dict[str, Any]) -> dict[str, Any]:
    """The model's sizes as the manifest holds them (runtime/artifact.py `DecoderFacts`)."""
    out = {k: cfg.get(k) for k in _FACTS}
    if isinstance(out["eos"], (list, tuple)):
        out["eos"] = [int(e) for e in out["eos"]]
    return out


def attach(cm: Any) -> Any:
    """A loaded decoder artifact made to decode (`generate`, `stream`) with its tokenizer."""
    from graphmode.decode import api
    cm.decoding = api
    folder = cm.artifact.get("tokenizer")
    cm.tokenizer = load_tokenizer(folder, cm.artifact["path"]) if folder is not None else None
    return cm


def engine_over(cm: Any) -> Any:
    """The decode engine over a loaded artifact's paged graph and plans (no capture, no compile)."""
    from graphmode.decode.engine import DecodeEngine
    return DecodeEngine.over(cm, cm.recipe, dict(cm.artifact["decoder"]))


# ---- a tensor-parallel decoder's group: one file per rank and the group file -----------------

def start_group(files: tuple[str, ...], recipe: Any, *, cache_dir: Any = None, threads: int | None = None) -> Any:
    """Start a saved decoder group (runtime/rank_artifacts.py `group_files`: checked): every rank
    loads its own file and builds its engine over it; a `TensorParallelDecoder`, as
    `graphmode.compile` gives, with rank 0's tokenizer (`.tokenizer`)."""
    from graphmode.decode.tensor_parallel import launch_decoder
    dec = launch_decoder(files, recipe, "host", cache_dir=cache_dir, threads=threads, driver=saved_group_driver())
    folder = dec.tp.ranks[0].get("tokenizer")
    dec.tokenizer = load_tokenizer(folder, files[0]) if folder else None
    return dec


def saved_group_driver() -> Any:
    """What a rank of a saved decoder group runs in place of compiling: its file, loaded."""
    from graphmode.compile_report import graph_collectives
    from graphmode.parallel.launch import RankDriver
    from graphmode.runtime.rank_artifacts import artifact_source, save_group
    return RankDriver(compile=load_rank, resolve_model=artifact_source, collectives=graph_collectives, save=save_group)


def load_rank(files: Any, recipe: Any, target: Any, *, rank: int, cache_dir: Any = None, threads: int | None = None,
              **_: Any) -> Any:
    """A rank's decode engine over its own file (no capture, no compile), as `compile_rank` gives."""
    from graphmode.decode.tensor_parallel import RankDecoder
    from graphmode.parallel.comm import active
    from graphmode.runtime.rank_artifacts import load_rank as load_file
    cm = load_file(files, recipe, target, rank=rank, cache_dir=cache_dir, threads=threads)
    dec = RankDecoder(engine_over(cm), rank, active(), float(recipe.parallel.comm.timeout_s))
    dec.rank_info.update(cm.rank_info, tokenizer=cm.artifact.get("tokenizer"))
    return dec
