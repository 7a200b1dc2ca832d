"""A tensor-parallel group's artifacts (graphmode/runtime/rank_artifacts.py) without rank
processes: the tiny MLP's two shards compiled in this process (`rank=`) and saved as rank files,
the group file over them; damaged, replaced, missing or misused files are refused naming the file
before any rank starts. Saving from the ranks and loading the group: tests/e2e/test_saved_tp_group.py."""
from __future__ import annotations

import json
import sys
import zipfile
from pathlib import Path

import pytest

import graphmode
from graphmode.runtime.artifact import ArtifactError, load
from graphmode.runtime.rank_artifacts import group_files, rank_paths, read_group, write_group

sys.path.insert(0, str(Path(__file__).parents[2] / "e2e"))
import tiny_tp  # noqa: E402

SPEC = str(Path(__file__).parents[2] / "e2e" / "tiny_tp.py")


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("group")
    rec = tiny_tp.recipe("mlp-tp2", inputs=tiny_tp.MLP_INPUTS, dims=tiny_tp.MLP_DIMS)
    files = rank_paths(tmp / "mlp.gm", 2)
    for r, f in enumerate(files):
        cm = graphmode.compile(f"{SPEC}:mlp", rec, cache_dir=tmp / "cache", rank=r)     # the shard only
        manifest = cm.save(f, rank=r)
        assert (manifest["rank"], manifest["world"]) == (r, 2)
    write_group(tmp / "mlp.gm", files, cm.recipe)
    return tmp, files


def copy_group(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in ("mlp.gm", "mlp.rank0.gm", "mlp.rank1.gm"):
        (dst / f).write_bytes((src / f).read_bytes())
    return dst / "mlp.gm"


def test_the_group_file_names_each_rank_file_with_its_hash(group):
    tmp, files = group
    g = read_group(tmp / "mlp.gm")
    assert g["world"] == 2 and [r["file"] for r in g["ranks"]] == ["mlp.rank0.gm", "mlp.rank1.gm"]
    assert [r["bytes"] for r in g["ranks"]] == [f.stat().st_size for f in files]


def test_a_damaged_or_missing_rank_file_is_refused_naming_it(group, tmp_path):
    tmp, _ = group
    path = copy_group(tmp, tmp_path / "damaged")
    rank1 = path.with_name("mlp.rank1.gm")
    data = bytearray(rank1.read_bytes())
    data[len(data) // 2] ^= 0xFF
    rank1.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="rank 1's file differs from the group manifest") as e:
        graphmode.load(path, cache_dir=tmp_path / "c")          # refused before any rank starts
    assert e.value.where == str(rank1)
    rank1.unlink()
    with pytest.raises(ArtifactError, match="rank 1's file cannot be read") as e:
        read_group(path)
    assert e.value.where == str(rank1) and "mlp.rank1.gm" in e.value.fix


def test_an_edited_group_file_is_refused(group, tmp_path):
    tmp, _ = group
    path = copy_group(tmp, tmp_path / "edited")
    with zipfile.ZipFile(path) as z:
        doc = json.loads(z.read("group.json"))
    for edit, match in (({"world": 3}, "3 rank files|2 rank files for a group of 3"),
                        ({"ranks": [dict(doc["ranks"][0], file="../mlp.rank0.gm"), doc["ranks"][1]]}, "ranks.0.file"),
                        ({"torch": "0.0"}, "built with torch 0.0")):
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("group.json", json.dumps({**doc, **edit}))
        with pytest.raises(ArtifactError, match=match):
            read_group(path)


def test_a_rank_file_loads_only_on_its_rank(group, tmp_path):
    _, files = group
    with pytest.raises(ArtifactError, match="rank 0's shard of a 2-rank group") as e:
        graphmode.load(files[0], cache_dir=tmp_path)
    assert "group file" in e.value.fix
    with pytest.raises(ArtifactError, match="rank 1 of 2, loaded as rank 0"):
        load(files[1], cache_dir=tmp_path, rank=0)


def test_a_node_checks_only_its_own_ranks_file(group, tmp_path):
    tmp, _ = group
    path = copy_group(tmp, tmp_path / "node1")
    path.with_name("mlp.rank0.gm").unlink()                     # another node holds rank 0
    files, recipe = group_files(path, 1)
    assert Path(files[1]).name == "mlp.rank1.gm" and recipe.parallel.tensor == 2
    with pytest.raises(ArtifactError, match="rank 0's file cannot be read"):
        group_files(path, 0)
    with pytest.raises(ArtifactError, match="rank 2 is outside the saved group of 2"):
        group_files(path, 2)


def test_a_group_file_s_recipe_is_the_ranks_and_run_refuses_a_recipe_beside_it(group):
    from typer.testing import CliRunner

    from graphmode.cli.app import _register, app
    from graphmode.runtime.artifact import recipe_of
    tmp, files = group
    assert recipe_of(tmp / "mlp.gm").hash() == recipe_of(files[0]).hash()     # what `serve` reads and serves
    _register()
    res = CliRunner().invoke(app, ["run", "--model", str(tmp / "mlp.gm"), "--mode", "graph"])   # before any rank starts
    assert res.exit_code == 2 and "--mode does not apply to an artifact" in res.output, res.output
