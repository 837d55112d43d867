"""The ROCm platform. Its probe reads the amdkfd topology in sysfs and never initialises HIP.

ROCm's torch build uses the ``cuda`` device type: ``torch.cuda`` drives HIP, RCCL serves the
``nccl`` distributed backend, and ``torch.cuda.CUDAGraph`` captures HIP graphs, so everything but
the probe and the architecture name comes from :class:`~weft.contracts.gpu_platform.GpuPlatform`.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from weft.contracts.gpu_platform import DeviceScan, GpuPlatform


def gfx_name(target_version: int) -> str:
    """amdkfd's ``gfx_target_version`` (90500) as an LLVM target name (gfx950)."""
    major, minor, stepping = target_version // 10000, (target_version // 100) % 100, target_version % 100
    return f"gfx{major}{minor:x}{stepping:x}"


class RocmPlatform(GpuPlatform):
    """AMD GPUs through ROCm/HIP (torch's ``cuda`` device type); RCCL through the nccl backend; HIP graphs."""

    name: ClassVar[str] = "rocm"
    device_type: ClassVar[str] = "cuda"
    distributed_backend: ClassVar[str] = "nccl"
    supports_graph_capture: ClassVar[bool] = True
    vendor: ClassVar[str] = "AMD"
    runtime: ClassVar[str] = "ROCm"
    torch_library: ClassVar[str] = "libtorch_hip.so"
    visibility_variables: ClassVar[tuple[str, ...]] = (
        "HIP_VISIBLE_DEVICES",
        "ROCR_VISIBLE_DEVICES",
        "CUDA_VISIBLE_DEVICES",
    )
    triton_backend: ClassVar[str | None] = "amd"

    @classmethod
    def scan(cls, root: Path) -> DeviceScan:
        if not (root / "dev/kfd").exists():
            return DeviceScan(driver=False, missing="/dev/kfd is absent")
        architectures = []
        # Node 0.. in numeric order (node 10 after node 9); CPU nodes report gfx_target_version 0.
        nodes = (root / "sys/class/kfd/kfd/topology/nodes").glob("*/properties")
        for properties in sorted(nodes, key=lambda path: int(path.parent.name) if path.parent.name.isdigit() else -1):
            fields = dict(
                line.split(None, 1) for line in properties.read_text(errors="replace").splitlines() if " " in line
            )
            target = int(fields.get("gfx_target_version", "0").strip() or 0)
            if target:
                architectures.append(gfx_name(target))
        return DeviceScan(driver=True, devices=architectures, details={"architectures": ", ".join(architectures)})

    def device_arch(self, index: int) -> str:
        import torch

        # "gfx950:sramecc+:xnack-": the target, then its feature flags.
        return torch.cuda.get_device_properties(index).gcnArchName.split(":")[0]
