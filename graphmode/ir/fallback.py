"""Eager execution of `fallback` nodes: ops graphmode keeps in the graph but does not compile.

A fallback node records the torch op (`target`, e.g. "aten.cumsum.default") and its
arguments as JSON, with tensor operands written as {"$in": i} (the node's i-th input) and
symbolic ints as {"$dim": "seq*2"}. The runtime calls the op through `torch.ops`.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from graphmode.errors import IRError
from graphmode.ir.types import DTYPES, eval_dim, normalize_dim


def resolve_target(target: str):
    ns, _, rest = target.partition(".")
    op_name, _, overload = rest.partition(".")
    try:
        packet = getattr(getattr(torch.ops, ns), op_name)
        return getattr(packet, overload or "default")
    except AttributeError:
        if ns not in ("aten", "prims"):
            raise IRError(f"fallback target {target!r} is not a torch op in this process: a library registers "
                          f"torch.ops.{ns}.{op_name} when one of its modules is imported",
                          fix=f"import the {ns} module that defines it before loading (a .gm saved since "
                              "graphmode records it: op_modules)") from None
        raise IRError(f"fallback target {target!r} is not a torch op",
                      fix="fallback targets look like 'aten.cumsum.default'") from None


def op_module(target: str) -> str | None:
    """The Python module that defines custom op `target` (torch.library.custom_op: a model
    library's own op, such as transformers' grouped_mm_fallback), or None for torch's own."""
    from torch._library import custom_ops
    ns, _, rest = target.partition(".")
    opdef = custom_ops.OPDEFS.get(f"{ns}::{rest.partition('.')[0]}")
    module = getattr(getattr(opdef, "_init_fn", None), "__module__", None)
    return module if isinstance(module, str) and module.split(".")[0] == ns else None


def import_op_modules(modules: list[str], targets: list[str]) -> None:
    """Import the modules a saved graph's custom ops come from, so their ops exist: only a module
    of the package its op's namespace names (transformers.* for torch.ops.transformers)."""
    import importlib
    spaces = {t.partition(".")[0] for t in targets}
    for m in modules:
        if m.split(".")[0] in spaces and m.split(".")[0] not in ("aten", "prims"):
            try:
                importlib.import_module(m)
            except Exception as e:  # noqa: BLE001 - reported with the module it came from
                raise IRError(f"module {m}, which defines a custom op the graph runs, does not import: "
                              f"{type(e).__name__}: {str(e)[:200]}", where="op_modules", value=m,
                              fix=f"install the package {m.split('.')[0]} this artifact was saved with") from None


def _materialise(arg: Any, ins: list[torch.Tensor], env: Mapping[str, int]) -> Any:
    if isinstance(arg, dict):
        if "$in" in arg:
            return ins[arg["$in"]]
        if "$dim" in arg:
            return eval_dim(normalize_dim(arg["$dim"]), env)
        if "$dtype" in arg:
            return DTYPES[arg["$dtype"]]
        if "$device" in arg:
            return torch.device(arg["$device"])
        return {k: _materialise(v, ins, env) for k, v in arg.items()}
    if isinstance(arg, list):
        return [_materialise(a, ins, env) for a in arg]
    return arg


def _whole_elements(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a copy where its storage is not a whole number of its elements: an arena holds
    values of every dtype (a bool output beside f32 ones), and some ATen kernels view the
    storage itself (index_put with accumulate asserted `nbytes % dtype_size == 0`)."""
    if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() % t.element_size():
        return t.clone()
    return t


def run_fallback(ins: list[torch.Tensor], attrs: Mapping[str, Any], env: Mapping[str, int]) -> list[torch.Tensor]:
    ins = [_whole_elements(t) for t in ins]
    fn = resolve_target(attrs["target"])
    args = _materialise(attrs.get("args", []), ins, env)
    kwargs = _materialise(attrs.get("kwargs", {}), ins, env)
    out = fn(*args, **kwargs)
    if isinstance(out, torch.Tensor):
        return [out]
    return [o for o in out if isinstance(o, torch.Tensor)]
