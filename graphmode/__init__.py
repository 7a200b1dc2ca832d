"""graphmode: a graph-mode compiler and runtime for deep-learning inference.

recipe -> capture -> IR -> passes -> plan -> backend -> runtime; see README.md and
docs/ARCHITECTURE.md ("Layers"). This package is the public facade: its names resolve lazily,
so `import graphmode` stays cheap until the pipeline is used, and no package below imports it
(the version lives in graphmode/version.py).
"""
import sys
import types

from graphmode.version import __version__  # noqa: F401

_API = {"capture": "graphmode.compiler", "optimize": "graphmode.compiler", "compile": "graphmode.api",
        "load_recipe": "graphmode.recipe", "CompiledModel": "graphmode.runtime.compiled",
        "load": "graphmode.api", "GraphmodeError": "graphmode.errors", "ContractViolation": "graphmode.errors",
        "RecipeError": "graphmode.errors", "CaptureError": "graphmode.errors"}


def __getattr__(name):
    if name in _API:
        import importlib
        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'graphmode' has no attribute {name!r}")


class _CapturePackage(types.ModuleType):
    """`graphmode.capture(model, recipe)` is the public capture function, and `graphmode.capture`
    is also the importers' package: once imported, the package is bound as the attribute, so
    the facade makes that package callable (forwarding to the driver's `capture`). The facade
    owns this, so the capture package never imports the driver above it."""

    def __call__(self, *args, **kwargs):
        from graphmode.compiler import capture
        return capture(*args, **kwargs)


class _Facade(types.ModuleType):
    def __setattr__(self, name, value):
        if name == "capture" and type(value) is types.ModuleType:
            value.__class__ = _CapturePackage     # the import system binding the subpackage
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Facade
