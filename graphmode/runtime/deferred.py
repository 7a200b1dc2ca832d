"""A CompiledModel whose graph is lowered on first use.

A decoder recipe (memory.kv_cache) compiles to two graphs: the paged decode graph that
`generate`, `stream` and the server's completions run (graphmode/decode/engine.py), and the
recipe's whole-sequence graph (input_ids and attention_mask -> logits at every position) that
only a forward call needs: `cm(...)`, the server's /v1/infer and KServe. Lowering the second
(torch.export, the passes, a proof) when nothing asks for it doubled a decoder's start, so
`compiler.compile` gives a decoder recipe this model: it is lowered once, under a lock, the
first time anything reads what the lowering makes (the graph, the verdict, the proof, the
capture report, the output structure). A lowering that refuses the recipe (a typed
GraphmodeError: the verdict, a capture error, a proof that fails) refuses every later use
with the same error; any other failure is raised and tried again next time.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from graphmode.errors import GraphmodeError
from graphmode.runtime.compiled import CompiledModel

log = logging.getLogger("graphmode.runtime")

# what CompiledModel._adopt sets from the lowering: reading one lowers the graph
LOWERED_FIELDS = frozenset({"lowered", "captured_graph", "graph", "capture_report", "optimize_report", "verdict",
                            "exact_dims", "masked_dims", "query_key_dims", "mask_sources", "_out_spec",
                            "output_structure", "mutated_inputs"})


class DeferredModel(CompiledModel):
    """`lower()` (a `compiler.Lowered` of the model under its recipe) runs on first use."""

    def __init__(self, source: Any, recipe: Any, target: Any, lower: Callable[[], Any], **kw: Any):
        self._lower = lower
        # held while the graph is lowered; the decode engine's build holds it too, so the two
        # lowerings of one model (each with a Z3 proof: not thread-safe) never run at once
        self.lowering_lock = threading.Lock()
        self._refusal: GraphmodeError | None = None
        self.pending = True
        super().__init__(source, recipe, target, None, None, None, **kw)

    def before_lowered_checks(self, inputs: Any) -> None:
        """A request outside the recipe's ranges under on_violation: error is refused before the
        graph is lowered for it: the server's first /v1/infer past seq's max took the seconds of a
        lowering to answer 422. (The other checks read the lowering: aliased in-place inputs, the
        model's tables and positions.)"""
        if self.pending and self.recipe.on_violation == "error" and self.mode != "eager":
            dims = self.shape_of(inputs)
            if any(not self.recipe.dim_range(d)[0] <= v <= self.recipe.dim_range(d)[1] for d, v in dims.items()):
                raise self._violation(dims)    # (counted by whoever called: a server validates with bind_inputs)

    def _adopt(self, captured: Any, graph: Any, reports: Any, verdict: Any, lowered: Any) -> None:
        if lowered is not None:          # CompiledModel.__init__ adopts nothing: the fields stay unset
            super()._adopt(captured, graph, reports, verdict, lowered)

    def __getattr__(self, name: str) -> Any:
        """Only for attributes not set: one the lowering makes lowers the graph first."""
        if name in LOWERED_FIELDS and "lowering_lock" in self.__dict__:
            self.lower_now()
            return self.__dict__[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def lower_now(self) -> None:
        """Lower the graph (once, whichever thread asks first; the others wait for it), then
        spill the constants the passes made as `compiler.compile` does."""
        if not self.pending:
            return
        with self.lowering_lock:
            if not self.pending:
                return
            if self._refusal is not None:
                raise self._refusal.with_traceback(None)
            try:
                low = self._lower()
            except GraphmodeError as e:
                log.warning("the whole-sequence graph of recipe %s is refused: %s", self.recipe.name, e)
                self._refusal = e
                raise
            self._adopt(low.captured, low.graph, (low.capture_report, low.optimize_report), low.verdict, low)
            self.spill_constants()
            self._lower = None           # the model it lowered is the source's: nothing else to keep
            self.pending = False
