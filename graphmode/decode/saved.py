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

import tempfile
from pathlib import Path
from typing import Any

from graphmode.errors import GraphmodeError

_FACTS = ("layers", "heads", "kv_heads", "head_dim", "vocab", "context", "eos", "pad")


def save(cm: Any, path: Any, *, tokenizer: Any = None, rank: int | None = None) -> dict[str, Any]:
    """Build the decode engine's every plan and write its paged graph as one `.gm` file; the
    tokenizer is `tokenizer`, or the model bundle's when it has one."""
    from graphmode.decode.api import engine_of
    from graphmode.runtime.artifact import save as save_artifact
    if rank is not None:
        raise GraphmodeError("a decoder's rank is saved by its group, and decoder groups are not saved yet",
                             where="parallel.tensor", fix="save the decoder with parallel.tensor: 1")
    eng = engine_of(cm)
    tok = tokenizer if tokenizer is not None else tokenizer_of(cm)
    with tempfile.TemporaryDirectory(prefix="graphmode-tokenizer-") as folder:
        if tok is not None:
            try:
                tok.save_pretrained(folder)
            except Exception as e:  # noqa: BLE001 - a tokenizer that cannot save its files
                raise GraphmodeError(f"the tokenizer ({type(tok).__name__}) cannot write its files: "
                                     f"{type(e).__name__}: {str(e)[:200]}", where="tokenizer",
                                     fix="pass a transformers tokenizer, or none (prompts are then token ids)"
                                     ) from None
        return save_artifact(eng.runner.cm, path, envs=eng.runner.envs(), decoder=facts(eng.cfg),
                             tokenizer=Path(folder) if tok is not None else None)


def facts(cfg: dict[str, Any]) -> dict[str, Any]:
    """The model's sizes as the manifest holds them (runtime/artifact.py `DecoderFacts`)."""
    out = {k: cfg.get(k) for k in _FACTS}
    if isinstance(out["eos"], (list, tuple)):
        out["eos"] = [int(e) for e in out["eos"]]
    return out


def tokenizer_of(cm: Any) -> Any:
    """The model's tokenizer: a built-in bundle's or a loaded artifact's, else None."""
    own = getattr(cm, "tokenizer", None)
    if own is not None:
        return own
    return getattr(getattr(getattr(cm, "source", None), "bundle", None), "tokenizer", None)


def attach(cm: Any) -> Any:
    """A loaded decoder artifact made to decode (`generate`, `stream`) with its tokenizer."""
    from graphmode.decode import api
    cm.decoding = api
    folder = cm.artifact.get("tokenizer")
    cm.tokenizer = None
    if folder is not None:
        try:
            from transformers import AutoTokenizer
            cm.tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
        except Exception as e:  # noqa: BLE001 - tokenizer files from another transformers, or damaged
            from graphmode.runtime.artifact import ArtifactError
            raise ArtifactError(f"its tokenizer does not load: {type(e).__name__}: {str(e)[:200]}",
                                where=f"{cm.artifact['path']}:tokenizer/",
                                fix="save the artifact again with this transformers version") from None
    return cm


def engine_over(cm: Any) -> Any:
    """The decode engine over a loaded artifact's paged graph and plans (no capture, no compile)."""
    from graphmode.decode.engine import DecodeEngine
    return DecodeEngine.over(cm, cm.recipe, dict(cm.artifact["decoder"]))
