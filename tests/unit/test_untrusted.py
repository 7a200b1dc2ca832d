"""The one reader of files graphmode did not write: regular files only, inside the root, within
a size bound checked before reading, the recorded hash, strict JSON; each refusal one
UntrustedFileError naming the file."""
from __future__ import annotations

import hashlib
import os

import pytest

from graphmode.untrusted import UntrustedFileError, file_sha256, parse_json, read_bytes, read_json


def test_reads_a_regular_file_within_bounds_and_hash(tmp_path):
    f = tmp_path / "a.json"
    f.write_text('{"a": [1, 2.5, "x"]}')
    sha = hashlib.sha256(f.read_bytes()).hexdigest()
    assert read_json(f, limit=100, root=tmp_path, sha256=sha) == {"a": [1, 2.5, "x"]}
    assert file_sha256(f, limit=100, root=tmp_path) == sha
    with pytest.raises(UntrustedFileError, match="sha256"):
        read_bytes(f, limit=100, sha256="0" * 64)
    with pytest.raises(UntrustedFileError, match="more than the 10"):
        read_bytes(f, limit=10)


@pytest.mark.parametrize("what, match", [("fifo", "FIFO"), ("dev-zero", "outside"), ("folder", "folder"),
                                          ("link-out", "outside"), ("missing", "cannot open")])
def test_refuses_what_is_not_a_regular_file_inside_the_root(tmp_path, what, match):
    root = tmp_path / "root"
    root.mkdir()
    f = root / "x"
    {"fifo": lambda: os.mkfifo(f), "dev-zero": lambda: f.symlink_to("/dev/zero"), "folder": f.mkdir,
     "link-out": lambda: f.symlink_to(tmp_path), "missing": lambda: None}[what]()
    with pytest.raises(UntrustedFileError, match=match) as e:
        read_bytes(f, limit=1 << 20, root=root)
    assert e.value.where == str(f)


def test_a_device_is_refused_even_without_a_root():
    with pytest.raises(UntrustedFileError, match="character device"):
        read_bytes("/dev/zero", limit=1 << 20)


def test_a_link_inside_the_root_is_followed(tmp_path):
    (tmp_path / "real").write_text("[]")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert read_json(tmp_path / "link", limit=10, root=tmp_path) == []


@pytest.mark.parametrize("text, match", [("1e999", "out of range"), ("NaN", "not a JSON number"),
                                         ("[-Infinity]", "not a JSON number"), ("[" * 100 + "]" * 100, "nested"),
                                         ("9" * 5000, "digits|int"), (b"\xff", "UTF-8"), ("{", "Expecting")])
def test_strict_json(text, match):
    with pytest.raises(ValueError, match=match):
        parse_json(text)
    assert parse_json('{"a": "[[[[", "b": 1e300}') == {"a": "[[[[", "b": 1e300}     # brackets in strings do not count
