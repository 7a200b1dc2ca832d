"""Export a :class:`~graphmode.capture.zoo.ModelBundle` to ONNX, with an on-disk cache.

* Exporter order (``exporter="auto"``): the TorchScript exporter (``dynamo=False``,
  opset 17; 1-10 s on the built-ins) first, then the torch.export-based one
  (``dynamo=True``, opset 18; 6-17 s, fewer shape ops) if the first one fails.
* Dynamic axes are named after the bundle's symbolic dims (``batch``, ``seq``), so the
  ONNX inputs read ``input_ids: int64[batch, seq]`` exactly like the recipes.
* Cache: ``<cache_dir>/<name>-<fingerprint>-torch<version>-opset<N>-<dyn|static>.onnx``
  plus a ``.json`` sidecar (exporter used, seconds, file size). ``cache_dir`` is an
  argument (default: ``graphmode.paths.CacheLayout.onnx``); a cached file whose size disagrees with
  its sidecar is treated as corrupt and re-exported.
"""
from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import logging
import os
import shutil
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from graphmode.capture.export_errors import EXPORT_LOCK
from graphmode.capture.zoo import DEFAULT_DIM_RANGES, ModelBundle
from graphmode.errors import CaptureError
from graphmode.paths import cache_layout
from graphmode.verify.numerics import rel_l2

__all__ = ["export_onnx", "ExportRecord", "onnx_cache_key", "bundle_fingerprint", "onnx_op_types", "verify_onnx"]

TORCHSCRIPT_OPSET = 17
DYNAMO_OPSET = 18


@dataclass
class ExportRecord:
    """What an export produced (also the cache sidecar's content)."""

    path: str
    model: str
    exporter: str            # "torchscript" | "dynamo"
    opset: int
    dynamic: bool
    seconds: float
    size: int
    torch_version: str
    cached: bool = False
    fallback_reason: str | None = None


def bundle_fingerprint(bundle: ModelBundle) -> str:
    """Cheap content hash: module class, input dims, outputs, every parameter/buffer's
    name, shape, dtype and float64 sum (so different seeds give different keys)."""
    h = hashlib.sha256()
    h.update(type(bundle.module).__qualname__.encode())
    h.update(json.dumps([bundle.input_dims, bundle.output_names], default=str).encode())
    with torch.no_grad():
        for name, t in list(bundle.module.state_dict(keep_vars=False).items()):
            h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
            if t.numel() and (t.dtype.is_floating_point or t.dtype in (torch.int64, torch.int32)):
                h.update(repr(float(t.double().sum())).encode())
    return h.hexdigest()[:12]


def onnx_cache_key(bundle: ModelBundle, *, dynamic: bool = True, opset: int | None = None,
                   exporter: str = "auto") -> str:
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in bundle.name)
    tv = torch.__version__.replace("+", "_")
    parts = [safe, bundle_fingerprint(bundle), f"torch{tv}"]
    if opset is not None:
        parts.append(f"opset{opset}")
    if exporter != "auto":
        parts.append(exporter)
    if dynamic:
        parts.append("dyn")
    else:
        parts.append("static-" + "x".join(f"{k}{v}" for k, v in bundle.example_shape().items()))
    return "-".join(parts)


@contextlib.contextmanager
def _quiet_export() -> Iterator[None]:
    """Hide tracer/deprecation warnings and the exporter's INFO/WARNING log lines; one trace at
    a time in the process (EXPORT_LOCK: the exporters trace with torch.export)."""
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch.export", "torch._dynamo",
                                                "torch.fx.experimental.symbolic_shapes",
                                                "onnxscript")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with EXPORT_LOCK, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, lv in zip(loggers, levels):
            lg.setLevel(lv)


def _axes(bundle: ModelBundle) -> dict[str, dict[int, str]]:
    axes: dict[str, dict[int, str]] = {}
    for name, dims in {**bundle.input_dims, **bundle.output_dims}.items():
        named = {i: d for i, d in enumerate(dims) if isinstance(d, str)}
        if named:
            axes[name] = named
    return axes


def _export_torchscript(bundle: ModelBundle, path: Path, dynamic: bool, opset: int) -> None:
    torch.onnx.export(
        bundle.module, (), str(path), kwargs=dict(bundle.example_inputs),
        input_names=list(bundle.input_dims), output_names=list(bundle.output_names),
        dynamic_axes=_axes(bundle) if dynamic else None, opset_version=opset,
        do_constant_folding=True, dynamo=False)


def _export_dynamo(bundle: ModelBundle, path: Path, dynamic: bool, opset: int) -> None:
    ranges = {d: (1, hi) for d, (_, hi) in {**DEFAULT_DIM_RANGES, **bundle.dim_ranges}.items()}
    prog = torch.onnx.export(
        bundle.module, (), None, kwargs=dict(bundle.example_inputs),
        input_names=list(bundle.input_dims), output_names=list(bundle.output_names),
        dynamic_shapes=bundle.dynamic_shapes(ranges) if dynamic else None,
        opset_version=opset, dynamo=True, verbose=False, optimize=True)
    prog.save(str(path), external_data=False)


def _record_ok(onnx_path: Path, meta_path: Path) -> dict[str, Any] | None:
    if not (onnx_path.is_file() and meta_path.is_file()):
        return None
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError):
        return None
    if meta.get("size") != onnx_path.stat().st_size:
        return None
    return meta


def export_onnx(bundle: ModelBundle, path: str | os.PathLike | None = None, dynamic: bool = True,
                *, exporter: str = "auto", opset: int | None = None,
                cache_dir: str | os.PathLike | None = None, force: bool = False) -> ExportRecord:
    """Export ``bundle`` to ONNX and return an :class:`ExportRecord` (``.path`` is the file).

    ``path=None``: the file lives in the cache (``cache_dir`` or the default) under
    :func:`onnx_cache_key`, and a valid cached file is reused unless ``force``.
    ``path`` given: written there; if ``cache_dir`` is also given the cache is consulted
    and filled, and the cached file copied to ``path``.
    ``exporter``: ``"auto"`` (TorchScript, then dynamo on failure), ``"torchscript"`` or
    ``"dynamo"``. ``opset`` defaults to 17 (TorchScript) / 18 (dynamo).
    """
    if exporter not in ("auto", "torchscript", "dynamo"):
        raise CaptureError("unknown ONNX exporter", where="export_onnx.exporter", value=exporter,
                           fix="use 'auto', 'torchscript' or 'dynamo'")
    use_cache = path is None or cache_dir is not None
    cdir = Path(cache_dir) if cache_dir is not None else cache_layout().onnx
    key = onnx_cache_key(bundle, dynamic=dynamic, opset=opset, exporter=exporter)
    cached_onnx, cached_meta = cdir / f"{key}.onnx", cdir / f"{key}.json"
    target = Path(path) if path is not None else cached_onnx

    if use_cache and not force:
        meta = _record_ok(cached_onnx, cached_meta)
        if meta is not None:
            if target != cached_onnx:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(cached_onnx, target)
            meta.update(path=str(target), cached=True)
            return ExportRecord(**meta)

    work = cached_onnx if use_cache else target
    work.parent.mkdir(parents=True, exist_ok=True)
    tmp = work.with_name(f".{work.stem}.{os.getpid()}.tmp.onnx")
    attempts: list[tuple[str, int]] = []
    if exporter in ("auto", "torchscript"):
        attempts.append(("torchscript", opset or TORCHSCRIPT_OPSET))
    if exporter in ("auto", "dynamo"):
        attempts.append(("dynamo", opset or DYNAMO_OPSET))
    errors: list[str] = []
    rec: ExportRecord | None = None
    bundle.module.eval()
    for kind, ops in attempts:
        t0 = time.perf_counter()
        try:
            with _quiet_export(), torch.no_grad():
                (_export_torchscript if kind == "torchscript" else _export_dynamo)(
                    bundle, tmp, dynamic, ops)
        except Exception as e:  # noqa: BLE001 - collected and reported below
            errors.append(f"{kind} exporter: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
            tmp.unlink(missing_ok=True)
            continue
        os.replace(tmp, work)
        rec = ExportRecord(path=str(work), model=bundle.name, exporter=kind, opset=ops,
                           dynamic=dynamic, seconds=round(time.perf_counter() - t0, 3),
                           size=work.stat().st_size, torch_version=torch.__version__,
                           fallback_reason="; ".join(errors) or None)
        break
    if rec is None:
        raise CaptureError(f"ONNX export of model {bundle.name!r} failed with every exporter",
                           where=f"model {bundle.name}", value="; ".join(errors),
                           fix="check that forward(**example_inputs) returns tensors only and "
                               "has no data-dependent control flow; or use the torch.export "
                               "path (no ONNX) for this model")
    if use_cache:
        cached_meta.write_text(json.dumps({k: v for k, v in asdict(rec).items()
                                           if k not in ("cached",)}, indent=1))
        if target != work:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(work, target)
            rec.path = str(target)
    return rec


# ------------------------------------------------------------------------------ helpers


def onnx_op_types(path: str | os.PathLike) -> dict[str, int]:
    """``{op_type: count}`` over the main graph (sorted by op type)."""
    import onnx

    m = onnx.load(str(path), load_external_data=False)
    c = collections.Counter(n.op_type for n in m.graph.node)
    return dict(sorted(c.items()))


def verify_onnx(bundle: ModelBundle, path: str | os.PathLike,
                shapes: list[dict[str, int]] | None = None, seed: int = 0,
                threads: int | None = None) -> list[dict[str, Any]]:
    """Run the ONNX file with onnxruntime (CPU) and eager torch on ``shapes`` (default:
    the example shape) and return ``[{shape, output, rel_l2}]`` per shape and output."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    if threads:
        so.intra_op_num_threads = threads
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    ort_inputs = [i.name for i in sess.get_inputs()]
    results = []
    for shp in shapes or [bundle.example_shape()]:
        inp = bundle.make_inputs(shp, seed)
        feed = {n: inp[n].numpy() for n in ort_inputs}
        got = sess.run(None, feed)
        ref = bundle.run(inp)
        for name, g, r in zip(bundle.output_names, got, ref):
            results.append({"shape": dict(shp), "output": name,
                            "rel_l2": rel_l2(torch.from_numpy(g), r)})
    return results
