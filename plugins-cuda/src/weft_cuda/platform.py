"""The CUDA platform. Its probe reads the NVIDIA driver's /proc files and never creates a CUDA context."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from weft.contracts.gpu_platform import DeviceScan, GpuPlatform


class CudaPlatform(GpuPlatform):
    """NVIDIA GPUs through CUDA; NCCL for tensor parallelism; CUDA graphs."""

    name: ClassVar[str] = "cuda"
    device_type: ClassVar[str] = "cuda"
    distributed_backend: ClassVar[str] = "nccl"
    supports_graph_capture: ClassVar[bool] = True
    vendor: ClassVar[str] = "NVIDIA"
    runtime: ClassVar[str] = "CUDA"
    torch_library: ClassVar[str] = "libtorch_cuda.so"
    visibility_variables: ClassVar[tuple[str, ...]] = ("CUDA_VISIBLE_DEVICES",)
    triton_backend: ClassVar[str | None] = "nvidia"

    @classmethod
    def scan(cls, root: Path) -> DeviceScan:
        version_file = root / "proc/driver/nvidia/version"
        device_files = sorted(path for path in (root / "dev").glob("nvidia[0-9]*") if path.name[6:].isdigit())
        if not version_file.exists() and not (root / "dev/nvidiactl").exists():
            return DeviceScan(driver=False, missing="/proc/driver/nvidia/version and /dev/nvidiactl are absent")
        driver = (
            version_file.read_text(errors="replace").splitlines()[0].strip() if version_file.exists() else "unknown"
        )
        # Sandboxed kernels (gVisor) may expose the device files without the driver's /proc entries.
        gpu_dirs = sorted((root / "proc/driver/nvidia/gpus").glob("*")) or device_files
        models = []
        for gpu in gpu_dirs:
            info = gpu / "information"
            text = info.read_text(errors="replace") if info.exists() else ""
            model = [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Model:")]
            models.append(model[0] if model else gpu.name)
        return DeviceScan(driver=True, devices=models, details={"driver": driver, "gpus": ", ".join(models)})

    def device_arch(self, index: int) -> str:
        import torch

        major, minor = torch.cuda.get_device_capability(index)
        return f"sm_{major}{minor}"

    def float8_unsupported(self) -> str | None:
        """fp8 GEMMs (``torch._scaled_mm``) and Triton's ``float8e4nv`` need compute capability 8.9 (Ada, Hopper)."""
        import torch

        major, minor = torch.cuda.get_device_capability()
        if (major, minor) >= (8, 9):
            return None
        return f"this platform is cuda with a {torch.cuda.get_device_name()} of compute capability {major}.{minor}"

    def communicator(self, group: Any, device: Any) -> Any:
        """NCCL, with one-shot all-reduces over NVLink peer memory that decode graphs capture
        (weft_cuda.communicator)."""
        from weft_cuda.communicator import CudaCommunicator

        return CudaCommunicator(group, device)
