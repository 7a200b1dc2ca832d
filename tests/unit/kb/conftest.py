"""One artifact cache for the session's knowledge-base and tuning tests: the same tiny
kernels compile once."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def kb_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.getbasetemp() / "graphmode-kb-cache"
