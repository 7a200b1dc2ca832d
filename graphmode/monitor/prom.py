"""Prometheus metric families of one server or model, in their own `CollectorRegistry`.

Never the global registry: two servers (or two tests) in one process each get their own
families. Every series carries the recipe `version` (content hash) and `target`; per-plan
series also carry `bucket` (`batch=4,seq=32`; `none` when the request never reached a
plan, `eager` for an eager fallback).

The decoding series (time to first token, inter-token latency, time per output token,
end-to-end and queue time, running / waiting sequences, KV page usage, preemptions, prompt
and generated tokens) follow vLLM's definitions and names with a `graphmode_` prefix, so
dashboards built for one read the other.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   10.0, 30.0)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
VIOLATION_KINDS = ("shape", "input", "memory", "latency", "fallback")
# per-token times (TTFT, ITL, TPOT, queue) and whole generations (end to end): vLLM's ranges
TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0)
GENERATION_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0, 240.0,
                      480.0, 960.0, 1920.0)

L = ("version", "target")


class PromMetrics:
    """The metric families (see graphmode/serve/README.md for the list)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter("graphmode_requests", "Inference requests by outcome (ok, contract = refused "
                                "by the recipe's contract, timeout = no answer within the request timeout, "
                                "cancelled = the client went away mid-generation, error = server fault)",
                                L + ("bucket", "status"), registry=r)
        self.latency = Histogram("graphmode_request_latency_seconds", "Server-side latency of a successful "
                                 "request, arrival to result (queueing and batching included)",
                                 L + ("bucket",), buckets=LATENCY_BUCKETS, registry=r)
        self.model_latency = Histogram("graphmode_model_latency_seconds", "One model call (one batch)",
                                       L + ("bucket",), buckets=LATENCY_BUCKETS, registry=r)
        self.batch_requests = Histogram("graphmode_batch_requests", "Requests merged into one model call",
                                        L + ("bucket",), buckets=BATCH_BUCKETS, registry=r)
        self.compiles = Counter("graphmode_compile_events", "Plan builds per bucket "
                                "(event = compile, or cache_hit when the plan came from the artifact cache)",
                                L + ("bucket", "event"), registry=r)
        self.fallbacks = Counter("graphmode_fallback_events", "Eager fallbacks taken", L + ("bucket", "reason"),
                                 registry=r)
        self.violations = Counter("graphmode_contract_violations", "Contract violations by kind: shape (dims "
                                  "outside the recipe), input (names, dtypes, ranks, fixed dims), memory (plan "
                                  "over budget), latency (request over its SLA p99), fallback (eager fallback "
                                  "taken)", L + ("bucket", "kind"), registry=r)
        self.operations = Counter("graphmode_operations", "Operations checked against the contract "
                                  "(requests + bucket plans)", L, registry=r)
        self.violated_operations = Counter("graphmode_violated_operations", "Operations with at least one "
                                           "contract violation", L, registry=r)
        self.health = Gauge("graphmode_health_score", "1 - violated operations / operations", L, registry=r)
        self.arena_bytes = Gauge("graphmode_arena_bytes", "Activation arena of a bucket's plan", L + ("bucket",),
                                 registry=r)
        self.weights_bytes = Gauge("graphmode_weights_bytes", "Constant (weight) bytes of the compiled graph", L,
                                   registry=r)
        self.sla_bound = Gauge("graphmode_sla_bound_seconds", "The recipe's latency bounds (entry sla or "
                               "sla.per_bucket[i], quantile p50 or p99), so an alert need not copy them",
                               L + ("entry", "quantile"), registry=r)
        self.memory_budget = Gauge("graphmode_memory_budget_bytes", "The recipe's memory budget (weights + "
                                   "activations)", L, registry=r)
        self.drift = Counter("graphmode_sla_drift_events", "Sustained SLA drift detected by the probe",
                             L + ("sla", "quantile"), registry=r)
        self.renegotiations = Counter("graphmode_renegotiations", "What a drift event led to (renegotiated, "
                                      "rate_limited, no_variant, busy)", L + ("outcome",), registry=r)
        self.reloads = Counter("graphmode_recipe_reloads", "Recipe loads (outcome = swapped, refused, failed, "
                               "busy, unchanged; origin = api, variant, initial)", ("target", "origin", "outcome"),
                               registry=r)
        self.recipe_active = Gauge("graphmode_recipe_active", "1 for the recipe version now serving",
                                   L + ("name", "origin"), registry=r)
        self.ready = Gauge("graphmode_ready", "1 once every bucket of the active recipe is warm", ("target",),
                           registry=r)
        self.queue_depth = Gauge("graphmode_queue_depth", "Requests waiting to be batched", ("target",), registry=r)
        self.ranks_up = Gauge("graphmode_tensor_parallel_ranks_up", "Rank processes of the served tensor-parallel "
                              "group that are alive (absent for one process)", ("target",), registry=r)
        self.bad_requests = Counter("graphmode_bad_requests", "Requests refused before the contract was checked "
                                    "(malformed body, too large, unsupported media type, not ready)",
                                    ("target", "reason"), registry=r)
        self._decode_families(r)

    def _decode_families(self, r: CollectorRegistry) -> None:
        tok = dict(buckets=TOKEN_BUCKETS, registry=r)
        self.ttft = Histogram("graphmode_time_to_first_token_seconds", "Request arrival to its first generated "
                              "token", L, **tok)
        self.itl = Histogram("graphmode_inter_token_latency_seconds", "Gap between two successive tokens of one "
                             "sequence", L, **tok)
        self.tpot = Histogram("graphmode_request_time_per_output_token_seconds", "(end to end - time to first "
                              "token) / (generated tokens - 1), per sequence of at least 2 tokens", L, **tok)
        self.queue_time = Histogram("graphmode_request_queue_time_seconds", "Request arrival to the step that "
                                    "admitted its sequence (prefill)", L, **tok)
        self.e2e = Histogram("graphmode_e2e_request_latency_seconds", "Request arrival to its sequence's last "
                             "token", L, buckets=GENERATION_BUCKETS, registry=r)
        self.running = Gauge("graphmode_num_requests_running", "Sequences being decoded (one per prompt)", L,
                             registry=r)
        self.waiting = Gauge("graphmode_num_requests_waiting", "Sequences waiting for KV pages (new or preempted)",
                             L, registry=r)
        self.kv_usage = Gauge("graphmode_kv_cache_usage_ratio", "Used KV pages / pages in the pool (0 to 1)", L,
                              registry=r)
        self.preemptions = Counter("graphmode_num_preemptions", "Sequences that gave their KV pages back to be "
                                   "recomputed later", L, registry=r)
        self.prompt_tokens = Counter("graphmode_prompt_tokens", "Prompt tokens prefilled (a recomputed sequence "
                                     "counts once)", L, registry=r)
        self.generation_tokens = Counter("graphmode_generation_tokens", "Tokens generated", L, registry=r)
        self.prefix_queries = Counter("graphmode_prefix_cache_queries", "Prompt tokens looked up in the prefix "
                                      "cache at admission (a recomputed sequence again)", L, registry=r)
        self.prefix_hits = Counter("graphmode_prefix_cache_hits", "Prompt tokens found in cached KV pages (not "
                                   "prefilled); hit rate = hits / queries", L, registry=r)
        self.draft_tokens = Counter("graphmode_spec_decode_draft_tokens", "Draft tokens proposed by speculative "
                                    "decoding (decode.speculative) and verified", L, registry=r)
        self.accepted_tokens = Counter("graphmode_spec_decode_accepted_tokens", "Draft tokens accepted by the verify "
                                       "step; acceptance rate = accepted / draft", L, registry=r)
        self.finished = Counter("graphmode_sequences_finished", "Finished sequences by reason (eos, length, stop, "
                                "cancelled = the client went away or timed out, error)", L + ("finish_reason",),
                                registry=r)

    def counted(self, fam: Any, version: str, target: str) -> int:
        """What counter `fam` has counted for one recipe version so far (a version served again
        after a reload continues its series)."""
        return int(sum(s.value for m in fam.collect() for s in m.samples if s.name.endswith("_total")
                       and s.labels.get("version") == version and s.labels.get("target") == target))

    def decode_series(self, version: str, target: str, speculative: bool = True) -> "DecodeSeries":
        """The decoding series of one recipe version, bound once (the decode loop updates them
        for every token). The speculative-decoding counters only where it drafts: a version
        without exported them at 0 beside the one that does."""
        lab = (version, target)
        spec = {"draft_tokens": self.draft_tokens.labels(*lab),
                "accepted_tokens": self.accepted_tokens.labels(*lab)} if speculative else {}
        return DecodeSeries(*(fam.labels(*lab) for fam in (
            self.ttft, self.itl, self.tpot, self.queue_time, self.e2e, self.running, self.waiting, self.kv_usage,
            self.preemptions, self.prompt_tokens, self.generation_tokens)), finished=self.finished, labels=lab,
            prefix_queries=self.prefix_queries.labels(*lab), prefix_hits=self.prefix_hits.labels(*lab), **spec)

    def forget(self, version: str) -> None:
        """Drop every series of recipe `version` (retired long ago), so a server that swaps
        recipes for months does not export, or keep in memory, one set of series per swap."""
        for fam in (self.requests, self.latency, self.model_latency, self.batch_requests, self.compiles,
                    self.fallbacks, self.violations, self.operations, self.violated_operations, self.health,
                    self.arena_bytes, self.weights_bytes, self.memory_budget, self.sla_bound, self.drift,
                    self.renegotiations,
                    self.recipe_active, self.ttft, self.itl, self.tpot, self.queue_time, self.e2e, self.running,
                    self.waiting, self.kv_usage, self.preemptions, self.prompt_tokens, self.generation_tokens,
                    self.finished, self.prefix_queries, self.prefix_hits, self.draft_tokens, self.accepted_tokens):
            if hasattr(fam, "remove_by_labels"):            # prometheus_client >= 0.22
                fam.remove_by_labels({"version": version})
                continue
            series = {tuple(s.labels.values()) for m in fam.collect() for s in m.samples
                      if s.labels.get("version") == version and "le" not in s.labels}
            for values in series:                           # sample labels are in label-name order
                fam.remove(*values)

    def text(self) -> bytes:
        """The Prometheus text exposition of this registry, without the `_created` samples
        prometheus_client adds to every counter and histogram (a creation time, typed as a gauge
        under the counter's help text). Dropped here, per registry, rather than by its
        process-wide switch: a replica's or a library user's process exports the same text."""
        return generate_latest(_WithoutCreated(self.registry))


class _WithoutCreated:
    """A registry's families as collected, less their `_created` samples."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry

    def collect(self) -> Any:
        for fam in self.registry.collect():       # each collect() builds new families: safe to trim
            fam.samples = [s for s in fam.samples if not s.name.endswith("_created")]
            yield fam


@dataclass(frozen=True)
class DecodeSeries:
    """The decoding series of one recipe version (labelled children of PromMetrics' families)."""
    ttft: Any
    itl: Any
    tpot: Any
    queue_time: Any
    e2e: Any
    running: Any
    waiting: Any
    kv_usage: Any
    preemptions: Any
    prompt_tokens: Any
    generation_tokens: Any
    finished: Any
    labels: tuple[str, str]
    prefix_queries: Any = None
    prefix_hits: Any = None
    draft_tokens: Any = None
    accepted_tokens: Any = None

    def counted(self) -> dict[str, Any]:
        """The counters that follow one of the decode engine's running totals (`DecodeEngine.stats`
        key -> counter); a total the engine does not keep (no speculator) is left out."""
        pairs = {"preemptions": self.preemptions, "prefix_cache_queries": self.prefix_queries,
                 "prefix_cache_hits": self.prefix_hits, "draft_tokens": self.draft_tokens,
                 "accepted_tokens": self.accepted_tokens}
        return {k: c for k, c in pairs.items() if c is not None}

    def finish(self, reason: str) -> None:
        self.finished.labels(*self.labels, reason).inc()
