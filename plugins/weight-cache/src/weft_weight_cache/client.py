"""The engine's side of the socket: check it, connect, ask for a key, release the lease."""

from __future__ import annotations

import os
import socket
from pathlib import Path

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
    decode_reply,
    recv_frame,
    send_frame,
)
from weft_weight_cache.safety import check_socket, check_socket_path


class WeightCacheClient:
    def __init__(
        self, socket_path: Path, timeout: float = 60.0, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    ) -> None:
        check_socket_path(socket_path)
        check_socket(socket_path)
        self.max_frame_bytes = max_frame_bytes
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(str(socket_path))
        except OSError:
            self.sock.close()
            raise

    def _ask(self, message: GetState | Release) -> tuple[Ok | Mismatch | Error | Released, list[int]]:
        send_frame(self.sock, message)
        frame = recv_frame(self.sock, self.max_frame_bytes)
        if frame is None:
            raise FrameError("the daemon closed the connection without a reply")
        payload, fds = frame
        try:
            return decode_reply(payload), fds
        except FrameError:
            for fd in fds:
                os.close(fd)
            raise

    def get_state(self, key: CacheKey, device: str) -> tuple[Ok | Mismatch | Error, list[int]]:
        """The daemon's answer for ``key`` on ``device``, with the descriptors of an :class:`Ok` (the caller closes
        them)."""
        reply, fds = self._ask(GetState(key, device))
        if isinstance(reply, Released):
            raise FrameError("the daemon answered get_state with released")
        if not isinstance(reply, Ok):
            for fd in fds:
                os.close(fd)
            fds = []
        return reply, fds

    def release(self, lease: str) -> None:
        reply, fds = self._ask(Release(lease))
        for fd in fds:
            os.close(fd)
        if not isinstance(reply, Released):
            raise FrameError(f"the daemon answered release with {type(reply).__name__}")

    def close(self) -> None:
        self.sock.close()
