"""The Intel XPU platform. Its probe reads DRM devices in sysfs and never initialises Level Zero.

torch's ``xpu`` device module gives devices, memory and streams; XCCL (oneCCL) serves tensor
parallelism. Graph capture is not offered: decode runs eagerly. weft-triton's kernels run where
Intel's XPU Triton backend (``pytorch-triton-xpu``, which XPU builds of torch bring) is installed;
otherwise core's torch references and attention backend are chosen.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from weft.contracts.gpu_platform import DeviceScan, GpuPlatform

INTEL_VENDOR = "0x8086"
DISPLAY_CLASS_PREFIX = "0x03"


class XpuPlatform(GpuPlatform):
    """Intel GPUs through torch's XPU device; XCCL for tensor parallelism; no graph capture."""

    name: ClassVar[str] = "xpu"
    device_type: ClassVar[str] = "xpu"
    distributed_backend: ClassVar[str] = "xccl"
    supports_graph_capture: ClassVar[bool] = False
    vendor: ClassVar[str] = "Intel"
    runtime: ClassVar[str] = "XPU"
    torch_library: ClassVar[str] = "libtorch_xpu.so"
    visibility_variables: ClassVar[tuple[str, ...]] = ("ZE_AFFINITY_MASK",)
    triton_backend: ClassVar[str | None] = "intel"

    @classmethod
    def scan(cls, root: Path) -> DeviceScan:
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
            return DeviceScan(driver=False, missing="no Intel renderD* device in /sys/class/drm")
        return DeviceScan(driver=True, devices=devices, details={"devices": ", ".join(devices)})

    def device_arch(self, index: int) -> str:
        import torch

        return torch.xpu.get_device_properties(index).name
