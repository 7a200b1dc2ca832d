"""Shared fixtures. Captures of the built-in models are cached per test session (a capture
takes seconds); tests must not mutate the returned graphs."""
from __future__ import annotations

import functools
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# small dim ranges keep captures and interpreter runs fast
MODEL_DIMS = {
    "minilm": {"batch": (1, 32), "seq": (2, 512)},
    "gpt2": {"batch": (1, 8), "seq": (2, 1024)},
    "resnet18": {"batch": (1, 8)},
}


@functools.lru_cache(maxsize=None)
def _bundle(name: str):
    from graphmode.capture.zoo import build
    return build(name)


CAPTURE_CACHE = os.path.join(os.path.dirname(__file__), "..", ".pytest_cache", "graphmode-captures")


@functools.lru_cache(maxsize=None)
def _captured(name: str):
    """Capture once per machine: the IR (save_graph) and report are cached on disk keyed by
    model, dims and torch/graphmode source, so pytest-xdist workers and reruns share it."""
    import fcntl
    import hashlib
    import json
    import pathlib

    import torch

    from graphmode.capture.torch_import import CaptureReport, Fallback, import_torch
    from graphmode.ir import load_graph, save_graph

    src = pathlib.Path(__file__).resolve().parents[1] / "graphmode"
    h = hashlib.sha256(repr((name, MODEL_DIMS[name], torch.__version__)).encode())
    for f in sorted([src / "capture" / "zoo.py", src / "capture" / "torch_import.py"] + list((src / "ir").glob("*.py"))):
        h.update(f.read_bytes())
    d = pathlib.Path(CAPTURE_CACHE) / f"{name}-{h.hexdigest()[:16]}"
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (d / "report.json").exists():
            try:
                rep = json.loads((d / "report.json").read_text())
                report = CaptureReport(rep["source"], rep["seconds"], rep["aten_ops"],
                                       [Fallback(**f) for f in rep["fallbacks"]], rep.get("out_spec"),
                                       rep["output_names"])
                return load_graph(d / "graph"), report
            except Exception:  # noqa: BLE001 - a broken cache entry is simply recaptured
                pass
        b = _bundle(name)
        g, report = import_torch(b.module, b.example_inputs, b.input_dims, MODEL_DIMS[name], name=name,
                                 output_names=b.output_names)
        save_graph(g, d / "graph")
        rep = report.to_json()
        rep["out_spec"] = report.out_spec
        (d / "report.json").write_text(json.dumps(rep))
        return g, report


@pytest.fixture(scope="session")
def bundle():
    """bundle(name) -> ModelBundle (module, example inputs, make_inputs)."""
    return _bundle


@pytest.fixture(scope="session")
def captured():
    """captured(name) -> (Graph, CaptureReport) from torch.export, cached."""
    return _captured


# ---- golden IR files (tests/golden/<pass>/<case>.txt) ---------------------------------------
GOLDEN_DIR = os.path.join(os.path.dirname(__file__), "golden")


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true", default=False,
                     help="rewrite tests/golden/**.txt from the current output instead of comparing")


@pytest.fixture
def golden(request):
    """golden("<pass>/<case>", text): compare `text` with tests/golden/<pass>/<case>.txt;
    with --update-golden the file is (re)written instead. Read a rewritten file before
    committing it: the golden file is the expected output, not a snapshot of whatever ran."""
    update = request.config.getoption("--update-golden")

    def check(name: str, text: str) -> None:
        path = os.path.join(GOLDEN_DIR, name if name.endswith(".txt") else name + ".txt")
        if update:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(text)
            return
        if not os.path.exists(path):
            pytest.fail(f"golden file {path} is missing; create it with `pytest --update-golden` "
                        f"and read it to check it is right")
        with open(path) as f:
            expected = f.read()
        assert text == expected, f"output differs from {path} (refresh with --update-golden if intended)"
    return check
