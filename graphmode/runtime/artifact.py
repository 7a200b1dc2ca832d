"""A deployable `.gm` artifact: one file that runs a compiled model without the model's code.

Like a TensorRT engine or an AOTInductor package, it holds what the runtime needs and nothing
it would have to redo: the recipe, the optimised IR graph and its constants, every bucket's
execution plan, the compiled kernel libraries those plans load, the tactics' timing cache,
and the versions and host it was built for. `load` checks those before anything runs and
refuses a different graphmode or torch version, or a CPU missing an instruction set the
kernels were compiled for, with the fix (compile again on this host). Each plan is
re-derived against the graph on load (`load_plan`), as a cached plan is, so an edited
archive is refused rather than run.

The file is a zip (stored, not deflated: libraries and weights barely compress):

    manifest.json            versions, host, recipe hash, graph hash, buckets, outputs
    recipe.json              the recipe (its hash must equal the manifest's)
    graph.ir                 the optimised graph as IR text
    constants.pt             its constants (weights), loaded with weights_only=True
    plans/<bucket>.json      one execution plan per bucket
    kernels/<key>.so         kernel libraries (each with its .so.sha256)
    tactics/*.json           the GEMM/conv timing cache the plans were tuned with

Out-of-contract requests cannot run eagerly (there is no module): they are refused.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

import torch

import graphmode
from graphmode.errors import GraphmodeError
from graphmode.progress import OnStage, StageReporter, stage

FORMAT = 1
SUFFIX = ".gm"


class ArtifactError(GraphmodeError):
    """An artifact that cannot be written, read or run here."""

    exit_code = 1


def _host() -> dict[str, Any]:
    from graphmode.targets.host import detect_host_facts, simd_features
    cpu = detect_host_facts().cpu
    return {"cpu": cpu.model_name, "arch": cpu.isa, "simd": simd_features(cpu)}


def _bucket_file(key: str) -> str:
    return "plans/" + key.replace(",", "_").replace("=", "-") + ".json"


def save(cm: Any, path: str | Path) -> dict[str, Any]:
    """Build every bucket of `cm` (from its cache where it can) and write them into one file.
    Returns the manifest."""
    from graphmode.runtime.build import cache_key
    path = Path(path)
    if cm.mode == "eager" or cm.graph is None:
        raise ArtifactError("an eager-mode model has no plans to save", where="exe_mode", value=cm.mode,
                            fix="compile with exe_mode graph or hybrid")
    if cm.recipe.memory.kv_cache is not None:
        raise ArtifactError("decoder artifacts (memory.kv_cache) are not supported yet: the decode engine builds "
                            "its prefill/decode graphs from the module", where="memory.kv_cache",
                            fix="deploy decoders with `graphmode serve` on the model itself")
    t0 = time.perf_counter()
    cm.warmup()
    graph = cm.graph
    buckets = cm.recipe.buckets()
    plans: dict[str, Any] = {}
    libraries: dict[str, Path] = {}
    for env in buckets:
        exe = cm.executable(env)
        plans[cm.bucket_key(env)] = exe.plan.to_json()
        for lib in getattr(exe, "libraries", []):
            libraries.setdefault(Path(lib).name, Path(lib))
    key = cache_key(cm, buckets[0])
    out_spec = getattr(cm.capture_report, "out_spec", None) if cm.capture_report is not None else None
    manifest = {"format": FORMAT, "graphmode": graphmode.__version__, "torch": torch.__version__,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "host": _host(),
                "model": cm.source.name if cm.source is not None else graph.name,
                "recipe_hash": cm.recipe.hash(), "graph_hash": key["graph_hash"],
                "target": getattr(cm.target, "name", "host"), "mode": cm.mode, "device": cm.device,
                "isa": cm.recipe.codegen.isa,
                "threads": cm.threads, "buckets": list(plans), "outputs": cm.output_names,
                "out_spec": out_spec, "output_structure": cm.output_structure,
                "mutated_inputs": list(cm.mutated_inputs), "exact_dims": list(cm.exact_dims), "kernels": sorted(libraries)}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    writing = StageReporter(getattr(cm, "on_stage", None), "write", None, str(path))
    writing.start()
    try:
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED) as z:
            z.writestr("manifest.json", json.dumps(manifest, indent=1))
            z.writestr("recipe.json", json.dumps(cm.recipe.model_dump(mode="json")))
            z.writestr("graph.ir", graph.text())
            with z.open("constants.pt", "w", force_zip64=True) as f:   # streamed: no in-memory copy of the weights
                torch.save({k: v.contiguous() for k, v in graph.constants.items()}, f)
            for k, text in plans.items():
                z.writestr(_bucket_file(k), json.dumps(text))
            for name, lib in sorted(libraries.items()):
                z.write(lib, f"kernels/{name}")
                sha = lib.with_suffix(".so.sha256")
                if sha.is_file():
                    z.write(sha, f"kernels/{sha.name}")
            tactics = _tactics_dir(libraries)
            for f in sorted(tactics.glob("*.json")) if tactics is not None else []:
                z.write(f, f"tactics/{f.name}")
        tmp.replace(path)                 # a reader never sees a half-written artifact
        writing.finish()
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise ArtifactError(f"cannot write the artifact: {e.strerror or e}", where=str(path),
                            fix="write it to a folder you can write to") from None
    manifest["seconds"] = round(time.perf_counter() - t0, 3)
    manifest["bytes"] = path.stat().st_size
    return manifest


def _tactics_dir(libraries: dict[str, Path]) -> Path | None:
    """The timing cache beside the kernel folder (the CPU backend's layout)."""
    for lib in libraries.values():
        d = lib.parent.parent / "tactics"
        return d if d.is_dir() else None
    return None


def _graph(z: zipfile.ZipFile, root: Path, text: str, manifest: dict[str, Any], where: Path):
    """(the graph over the weights mapped from `root`, their spill), checked against the
    manifest's graph hash, or ArtifactError."""
    from graphmode.hostmem import load_mapped
    from graphmode.ir.parser import parse_graph
    try:
        constants, spill = load_mapped(_constants_file(z, root, where))
        graph = parse_graph(text, constants)
    except GraphmodeError as e:
        raise ArtifactError(f"its graph or weights are damaged or edited: {e.message}", where=str(where),
                            fix="save the artifact again") from None
    except Exception as e:  # noqa: BLE001 - torch.load raises many types for a damaged file
        raise ArtifactError(f"its constants do not load: {type(e).__name__}", where=f"{where}:constants.pt",
                            fix="save the artifact again") from None
    if graph.structural_hash() != manifest.get("graph_hash"):
        raise ArtifactError("its graph or weights do not match the manifest's hash (edited?)", where=str(where),
                            fix="save the artifact again")
    return graph, spill


def _constants_file(z: zipfile.ZipFile, root: Path, where: Path) -> Path:
    """The weights' file in the extraction folder (extracted there now if an older graphmode
    extracted this artifact without it), to be mapped rather than read into memory."""
    out = root / "constants.pt"
    if not out.is_file():
        try:
            with z.open("constants.pt") as src, tempfile.NamedTemporaryFile(dir=root, delete=False) as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            Path(dst.name).replace(out)
        except KeyError:
            raise ArtifactError("the artifact has no constants.pt", where=str(where),
                                fix="it is truncated or not a graphmode artifact: save it again") from None
    return out


def _read(z: zipfile.ZipFile, name: str, where: Path) -> bytes:
    try:
        return z.read(name)
    except KeyError:
        raise ArtifactError(f"the artifact has no {name}", where=str(where),
                            fix="it is truncated or not a graphmode artifact: save it again") from None
    except (zipfile.BadZipFile, OSError) as e:
        raise ArtifactError(f"cannot read {name}: {e}", where=str(where), fix="save the artifact again") from None


def needed_simd(built: list[str], isa: str) -> list[str]:
    """The build host's SIMD flags its kernels may use under the recipe's `codegen.isa` cap:
    all of them at auto (-march=native), none of AVX-512 under avx2 (-mno-avx512f drops the
    family), only baseline x86-64 for portable."""
    if isa == "portable":
        return []
    if isa == "avx2":
        return [f for f in built if not f.startswith("avx512")]
    return list(built)


def check_manifest(manifest: dict[str, Any], where: Path, host: dict[str, Any] | None = None) -> None:
    """Refuse an artifact this process cannot run as it was built: format, versions, host ISA."""
    if manifest.get("format") != FORMAT:
        raise ArtifactError(f"artifact format {manifest.get('format')!r}, this graphmode reads format {FORMAT}",
                            where=str(where), fix="save it again with this graphmode version")
    for name, have in (("graphmode", graphmode.__version__), ("torch", torch.__version__)):
        if manifest.get(name) != have:
            raise ArtifactError(f"built with {name} {manifest.get(name)}, this is {name} {have}", where=str(where),
                                value=manifest.get(name),
                                fix=f"load it with {name} {manifest.get(name)}, or compile again here "
                                    "(graphmode compile ... --save)")
    host = host or _host()
    built = manifest.get("host") or {}
    if built.get("arch") != host["arch"]:
        raise ArtifactError(f"built for {built.get('arch')} ({built.get('cpu')}), this host is {host['arch']}",
                            where=str(where), fix="compile again on this host (graphmode compile ... --save)")
    missing = sorted(set(needed_simd(built.get("simd") or [], manifest.get("isa", "auto"))) - set(host["simd"]))
    if missing:
        raise ArtifactError(f"its kernels were compiled for {built.get('cpu')} and use {', '.join(missing)}, "
                            f"which this CPU ({host['cpu']}) lacks", where=str(where), value=missing,
                            fix="compile again on this host (graphmode compile ... --save)")


def load(path: str | Path, *, cache_dir: str | Path | None = None, threads: int | None = None,
         on_stage: OnStage | None = None):
    """A CompiledModel from a `.gm` file, every bucket ready (no capture, no kernel compile
    when the host matches). Extracted once under the cache's `artifacts/<digest>/`. `on_stage`
    hears the `plans` stage, bucket N of M (graphmode/progress.py)."""
    from graphmode.backends import get_backend
    from graphmode.compiler import ModelSource
    from graphmode.errors import PlanError
    from graphmode.paths import cache_layout
    from graphmode.plan.execution import load_plan
    from graphmode.recipe import Recipe
    from graphmode.runtime.build import backend_options, cache_key
    from graphmode.runtime.compiled import CompiledModel
    path = Path(path)
    try:
        with open(path, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()[:24]
        z = zipfile.ZipFile(path)
    except FileNotFoundError:
        raise ArtifactError("no such artifact", where=str(path), fix="check the path") from None
    except (zipfile.BadZipFile, OSError) as e:
        raise ArtifactError(f"not a graphmode artifact: {e}", where=str(path),
                            fix="pass a file written by graphmode compile --save / CompiledModel.save") from None
    with z:
        try:
            manifest = json.loads(_read(z, "manifest.json", path))
            recipe = Recipe.model_validate(json.loads(_read(z, "recipe.json", path)))
        except (ValueError, TypeError) as e:
            raise ArtifactError(f"unreadable manifest or recipe: {str(e).splitlines()[0]}", where=str(path),
                                fix="save the artifact again") from None
        check_manifest(manifest, path)
        if recipe.hash() != manifest.get("recipe_hash"):
            raise ArtifactError("its recipe does not match the manifest's hash (edited?)", where=f"{path}:recipe.json",
                                fix="save the artifact again")
        root = cache_layout(cache_dir).artifacts / digest
        if not (root / "complete").is_file():
            _extract(z, root)
        text = _read(z, "graph.ir", path).decode()
        try:
            graph, spill = _graph(z, root, text, manifest, path)
        except ArtifactError:     # the extracted weights are a cache: damaged or edited there, extract them again
            (root / "constants.pt").unlink(missing_ok=True)
            graph, spill = _graph(z, root, text, manifest, path)
    source = ModelSource(manifest.get("model") or graph.name, input_dims={i.name: list(i.shape) for i in recipe.inputs},
                         output_names=list(manifest.get("outputs") or []))
    cm = CompiledModel(source, recipe, _target(manifest.get("target")), None, graph, None, mode=manifest["mode"],
                       cache_dir=root, threads=threads if threads is not None else manifest.get("threads"),
                       device=manifest.get("device") or "cpu", on_stage=on_stage)
    cm.exact_dims = list(manifest.get("exact_dims") or [])
    cm.output_structure = manifest.get("output_structure")
    cm.mutated_inputs = list(manifest.get("mutated_inputs") or [])
    cm.artifact = {"path": str(path), "digest": digest, **{k: manifest[k] for k in ("created", "host", "buckets")}}
    if manifest.get("out_spec"):
        import torch.utils._pytree as pytree
        try:
            cm._out_spec = pytree.treespec_loads(manifest["out_spec"])
        except Exception:  # noqa: BLE001 - a flat tuple of outputs, as for a model without one
            cm._out_spec = None
    # the weights are mapped from the extracted file, as compile spills them: once the kernels hold
    # their prepared copies the originals' pages go (hashing the graph just read every one)
    cm.constant_spill = spill
    spill.release()
    backend = get_backend(cm.device)
    extra: dict[str, Any] = backend_options(backend, recipe)
    if backend.capabilities.kernel_selection:       # a backend with tactics: the saved choices are final
        extra["frozen"] = True
    buckets = recipe.buckets()
    with stage(on_stage, "plans", total=len(buckets)) as plans:
        for env in buckets:
            key = cm.bucket_key(env)
            if key not in manifest["buckets"]:
                raise ArtifactError(f"no plan for bucket {key}", where=str(path), fix="save the artifact again")
            try:
                plan = load_plan(json.loads((root / _bucket_file(key)).read_text()), graph, env,
                                 built_for=cache_key(cm, env), reuse=recipe.optimize.memory_reuse,
                                 alias_groups=[list(g) for g in recipe.alias_groups])
            except (PlanError, OSError, ValueError) as e:
                raise ArtifactError(f"the plan for bucket {key} is not a plan of its graph: "
                                    f"{getattr(e, 'message', e)}", where=str(path),
                                    fix="save the artifact again") from None
            t0 = time.perf_counter()
            exe = backend.executable(plan, graph.constants, kernel_dir=root / "kernels", threads=cm.threads,
                                     kernel_selection=recipe.codegen.kernel_selection, **extra)
            cm._executables[key] = exe
            if cm.constant_spill is not None:
                cm.constant_spill.release()
            cm._event("artifact_load", bucket=key, seconds=round(time.perf_counter() - t0, 3))
            plans.step(key)
    return cm


def _extract(z: zipfile.ZipFile, root: Path) -> None:
    """Unpack into `root` atomically (a folder renamed into place, then marked complete)."""
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".extract-", dir=root.parent))
    try:
        for info in z.infolist():
            name = info.filename
            if name.startswith("/") or ".." in Path(name).parts:
                raise ArtifactError(f"unsafe member name {name!r}", where="artifact", fix="do not load this file")
            if name.split("/")[0] in ("plans", "kernels", "tactics", "constants.pt"):
                z.extract(info, tmp)
        (tmp / "complete").write_text("ok")
        shutil.rmtree(root, ignore_errors=True)
        tmp.replace(root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _target(name: str | None):
    from graphmode.targets import get_target
    try:
        return get_target(name or "host")
    except GraphmodeError:
        return None


__all__ = ["ArtifactError", "FORMAT", "SUFFIX", "check_manifest", "load", "needed_simd", "save"]
