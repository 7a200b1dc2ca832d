"""ATen -> core IR converters: one small registered function per ATen overload.

Arguments are normalised once against the overload's own schema (`bind`), so a converter
reads `a["dim"]` whether the model passed it by position, by keyword or left the default —
never `node.args[3]`. Ops captured one-to-one are converted from the op database
(`OpSpec.aten`): tensor arguments become inputs, arguments named like the op's attributes
become attributes, and any other argument must be at its default or the op is not
converted (it becomes an explicit fallback, listed with its source line). A converter
returns False when it does not cover this instance (same outcome).

registry.py (registration, argument binding, dispatch), emit.py (emission helpers the
converters share), and the converters by family: elementwise.py, nn.py (reductions,
normalisations, GEMM / conv / attention, pools), shape.py (shape and data ops). Importing
this package registers them all.
"""
from graphmode.capture.aten import elementwise, nn, shape  # noqa: F401 - registers the converters
from graphmode.capture.aten.emit import (aten_reference, axis, emit_aten_reference, emit_checked, emit_on_rank1,
                                         repeat_axis, repeat_heads)
from graphmode.capture.aten.registry import CONVERTERS, Converter, bind, convert, converts, is_default, one_to_one

__all__ = ["CONVERTERS", "Converter", "converts", "bind", "is_default", "convert", "one_to_one", "axis",
           "emit_on_rank1", "aten_reference", "emit_aten_reference", "emit_checked", "repeat_axis", "repeat_heads"]
