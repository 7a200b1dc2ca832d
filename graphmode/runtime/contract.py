"""A compiled model's input contract: bind a call's arguments to the recipe's inputs, check
dtypes, ranks, constants and fixed dims, the values the model's tables and the recipe's ranges
admit (runtime/bounds.py), and find the bucket a shape runs in."""
from __future__ import annotations

import inspect
from typing import Any, Mapping

import torch

from graphmode.errors import ContractViolation, GraphmodeError
from graphmode.runtime.shaping import has_eager, or_eager


# options a Hugging Face forward takes through **kwargs (transformers 5): fixed when it was compiled
HF_CALL_OPTIONS = ("return_dict", "output_hidden_states", "output_attentions", "use_cache")

class InputContract:
    """CompiledModel's input checks (a mixin: it reads the model's recipe, signature, verdict,
    graphs and source)."""

    _grad_said = False

    def _fill_omitted(self, name: str, named: dict[str, Any]) -> bool:
        """Put in an input the call left out that the eager model treats as optional (an HF
        attention_mask of ones, token types of zeros: ModelSource.omitted_value), shaped like a
        given input declared with the same dims. False when it is not optional there."""
        source = getattr(self, "source", None)
        if source is None or not hasattr(source, "omitted_value"):
            return False
        specs = {s.name: s for s in self.recipe.inputs}
        like = next((named[k] for k in named if k in specs and isinstance(named[k], torch.Tensor)
                     and list(specs[k].shape) == list(specs[name].shape)), None)
        if like is None:
            return False
        value = source.omitted_value(name)
        if value is None:
            return False
        from graphmode.ir.types import DTYPES
        named[name] = torch.full(tuple(like.shape), value, dtype=DTYPES[specs[name].dtype])
        return True

    def before_lowered_checks(self, inputs: Mapping[str, torch.Tensor]) -> None:
        """Checks a model whose graph is lowered on first use (runtime/deferred.py) makes before
        that; a lowered model makes them with the rest."""

    def bind_inputs(self, args: tuple, kwargs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        if self._signature is not None:
            try:
                bound = self._signature.bind_partial(*args, **kwargs)
                named = dict(bound.arguments)
            except TypeError as e:
                trimmed = _at_compiled_values(self, args, kwargs)
                if trimmed is not None:
                    return self.bind_inputs(*trimmed)
                raise self._not_compiled_with(kwargs) or ContractViolation(
                    f"arguments do not match the model's signature: {e}",
                    fix=f"call with {', '.join(self.input_names)}") from None
        else:      # an ONNX model or a loaded artifact: positions as the model's forward had them
            order = list(getattr(self, "positional", None) or self.input_names)
            if len(args) > len(order):
                raise ContractViolation(f"got {len(args)} positional inputs, the model takes {len(order)}",
                                        fix=f"inputs: {', '.join(order)}")
            named = dict(zip(order, args))
            twice = [k for k in kwargs if k in named]
            if twice:
                raise ContractViolation(f"inputs {twice} given both by position and by name", where="inputs",
                                        fix=f"give each input once (positions: {', '.join(order)})")
            named.update(kwargs)
        params = self._signature.parameters if self._signature is not None else {}
        named = {k: v for k, v in named.items()       # an explicit None (unless a default says otherwise): omitted
                 if v is not None or (k in params and params[k].default not in (None, params[k].empty))}
        named = _ir_spelled(named, self.input_names)
        unknown = [k for k in named if k not in self.input_names]
        if unknown:
            consts = _file_constants(getattr(self.source, "onnx_path", None), unknown)
            if consts:
                raise ContractViolation(f"inputs {consts} are initializers of the ONNX file (graph inputs with a "
                                        "stored value): graphmode compiles them as constants, so a value given "
                                        "for them would not be used", where="inputs", value=consts,
                                        fix="leave them out (the file's values are used), or re-export the model "
                                            "with them as graph inputs without an initializer to feed them")
            raise ContractViolation(f"unknown inputs {unknown}", where="inputs",
                                    fix=f"the recipe declares {', '.join(self.input_names)}")
        for k, t in named.items():      # before the omitted inputs are filled in: they copy a given tensor's shape
            if isinstance(t, torch.Tensor) and _traced(t):
                raise GraphmodeError("the compiled model was called while torch traces a model around it "
                                     "(torch.export, make_fx: its inputs are fake tensors): its plans would be "
                                     "recorded as constants, answering every later call the same",
                                     where=f"inputs.{k}", fix="export or trace the eager model itself, or "
                                     "graphmode.compile the module that calls it")
            if isinstance(t, torch.Tensor) and t.requires_grad and torch.is_grad_enabled() and not self._grad_said:
                self._grad_said = True          # said once: the outputs are cut from autograd, as plans run no backward
                import warnings

                from graphmode.capture.spec import GraphmodeNotice
                warnings.warn(GraphmodeNotice(f"input {k!r} requires grad, and a compiled model runs inference only: "
                                              "its outputs carry no gradient (backward() through them fails). "
                                              "Call it under torch.no_grad() or inference_mode(), or train the eager "
                                              "module"), stacklevel=4)
            if not isinstance(t, torch.Tensor):
                kind = type(t).__name__
                raise ContractViolation(f"input {k!r} must be a tensor", where=f"inputs.{k}", value=kind,
                                        fix=f"pass torch.from_numpy({k})" if kind == "ndarray"
                                        else f"pass torch.tensor({k})" if isinstance(t, (list, tuple, int, float, bool))
                                        else "pass a torch.Tensor")
        missing = [k for k in self.input_names if k not in named and not self._fill_omitted(k, named)]
        if missing:
            optional = [k for k in missing if k in _none_defaults(getattr(getattr(self, "source", None), "module", None))]
            why = (f": forward takes {optional} as optional, and the compiled graph takes them as inputs; "
                   "graphmode fills one in only with a constant it checked against eager at capture (an "
                   "integer example holding one value, as a mask of ones; not a mask the model builds from "
                   "the ids), so here a compiled call cannot stand in for None" if optional else "")
            fix = f"pass every declared input: {', '.join(self.input_names)}"
            if optional:
                fix += (f" (the value None means for your model, e.g. {optional[0]}=torch.zeros(...)), or compile "
                        f"with example inputs that leave {optional[0]} out")
            raise ContractViolation(f"missing inputs {missing}{why}", where="inputs", fix=fix)
        out = {}
        for spec in self.recipe.inputs:
            t = named[spec.name]
            if t.is_meta:               # shapes without data: nothing to compute on
                raise ContractViolation(f"input {spec.name!r} is a meta tensor (a shape without data)",
                                        where=f"inputs.{spec.name}", value="device meta",
                                        fix="pass a tensor with data (materialise it, e.g. torch.empty_like(x, "
                                            "device='cpu'), or load the real values)")
            if t.layout != torch.strided or t.is_nested:
                how = "nested" if t.is_nested else str(t.layout).replace("torch.", "").strip("_")
                raise ContractViolation(f"input {spec.name!r} is a {how} tensor; the plans read dense strided "
                                        "tensors", where=f"inputs.{spec.name}", value=how, kind="input",
                                        fix="send x.to_dense() (a nested tensor: torch.nested.to_padded_tensor(x, 0), "
                                            "with a mask where the model takes one)")
            from graphmode.ir.types import DTYPES
            if t.dtype != DTYPES[spec.dtype]:
                raise ContractViolation(f"input {spec.name!r} has dtype {t.dtype}, the recipe declares {spec.dtype}",
                                        where=f"inputs.{spec.name}.dtype", fix=f"convert it: x.to({DTYPES[spec.dtype]})")
            if t.dim() != len(spec.shape):
                raise ContractViolation(f"input {spec.name!r} has rank {t.dim()}, the recipe declares "
                                        f"{spec.shape}", where=f"inputs.{spec.name}.shape", value=tuple(t.shape),
                                        fix=f"send a {len(spec.shape)}-d tensor shaped {spec.shape}")
            if spec.value is not None and not torch.equal(t, self._constants[spec.name]):
                raise ContractViolation(f"input {spec.name!r} differs from the value the recipe declares constant "
                                        "(the model was compiled for that value)", where=f"inputs.{spec.name}.value",
                                        value=t.tolist() if t.numel() <= 16 else tuple(t.shape),
                                        fix=f"send {spec.value}, or compile with a recipe declaring the new value")
            out[spec.name] = t
        self.before_lowered_checks(out)
        mutated = getattr(self, "mutated_inputs", None)
        if mutated:
            refuse_aliased_updates(out, mutated)
        return out

    def _not_compiled_with(self, kwargs: Mapping[str, Any]) -> ContractViolation | None:
        """Arguments the user's forward takes that the compiled model was not compiled with (an
        input the draft or the examples left out, LayoutLM's bbox; an option such as return_dict):
        named as such, with how to compile with them, or None."""
        module = getattr(getattr(self, "source", None), "module", None)
        inner = getattr(module, "model", module)
        import inspect
        try:
            params = inspect.signature(inner.forward).parameters
        except (AttributeError, TypeError, ValueError):
            return None
        takes_kw = any(p.kind is p.VAR_KEYWORD for p in params.values()) and hasattr(inner, "config")
        extra = [k for k in kwargs if k not in self.input_names and (k in params or takes_kw and k in HF_CALL_OPTIONS)]
        options = [k for k in extra if not isinstance(kwargs[k], torch.Tensor)]
        if options:       # a Python option: part of the model's code, fixed when it was compiled
            return ContractViolation(
                f"{options} {'is an option' if len(options) == 1 else 'are options'} of {type(inner).__name__}.forward "
                f"(not tensors), which a compiled model holds at the value it was compiled with (its default)",
                where="inputs", value=options,
                fix="compile a module with the option set, e.g. functools.partial of forward or a small wrapper "
                    f"module whose forward calls the model with {options[0]}={kwargs[options[0]]!r}; a config option "
                    "(return_dict, output_attentions): set it in the model's config")
        if not extra:
            return None
        return ContractViolation(
            f"{extra} {'is a parameter' if len(extra) == 1 else 'are parameters'} of {type(inner).__name__}.forward "
            f"that this model was not compiled with (it takes {', '.join(self.input_names)})", where="inputs",
            value=extra, fix="compile with example inputs that include them, e.g. graphmode.compile((model, "
                             "{" + ", ".join(f"'{k}': ..." for k in [*self.input_names[:1], extra[0]]) + "})); a call "
                             "option (return_dict, output_attentions) is fixed at compile: set it in the model's config")

    def takes_return_dict(self) -> bool:
        """A Hugging Face model compiled without `return_dict` as an input: its forward takes it."""
        module = getattr(getattr(self, "source", None), "module", None)
        inner = getattr(module, "model", module)          # the capture's wrapper holds the model
        return "return_dict" not in self.input_names and hasattr(getattr(inner, "config", None), "return_dict")

    def call_with_return_dict(self, args: tuple, kwargs: Mapping[str, Any]) -> Any:
        """The call without `return_dict`; with `return_dict=False`, eager's tuple of the set fields."""
        kw = dict(kwargs)
        as_tuple = kw.pop("return_dict") is False
        out = self(*args, **kw)
        return out.to_tuple() if as_tuple and hasattr(out, "to_tuple") else out

    def bounds(self) -> tuple[list, list]:
        """(value checks, dim checks) of runtime/bounds.py, from the verdict's index analysis (or
        the graph's, for a model loaded from an artifact)."""
        if self._bounds is None:
            from graphmode.runtime.bounds import dim_checks, value_checks
            index = getattr(self.verdict, "index", None)
            graph = self.captured_graph if self.captured_graph is not None else self.graph
            if index is None and graph is not None:
                from graphmode.analysis.indices import analyze_indices
                index = analyze_indices(graph)
            self._bounds = (value_checks(self.recipe, index), dim_checks(index))
        return self._bounds

    def check_inputs(self, inputs: Mapping[str, torch.Tensor], dims: Mapping[str, int] | None = None) -> None:
        """Refuse (ContractViolation) values the model's tables or the recipe's ranges exclude,
        and dims past the model's positions: before any plan or eager fallback runs."""
        values, limits = self.bounds()
        if limits:
            from graphmode.runtime.bounds import check_dims
            admitted = {c.dim: self.recipe.dim_range(c.dim) for c in limits
                        if self.recipe.on_violation == "error" and c.dim in self.recipe.dims}
            check_dims(self.shape_of(inputs) if dims is None else dims, limits, admitted)
        if values:
            from graphmode.runtime.bounds import check_values
            check_values(inputs, values)

    def sample_inputs(self, env: Mapping[str, int], seed: int = 0) -> dict[str, torch.Tensor]:
        """The model source's sample inputs at `env`, index inputs drawn inside the model's tables."""
        from graphmode.runtime.bounds import draw_within
        if self.source.bundle is None and self.source.module is None:   # a loaded artifact: the recipe's inputs
            from graphmode.capture.source import example_inputs_from_recipe
            drawn = example_inputs_from_recipe(self.recipe, sizes=dict(env), seed=seed)
        else:
            drawn = self.source.make_inputs(dict(env), seed=seed)
        return draw_within(drawn, self.bounds()[0], seed)

    def shape_of(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, int]:
        dims: dict[str, int] = {}
        for spec in self.recipe.inputs:
            t = inputs[spec.name]
            for ax, d in enumerate(spec.shape):
                size = int(t.shape[ax])
                if isinstance(d, int):
                    if size != d:
                        raise ContractViolation(f"input {spec.name!r} axis {ax} must be {d}",
                                                where=f"inputs.{spec.name}.shape[{ax}]", value=size,
                                                fix=f"send {spec.name} shaped {spec.shape}" + self._drafted_axis())
                elif dims.setdefault(d, size) != size:
                    fix = "inputs sharing a dim must agree on its size"
                    if getattr(self, "drafted", False):      # a draft tied them (a two-tower model's batches)
                        fix += (f"; graphmode drafted the recipe and named both axes {d!r}: to let them differ "
                                f"(N images x M texts), compile with dynamic_shapes= giving each input's axis a Dim "
                                f"of its own, e.g. {{{spec.name!r}: {{{ax}: Dim('{spec.name}_{d}')}}, ...}}, or write "
                                "a recipe with two dims")
                    raise ContractViolation(f"dim {d!r} is {dims[d]} in one input but {size} in {spec.name!r}",
                                            where=f"inputs.{spec.name}.shape[{ax}]", value=size, fix=fix)
        return dims

    def _drafted_axis(self) -> str:
        """Why a drafted recipe kept an axis at the example's size, and what would make it vary."""
        note = (getattr(self, "draft_notes", None) or {}).get("inputs")
        if not note:
            return ""
        if "as declared" in note:
            return "; the axis was declared fixed (input_dims): name it there (e.g. 'batch') to vary it"
        if "cannot keep it dynamic" in note:     # torch.export fixed it: no way of compiling varies it
            return (f"; graphmode drafted the recipe from your example ({note}): compile once per size you send, "
                    "or run the model with exe_mode: eager")
        if getattr(getattr(self, "source", None), "onnx_path", None) is not None:     # the file fixed it
            return ("; the ONNX file fixes this axis (its exporter wrote a number, not a name): export it again with "
                    "the axis dynamic (torch.onnx.export(..., dynamic_axes= / dynamic_shapes=)), then draft again")
        return (f"; graphmode drafted the recipe (from your example, or the model's config) and kept this axis at its "
                f"size ({note}): to vary it, compile with dynamic_shapes= (torch.export's Dims) or (module, "
                "example_inputs, input_dims)")

    def bucket_for(self, dims: Mapping[str, int]) -> dict[str, int] | None:
        return self.recipe.bucket_for(dict(dims))

    def _violation(self, dims: Mapping[str, int]) -> ContractViolation:
        for d, v in dims.items():
            lo, hi = self.recipe.dim_range(d)
            if v == 0:          # a recipe's dims start at 1: widening cannot admit it
                return ContractViolation(f"dim {d!r} = 0: an empty request is outside every recipe (dims start at 1)",
                                         where=f"dims.{d}", value=v,
                                         fix=f"send at least one along {d}, {or_eager(self, d)}")
            if not lo <= v <= hi:
                widen = f"widen dims.{d} in the recipe, " if has_eager(self) else ""   # an artifact keeps its recipe
                return ContractViolation(f"dim {d!r} = {v} is outside the recipe's range [{lo}, {hi}]",
                                         where=f"dims.{d}", value=v,
                                         fix=f"send {d} within [{lo}, {hi}], {widen}{or_eager(self, d)}")
        return ContractViolation(f"no bucket holds shape {dict(dims)}", where="dims", value=dict(dims),
                                 fix="add a bucket that covers it")


def positional_names(cm: Any) -> list[str]:
    """The parameters a call's positional arguments bind to, as the model's forward has them (a
    loaded artifact has no forward; the recipe may list the inputs in another order)."""
    sig = getattr(cm, "_signature", None)
    if sig is None:
        return list(getattr(cm, "positional", None) or [])
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [n for n, p in sig.parameters.items() if p.kind in positional]


def omitted_constants(cm: Any) -> dict[str, int]:
    """The inputs a call may leave out, with the constant each stands for (ModelSource.omitted_value,
    which runs the eager model): what a saved artifact, without the model, still fills in."""
    source = getattr(cm, "source", None)
    if source is None or getattr(source, "module", None) is None:
        return dict(getattr(source, "__dict__", {}).get("_omitted") or {})
    optional = _none_defaults(source.module)
    found = {n: source.omitted_value(n) for n in cm.input_names if n in optional}
    return {n: v for n, v in found.items() if v is not None}


def _at_compiled_values(cm: Any, args: tuple, kwargs: Mapping[str, Any]) -> tuple[tuple, dict] | None:
    """The call without the Python options it passes at the value the model was compiled with (its
    forward's default: `temperature=1.0` where forward says `temperature: float = 1.0`), by keyword
    or by position, as keywords; None when there are none (the call is refused as it was)."""
    module = getattr(getattr(cm, "source", None), "module", None)
    try:
        sig = inspect.signature(getattr(module, "model", module).forward)
        bound = sig.bind_partial(*args, **kwargs).arguments
    except (AttributeError, TypeError, ValueError):
        return None
    params = sig.parameters
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params.values()):
        return None
    same = [k for k, v in bound.items() if k not in cm.input_names and not isinstance(v, torch.Tensor)
            and params[k].default is not params[k].empty and type(v) is type(params[k].default)
            and v == params[k].default]
    if not same:
        return None
    return (), {k: v for k, v in bound.items() if k not in same}


def _none_defaults(module: Any) -> set[str]:
    """The parameters the user's forward (inside graphmode's wrapper, if any) defaults to None."""
    inner = getattr(module, "model", module)
    try:
        return {n for n, p in inspect.signature(inner.forward).parameters.items() if p.default is None}
    except (AttributeError, TypeError, ValueError):
        return set()


def _extent(t: torch.Tensor) -> tuple[int, int, int]:
    """(storage address, first byte, end byte) of the memory `t` reads."""
    size = t.element_size()
    last = t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 0)
    return t.untyped_storage().data_ptr(), t.storage_offset() * size, (last + 1) * size


def refuse_aliased_updates(inputs: Mapping[str, torch.Tensor], mutated: list[str]) -> None:
    """The model updates `mutated` in place. A compiled call runs each input from its own copy and
    writes the update back after, so an updated input that shares memory with another input (one
    tensor passed twice, overlapping views) or with itself (an expanded tensor) would not see the
    update where eager does: refused, naming the inputs."""
    for name in mutated:
        t = inputs.get(name)
        if t is None or t.numel() == 0:
            continue
        if t.requires_grad and t.is_leaf and torch.is_grad_enabled():
            raise ContractViolation(f"the model updates input {name!r} in place, and it is a leaf tensor that "
                                    "requires grad: eager PyTorch refuses that in-place update", where=f"inputs.{name}",
                                    fix=f"call under torch.no_grad() (as eager allows), or pass "
                                        f"{name}.detach().clone()")
        if any(st == 0 and n > 1 for n, st in zip(t.shape, t.stride())):
            raise ContractViolation(f"the model updates input {name!r} in place, and its elements share memory "
                                    "(an expanded tensor: stride 0)", where=f"inputs.{name}", value=tuple(t.stride()),
                                    fix=f"pass {name}.clone() (or .contiguous())")
        mine = _extent(t)
        for other, u in inputs.items():
            if other == name or u.numel() == 0:
                continue
            theirs = _extent(u)
            if mine[0] == theirs[0] and mine[1] < theirs[2] and theirs[1] < mine[2]:
                raise ContractViolation(f"the model updates input {name!r} in place, and it shares memory with input "
                                        f"{other!r}: eager sees the update through both, a compiled call would not",
                                        where=f"inputs.{name}", fix=f"pass separate tensors, e.g. {other}.clone()")


def _ir_spelled(named: dict[str, Any], declared: list[str]) -> dict[str, Any]:
    """`named` with an ONNX input's own name ("x:0", as ONNX Runtime takes it) put as the IR spells
    it ("x_0", the recipe's name) where only that is declared."""
    from graphmode.ir.graph import declared_name
    if all(k in declared for k in named):
        return named
    out = {}
    for k, v in named.items():
        c = declared_name(k, declared)
        out[c if c is not None and (c == k or c not in named) else k] = v
    return out


def _traced(t: torch.Tensor) -> bool:
    """`t` is a tracer's tensor (a FakeTensor, or one functionalization wraps): no data to run on.
    Not under torch.compile's dynamo: it breaks its graph at the compiled model's data-dependent
    steps and runs them on the real tensors (checked: the same answers as eager)."""
    from torch._subclasses.fake_tensor import is_fake
    return type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter) and \
        not torch.compiler.is_dynamo_compiling() and is_fake(t)


def _file_constants(onnx_path: Any, names: list[str]) -> list[str]:
    """Which of `names` an ONNX file stores as initializers (read when a call names them: the
    refusal says why such an input, which ONNX Runtime lets a caller override, is not taken)."""
    if onnx_path is None:
        return []
    try:
        import onnx
        model = onnx.load(str(onnx_path), load_external_data=False)
    except Exception:  # noqa: BLE001 - the file moved or changed: the plain refusal stands
        return []
    stored = {t.name for t in model.graph.initializer}
    return [n for n in names if n in stored]
