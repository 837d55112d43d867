"""The daemon: one device's weights, loaded once and kept resident, served to engines over its socket.

:func:`load_resident` reads the weights as an engine worker at the same place would (the same
platform dtype, model family load dtype and ranks, through the configured disk loader), and keeps
only what that worker reads: its rank's part of each tensor (:mod:`weft_weight_cache.reads`);
:class:`WeightCacheServer` answers :class:`~weft_weight_cache.protocol.GetState` with an
:class:`~weft_weight_cache.protocol.Ok` lease when the key and the device match, and
:class:`~weft_weight_cache.protocol.Mismatch` naming the differing fields when they do not.
Each connection is served on its own thread; its leases end with :class:`Release` or when it closes.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from pathlib import Path
from typing import Any

import msgspec

from weft_weight_cache.protocol import (
    DEFAULT_MAX_FRAME_BYTES,
    CacheKey,
    Error,
    FrameError,
    GetState,
    Mismatch,
    Ok,
    Release,
    Released,
    decode_request,
    mismatched_fields,
    recv_frame,
    send_frame,
)
from weft_weight_cache.safety import SafetyError, bind_private, check_peer
from weft_weight_cache.storage import ResidentWeights

logger = logging.getLogger("weft.weight_cache")


def load_resident(config: Any, load_config: Any, disk_loader: str) -> tuple[CacheKey, ResidentWeights]:
    """Load the part of ``config.model`` that the worker ``load_config`` describes reads, with ``disk_loader``.

    Returns the key engines must ask for and the packed parts on ``load_config.device``.
    """
    from weft.api import PluginRegistry, build_loader, build_platform, load_family, resolve_dtype
    from weft_weight_cache.key import cache_key
    from weft_weight_cache.reads import rank_reads

    registry = PluginRegistry()
    platform = build_platform(registry, config)
    loader = build_loader(registry, config, disk_loader, msgspec.structs.replace(load_config, loader=disk_loader))
    source = loader.resolve(config.model)
    family = load_family(registry, config, source)
    dtype = resolve_dtype(config, platform)
    key = cache_key(source, load_config, family.load_dtype(dtype))
    resident = ResidentWeights(rank_reads(config, load_config, loader, source, family, dtype), load_config.device)
    return key, resident


class WeightCacheServer:
    """Serves one device's resident weights on a socket in a checked folder."""

    def __init__(
        self,
        key: CacheKey,
        weights: ResidentWeights,
        identity: str,
        socket_path: Path,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        allowed_uid: int | None = None,
    ) -> None:
        self.key, self.weights, self.identity = key, weights, identity
        self.socket_path, self.max_frame_bytes, self.allowed_uid = socket_path, max_frame_bytes, allowed_uid
        self.leases: dict[str, int] = {}
        self.served = 0
        self.lock = threading.Lock()
        if socket_path.is_symlink() or socket_path.exists():
            socket_path.unlink()  # a stale socket of a daemon that died: the device lock says none runs
        self.listener = bind_private(socket_path)
        self._closed = threading.Event()

    def serve_forever(self) -> None:
        while not self._closed.is_set():
            try:
                connection, _ = self.listener.accept()
            except OSError:
                if self._closed.is_set():
                    return
                raise
            threading.Thread(target=self._serve, args=(connection,), daemon=True).start()

    def close(self) -> None:
        self._closed.set()
        try:
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.listener.close()
        self.socket_path.unlink(missing_ok=True)

    def _serve(self, connection: socket.socket) -> None:
        held: set[str] = set()
        with connection:
            try:
                check_peer(connection, self.allowed_uid)
            except SafetyError as error:
                logger.warning("weight cache: refused a connection: %s", error)
                self._reply(connection, Error(str(error)))
                return
            while True:
                try:
                    frame = recv_frame(connection, self.max_frame_bytes)
                    if frame is None:
                        break
                    payload, fds = frame
                    for fd in fds:  # engines send no descriptors
                        os.close(fd)
                    request = decode_request(payload)
                except (FrameError, OSError) as error:
                    logger.warning("weight cache: dropped a connection: %s", error)
                    self._reply(connection, Error(f"protocol error: {error}"))
                    break
                if isinstance(request, GetState):
                    self._get_state(connection, request, held)
                elif isinstance(request, Release):
                    self._release(request.lease, held)
                    self._reply(connection, Released(request.lease))
        for lease in list(held):
            self._release(lease, held)

    def _get_state(self, connection: socket.socket, request: GetState, held: set[str]) -> None:
        if request.device != self.identity:
            self._reply(
                connection,
                Error(f"device mismatch: this daemon serves {self.identity}, the engine is on {request.device}"),
            )
            return
        fields = mismatched_fields(request.key, self.key)
        if fields:
            self._reply(connection, Mismatch(fields, self.key))
            return
        lease = uuid.uuid4().hex
        arena, fds = self.weights.describe()
        with self.lock:
            self.leases[lease] = id(connection)
            self.served += 1
            held.add(lease)
        logger.info(
            "weight cache: lease %s for %d tensors (%d leases held)",
            lease[:8],
            len(self.weights.entries),
            len(self.leases),
        )
        self._reply(connection, Ok(lease, arena, self.weights.entries), fds)

    def _release(self, lease: str, held: set[str]) -> None:
        with self.lock:
            self.leases.pop(lease, None)
            held.discard(lease)

    @staticmethod
    def _reply(connection: socket.socket, message: msgspec.Struct, fds: tuple[int, ...] = ()) -> None:
        try:
            send_frame(connection, message, fds)
        except OSError:
            pass
