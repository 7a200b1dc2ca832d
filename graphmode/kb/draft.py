"""Draft a complete, valid recipe for a model nobody wrote one for.

`graphmode recipe init`, `graphmode kb recommend` and `graphmode.compile(model)` (no recipe)
all call `draft_recipe`:

1. inputs, dtypes and symbolic dims from the model's signature (its example inputs and
   `input_dims`, a Hugging Face model's config, or the ONNX graph); each dim's range from the
   model's declared ranges, its config (`max_position_embeddings`, `n_positions`, ...), or
   graphmode's defaults. A model handed with static shapes gets a dynamic batch where it
   exports with one, else no dims at all; a dim torch.export cannot keep dynamic is fixed at
   the example's size; `ranges` overrides ranges or adds dims on input axes;
2. buckets synthesised under a padding bound (`max_padding`, optionally `max_buckets`); when
   neither is given, at most `MAX_DRAFT_PLANS` plans (warm-up stays bounded);
3. the model is captured once; its fingerprint finds the nearest measured recipes in the
   knowledge base, whose precision, fusion and kernel selection the draft takes;
4. the verdict every entry point uses decides the rest: an input named like a mask is
   declared `role: attention_mask`; a dim the padding analysis still finds unsafe gets exact
   buckets (or, past `MAX_EXACT` values, `on_violation: eager`: kb/draft_padding.py); ops
   without a lowering make the draft `exe_mode: hybrid`; a causal LM gets `memory.kv_cache` from its config;
5. the memory budget (unless given) is what the memory proof counts (weights, their prepared
   copies at `memory.weight_growth`, activation peak, workspace, KV cache) at the bucket that
   needs most, with headroom; the draft is then proved like any recipe and refused if it fails.

Every value graphmode chose has a note saying where it came from (`Draft.notes`, written
as YAML comments by `Draft.yaml()`).
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from graphmode.capture.spec import with_batch_axis
from graphmode.capture.zoo import marks_padding
from graphmode.errors import CaptureError, RecipeError
from graphmode.kb.draft_knobs import MAX_KNOB_DISTANCE, knobs_from_kb  # noqa: F401 - kb ls reads it here
from graphmode.kb.draft_padding import EXACT_PLANS, settle_padding
from graphmode.passes.attention import scores_written

COARSE_PADDING = 0.5    # a dim whose few buckets pad more than this gets exact_plans for the values that recur

DEFAULT_MAX_PADDING = 0.25
MEMORY_HEADROOM = 1.25
SEQ_DIMS = ("seq", "sequence", "seq_len", "tokens", "length", "positions")
CONFIG_MAX_POSITIONS = ("max_position_embeddings", "n_positions", "max_seq_len", "max_sequence_length", "n_ctx",
                        "max_target_positions")         # Whisper's decoder: its tokens' position table
MB = 2**20
_MAX_TIES = 16                 # exporter axes an ONNX draft joins, one pair the graph ties at a time
MAX_DRAFT_PLANS = 16           # plans a draft builds at warm-up when no padding or bucket limit is given
DEFAULT_OTHER_MAX = 64         # a dim the model names with no range, no example and no default
DECODER_BATCH = (1, 8)         # a causal LM's draft: sequences per step (each holds KV pages)
DECODER_CONTEXT = 1024         # ... and its longest sequence, where the config allows more
KV_PAGE = 16


@dataclass
class Draft:
    data: dict[str, Any]                  # the recipe as YAML data
    notes: dict[str, str]                 # field path -> where its value came from
    recipe: Any                           # the loaded, validated Recipe
    report: Any                           # its ValidationReport (proved with the compiled graph)
    verdict: Any                          # graphmode.verdict.Verdict of the final draft
    model: dict[str, Any]                 # the model's knowledge-base fingerprint row
    hardware: dict[str, Any]
    recommendations: list[Any] = field(default_factory=list)
    source: Any = None                    # graphmode.compiler.ModelSource
    graph: Any = None                     # the captured IR
    warnings: list[str] = field(default_factory=list)
    fixed_dims: list[str] = field(default_factory=list)   # asked dynamic, fixed at the example's size

    def yaml(self) -> str:
        from graphmode.kb.render import render
        from graphmode.recipe import recipe_hash
        header = [f"{self.recipe.name}: drafted by graphmode recipe init on "
                  f"{_dt.date.today().isoformat()} for model {self.model['name']} ({self.model['family']}, "
                  f"{self.model['params']:,} parameters)",
                  f"validated with the model on target {self.report.target.name}: {self.report.verdict}; hash "
                  f"{recipe_hash(self.recipe)}; `recipe validate` it with --model (the proofs count the model)",
                  "each comment says where its value came from; check them, then `graphmode tune` it"]
        return render(self.data, self.notes, header)


# ---- the model's signature ------------------------------------------------------------------------


def _module_of(bundle: Any) -> Any:
    """The user's module (`is None` tests: a Sequential of no layers, or a module whose __len__
    fails, must not read as missing)."""
    raw = getattr(bundle, "raw_module", None)
    return getattr(bundle, "module", None) if raw is None else raw

def as_bundle(model: Any) -> Any:
    """What drafting reads a signature from: a ModelBundle or an ONNX spec."""
    from graphmode.capture.spec import as_model
    return as_model(model)


def _signature(bundle: Any) -> tuple[dict[str, str], dict[str, list], dict[str, int]]:
    """(dtype per input, symbolic shape per input, example value per dim)."""
    from graphmode.ir.types import TORCH_TO_DTYPE
    dims = {k: list(v) for k, v in bundle.input_dims.items()}
    if hasattr(bundle, "example_inputs"):
        return {k: TORCH_TO_DTYPE[bundle.example_inputs[k].dtype] for k in dims}, dims, bundle.example_shape()
    return {k: TORCH_TO_DTYPE[v] for k, v in bundle.input_dtypes.items()}, dims, {}


def _causal_lm(bundle: Any) -> Any:
    """The transformers causal LM a bundle was made from (it gets a decoder draft), or None."""
    raw = getattr(bundle, "raw_module", None)
    cls = type(raw).__name__
    if raw is None or not hasattr(raw, "config") or not ("CausalLM" in cls or "LMHead" in cls):
        return None
    return raw if not getattr(raw.config, "is_encoder_decoder", False) else None


def _dim_range(d: str, bundle: Any, example: dict[str, int], decoder: bool = False) -> tuple[int, int, str]:
    cfg = getattr(getattr(bundle, "raw_module", None), "config", None)
    if decoder and d == "batch":
        return (*DECODER_BATCH, "a decoder's sequences per step (each holds KV-cache pages: widen it if memory allows)")
    if cfg is not None and (d in SEQ_DIMS or "seq" in d):
        for key in CONFIG_MAX_POSITIONS:
            v = getattr(cfg, key, None)
            if isinstance(v, int) and v >= 2:
                if decoder:               # a prompt leaves room for at least one new token
                    hi = min(v, DECODER_CONTEXT) - 1
                    return 1, hi, (f"1 .. {hi}: config.{key} = {v} positions less one for a new token"
                                   + (f", capped at {DECODER_CONTEXT} (every sequence's KV cache is sized for it: "
                                      "widen it if memory allows)" if v > DECODER_CONTEXT else ""))
                offset = _position_offset(bundle)
                if offset:            # RoBERTa numbers positions from padding_idx + 1: fewer fit the table
                    return 1, v - offset, (f"1 .. config.{key} = {v} less the {offset} positions the model's "
                                           "table reserves below its first (padding_idx + 1)")
                return 1, v, f"1 .. config.{key}"
    ranges = getattr(bundle, "dim_ranges", None) or {}
    if d in ranges:
        lo, hi = ranges[d]
        return int(lo), int(hi), f"the model's declared range for {d}"
    table = _position_table(bundle) if d in SEQ_DIMS or "seq" in d else None
    if table is not None:
        name, rows = table
        return 1, rows, f"1 .. the {rows} rows of the model's position table {name}"
    if d == "samples" and not hasattr(bundle, "module"):    # an ONNX file's raw audio axis (onnx_axes.named)
        from graphmode.capture.hf import AUDIO_SAMPLES
        return (*AUDIO_SAMPLES, f"{AUDIO_SAMPLES[0]:,} .. {AUDIO_SAMPLES[1]:,}: raw audio of 0.1 .. 10 s at 16 kHz "
                                "(narrow it to the clips you expect)")
    from graphmode.capture.zoo import DEFAULT_DIM_RANGES
    key = "seq" if d in SEQ_DIMS or "seq" in d else d       # T5's decoder_seq: a sequence, relative positions
    if key in DEFAULT_DIM_RANGES:
        lo, hi = DEFAULT_DIM_RANGES[key]
        hi = max(hi, example.get(d, hi))
        return lo, hi, f"graphmode's default range for {key} (narrow it to the traffic you expect)"
    v = example.get(d, 1)
    if v < 2:
        return 1, DEFAULT_OTHER_MAX, (f"1 .. {DEFAULT_OTHER_MAX}: the model names {d!r} without a range (narrow or "
                                      "widen it to the traffic you expect)")
    return 1, v, f"up to the example's value {v} (widen it if the model takes more)"


POSITION_TABLES = ("position_embed", "pos_embed", "wpe")


def _position_offset(bundle: Any) -> int:
    """The rows a position table reserves below the first position: padding_idx + 1 where its
    nn.Embedding has a padding_idx (RoBERTa and its family count positions from there), else 0."""
    import torch
    module = _module_of(bundle)
    for n, m in module.named_modules() if module is not None else ():
        if isinstance(m, torch.nn.Embedding) and "position" in n.lower() and m.padding_idx is not None:
            return int(m.padding_idx) + 1
    return 0


def _position_table(bundle: Any) -> tuple[str, int] | None:
    """(name, rows) of a learned position-embedding table, the longest sequence the model takes,
    for a model without a config saying it: an nn.Embedding or a 2-D ONNX initializer named so."""
    import torch

    def named(n: str) -> bool:
        return any(k in n.lower() for k in POSITION_TABLES)
    module = _module_of(bundle)
    if module is not None:
        found = [(n, m.num_embeddings) for n, m in module.named_modules()
                 if isinstance(m, torch.nn.Embedding) and named(n)]
        return found[0] if found else None
    path = getattr(bundle, "path", None)
    if path is None:
        return None
    import onnx
    graph = onnx.load(str(path), load_external_data=False).graph
    found = [(i.name, int(i.dims[0])) for i in graph.initializer if len(i.dims) == 2 and named(i.name)]
    return found[0] if found else None


def _pad_token(bundle: Any) -> Any:
    return getattr(getattr(getattr(bundle, "raw_module", None), "config", None), "pad_token_id", None)


def _safe_name(text: str) -> str:
    return (re.sub(r"[^A-Za-z0-9_.-]", "-", text).strip("-.") or "model")[:100]


def _is_mask(name: str, dtype: str, shape: list) -> bool:
    return "mask" in name.lower() and dtype in ("i64", "i32", "i16", "i8", "u8", "bool") and \
        any(isinstance(d, str) for d in shape[1:])


# ---- drafting -----------------------------------------------------------------------------------

def draft_recipe(model: Any, *, target: Any = "host", p99_ms: float | None = None, memory_mb: float | None = None,
                 max_p99_over_p50: float | None = None, max_padding: float | None = None,
                 max_buckets: int | None = None, kb_path: str | Path | None = None, objective: str = "latency",
                 name: str | None = None, target_cache_dir: str | Path | None = None, record: bool = True,
                 ranges: dict[str, tuple] | None = None) -> Draft:
    """Draft, prove and (with `kb_path` and `record`) record a recipe for `model`; see the module doc.
    `ranges` ({dim: (lo, hi)} or {dim: (lo, hi, [(input, axis), ...])}) overrides the ranges
    drafting would choose, or adds a dim on the named input axes (on the leading axis for
    `batch`, on axis 1 of the token inputs for a sequence dim, when no axes are named).
    Raises RecipeErrors / ConstraintError / ContractRefused when no valid draft exists
    (e.g. `p99_ms` below what the cost model predicts), naming why."""
    bounded = max_padding is None and max_buckets is None     # graphmode chooses: keep warm-up bounded
    given = as_bundle(model)
    if not hasattr(given, "module"):           # an ONNX file: one dim per axis the exporter named per input
        from graphmode.kb.onnx_axes import unified
        given = unified(given)
    guessed: dict[str, list] = {}
    bundle = _place_dims(given, dict(ranges or {}), guessed)
    opts = dict(target=target, p99_ms=p99_ms, memory_mb=memory_mb, max_p99_over_p50=max_p99_over_p50,
                # a bucket count alone is its own policy (the default padding bound could contradict it)
                max_padding=DEFAULT_MAX_PADDING if bounded else max_padding, max_buckets=max_buckets,
                kb_path=kb_path, objective=objective, name=name, target_cache_dir=target_cache_dir, record=record,
                ranges={d: tuple(r[:2]) for d, r in (ranges or {}).items()}, bounded=bounded)
    if not hasattr(bundle, "module"):          # ONNX: the file's axes are what they are
        from graphmode.kb.onnx_axes import named, tied
        raw, narrowed = bundle, None
        for _ in range(_MAX_TIES):
            bundle = named(raw)                   # made-up names left: by the axis's role (seq, height, ...)
            try:
                return _draft(bundle, **opts, narrowed=narrowed)
            except CaptureError as e:
                hint = _onnx_ranges(e, bundle, opts["ranges"])     # an op's least size (TopK's K): start there
                if hint and hint != narrowed:
                    narrowed = _tighter(narrowed or {}, hint)
                    continue
                joined = tied(raw, e, shown=bundle)       # two made-up axes the graph ties: one dim
                if joined is None:
                    raise _static_axis_advice(e, bundle) from None
                raw = joined
        raise CaptureError(f"the ONNX model's axes kept meeting after {_MAX_TIES} ties", where="inputs",
                           fix="name the axes that share a size with one dim (--dim NAME=LO:HI@INPUT:AXIS, ...)")
    if given.dim_names:                       # a dim torch.export cannot keep dynamic is fixed at the example's
        free = [d for d in bundle.dim_names if d not in (ranges or {})]
        tries = [bundle, _pin(bundle, [d for d in free if d != "batch"]), _pin(bundle, free)]
    else:                                     # handed with static shapes: try a dynamic batch, else keep them
        tries = [b for b in (with_batch_axis(bundle), bundle) if b is not None]
    tries = [b for i, b in enumerate(tries) if b.input_dims not in [t.input_dims for t in tries[:i]]]
    queue: list[tuple[Any, dict | None]] = [(b, None) for b in tries]
    rounds = 0
    while queue:
        b, narrowed = queue.pop(0)
        try:
            draft = _draft(b, **opts, narrowed=narrowed)
        except CaptureError as e:
            hint = _export_ranges(e, b, opts["ranges"])
            if hint and narrowed:             # a second guard inside the first range (x[:, :4]: seq >= 4, != 4)
                merged = _tighter(narrowed, hint)
                hint = merged if merged != narrowed and len(narrowed) + rounds < 8 else None
            if hint:                          # torch.export named the range one graph holds for: take it
                rounds += 1
                queue.insert(0, (b, hint))
            elif not queue:
                raise _guessed_axes_advice(e, guessed, given) if guessed else e
            continue
        draft.fixed_dims = [d for d in bundle.dim_names if d not in b.dim_names]
        if draft.fixed_dims:
            draft.notes["inputs"] += (f"; {', '.join(draft.fixed_dims)} fixed at the example's size: torch.export "
                                      "cannot keep it dynamic for this model")
            if "seq" in draft.fixed_dims and "memory.kv_cache" in draft.notes:    # an LM whose seq export fixed
                draft.notes["memory.kv_cache"] = (   # not the user's fixed example: giving dims cannot help
                    "none: torch.export cannot keep seq dynamic for this model (its code fixes the length: a "
                    "recurrent or state-space layer), so it cannot decode on graphmode's KV cache; this draft "
                    "compiles its forward pass at the example's length")
        return draft
    raise AssertionError("unreachable")


def _guessed_axes_advice(e: CaptureError, guessed: dict[str, list], given: Any) -> RecipeError:
    """A --dim placed where its name suggests (a sequence dim on axis 1) that torch.export refused
    there: the model fixes that axis (an MLP's features), or has no such dim at all."""
    d, axes = next(iter(guessed.items()))
    where = ", ".join(f"axis {ax} of {inp} (size {size} in the example)" for inp, ax, size in axes)
    first = (str(e.message).strip().splitlines() or [""])[0]
    shapes = ", ".join(f"{k} {v}" for k, v in given.input_dims.items())
    return RecipeError(f"--dim {d} was put on {where}, where a dim named {d!r} goes when no axes are named, and "
                       f"the model does not take it there ({first})", where="--dim", value=d,
                       fix=f"name the axes it is on: --dim {d}=LO:HI@INPUT:AXIS (inputs: {shapes}), or leave "
                           f"--dim {d} out if the model has no such axis")


def _tighter(narrowed: dict[str, tuple], hint: dict[str, tuple]) -> dict[str, tuple]:
    """Both guards' ranges at once: a dim torch.export bounds below in one try (x[1]: batch >= 2)
    and above in the next (cdist: batch <= 25) keeps both bounds (the second replaced the first)."""
    out = dict(narrowed)
    for d, (lo, hi, why) in hint.items():
        if d not in out:
            out[d] = (lo, hi, why)
            continue
        lo0, hi0, why0 = out[d]
        pick = lambda a, b, f: a if b is None else b if a is None else f(a, b)  # noqa: E731
        out[d] = (pick(lo0, lo, max), pick(hi0, hi, min), why0 if why == why0 else f"{why0}; {why}")
    return out


def _static_axis_advice(e: CaptureError, bundle: Any) -> CaptureError:
    """An ONNX file whose op needs an axis static (a Resize, an LSTM): a draft keeps the file's
    dynamic axes dynamic, so the fix is a recipe the user writes with that axis a number."""
    from graphmode.capture.onnx.importer import STATIC_AXIS_FIX
    if e.fix != STATIC_AXIS_FIX:
        return e
    _, dims_of, _ = _signature(bundle)
    shapes = "; ".join(f"{n}: {shape}" for n, shape in dims_of.items())
    return CaptureError(e.message, where=e.where, value=e.value,
                        fix=f"a drafted recipe keeps the file's dynamic axes ({shapes}) dynamic: write the recipe "
                            "with the axis this op reads as a fixed size in inputs[].shape (an integer in place of its "
                            "dim name), or re-export the model with that axis static")


def _export_ranges(e: CaptureError, bundle: Any, given: dict) -> dict[str, tuple] | None:
    """torch.export's suggested ranges (capture/export_errors.py), or the minimums where its graph
    holds (compiler._where_export_holds), for the dims this draft chose itself, where they still
    hold the example's size; None when there is nothing to narrow."""
    example = bundle.example_shape()
    out = {}
    for d, (lo, hi) in (getattr(e, "suggested_ranges", None) or {}).items():
        if d in bundle.dim_names and d not in given and (lo or 1) <= example.get(d, lo or 1) <= (hi or 2 ** 62):
            out[d] = (lo, hi, "torch.export's range for this model (outside it the model takes another path, "
                              "e.g. a window wider than the input)")
    for d, (lo, hi) in (getattr(e, "derived_ranges", None) or {}).items():
        shorter = max(example.get(d, lo), hi // 4)       # its solver proves a floor guard over a shorter range
        if d in bundle.dim_names and d not in given and lo <= example.get(d, lo) and shorter < hi:
            out[d] = (lo, shorter, "the range torch.export keeps this dim dynamic over (over a longer one it asks "
                                   "for a multiple of a stride, which graphmode's dims do not take)")
    return out or None


def _onnx_ranges(e: CaptureError, bundle: Any, given: dict) -> dict[str, tuple] | None:
    """The least size an ONNX op needs of a dim this draft chose itself (TopK's K along seq)."""
    names = {d for shape in bundle.input_dims.values() for d in shape if isinstance(d, str)}
    out = {d: (lo, hi, f"the least size the model's ops take ({e.message.split(':')[0].split(', which')[0].strip()})")
           for d, (lo, hi) in (getattr(e, "suggested_ranges", None) or {}).items() if d in names and d not in given}
    return out or None


def _pin(bundle: Any, names: list[str]) -> Any:
    """The bundle with dims `names` fixed at the example's values."""
    ex = bundle.example_shape()
    return dataclasses.replace(bundle, input_dims={k: [ex[d] if d in names else d for d in v]
                                                   for k, v in bundle.input_dims.items()})


def _place_dims(bundle: Any, ranges: dict[str, tuple], guessed: dict[str, list] | None = None) -> Any:
    """The bundle with every dim of `ranges` the model does not have yet named on its input axes;
    `guessed` collects the axes chosen for a dim whose axes were not named."""
    names = set(bundle.dim_names)
    new = {d: r for d, r in ranges.items() if d not in names or len(r) > 2}
    if not new:
        return bundle
    if not hasattr(bundle, "module"):          # an ONNX file: its symbolic axes take the names
        from graphmode.kb.onnx_axes import placed
        return placed(bundle, new)
    dims = {k: list(v) for k, v in bundle.input_dims.items()}
    for d, r in new.items():
        axes = list(r[2]) if len(r) > 2 else _default_axes(d, dims)
        if len(r) <= 2 and guessed is not None:
            guessed[d] = [(inp, ax, dims[inp][ax]) for inp, ax in axes]
        if not axes:
            raise RecipeError(f"the model has no dim {d!r} and graphmode cannot tell which input axis it is",
                              where="--dim", value=d,
                              fix=f"name the axes: --dim {d}={r[0]}:{r[1]}@INPUT:AXIS[,INPUT:AXIS] (inputs: "
                                  + ", ".join(f"{k} {v}" for k, v in dims.items()) + ")")
        for inp, ax in axes:
            if inp not in dims or not -len(dims[inp]) <= ax < len(dims[inp]):
                raise RecipeError(f"no axis {ax} on input {inp!r}", where="--dim", value=f"{inp}:{ax}",
                                  fix="inputs: " + ", ".join(f"{k} {v}" for k, v in dims.items()))
            dims[inp][ax] = d
    import dataclasses
    return dataclasses.replace(bundle, input_dims=dims)


def _default_axes(d: str, dims: dict[str, list]) -> list[tuple[str, int]]:
    """Where a dim named `batch` or like a sequence goes when its axes are not named: the leading
    axis of every input, or axis 1 of every input of rank >= 2 sharing that axis's size."""
    if d == "batch":
        lead = {v[0] for v in dims.values() if v}
        return [(k, 0) for k in dims] if len(lead) == 1 and all(dims.values()) else []
    if d in SEQ_DIMS or "seq" in d:
        cand = [(k, v[1]) for k, v in dims.items() if len(v) >= 2]
        sizes = {s for _, s in cand}
        return [(k, 1) for k, _ in cand] if cand and len(sizes) == 1 else []
    return []


def _draft(bundle: Any, *, target: Any, p99_ms: float | None, memory_mb: float | None,
           max_p99_over_p50: float | None, max_padding: float | None, max_buckets: int | None, kb_path: Any,
           objective: str, name: str | None, target_cache_dir: Any, record: bool,
           ranges: dict[str, tuple[int, int]], bounded: bool,
           narrowed: dict[str, tuple[int | None, int | None, str]] | None = None) -> Draft:
    from graphmode.compiler import capture_model, relower, reprove
    from graphmode.kb.fingerprint import hardware_of, model_of, recipe_inputs
    from graphmode.decode.lm import ALIBI_WHY, alibi
    from graphmode.passes.to_paged import not_causal
    from graphmode.recipe import load_recipe
    from graphmode.recipe.targets import pick_target

    dtypes, dims_of, example = _signature(bundle)
    if not dims_of:
        from graphmode.errors import RecipeError
        raise RecipeError(f"{bundle.name} takes no inputs: its outputs are constants, so there is nothing to compile "
                          "per request", where="inputs", value=[],
                          fix="compute its outputs once (eager PyTorch or ONNX Runtime) and keep them; or give the "
                              "model the input its outputs should depend on")
    notes: dict[str, str] = {"inputs": "names, dtypes and dims from the model's signature"}
    data: dict[str, Any] = {"version": 1, "name": _safe_name(name or f"{bundle.name}-draft"),
                            "description": "drafted by graphmode recipe init for "
                                           + (getattr(bundle, "source", "") or bundle.name)}
    data["inputs"] = []
    for i, (n, shape) in enumerate(dims_of.items()):
        spec: dict[str, Any] = {"name": n, "dtype": dtypes[n], "shape": shape}
        if _is_mask(n, dtypes[n], shape) and marks_padding(n):
            spec.update(pad_value=True if dtypes[n] == "bool" else 1)
            notes[f"inputs[{i}]"] = "named like a key padding mask (true marks padding): padded positions read padding"
        elif _is_mask(n, dtypes[n], shape):
            spec.update(pad_value=0, role="attention_mask")
            notes[f"inputs[{i}]"] = "named like a mask: padded positions read 0 (masked out)"
        elif n == "input_ids" and isinstance(pad := _pad_token(bundle), int) and pad != 0:
            spec.update(pad_value=pad)      # positions and masks a model derives from ids treat it as padding
            notes[f"inputs[{i}]"] = f"token ids: padded with config.pad_token_id = {pad}"
        data["inputs"].append(spec)
    lm = _causal_lm(bundle)
    raw = getattr(bundle, "raw_module", None)
    if lm is None and getattr(getattr(raw, "config", None), "is_encoder_decoder", False):
        notes["memory.kv_cache"] = (f"none: {type(raw).__name__} is an encoder-decoder model, and graphmode decodes "
                                    "decoder-only causal LMs (one decoder stack over a paged KV cache); this draft "
                                    "compiles its forward pass")
    given, narrowed = ranges, dict(narrowed or {})
    dim_args = (dims_of, given, bundle, example, max_padding, max_buckets, bounded, lm is not None, notes)
    data["dims"], ranges = _dims(*dim_args, narrowed)
    if not data["dims"]:
        del data["dims"]
        leads = {k: v[0] for k, v in bundle.input_dims.items() if v}
        differ = (f": the inputs' leading axes differ ({', '.join(f'{k} {n}' for k, n in leads.items())}), so none "
                  "is taken as a batch" if len(set(leads.values())) > 1 else "")
        notes["inputs"] = ("names, dtypes and shapes as declared: every axis fixed (input_dims)"
                           if bundle.meta.get("static") else
                           "names, dtypes and shapes from the model's signature: every shape is fixed (no dims)"
                           + differ)
    data.update(exe_mode="graph", on_violation="error", optimize={"preset": "default", "fusion": {"enabled": True}},
                codegen={"kernel_selection": f"{objective}_first"}, precision={"compute": "f32"},
                targets=[getattr(target, "name", None) or str(target)])
    skeleton = load_recipe(_ordered(data))
    tgt = pick_target(skeleton, target, cache_dir=target_cache_dir)
    notes["targets"] = f"checked against {tgt.name}"
    low = capture_model(bundle, skeleton)
    graph0, cap, src = low.captured, low.capture_report, low.source
    fit = _position_maximums(graph0, ranges, given)
    for d, (lo, _, why) in _extent_minimums(graph0, ranges, given).items():
        fit[d] = (lo, fit[d][1], f"{why}; {fit[d][2]}") if d in fit else (lo, None, why)
    if fit:                     # an ONNX file's axes say nothing of where its windows fit or its positions end
        narrowed = _tighter(narrowed, fit)
        data["dims"], ranges = _dims(*dim_args, narrowed)
    model_row, hw_row = model_of(graph0, src, recipe_inputs(skeleton)), hardware_of(tgt)
    recs = knobs_from_kb(data, notes, model_row, hw_row, kb_path, objective)
    if data["precision"] == {"compute": "f32"} and (own := _narrow_weights(graph0)):
        notes["precision"] += (f"; compute f32 changes no dtype: the model's {own} weights and the ops on them run "
                               f"in {own} as in eager (compute {own} would narrow its f32 ops too)")
    if cap.fallbacks:
        data["exe_mode"] = "hybrid"
        notes["exe_mode"] = (f"{len(cap.fallbacks)} op(s) have no graphmode lowering "
                             f"({', '.join(sorted({f.target for f in cap.fallbacks}))}): they run as eager islands")
    if getattr(cap, "tail", None) is not None:
        from graphmode.verdict import describe
        data["exe_mode"] = "hybrid"
        notes["exe_mode"] = ((notes["exe_mode"] + "; " if "exe_mode" in notes else "") +
                             f"the model makes a size only its data decides ({describe(cap.tail)}): that op and "
                             "what reads it run eagerly after the plan")
    outputs = _outputs(graph0, cap, ranges)
    if outputs:
        data["outputs"] = outputs
        notes["outputs"] = "from the captured graph: dim axes are sliced back after padding"
    verdict = settle_padding(data, notes, lambda d: load_recipe(_ordered(d)), graph0, cap, src, ranges)
    exact = {d: example.get(d, ranges[d][1]) for d in verdict.exact_dims
             if (data.get("dims") or {}).get(d, {}).get("exact_plans") and "buckets" not in data["dims"][d]}
    if bounded and exact:        # their synthesised buckets served exact values only: the budget goes to batch
        data["dims"], ranges = _dims(*dim_args, narrowed, exact)
        verdict = settle_padding(data, notes, lambda d: load_recipe(_ordered(d)), graph0, cap, src, ranges)
    _sla(data, notes, p99_ms, max_p99_over_p50)
    data["memory"] = {}
    windowed = False          # left out for a window only: said when nothing else stops decoding
    if lm is not None and {"batch", "seq"} <= set(data.get("dims") or {}):
        windowed = _kv_cache(data, notes, lm, ranges)
    elif lm is not None:                  # a decoder recipe needs dims batch and seq (the KV cache's)
        notes["memory.kv_cache"] = (f"none: {type(lm).__name__} is a causal LM, but its example's shapes are "
                                    "fixed, so this draft compiles its forward pass at that shape; for decoding, "
                                    "pass the model itself, or give dims batch and seq in a recipe "
                                    "(`graphmode recipe init --dim batch=1:4 --dim seq=1:512` drafts it)")
    low = relower(low, load_recipe(_ordered(data)), tgt, prove_graph=False)   # the budget does not change it
    # GPT-Neo's hint to narrow seq inside its window led to a draft refused for its attention
    why_not = None if "kv_cache" not in data["memory"] and not windowed else (
        f"it {ALIBI_WHY}" if alibi(getattr(lm, "config", None)) else
        None if _attends_as_sdpa(low.graph) else "its attention does not capture as one sdpa (soft-capped or "
                                                  f"otherwise rewritten logits{scores_written(low.captured)})"
    ) or not_causal(low.captured)
    if why_not is not None:
        data["memory"].pop("kv_cache", None)        # the decode engine would refuse it
        notes["memory.kv_cache"] = (f"none: {type(lm).__name__} cannot decode on graphmode's KV cache: {why_not}; "
                                    "this draft compiles its forward pass")
        low = relower(low, load_recipe(_ordered(data)), tgt, prove_graph=False)
    graph = low.graph
    if memory_mb is not None:
        data["memory"]["budget_mb"] = memory_mb
        notes["memory.budget_mb"] = "given (--memory-mb)"
    else:
        _memory_need(data, notes, graph, tgt)
    recipe = load_recipe(_ordered(data))
    report = reprove(low, recipe, tgt).proof          # refused unless proved
    if "dims" in data:
        notes["dims"] = (f"{report.plans} plan(s): one per bucket, built on first use or all at warm-up "
                         f"(`run --warmup`, `compile --save`, `serve`)")
    draft = Draft(_ordered(data), notes, recipe, report, verdict, model_row, hw_row, recs, src, graph0)
    if kb_path is not None and record:
        from graphmode.kb.record import Subject
        from graphmode.kb.record import record as write
        warning = write(kb_path, Subject(recipe, tgt, src, graph0, graph.structural_hash(), origin="init"), [])
        if warning:
            draft.warnings.append(warning)
    return draft


_ANNOUNCED: set[str] = set()


class RecipeDrafted(UserWarning):
    """graphmode.compile(model) ran without a recipe and drafted one."""


def drafted(model: Any, target: Any, ranges: dict[str, tuple] | None = None) -> tuple[Any, Any, dict[str, str]]:
    """(model as drafted, recipe, its notes) for `graphmode.compile(model)` without a recipe: a draft,
    announced by one RecipeDrafted warning (no knowledge base: the Python API reads no
    environment). The model comes back as the bundle the draft named the dims of, so
    `(module, example_inputs)` compiles too."""
    import warnings

    from graphmode.recipe import recipe_hash
    d = draft_recipe(model, target=target or "host", ranges=ranges or None)
    stamp = recipe_hash(d.recipe)
    # dims asked dynamic that torch.export could not keep so: said here, not only in the notes
    fixed = [f"{', '.join(d.fixed_dims)} fixed at the example's size"] if d.fixed_dims else []
    if stamp not in _ANNOUNCED:           # once per draft and process (a warnings filter reset would repeat it)
        _ANNOUNCED.add(stamp)
        warnings.warn(RecipeDrafted(
            f"graphmode.compile: no recipe given, so one was drafted for {d.model['name']}: {d.recipe.name} "
            f"({stamp}), {'; '.join([f'{d.report.plans} plan(s)'] + d.verdict.lines() + fixed)}. It is cm.recipe; "
            "`graphmode recipe init` writes it out with where each value came from"), stacklevel=4)
    return d.source.bundle, d.recipe, d.notes


def _dims(dims_of: dict[str, list], given: dict[str, tuple[int, int]], bundle: Any, example: dict[str, int],
          max_padding: float | None, max_buckets: int | None, bounded: bool, decoder: bool,
          notes: dict[str, str], narrowed: dict[str, tuple] | None = None, pinned: dict[str, int] | None = None
          ) -> tuple[dict[str, Any], dict[str, tuple[int, int]]]:
    """Each dim's range (given, from the config or a default) and bucket policy. With `bounded`
    (no padding or bucket limit given) the plans stay at most MAX_DRAFT_PLANS: past that, each
    dim gets a bucket count (the smallest padding those buckets allow) instead of the padding bound.
    `pinned` dims (unsafe to pad, their recurring values planned by `exact_plans`) get their
    example's value and their max as buckets, and leave the plan budget to the others."""
    from graphmode.recipe.buckets import synthesize_buckets, worst_padding
    names = list(dict.fromkeys(x for v in dims_of.values() for x in v if isinstance(x, str)))
    dims: dict[str, Any] = {}
    ranges: dict[str, tuple[int, int]] = {}
    for d in names:
        if d in given:
            lo, hi = given[d]
            why = f"range given (--dim {d}={lo}:{hi})"
        else:
            lo, hi, why = _dim_range(d, bundle, example, decoder)
            nlo, nhi, nwhy = (narrowed or {}).get(d, (None, None, ""))
            new = max(lo, nlo or lo), min(hi, nhi or hi)
            if new[0] <= new[1] and new != (lo, hi):      # a bound the model set; the other one's reason stays
                kept = "" if nhi is not None and new[1] < hi else f"; the max: {why}"
                (lo, hi), why = new, f"{new[0]} .. {new[1]}: {nwhy}{kept}"
        dims[d] = {"min": lo, "max": hi}
        if lo < hi:
            dims[d].update((k, v) for k, v in (("max_padding", max_padding), ("max_buckets", max_buckets))
                           if v is not None)
            why += f"; buckets synthesised with padding <= {max_padding}" if max_padding is not None else \
                f"; at most {max_buckets} buckets, placed for the least padding"
        notes[f"dims.{d}"] = why
        ranges[d] = (lo, hi)
    for d, v in (pinned or {}).items():
        lo, hi = ranges[d]
        kept = sorted({min(max(v, lo), hi), hi})      # the max too: a value above every bucket has none
        dims[d] = {"min": lo, "max": hi, "buckets": kept, "exact_plans": EXACT_PLANS}
        notes[f"dims.{d}"] = (notes[f"dims.{d}"].split("; buckets")[0] + f"; buckets {kept} (the draft's example "
                              f"size and the max): padding {d} is unsafe, so other values run eagerly until they "
                              "recur and get plans of their own")
    counts = {d: len(synthesize_buckets(lo, hi, max_padding=max_padding).buckets)
              for d, (lo, hi) in ranges.items() if lo < hi and d not in (pinned or {})} if bounded else {}
    held = math.prod(len(dims[d]["buckets"]) for d in (pinned or {}))    # the pinned dims' plans
    budget = MAX_DRAFT_PLANS // held
    if bounded and counts and math.prod(counts.values()) > budget:
        while math.prod(counts.values()) > budget and max(counts.values()) > 1:
            top = max(counts, key=lambda d: (counts[d], d == "batch"))
            counts[top] -= 1
        for d, k in counts.items():
            lo, hi = ranges[d]
            syn = synthesize_buckets(lo, hi, max_buckets=k)
            buckets, worst = list(syn.buckets), syn.worst_padding
            dims[d] = {"min": lo, "max": hi, "max_buckets": k}
            if d == "batch" and k > 1 and buckets[0] != lo:
                # the fewest-padding split pads a lone request (batch 1) to 2; it is the latency
                # case, so it keeps a bucket of its own and the rest split the others
                buckets = [lo, *synthesize_buckets(lo + 1, hi, max_buckets=k - 1).buckets]
                worst, _ = worst_padding(buckets, lo, hi)
                dims[d] = {"min": lo, "max": hi, "buckets": buckets}
            coarse = float(worst) > COARSE_PADDING
            if coarse:        # a request of batch 2 padded to 32 ran 43x eager: its recurring values get plans
                dims[d]["exact_plans"] = EXACT_PLANS
            notes[f"dims.{d}"] = (notes[f"dims.{d}"].split("; buckets")[0] + f"; {k} bucket(s) {buckets} "
                                  f"(padding <= {float(worst):.0%}) keep the draft at "
                                  f"{math.prod(counts.values()) * held} plans to build at warm-up (at most "
                                  f"{MAX_DRAFT_PLANS}); give --max-padding or --max-buckets for others"
                                  + (f"; up to {EXACT_PLANS} values of {d} that recur get plans of their own "
                                     "(exact_plans), so a shape that keeps coming is not padded that far"
                                     if coarse else ""))
    return dims, ranges


def _extent_minimums(graph: Any, ranges: dict[str, tuple[int, int]], given: dict) -> dict[str, tuple]:
    """{dim: (min, None, why)} for the dims this draft chose whose minimum leaves a window wider
    than its input (analysis/extents.py): the draft starts them where the model runs."""
    from graphmode.analysis.extents import short_extents, short_slices
    out = {s.dim: (s.fits, None, f"from the smallest {s.dim} the model takes (below it {s.op} -> %{s.output} "
                                 f"has {s.extent} < {s.floor} positions: "
                                 + ("its window is wider than its input)" if s.floor else "a negative size)"))
           for s in short_extents(graph, ranges) if s.fits is not None and s.dim not in given}
    for s in short_slices(graph, ranges):      # x[:, -2]: the axis must hold the positions it reads
        if s.fits is not None and s.dim not in given and s.fits > out.get(s.dim, (0,))[0]:
            out[s.dim] = (s.fits, None, f"from the smallest {s.dim} the model takes (a slice of {s.extent} "
                                        f"positions reads {s.need} of them: %{s.output})")
    return out


def _position_maximums(graph: Any, ranges: dict[str, tuple[int, int]], given: dict) -> dict[str, tuple]:
    """{dim: (None, max, why)} for the dims this draft chose past the positions the model's tables
    hold (analysis/indices.py: an ONNX RoBERTa numbers positions from its pad id + 1, so 2 of its
    128 rows are not positions; a draft up to 128 failed in a kernel at every padded request)."""
    from graphmode.analysis.indices import analyze_indices
    return {d: (None, lim.max, f"the most the model takes: {lim.describe()}")
            for d, lim in analyze_indices(graph).dims.items()
            if d in ranges and d not in given and lim.max < ranges[d][1]}


_ORDER = ("version", "name", "description", "model", "inputs", "outputs", "dims", "exe_mode", "on_violation",
          "capture", "optimize", "codegen", "precision", "memory", "sla", "targets")


def _ordered(data: dict[str, Any]) -> dict[str, Any]:
    return {k: data[k] for k in _ORDER if k in data}


def _narrow_weights(graph: Any) -> str:
    """The float dtype(s) of the model's own weights other than f32 ('' for an f32 model)."""
    import torch
    names = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64"}
    return "/".join(sorted({names[t.dtype] for t in graph.constants.values() if t.dtype in names}))


def _outputs(graph: Any, cap: Any, ranges: dict[str, tuple[int, int]]) -> dict[str, list]:
    from graphmode.ir.types import dim_str
    from graphmode.verdict import user_output_types
    names = list(getattr(cap, "output_names", None) or graph.outputs)
    types = user_output_types(graph, cap)
    if len(names) != len(types) or not all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", n) for n in names):
        return {}
    out = {}
    for n, ty in zip(names, types):
        out[n] = [d if isinstance(d, int) else (dim_str(d) if dim_str(d) in ranges else "*") for d in ty.shape]
    return out


def _memory_need(data: dict, notes: dict, graph: Any, target: Any) -> None:
    """memory.budget_mb: what the memory proof counts (weights, their prepared copies at
    memory.weight_growth, the planner's activation peak, workspace, KV cache) at the bucket that
    needs most, with headroom."""
    from graphmode.compile_report import model_facts
    from graphmode.plan.memory import activation_peak_expr
    from graphmode.recipe import load_recipe
    from graphmode.recipe.buckets import cross_product
    from graphmode.recipe.constraints import build_constraint_model
    recipe = load_recipe(_ordered(data))
    act = activation_peak_expr(graph, reuse=recipe.optimize.memory_reuse,
                               alias_groups=[list(g) for g in recipe.alias_groups])
    cm = build_constraint_model(recipe, target, model_facts(graph, act))

    def at(env: dict[str, int]) -> dict[str, float]:
        def value(e: Any) -> float:
            return float(e.subs({s: env[s.name] for s in e.free_symbols})) if hasattr(e, "subs") else float(e)
        return {k: value(v) for k, v in cm.memory_terms.items()}

    top, terms = max(((env, at(env)) for env in cross_product(cm.domains)), key=lambda p: sum(p[1].values()))
    data["memory"]["budget_mb"] = max(1, math.ceil(sum(terms.values()) / MB * MEMORY_HEADROOM))
    parts = " + ".join(f"{k.replace('_', ' ')} {v / MB:.1f}" for k, v in terms.items() if v)
    where = f" at the bucket that needs most {top}" if top else ""
    notes["memory.budget_mb"] = (f"{parts} MB{where}, +{MEMORY_HEADROOM - 1:.0%} headroom (prepared weights: "
                                 f"memory.weight_growth {recipe.memory.weight_growth:g}x the GEMM and conv weights "
                                 "(not lookup tables), what tactic selection may use; a conv tactic's workspace must "
                                 "fit in what is left)")


def _attends_as_sdpa(graph: Any) -> bool:
    return any(n.op == "sdpa" or (n.body is not None and _attends_as_sdpa(n.body)) for n in graph.nodes)


def _kv_cache(data: dict, notes: dict, lm: Any, ranges: dict[str, tuple[int, int]]) -> bool:
    """memory.kv_cache of a causal LM from its config: its layers, KV heads and head dim, pages
    enough for the longest sequence the dims admit. True when the cache is left out only for a
    sliding window the seq range outgrows (narrowing seq would decode, unless more stops it)."""
    from graphmode.decode.lm import lm_config
    cfg = lm_config(lm)
    context = ranges.get("seq", (1, (cfg["context"] or DECODER_CONTEXT) - 1))[1] + 1   # the longest prompt + a token
    window = cfg.get("sliding_window")
    if cfg["v_head_dim"] != cfg["head_dim"]:
        notes["memory.kv_cache"] = (f"none: {type(lm).__name__} cannot decode on graphmode's KV cache: its value heads "
                                    f"are {cfg['v_head_dim']} wide and its key heads {cfg['head_dim']} (multi-head "
                                    "latent attention), and a cache page holds K and V heads of one head_dim; this "
                                    "draft compiles its forward pass")
        return False
    if window is not None and context > window:
        # the paged attention attends every cached token; decoding past the window is refused
        notes["memory.kv_cache"] = (f"none: {type(lm).__name__} attends over a sliding window of {window} tokens, "
                                    f"which graphmode's paged attention does not apply, and prompts of the seq range "
                                    f"make sequences of {context}; for decoding, keep seq inside the window: "
                                    f"dims.seq.max: {window - 1} in a recipe (`graphmode recipe init --dim "
                                    f"seq=1:{window - 1}` drafts it)")
        return True
    page = KV_PAGE
    while window is not None and page > 1 and math.ceil(context / page) * page > window:
        page //= 2                   # every page of a sequence within the window
    pages = math.ceil(context / page)
    data["memory"]["kv_cache"] = {"page_size": page, "max_pages_per_seq": pages,
                                  "dtype": "f32", "layers": cfg["layers"], "kv_heads": cfg["kv_heads"],
                                  "head_dim": cfg["head_dim"]}
    notes["memory.kv_cache"] = (f"a causal LM ({type(lm).__name__}): layers, KV heads and head dim from its config, "
                                f"{pages} pages of {page} tokens a sequence: up to {pages * page} tokens (a prompt of "
                                f"the seq range's {context - 1} and one new token, in whole pages; `generate` and "
                                "`serve` decode with it)"
                                + (f"; within its sliding window of {window}" if window else ""))
    return False


def _sla(data: dict, notes: dict, p99_ms: float | None, ratio: float | None) -> None:
    sla: dict[str, Any] = {}
    if p99_ms is not None:
        sla["p99_ms"] = p99_ms
        notes["sla.p99_ms"] = "given (--p99-ms); proved with the target's cost model"
    if ratio is not None:
        sla["max_p99_over_p50"] = ratio
        notes["sla.max_p99_over_p50"] = "given (--max-p99-over-p50): measured by bench and tune, monitored by serve"
    if sla:
        data["sla"] = sla
