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

    manifest.json            versions, host, recipe hash, graph hash, buckets, outputs,
                             `files`: every other member's size and sha256, and `digest`:
                             the sha256 of its other fields (a hand edit shows)
    recipe.json              the recipe (its hash must equal the manifest's)
    graph.ir                 the optimised graph as IR text
    constants.pt             its constants (weights), loaded with weights_only=True
    plans/<bucket>.json      one execution plan per bucket
    kernels/<key>.so         kernel libraries
    tactics/*.json           the GEMM/conv timing cache entries these plans were tuned with (not the rest
                             of the shared cache: other models' shapes stay out)
    tokenizer/*              the model's tokenizer files, when it had one

A decoder (a recipe with memory.kv_cache) is saved as the paged graph its decode engine runs, with a
plan per prefill and decode bucket (`bucket_envs`) and the model's sizes (`decoder`); its KV pools
are run-time state, stored as their types only and zero at load (decode/saved.py builds the engine).

A `.gm` is untrusted input until checked: the manifest is read within a size bound and
every field is checked against `Manifest` (types, enums, thread count, sizes, counts; an
unknown field is refused); every other member must be listed there, stored (a compressed
member could inflate without bound), of the listed size, and is read or extracted in
bounded chunks and checked against its sha256 before anything parses, maps or loads it.
What fails is one ArtifactError naming the member, never a traceback. The hashes catch
damage and inconsistent edits; loading a `.gm` runs the native code it carries, so a file
rewritten consistently by someone else is as trusted as its source (docs/robustness.md).
Out-of-contract requests cannot run eagerly (there is no module): they are refused.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
import uuid
import zipfile
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError

from graphmode.errors import ArtifactError, GraphmodeError, short_value
from graphmode.progress import OnStage, StageReporter, stage
from graphmode.runtime.bounds import bounds_doc, bounds_from_doc
from graphmode.runtime.contract import omitted_constants, positional_names
from graphmode.runtime.manifest import MAX_ITEMS, MAX_RANKS, MAX_THREADS, Manifest, OutputSpec, manifest_digest
from graphmode.runtime.tail import MEMBERS as TAIL_MEMBERS, read_tail, tail_members
from graphmode.untrusted import (ARTIFACT_SUFFIX as SUFFIX, GROUP_MEMBER, GiB, MiB, UntrustedFileError, file_sha256,
                                 is_artifact, open_file, parse_json, read_bytes)
from graphmode.version import __version__

FORMAT = 3              # 2: the manifest lists every member's size and sha256; 3: and its own digest
MANIFEST_MAX_BYTES = 1 * MiB
# what one member may hold, by where it lives (constants.pt: anything up to the archive's size)
MEMBER_MAX_BYTES = {"recipe.json": 16 * MiB, "graph.ir": 1 * GiB, "plans": 256 * MiB, "kernels": 512 * MiB,
                    "tactics": 16 * MiB, "tokenizer": 64 * MiB, "tail.ir": 64 * MiB, "tail.pt": 1 * GiB}
_MEMBER = re.compile(r"recipe\.json|graph\.ir|constants\.pt|tail\.ir|tail\.pt|plans/[A-Za-z0-9_.,=-]{1,200}\.json"
                     r"|kernels/[0-9a-f]{32}\.so|tactics/[A-Za-z0-9_.-]{1,200}\.json"
                     r"|tokenizer/[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}")
_EXTRACTED = ("constants.pt", "kernels", "tactics", "tokenizer")      # what is mapped or loaded by path: written to disk


def _host() -> dict[str, Any]:
    from graphmode.targets.host import detect_host_facts, simd_features
    cpu = detect_host_facts().cpu
    return {"cpu": cpu.model_name, "arch": cpu.isa, "simd": simd_features(cpu)}


def _bucket_file(key: str) -> str:
    """A bucket's plan member; a model with no dims has one bucket, keyed ""."""
    return "plans/" + (key.replace(",", "_").replace("=", "-") or "static") + ".json"


class _Hashing:
    """A write-only stream that hashes and counts what passes through it to `f`."""

    def __init__(self, f: Any):
        self.f, self.sha, self.bytes = f, hashlib.sha256(), 0

    def write(self, b: bytes) -> int:
        self.sha.update(b)
        self.bytes += len(b)
        return self.f.write(b)

    def flush(self) -> None:
        self.f.flush()

    def member(self) -> dict[str, Any]:
        return {"bytes": self.bytes, "sha256": self.sha.hexdigest()}


def check_writable(path: str | Path, where: str = "--save") -> Path:
    """Refuse an artifact path that cannot be written before the buckets are built (minutes), not after:
    a folder, a FIFO or device (the atomic replace would put a file in its place), or a parent that
    cannot be created or written. A link is followed: the file it points to is the one replaced."""
    from graphmode.paths import writable_output
    try:
        return writable_output(path, where, replaced=True)
    except GraphmodeError as e:
        raise ArtifactError(e.message, where=where, value=e.value, fix=e.fix, exit_code=2) from None


def save(cm: Any, path: str | Path, *, rank: int | None = None, envs: list[dict[str, int]] | None = None,
         decoder: dict[str, Any] | None = None, tokenizer: Path | None = None) -> dict[str, Any]:
    """Build every bucket of `cm` (from its cache where it can) and write them into one file.
    Returns the manifest. `rank`: `cm` is that rank's shard of a tensor-parallel group, saved
    by the group (runtime/rank_artifacts.py), which loads it back on that rank only. A
    decoder's paged graph (decode/saved.py) comes with its plans' `envs`, its sizes
    (`decoder`) and a folder of tokenizer files (`tokenizer`, or None)."""
    from graphmode.runtime.build import cache_key
    path = check_writable(path, "path")
    if cm.mode == "eager" or cm.graph is None:
        raise ArtifactError("an eager-mode model has no plans to save", where="exe_mode", value=cm.mode,
                            fix="compile with exe_mode graph or hybrid")
    if rank is None:
        refuse_tensor_parallel(cm.recipe, str(path))
    if cm.recipe.memory.kv_cache is not None and decoder is None:
        raise ArtifactError("decoder artifacts (memory.kv_cache) are not supported yet: the decode engine builds "
                            "its prefill/decode graphs from the module", where="memory.kv_cache",
                            fix="deploy decoders with `graphmode serve` on the model itself")
    if cm.recipe.on_violation == "eager" and decoder is None:
        import warnings

        from graphmode.capture.spec import GraphmodeNotice
        warnings.warn(GraphmodeNotice(f"{path.name}: on_violation: eager has nothing to fall back to once saved (the "
                                      "file holds plans, not the model): a request outside the contract, or one it "
                                      "sends to eager, is refused when run from it"), stacklevel=3)
    values = getattr(cm, "exact_values", None)
    promoted = {d: v for d, v in values.report().items() if v} if values is not None and envs is None else {}
    if promoted:
        import warnings

        from graphmode.capture.spec import GraphmodeNotice
        warnings.warn(GraphmodeNotice(
            f"{path.name}: the plans of recurring values ({promoted}, dims.<d>.exact_plans) are not saved: the file "
            "holds the recipe's buckets, and such requests run padded from it (add the values to the recipe's buckets "
            "to save their plans)"), stacklevel=3)
    t0 = time.perf_counter()
    if envs is None:
        cm.warmup()
    graph = cm.graph
    buckets = envs if envs is not None else cm.recipe.buckets()
    plans: dict[str, Any] = {}
    libraries: dict[str, Path] = {}
    schedules: set[str] = set()
    tactic_files: set[str] = set()      # this model's entries of the shared timing cache, not its neighbours'
    for env in buckets:
        exe = cm.executable(env)
        plans[cm.bucket_key(env)] = exe.plan.to_json()
        if getattr(exe, "schedule", None) is not None:
            schedules.add(exe.schedule)
        for lib in getattr(exe, "libraries", []):
            libraries.setdefault(Path(lib).name, Path(lib))
        tactic_files |= getattr(exe, "tactic_files", frozenset())
    if "claim" in schedules:        # the work-claiming pool those kernels run on: shipped, not built at load
        from graphmode.backends.cpu.claim_pool import library_path
        pool = library_path()
        if pool is not None:
            libraries.setdefault(pool.name, pool)
    key = cache_key(cm, buckets[0])
    out_spec = getattr(cm.capture_report, "out_spec", None) if cm.capture_report is not None else None
    manifest = {"format": FORMAT, "graphmode": __version__, "torch": torch.__version__,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "host": _host(),
                "model": cm.source.name if cm.source is not None else graph.name,
                "recipe_hash": cm.recipe.hash(), "graph_hash": key["graph_hash"],
                "target": getattr(cm.target, "name", "host"), "mode": cm.mode, "device": cm.device,
                "isa": cm.recipe.codegen.isa,
                "threads": cm.threads, "buckets": list(plans), "outputs": cm.output_names,
                "out_spec": out_spec, "output_structure": cm.output_structure,
                "mutated_inputs": list(cm.mutated_inputs), "exact_dims": list(cm.exact_dims),
                "positional": positional_names(cm), "omitted": omitted_constants(cm),
                "masked_dims": list(getattr(cm, "masked_dims", [])), "mask_sources": getattr(cm, "mask_sources", None),
                "query_key_dims": list(getattr(cm, "query_key_dims", [])), "kernels": sorted(libraries),
                # the compile's checks: a rank's shard (its table split over the ranks) cannot derive them again
                "input_bounds": bounds_doc(*cm.bounds()) if decoder is None else None}
    if decoder is not None:
        manifest.update(bucket_envs=[dict(e) for e in buckets], decoder=decoder)
    if len(schedules) == 1:
        manifest["schedule"] = schedules.pop()
    from graphmode.ir.fallback import op_module
    nodes = list(graph.nodes) + list(cm.tail.nodes if getattr(cm, "tail", None) is not None else [])
    modules = sorted({m for n in nodes if n.op == "fallback" for m in [op_module(n.attrs["target"])] if m})
    if modules:
        manifest["op_modules"] = modules     # imported at load, so a library's custom ops exist there
    if rank is not None:
        manifest.update(rank=rank, world=cm.recipe.parallel.tensor)
    files: dict[str, dict[str, Any]] = {}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")   # two saves never share one
    writing = StageReporter(getattr(cm, "on_stage", None), "write", None, str(path))
    writing.start()
    try:
        with zipfile.ZipFile(tmp, "x", compression=zipfile.ZIP_STORED) as z:
            def put(name: str, data: bytes) -> None:
                z.writestr(name, data)
                files[name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            put("recipe.json", json.dumps(cm.recipe.model_dump(mode="json")).encode())
            put("graph.ir", graph.text().encode())
            with z.open("constants.pt", "w", force_zip64=True) as f:   # streamed: no in-memory copy of the weights
                out = _Hashing(f)
                # run-time state (KV pools) is not saved: its type is in graph.ir, and it loads as zeros
                torch.save({k: v.contiguous() for k, v in graph.constants.items()
                            if graph.values[k].role != "state"}, out)
            files["constants.pt"] = out.member()
            for name, data in (tail_members(cm.tail) if getattr(cm, "tail", None) is not None else {}).items():
                put(name, data)        # what runs after the plan on data-dependent sizes (runtime/tail.py)
            for k, text in plans.items():
                put(_bucket_file(k), json.dumps(text).encode())
            for name, lib in sorted(libraries.items()):
                put(f"kernels/{name}", lib.read_bytes())
            tactics = _tactics_dir(libraries)
            for name in sorted(tactic_files) if tactics is not None else []:
                if (tactics / name).is_file():
                    put(f"tactics/{name}", (tactics / name).read_bytes())
            for f in sorted(tokenizer.iterdir()) if tokenizer is not None else []:
                if f.is_file():
                    put(f"tokenizer/{f.name}", f.read_bytes())
            manifest["files"] = files
            manifest["digest"] = manifest_digest(manifest)
            z.writestr("manifest.json", json.dumps(manifest, indent=1))
        tmp.replace(path)                 # a reader never sees a half-written artifact
        writing.finish()
    except OSError as e:
        fix = ("free space on that disk, or save it on another" if e.errno in (errno.ENOSPC, errno.EDQUOT)
               else "write it to a folder you can write to")
        raise ArtifactError(f"cannot write the artifact: {e.strerror or e}", where=str(path), fix=fix) from None
    finally:
        tmp.unlink(missing_ok=True)       # an error of any kind (or ^C) leaves no half-written file behind
    manifest["seconds"] = round(time.perf_counter() - t0, 3)
    manifest["bytes"] = path.stat().st_size
    return manifest


def not_a_forward(path: str) -> GraphmodeError:
    """What a forward call of a loaded decoder gets: its file holds the paged decode graph only."""
    return GraphmodeError("a decoder's .gm holds the paged graph its decode engine runs, not the whole-sequence "
                          "forward", where="model", value=path,
                          fix="cm.generate(input_ids) / cm.stream(...), graphmode generate or serve it; for logits "
                              "at every position compile the model itself")


def refuse_tensor_parallel(recipe: Any, where: str) -> None:
    """An artifact holds one graph; a `parallel` recipe's ranks each run their own shard, so one
    shard saved or loaded alone would stop at its first collective: refused. The group saves
    and loads every rank's file together (runtime/rank_artifacts.py)."""
    par = getattr(recipe, "parallel", None)
    if par is not None and par.tensor > 1:
        raise ArtifactError(f"a tensor-parallel recipe (parallel.tensor {par.tensor}) has one shard per rank, and an "
                            "artifact holds one graph: the rank group saves one file per rank", where=where,
                            value=f"parallel.tensor: {par.tensor}",
                            fix="save the rank group (graphmode.compile(...).save(path) or `graphmode compile --save`: "
                                "one file per rank and a group file), or start the ranks from the model "
                                "(`graphmode run --recipe`)")


def _check_rank(manifest: dict[str, Any], recipe: Any, rank: int | None, path: Path) -> None:
    """A rank's file loads on its rank only; any other file of a tensor-parallel recipe is refused."""
    if manifest.get("rank") is None:
        refuse_tensor_parallel(recipe, str(path))
        return
    if rank is None:
        raise ArtifactError(f"this is rank {manifest['rank']}'s shard of a {manifest.get('world')}-rank group: alone it "
                            "would stop at its first collective", where=str(path),
                            fix="load the group file it was saved with (graphmode.load(GROUP.gm) starts every rank)")
    par = getattr(recipe, "parallel", None)
    if manifest["rank"] != rank or par is None or manifest.get("world") != par.tensor:
        raise ArtifactError(f"this file is rank {manifest['rank']} of {manifest.get('world')}, loaded as rank {rank} "
                            f"of {par.tensor if par else 1}", where=str(path), value=manifest["rank"],
                            fix="load the group file (it gives each rank its own file)")


def _tactics_dir(libraries: dict[str, Path]) -> Path | None:
    """The timing cache beside the kernel folder (the CPU backend's layout)."""
    for lib in libraries.values():
        d = lib.parent.parent / "tactics"
        return d if d.is_dir() else None
    return None


# ---- reading ---------------------------------------------------------------------------------------

def _damaged(where: Path, name: str, why: str) -> ArtifactError:
    return ArtifactError(f"{name} is damaged or edited: {why}", where=f"{where}:{name}",
                         fix="the file was damaged in transit or edited: save the artifact again", exit_code=2)


def _member_limit(name: str, archive_bytes: int) -> int:
    return archive_bytes if name == "constants.pt" else MEMBER_MAX_BYTES[name.split("/")[0]]


def _stream(z: zipfile.ZipFile, name: str, where: Path, limit: int, want: dict[str, Any] | None):
    """The chunks of member `name`, checked: present, stored, within `limit` (and `want`'s
    size), ending in `want`'s sha256. A damaged member is an ArtifactError, raised at the
    first bad chunk or after the last."""
    try:
        info = z.getinfo(name)
    except KeyError:
        raise ArtifactError(f"the artifact has no {name}", where=str(where),
                            fix="it is truncated, damaged or not a graphmode artifact: save it again",
                            exit_code=2) from None
    if info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 0x1:
        raise _damaged(where, name, "it is compressed or encrypted; graphmode stores every member as is")
    if info.file_size > limit or info.file_size != info.compress_size:
        raise _damaged(where, name, f"it claims {info.file_size} bytes ({info.compress_size} stored), "
                                    f"more than {limit} or than it holds")
    if want is not None and info.file_size != want["bytes"]:
        raise _damaged(where, name, f"{info.file_size} bytes where the manifest lists {want['bytes']}")
    sha, left = hashlib.sha256(), info.file_size
    try:
        with z.open(info) as f:
            while left > 0:
                b = f.read(min(left, 1 << 20))
                if not b:
                    raise _damaged(where, name, "it ends early (truncated)")
                left -= len(b)
                sha.update(b)
                yield b
    except ArtifactError:
        raise
    except Exception as e:  # noqa: BLE001 - zipfile raises BadZipFile, OSError, EOFError, ValueError, zlib.error
        raise _damaged(where, name, f"{type(e).__name__}: {str(e)[:200]}") from None
    if want is not None and sha.hexdigest() != want["sha256"]:
        raise _damaged(where, name, "its sha256 differs from the manifest's")


def _member(z: zipfile.ZipFile, name: str, where: Path, manifest: dict[str, Any], archive_bytes: int) -> bytes:
    return b"".join(_stream(z, name, where, _member_limit(name, archive_bytes), manifest["files"].get(name)))


def read_manifest(z: zipfile.ZipFile, where: Path) -> dict[str, Any]:
    """The manifest, parsed strictly and checked field by field against `Manifest`, its
    member list against the archive's; or ArtifactError."""
    raw = b"".join(_stream(z, "manifest.json", where, MANIFEST_MAX_BYTES, None))
    try:
        manifest = parse_json(raw)
    except ValueError as e:
        raise ArtifactError(f"unreadable manifest: {e}", where=f"{where}:manifest.json",
                            fix="save the artifact again", exit_code=2) from None
    if not isinstance(manifest, dict):
        raise ArtifactError(f"the manifest is a JSON {type(manifest).__name__}, not an object",
                            where=f"{where}:manifest.json", fix="save the artifact again", exit_code=2)
    _check_versions(manifest, where)        # before the fields: another version may have other fields
    try:
        Manifest.model_validate(manifest)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(x) for x in err["loc"])
        raise ArtifactError(f"manifest field {field}: {err['msg']}", where=f"{where}:manifest.json",
                            value=err.get("input"), fix="save the artifact again", exit_code=2) from None
    if manifest["digest"] != manifest_digest(manifest):
        raise ArtifactError("the manifest's fields differ from the ones it was written with (its digest does "
                            "not match): it was edited or damaged", where=f"{where}:manifest.json",
                            fix="save the artifact again (graphmode compile ... --save)", exit_code=2)
    problem = _members_problem(z, manifest)
    if problem is not None:
        raise ArtifactError(problem, where=str(where), fix="save the artifact again", exit_code=2)
    return manifest


def _members_problem(z: zipfile.ZipFile, manifest: dict[str, Any]) -> str | None:
    from graphmode.backends.cpu.isa import CAPS
    if manifest["isa"] not in CAPS:
        return f"manifest field isa: {manifest['isa']!r} is not one of {', '.join(CAPS)}"
    names = [i.filename for i in z.infolist()]
    if len(names) != len(set(names)):
        return "the archive holds a member twice"
    listed = set(manifest["files"])
    present = set(names) - {"manifest.json"}
    for name in sorted(listed | present):
        if not _MEMBER.fullmatch(name):
            return f"unexpected member {name[:200]!r}: not one a graphmode artifact holds"
    if present != listed:
        extra, missing = sorted(present - listed), sorted(listed - present)
        return (f"members not in the manifest: {', '.join(extra)[:300]}" if extra else
                f"members the manifest lists are missing: {', '.join(missing)[:300]}")
    for name in ("recipe.json", "graph.ir", "constants.pt"):
        if name not in listed:
            return f"the artifact has no {name}"
    kernels = {f"kernels/{k}" for k in manifest["kernels"]}
    if kernels != {n for n in listed if n.startswith("kernels/")}:
        return "the manifest's kernels and its kernel members differ"
    for key in manifest["buckets"]:
        if _bucket_file(key) not in listed:
            return f"no plan for bucket {key[:200]}"
    return None


def needed_simd(built: list[str], isa: str) -> list[str]:
    """The build host's SIMD flags its kernels may use under the recipe's `codegen.isa` cap:
    all of them at auto (-march=native), none of AVX-512 under avx2 (-mno-avx512f drops the
    family), only baseline x86-64 for portable."""
    if isa == "portable":
        return []
    if isa == "avx2":
        return [f for f in built if not f.startswith("avx512")]
    return list(built)


def _check_versions(manifest: dict[str, Any], where: Path) -> None:
    if manifest.get("format") is None:
        raise ArtifactError("its manifest names no format: a zip, but not one graphmode wrote", where=str(where),
                            fix="pass a file written by graphmode compile --save / CompiledModel.save", exit_code=2)
    if manifest.get("format") != FORMAT:
        raise ArtifactError(f"artifact format {short_value(manifest.get('format'))!r}, this graphmode reads format "
                            f"{FORMAT}", where=str(where), fix="save it again with this graphmode version")
    for name, have in (("graphmode", __version__), ("torch", torch.__version__)):
        if manifest.get(name) != have:
            got = short_value(manifest.get(name))
            raise ArtifactError(f"built with {name} {got}, this is {name} {have}", where=str(where), value=got,
                                fix=f"load it with {name} {got}, or compile again here (graphmode compile ... --save)")


def check_manifest(manifest: dict[str, Any], where: Path, host: dict[str, Any] | None = None) -> None:
    """Refuse an artifact this process cannot run as it was built: format, versions, host ISA."""
    _check_versions(manifest, where)
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


class _OwnedZip(zipfile.ZipFile):
    """A ZipFile that closes the file object it reads (ZipFile leaves one passed to it open: a
    ResourceWarning at every load)."""

    def __init__(self, fobj: Any):
        self._owned = fobj              # first: a file that is no zip raises in __init__, then __del__ closes
        super().__init__(fobj)

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._owned.close()


def _open(path: Path, digest: bool = True) -> tuple[zipfile.ZipFile, str, int]:
    """(the archive, its digest, its size): a regular file, hashed and opened from one descriptor.
    Without `digest` the whole file is not read (its digest is ""): a caller after one member."""
    try:
        f = open_file(path, limit=1 << 48)
    except UntrustedFileError as e:
        if not Path(path).exists() and not Path(path).is_symlink():
            raise ArtifactError("no such artifact", where=str(path), fix="check the path", exit_code=2) from None
        if e.message.startswith("cannot open it"):          # there, but this process may not read it
            raise ArtifactError(f"cannot read the artifact: {e.message}", where=str(path), exit_code=2,
                                fix="check the file's permissions (this process must be able to read it)") from None
        raise ArtifactError(f"not an artifact: {e.message}", where=str(path), exit_code=2,
                            fix="pass a file written by graphmode compile --save / CompiledModel.save") from None
    with f:
        try:
            sha = hashlib.sha256()
            for b in f.chunks() if digest else ():
                sha.update(b)
            fobj = os.fdopen(os.dup(f.fd), "rb")
        except (OSError, GraphmodeError) as e:
            raise ArtifactError(f"cannot read it: {getattr(e, 'message', e)}", where=str(path)) from None
    if f.size == 0:
        fobj.close()
        raise ArtifactError("the file is empty (0 bytes)", where=str(path), exit_code=2,
                            fix="copy it again whole, or save it again (graphmode compile ... --save)")
    try:
        z = _OwnedZip(fobj)
    except Exception as e:  # noqa: BLE001 - a damaged central directory raises many types
        cut = fobj.seek(0) == 0 and fobj.read(4) == b"PK\x03\x04"   # a zip's first member, no directory at its end
        fobj.close()
        raise ArtifactError(f"{'a zip archive without its end: truncated' if cut else 'not a graphmode artifact'}: "
                            f"{type(e).__name__}: {str(e)[:200]}", where=str(path), exit_code=2,
                            fix="copy it again whole, or save it again" if cut else
                            "pass a file written by graphmode compile --save / CompiledModel.save") from None
    return z, sha.hexdigest()[:24] if digest else "", f.size


def load(path: str | Path, *, cache_dir: str | Path | None = None, threads: int | None = None,
         on_stage: OnStage | None = None, rank: int | None = None):
    """A CompiledModel from a `.gm` file, every bucket ready (no capture, no kernel compile
    when the host matches). Extracted once under the cache's `artifacts/<digest>/`; the
    extracted copy is checked against the manifest on every load and extracted again when
    it differs. `on_stage` hears the `plans` stage, bucket N of M (graphmode/progress.py).
    A tensor-parallel group's file starts its ranks from their own files
    (runtime/rank_artifacts.py); `rank` loads that rank's file in a rank process."""
    from graphmode.backends import get_backend
    from graphmode.capture.source import ModelSource
    from graphmode.errors import PlanError
    from graphmode.paths import cache_layout
    from graphmode.plan.execution import load_plan
    from graphmode.runtime.build import backend_options, cache_key
    from graphmode.runtime.compiled import CompiledModel
    path = Path(path)
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                or not 1 <= threads <= MAX_THREADS):
        raise ArtifactError(f"threads must be an integer in [1, {MAX_THREADS}]", where="threads", value=threads,
                            fix="pass a thread count no larger than the machine's cores, or None for the artifact's")
    z, digest, size = _open(path)
    with z:
        if rank is None and GROUP_MEMBER in z.namelist():
            from graphmode.runtime.rank_artifacts import load_group
            z.close()
            return load_group(path, cache_dir=cache_dir, threads=threads)
        manifest = read_manifest(z, path)
        check_manifest(manifest, path)
        recipe = _recipe(z, path, manifest, size)
        _check_rank(manifest, recipe, rank, path)
        root = cache_layout(cache_dir).artifacts / digest
        if not (root / "complete").is_file() or _extraction_problem(root, manifest, size) is not None:
            root = _extract_somewhere(z, path, root, manifest, size)
        try:
            text = _member(z, "graph.ir", path, manifest, size).decode()
        except UnicodeDecodeError:
            raise _damaged(path, "graph.ir", "it is not UTF-8 text") from None
        graph, spill = _graph(root, text, manifest, path)
        plans = {key: _member(z, _bucket_file(key), path, manifest, size) for key in manifest["buckets"]}
        tail = _tail(z, path, manifest, size)
    source = ModelSource(manifest.get("model") or graph.name, input_dims={i.name: list(i.shape) for i in recipe.inputs},
                         output_names=list(manifest.get("outputs") or []))
    source.__dict__["_omitted"] = dict(manifest.get("omitted") or {})     # what omitted_value found at save
    cm = CompiledModel(source, recipe, _target(manifest.get("target")), None, graph, None, mode=manifest["mode"],
                       cache_dir=root, threads=threads if threads is not None else manifest.get("threads"),
                       device=manifest.get("device") or "cpu", on_stage=on_stage)
    for field in ("exact_dims", "masked_dims", "query_key_dims", "mutated_inputs", "positional"):
        setattr(cm, field, list(manifest.get(field) or []))
    cm.mask_sources = manifest.get("mask_sources")
    cm.output_structure, cm.tail = manifest.get("output_structure"), tail
    if manifest.get("input_bounds") is not None:
        cm._bounds = bounds_from_doc(manifest["input_bounds"])
    cm.artifact = {"path": str(path), "digest": digest, **{k: manifest[k] for k in ("created", "host", "buckets")}}
    cm.artifact["tokenizer"] = str(root / "tokenizer") if (root / "tokenizer").is_dir() else None
    if manifest.get("decoder") is not None:       # decode/saved.py builds its engine over this model
        cm.artifact["decoder"] = manifest["decoder"]
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
    try:
        backend = get_backend(cm.device)
    except GraphmodeError as e:
        raise ArtifactError(f"it runs on device {cm.device!r}: {e.message}", where=f"{path}:manifest.json",
                            fix=e.fix) from None
    extra: dict[str, Any] = backend_options(backend, recipe)
    if backend.capabilities.kernel_selection:       # a backend with tactics: the saved choices are final
        extra["frozen"] = True
    if manifest.get("schedule") is not None and backend.capabilities.generates_kernels:
        extra["schedule"] = manifest["schedule"]     # the libraries' own, whatever `auto` means in this process
    buckets = manifest.get("bucket_envs") or recipe.buckets()
    with stage(on_stage, "plans", total=len(buckets)) as progress_plans:
        for env in buckets:
            key = cm.bucket_key(env)
            if key not in plans:
                raise ArtifactError(f"no plan for bucket {key}", where=str(path), fix="save the artifact again",
                                    exit_code=2)
            try:
                doc = parse_json(plans[key], nonfinite=True)    # json.dumps writes -inf as -Infinity
                if not isinstance(doc, dict):
                    raise ValueError(f"a JSON {type(doc).__name__}, not an object")
                plan = load_plan(doc, graph, env, built_for=cache_key(cm, env),
                                 reuse=recipe.optimize.memory_reuse, alias_groups=[list(g) for g in recipe.alias_groups])
            except (PlanError, ValueError, TypeError, KeyError, AttributeError) as e:
                raise ArtifactError(f"the plan for bucket {key} is not a plan of its graph: "
                                    f"{getattr(e, 'message', e)}", where=str(path), fix="save the artifact again",
                                    exit_code=2) from None
            t0 = time.perf_counter()
            exe = backend.executable(plan, graph.constants, kernel_dir=root / "kernels", threads=cm.threads,
                                     kernel_selection=recipe.codegen.kernel_selection, **extra)
            cm._executables[key] = exe
            if cm.constant_spill is not None:
                cm.constant_spill.release()
            cm._event("artifact_load", bucket=key, seconds=round(time.perf_counter() - t0, 3))
            progress_plans.step(key)
    return cm


def recipe_of(path: str | Path):
    """The recipe an artifact was compiled with (nothing extracted or loaded): what a server of
    the artifact serves, and the only recipe it can serve. Read as `load` reads it: the manifest
    checked (fields, members, versions, host), the recipe member within its bound, sha256 and hash.
    A tensor-parallel group's file: its ranks' recipe (runtime/rank_artifacts.py)."""
    path = Path(path)
    z, _, size = _open(path, digest=False)
    with z:
        if GROUP_MEMBER in z.namelist():
            from graphmode.runtime.rank_artifacts import group_files
            z.close()
            return group_files(path)[1]
        manifest = read_manifest(z, path)
        check_manifest(manifest, path)
        return _recipe(z, path, manifest, size)


def _recipe(z: zipfile.ZipFile, path: Path, manifest: dict[str, Any], size: int):
    """The recipe member, parsed and checked against the manifest's recipe hash."""
    from graphmode.recipe import Recipe
    try:
        recipe_doc = parse_json(_member(z, "recipe.json", path, manifest, size))
        recipe = Recipe.model_validate(recipe_doc)
    except (ValueError, TypeError) as e:
        raise ArtifactError(f"unreadable recipe: {str(e).splitlines()[0][:300]}", where=f"{path}:recipe.json",
                            fix="save the artifact again", exit_code=2) from None
    if recipe.hash() != manifest.get("recipe_hash"):
        raise ArtifactError("its recipe does not match the manifest's hash (edited?)", where=f"{path}:recipe.json",
                            fix="save the artifact again", exit_code=2)
    return recipe


def _tail(z: zipfile.ZipFile, where: Path, manifest: dict[str, Any], size: int) -> Any:
    if not any(m in manifest["files"] for m in TAIL_MEMBERS):
        return None
    try:
        members = [_member(z, m, where, manifest, size) for m in TAIL_MEMBERS]
        return read_tail(*members, manifest.get("op_modules"))
    except ArtifactError:
        raise
    except Exception as e:  # noqa: BLE001 - the parser, torch.load and an op's module raise many types
        raise _damaged(where, "tail.ir", getattr(e, "message", None) or f"{type(e).__name__}: {str(e)[:200]}") from None


def _graph(root: Path, text: str, manifest: dict[str, Any], where: Path):
    """(the graph over the weights mapped from `root`, their spill), checked against the
    manifest's graph hash, or ArtifactError."""
    from graphmode.hostmem import load_mapped
    from graphmode.ir.parser import parse_graph
    try:
        constants, spill = load_mapped(root / "constants.pt")
        if not isinstance(constants, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                      for k, v in constants.items()):
            raise ArtifactError("its constants are not a mapping of names to tensors", where=f"{where}:constants.pt",
                                fix="save the artifact again", exit_code=2)
        graph = parse_graph(text, constants)
        from graphmode.ir.fallback import import_op_modules
        import_op_modules(manifest.get("op_modules") or [],
                          [n.attrs["target"] for n in graph.nodes if n.op == "fallback"])
    except ArtifactError:
        raise
    except GraphmodeError as e:
        raise ArtifactError(f"its graph or weights are damaged or edited: {e.message}", where=str(where),
                            fix="save the artifact again", exit_code=2) from None
    except Exception as e:  # noqa: BLE001 - torch.load and the parser raise many types for a damaged file
        raise ArtifactError(f"its graph or constants do not load: {type(e).__name__}: {str(e)[:200]}",
                            where=f"{where}:constants.pt", fix="save the artifact again", exit_code=2) from None
    if manifest.get("graph_hash") not in (graph.structural_hash(), graph.structural_hash(named=True)):
        raise ArtifactError("its graph or weights do not match the manifest's hash (edited?)", where=str(where),
                            fix="save the artifact again", exit_code=2)
    return graph, spill


def _extracted(manifest: dict[str, Any]) -> list[str]:
    return sorted(n for n in manifest["files"] if n.split("/")[0] in _EXTRACTED)


def _extraction_problem(root: Path, manifest: dict[str, Any], archive_bytes: int) -> str | None:
    """Why the extracted copy in `root` is not the manifest's (a member missing, of another
    type, size or hash, a kernel library unsealed), or None."""
    from graphmode.backends.cpu.build import library_seal, seal_path
    for name in _extracted(manifest):
        want, limit = manifest["files"][name], _member_limit(name, archive_bytes)
        try:
            if not name.startswith("kernels/"):
                if file_sha256(root / name, limit=limit, root=root) != want["sha256"]:
                    return f"{name} differs from the artifact"
                continue
            data = read_bytes(root / name, limit=limit, root=root, sha256=want["sha256"])
            seal = read_bytes(root / seal_path(Path(name)), limit=1024, root=root).decode("ascii", "replace")
            if seal.strip() != library_seal(root / "kernels", Path(name).stem, data):
                return f"{name}'s seal differs"
        except (UntrustedFileError, OSError) as e:
            return f"{name}: {getattr(e, 'message', e)}"
    return None


class _CannotExtract(ArtifactError):
    """The folder could not take the extracted copy (read-only, full, a path too long)."""


def _extract_somewhere(z: zipfile.ZipFile, where: Path, root: Path, manifest: dict[str, Any],
                       archive_bytes: int) -> Path:
    """The extracted copy's folder: `root` in the cache, or where the cache cannot take it (a
    read-only image layer, a full disk, a path past the file system's limit) a private temporary
    folder removed at exit, as a compile runs uncached then: a cache that cannot be used is no
    reason to fail (load refused what compile ran)."""
    try:
        _extract(z, where, root, manifest, archive_bytes)
        return root
    except _CannotExtract as e:
        import atexit
        import logging
        try:
            private = Path(tempfile.mkdtemp(prefix="graphmode-gm-"))
        except OSError:
            raise e from None
        atexit.register(shutil.rmtree, private, True)
        logging.getLogger("graphmode.runtime").warning(
            "%s: the cache cannot hold its extracted copy (%s); extracted to %s for this process instead",
            where, e.message, private)
        _extract(z, where, private / root.name, manifest, archive_bytes)
        return private / root.name


def _cannot_extract(where: Path, folder: Path, e: OSError) -> _CannotExtract:
    fix = ("free disk space, or pass another cache_dir" if e.errno in (errno.ENOSPC, errno.EDQUOT) else
           "pass a cache_dir with a shorter path" if e.errno == errno.ENAMETOOLONG else
           "use a cache folder you can write to (--cache-dir, $GRAPHMODE_CACHE_DIR, or cache_dir= in Python)")
    return _CannotExtract(f"cannot extract the artifact under {folder}: {e.strerror or e}", where=str(where), fix=fix,
                          exit_code=2)


def _extract(z: zipfile.ZipFile, where: Path, root: Path, manifest: dict[str, Any], archive_bytes: int) -> None:
    """Unpack the members that are mapped or loaded by path into `root` atomically (a folder
    renamed into place, then marked complete), each checked against the manifest as it is
    written; kernel libraries are sealed for this folder's builder. Two processes repairing
    one copy at once: the one whose rename finds the other's copy in place takes it when whole
    (its rename failed 'Directory not empty')."""
    from graphmode.backends.cpu.build import seal_library
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".extract-", dir=root.parent))
    except OSError as e:
        raise _cannot_extract(where, root.parent, e) from None
    try:
        for name in _extracted(manifest):
            out = tmp / name
            out.parent.mkdir(parents=True, exist_ok=True)
            with open(out, "wb") as f:
                for b in _stream(z, name, where, _member_limit(name, archive_bytes), manifest["files"][name]):
                    f.write(b)
            if name.startswith("kernels/"):
                seal_library(out)
        (tmp / "complete").write_text("ok")
        for _ in range(3):
            shutil.rmtree(root, ignore_errors=True)
            try:
                tmp.replace(root)
                return
            except OSError as e:
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
                if (root / "complete").is_file() and _extraction_problem(root, manifest, archive_bytes) is None:
                    return                        # another process's copy, whole: it serves
        raise OSError(errno.ENOTEMPTY, "another process kept replacing the extracted copy")
    except OSError as e:
        raise _cannot_extract(where, root.parent, e) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _target(name: str | None):
    from graphmode.targets import get_target
    try:
        return get_target(name or "host")
    except GraphmodeError:
        return None


__all__ = ["ArtifactError", "FORMAT", "Manifest", "SUFFIX", "check_manifest", "is_artifact", "load", "manifest_digest", "needed_simd",
           "read_manifest", "save"]
