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
    the recipe's dims) and the third drafted fixed shapes, refusing seq 9 later."""
    results: dict[int, object] = {}
    models = [_bert(i) for i in range(2)]     # (transformers' lazy first import is not for threads)

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
    threads = [threading.Thread(target=compile_one, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(2):
        assert not isinstance(results[i], Exception), results[i]
        dims, err = results[i]
        assert dims == ["batch", "seq"] and err < 1e-5, results[i]
