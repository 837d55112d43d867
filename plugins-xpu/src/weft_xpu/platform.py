"""The Intel XPU platform. Its probe reads DRM devices in sysfs and never initialises Level Zero."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from weft.contracts.platform import MemoryInfo, Platform, PlatformProbe, torch_has_library, visible_device_count

INTEL_VENDOR = "0x8086"
DISPLAY_CLASS_PREFIX = "0x03"


def probe_intel(root: Path = Path("/")) -> PlatformProbe:
    """Probe the machine whose filesystem is at ``root`` for Intel GPUs usable by torch."""
    devices = []
    for render in sorted((root / "sys/class/drm").glob("renderD*")):
        vendor, device_class = render / "device/vendor", render / "device/class"
        if not vendor.exists() or vendor.read_text().strip() != INTEL_VENDOR:
            continue
        if device_class.exists() and not device_class.read_text().strip().startswith(DISPLAY_CLASS_PREFIX):
            continue
        device_id = render / "device/device"
        devices.append(device_id.read_text().strip() if device_id.exists() else render.name)
    if not devices:
        return PlatformProbe(available=False, reason="no Intel GPU (no Intel renderD* device in /sys/class/drm)")
    count = visible_device_count(len(devices), "ZE_AFFINITY_MASK")
    details = {"devices": ", ".join(devices)}
    if count == 0:
        return PlatformProbe(available=False, reason="Intel GPU present but hidden by ZE_AFFINITY_MASK", details=details)
    if not torch_has_library("libtorch_xpu.so"):
        return PlatformProbe(
            available=False,
            reason="Intel GPU found but the installed torch has no XPU support; install an XPU build of torch",
            device_count=count,
            details=details,
        )
    return PlatformProbe(available=True, reason=f"{count} Intel GPU(s)", priority=100, device_count=count, details=details)


class XpuPlatform(Platform):
    """Intel GPUs through torch's XPU device; XCCL for tensor parallelism."""

    name: ClassVar[str] = "xpu"
    device_type: ClassVar[str] = "xpu"
    distributed_backend: ClassVar[str] = "xccl"
    default_attention: ClassVar[str] = "torch"
    supported_dtypes: ClassVar[tuple[str, ...]] = ("bfloat16", "float16", "float32")

    @classmethod
    def probe(cls) -> PlatformProbe:
        return probe_intel()

    def memory_info(self, index: int = 0) -> MemoryInfo:
        import torch

        free, total = torch.xpu.mem_get_info(index)
        return MemoryInfo(free=free, total=total)
