"""One worker's NIXL agent: the KV-cache memory it registers, its layout, and the writes it posts.

A worker registers every KV-cache tensor of the transferable groups with its
agent (host memory as ``DRAM``, device memory as ``VRAM``), and describes them as
:class:`Region` s: a contiguous run of equal blocks. The attention backends'
default layout ``[2, num_blocks, ...]`` is two regions per layer (keys, values);
the block-first layouts of model-managed groups are one. A block of a request is
the same block index in every region of its group, so moving blocks ``a -> b``
of a group is one descriptor per region and block pair.

A write names the peer's regions (sent in its handshake) and pairs of block ids,
and carries a notification the peer's agent receives after the data.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from weft.contracts.kv_connector import block_axis

if TYPE_CHECKING:
    import torch

    from weft.contracts.kv_cache import KVCacheGroupSpec

logger = logging.getLogger("weft.nixl")


class Region(msgspec.Struct, frozen=True, array_like=True):
    """A contiguous run of ``num_blocks`` blocks of ``block_bytes`` each, from ``base``."""

    base: int
    block_bytes: int
    num_blocks: int


def import_nixl() -> tuple[Any, Any]:
    """``(nixl_agent, nixl_agent_config)`` from the installed NIXL build.

    The per-CUDA wheels come first: the ``nixl`` meta package picks its build by probing the
    driver, and picks one that does not import on a machine without a GPU.

    On a machine without InfiniBand devices, UCX's InfiniBand and RDMA-CM modules are not loaded
    (``UCX_MODULES``, unless the user set it): they have nothing to drive there, and with them NIXL
    1.5's wheel crashes every process at exit (a segfault in its bundled libnl-route).
    """
    if not os.path.isdir("/sys/class/infiniband") or not os.listdir("/sys/class/infiniband"):
        os.environ.setdefault("UCX_MODULES", "^ib,rdmacm")
    errors = []
    for module in ("nixl_cu12._api", "nixl_cu13._api", "nixl._api"):
        try:
            api = __import__(module, fromlist=["nixl_agent"])
        except ImportError as error:
            errors.append(f"{module}: {error}")
            continue
        return api.nixl_agent, api.nixl_agent_config
    raise ImportError(
        "weft-nixl needs NVIDIA's NIXL: pip install 'weft-nixl[cu12]' (or [cu13] for CUDA 13); " + "; ".join(errors)
    )


def group_regions(group: KVCacheGroupSpec, kv_caches: dict[str, torch.Tensor]) -> list[Region]:
    """The regions of every layer of ``group``, in layer order (see the module docstring).

    A group the attention backend owns must have its default layout (:func:`block_axis` checks it);
    a group the model manages puts the block first, whatever a block holds (DeepSeek V4's rings keep
    one vector per slot, less than ``page_size_bytes``): the two instances' handshake compares the
    bytes per block, so only the same layout on both sides is written.
    """
    regions = []
    for layer in group.layer_names:
        tensor = kv_caches[layer]
        if not tensor.is_contiguous():
            raise ValueError(f"weft-nixl: the KV cache of {layer} is not contiguous (shape {tuple(tensor.shape)})")
        axis = block_axis(group, layer, tensor) if group.spec.paged_attention else 0
        parts = [tensor] if axis == 0 else [tensor[0], tensor[1]]
        for part in parts:
            regions.append(Region(part.data_ptr(), part[0].numel() * part.element_size(), part.shape[0]))
    return regions


class KVAgent:
    """A NIXL agent that owns this worker's registered KV-cache memory."""

    def __init__(
        self,
        name: str,
        backends: Sequence[str],
        groups: Sequence[KVCacheGroupSpec],
        transferable: Sequence[int],
        kv_caches: dict[str, torch.Tensor],
    ) -> None:
        nixl_agent, nixl_agent_config = import_nixl()
        self.name = name
        # No progress thread: NIXL's spins without pause (a core per instance, which slowed a shared
        # 2-core machine tenfold). Transfers progress from the worker's calls instead: every step, and an
        # instance with a transfer in flight keeps stepping (a leased or parked request is work).
        self.agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=list(backends)))
        tensors = [kv_caches[layer] for index in transferable for layer in groups[index].layer_names]
        first = tensors[0]
        self.memory_type = "DRAM" if first.device.type == "cpu" else "VRAM"
        self.device_id = max(first.get_device(), 0)
        self.regions = [group_regions(groups[index], kv_caches) for index in transferable]
        """Per transferable group (in the order of ``transferable``), its regions."""
        self._device = first.device
        unique = list({tensor.data_ptr(): tensor for tensor in tensors}.values())
        self._registered = self.agent.register_memory(unique)
        self._peers: dict[bytes, str] = {}

    @property
    def metadata(self) -> bytes:
        return self.agent.get_agent_metadata()

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer agent's metadata (once per peer); returns its name."""
        name = self._peers.get(metadata)
        if name is None:
            name = self.agent.add_remote_agent(metadata)
            if isinstance(name, bytes):
                name = name.decode()
            self._peers[metadata] = name
        return name

    def write(
        self,
        peer: str,
        peer_regions: Sequence[Sequence[Region]],
        peer_device: int,
        pairs: Sequence[tuple[np.ndarray, np.ndarray]],
        notification: bytes,
    ) -> tuple[Any, int]:
        """A write of local blocks ``pairs[g][0]`` into the peer's blocks ``pairs[g][1]`` of each transferable
        group ``g``, to post with :meth:`post`; returns the transfer's handle and its bytes."""
        local_rows, remote_rows = [], []
        for local_regions, remote_regions, (local_blocks, remote_blocks) in zip(
            self.regions, peer_regions, pairs, strict=False
        ):
            if not len(local_blocks):
                continue
            for local, remote in zip(local_regions, remote_regions, strict=False):
                size = np.full(len(local_blocks), local.block_bytes, dtype=np.uint64)
                local_device = np.full(len(local_blocks), self.device_id, dtype=np.uint64)
                remote_device = np.full(len(local_blocks), peer_device, dtype=np.uint64)
                local_rows.append(np.stack([local.base + local_blocks * local.block_bytes, size, local_device], axis=1))
                remote_rows.append(
                    np.stack([remote.base + remote_blocks * remote.block_bytes, size, remote_device], axis=1)
                )
        local_descs = np.concatenate(local_rows).astype(np.uint64)
        remote_descs = np.concatenate(remote_rows).astype(np.uint64)
        handle = self.agent.initialize_xfer(
            "WRITE",
            self.agent.get_xfer_descs(local_descs, self.memory_type),
            self.agent.get_xfer_descs(remote_descs, self.memory_type),
            peer,
            notification,
        )
        return handle, int(local_descs[:, 1].sum())

    def wait_for_device(self) -> None:
        """Until the device finished the work queued so far (a no-op for host memory)."""
        if self._device.type == "cuda":
            import torch

            torch.cuda.synchronize(self._device)

    def post(self, handle: Any) -> str:
        """Start a write; ``DONE``, ``PROC`` (in progress) or ``ERR``."""
        return self.agent.transfer(handle)

    def state(self, handle: Any) -> str:
        return self.agent.check_xfer_state(handle)

    def release(self, handle: Any) -> None:
        self.agent.release_xfer_handle(handle)

    def notify(self, peer: str, message: bytes) -> None:
        """A notification with no data (a transfer with nothing to write)."""
        self.agent.send_notif(peer, message)

    def notifications(self) -> list[bytes]:
        """Notifications from every peer since the last call."""
        return [message for messages in self.agent.get_new_notifs().values() for message in messages]

    def close(self) -> None:
        for name in self._peers.values():
            try:
                self.agent.remove_remote_agent(name)
            except Exception:  # noqa: BLE001 - best effort at shutdown
                logger.debug("weft-nixl: removing peer %s failed", name, exc_info=True)
        self._peers.clear()
        if self._registered is not None:
            self.agent.deregister_memory(self._registered)
            self._registered = None
