"""The "weight-cache" loader: an engine maps its weights from the device's daemon instead of reading disk.

Resolution is the plain ``safetensors`` loader's (folders, repo ids, downloads: the engine still
reads the config and tokenizer files, and the shards' headers for the key). The loader asks the
daemon on this worker's device for the worker's :class:`~weft_weight_cache.protocol.CacheKey`; on
``ok`` it maps the arena, which holds this rank's parts of the tensors, and yields each tensor as a
:class:`~weft_weight_cache.reads.ResidentSlice` answering the reads the model family makes of it
(whole tensors to a family that reads whole tensors); the lease is released once the model holds
its own copy. Any other answer (a mismatch, an error, no daemon, a socket that fails the safety
checks) is logged with its reason and the weights come from disk through a copy of the worker's
load config naming ``disk_loader``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar

import msgspec

from weft.api import SafetensorsLoader
from weft.contracts.loader import ModelSource, WeightSlice
from weft_weight_cache.protocol import DEFAULT_MAX_FRAME_BYTES, Error, FrameError, Mismatch, Ok, TensorEntry
from weft_weight_cache.safety import SafetyError, default_socket_dir

if TYPE_CHECKING:  # torch loads where weights are mapped: weft serve's API process resolves with this loader
    import torch

logger = logging.getLogger("weft.weight_cache")


class WeightCacheOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    socket_dir: (
        Annotated[
            str,
            msgspec.Meta(
                description="folder of the daemons' sockets (0700, yours); default $XDG_RUNTIME_DIR/"
                "weft-weight-cache, else /tmp/weft-weight-cache-<uid>"
            ),
        ]
        | None
    ) = None
    disk_loader: Annotated[
        str, msgspec.Meta(description="loader the daemon reads with, and the engine falls back to")
    ] = "safetensors"
    rendezvous_port: Annotated[
        int,
        msgspec.Meta(
            ge=1,
            le=65535,
            description="TCP port of the daemons' own process group (several "
            "daemons): the same on every node, never the engine's",
        ),
    ] = 29650
    max_frame_bytes: Annotated[int, msgspec.Meta(ge=1024, description="largest protocol frame accepted")] = (
        DEFAULT_MAX_FRAME_BYTES
    )
    timeout: Annotated[float, msgspec.Meta(gt=0, description="seconds to wait for a daemon's reply")] = 60.0


def socket_dir(options: WeightCacheOptions) -> Path:
    return Path(options.socket_dir).expanduser() if options.socket_dir else default_socket_dir()


class WeightCacheLoader(SafetensorsLoader):
    """Weights mapped from a `weft weights serve` daemon (shared memory, CUDA IPC); disk when it cannot serve."""

    Options = WeightCacheOptions
    priority: ClassVar[int] = -20
    """Only when named: ``use.loader = "weight-cache"``."""

    def iter_weight_slices(self, source: ModelSource, dtype: str) -> Iterator[tuple[str, WeightSlice]]:
        """This rank's parts from the daemon, each tensor answering the reads its model family makes of it."""
        from weft_weight_cache.reads import ResidentSlice

        lease = self._lease(source, dtype)
        if isinstance(lease, str):
            yield from self._from_disk(source, dtype, lease, slices=True)
            return
        with lease:
            for entry, views in lease.parts():
                yield entry.name, ResidentSlice(entry, views)

    def iter_weights(self, source: ModelSource, dtype: str) -> Iterator[tuple[str, torch.Tensor]]:
        """Whole tensors from a daemon that holds them whole (the daemon of a family that reads whole tensors)."""
        lease = self._lease(source, dtype)
        if isinstance(lease, _Lease) and not lease.whole:
            lease.close()
            lease = f"the daemon at {lease.path} holds parts of tensors, and this model family reads whole tensors"
        if isinstance(lease, str):
            yield from self._from_disk(source, dtype, lease, slices=False)
            return
        with lease:
            for entry, views in lease.parts():
                yield entry.name, views[0]

    def _lease(self, source: ModelSource, dtype: str) -> _Lease | str:
        """The weights mapped from this worker's daemon, or why not (logged before the engine reads disk)."""
        from weft_weight_cache.client import WeightCacheClient
        from weft_weight_cache.key import cache_key, device_identity, socket_name
        from weft_weight_cache.storage import map_arena

        options: WeightCacheOptions = self.options
        load = self.load_config
        identity = device_identity(load.device, load.local_rank)
        path = socket_dir(options) / socket_name(identity)
        try:
            if not path.is_symlink() and not path.exists():
                raise FileNotFoundError(path)
            client = WeightCacheClient(path, options.timeout, options.max_frame_bytes)
        except (FileNotFoundError, ConnectionRefusedError):
            return f"no daemon serves {identity} (nothing listens at {path}; start one with `weft weights serve`)"
        except (OSError, SafetyError) as error:
            return f"cannot use {path}: {error}"
        try:
            key = cache_key(source, load, dtype)
            reply, fds = client.get_state(key, identity)
            if isinstance(reply, Ok):
                try:
                    block = map_arena(reply.arena, fds, load.device)
                finally:
                    for fd in fds:
                        os.close(fd)
                logger.info(
                    "weight cache: mapping %d tensors (%.1f MiB) from %s",
                    len(reply.tensors),
                    reply.arena.nbytes / 2**20,
                    path,
                )
                return _Lease(client, reply, block, path)
            if isinstance(reply, Mismatch):
                differences = ", ".join(
                    f"{field} (asked {getattr(key, field)!r}, served {getattr(reply.served, field)!r})"
                    for field in reply.fields
                )
                reason = f"the daemon at {path} holds other weights: {differences}"
            else:
                assert isinstance(reply, Error)
                reason = f"the daemon at {path} answered: {reply.message}"
        except (OSError, FrameError, ValueError) as error:
            reason = f"the daemon at {path} failed: {error}"
        client.close()
        return reason

    def _from_disk(self, source: ModelSource, dtype: str, reason: str, slices: bool) -> Iterator[tuple[str, Any]]:
        from weft.api import PluginRegistry

        disk_loader = self.options.disk_loader
        logger.warning("weight cache: %s; loading from disk with the %r loader", reason, disk_loader)
        disk_class = PluginRegistry().load("loader", disk_loader)
        disk = disk_class.for_load(None, msgspec.structs.replace(self.load_config, loader=disk_loader))
        yield from disk.iter_weight_slices(source, dtype) if slices else disk.iter_weights(source, dtype)


class _Lease:
    """Weights mapped from a daemon: held until :meth:`close`, which releases the lease."""

    def __init__(self, client: Any, reply: Ok, block: torch.Tensor, path: Path) -> None:
        self.client, self.reply, self.block, self.path = client, reply, block, path

    @property
    def whole(self) -> bool:
        return all(len(entry.parts) == 1 and entry.parts[0].narrow is None for entry in self.reply.tensors)

    def parts(self) -> Iterator[tuple[TensorEntry, list[torch.Tensor]]]:
        from weft_weight_cache.storage import part_views

        return part_views(self.block, self.reply.tensors)

    def close(self) -> None:
        self.block = None  # the model holds its own copy now
        try:
            self.client.release(self.reply.lease)
        except (OSError, FrameError) as error:
            logger.warning(
                "weight cache: releasing lease %s at %s failed (%s); closing the connection ends it",
                self.reply.lease[:8],
                self.path,
                error,
            )
        finally:
            self.client.close()

    def __enter__(self) -> _Lease:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
