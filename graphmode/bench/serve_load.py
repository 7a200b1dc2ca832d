"""A bounded serving load test in the style of `vllm bench serve` (random dataset).

`num_prompts` streamed completions of random token ids, with input and output lengths drawn
uniformly from `[len * (1 - range_ratio), len * (1 + range_ratio)]`, sent at Poisson
arrivals of `request_rate` per second (`inf`: all at once), at most `max_concurrency` in
flight, to a server on a loopback address only (a load test is not a tool against someone
else's server). Output lengths are exact: the requests set `ignore_eos`.

Measured on the client, as vLLM does: TTFT = request sent -> first streamed token, ITL =
gap between two streamed chunks of one request, TPOT = (e2e - TTFT) / (tokens - 1) per
request, e2e = request sent -> last chunk; throughput = output tokens / wall time of the
run. Percentiles are numpy's (linear interpolation).

`endpoint="embeddings"` loads an encoder instead (`POST /v1/embeddings`, one input of
random token ids per request, as vLLM's embedding benchmark does): requests/s, input
tokens/s and the e2e latency; no tokens are generated, so TTFT, TPOT and ITL stay empty.
Behind `serve --replicas` the server counters (one replica's) are left out.
"""
from __future__ import annotations

import asyncio
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np

from graphmode.client import AsyncClient, ServerError
from graphmode.errors import GraphmodeError
from graphmode.progress import OnStage, StageReporter, stage

MAX_PROMPTS = 100_000
ENDPOINTS = ("completions", "embeddings")
PERCENTILES = (50, 99)


@dataclass
class LoadConfig:
    url: str = "http://127.0.0.1:8000"
    num_prompts: int = 100
    input_len: int = 32
    output_len: int = 32
    range_ratio: float = 0.0
    request_rate: float = math.inf
    max_concurrency: int | None = None
    temperature: float = 0.0
    seed: int = 0
    timeout_s: float = 600.0
    endpoint: str = "completions"    # or "embeddings": an encoder

    def check(self) -> None:
        def bad(name: str, value: Any, fix: str) -> GraphmodeError:
            return GraphmodeError("invalid load test option", where=f"--{name.replace('_', '-')}", value=value, fix=fix)
        host = urlsplit(self.url).hostname
        if not host:
            raise bad("url", self.url, "give the server's address, e.g. http://127.0.0.1:8000")
        from graphmode.serve.app import is_loopback
        if not is_loopback(host):
            raise bad("url", self.url, "the load generator only targets a server on a loopback address "
                                       "(127.0.0.1, ::1, localhost)")
        if self.endpoint not in ENDPOINTS:
            raise bad("endpoint", self.endpoint, " or ".join(ENDPOINTS))
        if not 1 <= self.num_prompts <= MAX_PROMPTS:
            raise bad("num_prompts", self.num_prompts, f"between 1 and {MAX_PROMPTS}")
        if self.input_len < 1 or self.output_len < 1:
            raise bad("input_len", (self.input_len, self.output_len), "lengths of at least 1")
        if not 0 <= self.range_ratio < 1:
            raise bad("range_ratio", self.range_ratio, "a ratio in [0, 1)")
        if not (self.request_rate > 0):
            raise bad("request_rate", self.request_rate, "requests per second > 0 (inf: all at once)")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise bad("max_concurrency", self.max_concurrency, "at least 1")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise bad("temperature", self.temperature, "a finite number >= 0 (0: greedy)")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise bad("timeout_s", self.timeout_s, "seconds > 0")


@dataclass
class RequestResult:
    input_len: int
    output_len: int = 0              # tokens received
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    latency: float | None = None
    error: str | None = None


@dataclass
class LoadReport:
    config: dict[str, Any]
    completed: int
    failed: int
    duration_s: float
    input_tokens: int
    output_tokens: int
    request_throughput: float        # completed requests / s
    output_throughput: float         # output tokens / s
    total_throughput: float          # (input + output) tokens / s
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    itl_ms: dict[str, float]
    e2e_ms: dict[str, float]
    errors: list[str]
    server: dict[str, Any]           # the engine's counters, before -> after

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def text(self) -> str:
        w = 50
        lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=w, c="=")]
        row = lambda k, v: lines.append(f"{k:<40}{v:>10}")  # noqa: E731
        row("Successful requests:", self.completed)
        row("Failed requests:", self.failed)
        row("Benchmark duration (s):", f"{self.duration_s:.2f}")
        row("Total input tokens:", self.input_tokens)
        row("Total generated tokens:", self.output_tokens)
        row("Request throughput (req/s):", f"{self.request_throughput:.2f}")
        row("Output token throughput (tok/s):", f"{self.output_throughput:.2f}")
        row("Total token throughput (tok/s):", f"{self.total_throughput:.2f}")
        for title, key, stats in (("Time to First Token", "TTFT", self.ttft_ms),
                                  ("Time per Output Token (excl. 1st token)", "TPOT", self.tpot_ms),
                                  ("Inter-token Latency", "ITL", self.itl_ms), ("End-to-end Latency", "E2E", self.e2e_ms)):
            lines.append("{s:{c}^{n}}".format(s=title, n=w, c="-"))
            for stat in ("mean", *(f"p{p}" for p in PERCENTILES)):
                row(f"{stat.replace('p50', 'Median').replace('mean', 'Mean').replace('p99', 'P99')} {key} (ms):",
                    f"{stats[stat]:.2f}" if stat in stats else "-")
        if self.server:
            lines.append("{s:{c}^{n}}".format(s="Server (during the run)", n=w, c="-"))
            for k, v in self.server.items():
                row(f"{k}:", v)
        lines.append("=" * w)
        return "\n".join(lines)


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    a = np.asarray(values) * 1e3
    return {"mean": float(a.mean()), **{f"p{p}": float(np.percentile(a, p)) for p in PERCENTILES}}


def _lengths(rng: np.random.Generator, n: int, length: int, ratio: float) -> list[int]:
    lo, hi = max(1, int(length * (1 - ratio))), int(length * (1 + ratio))
    return [int(x) for x in rng.integers(lo, max(lo, hi) + 1, size=n)]


def _recipe_view(url: str) -> tuple[dict[str, Any], str | None]:
    """GET /v1/recipe, and the replica that answered (None: a single server)."""
    try:
        r = httpx.get(url.rstrip("/") + "/v1/recipe", timeout=30)
        view = r.json() if r.status_code == 200 else {}
    except (httpx.HTTPError, ValueError) as e:
        raise GraphmodeError(f"cannot read the server's recipe: {type(e).__name__}: {e}", where="--url", value=url,
                             fix="start `graphmode serve` there first (and wait for `ready`)") from None
    return (view if isinstance(view, dict) else {}), r.headers.get("x-graphmode-replica")


def _decoder_info(url: str) -> tuple[dict[str, Any], str | None]:
    view, replica = _recipe_view(url)
    info = view.get("decoder")
    if not info:
        raise GraphmodeError("the server does not serve a decoder (no /v1/completions)", where="--url", value=url,
                             fix="start it with a causal LM and a recipe that declares memory.kv_cache, or load "
                                 "an encoder with --endpoint embeddings")
    return info, replica


def _encoder_info(url: str) -> dict[str, Any]:
    """What the embeddings load needs: the vocabulary (recipe.model.vocab, else 1000)."""
    view, _ = _recipe_view(url)
    recipe = view.get("recipe") or {}
    names = {i.get("name") for i in recipe.get("inputs", [])}
    if "input_ids" not in names or view.get("decoder"):
        raise GraphmodeError("the server does not serve an encoder (no /v1/embeddings: its recipe takes no "
                             "input_ids, or it is a decoder)", where="--url", value=url,
                             fix="start it with an encoder (e.g. --model minilm), or load a decoder with "
                                 "--endpoint completions")
    return {"vocab": (recipe.get("model") or {}).get("vocab") or 1000}


def _check_lengths(cfg: LoadConfig, inputs: list[int], outputs: list[int], info: dict[str, Any]) -> None:
    """Refuse before sending anything when the drawn lengths exceed the server's contract."""
    longest_in = max(inputs)
    if longest_in > info["max_prompt_tokens"]:
        raise GraphmodeError(f"prompts of up to {longest_in} tokens exceed the server's {info['max_prompt_tokens']}",
                             where="--input-len", value=cfg.input_len, fix="lower --input-len or --range-ratio")
    longest = max(i + o for i, o in zip(inputs, outputs))
    if longest > info["max_tokens_per_sequence"]:
        raise GraphmodeError(f"prompt + output up to {longest} tokens exceed the {info['max_tokens_per_sequence']} a "
                             "sequence's KV pages hold", where="--output-len", value=cfg.output_len,
                             fix="lower --input-len / --output-len")


async def _one(client: AsyncClient, prompt: list[int], out_len: int, cfg: LoadConfig) -> RequestResult:
    res = RequestResult(len(prompt))
    sent = time.perf_counter()
    last = sent
    try:
        async for chunk in client.stream(prompt, max_tokens=out_len, temperature=cfg.temperature, ignore_eos=True,
                                         seed=cfg.seed if cfg.temperature > 0 else None):
            n = len(chunk.token_ids)
            if n == 0:
                continue
            if res.ttft is None:
                res.ttft = chunk.arrived - sent
            else:
                res.itl.append(chunk.arrived - last)
            last = chunk.arrived
            res.output_len += n
        res.latency = last - sent
    except (ServerError, httpx.HTTPError, ValueError) as e:      # (ValueError: an event that is not JSON)
        res.error = f"{type(e).__name__}: {e}"
    return res


async def _embed(client: httpx.AsyncClient, prompt: list[int], cfg: LoadConfig) -> RequestResult:
    res = RequestResult(len(prompt))
    sent = time.perf_counter()
    try:
        r = await client.post(cfg.url.rstrip("/") + "/v1/embeddings", json={"input": [prompt]})
        if r.status_code != 200:
            res.error = f"HTTP {r.status_code}: {r.text[:200]}"
        else:
            res.latency = time.perf_counter() - sent
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def _run(cfg: LoadConfig, prompts: list[list[int]], outputs: list[int], gaps: list[float],
               answered: StageReporter) -> tuple[list[RequestResult], float]:
    limit = asyncio.Semaphore(cfg.max_concurrency or len(prompts))
    conns = cfg.max_concurrency or len(prompts)
    async with AsyncClient(cfg.url, timeout=cfg.timeout_s, max_connections=conns) as c, \
            httpx.AsyncClient(timeout=cfg.timeout_s, limits=httpx.Limits(max_connections=conns)) as plain:
        async def limited(p: list[int], o: int) -> RequestResult:
            async with limit:
                res = await (_embed(plain, p, cfg) if cfg.endpoint == "embeddings" else _one(c, p, o, cfg))
            answered.step("failed" if res.error else "ok")
            return res

        tasks = []
        start = time.perf_counter()
        for p, o, gap in zip(prompts, outputs, gaps):
            if gap > 0:
                await asyncio.sleep(gap)
            tasks.append(asyncio.ensure_future(limited(p, o)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def run_load(cfg: LoadConfig, on_stage: OnStage | None = None) -> LoadReport:
    """Run the load test against the server at `cfg.url` (which must be ready) and measure it;
    `on_stage` hears the `requests` stage, one step per answered request (graphmode/progress.py)."""
    cfg.check()
    encoder = cfg.endpoint == "embeddings"
    info, replica = (_encoder_info(cfg.url), None) if encoder else _decoder_info(cfg.url)
    rng = np.random.default_rng(cfg.seed)
    inputs = _lengths(rng, cfg.num_prompts, cfg.input_len, cfg.range_ratio)
    outputs = [0] * cfg.num_prompts if encoder else _lengths(rng, cfg.num_prompts, cfg.output_len, cfg.range_ratio)
    if not encoder:
        _check_lengths(cfg, inputs, outputs, info)
    vocab = int(info.get("vocab") or 2)
    prompts = [[int(t) for t in rng.integers(0, vocab, size=n)] for n in inputs]
    gaps = [0.0] * cfg.num_prompts if math.isinf(cfg.request_rate) else \
        [0.0] + [float(g) for g in rng.exponential(1.0 / cfg.request_rate, size=cfg.num_prompts - 1)]
    with stage(on_stage, "requests", total=cfg.num_prompts, detail=cfg.url) as answered:
        results, duration = asyncio.run(_run(cfg, prompts, outputs, gaps, answered))
    after = {} if encoder or replica is not None else _decoder_info(cfg.url)[0]   # one replica's: left out
    ok = [r for r in results if r.error is None]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.input_len for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1 and r.ttft is not None]
    server = {k: after[k] - info[k] for k in ("prefill_steps", "decode_steps", "preemptions", "generated_tokens")
              if k in info and k in after}
    return LoadReport(config=asdict(cfg), completed=len(ok), failed=len(results) - len(ok), duration_s=duration,
                      input_tokens=in_tokens, output_tokens=out_tokens,
                      request_throughput=len(ok) / duration, output_throughput=out_tokens / duration,
                      total_throughput=(in_tokens + out_tokens) / duration,
                      ttft_ms=_stats([r.ttft for r in ok if r.ttft is not None]), tpot_ms=_stats(tpots),
                      itl_ms=_stats([g for r in ok for g in r.itl]), e2e_ms=_stats([r.latency for r in ok]),
                      errors=sorted({r.error for r in results if r.error})[:10], server=server)
