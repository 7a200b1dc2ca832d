"""No tracked file names this machine's layout: an absolute path under a home folder, root's home,
the work or temp folder of the machine the file was written on. Such a path means nothing on
another machine (a bench result, a profile, a test's data file), and a test that reads one passes
only where it was written. Generated results print paths relative to the repo or `~` instead."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

SELF = Path(__file__).resolve()
REPO = SELF.parents[2]

# An absolute path (not the tail of a relative one such as bench/results/tmp/) whose first
# folder is one of these. Each says where it usually comes from.
MACHINE_ROOTS = {
    "home": "a user's home folder",
    "root": "root's home folder",
    "Users": "a macOS home folder",
    "work": "a checkout or venv of the machine the file was written on",
    "tmp": "a temporary folder of one run",
    "mnt": "a mounted volume",
    "scratch": "a cluster's scratch space",
}
MACHINE_PATH = re.compile(r"(?<![\w.~$/-])/(" + "|".join(MACHINE_ROOTS) + r")/[\w.-]")
WINDOWS_HOME = re.compile(r"\b[A-Za-z]:\\{1,2}Users\\{1,2}\w")


def tracked_text_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:     # an sdist or a copy without .git
        pytest.skip(f"not a git checkout: {e}")
    files = []
    for name in out.decode().split("\0"):
        p = REPO / name
        if not name or not p.is_file() or p == SELF:         # this file's own examples of what is refused
            continue
        data = p.read_bytes()
        if b"\0" in data[:8192]:
            continue                                          # binary: a chart, an ONNX file
        files.append(p)
    return files


def machine_paths(text: str) -> list[tuple[int, str]]:
    """(line number, the line) for every line that names a machine path."""
    return [(i, line.strip()) for i, line in enumerate(text.splitlines(), start=1)
            if MACHINE_PATH.search(line) or WINDOWS_HOME.search(line)]


@pytest.mark.parametrize("line, found", [
    ("wrote /work/main/bench/results/bench.json", True),
    ("loaded from /root/.cache/graphmode/calibration/host.json", True),
    ('"path":"/tmp/rs/mlp.gm"', True),
    ("cd /home/alice/graphmode && make", True),
    (r"C:\Users\alice\graphmode", True),
    ("bench/results/tmp/", False),                           # a relative folder that happens to be named tmp
    ("~/.cache/graphmode/calibration/host.json", False),     # the documented default cache, on any machine
    ("GET /v1/infer/../../etc/passwd", False),
    ("#!/usr/bin/env bash", False),
])
def test_the_pattern_finds_machine_paths_and_nothing_else(line, found):
    assert bool(machine_paths(line)) is found


def test_no_tracked_file_names_a_machine_path():
    bad = []
    for p in tracked_text_files():
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        bad += [f"{p.relative_to(REPO)}:{n}: {line[:160]}" for n, line in machine_paths(text)]
    assert not bad, ("tracked files name paths of one machine (write them relative to the repo, the results "
                     "folder or ~):\n" + "\n".join(bad))


def test_test_modules_have_unique_basenames():
    """tests/ has no __init__.py, so pytest imports each test file by its basename: two files of
    one name make the second fail to collect ("import file mismatch") in whichever run meets both."""
    seen: dict[str, Path] = {}
    for f in sorted((REPO / "tests").rglob("test_*.py")):
        other = seen.setdefault(f.name, f)
        assert other == f, f"{f.relative_to(REPO)} and {other.relative_to(REPO)}: rename one"


def test_no_model_or_build_output_is_tracked():
    """Models, artifacts, caches and objects are made by the code and tests at run time: one
    committed by accident (an ONNX file a session wrote at the repo root) is data nothing reads."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"not a git checkout: {e}")
    made = re.compile(r"\.(onnx|gm|gguf|pt|pth|safetensors|sqlite|so|o|pyc)$")
    bad = [n for n in out.decode().split("\0") if made.search(n)]
    assert not bad, f"tracked files that the code makes at run time (git rm them): {bad}"
