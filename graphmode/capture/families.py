"""The common model families, built small from code or `transformers` configs (random weights).

Each family is a model spec (`graphmode.capture.families:bert`, ...) returning
`(module, example_inputs, input_dims)`, and `recipe(name)` gives a recipe that compiles it in
graph mode with padded buckets wherever padding is proven safe. The family suite (tests and
`graphmode bench --zoo`) checks each one compiles with no fallback and matches eager (and,
through its ONNX export, ONNX Runtime).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

SEQ = ["batch", "seq"]
IMG = 32


def _tokens(vocab: int = 100, mask: bool = True, types: bool = False, b: int = 2, s: int = 8) -> dict:
    g = torch.Generator().manual_seed(0)
    d = {"input_ids": torch.randint(3, vocab, (b, s), generator=g)}
    if mask:
        d["attention_mask"] = torch.ones(b, s, dtype=torch.long)
    if types:
        d["token_type_ids"] = torch.zeros(b, s, dtype=torch.long)
    return d


def _image(c: int = 3, size: int = IMG) -> dict:
    return {"pixel_values": torch.randn(2, c, size, size, generator=torch.Generator().manual_seed(0))}


def randomize(model: nn.Module, seed: int = 0) -> nn.Module:
    """Give every path something to compute: random init leaves some tensors all zero (class
    tokens, relative-position tables) and batch norms at identity, which would let a wrong
    kernel on those paths pass unnoticed."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.modules.batchnorm._BatchNorm) and mod.running_mean is not None:
                mod.weight.copy_(torch.rand(mod.weight.shape, generator=g) + 0.5)
                mod.bias.copy_(torch.randn(mod.bias.shape, generator=g) * 0.1)
                mod.running_mean.copy_(torch.randn(mod.running_mean.shape, generator=g) * 0.1)
                mod.running_var.copy_(torch.rand(mod.running_var.shape, generator=g) + 0.5)
        for t in list(model.parameters()) + [b for b in model.buffers() if b.is_floating_point()]:
            if t.is_floating_point() and t.numel() > 1 and not t.any():
                t.copy_(torch.randn(t.shape, generator=g) * 0.1)
    return model


def _hf(cls_name: str, cfg_name: str, **cfg: Any) -> nn.Module:
    import transformers
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        config = getattr(transformers, cfg_name)(**cfg)
        return randomize(getattr(transformers, cls_name)(config).eval())


_TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=100,
             max_position_embeddings=64)
_DECODER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=100, max_position_embeddings=64, use_cache=False)


def _text(model: nn.Module, **tok: Any):
    ex = _tokens(**tok)
    return model, ex, {k: list(SEQ) for k in ex}


def _vision(model: nn.Module, c: int = 3):
    return model, _image(c), {"pixel_values": ["batch", c, IMG, IMG]}


def bert():
    return _text(_hf("BertModel", "BertConfig", **_TINY), types=True)


def roberta():
    return _text(_hf("RobertaModel", "RobertaConfig", **_TINY, pad_token_id=1))


def distilbert():
    return _text(_hf("DistilBertModel", "DistilBertConfig", dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                     vocab_size=100, max_position_embeddings=64))


def albert():
    return _text(_hf("AlbertModel", "AlbertConfig", **_TINY, embedding_size=16))


def t5_encoder():
    """T5's encoder: relative position buckets (log, min, where over an arange grid)."""
    return _text(_hf("T5EncoderModel", "T5Config", d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                     vocab_size=100))


def gpt2():
    return _text(_hf("GPT2LMHeadModel", "GPT2Config", n_embd=32, n_layer=2, n_head=4, vocab_size=100,
                     n_positions=64, use_cache=False, bos_token_id=1, eos_token_id=2))


def llama():
    """RoPE, RMSNorm, grouped-query attention (2 KV heads for 4 query heads), SwiGLU, untied head."""
    return _text(_hf("LlamaForCausalLM", "LlamaConfig", **_DECODER, tie_word_embeddings=False))


def mistral():
    return _text(_hf("MistralForCausalLM", "MistralConfig", **_DECODER))


def qwen2():
    return _text(_hf("Qwen2ForCausalLM", "Qwen2Config", **_DECODER, tie_word_embeddings=True))


def vit():
    return _vision(_hf("ViTModel", "ViTConfig", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=64, image_size=IMG, patch_size=8))


def deit():
    return _vision(_hf("DeiTModel", "DeiTConfig", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=64, image_size=IMG, patch_size=8))


def swin():
    """Windowed attention: window partition by reshape/permute, shifted windows by roll."""
    return _vision(_hf("SwinModel", "SwinConfig", image_size=IMG, patch_size=4, embed_dim=16, depths=[2, 2],
                       num_heads=[2, 4], window_size=4))


def clip_text():
    """CLIP's text tower: causal mask, pooling at the first end-of-text token (an argmax)."""
    return _text(_hf("CLIPTextModel", "CLIPTextConfig", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, vocab_size=100, max_position_embeddings=64, eos_token_id=99,
                     bos_token_id=98, pad_token_id=1))


def clip_vision():
    return _vision(_hf("CLIPVisionModel", "CLIPVisionConfig", hidden_size=32, intermediate_size=64,
                       num_hidden_layers=2, num_attention_heads=4, image_size=IMG, patch_size=8))


def whisper_encoder():
    """Whisper's audio encoder: two conv1d with GELU, sinusoidal positions, pre-norm blocks."""
    m = _hf("WhisperForAudioClassification", "WhisperConfig", d_model=32, encoder_layers=2,
            encoder_attention_heads=4, encoder_ffn_dim=64, num_mel_bins=16, max_source_positions=16,
            vocab_size=100, pad_token_id=1, bos_token_id=1, eos_token_id=2, decoder_start_token_id=3)
    feats = {"input_features": torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(0))}
    return m.encoder, feats, {"input_features": ["batch", 16, 32]}


def resnet():
    return _vision(_hf("ResNetModel", "ResNetConfig", embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                       layer_type="basic"))


def mobilenet_v2():
    """Depthwise separable convs, ReLU6, TF-style 'same' padding."""
    return _vision(_hf("MobileNetV2Model", "MobileNetV2Config", image_size=IMG, depth_multiplier=0.35))


class _SqueezeExcite(nn.Module):
    def __init__(self, c: int, r: int = 4, gate: nn.Module | None = None):
        super().__init__()
        self.fc1, self.fc2 = nn.Conv2d(c, c // r, 1), nn.Conv2d(c // r, c, 1)
        self.gate = gate or nn.Hardsigmoid()

    def forward(self, x):
        s = F.adaptive_avg_pool2d(x, 1)
        return x * self.gate(self.fc2(F.relu(self.fc1(s))))


class _InvertedResidual(nn.Module):
    def __init__(self, c_in: int, c_out: int, expand: int, stride: int, act: type[nn.Module], se: bool):
        super().__init__()
        mid = c_in * expand
        self.use_res = stride == 1 and c_in == c_out
        layers = [nn.Conv2d(c_in, mid, 1, bias=False), nn.BatchNorm2d(mid), act(),
                  nn.Conv2d(mid, mid, 3, stride, 1, groups=mid, bias=False), nn.BatchNorm2d(mid), act()]
        if se:
            layers.append(_SqueezeExcite(mid))
        layers += [nn.Conv2d(mid, c_out, 1, bias=False), nn.BatchNorm2d(c_out)]
        self.block = nn.Sequential(*layers)

    def forward(self, x):
        y = self.block(x)
        return x + y if self.use_res else y


class MobileNetV3Small(nn.Module):
    """MobileNetV3-style: Hardswish/ReLU stages, squeeze-excite with Hardsigmoid gates."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8), nn.Hardswish())
        self.blocks = nn.Sequential(_InvertedResidual(8, 8, 2, 1, nn.ReLU, True),
                                    _InvertedResidual(8, 16, 3, 2, nn.Hardswish, True),
                                    _InvertedResidual(16, 16, 3, 1, nn.ReLU6, False))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 32), nn.Hardswish(),
                                  nn.Linear(32, classes))

    def forward(self, pixel_values):
        return self.head(self.blocks(self.stem(pixel_values)))


def mobilenet_v3():
    torch.manual_seed(0)
    return _vision(randomize(MobileNetV3Small().eval()))


def efficientnet():
    """SiLU, squeeze-excite, depthwise convs with 'same' padding."""
    return _vision(_hf("EfficientNetModel", "EfficientNetConfig", image_size=IMG, width_coefficient=0.25,
                       depth_coefficient=0.25, hidden_dim=320))


def convnext():
    """7x7 depthwise convs, LayerNorm over channels-last, GELU, layer scale."""
    return _vision(_hf("ConvNextModel", "ConvNextConfig", num_channels=3, hidden_sizes=[8, 16], depths=[1, 1],
                       num_stages=2, image_size=IMG))


@dataclass(frozen=True)
class Family:
    build: Callable[[], tuple]
    kind: str                          # text | decoder | vision | audio
    seq_buckets: list[int] = field(default_factory=lambda: [8, 16])
    exact_seq: bool = False            # padding seq is refused by the verdict for this model


FAMILIES: dict[str, Family] = {
    "bert": Family(bert, "text"), "roberta": Family(roberta, "text"), "distilbert": Family(distilbert, "text"),
    "albert": Family(albert, "text"), "t5_encoder": Family(t5_encoder, "text"),
    "gpt2": Family(gpt2, "decoder"), "llama": Family(llama, "decoder"), "mistral": Family(mistral, "decoder"),
    "qwen2": Family(qwen2, "decoder"), "vit": Family(vit, "vision"), "deit": Family(deit, "vision"),
    "swin": Family(swin, "vision"), "clip_text": Family(clip_text, "text"), "clip_vision": Family(clip_vision, "vision"),
    "whisper_encoder": Family(whisper_encoder, "audio"), "resnet": Family(resnet, "vision"),
    "mobilenet_v2": Family(mobilenet_v2, "vision"), "mobilenet_v3": Family(mobilenet_v3, "vision"),
    "efficientnet": Family(efficientnet, "vision"), "convnext": Family(convnext, "vision"),
}


def recipe(name: str, **over: Any) -> dict:
    """A graph-mode recipe for family `name`: batch buckets [1, 2], seq buckets for text models
    (padding safe: the masks are declared), heuristic kernel selection (fast to compile)."""
    fam = FAMILIES[name]
    _, ex, dims = fam.build()
    inputs = []
    for k, t in ex.items():
        dtype = {torch.int64: "i64", torch.float32: "f32"}[t.dtype]
        spec: dict[str, Any] = {"name": k, "dtype": dtype, "shape": dims[k], "pad_value": 0}
        if k == "attention_mask":
            spec["role"] = "attention_mask"
        if k == "input_ids":
            spec["pad_value"] = 1
        inputs.append(spec)
    r: dict[str, Any] = {"version": 1, "name": f"{name.replace('_', '-')}-family", "inputs": inputs,
                         "dims": {"batch": {"buckets": [1, 2]}}, "exe_mode": "graph",
                         "codegen": {"kernel_selection": "heuristic"}, "memory": {"budget_mb": 1024}}
    if any("seq" in d for d in dims.values()):
        r["dims"]["seq"] = {"buckets": list(fam.seq_buckets), "min": 2}
    r.update(over)
    return r
