"""Who may talk to a daemon, and where: the socket folder, the socket, the peer, one daemon per device.

* The socket folder belongs to the user and is ``0700``; it is never a symlink.
* The socket is ``0600``, owned by the user, and never a symlink; engines check it before connecting.
* The daemon asks the kernel who connected (``SO_PEERCRED``) and serves only its own user.
* One daemon per device: an exclusive ``flock`` on ``<folder>/<device>.lock``, held for the
  daemon's life (the kernel drops it when the process ends, however it ends).
"""

from __future__ import annotations

import fcntl
import os
import socket
import stat
import struct
from pathlib import Path

_UCRED = struct.Struct("3i")
MAX_SOCKET_PATH = 107


class SafetyError(PermissionError):
    """A socket folder, socket or peer that breaks the rules; the message names it and the fix."""


def default_socket_dir() -> Path:
    """``$XDG_RUNTIME_DIR/weft-weight-cache`` when the runtime folder exists, else ``/tmp/weft-weight-cache-<uid>``."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and Path(runtime).is_dir():
        return Path(runtime) / "weft-weight-cache"
    return Path(f"/tmp/weft-weight-cache-{os.geteuid()}")


def _owner_and_mode(path: Path, what: str, kind: str) -> os.stat_result:
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise SafetyError(f"{what} {path} does not exist") from None
    if stat.S_ISLNK(info.st_mode):
        raise SafetyError(f"{what} {path} is a symlink; refusing it (use the real path, owned by you)")
    if kind == "dir" and not stat.S_ISDIR(info.st_mode):
        raise SafetyError(f"{what} {path} is not a folder")
    if kind == "socket" and not stat.S_ISSOCK(info.st_mode):
        raise SafetyError(f"{what} {path} is not a socket")
    if info.st_uid != os.geteuid():
        raise SafetyError(
            f"{what} {path} belongs to uid {info.st_uid}, not to you (uid {os.geteuid()}); "
            f"use a folder of your own (plugins.weight-cache.socket_dir)"
        )
    return info


def check_socket_dir(path: Path) -> None:
    info = _owner_and_mode(path, "weight-cache socket folder", "dir")
    if stat.S_IMODE(info.st_mode) & 0o077:
        raise SafetyError(
            f"weight-cache socket folder {path} has mode {stat.S_IMODE(info.st_mode):04o}; it must be 0700 "
            f"(chmod 700 {path})"
        )


def prepare_socket_dir(path: Path) -> Path:
    """Create the daemon's socket folder (``0700``) if it is missing, then check it."""
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    check_socket_dir(path)
    return path


def check_socket(path: Path) -> None:
    """What an engine checks before it connects: the folder, then the socket itself."""
    check_socket_dir(path.parent)
    info = _owner_and_mode(path, "weight-cache socket", "socket")
    if stat.S_IMODE(info.st_mode) & 0o177:
        raise SafetyError(f"weight-cache socket {path} has mode {stat.S_IMODE(info.st_mode):04o}; it must be 0600")


def check_socket_path(path: Path) -> None:
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise SafetyError(
            f"weight-cache socket path {path} is {len(os.fsencode(path))} bytes; AF_UNIX allows {MAX_SOCKET_PATH}: "
            f"use a shorter plugins.weight-cache.socket_dir"
        )


def bind_private(path: Path) -> socket.socket:
    """A listening socket at ``path``, created ``0600`` (the umask is set while binding, so it never exists wider)."""
    check_socket_path(path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    previous = os.umask(0o177)
    try:
        server.bind(str(path))
    finally:
        os.umask(previous)
    os.chmod(path, 0o600)
    server.listen(16)
    return server


def peer_uid(connection: socket.socket) -> int:
    _, uid, _ = _UCRED.unpack(connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return uid


def check_peer(connection: socket.socket, expected_uid: int | None = None) -> None:
    expected = os.geteuid() if expected_uid is None else expected_uid
    uid = peer_uid(connection)
    if uid != expected:
        raise SafetyError(f"a process of uid {uid} connected; this daemon serves uid {expected} only")


class DeviceLock:
    """The one-daemon-per-device lock: ``<socket folder>/<device>.lock``, held while the object lives."""

    def __init__(self, socket_dir: Path, device: str) -> None:
        self.path = socket_dir / f"{device}.lock"
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(self.fd)
            raise SafetyError(
                f"another weight-cache daemon (pid {holder}) already serves device {device} from {socket_dir}; "
                f"stop it first, or give this one another device"
            ) from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, str(os.getpid()).encode(), 0)

    def close(self) -> None:
        os.close(self.fd)
