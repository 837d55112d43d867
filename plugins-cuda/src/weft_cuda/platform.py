"""The CUDA platform. Its probe reads the NVIDIA driver's /proc files and never creates a CUDA context."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from weft.contracts.platform import (
    EngineDefaults,
    MemoryInfo,
    Platform,
    PlatformProbe,
    torch_has_library,
    visible_device_count,
)


def probe_nvidia(root: Path = Path("/")) -> PlatformProbe:
    """Probe the machine whose filesystem is at ``root`` for NVIDIA GPUs usable by torch."""
    version_file = root / "proc/driver/nvidia/version"
    device_files = sorted(path for path in (root / "dev").glob("nvidia[0-9]*") if path.name[6:].isdigit())
    if not version_file.exists() and not (root / "dev/nvidiactl").exists():
        return PlatformProbe(available=False, reason="no NVIDIA driver (/proc/driver/nvidia/version and /dev/nvidiactl are absent)")
    driver = version_file.read_text(errors="replace").splitlines()[0].strip() if version_file.exists() else "unknown"
    # Sandboxed kernels (gVisor) may expose the device files without the driver's /proc entries.
    gpu_dirs = sorted((root / "proc/driver/nvidia/gpus").glob("*")) or device_files
    models = []
    for gpu in gpu_dirs:
        info = gpu / "information"
        text = info.read_text(errors="replace") if info.exists() else ""
        models.extend(line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Model:"))
    count = visible_device_count(len(gpu_dirs), "CUDA_VISIBLE_DEVICES")
    details = {"driver": driver, "gpus": ", ".join(models) or str(len(gpu_dirs))}
    if count == 0:
        return PlatformProbe(available=False, reason="NVIDIA driver present but no visible GPU", details=details)
    if not torch_has_library("libtorch_cuda.so"):
        return PlatformProbe(
            available=False,
            reason="NVIDIA GPU found but the installed torch has no CUDA support; install a CUDA build of torch",
            device_count=count,
            details=details,
        )
    return PlatformProbe(
        available=True, reason=f"{count} NVIDIA GPU(s)", priority=100, device_count=count, details=details
    )


class CudaPlatform(Platform):
    """NVIDIA GPUs through CUDA; NCCL for tensor parallelism."""

    name: ClassVar[str] = "cuda"
    device_type: ClassVar[str] = "cuda"
    distributed_backend: ClassVar[str] = "nccl"
    default_attention: ClassVar[str] = "triton"
    supported_dtypes: ClassVar[tuple[str, ...]] = ("bfloat16", "float16", "float32")
    supports_graph_capture: ClassVar[bool] = True

    @classmethod
    def probe(cls) -> PlatformProbe:
        return probe_nvidia()

    def memory_info(self, index: int = 0) -> MemoryInfo:
        import torch

        free, total = torch.cuda.mem_get_info(index)
        return MemoryInfo(free=free, total=total)

    def engine_defaults(self) -> EngineDefaults:
        """Sized by device memory: an H100/H200-class GPU (70 GiB and more) batches 512 sequences and
        16,384 tokens a step (prefill chunks that keep the matmuls at their full rate); the host prepares
        step N+1 while the GPU runs step N."""
        total = self.memory_info().total
        if total >= 70 << 30:
            return EngineDefaults(max_num_seqs=512, max_num_batched_tokens=16384, async_scheduling=True)
        if total >= 30 << 30:
            return EngineDefaults(max_num_seqs=256, max_num_batched_tokens=4096, async_scheduling=True)
        return EngineDefaults(max_num_seqs=128, max_num_batched_tokens=2048, async_scheduling=True)

    def communicator(self, group: Any, device: Any) -> Any:
        """NCCL, with one-shot all-reduces over NVLink peer memory that decode graphs capture (weft_cuda.communicator)."""
        from weft_cuda.communicator import CudaCommunicator

        return CudaCommunicator(group, device)

    def capture_graph(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        import torch

        if getattr(self, "_graph_pool", None) is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        # Run once outside the graph on a side stream: lazy initialisation (cuBLAS
        # workspaces, kernel loading) must not happen during capture.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            outputs = fn()

        def replay() -> Any:
            graph.replay()
            return outputs

        return replay
