"""Backends: what runs an ExecutionPlan on a device (base.py), found by name (registry.py).

Layering, one direction only: the runtime depends on `Backend` / `Executable`; each backend
package depends on base.py and arena.py (host memory) and on nothing above it.
"""
from graphmode.backends.base import Backend, Capabilities, Executable
from graphmode.backends.registry import DEFAULT_DEVICE, backends, get_backend, register

__all__ = ["Backend", "Capabilities", "Executable", "DEFAULT_DEVICE", "backends", "get_backend", "register"]
