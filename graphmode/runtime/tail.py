"""Running the data-dependent tail (graphmode/capture/tail.py) after the plan.

The tail is eager ATen calls on the plan's outputs, sliced back to the request's real sizes,
and on the request's own inputs; its outputs are the model's. Each data-dependent length
(`data_u0`, ...) is bound from the first tensor made with it as an axis, and must agree
wherever else it is an axis (torch.export assumed so when it traced the model).
"""
from __future__ import annotations

from typing import Mapping, Sequence

import sympy
import torch

from graphmode.errors import IRError
from graphmode.ir.graph import Graph
from graphmode.ir.interpreter import run_node
from graphmode.ir.types import DTYPES


def run_tail(tail: Graph, reads: Sequence[torch.Tensor], inputs: Mapping[str, torch.Tensor],
             dims: Mapping[str, int]) -> list[torch.Tensor]:
    """The model's outputs: `reads` are the plan's outputs (tail.inputs' first ones, in order)."""
    vals: dict[str, torch.Tensor] = dict(tail.constants)
    vals.update(zip(tail.inputs, reads))
    for name in tail.inputs[len(reads):]:
        vals[name] = inputs[name]
    env = dict(dims)
    with torch.no_grad():       # not inference mode: the caller may update the outputs in place
        for idx, n in enumerate(tail.nodes):
            try:
                outs = run_node(n, [vals[i] for i in n.inputs], env)
            except IRError:
                raise
            except Exception as e:  # noqa: BLE001 - re-raised naming the op and the model's line
                what = f"{n.attrs.get('target')} at {n.attrs.get('loc')}" if n.op == "fallback" else \
                    f"{n.op} -> %{n.outputs[0]}"
                raise IRError(f"{type(e).__name__}: {e}", where=f"data-dependent tail, node #{idx} {what}") from e
            for o, t in zip(n.outputs, outs):
                ty = tail.values[o].type
                want = DTYPES[ty.dtype]
                vals[o] = t if t.dtype == want else t.to(want)
                _bind(env, ty.shape, t.shape, n)
    return [vals[o] for o in tail.outputs]


def model_outputs(cm, flat: Sequence[torch.Tensor], inputs: Mapping[str, torch.Tensor],
                  dims: Mapping[str, int]) -> list[torch.Tensor]:
    """The model's outputs from its plan's (in `graph.outputs` order): the new values of inputs it
    updates in place left off, and its tail run, where it has one."""
    user = list(flat[:len(flat) - len(cm.mutated_inputs)])
    return user if cm.tail is None else run_tail(cm.tail, user, inputs, dims)


def _bind(env: dict[str, int], declared: Sequence, actual: Sequence[int], n) -> None:
    for d, size in zip(declared, actual):
        if isinstance(d, int) and d != size:     # (TopK of a constant K past what a mask kept)
            raise IRError(f"{n.attrs.get('target', n.op)} at {n.attrs.get('loc')} made an axis of {size} where the "
                          f"model asks for {d}", where="data-dependent tail",
                          fix="keep the request's data within what the model expects (e.g. enough selected "
                              "elements for a TopK's K), or run the model with exe_mode: eager")
        if isinstance(d, sympy.Symbol):
            have = env.setdefault(d.name, int(size))
            if have != size:
                raise IRError(f"{n.attrs.get('target')} at {n.attrs.get('loc')} made an axis of {size} where "
                              f"{d.name} is {have}: the model's data-dependent sizes differ from what torch.export "
                              "traced", where="data-dependent tail",
                              fix="run the model with exe_mode: eager")


MEMBERS = ("tail.ir", "tail.pt")     # a .gm's tail: its IR text and its constants


def tail_members(tail: Graph) -> dict[str, bytes]:
    """The members a `.gm` holds for `tail` (runtime/artifact.py writes and checks them)."""
    import io
    buf = io.BytesIO()
    torch.save({k: v.contiguous() for k, v in tail.constants.items()}, buf)
    return {"tail.ir": tail.text().encode(), "tail.pt": buf.getvalue()}


def read_tail(text: bytes, constants: bytes, op_modules: list[str] | None = None) -> Graph:
    """The tail a `.gm` holds (its members already checked against the manifest's hashes): eager
    ATen calls, and core ops (an ONNX tail's), run by their reference."""
    import io
    from graphmode.ir.fallback import import_op_modules
    from graphmode.ir.parser import parse_graph
    consts = torch.load(io.BytesIO(constants), weights_only=True)
    if not isinstance(consts, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                               for k, v in consts.items()):
        raise IRError("tail.pt is not a mapping of names to tensors", fix="save the artifact again")
    tail = parse_graph(text.decode(), consts)
    import_op_modules(op_modules or [], [n.attrs["target"] for n in tail.nodes if n.op == "fallback"])
    return tail
