"""Importers: torch.export and ONNX into the IR.

`graphmode.capture(model, recipe)` is also the public capture function. Importing this
package makes Python bind `graphmode.capture` to the package, so the package itself is
callable and forwards to `graphmode.compiler.capture`; both spellings keep working.
"""
import sys
import types


class _CallablePackage(types.ModuleType):
    def __call__(self, *args, **kwargs):
        from graphmode.compiler import capture
        return capture(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
