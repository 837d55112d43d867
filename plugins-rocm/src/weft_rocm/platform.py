"""The ROCm platform. Its probe reads the amdkfd topology in sysfs and never initialises HIP."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from weft.contracts.platform import MemoryInfo, Platform, PlatformProbe, torch_has_library, visible_device_count


def gfx_name(target_version: int) -> str:
    """amdkfd's ``gfx_target_version`` (90500) as an LLVM target name (gfx950)."""
    major, minor, stepping = target_version // 10000, (target_version // 100) % 100, target_version % 100
    return f"gfx{major}{minor:x}{stepping:x}"


def probe_amd(root: Path = Path("/")) -> PlatformProbe:
    """Probe the machine whose filesystem is at ``root`` for AMD GPUs usable by torch."""
    if not (root / "dev/kfd").exists():
        return PlatformProbe(available=False, reason="no AMD GPU driver (/dev/kfd is absent)")
    architectures = []
    for properties in sorted((root / "sys/class/kfd/kfd/topology/nodes").glob("*/properties")):
        fields = dict(line.split(None, 1) for line in properties.read_text(errors="replace").splitlines() if " " in line)
        target = int(fields.get("gfx_target_version", "0").strip() or 0)
        if target:
            architectures.append(gfx_name(target))
    count = visible_device_count(len(architectures), "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")
    details = {"architectures": ", ".join(architectures)}
    if count == 0:
        return PlatformProbe(available=False, reason="amdkfd present but no visible GPU", details=details)
    if not torch_has_library("libtorch_hip.so"):
        return PlatformProbe(
            available=False,
            reason="AMD GPU found but the installed torch has no ROCm support; install a ROCm build of torch",
            device_count=count,
            details=details,
        )
    return PlatformProbe(available=True, reason=f"{count} AMD GPU(s)", priority=100, device_count=count, details=details)


class RocmPlatform(Platform):
    """AMD GPUs through ROCm/HIP (torch's ``cuda`` device type); RCCL through the nccl backend."""

    name: ClassVar[str] = "rocm"
    device_type: ClassVar[str] = "cuda"
    distributed_backend: ClassVar[str] = "nccl"
    default_attention: ClassVar[str] = "torch"
    supported_dtypes: ClassVar[tuple[str, ...]] = ("bfloat16", "float16", "float32")

    @classmethod
    def probe(cls) -> PlatformProbe:
        return probe_amd()

    def memory_info(self, index: int = 0) -> MemoryInfo:
        import torch

        free, total = torch.cuda.mem_get_info(index)
        return MemoryInfo(free=free, total=total)
