"""Deployable `.gm` artifacts: save a compiled model, load it in a fresh cache without the
model's code, get the same numbers with no kernel compile; refuse what cannot run here."""
from __future__ import annotations

import hashlib
import json
import os
import sys
import zipfile
from pathlib import Path

import httpx
import pytest
import torch
import yaml
from typer.testing import CliRunner

import graphmode
from graphmode.backends.cpu.build import builder_for
from graphmode.capture.spec import bundle_from_module
from graphmode.cli.app import _register, app
from graphmode.errors import ContractViolation
from graphmode.ir.printer import INLINE_LIMIT
from graphmode.runtime.artifact import ArtifactError, check_manifest, manifest_digest

from tiny_models import mlp, recipe

TINY = str(Path(__file__).with_name("tiny_models.py"))
_register()
RECIPE = recipe("mlp", [{"name": "input", "dtype": "f32", "shape": ["batch", 16]}], {"batch": {"buckets": [1, 2, 4]}})


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("artifact")
    m, ex = mlp()
    cm = graphmode.compile(bundle_from_module(m, ex), RECIPE, cache_dir=tmp / "build-cache")
    manifest = cm.save(tmp / "mlp.gm")
    return cm, tmp / "mlp.gm", manifest, tmp


def test_a_load_in_a_process_of_another_openmp_wait_uses_the_kernels_schedule_and_compiles_nothing(
        saved, monkeypatch):
    """`auto` builds `claim` under a bounded OpenMP wait (the graphmode command, make test) and
    `dynamic` in a program that imported torch without one; the schedule is in every library's
    key, so the manifest names it and a load anywhere uses it (it recompiled every kernel)."""
    from graphmode.backends.cpu.omp_loops import auto_schedule
    cm, path, manifest, tmp = saved
    monkeypatch.setenv("GOMP_SPINCOUNT", "1000")
    built = auto_schedule()
    assert manifest["schedule"] == built == "claim"
    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert auto_schedule() == "dynamic"
    loaded = graphmode.load(path, cache_dir=tmp / "other-wait-cache")
    kernels = tmp / "other-wait-cache" / "artifacts" / loaded.artifact["digest"] / "kernels"
    for schedule in ("claim", "dynamic"):
        assert builder_for(kernels, loaded.threads, schedule=schedule).stats["compiles"] == 0, schedule
    x = torch.randn(2, 16)
    assert torch.equal(loaded(x), cm(x))


def test_a_fresh_process_loads_and_runs_an_artifact_without_building_a_library(saved):
    """The work-claiming pool the `claim` kernels run on is a library of its own: it was built at
    the first load in every new process (serve and generate from a .gm logged 'compiled 1
    kernels'); the artifact ships it."""
    import subprocess
    _, path, manifest, tmp = saved
    assert manifest["schedule"] == "claim"
    code = ("import logging, sys, torch, graphmode; logging.basicConfig(level=logging.INFO); "
            f"m = graphmode.load({str(path)!r}, cache_dir={str(tmp / 'fresh-process')!r}); m(torch.randn(2, 16))")
    env = dict(os.environ, GOMP_SPINCOUNT="1000")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "compiled" not in res.stderr, res.stderr


def test_loaded_artifact_matches_and_compiles_nothing(saved):
    cm, path, manifest, tmp = saved
    assert manifest["buckets"] == ["batch=1", "batch=2", "batch=4"] and manifest["kernels"]
    loaded = graphmode.load(path, cache_dir=tmp / "fresh-cache")
    kernels = tmp / "fresh-cache" / "artifacts" / loaded.artifact["digest"] / "kernels"
    assert builder_for(kernels, loaded.threads).stats["compiles"] == 0     # every library came from the file
    assert loaded.source.module is None and loaded.events["artifact_load"] == 3
    for batch in (1, 3, 4):                                          # 3 pads to the 4 bucket
        x = torch.randn(batch, 16, generator=torch.Generator().manual_seed(batch))
        got, want = loaded(x), cm(x)
        assert type(got) is type(want) and torch.equal(got[0], want[0]) and loaded.last_path == cm.last_path
    with pytest.raises(ContractViolation, match="outside"):
        loaded(torch.randn(5, 16))


def test_an_artifact_ships_its_own_timing_entries_not_the_shared_caches(saved):
    """The timing cache folder is shared by every model compiled with one cache dir: a .gm
    shipped all of it (127 entries for a one-linear model, other models' shapes among them)."""
    cm, path, manifest, tmp = saved
    torch.manual_seed(0)
    other = torch.nn.Sequential(torch.nn.Linear(96, 160), torch.nn.GELU(), torch.nn.Linear(160, 96)).eval()
    timed = graphmode.compile(bundle_from_module(other, {"input": torch.randn(8, 96)}),
                              recipe("other", [{"name": "input", "dtype": "f32", "shape": ["batch", 96]}],
                                     {"batch": {"buckets": [16]}}, codegen={"kernel_selection": "latency_first"}),
                              cache_dir=tmp / "build-cache")
    own = timed.save(tmp / "other.gm")            # its two GEMM shapes were timed into the shared folder
    entries = {f"tactics/{p.name}" for p in (tmp / "build-cache" / "tactics").glob("*.json")}
    timed_entries = {f"tactics/{n}" for n in timed.executable({"batch": 16}).tactic_files}
    assert timed_entries and {n for n in own["files"] if n.startswith("tactics/")} == timed_entries <= entries
    again = cm.save(tmp / "again.gm")             # the MLP saved after: none of the other model's entries
    assert {n for n in again["files"] if n.startswith("tactics/")} == \
        {n for n in manifest["files"] if n.startswith("tactics/")} and not timed_entries & set(again["files"])
    loaded = graphmode.load(tmp / "other.gm", cache_dir=tmp / "own-entries")
    x = torch.randn(16, 96)
    assert torch.equal(loaded(x), timed(x))
    stats = loaded.executable({"batch": 16}).tactics_report["stats"]
    assert stats["cache_misses"] == 0 and stats["timing_runs"] == 0, stats     # what it shipped was enough


def test_a_second_load_reuses_the_extracted_copy(saved):
    from graphmode.runtime.artifact import _open
    _, path, _, tmp = saved
    z, _, _ = _open(path)
    f = z.fp
    z.close()
    assert f.closed             # the file the archive read is closed with it (each load left one to the GC)
    a = graphmode.load(path, cache_dir=tmp / "again")
    b = graphmode.load(path, cache_dir=tmp / "again")
    assert a.artifact["digest"] == b.artifact["digest"]
    assert (tmp / "again" / "artifacts" / a.artifact["digest"] / "complete").is_file()


def test_weights_are_mapped_from_the_extracted_file_and_repaired_there(saved):
    """The loaded weights are pages of the extracted constants.pt, given back once the kernels
    hold their copies (not a second copy in memory: a GPT-2 .gm held 1.45 GB for 475 MB of
    weights); damaged there, the file is extracted again from the artifact."""
    cm, path, _, tmp = saved
    loaded = graphmode.load(path, cache_dir=tmp / "mapped")
    spill, consts = loaded.constant_spill, loaded.graph.constants
    assert spill.nbytes == sum(t.numel() * t.element_size() for t in consts.values()) > 0
    big = [t for t in consts.values() if t.numel() > INLINE_LIMIT]      # the IR text holds the small ones
    assert big and spill.releases >= 1 and all(spill.lo <= t.data_ptr() < spill.hi for t in big)
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(2))
    assert torch.equal(loaded(x)[0], cm(x)[0])                        # released pages refault from the file
    extracted = tmp / "mapped" / "artifacts" / loaded.artifact["digest"] / "constants.pt"
    damaged = extracted.with_name("damaged")
    damaged.write_bytes(b"damaged")
    damaged.replace(extracted)               # a new file: the mapping `loaded` holds stays intact
    again = graphmode.load(path, cache_dir=tmp / "mapped")
    assert torch.equal(again(x)[0], cm(x)[0]) and extracted.stat().st_size > len(b"damaged")
    assert torch.equal(loaded(x)[0], cm(x)[0])


def _rewrite(src: Path, dst: Path, **replace: bytes) -> Path:
    """A copy of the artifact with some members replaced, the manifest's sizes and hashes of
    them updated and its digest too (a consistent edit: what the checks after the hashes must
    catch)."""
    with zipfile.ZipFile(src) as zin:
        manifest = json.loads(zin.read("manifest.json"))
        for name, data in replace.items():
            if name != "manifest.json":
                manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        replace.setdefault("manifest.json", json.dumps(manifest).encode())
        try:
            edited = json.loads(replace["manifest.json"])
        except ValueError:
            edited = None                       # an unreadable manifest stays so
        if isinstance(edited, dict):
            replace["manifest.json"] = json.dumps(dict(edited, digest=manifest_digest(edited))).encode()
        with zipfile.ZipFile(dst, "w") as zout:
            for info in zin.infolist():
                zout.writestr(info, replace.get(info.filename, zin.read(info.filename)))
    return dst


def test_an_artifact_whose_graph_hash_names_the_graph_loads_and_another_hash_does_not(saved):
    """Artifacts saved before 2026-12-07 hashed the graph's name with its structure."""
    cm, path, manifest, tmp = saved
    written = {k: v for k, v in manifest.items() if k not in ("seconds", "bytes")}
    older = _rewrite(path, tmp / "named-hash.gm", **{"manifest.json": json.dumps(
        dict(written, graph_hash=cm.graph.structural_hash(named=True))).encode()})
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(3))
    assert torch.equal(graphmode.load(older, cache_dir=tmp / "named")(x)[0], cm(x)[0])
    other = _rewrite(path, tmp / "other-hash.gm", **{"manifest.json": json.dumps(
        dict(written, graph_hash="0123456789abcdef")).encode()})
    with pytest.raises(ArtifactError, match="do not match the manifest's hash"):
        graphmode.load(other, cache_dir=tmp / "other")


def test_refuses_another_version_or_a_cpu_without_its_isa(saved):
    _, path, manifest, tmp = saved
    written = {k: v for k, v in manifest.items() if k not in ("seconds", "bytes")}     # save's report adds them
    older = dict(written, torch="2.0.0")
    bad = _rewrite(path, tmp / "old-torch.gm", **{"manifest.json": json.dumps(older).encode()})
    with pytest.raises(ArtifactError, match="torch 2.0.0") as e:
        graphmode.load(bad, cache_dir=tmp / "c1")
    assert "compile again" in e.value.fix
    host = {"cpu": "a small CPU", "arch": manifest["host"]["arch"], "simd": ["sse4_2"]}
    needs = dict(manifest, host={**manifest["host"], "simd": ["sse4_2", "avx2"]})
    with pytest.raises(ArtifactError, match="avx2") as e:
        check_manifest(needs, path, host)
    assert "lacks" in e.value.message
    check_manifest(dict(needs, isa="portable"), path, host)         # a portable build needs no extension
    check_manifest(manifest, path)                                   # this host runs what it built


def test_refuses_damaged_or_edited_files(saved):
    _, path, _, tmp = saved
    (tmp / "garbage.gm").write_bytes(b"not a zip")
    for bad in (tmp / "garbage.gm", tmp / "missing.gm"):
        with pytest.raises(ArtifactError) as e:
            graphmode.load(bad, cache_dir=tmp / "c2")
        assert e.value.where == str(bad) and e.value.fix
    with zipfile.ZipFile(path) as z:
        consts = torch.load(__import__("io").BytesIO(z.read("constants.pt")), weights_only=True)
        plan_name = next(n for n in z.namelist() if n.startswith("plans/"))
        plan = json.loads(z.read(plan_name))
    name = next(iter(consts))
    consts[name] = consts[name] + 1                                   # edited weights
    buf = __import__("io").BytesIO()
    torch.save(consts, buf)
    with pytest.raises(ArtifactError, match="does not match its digest"):
        graphmode.load(_rewrite(path, tmp / "weights.gm", **{"constants.pt": buf.getvalue()}), cache_dir=tmp / "c3")
    plan["instructions"] = plan["instructions"][::-1]                 # a plan that is not a schedule of its graph
    with pytest.raises(ArtifactError, match="not a plan of its graph"):
        graphmode.load(_rewrite(path, tmp / "plan.gm", **{plan_name: json.dumps(plan).encode()}), cache_dir=tmp / "c4")


def test_eager_and_decoder_models_are_not_saved(tmp_path):
    m, ex = mlp()
    cm = graphmode.compile(bundle_from_module(m, ex), dict(RECIPE, exe_mode="eager"), cache_dir=tmp_path)
    with pytest.raises(ArtifactError, match="eager"):
        cm.save(tmp_path / "e.gm")
    assert not (tmp_path / "e.gm").exists()


def test_cli_compile_save(saved):
    _, _, _, tmp = saved
    r = tmp / "r.yaml"
    r.write_text(yaml.safe_dump(RECIPE))
    out = tmp / "cli.gm"
    res = CliRunner().invoke(app, ["compile", "--model", f"{TINY}:mlp", "--recipe", str(r), "--save", str(out),
                                   "--cache-dir", str(tmp / "build-cache")])
    assert res.exit_code == 0, res.output
    assert "saved" in res.output and "3 bucket(s)" in res.output
    loaded = graphmode.load(out, cache_dir=tmp / "cli-load")
    x = torch.randn(2, 16)
    m, _ = mlp()
    with torch.inference_mode():
        ref = m(x)
    y = loaded(x)                                              # a Tensor, as the module returns
    assert isinstance(y, torch.Tensor) and torch.allclose(y, ref, rtol=1e-5, atol=1e-6)


def test_cli_run_takes_an_artifact_and_checks_it_with_the_reference_interpreter(saved):
    """`graphmode run --model FILE.gm`: the artifact's recipe and plans (nothing compiled), its
    outputs checked against the reference interpreter of its graph; --recipe is refused."""
    import json
    _, path, _, tmp = saved
    res = CliRunner().invoke(app, ["run", "--model", str(path), "--shape", "batch=3", "--iters", "1", "--json",
                                   "--cache-dir", str(tmp / "run-cache")])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output[res.output.index("{"):])
    assert out["numerics_ok"] and out["bucket"] == {"batch": 4} and "reference interpreter" in out["median_ms"]
    assert out["outputs"][0]["shape"] == [3, 4] and out["outputs"][0]["rel_l2_vs_eager"] < 1e-6
    res = CliRunner().invoke(app, ["run", "--model", str(path), "--recipe", "r.yaml"])
    assert res.exit_code != 0 and "--recipe does not apply to an artifact" in res.output
    renamed, own = tmp / "renamed.bin", tmp / "own.yaml"       # known by its content; its own recipe is taken
    renamed.write_bytes(path.read_bytes())
    own.write_text(yaml.safe_dump(RECIPE))
    res = CliRunner().invoke(app, ["run", "--model", str(renamed), "--recipe", str(own), "--shape", "batch=1",
                                   "--iters", "1", "--cache-dir", str(tmp / "run-cache")])
    assert res.exit_code == 0, res.output


def _flip_inside(src: Path, dst: Path, member: str) -> Path:
    """A copy with one byte flipped in the middle of `member`'s stored data (a bad disk or copy)."""
    data = bytearray(src.read_bytes())
    with zipfile.ZipFile(src) as z:
        info = z.getinfo(member)
    start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
    data[start + info.compress_size // 2] ^= 0x10
    dst.write_bytes(bytes(data))
    return dst


def test_every_damaged_member_is_refused_naming_it(saved):
    """A flipped byte inside any member (a CRC error in zipfile, once a raw BadZipFile traceback)
    is one ArtifactError naming that member."""
    _, path, _, tmp = saved
    with zipfile.ZipFile(path) as z:
        members = [n for n in z.namelist() if z.getinfo(n).compress_size > 0]
    assert any(m.startswith("kernels/") for m in members) and "constants.pt" in members
    for member in members:
        bad = _flip_inside(path, tmp / "flipped.gm", member)
        with pytest.raises(ArtifactError) as e:
            graphmode.load(bad, cache_dir=tmp / "flipped")
        assert member in str(e.value), (member, str(e.value))


@pytest.mark.parametrize("fields", [{"mutated_inputs": ["x"]}, {"positional": ["y"]}, {"exact_dims": ["batch"]},
                                    {"threads": 999}, {"out_spec": "garbage"}])
def test_a_manifest_edited_by_hand_is_refused_by_its_digest(saved, fields):
    """Fields the schema accepts but the artifact was not saved with: mutated_inputs reached the
    call as a bare RuntimeError from a copy_, an edited output structure returned a tuple for
    eager's tensor, exact_dims refused a request as unsafe padding."""
    _, path, _, tmp = saved
    with zipfile.ZipFile(path) as zin, zipfile.ZipFile(tmp / "hand.gm", "w") as zout:
        for info in zin.infolist():
            data = zin.read(info.filename)
            if info.filename == "manifest.json":
                data = json.dumps(dict(json.loads(data), **fields)).encode()
            zout.writestr(info, data)
    with pytest.raises(ArtifactError, match="digest does not match") as e:
        graphmode.load(tmp / "hand.gm", cache_dir=tmp / "hand")
    assert "manifest.json" in e.value.where and "save the artifact again" in e.value.fix


def _edit_manifest(saved, name: str, **fields) -> Path:
    _, path, _, tmp = saved
    with zipfile.ZipFile(path) as z:
        manifest = json.loads(z.read("manifest.json"))
    manifest.update(fields)
    return _rewrite(path, tmp / name, **{"manifest.json": json.dumps(manifest).encode()})


@pytest.mark.parametrize("fields, match", [
    ({"mode": "turbo"}, "mode"), ({"threads": 10 ** 9}, "threads"), ({"threads": "4"}, "threads"),
    ({"buckets": []}, "buckets"), ({"isa": "avx9000"}, "isa"), ({"extra": 1}, "extra"),
    ({"kernels": ["../../etc/passwd"]}, "kernels"), ({"files": {}}, "not in the manifest"),
    ({"target": "../../etc"}, "target"), ({"output_structure": {"t": "pickle"}}, "output_structure"),
    ({"mutated_inputs": "x"}, "mutated_inputs"),
    ({"input_bounds": {"values": [{"input": "input", "lo": 0}], "dims": []}}, "input_bounds")])
def test_manifest_fields_are_bounds_checked(saved, fields, match):
    bad = _edit_manifest(saved, "fields.gm", **fields)
    with pytest.raises(ArtifactError, match=match):
        graphmode.load(bad, cache_dir=saved[3] / "fields")


def test_compressed_unlisted_or_special_files_are_refused(saved):
    _, path, _, tmp = saved
    bomb = tmp / "bomb.gm"                      # a small file carrying a member that inflates 64 MiB
    with zipfile.ZipFile(path) as zin, zipfile.ZipFile(bomb, "w") as zout:
        for info in zin.infolist():
            zout.writestr(info, zin.read(info.filename))
        zout.writestr("tactics/big.json", b"\0" * (64 << 20), compress_type=zipfile.ZIP_DEFLATED)
    assert bomb.stat().st_size < path.stat().st_size + (1 << 20)
    with pytest.raises(ArtifactError, match="not in the manifest"):
        graphmode.load(bomb, cache_dir=tmp / "bomb")
    with zipfile.ZipFile(path) as z:
        manifest = json.loads(z.read("manifest.json"))
    manifest["files"]["tactics/big.json"] = {"bytes": 64 << 20, "sha256": hashlib.sha256(b"\0" * (64 << 20)).hexdigest()}
    listed = _rewrite(bomb, tmp / "bomb2.gm", **{"manifest.json": json.dumps(manifest).encode()})
    with pytest.raises(ArtifactError, match="compressed"):
        graphmode.load(listed, cache_dir=tmp / "bomb")
    fifo = tmp / "fifo.gm"
    os.mkfifo(fifo)
    with pytest.raises(ArtifactError, match="FIFO"):
        graphmode.load(fifo, cache_dir=tmp / "fifo")
    link = tmp / "zero.gm"
    link.symlink_to("/dev/zero")
    with pytest.raises(ArtifactError, match="device"):
        graphmode.load(link, cache_dir=tmp / "fifo")


def test_edited_extraction_is_extracted_again(saved):
    """The extracted copy is a cache: a kernel library there edited with its seal left as it
    was, or replaced by a FIFO, is noticed on the next load and extracted again."""
    cm, path, _, tmp = saved
    loaded = graphmode.load(path, cache_dir=tmp / "reextract")
    kernels = tmp / "reextract" / "artifacts" / loaded.artifact["digest"] / "kernels"
    lib = sorted(kernels.glob("*.so"))[0]
    data = bytearray(lib.read_bytes())
    data[len(data) // 2] ^= 0xFF
    lib.unlink()
    lib.write_bytes(bytes(data))
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(2))
    assert torch.equal(graphmode.load(path, cache_dir=tmp / "reextract")(x)[0], cm(x)[0])
    assert lib.read_bytes() != bytes(data)
    lib.unlink()
    os.mkfifo(lib)
    assert torch.equal(graphmode.load(path, cache_dir=tmp / "reextract")(x)[0], cm(x)[0])
    assert lib.is_file()


def test_server_serves_an_artifact_and_only_its_recipe(saved):
    """`graphmode serve --model FILE.gm`: the server loads the artifact (no capture, no kernel
    compile), answers like the compiled model, and refuses any other recipe, a reload included."""
    from graphmode.errors import RecipeError
    from graphmode.serve import ModelServer, ServeConfig, ServerThread
    cm, path, _, tmp = saved
    server = ModelServer(str(path), None, config=ServeConfig(cache_dir=tmp / "serve-cache", batch_window_ms=0))
    assert server.recipe.hash() == cm.recipe.hash() and server.model is None
    with ServerThread(server) as running:
        running.wait_ready(600)
        assert server.active.cm.artifact["path"] == str(path)
        x = torch.randn(3, 16, generator=torch.Generator().manual_seed(3))
        r = httpx.post(running.url + "/v1/infer", json={"inputs": {"input": x.tolist()}}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["bucket"] == {"batch": 4}
        got = torch.tensor(r.json()["outputs"][server.active.names_for(1)[0]])
        assert torch.allclose(got, cm(x), rtol=1e-5, atol=1e-6)
        other = dict(RECIPE, dims={"batch": {"buckets": [1, 2]}})
        r = httpx.put(running.url + "/v1/recipe", json=other, timeout=60)
        assert r.status_code == 422 and "serves only the recipe it was compiled with" in r.json()["message"], r.text
    with pytest.raises(RecipeError, match="serves only the recipe"):
        ModelServer(str(path), other)


class _YMinusX(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, y):
        return self.lin(x) - 3 * y


def test_a_loaded_artifact_binds_positions_as_the_models_forward_did(tmp_path):
    """The recipe lists y before x: the compiled model binds cm(a, b) as forward(x=a, y=b), and a
    loaded artifact (no forward to read) bound it in the recipe's order, swapping x and y (rel L2
    1.75). An input given by position and by name was taken from the name without a word."""
    m = _YMinusX().eval()
    rec = recipe("two", [{"name": "y", "dtype": "f32", "shape": ["batch", 8]},
                         {"name": "x", "dtype": "f32", "shape": ["batch", 8]}], {"batch": {"buckets": [1, 4]}})
    cm = graphmode.compile(m, rec, cache_dir=tmp_path / "c")
    manifest = cm.save(tmp_path / "two.gm")
    assert manifest["positional"] == ["x", "y"]
    loaded = graphmode.load(tmp_path / "two.gm", cache_dir=tmp_path / "c")
    a, b = torch.randn(4, 8), torch.randn(4, 8)
    with torch.no_grad():
        ref = m(a, b)
    assert torch.allclose(loaded(a, b), ref, atol=1e-6) and torch.allclose(loaded(a, y=b), ref, atol=1e-6)
    with pytest.raises(ContractViolation, match="given both by position and by name"):
        loaded(a, b, y=b)


class _PadsWithMinusInf(torch.nn.Module):
    def forward(self, x):
        return torch.nn.functional.pad(x, (1, 1), value=float("-inf")).amax(-1) + x.sum(-1)


def test_a_plan_holding_minus_inf_saves_caches_and_loads(tmp_path):
    """json writes a -inf pad value as -Infinity; the strict reader refused its own files (the
    artifact could not load, the plan cache was called corrupt and rebuilt in every process)."""
    m, x = _PadsWithMinusInf(), torch.randn(3, 5)
    cm = graphmode.compile((m, (torch.randn(2, 5),)), cache_dir=tmp_path / "cache")
    assert torch.allclose(cm(x), m(x))
    cm.save(tmp_path / "pad.gm")
    assert torch.allclose(graphmode.load(tmp_path / "pad.gm")(x), m(x))
    again = graphmode.compile((m, (torch.randn(2, 5),)), cache_dir=tmp_path / "cache")
    assert torch.allclose(again(x), m(x))
    assert not [e for e in again.cache_events if e["event"] == "corrupt"]


def test_a_request_outside_a_loaded_artifacts_range_is_not_told_to_run_eagerly(saved):
    """The fix said "set on_violation: eager": an artifact has no model to run eagerly, and its
    recipe cannot be changed at load; the compiled model itself still says so."""
    cm, path, _, tmp = saved
    loaded = graphmode.load(path, cache_dir=tmp / "range")
    for model, eager in ((cm, True), (loaded, False)):
        with pytest.raises(ContractViolation) as e:
            model(torch.randn(7, 16))
        assert ("set on_violation: eager" in e.value.fix) is eager
        assert eager or "compile the model again from its source" in e.value.fix


def test_a_truncated_artifact_is_called_truncated(saved, monkeypatch):
    """A copy cut short (its zip directory gone) was called "not a graphmode artifact"; and
    after the error, the half-built archive's __del__ printed an AttributeError traceback."""
    import gc
    import sys
    broken = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: broken.append(u)
                        if "_owned" in str(u.exc_value) else None)     # only this archive's (xdist: others' gc)
    _, path, _, tmp = saved
    cut = tmp / "cut.gm"
    cut.write_bytes(path.read_bytes()[:-10])            # the end of its zip directory cut off
    with pytest.raises(ArtifactError, match="without its end: truncated") as e:
        graphmode.load(cut, cache_dir=tmp / "cut")
    assert "copy it again whole" in e.value.fix
    other = tmp / "other.gm"
    other.write_bytes(b"not a zip at all")
    with pytest.raises(ArtifactError, match="not a graphmode artifact"):
        graphmode.load(other, cache_dir=tmp / "other")
    empty, bare = tmp / "empty.gm", tmp / "bare.gm"        # "BadZipFile"; "format None: save it again with this version"
    empty.write_bytes(b"")
    with zipfile.ZipFile(bare, "w") as z:
        z.writestr("manifest.json", "{}")
    for f, needle in ((empty, "the file is empty"), (bare, "names no format: a zip, but not one graphmode wrote")):
        with pytest.raises(ArtifactError, match=needle) as e:
            graphmode.load(f, cache_dir=tmp / "other")
        assert e.value.exit_code == 2
    del e
    gc.collect()
    assert not broken, [str(u.exc_value) for u in broken]


def test_a_save_never_puts_a_file_in_place_of_a_fifo_and_writes_through_a_link(saved):
    """A FIFO (or a device, as root) was replaced by a regular file, and a link by a copy that
    left its target stale; two saves to one path shared one temporary file."""
    cm, path, _, tmp = saved
    tmp = tmp / "special"
    tmp.mkdir()
    fifo = tmp / "fifo.gm"
    os.mkfifo(fifo)
    with pytest.raises(ArtifactError, match="it is a FIFO, not a regular file") as e:
        cm.save(fifo)
    assert e.value.where == "path" and fifo.is_fifo()
    target, link = tmp / "target.gm", tmp / "link.gm"
    target.write_bytes(b"old")
    link.symlink_to(target)
    cm.save(link)
    assert link.is_symlink() and zipfile.is_zipfile(target)
    assert not [p.name for p in tmp.iterdir() if p.name.endswith(".tmp")]    # no temporary file left


def test_saving_an_eager_fallback_recipe_says_the_file_cannot_fall_back(tmp_path):
    """on_violation: eager needs the model; the file holds plans: saved without a word, the
    first request outside the contract was refused where the recipe promised eager."""
    import warnings

    from graphmode.capture.spec import GraphmodeNotice
    m, ex = mlp()
    cm = graphmode.compile(bundle_from_module(m, ex), dict(RECIPE, on_violation="eager"), cache_dir=tmp_path / "c")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cm.save(tmp_path / "eager.gm")
    said = [str(w.message) for w in seen if w.category is GraphmodeNotice]
    assert any("nothing to fall back to" in s for s in said), said
    with pytest.raises(ContractViolation):
        graphmode.load(tmp_path / "eager.gm", cache_dir=tmp_path / "l")(torch.randn(7, 16))


def test_an_encoder_artifact_keeps_its_tokenizer(bundle, tmp_path):
    """Encoder .gm files dropped the tokenizer (only decoders kept one), so `serve --replicas`,
    which serves the artifact it saves, answered every text /v1/embeddings request "this model
    has no tokenizer"; `serve --model x.gm` too."""
    import transformers as T
    tok = bundle("minilm").tokenizer
    torch.manual_seed(0)
    bert = T.BertModel(T.BertConfig(vocab_size=tok.vocab_size, hidden_size=16, num_hidden_layers=1,
                                    num_attention_heads=2, intermediate_size=32)).eval()
    ex = {"input_ids": torch.randint(0, 100, (1, 8)), "attention_mask": torch.ones(1, 8, dtype=torch.long)}
    b = bundle_from_module(bert, ex, {k: ["batch", "seq"] for k in ex})
    b.tokenizer = tok
    rec = {"version": 1, "name": "tiny-bert", "exe_mode": "graph", "codegen": {"kernel_selection": "heuristic"},
           "inputs": [{"name": "input_ids", "dtype": "i64", "shape": ["batch", "seq"]},
                      {"name": "attention_mask", "dtype": "i64", "shape": ["batch", "seq"], "role": "attention_mask"}],
           "dims": {"batch": {"buckets": [1]}, "seq": {"buckets": [8]}}}
    graphmode.compile(b, rec, cache_dir=tmp_path / "c").save(tmp_path / "bert.gm")
    loaded = graphmode.load(tmp_path / "bert.gm", cache_dir=tmp_path / "c2")
    assert loaded.tokenizer("A man is eating food.")["input_ids"] == tok("A man is eating food.")["input_ids"]


def test_a_cache_that_cannot_hold_the_extracted_copy_extracts_it_privately(saved, caplog):
    """load refused ('cannot extract ... fix: free disk space') where the cache was read-only, full
    or under a path too long, as compile runs uncached there (trial AA). A file where the cache's
    artifacts/ folder goes stands in for them here."""
    cm, path, _, tmp = saved
    blocked = tmp / "blocked-cache"
    blocked.mkdir()
    (blocked / "artifacts").write_text("not a folder")
    with caplog.at_level("WARNING", logger="graphmode.runtime"):
        loaded = graphmode.load(path, cache_dir=blocked)
    x = torch.randn(2, 16)
    assert torch.equal(loaded(x)[0], cm(x)[0])
    assert any("extracted to" in r.getMessage() and "for this process instead" in r.getMessage()
               for r in caplog.records)


def test_a_rename_that_finds_another_process_copy_in_place_takes_it(saved, monkeypatch):
    """Two processes repairing one extracted copy: one's rename landed between the other's
    removal and rename, which failed 'Directory not empty' (trial AA: 2 loads in 24)."""
    import errno
    import shutil
    from pathlib import Path

    import graphmode.runtime.artifact as art
    cm, path, _, tmp = saved
    first = graphmode.load(path, cache_dir=tmp / "race")
    root = tmp / "race" / "artifacts" / first.artifact["digest"]
    good = tmp / "race-good"
    shutil.copytree(root, good)
    (root / "complete").unlink()                 # damaged: the next load repairs it
    real = Path.replace

    def raced(self, target):
        if Path(target) == root and not root.exists():
            shutil.copytree(good, root)          # the other process renames its copy in first
            raise OSError(errno.ENOTEMPTY, "Directory not empty")
        return real(self, target)
    monkeypatch.setattr(Path, "replace", raced)
    again = graphmode.load(path, cache_dir=tmp / "race")
    x = torch.randn(2, 16)
    assert torch.equal(again(x)[0], cm(x)[0]) and (root / "complete").is_file()
