"""The graph: immutable nodes over named, typed values, plus constant data.

`Node` is frozen; a pass builds a new node list (or a new Graph via `clone`). Facts a pass
computes (liveness, offsets...) live in side maps, not on nodes.
"""
from __future__ import annotations

import hashlib
import os
import re
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

import torch

from graphmode.errors import IRError
from graphmode.ir.types import TensorType, Value

_NAME_RE = re.compile(r"[^A-Za-z0-9_.]")


def clean_name(name: str) -> str:
    """A value name that prints and parses: letters, digits, '_' and '.'."""
    n = _NAME_RE.sub("_", name)
    return n if n and not n[0].isdigit() else f"v{n}"


def declared_name(name: str, declared) -> str | None:
    """Which of `declared` (names as the IR spells them: a recipe's inputs) `name` is: itself, or
    an ONNX model's own spelling of one ("x:0" for "x_0"); None when neither."""
    if name in declared:
        return name
    return clean_name(name) if clean_name(name) in declared else None


@dataclass(frozen=True, eq=True)
class Node:
    op: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: Mapping[str, Any] = field(default_factory=dict)
    body: "Graph | None" = None   # fused nodes: the region they replace

    __hash__ = object.__hash__

    def attr(self, key: str, default: Any = None) -> Any:
        return self.attrs.get(key, default)

    def with_(self, **changes) -> "Node":
        d = {"op": self.op, "inputs": self.inputs, "outputs": self.outputs,
             "attrs": self.attrs, "body": self.body}
        d.update(changes)
        d["inputs"] = tuple(d["inputs"])
        d["outputs"] = tuple(d["outputs"])
        return Node(**d)


@dataclass
class Graph:
    """A model (or a fused region). `values` holds every value's type and role."""

    name: str
    values: dict[str, Value] = field(default_factory=dict)
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)
    constants: dict[str, torch.Tensor] = field(default_factory=dict)
    dims: dict[str, tuple[int, int]] = field(default_factory=dict)  # dim -> (min, max)

    # ---- construction -------------------------------------------------------------
    def add_value(self, name: str, type: TensorType, role: str = "intermediate") -> str:
        if name in self.values:
            raise IRError(f"value %{name} defined twice", where=f"graph @{self.name}",
                          fix="give every value a unique name (use Graph.fresh_name)")
        self.values[name] = Value(name, type, role)
        return name

    def add_input(self, name: str, type: TensorType) -> str:
        self.add_value(name, type, "input")
        self.inputs.append(name)
        return name

    def add_constant(self, name: str, tensor: torch.Tensor, role: str = "param") -> str:
        self.add_value(name, TensorType.of(tensor), role)
        self.constants[name] = tensor
        return name

    def fresh_name(self, hint: str = "v") -> str:
        base = clean_name(hint)
        if base not in self.values:
            return base
        i = 1
        while f"{base}_{i}" in self.values:
            i += 1
        return f"{base}_{i}"

    def add_node(self, op: str, inputs, out_types: list[TensorType], attrs=None, *,
                 names: list[str] | None = None, body: "Graph | None" = None) -> list[str]:
        names = names or [self.fresh_name(op) for _ in out_types]
        outs = [self.add_value(self.fresh_name(n) if n in self.values else n, t) for n, t in zip(names, out_types)]
        self.nodes.append(Node(op, tuple(inputs), tuple(outs), dict(attrs or {}), body))
        return outs

    # ---- queries --------------------------------------------------------------------
    def type_of(self, name: str) -> TensorType:
        try:
            return self.values[name].type
        except KeyError:
            raise IRError(f"unknown value %{name}", where=f"graph @{self.name}") from None

    def producers(self) -> dict[str, Node]:
        return {o: n for n in self.nodes for o in n.outputs}

    def users(self) -> dict[str, list[Node]]:
        out: dict[str, list[Node]] = {v: [] for v in self.values}
        for n in self.nodes:
            for i in n.inputs:
                out.setdefault(i, []).append(n)
        return out

    def is_constant(self, name: str) -> bool:
        return name in self.constants

    def iter_nodes(self, recursive: bool = False) -> Iterator[Node]:
        for n in self.nodes:
            yield n
            if recursive and n.body is not None:
                yield from n.body.iter_nodes(True)

    def op_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for n in self.nodes:
            counts[n.op] = counts.get(n.op, 0) + 1
        return dict(sorted(counts.items()))

    # ---- copies, hashing, equality ------------------------------------------------------
    def clone(self, *, nodes: list[Node] | None = None) -> "Graph":
        return Graph(self.name, dict(self.values), list(self.inputs), list(self.outputs),
                     list(self.nodes if nodes is None else nodes), dict(self.constants), dict(self.dims))

    def prune_values(self) -> "Graph":
        """Drop values (and constants) that no node, input or output mentions."""
        used = set(self.inputs) | set(self.outputs)
        for n in self.nodes:
            used.update(n.inputs)
            used.update(n.outputs)
        self.values = {k: v for k, v in self.values.items() if k in used}
        self.constants = {k: v for k, v in self.constants.items() if k in used}
        return self

    def text(self) -> str:
        from graphmode.ir.printer import print_graph
        return print_graph(self)

    def __str__(self) -> str:
        return self.text()

    def structural_hash(self, *, named: bool = False) -> str:
        """sha256 over the printed IR and every constant's bytes: stable across runs. A `state`
        value (a KV pool) is mutable run-time data: its type is in the text, its bytes are not.
        The graph's name is a label, left out unless `named` (artifacts saved before 2026-12-07
        hashed it): the CLI names a model after its builder, Python after its class, and the
        same model must find the same cache entries either way."""
        text = self.text()
        if not named:
            text = "graph @" + text[len(f"graph @{self.name}"):]
        h = hashlib.sha256(text.encode())
        for name in sorted(self.constants):
            h.update(name.encode())
            if self.values[name].role != "state":
                h.update(constant_digest(self.constants[name]).encode())
        return h.hexdigest()[:16]

    def equals(self, other: "Graph") -> bool:
        if self.text() != other.text() or set(self.constants) != set(other.constants):
            return False
        return all(torch.equal(self.constants[k], other.constants[k]) for k in self.constants)


_DIGESTS: dict[tuple, tuple] = {}   # key -> (weakref to the tensor, digest)


def _digest_key(t: torch.Tensor) -> tuple:
    return (id(t), t._version, t.data_ptr(), tuple(t.shape), str(t.dtype))


def _known_digest(t: torch.Tensor) -> str | None:
    if t.is_inference():      # no version counter: an in-place change could not be told from the cached digest
        return None
    hit = _DIGESTS.get(_digest_key(t))
    # the entry must belong to this very tensor: a freed tensor's id and address are reused
    # by new tensors, whose contents (and digest) differ
    return hit[1] if hit is not None and hit[0]() is t else None


def constant_digest(t: torch.Tensor) -> str:
    d = _known_digest(t)
    if d is None:
        data = t.detach().contiguous().cpu()
        if data.dtype == torch.bfloat16:
            data = data.view(torch.int16)
        h = hashlib.sha256(str((str(data.dtype), tuple(data.shape))).encode())
        h.update(data.reshape(-1).numpy())     # the buffer itself: no copy of a GPT-2's 500 MB
        d = h.hexdigest()[:16]
        if len(_DIGESTS) > 100_000:
            _DIGESTS.clear()
        if not t.is_inference():
            _DIGESTS[_digest_key(t)] = (weakref.ref(t), d)
    return d


def constant_digests(tensors) -> None:
    """Digest the large constants not digested yet on every core at once (sha256 lets go of the
    GIL): hashing a model's weights is most of a warm bucket build."""
    todo = [t for t in tensors if t.numel() >= _PARALLEL_NUMEL and _known_digest(t) is None]
    workers = min(len(todo), os.cpu_count() or 1)
    if workers <= 1:
        for t in todo:
            constant_digest(t)
        return
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(constant_digest, sorted(todo, key=lambda t: -t.numel())))


_PARALLEL_NUMEL = 1 << 16      # below this a digest is quicker than handing it to a thread
