"""Tensor parallelism at run time: communicators (`comm`, bound where the collective ops read
them, graphmode/ir/communicator.py), the loopback link probe (`link`), the per-rank report
(`report`) and the launcher of rank processes (`launch`). The recipe's `parallel` section, its
cost and checks are recipe modules (graphmode/recipe/parallel_spec.py, parallel_cost.py,
parallel_checks.py)."""
