"""Between a request's shape and a bucket's: pad inputs up to the bucket, slice outputs back
to the real dims, or run a batch between buckets as batches that fill buckets (runtime/split.py),
and give the flat outputs back in the structure eager returns."""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Mapping

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree

from graphmode.ir.types import eval_dim
from graphmode.runtime.split import chunks, output_axes

SPLIT_DIM = "batch"     # the dim a request between buckets may be cut along (runtime/split.py)


# set while the server runs requests it merged (serve/serving.py): each was checked alone, and the
# pad values merging put between them are padding, not a request's own masked positions
MERGED = contextvars.ContextVar("graphmode_merged_requests", default=False)


@contextlib.contextmanager
def merged_requests(merged: bool = True):
    """Calls inside run requests merged by the server (MERGED)."""
    token = MERGED.set(merged)
    try:
        yield
    finally:
        MERGED.reset(token)


class Shaping:
    """CompiledModel's padding, slicing, splitting and output structure (a mixin: it reads the
    model's graph, recipe, dims and capture report)."""

    def pad_hazard(self, inputs: Mapping[str, torch.Tensor], dims: Mapping[str, int],
                   bucket: Mapping[str, int] | None) -> tuple[str, str] | None:
        """(dim, input) when padding this request up to `bucket` is unsafe though the verdict
        padded the dim safely by masking (`masked_dims`, analysis/padding.py): an input the mask is
        read from (`mask_sources`, verdict.py) masks a row whole along it (every position its pad value), or, along
        a dim the model builds a query x key mask over (`query_key_dims`), holds its pad value at
        all: a softmax over a row masked whole spreads evenly over the padded positions too."""
        padded = [d for d in getattr(self, "masked_dims", ()) if bucket is not None and dims.get(d) != bucket.get(d)]
        if not padded or MERGED.get():        # every call asks: nothing more unless a masked dim is padded
            return None
        from graphmode.verdict import mask_inputs
        masks = getattr(self, "mask_sources", None)
        masks = mask_inputs(self.recipe) if masks is None else masks     # an artifact saved before they were known
        for d in padded:
            for name, axes in self._dim_axes.items():
                t, pv = inputs.get(name), self.pad_values.get(name)
                ax = next((a for a, dd in axes if dd == d), None)
                if name not in masks or t is None or pv is None or ax is None or t.is_floating_point():
                    continue
                hit = t == pv
                if bool(hit.any() if d in getattr(self, "query_key_dims", ()) else hit.all(dim=ax).any()):
                    return d, name
        return None

    def padding_violation(self, dims: Mapping[str, int], bucket: Mapping[str, int], unsafe: str | None,
                          hazard: tuple[str, str] | None) -> tuple[Any, str, str]:
        """(the ContractViolation, its kind, the fallback's reason) of a request its bucket's
        padding would change: along a dim the verdict found unsafe, or a `pad_hazard`."""
        from graphmode.errors import ContractViolation
        buckets = self.recipe.dim_buckets()
        if hazard is None:
            d = str(unsafe)
            err = ContractViolation(f"padding {d} from {dims[d]} to {bucket[d]} is unsafe for this model",
                                    kind="padding", where=f"dims.{d}", value=dims[d], fix=f"send {d} equal to a bucket value "
                                    f"{buckets[d]}, or see the compile report's padding verdict")
        else:
            d, name = hazard
            pv = self.pad_values.get(name)
            why = (f"holds its pad value {pv!r} along {d}, and the model may build a query x key mask from it: "
                   f"at a padding position of the request (right or left), where every key may be masked, "
                   f"eager's answer depends on how many keys there are (even attention over {dims[d]}, or NaN "
                   f"with a -inf fill), so padding {d} from {dims[d]} to {bucket[d]} could change the output there"
                   if d in getattr(self, "query_key_dims", ()) else
                   f"masks a whole row along {d} (every position its pad value {pv!r}), which would change if {d} "
                   f"were padded from {dims[d]} to {bucket[d]}")
            err = ContractViolation(
                f"input {name!r} {why}", kind="padding", where=f"dims.{d}",
                value=dims[d], fix=f"send {d} equal to a bucket value {buckets[d]}, {or_eager(self, d)}")
        return err, "padding", f"unsafe padding on {d}"     # bounded: it labels a Prometheus series

    def _pad(self, inputs: Mapping[str, torch.Tensor], bucket: Mapping[str, int]) -> dict[str, torch.Tensor]:
        out = {}
        for name, t in inputs.items():
            pads: list[int] = []
            need = False
            for ax in reversed(range(t.dim())):
                extra = 0
                for a, d in self._dim_axes[name]:
                    if a == ax:
                        extra = bucket[d] - int(t.shape[ax])
                pads += [0, extra]
                need |= extra > 0
            if need:
                t = F.pad(t, pads, value=self.pad_values[name])
            out[name] = t
        return out

    def _real_index(self, name: str, dims: Mapping[str, int], bucket: Mapping[str, int]) -> tuple | None:
        """The index that slices output `name` at the bucket's shape back to the real dims: every
        axis whose extent depends on a padded dim (the padding analysis proved such axes hold the
        real positions first); None when nothing is padded."""
        if dict(dims) == dict(bucket):
            return None
        ty = self.graph.values[name].type
        idx = []
        sliced = False
        for d in ty.shape:
            real = d if isinstance(d, int) else eval_dim(d, dims)
            if real != (d if isinstance(d, int) else eval_dim(d, bucket)):
                idx.append(slice(0, real))
                sliced = True
            else:
                idx.append(slice(None))
        return tuple(idx) if sliced else None

    def _ways(self, dims: Mapping[str, int], bucket: Mapping[str, int]) -> tuple[list[str], list[int]]:
        """The ways a request may run (runtime/split.py: padded, split, eager) and the batch
        parts of a split. A request that fills its bucket runs padded (nothing is padded). Split
        is offered once its parts' plans are built; until then they build in the background."""
        if dict(dims) == dict(bucket):
            return ["padded"], []
        parts = self._split_parts(dims, bucket)
        unbuilt = [e for e in ({**bucket, SPLIT_DIM: n} for n in dict.fromkeys(parts)) if not self.is_built(e)]
        for env in unbuilt:        # a way is offered once its plans are built: a request never waits for them
            self._build_later(env)
        split = ["split"] if parts and not unbuilt else []
        return ["padded"] + split + (["eager"] if self.eager_candidate else []), parts

    @property
    def eager_candidate(self) -> bool:
        """Whether a request between buckets may run eager PyTorch at its own shape when that
        measured faster: only in `exe_mode: hybrid` (graph mode never runs eager unless the
        recipe's on_violation says so, and then only outside the contract), only with the
        module in this process (not an ONNX model or a loaded artifact), and only when the plans
        keep no run-time state of their own (a decoder's KV pools) that eager would not update."""
        if self.mode != "hybrid" or self.source.module is None or getattr(self, "artifact", None) is not None:
            return False
        if self.graph is None:
            return False
        if getattr(self, "_stateless", None) is None:      # once per graph: a scan of its values
            self._stateless = not any(v.role == "state" for v in self.graph.values.values())
        return self._stateless

    def _split_parts(self, dims: Mapping[str, int], bucket: Mapping[str, int]) -> list[int]:
        """The batch sizes a request padded along SPLIT_DIM could run as instead (each a bucket
        value), or [] when it cannot: the dim is not padded, the model's rows meet, an output has
        no axis to concatenate along, the model updates an input in place, or the batch is no sum
        of bucket values."""
        if dims.get(SPLIT_DIM) == bucket.get(SPLIT_DIM) or not self._splittable():
            return []
        parts = chunks(dims[SPLIT_DIM], self.recipe.dim_buckets().get(SPLIT_DIM, []))
        return parts if len(parts) > 1 else []

    def independent_along(self, dim: str) -> bool:
        """Whether the model's rows along `dim` never meet (analysis.padding.positions_independent),
        so requests may be merged or cut along it; judged once per dim, on the captured graph."""
        known = self.__dict__.setdefault("_independent", {})
        if dim not in known:
            from graphmode.analysis.padding import positions_independent
            graph = self.captured_graph if self.captured_graph is not None else self.graph
            # a data-dependent tail (capture/tail.py) runs eagerly, unanalysed: nonzero over merged
            # requests numbers one request's rows after another's
            known[dim] = graph is not None and getattr(self, "tail", None) is None and positions_independent(graph, dim)
        return known[dim]

    def _splittable(self) -> bool:
        if self._split_axes is False:
            ok = (self.graph is not None and SPLIT_DIM in self.recipe.dim_buckets() and SPLIT_DIM not in self.exact_dims
                  and not self.mutated_inputs
                  and all(sum(d == SPLIT_DIM for _, d in axes) <= 1 for axes in self._dim_axes.values()))
            axes = output_axes(self.graph, SPLIT_DIM) if ok else None
            self._split_axes = axes if axes is not None and self.independent_along(SPLIT_DIM) else None
        return self._split_axes is not None

    def _run_split(self, inputs: Mapping[str, torch.Tensor], dims: Mapping[str, int], bucket: Mapping[str, int],
                   parts: list[int]) -> list[torch.Tensor]:
        """Run consecutive slices of the batch, `parts` rows each (bucket values), in `bucket`
        with that batch, and concatenate each output along its batch axis."""
        pieces, start = [], 0
        for n in parts:
            sub = {name: next((t.narrow(ax, start, n) for ax, d in self._dim_axes[name] if d == SPLIT_DIM), t)
                   for name, t in inputs.items()}
            sub_dims = {**dims, SPLIT_DIM: n}
            pieces.append(self._run_bucket(sub, sub_dims, {**bucket, SPLIT_DIM: n}))
            start += n
        axes = self._split_axes
        return [torch.cat([p[i] for p in pieces], dim=axes[name]) for i, name in enumerate(self.graph.outputs)]

    def structured(self, flat: list[torch.Tensor]) -> Any:
        """The flat outputs in the structure eager returns: a Tensor, tuple, dict or ModelOutput."""
        if self.output_structure is not None:
            from graphmode.capture.outputs import count, rebuild
            if count(self.output_structure) == len(flat):
                return rebuild(self.output_structure, flat)
        if self._out_spec is not None:
            try:
                return pytree.tree_unflatten(flat, self._out_spec)
            except Exception:  # noqa: BLE001 - structure mismatch: return the flat tuple
                pass
        return flat[0] if len(flat) == 1 else tuple(flat)

    @property
    def output_names(self) -> list[str]:
        """One name per output the model returns, named by its structure (capture/outputs.py)."""
        names = list(getattr(self.capture_report, "output_names", None) or getattr(self.source, "output_names", None)
                     or [])
        n_user = (len(self.tail.outputs) if getattr(self, "tail", None) is not None else
                  len(self.graph.outputs) - len(self.mutated_inputs) if self.graph is not None else len(names))
        return names if len(names) == n_user else (["output"] if n_user == 1 else
                                                   [f"output_{i}" for i in range(n_user)])


def fallback_engine(cm: Any) -> str:
    """What runs a request the plans do not take."""
    return "ONNX Runtime" if cm.source.module is None else "eager PyTorch"


def has_eager(cm: Any) -> bool:
    """Whether `on_violation: eager` can run this model: a model loaded from an artifact has
    neither the module nor the ONNX file (runtime/compiled.py `_eager`)."""
    src = getattr(cm, "source", None)
    return getattr(cm, "artifact", None) is None and src is not None and (
        src.module is not None or src.onnx_path is not None)


def or_eager(cm: Any, d: str) -> str:
    """The end of a fix for a request outside the plans: on_violation: eager where the model has
    an eager; else compiling again from the source, since an artifact keeps its recipe."""
    if has_eager(cm):
        return f"or set on_violation: eager (such requests then run in {fallback_engine(cm)})"
    return (f"or compile the model again from its source with dims.{d} changed or on_violation: eager (a loaded "
            "artifact keeps the recipe it was saved with)")
