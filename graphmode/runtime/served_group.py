"""A tensor-parallel group (graphmode/parallel/launch.py) on the server's request path, as a
CompiledModel is there: a request is bound and checked in this process (runtime/contract.py,
with rank 0's bounds: the whole model's tables, which no shard holds) before it is queued or
batched, and only a request the contract admits crosses the pipes to the ranks. Every rank
built every bucket's plan when it started, so nothing is built or warmed here."""
from __future__ import annotations

import threading
from typing import Any, Mapping

from graphmode.capture.source import constant_inputs
from graphmode.plan.memory import bucket_key
from graphmode.runtime.contract import InputContract


class ServedGroup(InputContract):
    """`group` (a TensorParallelModel of an encoder recipe) answering the server's calls one at
    a time: its pipes carry one request and its replies."""

    mode = "graph"
    graph = None                # each rank holds its own shard
    captured_graph = None
    verdict = None
    pending = False             # no graph lowered on first use (a decoder's whole-sequence graph)
    lowered = None              # each rank lowered and proved its shard; the server proves the recipe
    proof = None                # here once more, without the graph's facts, for the resolved recipe

    def __init__(self, group: Any):
        self.group = group
        self.recipe = group.recipe
        self.input_names = [i.name for i in self.recipe.inputs]
        self._constants = constant_inputs(self.recipe)
        self._signature = None                  # requests come by input name
        self._bounds = group.input_bounds or ([], [])
        self.facts = getattr(group, "facts", None)     # rank 0's shard's facts: the server's proof uses them
        self._lock = threading.Lock()
        self.monitor: Any = None

    @property
    def source(self) -> Any:
        return self.group.source

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return self.group(*args, **kwargs)

    bucket_key = staticmethod(bucket_key)

    def is_built(self, env: Mapping[str, int]) -> bool:
        return True

    def ranks(self) -> list[dict[str, Any]]:
        return self.group.rank_states()

    def health(self) -> str | None:
        return self.group.down()

    def close(self) -> None:
        self.group.close()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.group, name)        # NotOnRanks names what a group does not offer
