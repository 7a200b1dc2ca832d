"""The compile report's memory table: a plan table cut to its first and last buckets says so."""
from __future__ import annotations

from graphmode.cli.compile_cmd import memory_rows
from graphmode.compile_report import BucketMemory


def test_a_cut_memory_table_says_how_many_buckets_it_leaves_out():
    """Titled 'memory plan (16 buckets)', it listed 12 rows and nothing said 4 were left out (trial S)."""
    mem = [BucketMemory({"batch": i}, i << 20, i << 20) for i in range(1, 17)]
    rows = memory_rows(mem, 12)
    assert [r[0] for r in rows] == [f"batch={i}" for i in range(1, 7)] + ["... 4 more (--json)"] + \
        [f"batch={i}" for i in range(11, 17)]
    assert len(memory_rows(mem[:12], 12)) == 12 and rows[0][1:] == ("1.00", "1.00", "1.000")
