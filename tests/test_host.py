"""weft.host.usable_cpus: the affinity mask capped by a cgroup CPU quota (v2 cpu.max, v1 cfs quota), read from a
cgroup tree laid out in a temporary folder as the kernel lays it out."""

from __future__ import annotations

import os
from pathlib import Path

from weft.host import cgroup_cpu_quota, usable_cpus


def affinity() -> int:
    return len(os.sched_getaffinity(0))


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_a_v2_quota_on_an_ancestor_caps_the_cpus(tmp_path):
    root, membership = tmp_path / "cgroup", tmp_path / "membership"
    write(membership, "0::/kubepods/pod1/container\n")
    write(root / "cpu.max", "max 100000\n")
    write(root / "kubepods/cpu.max", "max 100000\n")
    write(root / "kubepods/pod1/cpu.max", "150000 100000\n")  # 1.5 CPUs: rounded up to 2
    write(root / "kubepods/pod1/container/cpu.max", "max 100000\n")
    assert cgroup_cpu_quota(root, membership) == 1.5
    assert usable_cpus(root, membership) == min(affinity(), 2)


def test_the_tightest_quota_along_the_path_wins_and_no_quota_leaves_the_affinity(tmp_path):
    root, membership = tmp_path / "cgroup", tmp_path / "membership"
    write(membership, "0::/a/b\n")
    write(root / "a/cpu.max", "100000 100000\n")
    write(root / "a/b/cpu.max", "400000 100000\n")
    assert cgroup_cpu_quota(root, membership) == 1.0
    assert usable_cpus(root, membership) == 1
    write(root / "a/cpu.max", "max 100000\n")
    write(root / "a/b/cpu.max", "max 100000\n")
    assert cgroup_cpu_quota(root, membership) is None
    assert usable_cpus(root, membership) == affinity()


def test_a_v1_cfs_quota_is_read_from_the_cpu_hierarchy(tmp_path):
    root, membership = tmp_path / "cgroup", tmp_path / "membership"
    write(membership, "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n")
    write(root / "cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "300000\n")
    write(root / "cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000\n")
    write(root / "cpu,cpuacct/cpu.cfs_quota_us", "-1\n")  # the root: no quota
    write(root / "cpu,cpuacct/cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_quota(root, membership) == 3.0
    assert usable_cpus(root, membership) == min(affinity(), 3)


def test_unreadable_or_malformed_files_mean_no_quota(tmp_path):
    root, membership = tmp_path / "cgroup", tmp_path / "membership"
    assert cgroup_cpu_quota(root, membership) is None  # no membership file
    write(membership, "garbage\n0::/x\n")
    write(root / "x/cpu.max", "lots of words here\n")
    assert cgroup_cpu_quota(root, membership) is None
    write(root / "x/cpu.max", "abc 100000\n")
    assert cgroup_cpu_quota(root, membership) is None
    assert usable_cpus(root, membership) == affinity()


def test_this_machine_answers_at_least_one_cpu():
    assert 1 <= usable_cpus() <= (os.cpu_count() or 1)


def test_a_path_outside_the_namespaces_mount_reads_the_mount_itself(tmp_path):
    """In a cgroup namespace the path can climb above the mount ("/../.."): the mount is then the process's own
    cgroup, and nothing outside it is read."""
    root, membership = tmp_path / "cgroup", tmp_path / "membership"
    write(membership, "0::/../..\n")
    write(root / "cpu.max", "200000 100000\n")
    write(tmp_path / "cpu.max", "100000 100000\n")  # outside the mount: never read
    assert cgroup_cpu_quota(root, membership) == 2.0


def test_nothing_sizes_threads_or_processes_by_the_machines_cpu_count():
    """``os.cpu_count()`` counts the machine's CPUs, not those a container may use: only weft.host reads it (as a
    fallback where there is no affinity mask); everything else sizes itself by ``usable_cpus()``."""
    repository = Path(__file__).resolve().parent.parent
    readers = sorted(
        str(path.relative_to(repository))
        for folder in ("core/src", *(str(p.relative_to(repository)) for p in repository.glob("plugins*")))
        for path in (repository / folder).rglob("*.py")
        if "cpu_count()" in path.read_text(encoding="utf-8")
    )
    assert readers == ["core/src/weft/host.py"]


def test_xgrammars_threads_leave_a_usable_cpu_free(monkeypatch):
    import weft_xgrammar.backend as backend

    monkeypatch.setattr(backend, "usable_cpus", lambda: 2)  # a 2-CPU quota on a machine of many more
    assert backend.spare_threads(8) == 1
    monkeypatch.setattr(backend, "usable_cpus", lambda: 16)
    assert backend.spare_threads(8) == 8 and backend.spare_threads(1) == 1
