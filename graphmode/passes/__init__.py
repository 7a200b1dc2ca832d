"""Passes over the IR. Exports load lazily: the recipe layer imports `registry` and `options`
(pass declarations and option models) and must not pay for torch; the pass modules register
themselves on the first lookup in `PASSES`."""
_API = {"PASSES": "base", "PassContext": "base", "PassResult": "base", "register_pass": "base",
        "DumpIR": "manager", "KeepSnapshots": "manager", "PassManager": "manager", "PassReport": "manager",
        "expand_pipeline": "manager", "PASS_INFOS": "registry", "PRESETS": "registry", "check_order": "registry"}

__all__ = list(_API)


def __getattr__(name):
    if name in _API:
        import importlib
        return getattr(importlib.import_module(f"graphmode.passes.{_API[name]}"), name)
    raise AttributeError(f"module 'graphmode.passes' has no attribute {name!r}")
