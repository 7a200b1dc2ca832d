"""A model's tokenizer in its `.gm` artifact: written as its `save_pretrained` files under
`tokenizer/` (checked to load back as itself), read back with AutoTokenizer. Decoders and
encoders alike: an encoder's /v1/embeddings takes text only where its tokenizer came along
(`serve --replicas` serves the artifact it saves)."""
from __future__ import annotations

import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from graphmode.errors import GraphmodeError


@contextmanager
def tokenizer_files(tokenizer: Any) -> Iterator[Path | None]:
    """A temporary folder of `tokenizer`'s files (None for no tokenizer), refused where they
    would load back as another tokenizer."""
    if tokenizer is None:
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="graphmode-tokenizer-") as folder:
        try:
            tokenizer.save_pretrained(folder)
        except Exception as e:  # noqa: BLE001 - a tokenizer that cannot save its files
            raise GraphmodeError(f"the tokenizer ({type(tokenizer).__name__}) cannot write its files: "
                                 f"{type(e).__name__}: {str(e)[:200]}", where="tokenizer",
                                 fix="pass a transformers tokenizer, or none (prompts are then token ids)") from None
        check_reloads(tokenizer, folder)
        yield Path(folder)


_PROBE = "Hello world, 123 -- Grüße, 東京! <unk> zzz"


def check_reloads(tokenizer: Any, folder: str) -> None:
    """Refuse to save a tokenizer whose saved files load back as another one (a vocabulary with
    two tokens on one id keeps one of them): the artifact would then encode prompts differently,
    or fail on text the tokenizer passed to save encodes."""
    def seen(tok: Any) -> tuple[Any, Any]:
        try:
            probe: Any = list(tok.encode(_PROBE))
        except Exception as e:  # noqa: BLE001 - compared, not raised: both may refuse the probe
            probe = f"{type(e).__name__}: {str(e)[:120]}"
        return tok.get_vocab(), probe
    back = load_tokenizer(folder, "tokenizer")
    (vocab, probe), (vocab_back, probe_back) = seen(tokenizer), seen(back)
    if vocab != vocab_back or probe != probe_back:
        what = (f"its vocabulary ({len(vocab)} entries) loads back as {len(vocab_back)} entries"
                if vocab != vocab_back else f"{_PROBE!r} encodes as {probe} but loads back as {probe_back}")
        raise GraphmodeError(f"the tokenizer ({type(tokenizer).__name__}) does not load back from its saved files as "
                             f"it is: {what}", where="tokenizer",
                             fix="pass a tokenizer that AutoTokenizer.from_pretrained loads back as itself from its "
                                 "save_pretrained files, or save without one (prompts are then token ids)")


def load_tokenizer(folder: str, path: str) -> Any:
    """The tokenizer an artifact was saved with, from its extracted `tokenizer/` folder."""
    try:
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - tokenizer files from another transformers, or damaged
        from graphmode.runtime.artifact import ArtifactError
        raise ArtifactError(f"its tokenizer does not load: {type(e).__name__}: {str(e)[:200]}",
                            where=f"{path}:tokenizer/", fix="save the artifact again with this transformers version"
                            ) from None


def tokenizer_of(cm: Any) -> Any:
    """The model's tokenizer: its own (a loaded artifact's) or its bundle's, else None."""
    own = getattr(cm, "tokenizer", None)
    if own is not None:
        return own
    return getattr(getattr(getattr(cm, "source", None), "bundle", None), "tokenizer", None)


def save_model(cm: Any, path: Any, *, rank: int | None = None, tokenizer: Any = None) -> dict[str, Any]:
    """A compiled model (not a decoder: decode/saved.py) as a `.gm` with its tokenizer's files:
    `tokenizer`, or the model's own."""
    from graphmode.runtime.artifact import save
    with tokenizer_files(tokenizer if tokenizer is not None else tokenizer_of(cm)) as folder:
        return save(cm, path, rank=rank, tokenizer=folder)


__all__ = ["tokenizer_files", "check_reloads", "load_tokenizer", "tokenizer_of", "save_model"]
