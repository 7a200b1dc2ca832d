"""Importers: torch.export and ONNX into the IR, and model sources (capture/source.py).

`graphmode.capture(model, recipe)` is also the public capture function: the `graphmode`
facade makes this package callable once it is imported (graphmode/__init__.py), so both
spellings keep working and this package never imports the driver above it.
"""
