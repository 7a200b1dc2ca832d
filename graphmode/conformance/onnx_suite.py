"""The ONNX backend node tests, generated from the installed onnx package, run through graphmode
and ONNX Runtime and compared with each case's expected outputs.

A case is one `onnx.backend.test.case.node` test: a model (one node, or an `_expanded`
function body) with one set of inputs and expected outputs. graphmode gets it the way a user
would: the model file, and a recipe drafted for the case's inputs (their dtypes and shapes;
the first axis of the first input named `d0` and pinned to its extent, since a recipe needs a
dim). The 29 cases whose inputs or outputs are sequences or optionals are not listed: a recipe
declares tensors only.

Subsets (summary rows): `f32` = every input and output float32 and the default-domain opset in
ONNX's window that graphmode aims at (7..24, `GOAL_OPSETS`).
"""
from __future__ import annotations

import os
import re
import tempfile
import warnings
from typing import Any

import numpy as np

from graphmode.conformance.runner import Case, Judged, judge
from graphmode.errors import RecipeError
from graphmode.recipe.limits import MAX_VALUE_ELEMS

GOAL_OPSETS = (7, 24)
# formal inputs that are shape-like data (axes, sizes, pads, counts): a user declares them constant
SHAPE_LIKE = frozenset({"axes", "shape", "pads", "repeats", "split", "starts", "ends", "steps", "K", "k", "sizes",
                        "scales", "roi", "depth", "output_shape", "image_shape", "block_shape", "axis", "dft_length",
                        "frame_step", "frame_length", "size", "training_mode", "ratio", "start", "limit", "delta",
                        "max_output_boxes_per_class", "iou_threshold", "score_threshold", "num_mel_bins",
                        "sample_rate", "lower_edge_hertz", "upper_edge_hertz", "constant_value", "M", "cond"})

# numpy dtype name -> recipe dtype; what a recipe cannot declare is refused naming the input
_RECIPE_DTYPES = {"float64": "f64", "float32": "f32", "float16": "f16", "bfloat16": "bf16", "int64": "i64",
                  "int32": "i32", "int16": "i16", "int8": "i8", "uint64": "u64", "uint32": "u32", "uint16": "u16",
                  "uint8": "u8", "bool": "bool"}


def _opset(model) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def _tensor_io(model) -> bool:
    return all(v.type.HasField("tensor_type") for v in list(model.graph.input) + list(model.graph.output))


def _op_of(tc, singles: dict[str, str]) -> str:
    nodes = tc.model.graph.node
    if len(nodes) == 1:
        return nodes[0].op_type
    base = re.sub(r"_expanded(_ver\d+)?$", "", tc.name)
    return singles.get(base) or (tc.name[len("test_"):] if tc.name.startswith("test_") else tc.name)


def _is_f32(model, inputs, outputs) -> bool:
    lo, hi = GOAL_OPSETS
    return (lo <= _opset(model) <= hi and all(a.dtype == np.float32 for a in list(inputs) + list(outputs)))


def _array(x) -> np.ndarray:
    """A case's input or output as numpy (some cases store TensorProtos: float8, int4, ...)."""
    if isinstance(x, (np.ndarray, np.generic)):
        return np.asarray(x)
    from onnx import numpy_helper
    return numpy_helper.to_array(x)


def _as_torch(arr: np.ndarray):
    import torch
    if arr.dtype.name == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(arr).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.array(arr, copy=True))


def _as_numpy(t) -> np.ndarray:
    import torch
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        import ml_dtypes
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


# the least relative tolerance per low-precision dtype: two ULPs (onnx's runner does this for
# bfloat16; float16's 1e-3 default is one ULP, under the rounding of one reordered accumulation)
TWO_ULPS = {"bfloat16": 2.0 ** -6, "float16": 2.0 ** -9}


def compare(got: list[np.ndarray], want: list[np.ndarray], rtol: float, atol: float) -> str | None:
    """None when `got` matches `want` as the ONNX backend test runner checks it (same count,
    shapes and dtypes; |got - want| <= atol + rtol * |want|, rtol at least two ULPs of a 16-bit
    float (TWO_ULPS), NaN where NaN; exact for non-floats), else the first difference."""
    if len(got) != len(want):
        return f"{len(got)} outputs, expected {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        if g.dtype != w.dtype:
            return f"output {i}: dtype {g.dtype}, expected {w.dtype}"
        if g.shape != w.shape:
            return f"output {i}: shape {list(g.shape)}, expected {list(w.shape)}"
        if w.dtype.kind == "f" or w.dtype.name.startswith(("bfloat", "float")):   # ml_dtypes' floats too
            g64, w64 = g.astype(np.float64), w.astype(np.float64)
            tol = max(rtol, TWO_ULPS.get(w.dtype.name, 0.0))
            ok = np.isclose(g64, w64, rtol=tol, atol=atol, equal_nan=True)
        else:
            ok = g == w
        if not np.all(ok):
            bad = np.argwhere(~np.asarray(ok))
            idx = tuple(int(x) for x in bad[0]) if bad.size else ()
            return (f"output {i}: {int((~np.asarray(ok)).sum())} of {w.size} elements differ; at {list(idx)} "
                    f"got {g[idx] if idx else g}, expected {w[idx] if idx else w}")
    return None


def _all_nodes(graph):
    """The graph's nodes and, recursively, those of its If/Loop/Scan subgraphs."""
    from onnx import helper
    for n in graph.node:
        yield n
        for a in n.attribute:
            v = helper.get_attribute_value(a)
            for g in (v if isinstance(v, list) else [v]):
                if hasattr(g, "node"):
                    yield from _all_nodes(g)


def shape_like_inputs(model) -> set[str]:
    """Graph inputs that shape-like data is computed from: a node's formal input named in
    SHAPE_LIKE (or ConstantOfShape's), followed back through the nodes that compute it (not
    through Shape or Size, whose outputs do not depend on their input's values)."""
    from onnx import defs
    opset = _opset(model)
    every = list(_all_nodes(model.graph))
    producer = {o: n for n in every for o in n.output}
    todo: list[str] = []
    for n in every:
        try:
            formal = defs.get_schema(n.op_type, opset, n.domain).inputs
        except Exception:  # noqa: BLE001 - an op ONNX does not define at this opset: the import refuses it
            continue
        for k, name in enumerate(n.input):
            shape_like = n.op_type == "ConstantOfShape" or (formal and formal[min(k, len(formal) - 1)].name
                                                            in SHAPE_LIKE)
            if name and shape_like:
                todo.append(name)
    seen: set[str] = set()
    while todo:
        v = todo.pop()
        if v in seen:
            continue
        seen.add(v)
        n = producer.get(v)
        if n is not None and n.op_type not in ("Shape", "Size"):
            todo.extend(i for i in n.input if i)
    return seen


def draft_recipe(model, inputs: list[np.ndarray]) -> dict[str, Any]:
    """The recipe a user would write for exactly these inputs: their dtypes and shapes, the
    shape-like ones declared constant (`value`), the first axis of the first other input named
    `d0` and pinned to its extent (a recipe needs a dim); `exe_mode: hybrid`, as `graphmode recipe
    init` drafts it, where an op's output size only the data decides (NonZero, Compress)."""
    init = {i.name for i in model.graph.initializer}
    names = [v.name for v in model.graph.input if v.name not in init]
    constant = shape_like_inputs(model)
    specs: list[dict[str, Any]] = []
    dims: dict[str, int] = {}
    for i, (name, arr) in enumerate(zip(names, inputs)):
        dt = _RECIPE_DTYPES.get(arr.dtype.name)
        if dt is None:
            raise RecipeError(f"a recipe cannot declare dtype {arr.dtype.name}", where=f"inputs[{i}].dtype",
                              value=arr.dtype.name, fix=f"one of: {', '.join(_RECIPE_DTYPES.values())}")
        shape: list[Any] = [int(d) for d in arr.shape]
        spec: dict[str, Any] = {"name": name, "dtype": dt, "shape": shape}
        if name in constant and arr.size <= MAX_VALUE_ELEMS:
            spec["value"] = arr.tolist()
        elif not dims and shape and shape[0] >= 1:
            dims["d0"] = shape[0]
            shape[0] = "d0"
        specs.append(spec)
    from graphmode.capture.onnx.convert_data import DATA_SIZED_OPS
    tail = any(n.op_type in DATA_SIZED_OPS for n in model.graph.node)
    return {"version": 1, "name": "onnx-node-test", "inputs": specs, "dims": dims,
            **({"exe_mode": "hybrid"} if tail else {})}


class OnnxSuite:
    name = "onnx"
    title = "ONNX backend node tests"
    subsets = {"f32": "f32 in/out, opset 7..24"}
    others = ("ORT",)

    def __init__(self, cache_dir: str | None = None, threads: int = 1):
        self.cache_dir = cache_dir
        self.threads = threads
        # the cases' files live while the suite does and go with it (a run left one folder per suite in /tmp)
        self._tmp_dir = tempfile.TemporaryDirectory(prefix="gm-onnx-conf-")
        self._tmp = self._tmp_dir.name

    def versions(self) -> dict[str, str]:
        import onnx
        import onnxruntime
        return {"onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__}

    def cases(self) -> list[Case]:
        from onnx.backend.test.case.node import collect_testcases
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            tcs = collect_testcases(None)
        singles = {tc.name: tc.model.graph.node[0].op_type for tc in tcs if len(tc.model.graph.node) == 1}
        out = []
        for tc in tcs:
            if not _tensor_io(tc.model):
                continue
            for k, (ins, outs) in enumerate(tc.data_sets):
                ins, outs = [_array(a) for a in ins], [_array(a) for a in outs]
                cid = tc.name if len(tc.data_sets) == 1 else f"{tc.name}[{k}]"
                tags = ("f32",) if _is_f32(tc.model, ins, outs) else ()
                out.append(Case(cid, _op_of(tc, singles), tags,
                                (tc.model.SerializeToString(), list(ins), list(outs), tc.rtol, tc.atol)))
        return out

    def run_case(self, case: Case) -> Judged:
        model_bytes, inputs, outputs, rtol, atol = case.payload
        judged = judge(lambda: self._graphmode(case.id, model_bytes, inputs, outputs, rtol, atol))
        judged.detail = judged.detail.replace(self._tmp + os.sep, "")     # name the case's file, not the folder
        judged.others["ORT"] = self._ort(model_bytes, inputs, outputs, rtol, atol)
        return judged

    def _graphmode(self, cid: str, model_bytes: bytes, inputs, outputs, rtol: float, atol: float) -> str | None:
        import onnx

        import graphmode
        model = onnx.load_model_from_string(model_bytes)
        recipe = draft_recipe(model, inputs)
        path = os.path.join(self._tmp, f"{cid.replace('/', '_')}.onnx")
        with open(path, "wb") as f:
            f.write(model_bytes)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cm = graphmode.compile(path, recipe, cache_dir=self.cache_dir, threads=self.threads)
            feed = {spec["name"]: _as_torch(a) for spec, a in zip(recipe["inputs"], inputs)}
            got = cm(**feed)
        got = list(got) if isinstance(got, (tuple, list)) else [got]
        return compare([_as_numpy(t) for t in got], list(outputs), rtol, atol)

    def _ort(self, model_bytes: bytes, inputs, outputs, rtol: float, atol: float) -> str:
        import onnxruntime as ort
        try:
            so = ort.SessionOptions()
            so.intra_op_num_threads = self.threads
            so.log_severity_level = 3
            sess = ort.InferenceSession(model_bytes, so, providers=["CPUExecutionProvider"])
            feed = {i.name: a for i, a in zip(sess.get_inputs(), inputs)}
            got = sess.run(None, feed)
        except Exception:  # noqa: BLE001 - ORT raises its own exception types; any is a failure
            return "fail"
        return "pass" if compare(list(got), list(outputs), rtol, atol) is None else "fail"
