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


@functools.lru_cache(maxsize=None)
def _captured(name: str):
    from graphmode.capture.torch_import import import_torch
    b = _bundle(name)
    return import_torch(b.module, b.example_inputs, b.input_dims, MODEL_DIMS[name], name=name,
                        output_names=b.output_names)


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
