"""The decoders the decode benchmark compares, behind one interface.

An engine is set up once per model, then `run(prompts, new)` generates `new` greedy tokens
after each row of `prompts` ([batch, prompt] token ids, no padding, end-of-sequence never
stops a row) and returns a `Run`: the tokens and times measured from the call: when every
row's first token is in the caller's hands (TTFT, `vllm bench serve`'s definition: request
sent -> first streamed token), when the last of those first tokens was produced (decoding
is timed from there) and when the last token was. Engines:

- `eager`: `transformers` generate, dynamic cache (the numerics reference);
- `static_compile`: `transformers` generate with `cache_implementation="static"` and
  `torch.compile(model.forward)` (inductor, `dynamic=False`, so each prompt length and
  batch gets its own graphs: warm-up compiles them);
- `llama_cpp[f32|q8_0]`: llama.cpp through llama-cpp-python's C API on the same weights
  written as GGUF (gguf_export.py); q8_0 is quantized by llama.cpp; its KV cache is its
  default f16, one stream per sequence; a prompt is one `llama_decode` call, a decode step
  one call for the whole batch;
- `graphmode`: the decode engine (`graphmode.decode`), requests added together and stepped
  until done; a step hands its tokens over when it returns, and the step that prefills a
  prompt also decodes its second token, so its TTFT includes one decode step;
  `graphmode[int8]` / `graphmode[bf16]` store the linear weights narrow (recipe
  `precision.weights`), `graphmode[batch_invariant]` computes each sequence alone;
- `ort_genai`, `openvino_genai`: reported "not installed" unless their package imports;
  the pipelines themselves are not wired up yet (reported as such).

An engine that cannot run here raises `EngineUnavailable` (the same as `graphmode bench`'s)
from `setup`: its rows say why, and `--quick` does not count them as failures.
"""
from __future__ import annotations

import copy
import ctypes
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from graphmode.bench.engines import EngineUnavailable

ENGINE_NAMES = ("eager", "static_compile", "llama_cpp", "ort_genai", "openvino_genai", "graphmode")
LLAMA_CPP_VARIANTS = ("f32", "q8_0")
WEIGHT_VARIANTS = ("bf16", "int8")                    # graphmode[int8]: recipe precision.weights
GRAPHMODE_VARIANTS = ("batch_invariant",) + WEIGHT_VARIANTS
LABELS = {"eager": "transformers eager", "static_compile": "transformers static+compile",
          "llama_cpp": "llama.cpp", "ort_genai": "ORT GenAI", "openvino_genai": "OpenVINO GenAI",
          "graphmode": "graphmode"}


@dataclass
class Run:
    tokens: list[list[int]]          # new tokens per row
    first_s: float                   # call -> every row's first token is in the caller's hands (TTFT)
    end_s: float                     # call -> every row has all its tokens
    produced_s: float | None = None  # call -> the last first token was produced (None: at first_s)

    @property
    def decode_from_s(self) -> float:
        """Where the decode interval starts: tokens 2..new of every row come after it."""
        return self.first_s if self.produced_s is None else self.produced_s


@dataclass
class DecodeShared:
    """What every engine of one model gets."""

    name: str
    bundle: Any
    lm: torch.nn.Module
    recipe: dict
    threads: int
    max_batch: int
    max_tokens: int
    cache_dir: Any = None            # graphmode artifacts (None: a fresh temp dir)
    work: Path | None = None         # scratch folder (GGUF files)
    on_stage: Any = None             # hears graphmode's decoder capture, passes and plans (graphmode/progress.py)


class DecodeEngine:
    name = "engine"
    dtype = "f32"                    # weights as the engine reads them
    kv_dtype = "f32"

    def __init__(self, variant: str | None = None) -> None:
        self.variant = variant
        self.setup_detail: dict[str, Any] = {}

    @property
    def label(self) -> str:
        base = LABELS.get(self.name, self.name)
        return f"{base} {self.variant}" if self.variant else base

    def setup(self, shared: DecodeShared) -> None:
        raise NotImplementedError

    def run(self, prompts: torch.Tensor, new: int) -> Run:
        raise NotImplementedError

    def close(self) -> None:
        pass


class _Stamps:
    """A `transformers` streamer that only timestamps: generate calls `put` with the prompt,
    then with each step's new tokens."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.puts: list[float] = []

    def put(self, value) -> None:
        self.puts.append(time.perf_counter())

    def end(self) -> None:
        pass


class HFEngine(DecodeEngine):
    name = "eager"
    static = False

    def setup(self, shared):
        from transformers import GenerationConfig
        lm = shared.lm
        if self.static:
            lm = copy.deepcopy(lm)
            lm.forward = torch.compile(lm.forward, dynamic=False)
        self.lm = lm.eval()
        # eos_token_id [] (not None: generate fills None from the model's own config) so that
        # end-of-sequence stops no row, as in every other engine here
        self.gen = GenerationConfig(do_sample=False, use_cache=True, pad_token_id=0, eos_token_id=[],
                                    cache_implementation="static" if self.static else None, disable_compile=True)
        self.setup_detail = {"cache": "static" if self.static else "dynamic",
                             "torch_compile": "inductor, default mode, dynamic=False" if self.static else None}

    def run(self, prompts, new):
        import torch._dynamo
        self.gen.max_new_tokens = new
        st = _Stamps()
        with torch.inference_mode(), torch._dynamo.config.patch(recompile_limit=64):
            out = self.lm.generate(prompts, attention_mask=torch.ones_like(prompts), generation_config=self.gen,
                                   streamer=st)
        end = time.perf_counter()
        first = st.puts[1] if len(st.puts) > 1 else end
        return Run(out[:, prompts.shape[1]:].tolist(), first - st.t0, end - st.t0)

    def close(self):
        self.lm = None


class StaticCompileEngine(HFEngine):
    name = "static_compile"
    static = True


class GraphmodeEngine(DecodeEngine):
    name = "graphmode"

    def __init__(self, variant: str | None = None) -> None:
        super().__init__(variant)
        self.dtype = variant if variant in WEIGHT_VARIANTS else "f32"

    def setup(self, shared):
        import graphmode
        from graphmode.decode.api import engine_of
        cache = shared.cache_dir
        if cache is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="graphmode-bench-decode-")
            cache = self._tmp.name
        t0 = time.perf_counter()
        # exe_mode eager: no whole-sequence graph; the decode engine captures its own
        recipe = shared.recipe
        if self.variant == "batch_invariant":
            recipe = dict(recipe, determinism=self.variant)
        elif self.variant in WEIGHT_VARIANTS:
            recipe = dict(recipe, precision={"compute": "f32", "weights": self.variant})
        cm = graphmode.compile(shared.bundle, recipe, "host", mode="eager", cache_dir=cache,
                               threads=shared.threads, on_stage=shared.on_stage)
        self.eng = engine_of(cm)
        self.setup_detail = {"engine_build_s": round(time.perf_counter() - t0, 3),
                             "kv_pages": self.eng.layout.pages, "page_size": self.eng.layout.page_size,
                             "recipe": shared.recipe.get("name")}

    def run(self, prompts, new):
        from graphmode.decode.engine import drive
        from graphmode.decode.sampling import SamplingParams
        params = SamplingParams(max_new_tokens=new)          # greedy; no end-of-sequence token
        t0 = time.perf_counter()
        seqs = [self.eng.add(row, params) for row in prompts.tolist()]
        seen = None
        for _ in drive(self.eng, seqs):
            if seen is None and all(s.generated for s in seqs):
                seen = time.perf_counter()
        end = time.perf_counter()
        return Run([s.generated for s in seqs], seen - t0, end - t0, max(s.first_token_at for s in seqs) - t0)

    def close(self):
        self.eng = None
        tmp = getattr(self, "_tmp", None)
        if tmp is not None:
            tmp.cleanup()


@dataclass
class _LlamaCtx:
    ctx: Any
    batch: Any
    seqs: int


class LlamaCppEngine(DecodeEngine):
    name = "llama_cpp"
    kv_dtype = "f16"

    def __init__(self, variant=None):
        super().__init__(variant or "f32")
        self.dtype = self.variant
        self._ctxs: dict[int, _LlamaCtx] = {}
        self.model = None

    def setup(self, shared):
        try:
            import llama_cpp
        except ImportError:
            raise EngineUnavailable("not installed (pip install llama-cpp-python gguf; it builds llama.cpp from "
                                    "source, minutes on 2 cores)") from None
        if self.variant not in LLAMA_CPP_VARIANTS:
            raise EngineUnavailable(f"unknown llama.cpp variant {self.variant!r}")
        from graphmode.bench.gguf_export import timed_gguf
        from graphmode.bench.machine import _version
        self.ll = llama_cpp
        _quiet(llama_cpp)
        llama_cpp.llama_backend_init()
        path, gguf_s = timed_gguf(shared.lm, shared.work, shared.name, self.variant, shared.threads)
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), llama_cpp.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.threads, self.max_tokens = shared.threads, shared.max_tokens
        self.setup_detail = {"gguf_s": round(gguf_s, 3), "gguf_mb": round(path.stat().st_size / 2**20, 1),
                             "weights": self.variant, "kv_cache": "f16 (llama.cpp default)",
                             "version": _version("llama_cpp_python")}

    def _ctx(self, seqs: int) -> _LlamaCtx:
        """One context per batch size: `seqs` KV streams of max_tokens each."""
        got = self._ctxs.get(seqs)
        if got is None:
            ll = self.ll
            p = ll.llama_context_default_params()
            p.n_seq_max = seqs
            p.n_ctx = seqs * self.max_tokens
            p.n_batch = p.n_ubatch = max(512, seqs)
            p.n_threads = p.n_threads_batch = self.threads
            p.kv_unified = False
            ctx = ll.llama_init_from_model(self.model, p)
            if not ctx:
                raise RuntimeError(f"llama.cpp could not create a context for {seqs} sequences")
            got = self._ctxs[seqs] = _LlamaCtx(ctx, ll.llama_batch_init(max(512, seqs, self.max_tokens), 0, 1), seqs)
        return got

    def _decode(self, c: _LlamaCtx, items: list[tuple[int, int, int, bool]]) -> None:
        """items: (token, position, sequence, wants logits)."""
        b = c.batch
        for i, (tok, pos, seq, out) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, out
            b.seq_id[i][0] = seq
        b.n_tokens = len(items)
        rc = self.ll.llama_decode(c.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _argmax(self, c: _LlamaCtx, i: int) -> int:
        import numpy as np
        ptr = self.ll.llama_get_logits_ith(c.ctx, i)
        return int(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).argmax())

    def run(self, prompts, new):
        rows = prompts.tolist()
        c = self._ctx(len(rows))
        self.ll.llama_memory_clear(self.ll.llama_get_memory(c.ctx), True)
        t0 = time.perf_counter()
        out: list[list[int]] = []
        for s, row in enumerate(rows):           # one prompt per call, logits at its last token only
            self._decode(c, [(t, p, s, p == len(row) - 1) for p, t in enumerate(row)])
            out.append([self._argmax(c, len(row) - 1)])
        first = time.perf_counter()
        for k in range(1, new):
            self._decode(c, [(out[s][-1], len(rows[s]) + k - 1, s, True) for s in range(len(rows))])
            for s in range(len(rows)):
                out[s].append(self._argmax(c, s))
        end = time.perf_counter()
        return Run(out, first - t0, end - t0)

    def close(self):
        ll = getattr(self, "ll", None)
        for c in self._ctxs.values():
            ll.llama_batch_free(c.batch)
            ll.llama_free(c.ctx)
        self._ctxs.clear()
        if self.model:
            ll.llama_model_free(self.model)
        self.model = None


_LOG_CB = None


def _quiet(llama_cpp) -> None:
    """llama.cpp logs every load and context to stderr; the benchmark's own log is enough."""
    global _LOG_CB
    if _LOG_CB is None:
        _LOG_CB = llama_cpp.llama_log_callback(lambda level, text, data: None)
        llama_cpp.llama_log_set(_LOG_CB, ctypes.c_void_p(0))


class _Unwired(DecodeEngine):
    """A runtime whose pipeline is not wired up yet: a row that says so, never a silent gap."""

    module = ""
    package = ""

    def setup(self, shared):
        import importlib.util
        if importlib.util.find_spec(self.module) is None:
            raise EngineUnavailable(f"not installed (pip install {self.package}); the benchmark does not drive it "
                                    "yet either")
        raise EngineUnavailable(f"{self.module} is installed, but the benchmark does not drive it yet")


class OrtGenAIEngine(_Unwired):
    name = "ort_genai"
    module = "onnxruntime_genai"
    package = "onnxruntime-genai"


class OpenVinoGenAIEngine(_Unwired):
    name = "openvino_genai"
    module = "openvino_genai"
    package = "openvino-genai"


ENGINES: dict[str, type[DecodeEngine]] = {"eager": HFEngine, "static_compile": StaticCompileEngine,
                                          "llama_cpp": LlamaCppEngine, "ort_genai": OrtGenAIEngine,
                                          "openvino_genai": OpenVinoGenAIEngine, "graphmode": GraphmodeEngine}


def parse_engines(text: str | None) -> list[tuple[str, str | None]]:
    """`eager,llama_cpp[q8_0],graphmode`; plain `llama_cpp` means both f32 and q8_0."""
    from graphmode.errors import GraphmodeError
    names = [e.strip() for e in (text.split(",") if text else ENGINE_NAMES) if e.strip()]
    out: list[tuple[str, str | None]] = []
    for n in names:
        base, _, var = n.partition("[")
        var = var.rstrip("]") or None
        if base not in ENGINES:
            raise GraphmodeError(f"unknown decode engine {base!r}", where="--engines", value=text,
                                 fix=f"choose from {', '.join(ENGINE_NAMES)}")
        if base == "graphmode" and var is not None and var not in GRAPHMODE_VARIANTS:
            raise GraphmodeError(f"unknown graphmode variant {var!r}", where="--engines", value=n,
                                 fix="graphmode, graphmode[batch_invariant] (determinism: batch_invariant: its cost "
                                     "against graphmode), graphmode[int8] or graphmode[bf16] (precision.weights)")
        if base == "llama_cpp" and var is not None and var not in LLAMA_CPP_VARIANTS:
            raise GraphmodeError(f"unknown llama.cpp weights {var!r}", where="--engines", value=n,
                                 fix=f"llama_cpp[{'] or llama_cpp['.join(LLAMA_CPP_VARIANTS)}]")
        for v in (LLAMA_CPP_VARIANTS if base == "llama_cpp" and var is None else (var,)):
            if (base, v) not in out:
                out.append((base, v))
    return out


def make_engine(name: str, variant: str | None = None) -> DecodeEngine:
    return ENGINES[name](variant)
