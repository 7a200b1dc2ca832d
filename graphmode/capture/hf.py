"""Example inputs of a Hugging Face model read from its config, so a `PreTrainedModel` compiles as loaded.

The input is the model's `main_input_name`: token ids (`input_ids`, with `attention_mask` and
`token_type_ids` when forward takes them, named dims `batch` and `seq`), images
(`pixel_values` [batch, channels, size, size] from `num_channels` and `image_size`; both for a two-tower
model such as CLIP, from its `text_config` and `vision_config`), or audio
(`input_features` [batch, mel bins, frames] for Whisper-style encoders, with `decoder_input_ids`
[batch, decoder_seq] for the encoder-decoder, `input_values` [batch, samples] for raw-waveform
models, [batch, frames, mel bins] for a spectrogram's). Example sizes are 2 and 8 (never 1: torch.export
specialises a dim of size 1).
"""
from __future__ import annotations

import inspect
from typing import Any

import torch

from graphmode.errors import CaptureError

BATCH, SEQ = 2, 8
CHOICES = 4             # a multiple-choice model's answers per question (a dim up to it)
SAMPLES = 4000          # raw-audio example: a quarter second at 16 kHz
AUDIO_SAMPLES = (1600, 160_000)    # raw audio a draft admits: 0.1 s .. 10 s at 16 kHz


def is_hf_model(module: Any) -> bool:
    return hasattr(module, "config") and isinstance(getattr(module, "main_input_name", None), str)


def _params(module: torch.nn.Module) -> list[str]:
    try:
        return list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return []


def _size(value: Any, default: int) -> tuple[int, int]:
    if isinstance(value, int):
        return value, value
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return int(value[0]), int(value[1])
    return default, default


def _is_spectrogram(cfg: Any) -> bool:
    """An `input_values` that is a spectrogram of a fixed size (the Audio Spectrogram Transformer's
    `max_length` frames x `num_mel_bins`), not a raw waveform."""
    return isinstance(getattr(cfg, "max_length", None), int) and isinstance(getattr(cfg, "num_mel_bins", None), int)


def dim_ranges(module: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """Ranges of the dims `example_inputs` names that no config states (raw audio's length)."""
    raw = module.main_input_name == "input_values" and not _is_spectrogram(module.config)
    return {"samples": AUDIO_SAMPLES} if raw else {}


def _ignores_zero_types(module: torch.nn.Module, ex: dict[str, torch.Tensor]) -> bool:
    """A model without token type embeddings whose answer is the same with zero token types: its
    tokenizer returns them (DeBERTa-v2 with type_vocab_size 0), so a compiled model takes them too.
    XLM embeds them with its word table: None is not zeros there, and they stay out."""
    try:
        with torch.inference_mode():
            a = module(**ex, token_type_ids=torch.zeros_like(ex["input_ids"]))
            b = module(**ex)
    except Exception:  # noqa: BLE001 - a model that cannot take them
        return False
    from graphmode.capture.zoo import _flatten_output
    a, b = ([t for _, t in _flatten_output(o) if isinstance(t, torch.Tensor)] for o in (a, b))
    return len(a) == len(b) > 0 and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


def example_inputs(module: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, list]]:
    """(example inputs, input_dims) for a transformers model, from its config."""
    cfg, main, params = module.config, module.main_input_name, _params(module)
    g = torch.Generator().manual_seed(0)
    if main == "input_ids":
        text, vision = getattr(cfg, "text_config", None), getattr(cfg, "vision_config", None)
        vocab = int(getattr(cfg, "vocab_size", None) or getattr(text, "vocab_size", None) or 100)
        ex = {"input_ids": torch.randint(min(3, vocab - 1), vocab, (BATCH, SEQ), generator=g)}
        if "attention_mask" in params:
            ex["attention_mask"] = torch.ones(BATCH, SEQ, dtype=torch.long)
        if "pixel_values" in params and vision is not None:     # a two-tower model (CLIP, SigLIP): both towers
            c = int(getattr(vision, "num_channels", 3) or 3)
            h, w = _size(getattr(vision, "image_size", None), 224)
            dims = {k: ["batch", "seq"] for k in ex}
            ex["pixel_values"] = torch.randn(BATCH, c, h, w, generator=g)
            return ex, {**dims, "pixel_values": ["batch", c, h, w]}
        if "token_type_ids" in params and (getattr(cfg, "type_vocab_size", 0) or _ignores_zero_types(module, ex)):
            ex["token_type_ids"] = torch.zeros(BATCH, SEQ, dtype=torch.long)
        if getattr(cfg, "is_encoder_decoder", False) and "decoder_input_ids" in params:
            ex["decoder_input_ids"] = torch.randint(min(3, vocab - 1), vocab, (BATCH, SEQ), generator=g)
            return ex, {k: ["batch", "decoder_seq" if k == "decoder_input_ids" else "seq"] for k in ex}
        if type(module).__name__.endswith("ForMultipleChoice"):     # [batch, choices, seq]: one row per answer
            ex = {k: v.unsqueeze(1).expand(BATCH, CHOICES, SEQ).contiguous() for k, v in ex.items()}
            return ex, {k: ["batch", "choices", "seq"] for k in ex}
        return ex, {k: ["batch", "seq"] for k in ex}
    if main == "pixel_values":
        c = int(getattr(cfg, "num_channels", 3) or 3)
        h, w = _size(getattr(cfg, "image_size", None), 224)
        return ({"pixel_values": torch.randn(BATCH, c, h, w, generator=g)}, {"pixel_values": ["batch", c, h, w]})
    if main == "input_features":
        mels = int(getattr(cfg, "num_mel_bins", 80))
        frames = 2 * int(getattr(cfg, "max_source_positions", 1500))   # Whisper's encoder takes exactly this
        ex, dims = {"input_features": torch.randn(BATCH, mels, frames, generator=g)}, {
            "input_features": ["batch", mels, frames]}
        if getattr(cfg, "is_encoder_decoder", False) and "decoder_input_ids" in params:
            vocab = int(getattr(cfg, "vocab_size", None) or 100)     # the decoder's tokens (Whisper's transcript)
            ex["decoder_input_ids"] = torch.randint(min(3, vocab - 1), vocab, (BATCH, SEQ), generator=g)
            dims["decoder_input_ids"] = ["batch", "decoder_seq"]
        return ex, dims
    if main == "input_values" and _is_spectrogram(cfg):     # AST: [batch, frames, mel bins], both fixed
        frames, mels = int(cfg.max_length), int(cfg.num_mel_bins)
        return ({"input_values": torch.randn(BATCH, frames, mels, generator=g)},
                {"input_values": ["batch", frames, mels]})
    if main == "input_values":
        ex = {"input_values": torch.randn(BATCH, SAMPLES, generator=g)}
        if "attention_mask" in params and getattr(cfg, "feat_extract_norm", None) == "layer":
            ex["attention_mask"] = torch.ones(BATCH, SAMPLES, dtype=torch.long)   # what its feature extractor returns
        return ex, {k: ["batch", "samples"] for k in ex}
    raise CaptureError(f"{type(module).__name__} takes {main!r} first, and graphmode does not know how to make "
                       "an example of it", where="model", value=main,
                       fix="pass (model, example_inputs) with tensors shaped as the model expects")



TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "tokenizer.model",
                   "spiece.model", "sentencepiece.bpe.model")


def load_folder(path: Any) -> tuple[torch.nn.Module, Any]:
    """(model, tokenizer or None) from a `save_pretrained` folder, as vLLM and TEI take one: the
    class its config's `architectures` names, its weights, and its tokenizer when the folder has one."""
    import warnings
    from pathlib import Path

    import transformers
    folder = Path(path)
    where = f"model folder {str(folder)!r}"
    try:
        cfg = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - a config transformers cannot read
        raise CaptureError(f"config.json could not be read by transformers: {type(e).__name__}: {e}", where=where,
                           fix="save the model with save_pretrained(), or give a 'file.py:function' that loads "
                               "it") from None
    archs = [a for a in (getattr(cfg, "architectures", None) or []) if hasattr(transformers, a)]
    if not archs:
        raise CaptureError("config.json names no model class transformers has (its `architectures`)", where=where,
                           value=getattr(cfg, "architectures", None),
                           fix="save the model with save_pretrained() (which writes `architectures`), or give a "
                               "'file.py:function' that builds the model class you mean")
    cls, hf_logging = getattr(transformers, archs[0]), transformers.utils.logging
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()         # graphmode's own progress says what is loading
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = cls.from_pretrained(folder, local_files_only=True).eval()
    except Exception as e:  # noqa: BLE001 - missing or mismatched weights
        raise CaptureError(f"{archs[0]}.from_pretrained failed: {type(e).__name__}: {e}", where=where,
                           fix="check that the folder holds the weights save_pretrained() wrote") from None
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    tokenizer = None
    if any((folder / f).is_file() for f in TOKENIZER_FILES):
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
        except Exception as e:  # noqa: BLE001 - the model still compiles; say why text is refused
            warnings.warn(f"graphmode: the tokenizer in {folder} could not be loaded ({type(e).__name__}: {e}); "
                          "text prompts will be refused", stacklevel=2)
    return model, tokenizer
