"""Shared by the ONNX importer tests: compile a file (drafted, or under a recipe), warnings quiet."""
from __future__ import annotations

import warnings

import graphmode


def compile_onnx(path, cache, recipe=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return graphmode.compile(path, recipe, cache_dir=cache) if recipe else graphmode.compile(path, cache_dir=cache)
