"""ONNX Runtime sessions over a user's file, for the reference, the eager fallback and the bench.

ONNX Runtime reads the weights of an external-data file itself, but not every tensor: one its
shape inference needs (an Unsqueeze's axes saved beside the weights by `size_threshold=0`)
fails the load with "Cannot parse data from external tensors", though graphmode imports the
same file. Such a file is handed over again as one in-memory model with its data inlined, where
that fits a protobuf (2 GB).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

PROTO_LIMIT = 2 ** 31 - 1      # bytes a serialized ModelProto may hold


def ort_session(path: str | Path, options: Any) -> Any:
    """An InferenceSession (CPU) over the file at `path`: from the path, or where that fails for
    an external-data file, from the model with its data inlined; else the first error."""
    import onnxruntime as ort
    try:
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as first:  # noqa: BLE001 - onnxruntime raises its own exception types
        inlined = _inlined(Path(path))
        if inlined is None:
            raise
        try:
            return ort.InferenceSession(inlined, options, providers=["CPUExecutionProvider"])
        except Exception:  # noqa: BLE001
            raise first from None


def _inlined(path: Path) -> bytes | None:
    """The model at `path` serialized with its external data inside; None when it has none, or
    it cannot be read, or it would not fit one protobuf."""
    import onnx
    from onnx.external_data_helper import uses_external_data
    try:
        light = onnx.load(str(path), load_external_data=False)
        if not any(uses_external_data(t) for t in light.graph.initializer):
            return None
        model = onnx.load(str(path), load_external_data=True)
    except Exception:  # noqa: BLE001 - a file onnx cannot read: the first error says why
        return None
    return model.SerializeToString() if model.ByteSize() <= PROTO_LIMIT else None
