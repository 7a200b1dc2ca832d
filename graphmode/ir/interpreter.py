"""Reference interpreter: runs any IR graph op by op with eager torch. The ground truth
every pass and backend is tested against."""
from __future__ import annotations

from typing import Callable, Mapping

import torch

from graphmode.errors import ContractViolation, IRError
from graphmode.ir.graph import Graph, Node
from graphmode.ir.ops import get_op
from graphmode.ir.types import DTYPES, eval_dim


def bind_dims(g: Graph, inputs: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """Dim values implied by the input shapes; inconsistent sizes are a ContractViolation."""
    env: dict[str, int] = {}
    for name in g.inputs:
        if name not in inputs:
            raise ContractViolation(f"missing input {name!r}", where=f"inputs.{name}",
                                    fix=f"pass every input: {', '.join(g.inputs)}")
        t = inputs[name]
        ty = g.values[name].type
        if t.dim() != ty.rank:
            raise ContractViolation(f"input {name!r} has rank {t.dim()}, expected {ty.rank} ({ty.text()})",
                                    where=f"inputs.{name}", value=tuple(t.shape))
        for axis, (d, size) in enumerate(zip(ty.shape, t.shape)):
            if isinstance(d, int):
                if d != size:
                    raise ContractViolation(f"input {name!r} dim {axis} must be {d}", where=f"inputs.{name}",
                                            value=tuple(t.shape))
            elif d.is_Symbol:
                prev = env.setdefault(d.name, int(size))
                if prev != size:
                    raise ContractViolation(f"dim {d.name!r} is {prev} elsewhere but {size} in input {name!r}",
                                            where=f"inputs.{name}", value=tuple(t.shape))
    for name in g.inputs:  # derived dims (e.g. seq*2) must agree with the bound symbols
        ty = g.values[name].type
        for d, size in zip(ty.shape, inputs[name].shape):
            if not isinstance(d, int) and not d.is_Symbol and eval_dim(d, env) != size:
                raise ContractViolation(f"input {name!r} size {size} != {d}", where=f"inputs.{name}")
    return env


def run_node(n: Node, args: list[torch.Tensor], env: Mapping[str, int]) -> list[torch.Tensor]:
    if n.op == "fused":
        vals = dict(zip(n.body.inputs, args))
        for m in n.body.nodes:
            outs = run_node(m, [vals[i] for i in m.inputs], env)
            vals.update(zip(m.outputs, outs))
        return [vals[o] for o in n.outputs]
    return get_op(n.op).ref(args, n.attrs, env)


def interpret(g: Graph, inputs: Mapping[str, torch.Tensor], *,
              hook: Callable[[Node, list[torch.Tensor]], None] | None = None,
              keep_all: bool = False) -> dict[str, torch.Tensor]:
    """Run `g` on named inputs; returns the outputs (or every value with keep_all)."""
    env = bind_dims(g, inputs)
    vals: dict[str, torch.Tensor] = dict(g.constants)
    for name in g.inputs:
        vals[name] = inputs[name]
    with torch.inference_mode():
        for idx, n in enumerate(g.nodes):
            try:
                outs = run_node(n, [vals[i] for i in n.inputs], env)
            except IRError:
                raise
            except Exception as e:  # noqa: BLE001 - re-raised with the node named
                raise IRError(f"{type(e).__name__}: {e}", where=f"node #{idx} {n.op} -> %{n.outputs[0]}") from e
            for o, t in zip(n.outputs, outs):
                want = DTYPES[g.values[o].type.dtype]
                vals[o] = t if t.dtype == want else t.to(want)
            if hook is not None:
                hook(n, outs)
    if keep_all:
        return vals
    return {o: vals[o] for o in g.outputs}
