"""What the host lets this process use: its CPUs.

``os.cpu_count()`` counts the machine's CPUs. A container limited with a CPU set (``docker --cpuset-cpus``,
``taskset``) or a CPU quota (``docker --cpus``, a Kubernetes CPU limit: cgroup v2's ``cpu.max``) may use far
fewer, and sizing threads, processes or busy polling after the machine's count starves the engine instead.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
MEMBERSHIP = Path("/proc/self/cgroup")


def usable_cpus(cgroup_root: Path = CGROUP_ROOT, membership: Path = MEMBERSHIP) -> int:
    """CPUs this process may run on (its affinity mask), capped by its cgroup's CPU quota rounded up; at least 1."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = cgroup_cpu_quota(cgroup_root, membership)
    if quota is not None:
        cpus = min(cpus, math.ceil(quota))
    return max(1, cpus)


def cgroup_cpu_quota(cgroup_root: Path = CGROUP_ROOT, membership: Path = MEMBERSHIP) -> float | None:
    """CPUs' worth of time per period this process's cgroup allows, the tightest along its path (cgroup v2's
    ``cpu.max``, ``"200000 100000"`` being 2.0; v1's ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us``); None where
    no quota is set or none can be read. ``membership``: the process's cgroups (``/proc/self/cgroup``)."""
    try:
        entries = membership.read_text().splitlines()
    except OSError:
        return None
    tightest = None
    for entry in entries:
        fields = entry.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "":  # v2: one hierarchy, the quota in cpu.max
            folder, read = cgroup_root, _read_cpu_max
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's own hierarchy
            folder, read = cgroup_root / controllers, _read_cfs_quota
        else:
            continue
        top = folder
        folder = Path(os.path.normpath(folder / path.lstrip("/")))
        if folder != top and top not in folder.parents:  # "/../.." in a cgroup namespace: the mount is its own
            folder = top
        while True:  # a quota may be set on any ancestor
            quota = read(folder)
            if quota is not None:
                tightest = quota if tightest is None else min(tightest, quota)
            if folder == top:
                break
            folder = folder.parent
    return tightest


def _read_cpu_max(folder: Path) -> float | None:
    fields = _read_fields(folder / "cpu.max")
    if fields is None or len(fields) != 2 or fields[0] == "max":
        return None
    return _ratio(fields[0], fields[1])


def _read_cfs_quota(folder: Path) -> float | None:
    quota, period = _read_fields(folder / "cpu.cfs_quota_us"), _read_fields(folder / "cpu.cfs_period_us")
    if not quota or not period:
        return None
    return _ratio(quota[0], period[0])


def _read_fields(path: Path) -> list[str] | None:
    try:
        return path.read_text().split()
    except OSError:
        return None


def _ratio(quota: str, period: str) -> float | None:
    try:
        numerator, denominator = int(quota), int(period)
    except ValueError:
        return None
    return numerator / denominator if numerator > 0 and denominator > 0 else None
