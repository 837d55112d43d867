"""The CPU platform: always available, the lowest priority under ``use.platform = "auto"``."""

from __future__ import annotations

import os
from typing import ClassVar

from weft.contracts.platform import MemoryInfo, Platform, PlatformProbe
from weft.host import usable_cpus


class CpuPlatform(Platform):
    """Runs on the host CPU with torch; gloo for tensor parallelism."""

    name: ClassVar[str] = "cpu"
    device_type: ClassVar[str] = "cpu"
    distributed_backend: ClassVar[str] = "gloo"
    default_attention: ClassVar[str] = "torch"
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16")

    @classmethod
    def probe(cls) -> PlatformProbe:
        cores = usable_cpus()
        return PlatformProbe(
            available=True,
            reason=f"host CPU, {cores} usable cores",
            priority=0,
            device_count=0,
            details={"cores": str(cores)},
        )

    def memory_info(self, index: int = 0) -> MemoryInfo:
        total = available = 0
        try:
            with open("/proc/meminfo") as meminfo:
                values = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in meminfo}
            total, available = values["MemTotal"], values.get("MemAvailable", values["MemFree"])
        except (OSError, KeyError, ValueError, IndexError):
            pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
            total = available = pages * page_size
        return MemoryInfo(free=available, total=total)
