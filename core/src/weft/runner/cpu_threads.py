"""How many compute threads the CPU worker runs, and on which cores.

Default: one thread per physical core the process may use: the cores of its CPU affinity
(``sched_getaffinity``, one logical CPU per core, the first sibling), capped by the cgroup's CPU
quota (``cpu.max`` under cgroup v2, ``cpu.cfs_quota_us`` under v1) rounded down, at least one.
The process is then bound to those CPUs, so the OpenMP threads torch starts stay on them.
``engine.cpu_threads`` and ``engine.cpu_affinity`` override the count and the CPUs.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger("weft.runner")


def physical_cores(cpus: list[int]) -> list[int]:
    """One logical CPU (the lowest) per physical core among ``cpus``; all of them where the topology is unknown."""
    chosen: dict[tuple[str, str], int] = {}
    for cpu in sorted(cpus):
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            key = ((topology / "physical_package_id").read_text().strip(), (topology / "core_id").read_text().strip())
        except OSError:
            key = ("cpu", str(cpu))
        chosen.setdefault(key, cpu)
    return sorted(chosen.values())


def cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Whole CPUs the cgroup's quota allows (rounded down, at least 1); None without a quota."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        if quota == "max":
            return None
        return max(1, int(quota) // int(period))
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 else max(1, quota // period)
    except (OSError, ValueError):
        return None


def choose_cpus(threads: int | None, affinity: list[int] | None) -> tuple[list[int], str]:
    """``(CPUs to bind, why)``: ``affinity`` if given, else one per physical core available, capped by the quota;
    ``threads`` (if given) takes the first that many."""
    available = sorted(os.sched_getaffinity(0))
    if affinity is not None:
        unknown = sorted(set(affinity) - set(available))
        if unknown:
            raise ValueError(
                f"engine.cpu_affinity = {affinity}: CPUs {unknown} are not available to this process "
                f"(available: {available}); name some of those"
            )
        cpus, why = sorted(affinity), "engine.cpu_affinity"
    else:
        cpus = physical_cores(available)
        limit = cgroup_cpu_limit()
        why = f"one per physical core of {len(available)} available CPUs"
        if limit is not None and limit < len(cpus):
            cpus, why = cpus[:limit], f"{why}, capped by the cgroup quota of {limit}"
    if threads is not None:
        if threads > len(cpus):
            logger.warning(
                "engine.cpu_threads = %d exceeds the %d CPUs chosen (%s); threads will share cores",
                threads,
                len(cpus),
                why,
            )
        else:
            cpus = cpus[:threads]
        why = f"engine.cpu_threads = {threads}; {why}"
    return cpus, why


def bind_compute_threads(threads: int | None, affinity: list[int] | None) -> int:
    """Bind this process to the chosen CPUs and size torch's thread pool to them; returns the thread count."""
    import torch

    cpus, why = choose_cpus(threads, affinity)
    count = threads or len(cpus)
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(count)
    logger.debug("CPU compute: %d thread(s) on CPUs %s (%s)", count, ",".join(map(str, cpus)), why)
    return count
