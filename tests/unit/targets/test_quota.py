"""The CPU quota a container's cgroup sets (v2 `cpu.max`, v1 CFS quota) and the thread count
it gives, read from fixture folders laid out like /sys/fs/cgroup and /proc."""
from __future__ import annotations

from pathlib import Path

import pytest

from graphmode.targets.quota import cpu_quota, parse_cfs, parse_cpu_max, threads_for


def _tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


@pytest.mark.parametrize("text, cpus", [("150000 100000", 1.5), ("max 100000", None), ("200000 100000\n", 2.0),
                                        ("", None), (None, None), ("x 100000", None), ("0 100000", None),
                                        ("100000", None)])
def test_cpu_max_lines(text, cpus):
    assert parse_cpu_max(text) == cpus


@pytest.mark.parametrize("quota, period, cpus", [("-1", "100000", None), ("50000", "100000", 0.5),
                                                 ("", "100000", None), ("300000", "0", None)])
def test_cfs_quota_files(quota, period, cpus):
    assert parse_cfs(quota, period) == cpus


def test_v2_quota_is_the_tightest_along_the_process_path(tmp_path):
    cg, proc = tmp_path / "cg", tmp_path / "proc"
    _tree(cg, {"cgroup.controllers": "cpu memory", "cpu.max": "max 100000",
               "kube/cpu.max": "150000 100000", "kube/pod1/cpu.max": "300000 100000",
               "other/cpu.max": "10000 100000"})
    _tree(proc, {"self/cgroup": "0::/kube/pod1\n"})
    assert cpu_quota(cg, proc) == 1.5        # the parent's 1.5 binds its child's 3


def test_v2_inside_a_container_sees_its_own_root(tmp_path):
    """A container's /proc/self/cgroup names the host's path, its mount shows only its own subtree."""
    cg, proc = tmp_path / "cg", tmp_path / "proc"
    _tree(cg, {"cgroup.controllers": "cpu", "cpu.max": "250000 100000"})
    _tree(proc, {"self/cgroup": "0::/system.slice/docker-abc.scope\n"})
    assert cpu_quota(cg, proc) == 2.5


def test_v1_cfs_quota(tmp_path):
    cg, proc = tmp_path / "cg", tmp_path / "proc"
    _tree(cg, {"cpu,cpuacct/cpu.cfs_quota_us": "-1", "cpu,cpuacct/cpu.cfs_period_us": "100000",
               "cpu,cpuacct/job/cpu.cfs_quota_us": "120000", "cpu,cpuacct/job/cpu.cfs_period_us": "100000"})
    _tree(proc, {"self/cgroup": "4:memory:/job\n3:cpu,cpuacct:/job\n0::/\n"})
    assert cpu_quota(cg, proc) == 1.2


def test_no_quota_or_no_cgroup_files(tmp_path):
    cg, proc = tmp_path / "cg", tmp_path / "proc"
    _tree(cg, {"cgroup.controllers": "cpu", "cpu.max": "max 100000", "cpu/cpu.cfs_quota_us": "-1",
               "cpu/cpu.cfs_period_us": "100000"})
    _tree(proc, {"self/cgroup": "1:cpu:/\n0::/\n"})
    assert cpu_quota(cg, proc) is None
    assert cpu_quota(tmp_path / "missing", tmp_path / "missing") is None


@pytest.mark.parametrize("affinity, quota, threads", [(8, None, 8), (8, 1.5, 1), (8, 2.0, 2), (2, 4.0, 2),
                                                      (8, 0.5, 1), (0, None, 1)])
def test_threads_follow_the_affinity_capped_at_the_quota(affinity, quota, threads):
    assert threads_for(affinity, quota) == threads
