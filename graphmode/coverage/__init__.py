"""Op coverage: which ops graphmode imports, interprets and lowers, read from the registries
(`graphmode ops`, docs/ops.md, tests/unit/ir/test_op_coverage.py)."""
