"""The benchmark's causal LMs written as GGUF, so llama.cpp runs the very same weights.

Written with `gguf-py` (the `gguf` package), f32 throughout; llama.cpp
quantizes that file to q8_0 itself (`quantize_gguf`). Tensor names come from gguf-py's own
HF -> GGUF name map; two layouts differ from `transformers`':
- GPT-2's `Conv1D` stores weights [in, out]: transposed to [out, in] like every linear;
- llama.cpp's LLAMA graph rotates adjacent pairs of a head's dims while `transformers`
  rotates its two halves: Q and K rows are reordered per head (first half -> even rows,
  second half -> odd rows), which makes both compute the same attention scores.

A model built from a config has no tokenizer: the file gets a synthetic SentencePiece-style
vocabulary (unknown/begin/end, then byte tokens, then `t<id>`), enough for llama.cpp to
load it when token ids are fed directly.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from graphmode.errors import GraphmodeError

ARCHS = {"GPT2LMHeadModel": "gpt2", "LlamaForCausalLM": "llama"}
Q8_0_BYTES_PER_WEIGHT = 34 / 32          # one f16 scale per block of 32 int8 weights


def _gguf():
    try:
        import gguf
    except ImportError:
        raise GraphmodeError("writing GGUF needs the `gguf` package", where="llama_cpp",
                             fix="pip install gguf") from None
    return gguf


def arch_of(lm: torch.nn.Module) -> str:
    name = type(lm).__name__
    if name not in ARCHS:
        raise GraphmodeError(f"no GGUF layout for {name}", where="llama_cpp", value=name,
                             fix=f"the decode benchmark writes GGUF for {', '.join(ARCHS)}")
    return ARCHS[name]


def _rope_pairs(w: np.ndarray, heads: int) -> np.ndarray:
    """Rows of each head from [half0 | half1] order to interleaved (h0[0], h1[0], h0[1], ...)."""
    out, rest = w.shape[0], w.shape[1:]
    return w.reshape(heads, 2, out // heads // 2, *rest).swapaxes(1, 2).reshape(out, *rest)


def _tensors(lm: torch.nn.Module, arch: str, gguf) -> list[tuple[str, np.ndarray]]:
    cfg = lm.config
    blocks = cfg.n_layer if arch == "gpt2" else cfg.num_hidden_layers
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT2 if arch == "gpt2" else gguf.MODEL_ARCH.LLAMA, blocks)
    out = []
    for hf, t in lm.state_dict().items():
        if hf.endswith((".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")):
            continue                                         # buffers, not weights
        if hf == "lm_head.weight" and getattr(cfg, "tie_word_embeddings", True):
            continue                                         # llama.cpp reuses token_embd
        name = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise GraphmodeError(f"no GGUF name for tensor {hf}", where="llama_cpp", value=hf,
                                 fix="extend graphmode.bench.gguf_export for this model")
        w = t.detach().to(torch.float32).contiguous().numpy()
        if arch == "gpt2" and w.ndim == 2 and hf.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")):
            w = np.ascontiguousarray(w.T)
        if arch == "llama" and hf.endswith("q_proj.weight"):
            w = _rope_pairs(w, cfg.num_attention_heads)
        elif arch == "llama" and hf.endswith("k_proj.weight"):
            w = _rope_pairs(w, cfg.num_key_value_heads or cfg.num_attention_heads)
        out.append((name, np.ascontiguousarray(w, dtype=np.float32)))
    return out


def _vocab(writer: Any, n: int, gguf) -> None:
    tokens, types = ["<unk>", "<s>", "</s>"], [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    for b in range(min(256, n - 3)):
        tokens.append(f"<0x{b:02X}>")
        types.append(gguf.TokenType.BYTE)
    for i in range(len(tokens), n):
        tokens.append(f"t{i}")
        types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens[:n])
    writer.add_token_scores([0.0] * n)
    writer.add_token_types(types[:n])
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)


def write_gguf(lm: torch.nn.Module, path: str | Path, name: str = "model") -> Path:
    """`lm` as an f32 GGUF file at `path`."""
    gguf = _gguf()
    arch = arch_of(lm)
    cfg = lm.config
    path = Path(path)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if arch == "gpt2":
        w.add_context_length(cfg.n_positions)
        w.add_embedding_length(cfg.n_embd)
        w.add_feed_forward_length(cfg.n_inner or 4 * cfg.n_embd)
        w.add_block_count(cfg.n_layer)
        w.add_head_count(cfg.n_head)
        w.add_layer_norm_eps(cfg.layer_norm_epsilon)
    else:
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        w.add_context_length(cfg.max_position_embeddings)
        w.add_embedding_length(cfg.hidden_size)
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_block_count(cfg.num_hidden_layers)
        w.add_head_count(cfg.num_attention_heads)
        w.add_head_count_kv(cfg.num_key_value_heads or cfg.num_attention_heads)
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_rope_dimension_count(head_dim)
        w.add_rope_freq_base(float(getattr(cfg, "rope_theta", None) or
                                   (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)))
        w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    _vocab(w, cfg.vocab_size, gguf)
    for tname, arr in _tensors(lm, arch, gguf):
        w.add_tensor(tname, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def quantize_gguf(src: str | Path, dst: str | Path, kind: str = "q8_0", threads: int = 2) -> Path:
    """llama.cpp's own quantizer (`llama_model_quantize`) from an f32 GGUF file."""
    try:
        import llama_cpp
    except ImportError:
        raise GraphmodeError("quantizing GGUF needs llama-cpp-python", where="llama_cpp",
                             fix="pip install llama-cpp-python") from None
    ftypes = {"q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0, "q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0,
              "q4_K_M": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M}
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftypes[kind]
    params.nthread = threads
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    if rc != 0:
        raise GraphmodeError(f"llama_model_quantize returned {rc}", where="llama_cpp", value=str(src))
    return Path(dst)


def timed_gguf(lm: torch.nn.Module, folder: Path, name: str, kind: str, threads: int) -> tuple[Path, float]:
    """(path, seconds): the f32 file (written once per folder), quantized when `kind` is not f32."""
    t0 = time.perf_counter()
    f32 = folder / f"{name}-f32.gguf"
    if not f32.exists():
        write_gguf(lm, f32, name)
    path = f32 if kind == "f32" else quantize_gguf(f32, folder / f"{name}-{kind}.gguf", kind, threads)
    return path, time.perf_counter() - t0
