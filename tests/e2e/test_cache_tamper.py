"""A tampered artifact cache never gives a wrong output, a crash or a traceback.

A real compile of a small MLP (2 buckets) fills a cache once; each test copies it, damages
the copy the way a bad copy, a stale sync or a hand edit would (checksums updated so they
cannot be what catches it), compiles again over it and checks: outputs equal eager PyTorch,
the damage was reported as a cache event, and the entry was rebuilt (the next compile hits).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch
import yaml

import graphmode
from graphmode.backends.cpu.build import library_problem, seal_library, seal_path
from graphmode.fuzz.models import RECIPE as FUZZ_RECIPE
from graphmode.fuzz.models import SPEC
from graphmode.recipe import load_recipe
from graphmode.runtime.cache import ArtifactCache
from graphmode.verify.numerics import rel_l2

ROOT = Path(__file__).resolve().parents[2]
RECIPE = dict(FUZZ_RECIPE, name="mlp-cache")        # the fuzz sweep's MLP: the same model for the API and CLI


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pristine-cache")
    graphmode.compile(SPEC, load_recipe(RECIPE), cache_dir=root).warmup()
    assert len(ArtifactCache(root).entries()) == 2
    return root


@pytest.fixture
def cache(pristine, tmp_path) -> Path:
    shutil.copytree(pristine, tmp_path / "cache", symlinks=True)
    return tmp_path / "cache"


def entry(cache: Path, bucket: str) -> Path:
    return next(e.path for e in ArtifactCache(cache).entries() if e.key.get("bucket") == bucket)


def reseal(d: Path) -> None:
    """Make meta.json's checksum agree with plan.json again (a tamperer can)."""
    meta = json.loads((d / "meta.json").read_text())
    meta["files"]["plan.json"] = hashlib.sha256((d / "plan.json").read_bytes()).hexdigest()
    (d / "meta.json").write_text(json.dumps(meta))


def edit_plan(cache: Path, fn: Callable[[dict], object], bucket: str = "batch=1") -> None:
    d = entry(cache, bucket)
    plan = json.loads((d / "plan.json").read_text())
    out = fn(plan)
    (d / "plan.json").write_text(json.dumps(plan if out is None else out))
    reseal(d)


def run_and_check(cache) -> graphmode.runtime.compiled.CompiledModel:
    """Compile over `cache`, run both buckets, compare with eager; the compiled model."""
    cm = graphmode.compile(SPEC, load_recipe(RECIPE), cache_dir=cache)
    for batch in (1, 2):
        x = torch.randn(batch, 16, generator=torch.Generator().manual_seed(batch))
        got = _first(cm(x=x))
        with torch.inference_mode():
            ref = _first(cm.source.module(x))
        assert got.shape == ref.shape == (batch, 10)
        assert rel_l2(got, ref) < 1e-5
    return cm


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def events(cm, kind: str) -> list[dict]:
    return [e for e in getattr(cm, "cache_events", []) if e["event"] == kind]


def libraries(cache: Path) -> list[Path]:
    libs = sorted((cache / "kernels").glob("*.so"))
    if not libs:
        pytest.skip("no C++ compiler: the cache holds no kernel libraries")
    return libs


def reseal_library(lib: Path) -> None:
    """Seal `lib` as the cache's key holder would, so the checks after the seal must catch it."""
    seal_library(lib)


def _swap_buckets(cache: Path) -> None:
    shutil.copyfile(entry(cache, "batch=2") / "plan.json", entry(cache, "batch=1") / "plan.json")
    reseal(entry(cache, "batch=1"))


def _swap_and_relabel(cache: Path) -> None:
    """Bucket 2's plan claiming, in every key field, to be bucket 1's."""
    _swap_buckets(cache)
    key = json.loads((entry(cache, "batch=1") / "meta.json").read_text())["key"]
    edit_plan(cache, lambda p: p.update(built_for=key))


def _zero_offsets(plan: dict) -> None:
    for slot in plan["slots"].values():
        if "offset" in slot:
            slot["offset"] = 0


def _drop_instruction(plan: dict) -> None:
    del plan["instructions"][1]


def _meta(text: str) -> Callable[[Path], None]:
    return lambda cache: (entry(cache, "batch=1") / "meta.json").write_text(text)


PLAN_TAMPERS: dict[str, Callable[[Path], None]] = {
    "other_bucket_plan": _swap_buckets,
    "other_bucket_plan_relabelled": _swap_and_relabel,
    "zeroed_offsets": lambda c: edit_plan(c, _zero_offsets),
    "dropped_instruction": lambda c: edit_plan(c, _drop_instruction),
    "reordered_instructions": lambda c: edit_plan(c, lambda p: p["instructions"].reverse()),
    "changed_attrs": lambda c: edit_plan(c, lambda p: p["instructions"][0]["attrs"].update(kind="elementwise")),
    "plan_is_a_list": lambda c: edit_plan(c, lambda p: [p]),
    "meta_is_a_list": _meta("[]"),
    "meta_key_missing": _meta('{"files": {}}'),
    "meta_wrong_types": _meta('{"key": {"bucket": 1}, "files": ["plan.json"]}'),
    "meta_not_json": _meta("{"),
}


@pytest.mark.parametrize("tamper", sorted(PLAN_TAMPERS))
def test_tampered_plan_is_reported_and_rebuilt(cache, tamper):
    PLAN_TAMPERS[tamper](cache)
    cm = run_and_check(cache)
    bad = events(cm, "corrupt")
    assert len(bad) == 1 and bad[0]["removed"], cm.cache_events
    assert cm.events["compile"] == 1 and cm.events["cache_hit"] == 1
    again = run_and_check(cache)            # the rebuilt entry is whole: both buckets hit
    assert again.events["cache_hit"] == 2 and not events(again, "corrupt")


def test_entry_replaced_by_a_file_or_a_link(cache):
    one, two = entry(cache, "batch=1"), entry(cache, "batch=2")
    shutil.rmtree(one)
    one.write_text("not a folder")
    cm = run_and_check(cache)
    assert [e["reason"] for e in events(cm, "corrupt")] == ["the entry is not a folder"]
    assert one.is_dir()
    shutil.rmtree(one)
    one.symlink_to(two, target_is_directory=True)     # the other bucket's entry, through a link
    cm = run_and_check(cache)
    assert len(events(cm, "corrupt")) == 1 and one.is_dir() and not one.is_symlink()
    assert (two / "plan.json").exists()              # removing the link left its target alone


def test_truncated_kernel_library_is_rebuilt_not_loaded(cache):
    libs = libraries(cache)
    for lib in libs:
        data = lib.read_bytes()
        lib.write_bytes(data[: len(data) // 2])
        reseal_library(lib)
        # what keeps dlopen (and SIGBUS) away from it; asserted first so a regression fails here
        assert "truncated" in library_problem(lib, lib.stem)
    cm = run_and_check(cache)
    bad = events(cm, "corrupt")
    assert bad and all("truncated" in e["reason"] for e in bad)
    # each one the run needed is whole again (a GEMM candidate timed into the cache by the first
    # build is needed again only when its timing is: a busy host's noisy entry is timed again)
    assert all(library_problem(Path(e["path"]), Path(e["path"]).stem) is None for e in bad)


def test_kernel_library_with_a_recomputed_checksum_is_rebuilt(cache):
    """Flipped bits with the checksum updated (SIGBUS/SIGSEGV once, when only a checksum guarded
    it): the seal is keyed, so the edit is refused before the library is mapped."""
    for lib in libraries(cache):
        data = bytearray(lib.read_bytes())
        for i in range(len(data) // 3, len(data) // 3 + 64):
            data[i] ^= 0x5A
        lib.write_bytes(bytes(data))
        seal_path(lib).write_text(hashlib.sha256(bytes(data)).hexdigest())
    cm = run_and_check(cache)
    bad = events(cm, "corrupt")
    assert bad and all("seal does not match" in e["reason"] for e in bad)


def test_kernel_library_from_another_entry_is_rebuilt(cache):
    libs = libraries(cache)
    if len(libs) < 2:
        pytest.skip("needs two kernel libraries")
    blobs = [lib.read_bytes() for lib in libs]
    for lib, blob in zip(libs, blobs[1:] + blobs[:1]):   # each gets another's bytes, checksum updated
        lib.write_bytes(blob)
        reseal_library(lib)
    cm = run_and_check(cache)
    bad = events(cm, "corrupt")
    assert bad and all("build key" in e["reason"] for e in bad)


def test_unusable_cache_dir_runs_uncached_with_one_warning(tmp_path, caplog):
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache folder should be")
    with caplog.at_level("WARNING", logger="graphmode.cache"):
        cm = run_and_check(blocker)
    assert len(events(cm, "unusable")) == 1
    assert len([r for r in caplog.records if "unusable" in r.getMessage()]) == 1
    assert blocker.read_text().startswith("a file")


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores folder permissions")
def test_read_only_cache_dir_runs_uncached(cache):
    for d in (cache, cache / "plans", cache / "kernels"):
        d.chmod(0o555)
    try:
        cm = run_and_check(cache)
    finally:
        for d in (cache, cache / "plans", cache / "kernels"):
            d.chmod(0o755)
    assert len(events(cm, "unusable")) == 1


@pytest.mark.slow       # a fresh interpreter importing torch, plus a kernel rebuild: ~15 s here
def test_cli_run_over_a_tampered_cache(pristine, tmp_path):
    """`graphmode run` over a cache with a swapped plan, a malformed meta.json and truncated
    kernel libraries: exit 0, outputs equal eager, the damage reported, no traceback."""
    from graphmode.targets.host import default_cache_dir as host_probe_dir
    home = tmp_path / "home"
    cache = home / ".cache" / "graphmode"
    shutil.copytree(pristine, cache, symlinks=True)
    if host_probe_dir().is_dir():        # the host probe takes seconds: reuse this machine's
        shutil.copytree(host_probe_dir(), cache / "targets", dirs_exist_ok=True)
    _swap_buckets(cache)
    (entry(cache, "batch=2") / "meta.json").write_text('[{"key": "batch=2"}]')
    for lib in libraries(cache):
        lib.write_bytes(lib.read_bytes()[:4096])
        reseal_library(lib)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(RECIPE))
    env = {**os.environ, "HOME": str(home)}
    env.pop("GRAPHMODE_CACHE_DIR", None)
    env.pop("XDG_CACHE_HOME", None)
    res = subprocess.run([sys.executable, "-m", "graphmode", "run", "--model", SPEC, "--recipe", str(recipe),
                          "--shape", "1", "--iters", "1", "--warmup", "--json"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    assert "cache corrupt" in res.stderr and "cached kernel library" in res.stderr
    out = json.loads(res.stdout)
    assert out["outputs"][0]["shape"] == [1, 10] and out["outputs"][0]["rel_l2_vs_eager"] < 1e-5
    assert all(library_problem(lib, lib.stem) is None for lib in libraries(cache))


@pytest.fixture
def full_disk(tmp_path):
    """A cache folder on a file system with no space left (a 64 KiB tmpfs filled up); skipped
    where this process may not mount one."""
    mnt = tmp_path / "full"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        subprocess.run(["dd", "if=/dev/zero", f"of={mnt / 'fill'}", "bs=4k"], capture_output=True)
        (mnt / "cache").mkdir(exist_ok=True)
        yield mnt / "cache"
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_full_disk_runs_uncached_with_one_warning(full_disk, caplog):
    import graphmode.backends.cpu.toolchain as toolchain_mod
    toolchain_mod._WARNED.clear()
    with caplog.at_level("WARNING"):
        cm = run_and_check(full_disk)
    said = [r.getMessage() for r in caplog.records if "uncached" in r.getMessage() or "unwritable" in r.getMessage()]
    assert len(said) == 1, said
    assert getattr(cm, "_cache_unusable", None)
