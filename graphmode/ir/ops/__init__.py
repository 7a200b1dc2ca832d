"""The op database: one `OpSpec` per core op (type inference, reference semantics, ATen
overloads, traits, sample inputs), grouped by family. Every importer lowers into these ops;
every pass, planner, analysis and backend reads them from here. Semantics follow PyTorch's
eager functions named in `ref`. A dim in an attribute (e.g. `reshape.shape`) may be an int
or a symbolic expression over the recipe dims, evaluated per bucket. See docs/ops.md.
"""
from graphmode.ir.ops.spec import (OPS, PAD_IDENTITIES, PADDING_RULES, TRAITS, OpSpec, Sample, _result_dtype,
                                   aten_table, broadcast_shapes, eval_shape, get_op, norm_axis, ops_with, pair,
                                   register, result_dtype)
from graphmode.ir.ops import elementwise, reduction, linalg, shape, data, kv, collective, regions, aten_ref  # noqa: F401,E401 - registers
from graphmode.ir.ops import aten_calls  # noqa: F401 - attaches each op's eager ATen call
from graphmode.ir.ops.aten_calls import aten_call
from graphmode.ir.ops.cost import flops_of
from graphmode.ir.ops.linalg import conv_out
from graphmode.ir.ops.shape import resolve_reshape

__all__ = ["OPS", "PAD_IDENTITIES", "PADDING_RULES", "TRAITS", "OpSpec", "Sample", "aten_call", "aten_table",
           "broadcast_shapes", "eval_shape", "get_op", "norm_axis", "ops_with", "pair", "register", "result_dtype",
           "_result_dtype", "flops_of", "conv_out", "resolve_reshape"]
