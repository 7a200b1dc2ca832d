"""graphmode: a graph-mode compiler and runtime for deep-learning inference.

recipe -> capture -> IR -> passes -> plan -> backend -> runtime; see README.md.
"""
__version__ = "0.1.0"

_API = {"capture": "graphmode.compiler", "optimize": "graphmode.compiler", "compile": "graphmode.compiler",
        "load_recipe": "graphmode.recipe", "CompiledModel": "graphmode.runtime.compiled",
        "load": "graphmode.runtime.artifact"}


def __getattr__(name):  # lazy: `import graphmode` stays cheap until the pipeline is used
    if name in _API:
        import importlib
        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'graphmode' has no attribute {name!r}")
