"""The platform slot: one hardware platform per engine (CPU, CUDA, ROCm, XPU, ...).

``use.platform = "auto"`` probes every enabled platform and picks the available
one with the highest :attr:`PlatformProbe.priority`; a tie between two
available platforms is an error asking the user to name one. ``use.platform =
"<name>"`` selects a platform directly, and it must then report itself
available.

Discovery rules a platform must keep:

* importing the module that holds the platform class imports neither torch
  nor a device runtime;
* :meth:`Platform.probe` initialises no device runtime (no CUDA context, no
  HIP, no Level Zero): it reads files, environment and driver metadata only, so
  it is safe to call in a process that will later fork workers.

Everything else on the class may import torch lazily.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec

from weft.contracts.parallel import Communicator
from weft.contracts.plugin import PluginBase

if TYPE_CHECKING:
    import torch


class PlatformProbe(msgspec.Struct, frozen=True):
    """What a platform found about the machine it runs on."""

    available: bool
    """Whether this platform can run the engine here."""
    reason: str
    """Why it is or is not available, in words a user can act on."""
    priority: int = 0
    """Higher wins under ``use.platform = "auto"``. CPU uses 0; accelerators 100."""
    device_count: int = 0
    """Devices found (0 for CPU)."""
    details: dict[str, str] = {}
    """Free-form facts for ``weft plugins doctor`` (driver version, architectures)."""


class EngineDefaults(msgspec.Struct, frozen=True):
    """Engine options sized for a platform's device, used where ``weft.toml`` leaves them unset."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    async_scheduling: bool = False
    """Whether scheduling the next step while one runs gains anything (a device that computes
    while the host works)."""
    decode_overlap: bool = False
    """Whether large captured decode steps run as two nano-batches, one's attention beside the other's GEMMs
    (``engine.decode_overlap``): only where a device run measured it faster than the plain step (added in core API
    1.16)."""


class MemoryInfo(msgspec.Struct, frozen=True):
    """Memory of one device, in bytes."""

    free: int
    total: int


FLOAT8_REQUIREMENT = "a CUDA GPU with compute capability >= 8.9 (Ada Lovelace, Hopper or newer)"
"""What fp8 weights and an fp8 KV cache need (:meth:`Platform.float8_unsupported`), in words for errors."""


class Platform(PluginBase):
    """A hardware platform: device, dtypes, memory, graphs, distributed backend.

    The engine instantiates the selected platform once, with its validated
    options: ``Platform(options)``.
    """

    name: ClassVar[str]
    """The entry-point name this platform registers under (``"cuda"``)."""

    device_type: ClassVar[str]
    """The torch device type (``"cpu"``, ``"cuda"``, ``"xpu"``; ROCm uses ``"cuda"``)."""

    distributed_backend: ClassVar[str]
    """The torch.distributed backend for tensor parallelism (``"gloo"``, ``"nccl"``, ``"xccl"``)."""

    default_attention: ClassVar[str]
    """The attention backend chosen when ``use.attention = "auto"``."""

    supported_dtypes: ClassVar[tuple[str, ...]]
    """Runtime dtypes by torch name, preferred first (``("bfloat16", "float16")``)."""

    supports_graph_capture: ClassVar[bool] = False
    """Whether :meth:`capture_graph` works (CUDA graphs, HIP graphs)."""

    def __init__(self, options: msgspec.Struct | None = None) -> None:
        self.options = options if options is not None else self.Options()

    @classmethod
    @abstractmethod
    def probe(cls) -> PlatformProbe:
        """Say whether this platform is usable here, without initialising a device runtime."""

    def device(self, index: int = 0) -> torch.device:
        """The torch device for local device ``index``."""
        import torch

        return torch.device(self.device_type, index) if self.device_type != "cpu" else torch.device("cpu")

    def select_device(self, index: int) -> torch.device:
        """Make local device ``index`` this process's current device and return it (a worker process
        owns one device). The CPU has nothing to select (added in core API 1.2)."""
        return self.device(index)

    @abstractmethod
    def memory_info(self, index: int = 0) -> MemoryInfo:
        """Free and total memory of device ``index``; the engine sizes the KV cache from it."""

    def engine_defaults(self) -> EngineDefaults:
        """Scheduler sizes and options for this platform's device; may query the device.

        The base class gives CPU-sized values; accelerator platforms size them from the device.
        """
        return EngineDefaults()

    def graph_batch_sizes(self, max_num_seqs: int) -> list[int]:
        """Decode batch sizes captured as graphs where ``engine.graph_batch_sizes`` is unset: 1, 2, 4, 8,
        then every multiple of 8 up to ``max_num_seqs`` (and ``max_num_seqs`` itself); none on a platform
        that captures no graphs (added in core API 1.8)."""
        if not self.supports_graph_capture:
            return []
        sizes = [size for size in (1, 2, 4) if size < max_num_seqs]
        sizes += list(range(8, max_num_seqs + 1, 8))
        return sorted(set(sizes) | {max_num_seqs})

    def default_dtype(self) -> str:
        """The dtype used when ``engine.dtype = "auto"``."""
        return self.supported_dtypes[0]

    def communicator(self, group: Any, device: torch.device) -> Any:
        """The collectives tensor-parallel layers run over ``group`` (a torch.distributed process group).

        Default: :class:`weft.contracts.parallel.Communicator`, plain torch.distributed calls on
        :attr:`distributed_backend`. A platform returns a subclass with faster collectives; one whose
        ``can_capture(dtype)`` is true lets decode graphs capture them (added in core API 1.4).
        """
        return Communicator(group, device)

    def capture_graph(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        """Capture ``fn()`` into a replayable graph; returns a callable that replays it.

        ``fn`` reads and writes only tensors that outlive the graph (the model
        runner's static input buffers, the KV cache); calling the returned
        function re-runs the captured work on their current contents and returns
        the tensors ``fn`` returned at capture, now holding the new results.
        Graphs captured by one platform instance share one memory pool, so
        capture the largest batch first. Only called when
        :attr:`supports_graph_capture` is true.
        """
        raise NotImplementedError(f"platform {self.name!r} does not capture graphs")

    def float8_unsupported(self) -> str | None:
        """None where the devices compute float8_e4m3fn (fp8 weights through ``torch._scaled_mm``, an fp8 KV cache
        through Triton's fp8 conversions), else what the platform is instead, for the error that refuses
        ``engine.quantization = "fp8"`` or ``engine.kv_cache_dtype = "fp8"`` (``"this platform is cpu"``); the
        requirement itself is :data:`FLOAT8_REQUIREMENT`. Default: unsupported. Added in core API 1.15."""
        return f"this platform is {self.name}"

    def release_memory(self) -> None:
        """Return what the platform keeps of a closed worker's device memory: its graphs' memory pool, the
        allocator's cached blocks. Called once the worker dropped its model, KV cache and graphs (a closed ``LLM``,
        an engine that failed to start), so the memory is free at once, not when the garbage collector runs.
        Default: nothing (the CPU allocator caches nothing). Added in core API 1.14."""


def torch_has_library(library: str) -> bool:
    """Whether the installed torch ships ``library`` (``"libtorch_cuda.so"``), without importing torch.

    Platform probes use it to tell a CUDA, ROCm or XPU build of torch from a CPU one.
    """
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False
    return any((Path(location) / "lib" / library).exists() for location in spec.submodule_search_locations)


def visible_device_count(found: int, *variables: str) -> int:
    """Devices left visible by the first set variable of ``variables`` (``CUDA_VISIBLE_DEVICES``)."""
    import os

    for variable in variables:
        value = os.environ.get(variable)
        if value is None:
            continue
        items = [item for item in value.split(",") if item.strip()]
        if not items or items[0].strip() == "-1":
            return 0
        return min(found, len(items))
    return found
