"""Rank 0 serving in its own process (graphmode/parallel/torchrun.py `TorchrunGroup`), without
torchrun: two spawned processes join a gloo group on loopback as torchrun's ranks would and call
`run_rank` (rank 1 follows, rank 0 hands its group to a `serve` callback, here a few calls in
place of the HTTP server). Rank 0's answers equal one process's (TP=1); a request outside the
contract is refused with the group kept up; a message for rank 0 alone (sample inputs) crosses
nothing; closing the group ends rank 1's loop, so both processes exit 0.

The HTTP server and decoding under real torchrun: tests/e2e/test_torchrun_serve.py (slow)."""
from __future__ import annotations

import multiprocessing as mp
import queue
import socket
import sys
import time
from pathlib import Path

import pytest
import torch

import graphmode
from graphmode.verify.numerics import rel_l2

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import tiny_tp  # noqa: E402

SPEC = f"{HERE / 'tiny_tp.py'}:mlp"
WAIT_S = 300           # two shard compiles on a slow, loaded 2-core host; a rank's death ends it sooner


def _serve(results: "mp.Queue"):
    def serve(group) -> None:
        from graphmode.errors import ContractViolation
        g = torch.Generator().manual_seed(5)
        xs = [torch.randn(2, 16, generator=g), torch.randn(1, 16, generator=g)]
        outs = [group(input=x) for x in xs]
        try:
            group(input=torch.randn(2, 15))
            refused = None
        except ContractViolation as e:
            refused = e.where
        sample = group.sample_inputs({"batch": 2})
        outs.append(group(input=xs[1]))            # after the refusal
        plain = [(o[0] if isinstance(o, (tuple, list)) else o).tolist() for o in outs]   # no tensor crosses the queue
        results.put({"xs": [x.tolist() for x in xs], "outs": plain, "refused": refused, "down": group.down(),
                     "states": group.rank_states(), "sample": {k: list(v.shape) for k, v in sample.items()}})
    return serve


def _rank(rank: int, port: int, cache: str, results: "mp.Queue") -> None:
    from graphmode.compiler import rank_driver
    from graphmode.parallel.torchrun import run_rank
    from graphmode.recipe import load_recipe
    recipe = load_recipe(tiny_tp.recipe("mlp-tp2", inputs=tiny_tp.MLP_INPUTS, dims=tiny_tp.MLP_DIMS))
    run_rank(SPEC, recipe, "host", rank=rank, world=2, master_addr="127.0.0.1", master_port=port,
             driver=rank_driver(), serve=_serve(results) if rank == 0 else None, cache_dir=cache, threads=1)
    results.put({"exit": rank})


@pytest.mark.slow     # ~28 s: two ranks compiled and served; the spawned group serves in test_tensor_parallel.py
def test_rank_0_serves_its_group_from_its_own_process(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, str(tmp_path / "cache"), results), daemon=True)
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        got, exits, deadline = None, set(), time.monotonic() + WAIT_S
        while got is None or len(exits) < 2:
            try:
                msg = results.get(timeout=1)
            except queue.Empty:
                failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if failed or time.monotonic() > deadline:     # a dead rank ends the wait at once
                    raise AssertionError(f"no word from the ranks (exit codes {[p.exitcode for p in procs]}); "
                                         "their tracebacks are in the captured stderr") from None
                continue
            if "exit" in msg:
                exits.add(msg["exit"])
            else:
                got = msg
        for p in procs:
            p.join(WAIT_S)
        assert [p.exitcode for p in procs] == [0, 0]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    one = graphmode.compile(SPEC, tiny_tp.recipe("mlp-tp1", 1, inputs=tiny_tp.MLP_INPUTS, dims=tiny_tp.MLP_DIMS),
                            cache_dir=tmp_path / "cache")
    for x, out in zip(got["xs"] + got["xs"][1:], got["outs"]):
        want = one(input=torch.tensor(x))
        want = want[0] if isinstance(want, (tuple, list)) else want
        out = torch.tensor(out)
        assert out.shape == want.shape and rel_l2(out, want) < 1e-5
    assert got["refused"] == "inputs.input.shape[1]"
    assert got["down"] is None and [s["rank"] for s in got["states"]] == [0, 1] and all(
        s["alive"] for s in got["states"]), got["states"]
    assert got["sample"] == {"input": [2, 16]}
