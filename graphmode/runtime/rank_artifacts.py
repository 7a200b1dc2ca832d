"""A tensor-parallel group as artifacts: one `.gm` per rank and a group file that names them.

Each rank runs its own shard, so each rank's shard is its own artifact (runtime/artifact.py,
with its manifest's `rank` and `world` set): every integrity check of a `.gm` holds for it, and a
node of several machines needs only its own rank's file. Saving `out.gm` writes
`out.rank0.gm` ... `out.rank{N-1}.gm` (each rank writes its own, from its process) and then
`out.gm`, a stored zip holding only `group.json`:

    format, graphmode, torch, created   as a rank's manifest
    world                               parallel.tensor
    recipe_hash                         every rank's recipe hash (they share the recipe)
    ranks                               per rank: file (a name in the group file's folder), bytes, sha256

`graphmode.load("out.gm")` checks the group file, then every rank file's size and sha256
against it (a damaged or replaced rank file is refused naming it, before any rank starts),
then starts the ranks with the one-machine launcher (graphmode/parallel/launch.py), each
loading its own file with `artifact.load(..., rank=r)`: no capture, no passes, no kernel
compile on the same host. The result is a `TensorParallelModel`, as `graphmode.compile` gives.
"""
from __future__ import annotations

import json
import os
import time
import zipfile
from pathlib import Path
from typing import Any

import torch
from pydantic import Field, ValidationError

from graphmode.runtime.artifact import (FORMAT, GROUP_MEMBER, MANIFEST_MAX_BYTES, ArtifactError, _check_versions, _open,
                                        _stream, recipe_of)
from graphmode.runtime.manifest import MAX_RANKS, Member, _Strict, _text
from graphmode.untrusted import UntrustedFileError, file_sha256, open_file
from graphmode.version import __version__

_RANK_FILE = r"^[A-Za-z0-9_][A-Za-z0-9_.,=+-]{0,250}\.gm$"      # a plain name in the group file's folder


class RankFile(Member):
    file: str = Field(pattern=_RANK_FILE)


class GroupManifest(_Strict):
    format: int
    graphmode: str = _text(64)
    torch: str = _text(64)
    created: str = _text(64)
    world: int = Field(ge=2, le=MAX_RANKS)
    recipe_hash: str = Field(pattern=r"^[0-9a-f]{8,64}$")
    ranks: list[RankFile] = Field(min_length=2, max_length=MAX_RANKS)


def is_group(path: str | Path) -> bool:
    """Whether `path` is a group file (not checked further: `read_group` does that). Anything
    but a regular zip file is not (opened as untrusted input: a FIFO must not block it)."""
    try:
        with open_file(path, limit=1 << 48) as f, os.fdopen(os.dup(f.fd), "rb") as fo, zipfile.ZipFile(fo) as z:
            return GROUP_MEMBER in z.namelist()
    except Exception:  # noqa: BLE001 - not a zip (zipfile raises many types); `load` says what it is
        return False


def rank_paths(path: Path, world: int) -> list[Path]:
    """`out.gm` -> out.rank0.gm ... beside it."""
    return [path.with_name(f"{path.stem}.rank{r}{path.suffix or '.gm'}") for r in range(world)]


def save_group(tp: Any, path: str | Path) -> dict[str, Any]:
    """Every rank of `tp` (a TensorParallelModel) writes its shard's artifact, then the group
    file at `path` names them (module doc). Returns a summary: buckets (rank 0's), kernels and
    bytes (all files), seconds, and the group manifest."""
    path = Path(path)
    t0 = time.perf_counter()
    files = rank_paths(path, tp.world)
    for f in files:
        f.parent.mkdir(parents=True, exist_ok=True)
    manifests = tp.save_ranks(files)
    group = write_group(path, files, tp.recipe)
    return {"buckets": manifests[0]["buckets"], "kernels": [k for m in manifests for k in m["kernels"]],
            "bytes": path.stat().st_size + sum(r["bytes"] for r in group["ranks"]),
            "seconds": round(time.perf_counter() - t0, 3), "files": [str(f) for f in files], "group": group}


def write_group(path: Path, files: list[Path], recipe: Any) -> dict[str, Any]:
    """The group file at `path` over the rank artifacts `files` (written already, in rank order)."""
    group = {"format": FORMAT, "graphmode": __version__, "torch": torch.__version__,
             "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "world": len(files),
             "recipe_hash": recipe.hash(),
             "ranks": [{"file": f.name, "bytes": f.stat().st_size, "sha256": file_sha256(f, limit=1 << 48)}
                       for f in files]}
    tmp = path.with_name(path.name + ".tmp")
    try:
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED) as z:
            z.writestr(GROUP_MEMBER, json.dumps(group, indent=1))
        tmp.replace(path)                 # a reader never sees a half-written group file
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise ArtifactError(f"cannot write the group file: {e.strerror or e}", where=str(path),
                            fix="write it to a folder you can write to") from None
    return group


def read_group(path: Path, rank: int | None = None) -> dict[str, Any]:
    """The group manifest of `path`, checked field by field, with its rank files checked
    against it (size, sha256; only `rank`'s when given: a node holds its own); or ArtifactError
    naming the file."""
    z, _, _ = _open(path)
    with z:
        if [i.filename for i in z.infolist()] != [GROUP_MEMBER]:
            raise ArtifactError(f"a group file holds only {GROUP_MEMBER}", where=str(path),
                                fix="save the group again (graphmode.compile(...).save)")
        raw = b"".join(_stream(z, GROUP_MEMBER, path, MANIFEST_MAX_BYTES, None))
    try:
        group = json.loads(raw)
        if not isinstance(group, dict):
            raise ValueError(f"a JSON {type(group).__name__}, not an object")
    except (ValueError, UnicodeDecodeError) as e:
        raise ArtifactError(f"unreadable group manifest: {str(e)[:200]}", where=f"{path}:{GROUP_MEMBER}",
                            fix="save the group again") from None
    _check_versions(group, path)
    try:
        GroupManifest.model_validate(group)
    except ValidationError as e:
        err = e.errors()[0]
        raise ArtifactError(f"group manifest field {'.'.join(map(str, err['loc']))}: {err['msg']}",
                            where=f"{path}:{GROUP_MEMBER}", value=err.get("input"), fix="save the group again") from None
    if len(group["ranks"]) != group["world"]:
        raise ArtifactError(f"{len(group['ranks'])} rank files for a group of {group['world']}",
                            where=f"{path}:{GROUP_MEMBER}", fix="save the group again")
    for r, entry in enumerate(group["ranks"]):
        if rank is not None and r != rank:
            continue
        f = path.parent / entry["file"]
        try:
            digest = file_sha256(f, limit=1 << 48)
        except UntrustedFileError as e:
            raise ArtifactError(f"rank {r}'s file cannot be read: {e.message}", where=str(f),
                                fix=f"copy {entry['file']} beside {path.name}, as the group was saved") from None
        if digest != entry["sha256"] or f.stat().st_size != entry["bytes"]:
            raise ArtifactError(f"rank {r}'s file differs from the group manifest (damaged or replaced)", where=str(f),
                                fix="copy it again from where the group was saved, or save the group again")
    return group


def load_group(path: str | Path, *, cache_dir: Any = None, threads: int | None = None) -> Any:
    """Start the group saved at `path` (module doc): a TensorParallelModel whose ranks loaded
    their own files."""
    return start_group(*group_files(path), cache_dir=cache_dir, threads=threads)


def start_group(files: tuple[str, ...], recipe: Any, *, cache_dir: Any = None, threads: int | None = None) -> Any:
    """The ranks of a checked group (`group_files`), each loading its own file."""
    from graphmode.parallel.launch import launch
    if recipe.memory.kv_cache is not None:
        raise ArtifactError("a decoder group's ranks build decode engines over their files", where=files[0],
                            fix="graphmode.load(path) (it starts them), or graphmode serve/generate --model path")
    return launch(files, recipe, "host", driver=group_driver(), cache_dir=cache_dir, threads=threads)


def group_files(path: str | Path, rank: int | None = None) -> tuple[tuple[str, ...], Any]:
    """(every rank's file, the group's recipe) of the group file at `path`, checked (`read_group`;
    only `rank`'s file and recipe when given)."""
    path = Path(path)
    group = read_group(path, rank)
    if rank is not None and not 0 <= rank < group["world"]:
        raise ArtifactError(f"rank {rank} is outside the saved group of {group['world']}", where=str(path), value=rank,
                            fix=f"start {group['world']} ranks in all (the group's parallel.tensor)")
    files = tuple(str(path.parent / r["file"]) for r in group["ranks"])
    own = files[rank or 0]
    recipe = recipe_of(own)
    if recipe.hash() != group["recipe_hash"] or recipe.parallel is None or recipe.parallel.tensor != group["world"]:
        raise ArtifactError(f"rank {rank or 0}'s recipe is not the group's (hash or parallel.tensor)", where=own,
                            fix="save the group again")
    return files, recipe


def group_driver() -> Any:
    """What a rank of a saved group runs in place of compiling (graphmode/parallel/launch.py
    `RankDriver`): its own file, loaded."""
    from graphmode.compile_report import facts_of, graph_collectives
    from graphmode.parallel.launch import RankDriver
    return RankDriver(compile=load_rank, resolve_model=artifact_source, collectives=graph_collectives,
                      save=save_group, facts=facts_of)


def load_rank(files: Any, recipe: Any, target: Any, *, rank: int, cache_dir: Any = None, threads: int | None = None,
              **_: Any) -> Any:
    """What a rank process runs in place of compiling (RankDriver.compile): its own file, loaded;
    its report says so (the artifact's digest, the buckets it loaded, the kernels compiled)."""
    from graphmode.backends.cpu.build import builder_for
    from graphmode.runtime.artifact import load
    cm = load(files[rank], cache_dir=cache_dir, threads=threads, rank=rank)
    if cm.recipe.hash() != recipe.hash():
        raise ArtifactError(f"rank {rank}'s recipe is not the group's", where=str(files[rank]),
                            fix="save the group again")
    kernels = Path(cm.cache_dir) / "kernels"
    cm.rank_info = {"artifact": cm.artifact["digest"], "artifact_loads": cm.events["artifact_load"],
                    "kernel_compiles": builder_for(kernels, cm.threads).stats["compiles"]}
    return cm


def artifact_source(files: Any, recipe: Any) -> Any:
    """The group's model in the calling process: no module (the ranks hold the graphs)."""
    from graphmode.capture.source import ModelSource
    return ModelSource(recipe.name, input_dims={i.name: list(i.shape) for i in recipe.inputs})


__all__ = ["GroupManifest", "group_driver", "group_files", "is_group", "load_group", "rank_paths", "read_group", "save_group", "write_group"]
