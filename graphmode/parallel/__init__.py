"""Tensor parallelism: the recipe's `parallel` section (`spec`), collective costs (`cost`),
communicators (`comm`), per-rank compilation (`rank`) and the launcher of rank processes
(`launch`, `worker`). Importing the package is light: the recipe layer reads `spec` and `cost`."""
