"""Resolve a model spec string into something capture can consume.

Accepted specs (tried in this order):

1. a built-in name: ``minilm``, ``gpt2``, ``resnet18`` (case-insensitive; aliases such as
   ``all-MiniLM-L6-v2``, ``gpt-2``, ``resnet-18``) -> :class:`~graphmode.capture.zoo.ModelBundle`;
2. a path to an ``.onnx`` file -> :class:`OnnxModelSpec` (path + input/output names,
   symbolic shapes and dtypes read from the graph; weights are not loaded);
3. ``package.module:function`` or ``path/to/file.py:function``: the function is called
   with no arguments and must return a ``ModelBundle``, ``(module, example_inputs)`` or
   ``(module, example_inputs, input_dims)`` -> ``ModelBundle``;
4. a folder ``save_pretrained()`` wrote (``config.json`` beside the weights) -> ``ModelBundle``
   of the class its config names, with its tokenizer when the folder holds one.

Every failure is a :class:`graphmode.errors.CaptureError` naming the spec, what was
tried and the fix.
"""
from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import keyword
import os
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from graphmode.capture import zoo
from graphmode.capture.outputs import describe
from graphmode.capture.zoo import ModelBundle
from graphmode.capture.self_changes import refuse_self_changes
from graphmode.errors import CaptureError, GraphmodeError, GraphmodeNotice  # noqa: F401 - re-exported
from graphmode.ir.graph import clean_name

__all__ = ["resolve_model_spec", "as_model", "OnnxModelSpec", "OnnxTensorSpec", "load_onnx_spec",
           "bundle_from_module", "describe_spec_forms"]


# ---------------------------------------------------------------------------- ONNX spec


@dataclass
class OnnxTensorSpec:
    name: str
    shape: list[str | int | None]   # dim_param (str), dim_value (int) or None (unknown)
    dtype: str                      # torch dtype name: "float32", "int64", "bool", ...


@dataclass
class OnnxModelSpec:
    """An ONNX model file as seen from its graph signature (weights not loaded)."""

    path: Path
    inputs: list[OnnxTensorSpec]
    outputs: list[OnnxTensorSpec]
    opset: int | None = None
    producer: str = ""
    ir_version: int | None = None
    name: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def input_names(self) -> list[str]:
        return [i.name for i in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [o.name for o in self.outputs]

    @property
    def input_dims(self) -> dict[str, list[str | int]]:
        """Symbolic shapes like ModelBundle.input_dims; unknown dims become ``<input>_d<i>``."""
        return {t.name: [d if d is not None else f"{t.name}_d{i}" for i, d in enumerate(t.shape)]
                for t in self.inputs}

    @property
    def input_dtypes(self) -> dict[str, torch.dtype]:
        return {t.name: getattr(torch, t.dtype) for t in self.inputs}

    @property
    def dim_names(self) -> list[str]:
        return zoo.dim_names_of(self.input_dims)

    def make_inputs(self, shape: dict[str, int], seed: int = 0, *, int_high: int = 1000
                    ) -> dict[str, torch.Tensor]:
        """Random inputs: floats randn; ints in ``[0, int_high)`` (and the dtype) except names containing
        ``mask`` (ones) or ``type`` (zeros); bools `zoo.bool_sample`."""
        g = torch.Generator().manual_seed(seed)
        out = {}
        for t in self.inputs:
            shp = []
            for d in self.input_dims[t.name]:
                if isinstance(d, int):
                    shp.append(d)
                elif d in shape:
                    shp.append(int(shape[d]))
                else:
                    raise CaptureError(f"no value for dim {d!r}", where=f"onnx model {self.path}",
                                       value=dict(shape), fix=f"give every dim: {self.dim_names}")
            dt = getattr(torch, t.dtype)
            if dt == torch.bool:
                out[t.name] = zoo.bool_sample(t.name, shp)
            elif dt.is_floating_point:
                out[t.name] = torch.randn(shp, generator=g).to(dt)
            elif "mask" in t.name:
                out[t.name] = torch.ones(shp, dtype=dt)
            elif "type" in t.name:
                out[t.name] = torch.zeros(shp, dtype=dt)
            else:     # within the dtype too: an int8 / uint8 input holds up to 127 / 255
                high = min(int_high, int(torch.iinfo(dt).max) + 1)
                out[t.name] = torch.randint(0, high, shp, generator=g, dtype=dt)
        return out


def _onnx_dtype_name(elem_type: int) -> str:
    import onnx
    import numpy as np

    try:
        np_dt = onnx.helper.tensor_dtype_to_np_dtype(elem_type)
    except Exception:  # noqa: BLE001 - e.g. bfloat16 / float8 types without numpy dtype
        return onnx.TensorProto.DataType.Name(elem_type).lower()
    name = np.dtype(np_dt).name
    return {"bool": "bool"}.get(name, name)


def _tensor_spec(vi: Any) -> OnnxTensorSpec:
    tt = vi.type.tensor_type
    shape: list[str | int | None] = []
    if tt.HasField("shape"):
        for d in tt.shape.dim:
            if d.HasField("dim_param") and d.dim_param:
                shape.append(d.dim_param)
            elif d.HasField("dim_value"):
                shape.append(int(d.dim_value))
            else:
                shape.append(None)
    return OnnxTensorSpec(vi.name, shape, _onnx_dtype_name(tt.elem_type))


def _name_dims(inputs: list[OnnxTensorSpec]) -> None:
    """Every dynamic dim of `inputs` named as a recipe dim (an identifier): the model's dim_param
    made one, or `<input>_d<i>` for a dim without a usable name."""
    from graphmode.capture.onnx.inputs import dim_names
    named = dim_names(d for t in inputs for d in t.shape if isinstance(d, str))
    unnamed = {(t.name, i): f"{t.name}_d{i}" for t in inputs for i, d in enumerate(t.shape)
               if not isinstance(d, int) and named.get(d) is None}
    extra = dim_names([*named.values(), *unnamed.values()])
    for t in inputs:
        t.shape = [d if isinstance(d, int) else named[d] if named.get(d) is not None
                   else extra[unnamed[t.name, i]] for i, d in enumerate(t.shape)]


def load_onnx_spec(path: str | os.PathLike, *, spec: str | None = None) -> OnnxModelSpec:
    """Read an ONNX file's signature (no weights). Raises CaptureError if it is not ONNX."""
    import onnx

    from graphmode.capture.onnx.validate import check_signature

    p = Path(path)
    label = spec if spec is not None else str(path)
    if not p.exists():
        raise CaptureError("ONNX file not found", where=f"model spec {label!r}",
                           value=str(p.resolve()),
                           fix="check the path (relative paths are resolved from the current "
                               f"directory {Path.cwd()})")
    if not p.is_file():
        raise CaptureError("ONNX path is not a file", where=f"model spec {label!r}",
                           value=str(p.resolve()), fix="give the path of the .onnx file itself")
    try:
        m = onnx.load(str(p), load_external_data=False)
    except Exception as e:  # noqa: BLE001 - protobuf DecodeError and friends
        raise CaptureError(f"not a readable ONNX model: {type(e).__name__}: {e}",
                           where=f"model spec {label!r}", value=str(p),
                           fix="re-export the model (torch.onnx.export), or copy the file again whole"
                           ) from e
    if not m.graph.node and not m.graph.input:
        empty = p.stat().st_size == 0
        raise CaptureError("the file is empty (0 bytes)" if empty else "ONNX file holds an empty graph",
                           where=f"model spec {label!r}", value=str(p),
                           fix="copy the file again whole, or re-export the model" if empty else "re-export the model")
    # the spec feeds make_inputs / input_dtypes: refuse here what they could not bind
    check_signature(m, f"model spec {label!r}")
    inits = {i.name for i in m.graph.initializer}
    opset = next((o.version for o in m.opset_import if o.domain in ("", "ai.onnx")), None)
    inputs = [_tensor_spec(i) for i in m.graph.input if i.name not in inits]
    for t in inputs:     # the IR's (and the recipe's) name: "x:0" -> "x_0"; calls may use either
        t.name = clean_name(t.name)
    _name_dims(inputs)
    return OnnxModelSpec(
        path=p.resolve(), inputs=inputs,
        outputs=[_tensor_spec(o) for o in m.graph.output], opset=opset,
        producer=f"{m.producer_name} {m.producer_version}".strip(), ir_version=m.ir_version,
        name=p.stem)


# ------------------------------------------------------------------ user module -> bundle




def _forward_params(module: nn.Module) -> list[str]:
    try:
        return list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return []


def _input_names_for(module: nn.Module, n: int) -> list[str]:
    try:
        params = [p for p in inspect.signature(module.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    names = [p.name for p in params[:n]]
    return names + [f"input_{i}" for i in range(len(names), n)]


def _make_wrapper(model: nn.Module, names: list[str], positional: bool,
                  call_kwargs: dict[str, Any] | None = None) -> nn.Module:
    """An OutputFlattener subclass whose forward has exactly ``names`` as parameters, so
    torch.export / ONNX export see named inputs; `call_kwargs` are passed on every call."""
    bad = [n for n in names if not n.isidentifier() or keyword.iskeyword(n)]
    if bad:
        raise CaptureError(f"input names must be Python identifiers: {bad}",
                           where="example_inputs", fix="rename those inputs")
    call = (f"self.model({', '.join(names)}, **self.call_kwargs)" if positional else
            f"self.model({', '.join(f'{n}={n}' for n in names)}, **self.call_kwargs)")
    src = (f"def forward(self, {', '.join(names)}):\n"
           f"    return self._flat({call})\n")
    ns: dict[str, Any] = {}
    exec(compile(src, f"<graphmode wrapper {type(model).__name__}>", "exec"), ns)  # noqa: S102

    def _flat(self: Any, out: Any) -> tuple[torch.Tensor, ...]:
        return tuple(t for _, t in zoo._flatten_output(out))

    cls = type(f"Flat{type(model).__name__}", (zoo.OutputFlattener,),
               {"forward": ns["forward"], "_flat": _flat})
    return cls(model, call_kwargs=call_kwargs)


def _notice_hooks(module: nn.Module) -> None:
    """Forward hooks are traced into the graph as they act at capture: what they compute into the
    output is compiled; whatever else they do (a feature stored in a dict, a call counted) happens
    only while graphmode runs the model, and a dict a hook fills is left holding trace values."""
    from torch.nn.modules import module as registry
    hooked = [repr(path) if path else type(module).__name__ for path, sub in module.named_modules()
              if sub._forward_hooks or sub._forward_pre_hooks]
    hooked += ["every module (global hooks)"] if registry._global_forward_hooks or \
        registry._global_forward_pre_hooks else []
    if hooked:
        warnings.warn(GraphmodeNotice(
            f"forward hooks on module {', '.join(hooked[:3])}{' ...' if len(hooked) > 3 else ''} are compiled as they act "
            "on the output; anything else they do (store a feature, count calls) does not happen on compiled calls, "
            "and what they stored while graphmode traced the model is not a real value. For features, return them "
            "from forward (a wrapper module) instead of collecting them in a hook."), stacklevel=3)


def _unwrapped(module: nn.Module, where: str) -> nn.Module:
    """The module graphmode compiles in place of a wrapper: torch.compile's OptimizedModule holds
    the user's module (compiled here instead of by Dynamo); a TorchScript module has no Python
    forward to export."""
    frames = sys.modules.get("torch._dynamo.eval_frame")     # not imported: nothing was torch.compile'd
    if frames is not None and isinstance(module, frames.OptimizedModule):
        return module._orig_mod
    if isinstance(module, torch.jit.RecursiveScriptModule):
        raise CaptureError(f"{type(module).__name__} is a scripted module (torch.jit.script's output), whose forward "
                           "is TorchScript, which torch.export cannot trace", where=where, value=type(module).__name__,
                           fix="pass the nn.Module you scripted (graphmode captures it with torch.export itself)")
    return module


def bundle_from_module(module: nn.Module, example_inputs: Any,
                       input_dims: dict[str, list[str | int]] | None = None, *,
                       name: str | None = None, output_names: list[str] | None = None,
                       source: str = "") -> ModelBundle:
    """Wrap a user ``nn.Module`` + example inputs (dict, tuple/list or one tensor) into a
    ModelBundle. ``input_dims`` defaults to the example's static shapes. The module is put
    in eval mode and run once to learn its outputs."""
    where = f"model spec {source!r}" if source else "model"
    if not isinstance(module, nn.Module):
        raise CaptureError("expected an nn.Module", where=where, value=type(module).__name__,
                           fix="return (module, example_inputs) with module an nn.Module")
    module = _unwrapped(module, where)
    _notice_hooks(module)
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if isinstance(example_inputs, dict):
        positional = False
        ex = dict(example_inputs)
    elif isinstance(example_inputs, (tuple, list)):
        positional = True
        ex = dict(zip(_input_names_for(module, len(example_inputs)), example_inputs))
    else:
        raise CaptureError("example_inputs must be a dict of tensors, a tuple of tensors or a "
                           "tensor", where=where, value=type(example_inputs).__name__,
                           fix="return (module, {'x': torch.randn(...)})")
    non_t = [k for k, v in ex.items() if not isinstance(v, torch.Tensor)]
    if non_t:
        raise CaptureError(f"example inputs {non_t} are not tensors", where=where,
                           fix="pass only tensors (bake other arguments into the module)")
    if not ex:
        raise CaptureError("no example inputs", where=where, fix="give at least one tensor")
    training = [n or type(module).__name__ for n, m in module.named_modules() if m.training]
    if training:        # dropout and batch statistics are a training forward: graphmode compiles inference
        warnings.warn(GraphmodeNotice(
            f"{type(module).__name__} was in training mode ({', '.join(training[:3])}"
            f"{f' and {len(training) - 3} more' if len(training) > 3 else ''}): graphmode set it to eval(), as it "
            "compiles the inference forward (dropout off, batch norm on its running statistics). Call "
            "model.eval() before compiling to silence this"), stacklevel=3)
    module.eval()
    dims = {k: list(v.shape) for k, v in ex.items()} if input_dims is None else {
        k: list(v) for k, v in input_dims.items()}
    if set(dims) != set(ex):
        raise CaptureError("input_dims names differ from the example inputs", where=where,
                           value=sorted(dims), fix=f"give dims for exactly {list(ex)}")
    dims = {k: dims[k] for k in ex}
    for k, axes in dims.items():          # None marks a fixed axis (torch.export's dynamic_shapes): its size
        shape = tuple(getattr(ex[k], "shape", ()))
        if any(a is None for a in axes) and len(axes) == len(shape):
            dims[k] = [shape[i] if a is None else a for i, a in enumerate(axes)]
    try:
        with torch.inference_mode(), refuse_self_changes(module, where, "running on its example inputs") as probe:
            probe.again = (lambda: module(*ex.values())) if positional else (lambda: module(**ex))
            raw = probe.answer = probe.again()
    except GraphmodeError:
        raise
    except Exception as e:  # noqa: BLE001
        call = "module(*example_inputs)" if positional else "module(**example_inputs)"
        raise CaptureError(f"running the model on its example inputs failed: "
                           f"{type(e).__name__}: {e}", where=where, value=list(ex),
                           fix=f"check that {call} runs eagerly (dict keys must be forward's "
                               "parameter names)") from e
    caches = zoo.cache_outputs(raw)
    call_kwargs: dict[str, Any] = {}
    if caches:
        # an encoder-style capture does not need the KV cache the model also returns: drop it,
        # and ask the model not to build it when it can be told so
        takes = "use_cache" in _forward_params(module)
        if takes:
            call_kwargs["use_cache"] = False
        warnings.warn(GraphmodeNotice(
            f"{type(module).__name__} also returns a key/value cache ({', '.join(caches)}); graphmode drops it "
            f"and compiles the forward pass{' with use_cache=False' if takes else ''}. Set config.use_cache=False "
            "(or pass use_cache=False) to silence this."), stacklevel=2)
    try:
        structure, flat = describe(raw)
    except TypeError as e:
        raise CaptureError(f"the model's output is not made of tensors: {e}", where=where,
                           fix="make forward return a tensor, tuple or dict of tensors") from e
    if not flat:
        raise CaptureError("the model returned no tensors", where=where,
                           fix="make forward return at least one tensor")
    outs = output_names or [n for n, _ in flat]
    if len(outs) != len(flat):
        raise CaptureError(f"{len(outs)} output names for {len(flat)} outputs", where=where,
                           value=outs)
    wrapper = _make_wrapper(module, list(ex), positional, call_kwargs).eval()
    bundle = ModelBundle(name=name or type(module).__name__.lower(), module=wrapper,
                         example_inputs=ex, input_dims=dims, output_names=list(outs),
                         source=source, raw_module=module, output_structure=structure)
    if input_dims is not None and not bundle.dim_names:
        bundle.meta["static"] = True      # the caller declared every axis fixed: no batch is guessed for it
    bundle.shape_of(ex)  # validates dims against the example
    return bundle


# -------------------------------------------------------------------------------- resolve


def as_model(model: Any) -> ModelBundle | OnnxModelSpec:
    """What a user hands to `graphmode.compile` or `recipe init`, as a ModelBundle or an
    OnnxModelSpec: a model spec (built-in name, .onnx path, 'module:function'), a ModelBundle,
    (module, example_inputs[, input_dims]), or a Hugging Face model (inputs from its config).
    A plain nn.Module has no example inputs: it needs them, or a recipe (compiler.resolve_model)."""
    from graphmode.capture import hf
    if isinstance(model, (str, os.PathLike)):
        try:
            return resolve_model_spec(model)
        except BareModuleError as e:
            if not hf.is_hf_model(e.module):
                raise
            bundle = as_model(e.module)       # a Hugging Face model alone: its inputs from its config
            bundle.source = f"callable:{model}"
            return bundle
    if isinstance(model, (ModelBundle, OnnxModelSpec)):
        return model
    if type(model).__name__ == "ModelProto" and type(model).__module__.startswith("onnx"):
        return load_onnx_spec(_saved_proto(model))
    if isinstance(model, (tuple, list)):
        if 2 <= len(model) <= 3 and isinstance(model[0], nn.Module):
            return bundle_from_module(*model)
        raise CaptureError(f"cannot compile a {type(model).__name__} of {len(model)} item(s)", where="model",
                           value=[type(m).__name__ for m in model][:4],
                           fix="pass (module, example_inputs) or (module, example_inputs, input_dims)")
    if isinstance(model, nn.Module):
        if hf.is_hf_model(model):
            ex, dims = hf.example_inputs(model)
            try:
                bundle = bundle_from_module(model, ex, dims)
            except CaptureError as e:         # examples graphmode made from the config: the user gave none
                if not e.message.startswith("running the model on its example inputs failed"):
                    raise
                shapes = ", ".join(f"{k} {list(v.shape)} {str(v.dtype).removeprefix('torch.')}" for k, v in ex.items())
                raise CaptureError(f"{type(model).__name__} did not run on the example inputs graphmode made from its "
                                   f"config ({shapes}): {e.message.split(': ', 1)[1]}", where="model",
                                   fix="pass (model, example_inputs) with tensors shaped as the model expects, e.g. "
                                       "what its processor returns") from None
            bundle.dim_ranges = hf.dim_ranges(model)
            return bundle
        raise CaptureError(f"a bare {type(model).__name__} has no example inputs to read its input dtypes and "
                           "shapes from", where="model",
                           fix="pass its example inputs, e.g. graphmode.compile(model, example_inputs=(torch.randn(2, "
                               "16),)) or (module, example_inputs[, input_dims]), or give a recipe declaring them")
    raise CaptureError(f"cannot compile a {type(model).__name__}", where="model",
                       fix=f"pass an nn.Module with example inputs or a recipe, {describe_spec_forms()}, "
                           "or a ModelBundle")




def with_batch_axis(bundle: Any) -> Any:
    """A bundle handed with static shapes only, with its leading axis named `batch` when every
    input of rank 1 or more shares that extent, else None. torch.export specialises an extent of
    1, so a batch-1 example (as torch users write one) is captured from its rows repeated to 2;
    the bundle as handed stays the next try. A 0-d input (a scalar temperature, a step) has no
    batch axis and keeps its shape. Shapes the caller declared fixed, axis by axis (input_dims
    of sizes and None), stay as declared."""
    if bundle.meta.get("static"):
        return None
    ranked = {k: v for k, v in bundle.input_dims.items() if v}
    lead = {v[0] for v in ranked.values()}
    n = next(iter(lead), None)
    if len(lead) != 1 or not isinstance(n, int) or n < 1 or "batch" in bundle.dim_names:
        return None
    examples = bundle.example_inputs
    if n == 1:
        import torch
        examples = {k: torch.cat([v, v]) if k in ranked else v for k, v in examples.items()}
    import dataclasses
    return dataclasses.replace(bundle, example_inputs=examples,
                               input_dims={k: ["batch"] + list(v[1:]) if k in ranked else list(v)
                                           for k, v in bundle.input_dims.items()})


def _saved_proto(model: Any) -> Path:
    """An in-memory onnx.ModelProto (what onnxruntime.InferenceSession takes as bytes) as a file
    under the cache's onnx/ folder, named by its content: the import, the ONNX Runtime reference
    and the cache key read a file."""
    import hashlib

    import onnx

    from graphmode.paths import cache_layout
    external = [t.name for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    if external:
        raise CaptureError(f"this onnx.ModelProto refers to weights it does not hold ({len(external)} tensor(s) "
                           f"stored outside it, e.g. {external[0]!r})", where="model",
                           fix="load it with its data (onnx.load(path), load_external_data=True, the default), or "
                               "compile the .onnx file's path")
    try:
        data = model.SerializeToString()
    except ValueError as e:           # protobuf's 2 GB limit
        raise CaptureError(f"this onnx.ModelProto cannot be serialized in one piece: {e}", where="model",
                           fix="save it with onnx.save(model, path, save_as_external_data=True) and compile the "
                               "path") from None
    name = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in (model.graph.name or "model"))[:40] or "model"
    path = cache_layout().onnx / "in-memory" / f"{name}-{hashlib.sha256(data).hexdigest()[:16]}.onnx"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)         # a concurrent compile of the same model writes the same bytes
    return path


def describe_spec_forms() -> str:
    return (f"a built-in name ({', '.join(zoo.builtin_names())}), a path to an .onnx file, a folder "
            "save_pretrained() wrote, or 'package.module:function' / 'path/to/file.py:function' returning "
            "(module, example_inputs) or a ModelBundle")


def _import_callable(spec: str) -> tuple[Any, str]:
    mod_part, _, fn_part = spec.rpartition(":")
    if not mod_part or not fn_part:
        raise CaptureError("malformed 'module:function' spec", where=f"model spec {spec!r}",
                           fix="write it as package.module:function, e.g. mypkg.models:build")
    if mod_part.endswith(".py"):
        file = Path(mod_part)
        if not file.is_file():
            raise CaptureError("Python file not found", where=f"model spec {spec!r}",
                               value=str(file.resolve()), fix="check the path")
        modname = f"_graphmode_user_{abs(hash(str(file.resolve())))}"
        folder = str(file.resolve().parent)
        if folder not in sys.path:     # its own modules import as under `python file.py` (after installed ones)
            sys.path.append(folder)
        try:
            ispec = importlib.util.spec_from_file_location(modname, file)
            assert ispec is not None and ispec.loader is not None
            mod = importlib.util.module_from_spec(ispec)
            sys.modules[modname] = mod
            ispec.loader.exec_module(mod)
        except Exception as e:  # noqa: BLE001
            sys.modules.pop(modname, None)
            raise CaptureError(f"importing {file} failed: {type(e).__name__}: {e}",
                               where=f"model spec {spec!r}",
                               fix=f"fix the error in {file} (run `python {file}` to see it)"
                               ) from e
    else:
        if not all(p.isidentifier() for p in mod_part.split(".")):
            raise CaptureError(f"{mod_part!r} is not a Python module path",
                               where=f"model spec {spec!r}",
                               fix="write it as package.module:function")
        try:
            mod = importlib.import_module(mod_part)
        except ModuleNotFoundError as e:
            raise CaptureError(f"cannot import module {mod_part!r}: {e}",
                               where=f"model spec {spec!r}",
                               fix=f"make {e.name or mod_part!r} importable (install it or add its "
                                   "folder to PYTHONPATH), or use path/to/file.py:function"
                               ) from e
        except Exception as e:  # noqa: BLE001 - the module raised while importing
            raise CaptureError(f"importing module {mod_part!r} raised {type(e).__name__}: {e}",
                               where=f"model spec {spec!r}",
                               fix=f"fix the error raised while importing {mod_part}") from e
    obj: Any = mod
    for attr in fn_part.split("."):
        if not hasattr(obj, attr):
            avail = sorted(n for n, v in vars(mod).items()
                           if callable(v) and not n.startswith("_")
                           and getattr(v, "__module__", None) == mod.__name__)
            near = difflib.get_close_matches(fn_part, avail, n=3)
            hint = f"did you mean {near}? " if near else ""
            raise CaptureError(f"module {mod_part!r} has no attribute {fn_part!r}",
                               where=f"model spec {spec!r}",
                               fix=f"{hint}callables defined there: {avail[:20]}")
        obj = getattr(obj, attr)
    if not callable(obj):
        raise CaptureError(f"{fn_part!r} in {mod_part!r} is not callable",
                           where=f"model spec {spec!r}", value=type(obj).__name__,
                           fix="point at a function returning (module, example_inputs)")
    return obj, fn_part


class BareModuleError(CaptureError):
    """A model spec's function returned an nn.Module alone: a recipe declaring its inputs can
    still compile it (capture.source.resolve_model takes `module`), and a Hugging Face model
    has its inputs in its config (`as_model`)."""

    def __init__(self, module: nn.Module, message: str, **kw: Any):
        super().__init__(message, **kw)
        self.module = module


def _from_callable(spec: str) -> ModelBundle:
    fn, fn_name = _import_callable(spec)
    try:
        ret = fn()
    except Exception as e:  # noqa: BLE001
        raise CaptureError(f"calling {fn_name}() raised {type(e).__name__}: {e}",
                           where=f"model spec {spec!r}",
                           fix=f"make {fn_name}() runnable with no arguments") from e
    expected = ("a ModelBundle, (module, example_inputs) or (module, example_inputs, "
                "input_dims)")
    if isinstance(ret, ModelBundle):
        if not ret.source:
            ret.source = f"callable:{spec}"
        return ret
    if isinstance(ret, nn.Module):
        raise BareModuleError(ret, f"{fn_name}() returned a bare {type(ret).__name__} without example inputs",
                              where=f"model spec {spec!r}",
                              fix=f"return (module, example_inputs) from {fn_name}(), or give a recipe that "
                                  "declares its inputs (--recipe)")
    if not isinstance(ret, (tuple, list)) or len(ret) not in (2, 3):
        raise CaptureError(f"{fn_name}() returned {type(ret).__name__}, expected {expected}",
                           where=f"model spec {spec!r}", fix=f"return {expected}")
    module, ex = ret[0], ret[1]
    dims = ret[2] if len(ret) == 3 else None
    if not isinstance(module, nn.Module):
        raise CaptureError(f"{fn_name}() returned {type(module).__name__} as the module, "
                           f"expected an nn.Module", where=f"model spec {spec!r}",
                           fix=f"return {expected}")
    if dims is not None and not isinstance(dims, dict):
        raise CaptureError("input_dims must be a dict {input name: [dims]}",
                           where=f"model spec {spec!r}", value=type(dims).__name__)
    name = fn_name.split(".")[-1]
    for pre in ("build_", "make_", "get_", "create_"):
        if name.startswith(pre) and len(name) > len(pre):
            name = name[len(pre):]
    return bundle_from_module(module, ex, dims, name=name, source=f"callable:{spec}")


def _from_hf_folder(folder: Path) -> ModelBundle:
    from graphmode.capture import hf
    module, tokenizer = hf.load_folder(folder)
    bundle = as_model(module)
    bundle.name, bundle.source, bundle.tokenizer = folder.resolve().name, f"hf:{folder.resolve()}", tokenizer
    return bundle


def resolve_model_spec(spec: str | os.PathLike, *, seed: int = 0, **build_kwargs: Any
                       ) -> ModelBundle | OnnxModelSpec:
    """Turn a model spec into a ModelBundle (built-in or callable) or an OnnxModelSpec.

    ``seed`` and ``build_kwargs`` go to the built-in builder (e.g.
    ``resolve_model_spec("gpt2", attn_implementation="eager")``).
    """
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    if not isinstance(spec, str):
        raise CaptureError("model spec must be a string", where="model spec",
                           value=type(spec).__name__, fix=f"give {describe_spec_forms()}")
    s = spec.strip()
    if not s:
        raise CaptureError("empty model spec", where="model spec",
                           fix=f"give {describe_spec_forms()}")
    key = zoo.ALIASES.get(s.lower(), s.lower())
    if key in zoo.BUILTINS:
        return zoo.build(key, seed, **build_kwargs)
    if build_kwargs:
        raise CaptureError(f"build options {sorted(build_kwargs)} only apply to built-in models",
                           where=f"model spec {spec!r}")
    from graphmode.untrusted import is_artifact
    if s.lower().endswith(".onnx") and not is_artifact(s):
        return load_onnx_spec(s, spec=spec)
    p = Path(s)
    # "module:function" (a Windows drive letter "C:\\..." is not one)
    if ":" in s and not (len(s) > 2 and s[1] == ":" and s[2] in "\\/"):
        return _from_callable(s)
    if p.exists():
        if p.is_file():
            if p.suffix == ".py":
                raise CaptureError("a Python file needs the function to call",
                                   where=f"model spec {spec!r}", value=str(p.resolve()),
                                   fix=f"write '{s}:function' where function() returns "
                                       "(module, example_inputs) or a ModelBundle")
            if is_artifact(p):      # run, generate and serve load one; this command compiles from a source
                raise CaptureError("a saved .gm holds plans compiled already, and this compiles the model from its "
                                   "source", where=f"model spec {spec!r}", value=str(p.resolve()),
                                   fix="give the model it was saved from, or load the .gm: graphmode.load(path) in "
                                       "Python; `graphmode run` (which times it and checks it with the reference "
                                       "interpreter), `generate` or `serve` on the command line")
            raise CaptureError(f"unsupported model file type {p.suffix or '(none)'!r}",
                               where=f"model spec {spec!r}", value=str(p.resolve()),
                               fix="give an .onnx file, or a 'module:function' that loads this "
                                   "file and returns (module, example_inputs)")
        if (p / "config.json").is_file():
            return _from_hf_folder(p)
        raise CaptureError("model spec is a directory without a config.json (not a Hugging Face save_pretrained "
                           "folder)", where=f"model spec {spec!r}", value=str(p.resolve()),
                           fix="point at the .onnx file inside it, a 'file.py:function' that loads it, or a folder "
                               "save_pretrained() wrote")
    near = difflib.get_close_matches(s.lower(), zoo.builtin_names() + list(zoo.ALIASES), n=1)
    hint = f"did you mean {zoo.ALIASES.get(near[0], near[0])!r}? " if near else ""
    tried = ("not a built-in name, not an existing file, not an .onnx path and not a "
             "'module:function'")
    if s.endswith(".py"):
        hint += f"to load a model from a Python file write '{s}:function'; "
    raise CaptureError(f"unknown model {s!r}: {tried}", where=f"model spec {spec!r}",
                       fix=f"{hint}use {describe_spec_forms()}")
