"""What the benchmark and the profiler run: model specs, shapes, and the recipe graphmode gets;
for `graphmode bench decode`, the causal LMs and their decoder recipe.

A *case* is one model at one shape. Shapes are written like the model's first input
(`1x128` for MiniLM/GPT-2 `[batch, seq]`, `8x3x224x224` for ResNet-18), or as just the
symbolic dims in order (`8` for ResNet-18's batch), or as `batch=8,seq=128`.
"""
from __future__ import annotations

import math
import re
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from graphmode.capture.spec import with_batch_axis
from graphmode.errors import GraphmodeError

# The default matrix: model -> shapes of the first input.
DEFAULT_SHAPES: dict[str, list[tuple[int, ...]]] = {
    "minilm": [(1, 16), (1, 128), (8, 128)],
    "gpt2": [(1, 16), (1, 128)],
    "resnet18": [(1, 3, 224, 224), (8, 3, 224, 224)],
}
DEFAULT_MODELS = list(DEFAULT_SHAPES)
PRETTY = {"minilm": "all-MiniLM-L6-v2", "gpt2": "GPT-2 small", "resnet18": "ResNet-18"}


@dataclass
class ModelCase:
    """One model (a resolved ModelBundle) and the dim values of each benchmarked shape."""

    spec: str                       # what the user typed (`minilm`, `pkg.mod:fn`)
    name: str                       # short name used in rows (`minilm`)
    bundle: Any                     # graphmode.capture.zoo.ModelBundle
    envs: list[dict[str, int]]      # one {dim: value} per shape
    load_s: float = 0.0
    recipe: Any = None              # graphmode's recipe for this model (None: the run's, or auto_recipe)

    def shape_of(self, env: dict[str, int]) -> list[int]:
        """The first input's concrete shape (what rows report as `shape`)."""
        first = self.bundle.input_names[0]
        return self.bundle.input_shape(first, env)


def resolve_bundle(spec: str, recipe: Any = None):
    """A built-in name or `package.module:function` / `file.py:function` -> ModelBundle (a
    function returning a module alone: a Hugging Face model's inputs from its config, another's
    from `recipe`, as compile takes them). ONNX files are refused: every engine is compared with
    the eager torch module."""
    from graphmode.capture.spec import BareModuleError, OnnxModelSpec, as_model
    try:
        b = as_model(spec)
    except BareModuleError as e:
        if recipe is None:
            raise
        from graphmode.capture.source import resolve_model
        b = resolve_model(e.module, recipe).bundle
    if isinstance(b, OnnxModelSpec):
        raise GraphmodeError("bench and profile take a PyTorch model: every engine and plan is timed and "
                             "checked against the eager module (--no-eager too: the sample inputs come from it)",
                             where="--model", value=spec,
                             fix="give a built-in name or 'package.module:function' returning (module, "
                                 "example_inputs[, input_dims]); `graphmode run --model x.onnx` times an ONNX file "
                                 "against ONNX Runtime")
    return b


def canonical_name(spec: str, bundle: Any = None) -> str:
    """Built-ins by their short name (`minilm`), other models by the bundle's name."""
    from graphmode.capture import zoo
    key = zoo.ALIASES.get(spec.lower(), spec.lower())
    if key in zoo.BUILTINS:
        return key
    return getattr(bundle, "name", None) or spec


def parse_shape(text: str, bundle: Any) -> dict[str, int] | None:
    """`1x128` / `8` / `batch=8,seq=128` -> {dim: value} for `bundle`, or None when the text
    does not fit this model (wrong rank, or a fixed axis that differs)."""
    t = text.strip().lower()
    dims = bundle.dim_names
    first = bundle.input_dims[bundle.input_names[0]]
    try:
        if "=" in t:
            env = {k.strip(): int(v) for k, v in (p.split("=", 1) for p in t.split(","))}
            return env if set(env) == set(dims) and all(v >= 1 for v in env.values()) else None
        vals = [int(v) for v in re.split(r"[x,]", t) if v]
    except ValueError:
        raise GraphmodeError(f"cannot parse shape {text!r}", where="--shape",
                             fix="write it like the first input's shape (1x128, 8x3x224x224), "
                                 "the symbolic dims only (8) or batch=1,seq=128") from None
    if any(v < 1 for v in vals):
        return None
    if len(vals) == len(first):
        env: dict[str, int] = {}
        for d, v in zip(first, vals):
            if isinstance(d, int):
                if d != v:
                    return None
            elif env.setdefault(d, v) != v:
                return None
        return env if set(env) == set(dims) else None
    if len(vals) == len(dims):
        return dict(zip(dims, vals))
    return None


def _with_recipe_dims(bundle: Any, recipe: Any) -> Any:
    """The bundle with the recipe's symbolic input shapes where it names no dims of its own and
    the recipe declares each input at its rank."""
    if recipe is None or bundle.dim_names:
        return bundle
    declared = {i.name: list(i.shape) for i in recipe.inputs}
    if set(declared) != set(bundle.input_dims) or any(len(declared[k]) != len(v) for k, v in bundle.input_dims.items()):
        return bundle
    import dataclasses
    return dataclasses.replace(bundle, input_dims=declared)


def _fitting(bundle: Any, shapes: Sequence[str]) -> dict[str, dict[str, int]]:
    """Each --shape that fits the bundle, with its dims."""
    return {s: env for s in shapes if (env := parse_shape(s, bundle)) is not None}


def default_envs(name: str, bundle: Any) -> list[dict[str, int]]:
    shapes = DEFAULT_SHAPES.get(name)
    if shapes is None:
        return [bundle.example_shape()]
    return [parse_shape("x".join(map(str, s)), bundle) for s in shapes]


def load_cases(models: Sequence[str], shapes: Sequence[str], *, quick: bool = False,
               recipe: Any = None) -> list[ModelCase]:
    """Build every selected model once; attach the shapes that fit it (or its defaults). Under a
    `recipe`, a model handed with static example shapes takes the recipe's dims (`--shape 2x16`
    reads as its batch x seq, as `run --shape` does)."""
    cases = []
    unused = list(shapes)
    for spec in models:
        t0 = time.perf_counter()
        bundle = _with_recipe_dims(resolve_bundle(spec, recipe), recipe)
        load_s = time.perf_counter() - t0
        name = canonical_name(spec, bundle)
        if shapes:
            fits = _fitting(bundle, shapes)
            batched = with_batch_axis(bundle) if len(fits) < len(shapes) and recipe is None else None
            if batched is not None and len(_fitting(batched, shapes)) > len(fits):
                bundle, fits = batched, _fitting(batched, shapes)   # static examples: a leading batch, as drafts take
            envs = list(fits.values())
            unused[:] = [s for s in unused if s not in fits]
            if not envs:
                first = bundle.input_names[0]
                declared = [i.name for i in recipe.inputs] if recipe is not None else None
                raise GraphmodeError(f"no --shape fits model {spec!r}", where="--shape", value=list(shapes),
                                     fix=f"its first input {first!r} is {bundle.input_dims[first]}; e.g. "
                                         f"{'x'.join(str(x) for x in bundle.input_shape(first, bundle.example_shape()))}"
                                         + ("; or give --recipe (graphmode recipe init) to name its dims"
                                            if recipe is None or bundle.dim_names else
                                            f"; the recipe's dims name none of its axes: it declares inputs "
                                            f"{declared}, the model's examples are {bundle.input_names} (declare "
                                            "each, at its rank)"))
        else:
            envs = default_envs(name, bundle)
        if quick:
            envs = envs[:1]
        if recipe is not None:
            _fits_recipe(spec, bundle, envs if shapes else [], recipe)       # the shapes asked for
        cases.append(ModelCase(spec, name, bundle, envs, load_s))
    if unused:
        raise GraphmodeError(f"shape(s) {unused} fit none of the models {list(models)}", where="--shape",
                             fix="write shapes like the first input of a selected model")
    return cases


def _fits_recipe(spec: str, bundle: Any, envs: Sequence[dict[str, int]], recipe: Any) -> None:
    """A --recipe that cannot run the model or a shape is refused before any engine is timed (it
    was a failed graphmode row after every other engine's minutes)."""
    unknown = [i.name for i in recipe.inputs if i.name not in bundle.input_names]
    if unknown:
        raise GraphmodeError(f"the recipe declares inputs {unknown} that model {spec!r} does not take",
                             where="--recipe", value=unknown,
                             fix=f"name the model's inputs in the recipe's inputs[]: {bundle.input_names}")
    for env in envs if recipe.on_violation == "error" else ():     # (eager: such a row runs eagerly, flagged)
        for d, v in env.items():
            lo, hi = recipe.dim_range(d) if d in recipe.dims else (v, v)
            if not lo <= v <= hi:
                raise GraphmodeError(f"shape {dict(env)} is outside the recipe's dims.{d} [{lo}, {hi}]",
                                     where="--shape", value=dict(env),
                                     fix=f"bench {d} within [{lo}, {hi}], or widen dims.{d} in the recipe")


# ---- the recipe graphmode gets ---------------------------------------------------------------------

def auto_recipe(bundle: Any, envs: Sequence[dict[str, int]], name: str | None = None) -> dict:
    """A graph-mode recipe whose buckets are exactly the benchmarked dim values (no padding)."""
    from graphmode.ir.types import TORCH_TO_DTYPE
    dims: dict[str, dict] = {}
    for d in bundle.dim_names:
        vals = sorted({int(e[d]) for e in envs})
        dims[d] = {"buckets": vals}
    inputs = [{"name": n, "dtype": TORCH_TO_DTYPE[bundle.example_inputs[n].dtype], "shape": list(bundle.input_dims[n])}
              for n in bundle.input_names]
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name or f"bench-{bundle.name}")
    return {"version": 1, "name": safe, "description": "generated by graphmode bench/profile: buckets at the "
            "benchmarked shapes", "inputs": inputs, "dims": dims, "exe_mode": "graph", "targets": ["host"]}

# ---- decoders (`graphmode bench decode`) ----------------------------------------------------
# `gpt2` is the built-in GPT-2 small; `llama` is a Llama config of SmolLM-135M's shape
# (30 layers, hidden 576, 9 query / 3 KV heads of 64, FFN 1536, vocab 49152, tied
# embeddings: 134.5 M parameters). No Llama weights ship in a package here, so both are
# random-init from `transformers` configs, seeded. `tiny_gpt2` / `tiny_llama` are the
# `--quick` models: 2 layers, a small vocab, and a wide init so greedy choices are decisive
# (fp32 engines that sum in a different order still pick the same argmax).
#
# Each builder is a model spec (`graphmode.bench.models:llama_135m`) returning a ModelBundle
# whose module is the `transformers` *ForCausalLM, so `graphmode generate` and
# `CompiledModel.generate` find it.

LLAMA_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                  num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=2048,
                  rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
TINY_LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=128,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, initializer_range=0.3)
TINY_GPT2 = dict(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=128, bos_token_id=1, eos_token_id=2,
                 initializer_range=0.3)


def _seeded_lm(cls_name: str, cfg_name: str, seed: int, **cfg: Any) -> torch.nn.Module:
    """A random-init transformers LM; the caller's RNG state is left as it was."""
    import transformers
    with warnings.catch_warnings(), torch.random.fork_rng(devices=[]):
        warnings.simplefilter("ignore")
        torch.manual_seed(seed)
        config = getattr(transformers, cfg_name)(**cfg)
        config._attn_implementation = "sdpa"
        return getattr(transformers, cls_name)(config).eval()


def lm_bundle(lm: torch.nn.Module, name: str):
    """A ModelBundle of a causal LM over `input_ids` + `attention_mask` [batch, seq]."""
    from graphmode.capture.spec import bundle_from_module
    g = torch.Generator().manual_seed(0)
    vocab = int(lm.config.vocab_size)
    ex = {"input_ids": torch.randint(3, vocab, (2, 8), generator=g),
          "attention_mask": torch.ones(2, 8, dtype=torch.int64)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return bundle_from_module(lm, ex, {k: ["batch", "seq"] for k in ex}, name=name)


def llama_135m(seed: int = 0):
    return lm_bundle(_seeded_lm("LlamaForCausalLM", "LlamaConfig", seed, **LLAMA_135M), "llama-135m")


def tiny_llama(seed: int = 0):
    return lm_bundle(_seeded_lm("LlamaForCausalLM", "LlamaConfig", seed, **TINY_LLAMA), "tiny-llama")


def tiny_gpt2(seed: int = 0):
    return lm_bundle(_seeded_lm("GPT2LMHeadModel", "GPT2Config", seed, **TINY_GPT2), "tiny-gpt2")


def gpt2_small(seed: int = 0):
    from graphmode.capture.zoo import build_gpt2
    return build_gpt2(seed)


DECODE_MODELS: dict[str, Callable[[], Any]] = {"gpt2": gpt2_small, "llama": llama_135m}
QUICK_DECODE_MODELS: dict[str, Callable[[], Any]] = {"tiny-gpt2": tiny_gpt2, "tiny-llama": tiny_llama}
DECODE_PRETTY = {"gpt2": "GPT-2 small (124M)", "llama": "Llama (SmolLM-135M shape)", "tiny-gpt2": "tiny GPT-2",
          "tiny-llama": "tiny Llama"}


def decode_recipe(lm: torch.nn.Module, prompt_lens: Sequence[int], batches: Sequence[int], max_tokens: int,
                  name: str = "bench-decode", page_size: int = 16) -> dict:
    """A graph-mode decoder recipe whose buckets are exactly the benchmarked prompt lengths and
    batches (no padding is measured) and whose KV pool holds every sequence of the largest
    batch at `max_tokens` (prompt + new tokens)."""
    from graphmode.decode.lm import lm_config
    cfg = lm_config(lm)
    return {"version": 1, "name": name, "description": "generated by graphmode bench decode: buckets at the "
            "benchmarked prompt lengths and batches",
            "inputs": [{"name": "input_ids", "dtype": "i64", "shape": ["batch", "seq"]},
                       {"name": "attention_mask", "dtype": "i64", "shape": ["batch", "seq"],
                        "role": "attention_mask"}],
            "dims": {"batch": {"buckets": sorted(set(batches))},
                     "seq": {"buckets": sorted(set(prompt_lens)), "min": 2}},
            "exe_mode": "graph", "targets": ["host"],
            "memory": {"kv_cache": {"page_size": page_size, "max_pages_per_seq": math.ceil(max_tokens / page_size),
                                    "layers": cfg["layers"], "kv_heads": cfg["kv_heads"],
                                    "head_dim": cfg["head_dim"], "dtype": "f32"}}}


@dataclass
class DecodeCase:
    name: str
    spec: str
    bundle: Any
    lm: torch.nn.Module
    load_s: float = 0.0


def decode_engine(bundle: Any, recipe: Any, *, threads: int, cache_dir: Any, on_stage: Any = None,
                  prepare: tuple[int, int] | None = None) -> tuple[Any, Any, float]:
    """`bundle` compiled under a decoder `recipe`, its decode engine with the (batch, prompt
    length) bucket `prepare` built, and the seconds that took. Compiled with mode eager:
    nothing but the engine's own paged graph is lowered."""
    import graphmode
    from graphmode.decode.api import engine_of
    t0 = time.perf_counter()
    cm = graphmode.compile(bundle, recipe, "host", mode="eager", cache_dir=cache_dir, threads=threads,
                           on_stage=on_stage)
    eng = engine_of(cm)
    if prepare is not None:
        eng.prepare(*prepare)
    return cm, eng, round(time.perf_counter() - t0, 3)


def load_decode_cases(models: Sequence[str], quick: bool) -> list[DecodeCase]:
    from graphmode.decode.api import causal_lm
    table = QUICK_DECODE_MODELS if quick else DECODE_MODELS
    cases = []
    for spec in models or list(table):
        t0 = time.perf_counter()
        builder = {**DECODE_MODELS, **QUICK_DECODE_MODELS}.get(spec)
        bundle = builder() if builder else resolve_bundle(spec)
        cases.append(DecodeCase(spec if builder else bundle.name, spec, bundle, causal_lm(bundle, "--model"),
                                time.perf_counter() - t0))
    return cases
