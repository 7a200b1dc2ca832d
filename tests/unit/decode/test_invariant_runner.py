"""The model runner under `determinism: batch_invariant` (decode/runner.py): a decode batch
runs as one step where the bucket's plan and the smallest bucket's list no batch-variant
step, and one sequence at a time (each row's logits without its padding rows, in order)
where either lists one, said once per bucket. The plans here are small torch functions of
each row's token and position (no model): what is checked is which plans run with how many
rows."""
from __future__ import annotations

import logging

import torch

from graphmode.decode.kvcache import KVLayout, PagedKVCache
from graphmode.decode.runner import ModelRunner
from graphmode.decode.sampling import SamplingParams
from graphmode.decode.scheduler import Sequence_

VOCAB = 11


class Plan:
    """One bucket's plan: logits from each row's token and position; `variant` is what its
    `batch_variant_steps` says."""

    def __init__(self, variant: list[str], runs: list[tuple[int, int]], batch: int):
        self.variant, self.runs, self.batch = variant, runs, batch

    def batch_variant_steps(self) -> list[str]:
        return list(self.variant)

    def run(self, inputs):
        self.runs.append((self.batch, int((inputs["lens"] > 0).sum())))
        ids, pos = inputs["input_ids"][:, 0], inputs["position_ids"][:, 0]
        logits = torch.nn.functional.one_hot((ids * 3 + pos) % VOCAB, VOCAB).float()
        return {"logits": logits[:, None, :]}


class Model:
    def __init__(self, variant: dict[int, list[str]]):
        self.variant, self.runs = variant, []

    def executable(self, env):
        return Plan(self.variant.get(env["batch"], []), self.runs, env["batch"])


def _runner(variant: dict[int, list[str]], buckets=(1, 2, 4)) -> tuple[ModelRunner, list[Sequence_]]:
    cache = PagedKVCache(KVLayout(layers=1, kv_heads=1, head_dim=2, page_size=4, pages=12, max_pages_per_seq=3))
    seqs = []
    for i in range(3):
        s = Sequence_(i, [1 + i, 2 + i, 3 + i], SamplingParams(max_new_tokens=2), generated=[5 + i])
        s.cached = len(s.tokens) - 1
        cache.reserve(s.id, len(s.tokens))
        seqs.append(s)
    return ModelRunner(Model(variant), cache, list(buckets), [8], invariant=True), seqs


def _expected(seqs) -> torch.Tensor:
    return torch.stack([torch.nn.functional.one_hot(torch.tensor((s.tokens[-1] * 3 + s.cached) % VOCAB), VOCAB).float()
                        for s in seqs])


def test_row_invariant_plans_decode_the_batch_in_one_step():
    runner, seqs = _runner({})
    out = runner.decode(seqs)
    assert runner.cm.runs == [(4, 3)] and runner.variant_buckets == {}
    assert torch.equal(out[:3], _expected(seqs))


class Said(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_a_variant_plan_runs_its_sequences_one_at_a_time_and_says_why():
    runner, seqs = _runner({4: ["linear 4x8x8 f32 (packed) runs ATen"]}, buckets=(2, 4))
    said, logger = Said(), logging.getLogger("graphmode.decode")
    logger.addHandler(said)
    try:
        out = runner.decode(seqs)
        runner.decode(seqs)
    finally:
        logger.removeHandler(said)
    assert runner.cm.runs == [(2, 1)] * 6                    # the smallest bucket, one row each
    assert torch.equal(out, _expected(seqs))                 # no padding rows between them
    assert runner.variant_buckets == {4: ["batch 4: linear 4x8x8 f32 (packed) runs ATen"]}
    assert sum("runs its sequences one at a time" in m for m in said.messages) == 1


def test_a_variant_smallest_bucket_keeps_every_batch_alone():
    runner, seqs = _runner({1: ["layer_norm #3 (reference) may reduce in an order that depends on the row count"]})
    runner.decode(seqs[:2])
    assert runner.cm.runs == [(1, 1), (1, 1)] and list(runner.variant_buckets) == [2]
