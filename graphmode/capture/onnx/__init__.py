"""ONNX -> IR: load, validate, translate every node into the core op set.

Why the importer evaluates shape code itself: exported ONNX graphs compute every
reshape/expand target at run time (`Shape -> Gather -> Unsqueeze -> Concat -> Reshape`),
while the IR wants those targets as attributes with symbolic dims (`reshape.shape =
[batch, seq, 12, 32]`) so that passes, the planner and the recipe checks can reason
about them. So each ONNX value is one of

* a *known* value: a small tensor whose elements are ints, floats, bools or sympy
  expressions over the recipe dims (shapes, shape arithmetic, small constants). Ops on
  known values are folded at import time (`_Known`, numpy object arrays); only when a
  known value feeds a real computation is it materialised as an IR constant (or, for a
  symbolic element such as `seq`, as `arange(start=seq, end=seq+1)`);
* an IR value (a tensor computed at run time), with its `TensorType` from the op table's
  `infer`, cross-checked against the ONNX `value_info` / output types when present;
* a large initializer, turned into a `param` constant the first time a node uses it.

Besides the shape folding, the translation makes the IR look like the torch.export one:
`MatMul(x, W)` with a constant 2-d `W` and `Gemm` become `linear` (transposed weight; a
tied `wte.T` initializer is recognised and shared), a following `Add(bias)` is folded
into it, `Gather` on a constant 2-d table becomes `embedding`, `Identity`/`Dropout` and
no-op reshapes/expands disappear. Activation chains (the exporter's erf-GELU) are kept
as elementwise ops for the fusion pass.

Before any node is translated, `validate.validate_onnx` refuses a malformed model
(onnx.checker, strict shape inference, attribute ranges, graph signature): the handlers
below may trust attribute values and types.

Inputs the file gives no shape (ONNX Runtime takes any) take the recipe's `inputs[].shape`;
dims the file declares as expressions (dynamo's `Min(32, s27)`) are checked over the dims'
ranges, and one that holds only on part of them is advisory (the index analysis bounds the dim);
an error inside the function body an op is imported through names the op of the file.

Limitations (each raises CaptureError naming the file, node and fix):
ops outside `supported_onnx_ops()` (all are listed with counts and node names before
anything is translated: ONNX has no eager fallback, so they cannot become `fallback`
nodes), control flow (If/Loop/Scan), non-default op domains, shapes that depend on
tensor *data* (e.g. Reshape to a shape read from an input's values), symbolic Slice
starts, negative Slice steps on run-time tensors, asymmetric Conv/Pool padding,
1-d/3-d convolutions, opsets below MIN_OPSET, nodes whose op is defined differently at the
model's opset than at KNOWN_MIN..KNOWN_MAX (`opsets.py`). Not checked: Squeeze
without axes treats a symbolic dim as != 1; `embedding`/`index` assume non-negative
run-time indices. Excluded ops (`exclude_ops` / `include_ops`, matched against the ONNX
op type or the core op it lowers to) become `fallback` nodes calling the equivalent
`torch.ops.aten` function (the op table's `OpSpec.aten_call`); one without one raises CaptureError.
"""
from __future__ import annotations
from graphmode.capture.onnx.importer import OnnxCaptureReport, import_onnx, supported_onnx_ops
from graphmode.capture.onnx.opsets import KNOWN_MAX, KNOWN_MIN
from graphmode.capture.onnx.validate import MIN_OPSET
from graphmode.capture.onnx import (convert_composite, convert_control, convert_core, convert_data,  # noqa: F401,E402
                                    convert_nn, convert_quant, convert_recurrent, convert_resize, convert_select,
                                    convert_shape)   # register handlers

__all__ = ["import_onnx", "OnnxCaptureReport", "supported_onnx_ops", "MIN_OPSET", "KNOWN_MIN", "KNOWN_MAX"]
