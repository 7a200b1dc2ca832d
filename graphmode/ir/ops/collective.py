"""Collectives: what a tensor-parallel rank exchanges with the others of its group.

`world` is the group's size and `comm_dtype` what crosses the link (the recipe's
`parallel.comm.dtype`): f32 as is; bf16 rounded to bfloat16 on the wire; int8 packed, each row
(last axis) as int8 with one f32 absmax scale. A narrow all_reduce gathers every rank's packed
operand and sums the unpacked parts in rank order, in f32, so every rank gets the same bits.
The reference semantics call the communicator bound to the running rank
(`graphmode.ir.communicator.active()`, bound by graphmode/parallel/comm.py): torch.distributed in a rank process, a thread group in
the interpreter's multi-rank runs. With `world: 1` each op is the identity.
Costs (bytes on the wire, ring time on a link) are in `graphmode/recipe/parallel_cost.py`.
"""
from __future__ import annotations

import sympy
import torch

from graphmode.errors import IRError
from graphmode.ir.communicator import active
from graphmode.ir.ops.spec import OpSpec, Sample, norm_axis, randn, register
from graphmode.ir.types import TensorType, normalize_dim

COMM_DTYPES = ("f32", "bf16", "int8")


def _comm(name: str, attrs) -> object | None:
    world = int(attrs.get("world", 1))
    if world == 1:
        return None
    comm = active()
    if comm is None:
        raise IRError(f"{name} over {world} ranks, but no communicator is bound to this thread",
                      fix="run a sharded graph under graphmode.parallel (rank processes, or "
                          "graphmode.parallel.comm.run_ranks for thread ranks)")
    if comm.world != world:
        raise IRError(f"{name} expects a group of {world} ranks, the bound communicator has {comm.world}",
                      fix="shard the graph for the group it runs in (parallel.tensor)")
    return comm


def _pack(t: torch.Tensor, dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    if dtype == "bf16":
        return t.to(torch.bfloat16), None
    if dtype == "int8":
        x = t.float()
        scale = (x.abs().amax(-1, keepdim=True) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        return torch.round(x / scale).clamp(-127, 127).to(torch.int8), scale
    return t, None


def _unpack(q: torch.Tensor, scale: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return (q.float() * scale if scale is not None else q.float()).to(like.dtype)


def _check_dtype(attrs) -> str:
    dt = attrs.get("comm_dtype", "f32")
    if dt not in COMM_DTYPES:
        raise IRError(f"comm_dtype {dt!r} is not a wire dtype", fix=f"one of {', '.join(COMM_DTYPES)}")
    return dt


def _same_infer(ins, attrs):
    _check_dtype(attrs)
    if int(attrs.get("world", 1)) < 1:
        raise IRError(f"world must be >= 1, got {attrs.get('world')}")
    if not ins[0].dtype.startswith("f") and attrs.get("comm_dtype", "f32") != "f32":
        raise IRError(f"a narrow comm_dtype needs a float operand, got {ins[0].text()}")
    return [ins[0]]


def _all_reduce_ref(ins, attrs, env):
    x = ins[0]
    comm = _comm("all_reduce", attrs)
    if comm is None:
        return [x.clone()]
    dt = _check_dtype(attrs)
    if dt == "f32":
        return [comm.all_reduce(x)]
    q, scale = _pack(x, dt)
    qs = comm.all_gather(q.unsqueeze(0), 0)
    ss = comm.all_gather(scale.unsqueeze(0), 0) if scale is not None else [None] * comm.world
    out = torch.zeros(x.shape, dtype=torch.float32)
    for r in range(comm.world):                  # rank order: the same sum on every rank
        out = out + (qs[r].float() * ss[r] if scale is not None else qs[r].float())
    return [out.to(x.dtype)]


def _gather_infer(ins, attrs):
    _same_infer(ins, attrs)
    x = ins[0]
    ax = norm_axis(attrs["axis"], x.rank)
    d = x.shape[ax]
    return [x.with_shape(x.shape[:ax] + (normalize_dim(d * int(attrs.get("world", 1))),) + x.shape[ax + 1:])]


def _all_gather_ref(ins, attrs, env):
    x = ins[0]
    comm = _comm("all_gather", attrs)
    if comm is None:
        return [x.clone()]
    ax = norm_axis(attrs["axis"], x.dim())
    q, scale = _pack(x, _check_dtype(attrs))
    out = comm.all_gather(q, ax)
    if scale is None and q.dtype == x.dtype:
        return [out]
    scales = comm.all_gather(scale, ax) if scale is not None else None
    if scales is not None and ax == x.dim() - 1:     # one scale per rank's row part: spread over its columns
        scales = scales.repeat_interleave(x.shape[-1], dim=-1)
    return [_unpack(out, scales, x)]


def _scatter_infer(ins, attrs):
    _same_infer(ins, attrs)
    x = ins[0]
    ax = norm_axis(attrs["axis"], x.rank)
    n, d = int(attrs.get("world", 1)), x.shape[ax]
    if isinstance(d, int) and d % n:
        raise IRError(f"reduce_scatter: axis {ax} of {x.text()} does not split over {n} ranks")
    part = d // n if isinstance(d, int) else normalize_dim(sympy.sympify(d) / n)
    return [x.with_shape(x.shape[:ax] + (part,) + x.shape[ax + 1:])]


def _reduce_scatter_ref(ins, attrs, env):
    x = ins[0]
    comm = _comm("reduce_scatter", attrs)
    if comm is None:
        return [x.clone()]
    ax = norm_axis(attrs["axis"], x.dim())
    total = _all_reduce_ref([x], attrs, env)[0]
    return [total.chunk(comm.world, ax)[comm.rank].contiguous()]


_DOC_TAIL = "; world ranks, comm_dtype f32 | bf16 | int8 on the wire (module doc)"
register(OpSpec("all_reduce", "collective", (1, 1), _same_infer, _all_reduce_ref, attrs=("world", "comm_dtype"),
                traits=frozenset({"collective"}), doc="sum of the operand over every rank of the group" + _DOC_TAIL,
                samples=lambda: [Sample(randn((2, 3, 8)), {"world": 1, "comm_dtype": "f32"})], padding="opaque"))
register(OpSpec("all_gather", "collective", (1, 1), _gather_infer, _all_gather_ref,
                attrs=("axis", "world", "comm_dtype"), traits=frozenset({"collective"}),
                doc="the ranks' operands concatenated along axis in rank order" + _DOC_TAIL,
                samples=lambda: [Sample(randn((2, 3, 8)), {"axis": 2, "world": 1, "comm_dtype": "f32"})],
                padding="opaque"))
register(OpSpec("reduce_scatter", "collective", (1, 1), _scatter_infer, _reduce_scatter_ref,
                attrs=("axis", "world", "comm_dtype"), traits=frozenset({"collective"}),
                doc="the sum over ranks, split along axis: rank r keeps part r" + _DOC_TAIL,
                samples=lambda: [Sample(randn((2, 4, 8)), {"axis": 1, "world": 1, "comm_dtype": "f32"})],
                padding="opaque"))
