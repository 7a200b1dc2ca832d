"""Running the eager reference on graphmode's own sample inputs, and saying why it failed."""
from __future__ import annotations

from typing import Any, Callable, Mapping

from graphmode.errors import GraphmodeError


def run_reference(reference: Callable[[Any], Any], inputs: Mapping[str, Any], shape: Mapping[str, int],
                  name: str = "eager PyTorch") -> Any:
    """`reference(inputs)`, or a GraphmodeError naming the shape and what the sample inputs hold
    when the model itself raises: at a shape the recipe admits, the cause is the model's limit
    (a position table) or a value the samples drew (a bool mask that masks a row whole). `name`
    says which reference failed (ONNX Runtime for an ONNX file)."""
    try:     # on copies: a model that updates an input in place must not change what graphmode then runs
        return reference({k: v.clone() if hasattr(v, "clone") else v for k, v in inputs.items()})
    except Exception as e:  # noqa: BLE001 - the model's own error, reported with what it was given
        drawn = ", ".join(f"{k} {getattr(v, 'dtype', type(v).__name__)}".replace("torch.", "")
                          for k, v in inputs.items())
        raise GraphmodeError(f"{name} fails at {dict(shape)}, a shape the recipe admits, on graphmode's "
                             f"sample inputs ({drawn}: random values within each input's declared range): "
                             f"{type(e).__name__}: {str(e)[:200]}", where="dims", value=dict(shape),
                             fix="narrow the recipe's dims to the shapes the model takes (e.g. seq up to its "
                                 "position table), or declare the inputs' value ranges (inputs[].range; a mask "
                                 "input role: attention_mask) so samples hold values the model accepts") from None
