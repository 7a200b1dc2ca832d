"""The ONNX importer's graph inputs: each model input bound to an IR input whose dims are the
recipe's (input_dims, dim_params, fixed extents), and the recipe's dim ranges."""
from __future__ import annotations

import re

from graphmode.capture.onnx.fold import DEFAULT_RANGE, _Known
from graphmode.capture.onnx.values import _deq
from graphmode.capture.onnx.checks import ONNX_DTYPES as _ONNX_DTYPES
from graphmode.errors import CaptureError
from graphmode.ir.graph import clean_name
from graphmode.ir.types import Dim, TensorType, dim_str, normalize_dim, sym


_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def dim_names(params) -> dict[str, str]:
    """A recipe dim name for each of a model's dim_params (in input order): the param itself where it
    is an identifier, else its letters, digits and '_' ("p2o.DynamicDimension.0" ->
    "p2o_DynamicDimension_0", "batch size" -> "batch_size", "2" -> "d_2"), made distinct from
    every other; a param with none of those ("?") is left out (an unnamed dim)."""
    params = list(dict.fromkeys(params))
    taken = {p for p in params if _IDENT.fullmatch(p)}
    out = {p: p for p in taken}
    for p in params:
        if p in out:
            continue
        name = re.sub(r"[^A-Za-z0-9_]+", "_", p).strip("_")
        if not name:
            continue
        name = f"d_{name}" if name[0].isdigit() else name
        while name in taken:
            name += "_"
        taken.add(name)
        out[p] = name
    return out


class InputBinder:
    """Mixin of _Importer: `bind_inputs` runs once, before any node is translated."""

    def bind_inputs(self, init_names: set[str]) -> None:
        onnx_inputs = [vi for vi in self.gp.input if vi.name not in init_names]
        names = [vi.name for vi in onnx_inputs]
        # a recipe names an input as the IR spells it ("x:0" -> "x_0")
        spelled = {clean_name(n): n for n in names if clean_name(n) not in names}
        self._check_recipe_names(names, spelled)
        self.input_dims = {spelled.get(k, k): v for k, v in self.input_dims.items()}
        self.input_values = {spelled.get(k, k): v for k, v in self.input_values.items()}
        named = dim_names(d.dim_param for vi in onnx_inputs if vi.type.tensor_type.HasField("shape")
                          for d in vi.type.tensor_type.shape.dim if d.HasField("dim_param"))
        for vi in onnx_inputs:   # validate_onnx checked: tensor types with a graphmode dtype
            tt = vi.type.tensor_type
            dtype = _ONNX_DTYPES[tt.elem_type]
            want = self.input_dims.get(vi.name)
            dims_p = list(tt.shape.dim) if tt.HasField("shape") else None
            field = f"the recipe's {self.recipe_field.get(vi.name, 'inputs[]')}.shape"
            if dims_p is None and want is None:
                raise CaptureError(f"input {vi.name!r} has no shape in the model", where=f"onnx {self.label}",
                                   fix=f"give its dims in {field} (dim names or integers)")
            rank = len(dims_p) if dims_p is not None else len(want)
            if want is not None and len(want) != rank:
                raise CaptureError(f"input {vi.name!r} has rank {rank} in the model but {field} gives "
                                   f"{len(want)} dims", where=f"onnx {self.label}", value=list(want),
                                   fix=f"give {field} one entry per dim of the model's input ({rank})")
            shape: list[Dim] = []
            for i in range(rank):
                d = dims_p[i] if dims_p is not None else None
                w = want[i] if want is not None else None
                static = int(d.dim_value) if d is not None and d.HasField("dim_value") else None
                param = d.dim_param if d is not None and d.HasField("dim_param") else None
                if w is not None:
                    wd = normalize_dim(w)
                    if static is not None and isinstance(w, str) and self._fixed_dim(w) == static:
                        wd = static     # a recipe dim pinned to the model's own fixed extent
                    if static is not None and (not isinstance(wd, int) or wd != static):
                        raise CaptureError(f"input {vi.name!r} dim {i} is fixed to {static} in the model, but "
                                           f"{field}[{i}] says {w!r}", where=f"onnx {self.label}", value=w,
                                           fix="re-export with a dynamic axis there (dynamic_axes / dynamic_shapes)"
                                               f" or declare it as {static} in the recipe")
                    dim = wd
                elif static is not None:
                    dim = static
                elif param is not None:
                    if param not in named:
                        raise CaptureError(f"input {vi.name!r} dim {i} is named {param!r}, which is not a dim name",
                                           where=f"onnx {self.label}", fix=f"name the dim in {field}[{i}]")
                    dim = sym(named[param])
                else:
                    raise CaptureError(f"input {vi.name!r} dim {i} has neither a size nor a name",
                                       where=f"onnx {self.label}", fix=f"name the dim in {field}[{i}]")
                if param is not None:
                    prev = self.dimmap.setdefault(param, dim)
                    if not _deq(prev, dim):
                        raise CaptureError(f"model dim {param!r} maps to both {dim_str(prev) if not isinstance(prev, int) else prev} "
                                           f"and {dim_str(dim) if not isinstance(dim, int) else dim}",
                                           where=f"onnx {self.label} input {vi.name!r}",
                                           fix="use one dim name for it in every recipe inputs[].shape")
                shape.append(dim)
            ty = TensorType(dtype, tuple(shape))
            self.ir[vi.name] = self.g.add_input(self.g.fresh_name(clean_name(vi.name)), ty)
            if vi.name in self.input_values:
                self._bind_constant_input(vi.name, ty)
        used: set[str] = set()
        for n in self.g.inputs:
            for d in self.g.values[n].type.shape:
                if not isinstance(d, int):
                    used |= {s.name for s in d.free_symbols}
        if self.user_dims is not None:
            missing = sorted(used - set(self.user_dims))
            if missing:
                raise CaptureError(f"input dims {missing} have no range in dims", where=f"onnx {self.label}",
                                   value=sorted(self.user_dims),
                                   fix="declare every dynamic dim in the recipe's dims (or map the model's dim "
                                       "names in the recipe's inputs[].shape)")
            self.g.dims = dict(self.user_dims)
        else:
            from graphmode.capture.zoo import DEFAULT_DIM_RANGES
            self.g.dims = {d: DEFAULT_DIM_RANGES.get(d, DEFAULT_RANGE) for d in sorted(used)}

    def _check_recipe_names(self, names: list[str], spelled: dict[str, str]) -> None:
        """Every input the recipe declares is one of the model's. `input_dims` holds the recipe's inputs
        in its order, so errors name the fields a user writes (inputs[k].name, inputs[k].shape)."""
        self.recipe_field = {spelled.get(k, k): f"inputs[{i}]" for i, k in enumerate(self.input_dims)}
        unknown = [(f"inputs[{i}]", k) for i, k in enumerate(self.input_dims) if spelled.get(k, k) not in names]
        if unknown:
            said = ", ".join(f"{f}.name {k!r}" for f, k in unknown)
            raise CaptureError(f"the recipe's {said}: an input the ONNX model does not have",
                               where=f"onnx {self.label}", value=[k for _, k in unknown],
                               fix=f"name the model's inputs in the recipe's inputs[].name: they are {names}")

    def _bind_constant_input(self, name: str, ty: TensorType) -> None:
        """An input the recipe declares constant: known to the converters (shape-like data folds),
        still a graph input (the runtime checks each call's value against the declared one)."""
        t = self.input_values[name]
        if list(t.shape) != list(ty.shape) or TensorType.of(t).dtype != ty.dtype:
            raise CaptureError(f"input {name!r} is {ty.text()} in the model, but its declared value is "
                               f"{TensorType.of(t).text()}", where=f"onnx {self.label}",
                               fix="give the value in the input's dtype and shape")
        self.known[name] = _Known.of(t)

    def _fixed_dim(self, name: str) -> int | None:
        """The one value a recipe dim admits (`d: 3` or min == max), else None."""
        lo_hi = (self.user_dims or {}).get(name)
        return lo_hi[0] if lo_hi is not None and lo_hi[0] == lo_hi[1] else None


def _unshaped(vis, skip=frozenset()) -> list:
    return [vi for vi in vis if vi.name not in skip and vi.type.HasField("tensor_type")
            and not vi.type.tensor_type.HasField("shape")]


def with_shapes(model, input_dims, label: str):
    """`model` (a copy, where it changes) with a shape on every graph input and output that has none.

    ONNX Runtime runs a model whose inputs have no shape at all (any shape is taken); onnx.checker
    requires one. An input's shape is the recipe's (inputs[k].shape: a recipe must declare it, there
    is nothing to draft it from); an output's is what ONNX's shape inference finds for it."""
    inits = {i.name for i in model.graph.initializer}
    ins, outs = _unshaped(model.graph.input, inits), _unshaped(model.graph.output)
    if not ins and not outs:
        return model
    import onnx
    out = onnx.ModelProto()
    out.CopyFrom(model)
    spelled = {clean_name(vi.name): vi.name for vi in model.graph.input}
    given = {spelled.get(k, k): (v, f"inputs[{i}]") for i, (k, v) in enumerate((input_dims or {}).items())}
    for vi in _unshaped(out.graph.input, inits):
        if vi.name not in given:
            raise CaptureError(f"input {vi.name!r} has no shape in the ONNX model (ONNX Runtime takes any), so "
                               "graphmode cannot tell its rank or dims", where=f"onnx {label}",
                               fix=f"declare it in a recipe's inputs[] (name: {vi.name}, and its shape as dim names "
                                   "or integers, e.g. [batch, 4]) and compile with that recipe; a recipe drafted "
                                   "from the file has nothing to take it from")
        _set_shape(vi.type.tensor_type, given[vi.name][0])
    scalars = [(vi.name, given[vi.name][1]) for vi in ins if not list(given[vi.name][0])]
    if scalars:
        _check_scalars(out, scalars, label)
    if outs:
        _infer_output_shapes(out, label)
    return out


def _check_scalars(model, scalars: list[tuple[str, str]], label: str) -> None:
    """Inputs without a shape that the recipe declares 0-d (shape []: what a draft writes for an input
    the file gives no shape, having nothing to take one from): refused, naming the recipe field,
    where ONNX's shape inference finds a node that cannot take a 0-d tensor there."""
    import onnx
    try:
        onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    except Exception as e:  # noqa: BLE001 - onnx.shape_inference.InferenceError and friends
        name, field = scalars[0]
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CaptureError(f"input {name!r} has no shape in the ONNX model (ONNX Runtime takes any), and the recipe's "
                           f"{field}.shape is [] (a 0-d tensor), which the model cannot take: {text}",
                           where=f"onnx {label}", value=[],
                           fix=f"declare its shape in the recipe's {field}.shape (dim names or integers, e.g. "
                               "[batch, 4]) and compile with that recipe: a recipe drafted from the file has nothing "
                               "to take the shape from") from None


def _set_shape(tt, dims) -> None:
    shape = tt.shape
    del shape.dim[:]
    for d in dims:
        entry = shape.dim.add()
        if isinstance(d, int):
            entry.dim_value = d
        else:
            entry.dim_param = str(d)


def _infer_output_shapes(model, label: str) -> None:
    """Each output without a shape gets the one ONNX's shape inference finds (refused where none)."""
    import onnx
    try:
        inferred = onnx.shape_inference.infer_shapes(model).graph
    except Exception:  # noqa: BLE001 - the validator names what is inconsistent
        inferred = model.graph
    found = {v.name: v.type.tensor_type for v in (*inferred.output, *inferred.value_info)
             if v.type.HasField("tensor_type") and v.type.tensor_type.HasField("shape")}
    local = {(f.domain, f.name) for f in model.functions}
    for vi in _unshaped(model.graph.output):
        made = next(((i, n) for i, n in enumerate(model.graph.node) if vi.name in n.output), None)
        if vi.name not in found and made is not None and made[1].domain not in ("", "ai.onnx") \
                and (made[1].domain, made[1].op_type) not in local:
            i, n = made        # the op itself is what fails: ONNX infers no shape through another domain's op
            kind = "ONNX Runtime's contrib ops" if n.domain == "com.microsoft" else "a custom domain"
            raise CaptureError(f"output {vi.name!r} is made by #{i} {n.op_type} of domain {n.domain!r} ({kind}), an op "
                               "outside ONNX's default domain, which graphmode does not import", where=f"onnx {label}",
                               fix="export the model without ONNX Runtime's graph optimizations (the file "
                                   "torch.onnx.export or your exporter wrote, before onnxruntime fused it)")
        if vi.name not in found:
            raise CaptureError(f"output {vi.name!r} has no shape in the ONNX model and ONNX's shape inference "
                               "finds none", where=f"onnx {label}",
                               fix="give it a shape in the model (one entry per axis, None where unknown: "
                                   "onnx.helper.make_tensor_value_info(name, elem_type, [None, None]))")
        vi.type.tensor_type.shape.CopyFrom(found[vi.name].shape)
