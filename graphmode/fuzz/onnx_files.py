"""Mutated ONNX files through compile and one run, checked against ONNX Runtime.

Two small models are built with onnx.helper (an MLP; an embedding lookup with a mean). Each
case mutates one: bytes flipped or the file cut short, or a protobuf edit (an initializer's
dims or dtype, a dropped initializer, an unknown op, a bad attribute, a dangling or duplicate
name, opset and IR versions, input dims, a 0-row table). A model graphmode compiles must give
ONNX Runtime's answer; one ONNX Runtime refuses must be refused too (`invalid-accepted`
otherwise); anything graphmode refuses must be a CaptureError-style GraphmodeError.
"""
from __future__ import annotations

import random
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

RECIPES = {
    "mlp": {"version": 1, "name": "fuzz-onnx-mlp", "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", 16]}],
            "dims": {"batch": {"buckets": [2]}}, "codegen": {"kernel_selection": "heuristic"}, "targets": ["host"]},
    "embed": {"version": 1, "name": "fuzz-onnx-embed",
              "inputs": [{"name": "ids", "dtype": "i64", "shape": ["batch", 8]}],
              "dims": {"batch": {"buckets": [2]}}, "codegen": {"kernel_selection": "heuristic"}, "targets": ["host"]},
}
PROTO_EDITS = ("init-dims", "init-dtype", "init-drop", "init-truncate", "op-unknown", "attr-bad", "input-dangling",
               "output-duplicate", "opset-1", "opset-999", "ir-0", "ir-99", "input-dim-0", "input-dim-neg",
               "input-dtype", "no-outputs", "nodes-reversed", "zero-row-table")


def _models() -> dict[str, Any]:
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(0)
    w1, b1 = rng.standard_normal((16, 32)).astype(np.float32) * 0.3, rng.standard_normal(32).astype(np.float32)
    w2 = rng.standard_normal((32, 10)).astype(np.float32) * 0.3
    mlp = helper.make_model(helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"), helper.make_node("Add", ["h", "b1"], ["hb"], name="add"),
         helper.make_node("Relu", ["hb"], ["r"], name="relu"), helper.make_node("MatMul", ["r", "w2"], ["y"], name="mm2")],
        "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 10])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(b1, "b1"), numpy_helper.from_array(w2, "w2")]),
        opset_imports=[helper.make_opsetid("", 17)])
    table = rng.standard_normal((50, 8)).astype(np.float32)
    embed = helper.make_model(helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["e"], name="gather", axis=0),
         helper.make_node("ReduceMean", ["e"], ["y"], name="mean", axes=[1], keepdims=0)],
        "embed", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])],
        [numpy_helper.from_array(table, "table")]), opset_imports=[helper.make_opsetid("", 17)])
    for m in (mlp, embed):
        m.ir_version = 8
        onnx.checker.check_model(m)
    return {"mlp": mlp, "embed": embed}


def setup(work: Path) -> dict[str, Any]:
    paths = {}
    for name, m in _models().items():
        paths[name] = str(work / f"{name}.onnx")
        Path(paths[name]).write_bytes(m.SerializeToString())
    return {"models": paths, "work": str(work)}


def cases(rng: random.Random, n: int, ctx: dict[str, Any]) -> list[dict[str, Any]]:
    out = [{"kind": "proto", "base": b, "edit": e} for e in PROTO_EDITS for b in ("mlp", "embed")]
    rng.shuffle(out)
    out = out[: max(1, n * 2 // 3)]
    sizes = {b: Path(p).stat().st_size for b, p in ctx["models"].items()}
    while len(out) < n:
        b = rng.choice(sorted(sizes))
        if rng.random() < 0.7:
            out.append({"kind": "flip", "base": b, "at": rng.randrange(sizes[b]), "bit": rng.randrange(8)})
        else:
            out.append({"kind": "truncate", "base": b, "at": rng.randrange(sizes[b])})
    for i, c in enumerate(out):
        c["expect"] = "either"
        c["id"] = f"{i:03d}-{c['kind']}-{c['base']}-{c.get('edit', c.get('at'))}"
        c["timeout_s"] = 180
    return out


def _edit(m: Any, edit: str) -> None:
    from onnx import TensorProto, helper, numpy_helper
    g = m.graph
    if edit == "init-dims":
        g.initializer[0].dims[0] += 3
    elif edit == "init-dtype":
        g.initializer[0].data_type = TensorProto.INT64
    elif edit == "init-drop":
        del g.initializer[0]
    elif edit == "init-truncate":
        g.initializer[0].raw_data = g.initializer[0].raw_data[:7]
    elif edit == "op-unknown":
        g.node[0].op_type = "Frobnicate"
    elif edit == "attr-bad":
        g.node[-1].attribute.append(helper.make_attribute("axis", 99))
    elif edit == "input-dangling":
        g.node[-1].input[0] = "nowhere"
    elif edit == "output-duplicate":
        g.node[0].output[0] = g.node[-1].output[0]
    elif edit in ("opset-1", "opset-999"):
        m.opset_import[0].version = int(edit.split("-")[1])
    elif edit in ("ir-0", "ir-99"):
        m.ir_version = int(edit.split("-")[1])
    elif edit == "input-dim-0":
        g.input[0].type.tensor_type.shape.dim[1].dim_value = 0
    elif edit == "input-dim-neg":
        g.input[0].type.tensor_type.shape.dim[1].dim_value = -5
    elif edit == "input-dtype":
        g.input[0].type.tensor_type.elem_type = TensorProto.STRING
    elif edit == "no-outputs":
        del g.output[:]
    elif edit == "nodes-reversed":
        nodes = list(g.node)[::-1]
        del g.node[:]
        g.node.extend(nodes)
    elif edit == "zero-row-table":
        init = g.initializer[0]
        arr = numpy_helper.to_array(init)
        g.initializer[0].CopyFrom(numpy_helper.from_array(arr[:0], init.name))


def _feeds(base: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    if base == "mlp":
        return {"x": rng.standard_normal((2, 16)).astype(np.float32)}
    return {"ids": rng.integers(0, 50, (2, 8)).astype(np.int64)}


def _ort(data: bytes, feeds: dict[str, np.ndarray]) -> list[np.ndarray] | str:
    try:
        import onnxruntime as ort
    except ImportError:
        return "onnxruntime is not installed"
    try:
        sess = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
        return sess.run(None, feeds)
    except Exception as e:  # noqa: BLE001 - ORT's refusal, whatever its type
        return f"{type(e).__name__}: {str(e)[:200]}"


def execute(case: dict[str, Any], ctx: dict[str, Any]) -> tuple[str, str]:
    import onnx
    import torch

    import graphmode
    from graphmode.recipe import load_recipe
    from graphmode.verify.numerics import rel_l2
    data = Path(ctx["models"][case["base"]]).read_bytes()
    if case["kind"] == "flip":
        b = bytearray(data)
        b[case["at"]] ^= 1 << case["bit"]
        data = bytes(b)
    elif case["kind"] == "truncate":
        data = data[: case["at"]]
    else:
        m = onnx.load_from_string(data)
        _edit(m, case["edit"])
        data = m.SerializeToString()
    feeds = _feeds(case["base"])
    with tempfile.TemporaryDirectory(dir=ctx["work"], prefix="case-") as tmp:
        path = Path(tmp) / "model.onnx"
        path.write_bytes(data)
        cm = graphmode.compile(str(path), load_recipe(RECIPES[case["base"]]), cache_dir=Path(tmp) / "cache")
        out = cm(**{k: torch.from_numpy(v) for k, v in feeds.items()})
    got = out[0] if isinstance(out, (tuple, list)) else out
    want = _ort(data, feeds)
    if isinstance(want, str):
        return ("accepted", "") if "not installed" in want else ("invalid-accepted", f"ONNX Runtime refuses it: {want}")
    err = rel_l2(got, torch.from_numpy(want[0])) if tuple(got.shape) == want[0].shape else float("inf")
    return ("accepted", "") if err < 1e-4 else ("wrong-output", f"rel L2 {err:.2e} vs ONNX Runtime")
