"""The server's side of a tensor-parallel group that lost a rank, with real rank processes and
pipes but no engines (the ranks here only sleep): the decode loop's health names the dead rank
and stops the group (the other rank is killed, no orphan), and a request is answered 503 naming
the rank, at once. (The whole path with real ranks and an HTTP server:
tests/e2e/test_serve_tensor_parallel.py, slow.)"""
from __future__ import annotations

import asyncio
import multiprocessing as mp
import time

import pytest

from graphmode.decode.sampling import SamplingParams
from graphmode.decode.tp_engine import RemoteEngine
from graphmode.parallel.launch import TensorParallelModel
from graphmode.recipe import load_recipe
from graphmode.serve.errors import NotReady
from graphmode.serve.generation import DecodeLoop

RECIPE = {"version": 1, "name": "tp",
          "inputs": [{"name": "input_ids", "dtype": "i64", "shape": ["batch", "seq"]}],
          "dims": {"batch": {"buckets": [1, 2]}, "seq": {"buckets": [8], "min": 2}},
          "memory": {"kv_cache": {"page_size": 4, "max_pages_per_seq": 4, "layers": 2, "kv_heads": 4, "head_dim": 8}},
          "parallel": {"tensor": 2, "device_group": ["rank0", "rank1"],
                       "links": {"loopback": {"bandwidth_gbps": 10, "latency_us": 20}}, "comm": {"timeout_s": 5}}}
# what rank 0's engine reports at start (decode/tp_engine.py:start_info), for a pool of 8 pages
INFO = {"cfg": {"eos": None, "vocab": 100}, "max_prompt": 8, "min_prompt": 2, "context": None,
        "layout": {"max_tokens": 16, "pages": 8, "page_size": 4, "max_pages_per_seq": 4, "batch_buckets": [1, 2]},
        "kv_pool_bytes": 0, "facts": None, "proof": None,
        "view": {"stats": {"decode_steps": 0}, "running": [], "waiting": [], "used_pages": 0}}


@pytest.fixture
def group():
    ctx = mp.get_context("spawn")
    procs, conns, ends = [], [], []
    for _ in range(2):
        parent, child = ctx.Pipe()
        ends.append(child)             # held open here: a closed pipe would be a failure of its own
        p = ctx.Process(target=time.sleep, args=(300,), daemon=True)
        p.start()
        procs.append(p)
        conns.append(parent)
    tp = TensorParallelModel(None, load_recipe(RECIPE), procs, conns, resolve_model=lambda m, r: None)
    yield tp, procs
    tp.close()
    for c in ends:
        c.close()


def test_a_dead_rank_fails_health_stops_the_group_and_requests_get_503(group):
    tp, procs = group
    loop = DecodeLoop(RemoteEngine(tp, INFO))
    assert loop.health() is None and [r["alive"] for r in loop.engine.ranks()] == [True, True]
    assert loop.describe()["ranks"][1]["pid"] == procs[1].pid
    procs[1].kill()
    procs[1].join(30)
    why = loop.health()
    assert why == f"rank 1 (pid {procs[1].pid}) was killed by signal 9", why
    procs[0].join(30)
    assert not procs[0].is_alive()                       # the group is stopped: no rank left behind
    ev = asyncio.new_event_loop()
    try:
        with pytest.raises(NotReady, match="tensor-parallel ranks are down: .*rank 1") as e:
            loop.submit([[5, 6, 7]], SamplingParams(max_new_tokens=2), time.perf_counter(), asyncio.Queue(), ev)
    finally:
        ev.close()
    assert e.value.status == 503 and e.value.where == "parallel"
    loop.stop()                                          # shutting the engine down again is harmless
