"""How many CPUs this process may really use: its affinity mask and its container's CPU quota.

A container limited to 1.5 CPUs (`docker --cpus 1.5`, a Kubernetes CPU limit) still shows every
core of the host in its affinity mask and /proc/cpuinfo; what limits it is CFS bandwidth
control: the cgroup may run `quota` microseconds per `period`, and once its threads have spent
that they all stop until the next period. A kernel that starts more threads than the quota
spends the period's budget early and then waits out the rest of the period, every period (a
descheduled thread holds up a whole parallel loop). So the default thread count is the
affinity mask capped at the quota, rounded down (at least 1), as Go's automaxprocs does.

Read from cgroup v2 (`cpu.max`: `<quota> <period>` or `max <period>`) or v1
(`cpu.cfs_quota_us`, -1 = none, and `cpu.cfs_period_us`), along the process's own cgroup path
from /proc/self/cgroup and each of its ancestors (a parent's limit binds its children). The
roots are arguments so tests can point them at fixture folders.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

V1_CONTROLLERS = ("cpu", "cpu,cpuacct", "cpuacct,cpu")


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return None


def parse_cpu_max(text: str | None) -> float | None:
    """CPUs allowed by a cgroup v2 `cpu.max` line (`150000 100000` -> 1.5); None for `max`,
    an empty or malformed line."""
    parts = (text or "").split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        quota, period = int(parts[0]), int(parts[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def parse_cfs(quota: str | None, period: str | None) -> float | None:
    """CPUs allowed by cgroup v1's `cpu.cfs_quota_us` / `cpu.cfs_period_us` (quota -1: none)."""
    try:
        q, p = int(quota or ""), int(period or "")
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def _cgroup_paths(proc_root: Path) -> tuple[str | None, dict[str, str]]:
    """(the v2 path, {v1 controller list: path}) of this process, from /proc/self/cgroup."""
    v2, v1 = None, {}
    for line in (_read(proc_root / "self" / "cgroup") or "").splitlines():
        hid, _, rest = line.partition(":")
        ctrl, _, path = rest.partition(":")
        if hid == "0" and ctrl == "":
            v2 = path
        elif ctrl:
            v1[ctrl] = path
    return v2, v1


def _ancestors(root: Path, path: str | None) -> list[Path]:
    """`root/path` and each folder above it up to `root`; a path the mount does not show (a
    container sees only its own subtree, mounted as the root) is just the root."""
    parts = [p for p in (path or "/").split("/") if p]
    out = [root.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]
    return [d for d in out if d.is_dir()] or [root]


def cpu_quota(cgroup_root: str | Path = "/sys/fs/cgroup", proc_root: str | Path = "/proc") -> float | None:
    """The CPU quota of this process's cgroup (the tightest along its path) in CPUs, e.g. 1.5;
    None when there is none or it cannot be read."""
    root, proc = Path(cgroup_root), Path(proc_root)
    v2, v1 = _cgroup_paths(proc)
    found: list[float] = []
    for d in _ancestors(root, v2) if (root / "cgroup.controllers").exists() else []:
        q = parse_cpu_max(_read(d / "cpu.max"))
        if q is not None:
            found.append(q)
    for ctrl in V1_CONTROLLERS:
        mount = root / ctrl
        if not mount.is_dir():
            continue
        path = v1.get(ctrl) or next((v for k, v in v1.items() if "cpu" in k.split(",")), None)
        for d in _ancestors(mount, path):
            q = parse_cfs(_read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us"))
            if q is not None:
                found.append(q)
        break
    return min(found) if found else None


def affinity_cores() -> int:
    """CPUs in this process's affinity mask."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def threads_for(affinity: int, quota: float | None) -> int:
    """Threads for a parallel kernel: the affinity mask's CPUs, capped at the quota rounded
    down, never below 1."""
    n = max(1, int(affinity))
    return max(1, min(n, math.floor(quota))) if quota is not None else n


def default_threads(cgroup_root: str | Path = "/sys/fs/cgroup", proc_root: str | Path = "/proc") -> int:
    """The thread count graphmode's kernels use when none is given: `threads_for` this
    process's affinity and its cgroup's CPU quota."""
    return threads_for(affinity_cores(), cpu_quota(cgroup_root, proc_root))


__all__ = ["cpu_quota", "parse_cpu_max", "parse_cfs", "affinity_cores", "threads_for", "default_threads"]
