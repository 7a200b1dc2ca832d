"""Damaged plan, kernel and timing cache entries under a real compile, by API and CLI.

A pristine cache of the fuzz MLP (two buckets, their plans and kernel libraries) is filled
once; each case copies it and damages the copy the way a bad disk, a sync, a hand edit or an
attacker who cannot read the folder's key would: a byte flipped or the file cut short, a FIFO,
a device, a link out of the folder, a huge sparse file, a folder where a file was (and a file
where a folder was), plan JSON edited with its checksum updated, libraries edited with a
recomputed checksum in place of the seal, swapped between entries, forged (a foreign library
carrying the build key), seals and the seal key lost or damaged; timing entries with garbage.
Every case must run with the eager answer (a cache is rebuilt, never a reason to fail): a
refusal is `valid-refused`. CLI cases run `graphmode run --json` over the damaged copy.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

FILE_DAMAGE = ("flip", "truncate", "empty", "fifo", "dev-zero", "link-out", "sparse-huge", "folder", "garbage",
               "deep-json", "huge-number")
TARGETS = ("plan", "meta", "library", "seal", "seal-key", "probe", "timing")
FOLDER_DAMAGE = ("plans-is-file", "kernels-is-file", "entry-is-file", "entry-is-link", "root-is-file")
LIBRARY_TAMPER = ("flip-rechecksum", "swap-with-seal", "forged-key-mark", "seal-from-other-cache", "sha256-sidecar")


def setup(work: Path) -> dict[str, Any]:
    import graphmode
    import yaml
    from graphmode.fuzz.models import RECIPE, SPEC
    from graphmode.recipe import load_recipe
    from graphmode.backends.cpu.build import SEAL_KEY, seal_library
    pristine = work / "pristine"
    graphmode.compile(SPEC, load_recipe(RECIPE), cache_dir=pristine).warmup()
    other = work / "other" / "kernels"          # the same libraries sealed in another cache (another key)
    shutil.copytree(pristine / "kernels", other)
    (other / SEAL_KEY).unlink()
    for lib in other.glob("*.so"):
        seal_library(lib)
    recipe = work / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(RECIPE))
    timing = pristine / "tactics"
    timing.mkdir(exist_ok=True)
    (timing / "gemm-0123.json").write_text(json.dumps({"key": {"v": 1}, "timings_s": {"aten": 1e-3}, "rejected": {}}))
    return {"pristine": str(pristine), "other": str(other.parent), "recipe": str(recipe), "work": str(work)}


def cases(rng: random.Random, n: int, ctx: dict[str, Any]) -> list[dict[str, Any]]:
    pool = [{"kind": "file", "target": t, "damage": d} for t in TARGETS for d in FILE_DAMAGE]
    pool += [{"kind": "folder", "damage": d} for d in FOLDER_DAMAGE]
    pool += [{"kind": "library", "damage": d} for d in LIBRARY_TAMPER]
    pool += [{"kind": "plan-edit", "seed": rng.randrange(1 << 30)} for _ in range(20)]
    pool += [{"kind": "full-disk"}]
    first = [c for c in pool if c["kind"] in ("folder", "library", "full-disk")]
    rest = [c for c in pool if c not in first]
    rng.shuffle(rest)
    picked = (first + rest)[:max(n - max(2, n // 10), 1)]
    picked += [dict(rng.choice(pool), cli=True) for _ in range(n - len(picked))]   # a share of them by CLI
    for i, c in enumerate(picked):
        c["expect"] = "valid"
        c["id"] = f"{i:03d}-{'cli-' if c.get('cli') else ''}{c['kind']}-" + "-".join(
            str(c[k]) for k in ("target", "damage") if k in c)
        if c.get("cli"):
            c["timeout_s"] = 300
    return picked


def _files(cache: Path, target: str) -> list[Path]:
    plans = sorted((cache / "plans").iterdir())
    return {"plan": [p / "plan.json" for p in plans], "meta": [p / "meta.json" for p in plans],
            "library": sorted((cache / "kernels").glob("*.so")),
            "seal": sorted((cache / "kernels").glob("*.so.seal")),
            "seal-key": [cache / "kernels" / ".seal-key"],
            "probe": sorted((cache / "kernels").glob("probe-*.json")),
            "timing": sorted((cache / "tactics").glob("*.json"))}[target]


def _damage_file(f: Path, damage: str, rng: random.Random) -> None:
    data = f.read_bytes() if f.is_file() else b""
    if f.exists() or f.is_symlink():
        shutil.rmtree(f) if f.is_dir() and not f.is_symlink() else f.unlink()
    if damage == "flip" and data:
        b = bytearray(data)
        b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        f.write_bytes(bytes(b))
    elif damage == "truncate":
        f.write_bytes(data[: rng.randrange(max(1, len(data)))])
    elif damage == "empty":
        f.write_bytes(b"")
    elif damage == "fifo":
        os.mkfifo(f)
    elif damage == "dev-zero":
        f.symlink_to("/dev/zero")
    elif damage == "link-out":
        f.symlink_to("/etc/hostname")
    elif damage == "sparse-huge":
        with open(f, "wb") as out:
            out.truncate(8 << 30)
    elif damage == "folder":
        f.mkdir()
    elif damage == "garbage":
        f.write_bytes(rng.randbytes(rng.randrange(1, 4096)))
    elif damage == "deep-json":
        f.write_text("[" * 200000)
    elif damage == "huge-number":
        f.write_text('{"key": 1e999, "files": {"plan.json": ' + "9" * 5000 + "}}")


def _reseal_plan(entry: Path) -> None:
    meta = json.loads((entry / "meta.json").read_text())
    meta["files"]["plan.json"] = hashlib.sha256((entry / "plan.json").read_bytes()).hexdigest()
    (entry / "meta.json").write_text(json.dumps(meta))


def _edit_plan(cache: Path, rng: random.Random) -> None:
    """A random value inside one plan changed, its checksum updated (what load_plan must catch)."""
    entry = rng.choice(sorted((cache / "plans").iterdir()))
    plan = json.loads((entry / "plan.json").read_text())
    paths: list[tuple[Any, Any]] = []

    def walk(v: Any) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                paths.append((v, k))
                walk(x)
        elif isinstance(v, list):
            for i, x in enumerate(v):
                paths.append((v, i))
                walk(x)
    walk(plan)
    holder, key = rng.choice(paths)
    holder[key] = rng.choice([None, -1, 0, 10 ** 12, "x", [], {}, True, 1.5, "linear_2", 2 ** 63])
    (entry / "plan.json").write_text(json.dumps(plan))
    _reseal_plan(entry)


def _tamper_library(cache: Path, other: Path, damage: str) -> None:
    from graphmode.backends.cpu.build import KEY_MARK, seal_library
    libs = sorted((cache / "kernels").glob("*.so"))
    if damage == "flip-rechecksum":
        for lib in libs:
            b = bytearray(lib.read_bytes())
            for i in range(len(b) // 3, len(b) // 3 + 64):
                b[i] ^= 0x5A
            lib.write_bytes(bytes(b))
            lib.with_name(lib.stem + ".so.seal").write_text(hashlib.sha256(bytes(b)).hexdigest())
    elif damage == "swap-with-seal":
        blobs = [(lib.read_bytes(), lib.with_name(lib.stem + ".so.seal").read_bytes()) for lib in libs]
        for lib, (blob, seal) in zip(libs, blobs[1:] + blobs[:1]):
            lib.write_bytes(blob)
            lib.with_name(lib.stem + ".so.seal").write_bytes(seal)
    elif damage == "forged-key-mark":       # a key holder's forgery: a foreign library, sealed, carrying the key
        import _ctypes
        for lib in libs:
            lib.write_bytes(Path(_ctypes.__file__).read_bytes() + (KEY_MARK + lib.stem).encode())
            seal_library(lib)
    elif damage == "seal-from-other-cache":        # each library and its seal as another cache holds them
        for lib in libs:
            shutil.copyfile(other / "kernels" / lib.name, lib)
            shutil.copyfile(other / "kernels" / (lib.stem + ".so.seal"), lib.with_name(lib.stem + ".so.seal"))
    elif damage == "sha256-sidecar":        # the format before seals: a plain checksum beside the library
        for lib in libs:
            lib.with_name(lib.stem + ".so.seal").unlink()
            lib.with_suffix(".so.sha256").write_text(hashlib.sha256(lib.read_bytes()).hexdigest())


def _damage_folder(cache: Path, damage: str) -> Path:
    if damage == "plans-is-file":
        shutil.rmtree(cache / "plans")
        (cache / "plans").write_text("x")
    elif damage == "kernels-is-file":
        shutil.rmtree(cache / "kernels")
        (cache / "kernels").write_text("x")
    elif damage == "entry-is-file":
        e = sorted((cache / "plans").iterdir())[0]
        shutil.rmtree(e)
        e.write_text("x")
    elif damage == "entry-is-link":
        a, b = sorted((cache / "plans").iterdir())
        shutil.rmtree(a)
        a.symlink_to(b, target_is_directory=True)
    elif damage == "root-is-file":
        shutil.rmtree(cache)
        cache.write_text("x")
    return cache


def _mount_full(path: Path) -> bool:
    path.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(path)],
                                           capture_output=True).returncode != 0:
        return False
    subprocess.run(["dd", "if=/dev/zero", f"of={path / 'fill'}", "bs=4k"], capture_output=True)
    return True


def damaged(case: dict[str, Any], ctx: dict[str, Any], tmp: Path) -> tuple[Path, bool]:
    """(the damaged cache, whether a tmpfs was mounted there)."""
    rng = random.Random(case["id"])
    cache = tmp / "cache"
    if case["kind"] == "full-disk":
        if _mount_full(tmp / "full"):
            return tmp / "full" / "cache", True
        cache.write_text("no tmpfs here: a file in place of the cache stands in for a disk that takes nothing")
        return cache, False
    shutil.copytree(ctx["pristine"], cache, symlinks=True)
    if case["kind"] == "file":
        for f in _files(cache, case["target"])[:2]:
            _damage_file(f, case["damage"], rng)
    elif case["kind"] == "folder":
        _damage_folder(cache, case["damage"])
    elif case["kind"] == "library":
        _tamper_library(cache, Path(ctx["other"]), case["damage"])
    elif case["kind"] == "plan-edit":
        _edit_plan(cache, random.Random(case["seed"]))
    return cache, False


def execute(case: dict[str, Any], ctx: dict[str, Any]) -> tuple[str, str]:
    import graphmode
    from graphmode.fuzz.models import RECIPE, SPEC, check_output, sample
    from graphmode.fuzz.outcome import from_cli
    from graphmode.recipe import load_recipe
    with tempfile.TemporaryDirectory(dir=ctx["work"], prefix="case-") as tmp:
        cache, mounted = damaged(case, ctx, Path(tmp))
        try:
            if case.get("cli"):
                res = subprocess.run([sys.executable, "-m", "graphmode", "run", "--model", SPEC, "--recipe",
                                      ctx["recipe"], "--shape", "2", "--iters", "1", "--json", "--cache-dir", str(cache)],
                                     capture_output=True, text=True, timeout=case.get("timeout_s", 300) - 10)
                outcome, detail = from_cli(res.returncode, res.stdout + res.stderr)
                if outcome == "accepted":
                    err = json.loads(res.stdout)["outputs"][0]["rel_l2_vs_eager"]
                    return ("accepted", "") if err < 1e-5 else ("wrong-output", f"rel L2 {err:.2e}")
                return outcome, detail
            cm = graphmode.compile(SPEC, load_recipe(RECIPE), cache_dir=cache)
            for b in (1, 2):
                outcome, detail = check_output(cm(sample(b)), b)
                if outcome != "accepted":
                    return outcome, detail
            return "accepted", ""
        finally:
            if mounted:
                subprocess.run(["umount", "-l", str(Path(tmp) / "full")], capture_output=True)
