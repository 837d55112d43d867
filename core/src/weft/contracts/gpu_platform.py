"""The base of GPU platforms (CUDA, ROCm, XPU): what they share, so each plugin holds only what differs.

A GPU platform plugin subclasses :class:`GpuPlatform`, sets the class attributes
that name its vendor, runtime and torch build, and implements two methods:

* :meth:`GpuPlatform.scan`: read the machine's files under a root (``/proc``,
  ``/sys``, ``/dev``) for the devices its driver exposes, without initialising a
  device runtime. Tests point it at a fabricated tree.
* :meth:`GpuPlatform.device_arch`: the architecture name of a device
  (``sm_90``, ``gfx950``), read from torch.

The base turns a scan into the :class:`~weft.contracts.platform.PlatformProbe`
(visibility variables, a torch build with the platform's library) and gives,
through torch's device module (``torch.cuda``, ``torch.xpu``): device
selection, memory, dtypes (bfloat16 where the
device has it), engine defaults sized by device memory, graph capture through
torch's CUDA-graph API (CUDA graphs, and HIP graphs on ROCm, whose torch build
uses the ``cuda`` device type), and the default attention backend: ``triton``
where the platform's Triton backend is installed, else core's ``torch``.

Like the rest of :mod:`weft.contracts.platform`, importing this module imports
neither torch nor a device runtime.
"""

from __future__ import annotations

import importlib.util
from abc import abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar

import msgspec

from weft.contracts.platform import (
    EngineDefaults,
    MemoryInfo,
    Platform,
    PlatformProbe,
    torch_has_library,
    visible_device_count,
)

if TYPE_CHECKING:
    import torch


class DeviceScan(msgspec.Struct, frozen=True):
    """What a GPU platform's :meth:`GpuPlatform.scan` found in the machine's files."""

    driver: bool
    """Whether the vendor's driver is present at all."""
    devices: list[str] = []
    """One entry per device the driver exposes (a model name, an architecture, a PCI id)."""
    details: dict[str, str] = {}
    """Facts for ``weft plugins doctor`` (driver version, architectures)."""
    missing: str = ""
    """When ``driver`` is false: which files were looked for, in words."""


class GpuPlatformOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    arch: Annotated[
        str,
        msgspec.Meta(
            description="the architecture kernel launch policies tune for (gfx950, sm_90); 'auto' reads it from "
            "the device. Set it to run another architecture's launch policy on this device (every policy gives "
            "the same results)"
        ),
    ] = "auto"


def triton_backend_installed(backend: str | None) -> bool:
    """Whether the installed ``triton`` has the compiler backend ``backend`` (``nvidia``, ``amd``, ``intel``).

    Reads the package's folder: importing triton is left to the kernels that run. CUDA's triton
    (PyPI) ships ``nvidia`` and ``amd``; ROCm's torch brings ``pytorch-triton-rocm`` (``amd``); XPU's
    brings ``pytorch-triton-xpu`` (``intel``).
    """
    if not backend:
        return False
    spec = importlib.util.find_spec("triton")
    if spec is None or not spec.submodule_search_locations:
        return False
    return any((Path(location) / "backends" / backend).is_dir() for location in spec.submodule_search_locations)


class _DefaultAttention:
    """``default_attention`` of a GPU platform: ``triton`` where its Triton backend is installed, else ``torch``.

    A descriptor, so that the class attribute itself answers (``weft plugins doctor`` reads it on the class)."""

    def __get__(self, instance: Any, owner: type[GpuPlatform]) -> str:
        return "triton" if triton_backend_installed(owner.triton_backend) else "torch"


class GpuPlatform(Platform):
    """A GPU with a torch device module; subclasses name the vendor and implement :meth:`scan` and
    :meth:`device_arch`."""

    Options: ClassVar[type[msgspec.Struct]] = GpuPlatformOptions

    vendor: ClassVar[str]
    """The vendor in messages (``"NVIDIA"``)."""
    runtime: ClassVar[str]
    """The torch build's runtime in messages (``"CUDA"``, ``"ROCm"``, ``"XPU"``)."""
    torch_library: ClassVar[str]
    """The library a torch build for this platform ships (``"libtorch_cuda.so"``)."""
    visibility_variables: ClassVar[tuple[str, ...]]
    """Environment variables that hide devices, in the order the runtime reads them."""
    triton_backend: ClassVar[str | None] = None
    """The Triton compiler backend for this device (``"nvidia"``, ``"amd"``, ``"intel"``); None if none."""

    supported_dtypes: ClassVar[tuple[str, ...]] = ("bfloat16", "float16", "float32")
    default_attention: ClassVar[str] = _DefaultAttention()  # type: ignore[assignment]

    @classmethod
    @abstractmethod
    def scan(cls, root: Path) -> DeviceScan:
        """The devices the driver exposes in the machine whose filesystem is at ``root``; reads files only."""

    @abstractmethod
    def device_arch(self, index: int) -> str:
        """The architecture name of device ``index`` (``sm_90``, ``gfx950``); may initialise the runtime."""

    @classmethod
    def probe(cls) -> PlatformProbe:
        return cls.probe_root(Path("/"))

    @classmethod
    def probe_root(cls, root: Path) -> PlatformProbe:
        """The probe of the machine whose filesystem is at ``root``."""
        scan = cls.scan(root)
        if not scan.driver:
            return PlatformProbe(available=False, reason=f"no {cls.vendor} GPU driver ({scan.missing})")
        count = visible_device_count(len(scan.devices), *cls.visibility_variables)
        if count == 0:
            hidden = " or ".join(cls.visibility_variables)
            reason = f"{cls.vendor} driver present but no visible GPU"
            if scan.devices:
                reason += f" ({len(scan.devices)} hidden by {hidden})"
            return PlatformProbe(available=False, reason=reason, details=scan.details)
        if not torch_has_library(cls.torch_library):
            return PlatformProbe(
                available=False,
                reason=f"{cls.vendor} GPU found but the installed torch has no {cls.runtime} support; "
                f"install a {cls.runtime} build of torch",
                device_count=count,
                details=scan.details,
            )
        return PlatformProbe(
            available=True,
            reason=f"{count} {cls.vendor} GPU(s)",
            priority=100,
            device_count=count,
            details=scan.details,
        )

    @property
    def device_module(self) -> Any:
        """torch's module for this device type (``torch.cuda``, ``torch.xpu``)."""
        import torch

        return torch.get_device_module(self.device_type)

    def select_device(self, index: int) -> torch.device:
        self.device_module.set_device(index)
        return self.device(index)

    def memory_info(self, index: int = 0) -> MemoryInfo:
        free, total = self.device_module.mem_get_info(index)
        return MemoryInfo(free=free, total=total)

    def launch_arch(self, device: torch.device) -> str:
        """The architecture kernel launch policies tune for on ``device``: the ``arch`` option when set,
        else the device's; ``""`` for a device of another type (the CPU under Triton's interpreter)."""
        if self.options.arch != "auto":
            return self.options.arch
        if device.type != self.device_type:
            return ""
        return self.device_arch(device.index if device.index is not None else self.device_module.current_device())

    def default_dtype(self) -> str:
        """bfloat16 where the device computes in it, else the next supported dtype (float16)."""
        if self.supported_dtypes[0] == "bfloat16" and not self.device_module.is_bf16_supported():
            return self.supported_dtypes[1]
        return self.supported_dtypes[0]

    def engine_defaults(self) -> EngineDefaults:
        """Sized by device memory: a 70 GiB and larger device (H100/H200, MI300X/MI355X, Max 1550) batches 512
        sequences and 16,384 tokens a step (prefill chunks that keep the matmuls at their full rate); the host
        prepares step N+1 while the device runs step N."""
        total = self.memory_info().total
        if total >= 70 << 30:
            return EngineDefaults(max_num_seqs=512, max_num_batched_tokens=16384, async_scheduling=True)
        if total >= 30 << 30:
            return EngineDefaults(max_num_seqs=256, max_num_batched_tokens=4096, async_scheduling=True)
        return EngineDefaults(max_num_seqs=128, max_num_batched_tokens=2048, async_scheduling=True)

    def capture_graph(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        """Capture through torch's CUDA-graph API: CUDA graphs, and HIP graphs on ROCm."""
        if not self.supports_graph_capture:
            return super().capture_graph(fn)
        import torch

        if getattr(self, "_graph_pool", None) is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        # Run once outside the graph on a side stream: lazy initialisation (BLAS
        # workspaces, kernel loading) must not happen during capture. One side stream for every
        # capture, warm-up and capture alike: cuBLAS keeps a workspace per stream until the process
        # ends, and torch.cuda.graph makes a new stream for each graph unless given one (33 graphs
        # held 1 GiB of workspaces after close()).
        if getattr(self, "_capture_stream", None) is None:
            self._capture_stream = torch.cuda.Stream()
        side = self._capture_stream
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool, stream=side):
            outputs = fn()

        def replay() -> Any:
            graph.replay()
            return outputs

        return replay

    def release_memory(self) -> None:
        """Drop the graphs' shared pool (the pool lives while a graph captured into it does) and the capture
        stream, and hand the allocator's cached blocks back to the driver. cuBLAS's workspace of the capture
        stream stays (torch frees workspaces only all at once, which would pull one from under another engine's
        graphs in the same process)."""
        self._graph_pool = None
        self._capture_stream = None
        self.device_module.empty_cache()  # nothing to do where the device was never used
