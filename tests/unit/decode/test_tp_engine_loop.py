"""Rank 0's decode loop (decode/tp_engine.py `engine_loop`) over a pipe, with a stand-in engine:
a refusal raised before any rank ran the step ends the live sequences and the loop keeps
serving (the other ranks wait at the next broadcast); one raised inside a broadcast step (the
other ranks may wait in its collectives) still ends the loop. A request-level error used to end
it always, and with it a tensor-parallel server until restarted (the trial's recompute past the
largest seq bucket)."""
from __future__ import annotations

import multiprocessing as mp
import threading
from types import SimpleNamespace

import pytest
import torch

from graphmode.decode.tp_engine import engine_loop
from graphmode.errors import ContractViolation


class Engine:
    """What engine_loop reads of a DecodeEngine; `fail` is raised by the next step."""

    def __init__(self):
        self.layout = SimpleNamespace(max_tokens=16, sequence_tokens=16, pages=8, page_size=4, max_pages_per_seq=4)
        self.batch_buckets, self.cfg, self.max_prompt, self.min_prompt = [1, 2], {"eos": None, "vocab": 100}, 8, 2
        self.cache = SimpleNamespace(bytes=0, used_pages=0)
        self.lowered, self.stats, self.running, self.waiting = None, {"decode_steps": 0}, [], []
        self.runner = SimpleNamespace(running=False, stop=lambda: None)
        self.fail, self.cancelled, self.ids = None, [], iter(range(100))
        self.context, self.on_logits = None, None

    def add(self, prompt, params, on_token=None):
        return SimpleNamespace(id=next(self.ids), done=False, params=params, logprobs=[])

    def cancel(self, s):
        self.cancelled.append(s.id)

    def step(self):
        if self.fail is not None:
            err, self.fail = self.fail, None
            raise err
        if self.on_logits is not None:          # one sequence's row, as sampling hands it to the hook
            self.on_logits(SimpleNamespace(id=0), torch.arange(3.0))
        return []


def run_loop(eng):
    parent, child = mp.Pipe()
    rd = SimpleNamespace(engine=eng, _counters=lambda: (), _meta=lambda before, **kw: kw, keepalive=lambda: None)
    raised = []

    def target():
        try:
            engine_loop(rd, child, keepalive_s=60)
        except BaseException as e:  # noqa: BLE001 - what the rank would report
            raised.append(e)
    t = threading.Thread(target=target, daemon=True)
    t.start()
    assert parent.poll(60), raised          # the loop's first message, or why it never came
    assert parent.recv()[0] == "ready"
    return parent, t, raised


def test_logit_rows_come_back_with_a_step_only_while_the_caller_asks_for_them():
    """verify's decode check on the ranks (decode/check.py): rank 0 sends each step's rows."""
    eng = Engine()
    conn, thread, raised = run_loop(eng)
    conn.send(("logits", True))
    conn.send(("step",))
    rows = conn.recv()[4]
    assert [sid for sid, _ in rows] == [0] and torch.equal(rows[0][1], torch.arange(3.0))
    conn.send(("logits", False))
    conn.send(("step",))
    assert conn.recv()[4] == [] and eng.on_logits is None
    conn.send(("end",))
    thread.join(10)
    assert not thread.is_alive() and not raised


def test_a_refusal_before_the_broadcast_ends_the_live_sequences_and_the_loop_serves_on():
    eng = Engine()
    conn, thread, raised = run_loop(eng)
    conn.send(("add", [5, 6, 7], None))
    assert conn.recv() == ("added", 0)
    eng.fail = ContractViolation("seq 17 is above the largest bucket 16", where="dims.seq")
    conn.send(("step",))
    kind, err, ended = conn.recv()
    assert kind == "step-failed" and isinstance(err, ContractViolation) and ended == [0] and eng.cancelled == [0]
    conn.send(("step",))
    assert conn.recv()[0] == "stepped"            # the loop is still up
    conn.send(("end",))
    assert conn.recv()[0] == "ok"
    thread.join(10)
    assert not thread.is_alive() and not raised


def test_a_refusal_inside_a_broadcast_step_still_ends_the_loop():
    eng = Engine()
    conn, thread, raised = run_loop(eng)
    eng.runner.running = True
    eng.fail = ContractViolation("the model was updated in place", where="weights")
    conn.send(("step",))
    thread.join(10)
    assert not thread.is_alive() and isinstance(raised[0], ContractViolation)


def test_the_caller_ends_its_mirrors_of_the_failed_sequences_and_the_engine_stays_open():
    from graphmode.decode.sampling import SamplingParams
    from graphmode.decode.tp_engine import RemoteEngine
    replies = [("added", 3), ("step-failed", ContractViolation("seq 17 is above", where="dims.seq"), [3]),
               ("stepped", [], [], {"stats": {}, "running": [], "waiting": [], "used_pages": 0}, [])]
    tp = SimpleNamespace(timeout_s=5.0, _down=None, send=lambda msgs: None,
                         receive=lambda r, timeout_s, what: replies.pop(0))
    info = {"cfg": {"eos": None, "vocab": 100}, "max_prompt": 8, "min_prompt": 2, "context": None,
            "layout": {"max_tokens": 16, "pages": 8, "page_size": 4, "max_pages_per_seq": 4, "batch_buckets": [1]},
            "kv_pool_bytes": 0, "facts": None, "proof": None,
            "view": {"stats": {}, "running": [], "waiting": [], "used_pages": 0}}
    eng = RemoteEngine(tp, info)
    s = eng.add([5, 6, 7], SamplingParams(max_new_tokens=2))
    with pytest.raises(ContractViolation, match="seq 17"):
        eng.step()
    assert s.finish_reason == "error" and not eng.has_work
    assert eng.step() == []                       # the group still answers
