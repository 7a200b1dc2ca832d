"""Compiles in several threads at once: torch.export keeps its tracing modes process-wide, so
graphmode traces one model at a time (capture/export_errors.EXPORT_LOCK) and every thread gets
the model it would get alone."""
from __future__ import annotations

import threading
import warnings

import torch

import graphmode
from graphmode.verify.numerics import rel_l2


def _bert(seed: int):
    from transformers import BertConfig, BertModel
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=64)
    return BertModel(cfg).eval()


def test_threads_compiling_at_once_each_get_a_dynamic_draft_that_matches_eager(tmp_path):
    """Trial AC: two of three threads failed ('Trying to pop empty mode stack', with a fix about
    the recipe's dims) and the third drafted fixed shapes, refusing seq 9 later. Meanwhile a third
    thread serves one of the models eagerly: non-strict torch.export swaps fake tensors into the
    module it traces, so that thread failed ('fake_mode.in_kernel_invocation must be False') and so
    did the compile; the trace runs on a copy over the same tensors (capture/trace_copy.py)."""
    from graphmode.capture.trace_copy import traced_copy
    results: dict[int, object] = {}
    models = [_bert(i) for i in range(2)]     # (transformers' lazy first import is not for threads)
    copied = traced_copy(models[0])
    assert copied is not models[0] and copied.embeddings is not models[0].embeddings
    assert copied.embeddings.word_embeddings.weight is models[0].embeddings.word_embeddings.weight
    ids0 = torch.randint(1, 64, (1, 7))
    with torch.inference_mode():
        want0 = models[0](input_ids=ids0).last_hidden_state
    started, done = threading.Event(), threading.Event()
    failures: list[BaseException] = []
    calls: list[float] = []

    def serve_eager() -> None:
        while not done.is_set() and len(calls) < 100_000:
            try:
                with torch.inference_mode():
                    calls.append(rel_l2(models[0](input_ids=ids0).last_hidden_state, want0))
            except Exception as e:  # noqa: BLE001 - reported by the assertion below
                failures.append(e)
            started.set()

    def compile_one(i: int) -> None:
        try:
            m = models[i]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cm = graphmode.compile(m, cache_dir=tmp_path / str(i))
            ids = torch.randint(1, 64, (2, 9))
            with torch.inference_mode():
                want = m(input_ids=ids).last_hidden_state
            results[i] = (sorted(cm.recipe.dims), rel_l2(cm(input_ids=ids).last_hidden_state, want))
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            results[i] = e
    server = threading.Thread(target=serve_eager)
    server.start()
    started.wait()
    threads = [threading.Thread(target=compile_one, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    server.join()
    assert not failures, failures[:3]
    assert calls and max(calls) < 1e-6
    for i in range(2):
        assert not isinstance(results[i], Exception), results[i]
        dims, err = results[i]
        assert dims == ["batch", "seq"] and err < 1e-5, results[i]
