"""What capture reads: a model source resolved from whatever the user passed (a built-in
name, an `.onnx` path, a `module:function` spec, an nn.Module, a Hugging Face model, a
ModelBundle), with example inputs sized by the recipe. Every entry point (the driver, a loaded
artifact, the server, the rank processes) resolves models here, below the driver.
"""
from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from graphmode.errors import CaptureError, GraphmodeError, RecipeError
from graphmode.ir.graph import declared_name

if TYPE_CHECKING:
    from graphmode.recipe import Recipe


def constant_inputs(recipe: Any) -> dict[str, torch.Tensor]:
    """The inputs the recipe declares constant (`inputs[].value`), as tensors of their dtype."""
    from graphmode.ir.types import DTYPES
    return {i.name: torch.tensor(i.value, dtype=DTYPES[i.dtype]) for i in recipe.inputs if i.value is not None}


@dataclass
class ModelSource:
    """What capture needs: a module with named example inputs, or an ONNX file."""

    name: str
    module: torch.nn.Module | None = None
    example_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    input_dims: dict[str, list] = field(default_factory=dict)
    output_names: list[str] = field(default_factory=list)
    onnx_path: Path | None = None
    bundle: Any = None   # graphmode.capture.zoo.ModelBundle when built-in
    # a decoder's forward (graphmode/decode/engine.py): exported over these ranges rather than the
    # recipe's (a batch of one still exports dynamic), and padded only where its graph masks the
    # padding itself (paged attention reads each row's length, the head its last position), so
    # the verdict's padding analysis, which knows the captured graph, does not apply
    capture_dims: dict[str, tuple[int, int]] | None = None
    masks_padding: bool = False
    constants: dict[str, torch.Tensor] = field(default_factory=dict)   # inputs the recipe declares constant

    def omitted_value(self, name: str) -> int | None:
        """The constant an input the caller left out stands for, or None when it has none.

        transformers models take `attention_mask` and `token_type_ids` as optional (None: every
        position attended, token type 0), while the captured graph takes them as inputs. An input
        counts as omittable only when the eager model, run on the capture's examples without it,
        gives the same outputs as with the example's constant value: so the compiled model fills
        it in exactly where eager would, and nowhere a model means something else by None."""
        known = self.__dict__.setdefault("_omitted", {})
        if name not in known:
            known[name] = self._omittable(name)
        return known[name]

    def _omittable(self, name: str) -> int | None:
        ex = self.example_inputs.get(name)
        if self.module is None or ex is None or ex.is_floating_point() or ex.numel() == 0:
            return None
        value = ex.reshape(-1)[0]
        if not bool((ex == value).all()):
            return None
        from graphmode.capture.zoo import OutputFlattener
        from graphmode.verify.numerics import rel_l2
        m = self.module
        # graphmode's wrapper of a transformers model names every input; its base forward passes
        # on only those given, as the user's own call of the model would
        fwd = (lambda **kw: OutputFlattener.forward(m, **kw)) if isinstance(m, OutputFlattener) else m
        for i, given in enumerate(_id_variants(self.example_inputs, name, self.module)):
            rest = {k: v for k, v in given.items() if k != name}
            try:
                with torch.inference_mode():
                    full, without = fwd(**given), fwd(**rest)
            except Exception:  # noqa: BLE001 - a forward that needs the input: it is not optional
                if i == 0:
                    return None
                continue      # ids a variant put past the model's tables: no evidence either way
            full, without = [list(o) if isinstance(o, (tuple, list)) else [o] for o in (full, without)]
            same = len(full) == len(without) and all(
                isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and (torch.equal(a, b) if not a.is_floating_point() else bool(torch.equal(a.isnan(), b.isnan()))
                     and rel_l2(b.nan_to_num(), a.nan_to_num()) < 1e-6)
                for a, b in zip(full, without))
            if not same:
                return None
        return int(value)

    def make_inputs(self, env: dict[str, int], seed: int = 0) -> dict[str, torch.Tensor]:
        if self.bundle is not None:
            return {**self.bundle.make_inputs(self._bundle_dims(env), seed=seed), **self.constants}
        raise CaptureError("no input generator for this model", where=f"model {self.name}",
                           fix="use a built-in model, an .onnx file or a ModelBundle (it has make_inputs)")

    def _bundle_dims(self, env: dict[str, int]) -> dict[str, int]:
        """`env` (the recipe's dims) with the sizes of the dims the bundle's own shapes name: an
        ONNX file's `ids_dynamic_axes_1` where the recipe says `seq` for the same axis."""
        own = getattr(self.bundle, "input_dims", None) or {}
        out = dict(env)
        for name, shape in self.input_dims.items():
            for mine, theirs in zip(shape, own.get(name) or []):
                if isinstance(theirs, str) and theirs not in out:
                    size = env.get(mine) if isinstance(mine, str) else mine
                    if size is not None:
                        out[theirs] = int(size)
        return out

    def reference(self, inputs: dict[str, torch.Tensor], optimized: bool = False) -> list[torch.Tensor]:
        """The ground truth outputs: eager PyTorch, or ONNX Runtime for an ONNX model. ONNX Runtime
        runs the file node by node (its graph optimisations off) unless `optimized`: its fusions
        round otherwise (a QDQ pair fused into a QLinear op moves an element by one quantization
        step), and the file's own meaning is what graphmode is checked against; the eager fallback
        and timings use ONNX Runtime as it ships."""
        if self.module is not None:
            with torch.inference_mode():
                out = self.module(**inputs)
            return list(out) if isinstance(out, (tuple, list)) else [out]
        import onnxruntime as ort

        from graphmode.capture.onnx.runtime import ort_session

        def first_line(e: Exception) -> str:
            return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        sessions = self.__dict__.setdefault("_ort", {})
        try:
            if optimized not in sessions:
                so = ort.SessionOptions()
                if not optimized:
                    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
                sessions[optimized] = ort_session(self.onnx_path, so)
        except Exception as e:  # noqa: BLE001 - onnxruntime raises its own exception types
            raise CaptureError(f"ONNX Runtime cannot load this model for reference: {first_line(e)}",
                               where=f"model {self.onnx_path}",
                               fix="check the model with onnx.checker and onnxruntime directly") from None
        sess = sessions[optimized]
        own = [i.name for i in sess.get_inputs()]     # the model's "x:0" is the recipe's "x_0"
        try:
            res = sess.run(None, {n: inputs[k].numpy() for n in own if (k := declared_name(n, inputs) or n)
                                       in inputs})
        except Exception as e:  # noqa: BLE001 - the model itself refuses these inputs (a window wider than one)
            shapes = {k: list(v.shape) for k, v in inputs.items()}
            raise GraphmodeError(f"ONNX Runtime fails on these inputs ({shapes}): {first_line(e)}", where="inputs",
                                 value=shapes, fix="send inputs the model takes (ONNX Runtime runs it as it is: "
                                                   "this is the model's own limit)") from None
        return [torch.from_numpy(r) for r in res]


def _id_variants(example: dict[str, torch.Tensor], omitted: str, module: Any) -> list[dict[str, torch.Tensor]]:
    """The examples, and copies whose integer inputs hold a pad id in their second half (0, 1, 2,
    the config's pad_token_id and the padding_idx of the model's embeddings): a model may build the
    omitted input from its ids (XLM's mask is `ids != pad_index`), which examples without a pad id
    cannot show."""
    config = getattr(module, "config", None) or getattr(getattr(module, "model", None), "config", None)
    tables = [m for m in module.modules() if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag))] \
        if isinstance(module, torch.nn.Module) else []
    named = [getattr(config, "pad_token_id", None), getattr(config, "pad_index", None)] + \
        [m.padding_idx % m.num_embeddings for m in tables if m.padding_idx is not None][:8]
    pads = {0, 1, 2} | {p for p in named if isinstance(p, int) and p >= 0}
    out = [example]
    for pad in sorted(pads):
        variant, changed = dict(example), False
        for k, v in example.items():
            if k == omitted or v.is_floating_point() or v.dtype == torch.bool or v.dim() == 0 or v.shape[-1] < 2:
                continue
            v = v.clone()
            v[..., v.shape[-1] // 2:] = pad
            variant[k], changed = v, True
        if changed:
            out.append(variant)
    return out


def _bundle_from_recipe(module: torch.nn.Module, ex: dict, recipe: Recipe, params: list[str]) -> Any:
    """A module handed without examples, run on inputs the recipe declares: where it does not
    take them, the recipe's inputs are what is wrong (a name forward does not have, a channel
    count or dtype its first layer refuses), so the error names them, not "example inputs"."""
    from graphmode.capture.spec import bundle_from_module
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD
                    for p in inspect.signature(module.forward).parameters.values()) if params else True
    for i, spec in enumerate(recipe.inputs):
        if not takes_any and spec.name not in params:
            raise RecipeError(f"inputs[{i}].name {spec.name!r} is not a parameter of "
                              f"{type(module).__name__}.forward", where=f"inputs[{i}].name", value=spec.name,
                              fix=f"name the recipe's inputs as forward's parameters: {params}")
    dims = {i.name: list(i.shape) for i in recipe.inputs}
    try:
        return bundle_from_module(module, ex, dims)
    except CaptureError as e:
        if not e.message.startswith("running the model on its example inputs failed"):
            raise
        if (at_buckets := _bucket_examples(recipe, module, ex)) is not None:
            try:        # the small sizes were too small for it (a conv's kernel): torch.export names the min
                return bundle_from_module(module, at_buckets, dims)
            except CaptureError:
                pass
        declared = "; ".join(f"{s.name} {s.dtype} {list(s.shape)}" for s in recipe.inputs)
        raise RecipeError(f"{type(module).__name__} does not run on inputs as the recipe declares them ({declared}): "
                          f"{e.message.split(': ', 1)[1]}", where="inputs", value=[s.name for s in recipe.inputs],
                          fix="declare each input as the model takes it (inputs[].dtype; inputs[].shape: channels "
                              "and fixed sizes; inputs[].range: the values it accepts), or pass inputs it runs on "
                              "(graphmode.compile(model, recipe, example_inputs={...}): offsets, masks and ids "
                              "random values may not satisfy)") from None


def _bucket_examples(recipe: Recipe, module: Any, ex: dict) -> dict | None:
    """The examples again with each dim at its smallest bucket where that is larger than the size
    the examples took (None: no dim has one)."""
    from graphmode.capture.torch_import import example_sizes
    ranges = {d: recipe.dim_range(d) for d in recipe.dims}
    small = example_sizes(ranges)
    raised = {d: (max(ranges[d][0], min(spec.buckets)), ranges[d][1]) for d, spec in recipe.dims.items()
              if spec.buckets and min(spec.buckets) > small[d]}
    if not raised:
        return None
    out = example_inputs_from_recipe(recipe, module, sizes=example_sizes({**ranges, **raised}))
    return dict(sorted(out.items(), key=lambda kv: list(ex).index(kv[0]) if kv[0] in ex else len(ex)))


def resolve_model(model: Any, recipe: Recipe) -> ModelSource:
    """Whatever the user passed (built-in name, .onnx path, 'pkg.mod:fn' spec, nn.Module,
    (module, example_inputs[, input_dims]), Hugging Face model, ModelBundle) -> ModelSource.
    A plain nn.Module takes its example inputs from the recipe's declared inputs."""
    from graphmode.capture.spec import BareModuleError, OnnxModelSpec, as_model, bundle_from_module, resolve_model_spec
    if isinstance(model, ModelSource):
        return model
    if isinstance(model, (str, os.PathLike)):
        try:
            model = resolve_model_spec(model)
        except BareModuleError as e:          # 'pkg.mod:fn' returning a module alone: the recipe has its inputs
            model = e.module
    if isinstance(model, torch.nn.Module):
        ex = example_inputs_from_recipe(recipe, model)
        try:                                   # forward's order: the compiled model binds positional args like it
            params = list(inspect.signature(model.forward).parameters)
        except (TypeError, ValueError):
            params = []
        ex = dict(sorted(ex.items(), key=lambda kv: params.index(kv[0]) if kv[0] in params else len(params)))
        model = _bundle_from_recipe(model, ex, recipe, params)
    model = as_model(model)
    if isinstance(model, OnnxModelSpec):
        return ModelSource(model.path.stem, onnx_path=model.path,
                           input_dims={i.name: list(i.shape) for i in recipe.inputs},
                           output_names=list(model.output_names), bundle=model,
                           constants=constant_inputs(recipe))
    dims = {i.name: list(i.shape) for i in recipe.inputs}
    missing = [n for n in model.input_names if n not in dims]
    if missing:
        raise RecipeError(f"the model takes inputs {missing} that the recipe does not declare",
                          where="inputs", fix=f"declare every model input: {model.input_names}")
    from graphmode.verdict import ContractRefused, example_mismatches
    issues = example_mismatches(recipe, model.example_inputs, model.input_dims)
    if issues:
        raise ContractRefused(issues)
    if model.input_maker is None and {k: dims[k] for k in model.input_names} != model.input_dims:
        # the recipe's shapes are the contract: sample inputs (run, verify) follow them,
        # not the static shapes of the example the model was handed with
        import dataclasses
        model = dataclasses.replace(model, input_dims={k: dims[k] for k in model.input_names})
    from graphmode.capture.torch_import import example_sizes
    examples = model.make_inputs(example_sizes({d: recipe.dim_range(d) for d in recipe.dims}), seed=0)
    return ModelSource(model.name, model.module, examples, {k: dims[k] for k in model.input_names},
                       list(model.output_names), bundle=model)


def example_inputs_from_recipe(recipe: Recipe, module: Any = None, *, sizes: dict[str, int] | None = None,
                               seed: int = 0) -> dict[str, torch.Tensor]:
    """One example per declared input at `sizes` (default: small sizes of the recipe's dims):
    floats random, token types zeros, bools `zoo.bool_sample` (key padding masks nothing padded;
    a bool with a declared pad_value is the other value everywhere), masks ones, token ids inside
    the module's vocabulary (its config's), other integers ones."""
    from graphmode.capture.torch_import import example_sizes
    from graphmode.capture.zoo import bool_sample
    from graphmode.ir.types import DTYPES
    sizes = sizes or example_sizes({d: recipe.dim_range(d) for d in recipe.dims})
    vocab = getattr(getattr(module, "config", None), "vocab_size", None)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for spec in recipe.inputs:
        shape = [sizes[d] if isinstance(d, str) else d for d in spec.shape]
        dt = DTYPES[spec.dtype]
        if dt.is_floating_point:
            out[spec.name] = torch.randn(shape, generator=g).to(dt)
        elif "type" in spec.name:
            out[spec.name] = torch.zeros(shape, dtype=dt)
        elif dt == torch.bool and "pad_value" in spec.model_fields_set:
            out[spec.name] = torch.full(shape, not bool(spec.pad_value), dtype=dt)
        elif dt == torch.bool:
            out[spec.name] = bool_sample(spec.name, shape)
        elif spec.name.endswith("ids") and isinstance(vocab, int) and vocab > 3:
            out[spec.name] = torch.randint(3, vocab, shape, generator=g).to(dt)
        else:
            out[spec.name] = torch.ones(shape, dtype=dt)
    out.update(constant_inputs(recipe))
    return out
