"""Passes over the IR. Importing this package registers every pass implementation."""
import importlib

from graphmode.passes.base import PASSES, PassContext, PassResult, register_pass
from graphmode.passes.manager import DumpIR, KeepSnapshots, PassManager, PassReport, expand_pipeline
from graphmode.passes.registry import PASS_INFOS, PRESETS, check_order

# one module per pass; a module not written yet is skipped (PassManager reports it)
for _mod in ("canonicalize", "precision", "constant_fold", "cse", "dce", "layout", "fuse", "memory_plan"):
    try:
        importlib.import_module(f"graphmode.passes.{_mod}")
    except ModuleNotFoundError as _e:
        if _e.name != f"graphmode.passes.{_mod}":
            raise

__all__ = ["PASSES", "PassContext", "PassResult", "register_pass", "DumpIR", "KeepSnapshots", "PassManager",
           "PassReport", "expand_pipeline", "PASS_INFOS", "PRESETS", "check_order"]
