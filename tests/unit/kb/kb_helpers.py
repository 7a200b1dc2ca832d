"""Helpers of the knowledge-base and tuning tests: subjects to record without compiling
anything, and model specs from kb_models.py."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch.nn as nn

MODELS = Path(__file__).resolve().with_name("kb_models.py")


def spec(name: str) -> str:
    return f"{MODELS}:{name}"


def recipe_data(name: str = "mlp-a", **over) -> dict:
    r = {"version": 1, "name": name, "inputs": [{"name": "x", "dtype": "f32", "shape": ["batch", 16]}],
         "dims": {"batch": {"min": 1, "max": 8, "max_padding": 0.5}}, "codegen": {"kernel_selection": "heuristic"},
         "targets": ["host"]}
    r.update(over)
    return r


def subject(recipe: dict | None = None, target: str = "cpu_avx2", width: int = 16, origin: str = "measured"):
    """A Subject over a shipped target and a module's parameters (no capture: fast)."""
    from graphmode.kb.record import Subject
    from graphmode.recipe import load_recipe
    from graphmode.targets import get_target
    src = SimpleNamespace(name=f"mlp{width}", module=nn.Sequential(nn.Linear(16, width), nn.Linear(width, 4)))
    return Subject(load_recipe(recipe or recipe_data()), get_target(target), src, None, f"ir{width}", origin=origin)
