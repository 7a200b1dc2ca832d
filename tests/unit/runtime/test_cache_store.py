"""ArtifactCache on real folders: damaged entries of every shape are reported, removed and
rewritable; an unusable cache folder is one `unusable` event, never an exception; the
management commands (`cache ls/prune/clear`) see damaged entries instead of crashing."""
from __future__ import annotations

import hashlib
import json
import os

import pytest
from typer.testing import CliRunner

from graphmode.cli.app import _register, app
from graphmode.errors import CacheError
from graphmode.runtime.cache import ArtifactCache, key_digest, make_key

KEY = make_key("g" * 16, "r" * 16, "host", {"batch": 2})
OTHER = make_key("g" * 16, "r" * 16, "host", {"batch": 4})
PLAN = {"graph": "t", "built_for": KEY, "instructions": []}
runner = CliRunner()
_register()


@pytest.fixture
def cache(tmp_path) -> ArtifactCache:
    c = ArtifactCache(tmp_path / "cache")
    c.put(KEY, PLAN)
    c.put(OTHER, PLAN)
    return c


def kinds(c: ArtifactCache) -> list[str]:
    return [e["event"] for e in c.events]


def test_round_trip_hits(cache):
    assert cache.get(KEY) == PLAN and kinds(cache) == ["hit"]
    assert {e.key["bucket"] for e in cache.entries()} == {"batch=2", "batch=4"}


META = {
    "list": "[]",
    "string": '"meta"',
    "null": "null",
    "no_key": '{"files": {"plan.json": "0"}}',
    "key_list": '{"key": [], "files": {"plan.json": "0"}}',
    "key_int_field": None,                       # built below: a real key with one field an int
    "files_list": None,
    "files_extra": None,                         # a second file, e.g. a path outside the entry
    "created_str": None,
    "not_json": "{",
    "deeply_nested": "[" * 100_000 + "]" * 100_000,
    "binary": b"\xff\xfe\x00garbage",
}


def _meta_text(name: str, real: dict) -> str | bytes:
    if META[name] is not None:
        return META[name]
    m = json.loads(json.dumps(real))
    if name == "key_int_field":
        m["key"]["bucket"] = 2
    elif name == "files_list":
        m["files"] = list(m["files"])
    elif name == "files_extra":
        m["files"]["../../outside.txt"] = "0"
    elif name == "created_str":
        m["created"] = "yesterday"
    return json.dumps(m)


@pytest.mark.parametrize("name", sorted(META))
def test_malformed_meta_is_corrupt_removed_and_rewritable(cache, name):
    d = cache.plans / key_digest(KEY)
    text = _meta_text(name, json.loads((d / "meta.json").read_text()))
    (d / "meta.json").write_bytes(text if isinstance(text, bytes) else text.encode())
    listed = {e.digest: e.key for e in cache.entries()}
    assert "corrupt" in listed[key_digest(KEY)]          # ls shows it instead of crashing
    assert cache.get(KEY) is None
    assert kinds(cache) == ["corrupt"] and cache.events[0]["removed"] and not d.exists()
    cache.put(KEY, PLAN)
    assert cache.get(KEY) == PLAN


@pytest.mark.parametrize("plan", ["[]", '"x"', "{", "null"])
def test_plan_json_not_an_object_is_corrupt(cache, plan):
    d = cache.plans / key_digest(KEY)
    (d / "plan.json").write_text(plan)
    meta = json.loads((d / "meta.json").read_text())
    meta["files"]["plan.json"] = hashlib.sha256(plan.encode()).hexdigest()
    (d / "meta.json").write_text(json.dumps(meta))
    assert cache.get(KEY) is None and kinds(cache) == ["corrupt"]


def test_entry_of_another_key_is_corrupt(cache):
    d, other = cache.plans / key_digest(KEY), cache.plans / key_digest(OTHER)
    (d / "meta.json").write_text((other / "meta.json").read_text())
    assert cache.get(KEY) is None and "key does not match" in cache.events[0]["reason"]


def test_entry_replaced_by_a_file(cache):
    d = cache.plans / key_digest(KEY)
    for f in d.iterdir():
        f.unlink()
    d.rmdir()
    d.write_text("x")
    assert [e.key for e in cache.entries() if e.digest == d.name] == [{"corrupt": "not a folder"}]
    assert cache.get(KEY) is None and not d.exists()
    d.write_text("x")
    cache.put(KEY, PLAN)                      # put replaces a file in its way too
    assert cache.get(KEY) == PLAN


def test_entry_replaced_by_a_link_is_removed_not_followed(cache, tmp_path):
    d = cache.plans / key_digest(KEY)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    for f in d.iterdir():
        f.unlink()
    d.rmdir()
    d.symlink_to(outside, target_is_directory=True)
    assert cache.get(KEY) is None and not os.path.lexists(d)
    assert (outside / "keep.txt").read_text() == "mine"


def test_prune_and_clear_remove_damaged_entries(cache):
    d = cache.plans / key_digest(KEY)
    (d / "meta.json").write_text("[]")
    stray = cache.plans / ("f" * 24)                 # graphmode's name, not a folder: damaged
    stray.write_text("x" * 1000)
    notes = cache.plans / "notes.md"                 # not graphmode's: prune and clear leave it, and say so
    notes.write_text("keep")
    assert len(cache.entries()) == 3
    removed = cache.prune(0)
    assert len(removed) == 3 and cache.entries() == []
    cache.put(KEY, PLAN)
    stray.write_text("x")
    assert len(cache.clear()) == 2 and [p.name for p in cache.plans.iterdir()] == ["notes.md"]
    assert cache.foreign() == [notes]


def test_unusable_cache_root_is_one_event(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for root in (blocker, blocker / "below"):
        c = ArtifactCache(root)
        why = c.unusable()
        assert why is not None and str(root) in why
        assert kinds(c) == ["unusable"]
    assert ArtifactCache(tmp_path / "fine").unusable() is None


def test_plans_folder_replaced_by_a_file(tmp_path):
    c = ArtifactCache(tmp_path)
    c.plans.write_text("x")
    assert c.unusable() is not None
    with pytest.raises(CacheError, match="cannot list"):
        c.entries()
    c.clear()
    assert not c.plans.exists() and c.unusable() is None


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores folder permissions")
def test_read_only_and_unreadable_cache(tmp_path):
    c = ArtifactCache(tmp_path / "c")
    c.put(KEY, PLAN)
    c.kernels.mkdir()
    try:
        c.plans.chmod(0o555)
        assert c.unusable() is None and "cannot write" in c.read_only      # read as it is
        assert c.get(KEY) == PLAN
        with pytest.raises(CacheError):
            c.put(OTHER, PLAN)
        c.plans.chmod(0o000)
        with pytest.raises(CacheError, match="cannot list"):
            c.entries()
    finally:
        c.plans.chmod(0o755)


def test_a_read_only_pre_warmed_cache_is_read(tmp_path):
    """A cache baked into an image and mounted read-only was called unusable: every start planned
    and compiled again in a temporary folder. It is read as it is and nothing is written (a real
    read-only bind mount, where this host lets an unprivileged user namespace make one)."""
    import shutil
    import subprocess
    import sys
    import textwrap
    if shutil.which("unshare") is None or subprocess.run(
            ["unshare", "--user", "--map-root-user", "--mount", "mount", "--bind", "-o", "ro", str(tmp_path),
             str(tmp_path)], capture_output=True).returncode != 0:
        pytest.skip("no unprivileged read-only bind mount on this host")
    script = tmp_path / "warm.py"
    script.write_text(textwrap.dedent("""
        import json, sys, torch, graphmode
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval()
        r = {"version": 1, "name": "ro", "inputs": [{"name": "input", "dtype": "f32", "shape": ["batch", 8]}],
             "dims": {"batch": {"buckets": [4]}}, "codegen": {"kernel_selection": "heuristic"}}
        cm = graphmode.compile(m, r, example_inputs=(torch.randn(2, 8),), cache_dir=sys.argv[1])
        x = torch.randn(3, 8)
        assert torch.allclose(cm(x), m(x), atol=1e-6)
        print(json.dumps([e["event"] for e in cm.cache_events]))
    """))
    cache = tmp_path / "cache"
    run = [sys.executable, str(script), str(cache)]
    first = subprocess.run(run, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr
    libraries = sorted(p.name for p in (cache / "kernels").iterdir())
    ro = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                         f'mount --bind -o ro "{cache}" "{cache}" && exec "$@"', "sh", *run],
                        capture_output=True, text=True, timeout=600)
    assert ro.returncode == 0, ro.stderr
    events = json.loads(ro.stdout.strip().splitlines()[-1])
    assert events[:2] == ["read_only", "hit"] and "unusable" not in events, events
    assert sorted(p.name for p in (cache / "kernels").iterdir()) == libraries


def test_cli_cache_ls_shows_damage_and_prune_clears_it(cache):
    (cache.plans / key_digest(KEY) / "meta.json").write_text('{"key": 1}')
    res = runner.invoke(app, ["cache", "ls", "--cache-dir", str(cache.root)])
    assert res.exit_code == 0 and "corrupt" in res.output, res.output
    res = runner.invoke(app, ["cache", "ls", "--json", "--cache-dir", str(cache.root)])
    assert res.exit_code == 0 and len(json.loads(res.stdout)) == 2
    res = runner.invoke(app, ["cache", "prune", "--max-size", "0", "--cache-dir", str(cache.root)])
    assert res.exit_code == 0 and "removed 2 plans" in res.output


def test_prune_and_clear_weigh_kernel_libraries_and_extracted_artifacts(cache):
    """`cache prune --max-size 100KB` removed nothing where kernels/ held 836 KB, and `cache clear`
    left them: the cache grew without bound. The least recently used go first, a library's
    .so, seal and source together; the timing cache stays."""
    import os
    import time
    cache.put(KEY, PLAN)
    cache.kernels.mkdir(parents=True, exist_ok=True)
    now = time.time()
    for i, stem in enumerate(("a" * 32, "b" * 32)):            # a is older than b
        for suffix, n in ((".so", 40_000), (".so.seal", 64), (".cpp", 5_000)):
            p = cache.kernels / f"{stem}{suffix}"
            p.write_bytes(b"x" * n)
            os.utime(p, (now - 100 + i * 50, now - 100 + i * 50))
    (cache.kernels / ".seal-key").write_bytes(b"k" * 32)
    (cache.artifacts / ("d1" * 12)).mkdir(parents=True)
    (cache.artifacts / ("d1" * 12) / "complete").write_text("ok")
    (cache.root / "tactics").mkdir()
    (cache.root / "tactics" / "gemm-x.json").write_text("{}")
    assert sorted(e.kind for e in cache.libraries()) == ["artifact", "kernel", "kernel"]
    res = runner.invoke(app, ["cache", "ls", "--cache-dir", str(cache.root)])
    assert "2 kernel libraries, 1 extracted artifact" in res.output, res.output
    res = runner.invoke(app, ["cache", "prune", "--max-size", "50KB", "--cache-dir", str(cache.root)])
    assert res.exit_code == 0 and "1 kernel library" in res.output, res.output
    assert not list(cache.kernels.glob("a*")) and len(list(cache.kernels.glob("b*"))) == 3
    res = runner.invoke(app, ["cache", "clear", "--cache-dir", str(cache.root)])
    assert res.exit_code == 0 and "1 kernel library" in res.output and "2 plans" in res.output, res.output
    assert cache.entries() == cache.libraries() == [] and not list(cache.artifacts.iterdir())
    assert (cache.root / "tactics" / "gemm-x.json").exists()


def test_cli_cache_ls_on_a_broken_cache_folder_is_a_typed_error_and_clear_fixes_it(tmp_path):
    (tmp_path / "plans").write_text("x")
    res = runner.invoke(app, ["cache", "ls", "--cache-dir", str(tmp_path)])
    assert res.exit_code == 2 and "cannot list" in res.output and "Traceback" not in res.output, res.output
    res = runner.invoke(app, ["cache", "clear", "--cache-dir", str(tmp_path)])
    assert res.exit_code == 0 and not (tmp_path / "plans").exists(), res.output


@pytest.mark.parametrize("what", ["fifo", "dev-zero", "link-out", "sparse-huge", "deep-json"])
@pytest.mark.parametrize("name", ["plan.json", "meta.json"])
def test_special_or_huge_files_are_corrupt_entries_not_hangs(cache, what, name):
    """A FIFO (a read blocks for ever: `run` hung > 300 s), a link to /dev/zero (read until memory
    runs out), a link out of the cache, an 8 GiB sparse file, JSON nested 10**5 deep: each one
    `corrupt` event, the entry removed, nothing read beyond the size bound."""
    f = cache.plans / key_digest(KEY) / name
    f.unlink()
    if what == "fifo":
        os.mkfifo(f)
    elif what == "dev-zero":
        f.symlink_to("/dev/zero")
    elif what == "link-out":
        f.symlink_to("/etc/hostname")
    elif what == "sparse-huge":
        with open(f, "wb") as out:
            out.truncate(8 << 30)
    else:
        f.write_text("[" * 100000)
    assert cache.get(KEY) is None
    assert kinds(cache) == ["corrupt"] and cache.events[0]["removed"]
    assert any(e.key.get("bucket") == "batch=4" for e in cache.entries())     # the other entry is untouched
    cache.put(KEY, PLAN)
    assert cache.get(KEY) == PLAN


def test_prune_removes_the_folders_of_writes_killed_mid_way_and_ls_names_them(cache):
    """A build killed by SIGKILL left kernels/.build-*/ (72-248 KiB each) that nothing removed, and
    `cache prune` said "removed nothing"; a folder younger than LEFTOVER_AGE_S may be a live build's."""
    import time

    from graphmode.runtime.cache import LEFTOVER_AGE_S
    cache.put(KEY, PLAN)
    old = time.time() - LEFTOVER_AGE_S - 60
    folders = [cache.kernels / ".build-0123abcd-x1", cache.plans / ".tmp-y2", cache.artifacts / ".extract-z3"]
    for d in folders:
        d.mkdir(parents=True)
        (d / "part0.o").write_bytes(b"o" * 2048)
        os.utime(d, (old, old))
    live = cache.kernels / ".build-live"
    live.mkdir()
    assert sorted(e.path for e in cache.leftovers()) == sorted(folders)
    res = runner.invoke(app, ["cache", "ls", "--cache-dir", str(cache.root)])
    assert "3 folders interrupted writes left" in res.output, res.output
    res = runner.invoke(app, ["cache", "prune", "--max-size", "100GB", "--cache-dir", str(cache.root)])
    assert res.exit_code == 0 and "3 folders interrupted writes left" in res.output, res.output
    assert not any(d.exists() for d in folders) and live.exists() and cache.get(KEY) is not None


def test_clear_on_a_folder_graphmode_did_not_fill_keeps_what_is_there_and_says_so(tmp_path):
    """`cache clear --cache-dir .` in a project with its own plans/ and kernels/ removed them
    whole (trial AA)."""
    (tmp_path / "plans").mkdir()
    (tmp_path / "plans" / "roadmap.md").write_text("Q3")
    (tmp_path / "kernels" / "linux").mkdir(parents=True)
    (tmp_path / "kernels" / "linux" / "Makefile").write_text("all:")
    res = runner.invoke(app, ["cache", "clear", "--cache-dir", str(tmp_path)])
    assert res.exit_code == 0 and "removed nothing" in res.output
    assert "left 2 item(s) graphmode did not write" in res.output and "plans/roadmap.md" in res.output
    assert (tmp_path / "plans" / "roadmap.md").read_text() == "Q3" and (tmp_path / "kernels" / "linux").is_dir()
