"""The daemon's protocol: msgspec messages in length-prefixed frames over an AF_UNIX stream socket.

A frame is an 8-byte big-endian payload length, then the payload (msgpack of one message). A frame
longer than the receiver's bound is refused before its payload is read; end of stream inside a
frame (in the length or the payload) is an error; end of stream between frames is a clean close.
File descriptors (the shared-memory arena on the CPU) travel as ``SCM_RIGHTS`` ancillary data with
the first byte of the frame they belong to.

Requests: :class:`GetState` (the weights for a key, on the asking engine's device) and
:class:`Release` (done with a lease). Replies: :class:`Ok` (a lease and the handles to map),
:class:`Mismatch` (the key fields that differ from what the daemon holds), :class:`Error`, and
:class:`Released`.
"""

from __future__ import annotations

import array
import socket
import struct

import msgspec

HEADER = struct.Struct(">Q")
DEFAULT_MAX_FRAME_BYTES = 64 << 20
MAX_FDS = 4


class FrameError(ConnectionError):
    """A frame that breaks the protocol: too large, cut short, or not a message."""


class CacheKey(msgspec.Struct, frozen=True, kw_only=True):
    """What must match for an engine to use resident weights instead of its checkpoint."""

    fingerprint: str
    """sha256 over the weight shards' names and safetensors headers (tensor names, dtypes, shapes, offsets)."""
    architecture: str
    model_config: str
    """sha256 of the model's ``config.json`` contents: head counts, sizes and tied embeddings decide each rank's
    part."""
    tensor_parallel_size: int
    tensor_parallel_rank: int
    pipeline_parallel_size: int
    pipeline_parallel_rank: int
    dtype: str
    """The dtype the engine's model family asks the loader for."""
    quantization: str
    revision: str
    """A Hub snapshot's commit; for a local folder its path and its shards' sizes and modification times."""
    weft_version: str
    stage_layers: tuple[int, int] | None = None
    """Under pipeline parallelism, the first layer and the layer count of the rank's stage (from
    ``engine.pipeline_partition`` or the even split); None with one stage."""
    expert_parallel: bool = False
    """``engine.enable_expert_parallel``: whole routed experts per tensor rank instead of slices of each."""


class GetState(msgspec.Struct, frozen=True, tag="get_state"):
    key: CacheKey
    device: str
    """The asking engine's device identity (a GPU's UUID; the CPU slot and the machine's boot id)."""


class Release(msgspec.Struct, frozen=True, tag="release"):
    lease: str


Request = GetState | Release


class TensorPart(msgspec.Struct, frozen=True, array_like=True):
    """One read of a checkpoint tensor, held in the arena: the range read along one axis (``[dim, start,
    length]``; None: the whole tensor), and the bytes' dtype (``float32``), shape and byte offset."""

    narrow: list[int] | None
    dtype: str
    shape: list[int]
    offset: int


class TensorEntry(msgspec.Struct, frozen=True, array_like=True):
    """One checkpoint tensor: its name, its whole shape, and the parts the served rank reads of it
    (none: another pipeline stage's layer, another rank's expert)."""

    name: str
    shape: list[int]
    parts: list[TensorPart]


class CudaHandle(msgspec.Struct, frozen=True):
    """A CUDA IPC handle of the arena's allocation, as ``torch.UntypedStorage._share_cuda_`` gives it."""

    device: int
    handle: bytes
    size: int
    offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool


class Arena(msgspec.Struct, frozen=True):
    """Where the weights are: a sealed memfd passed with the frame (``host``), or a CUDA allocation (``cuda``)."""

    kind: str
    nbytes: int
    cuda: CudaHandle | None = None


class Ok(msgspec.Struct, frozen=True, tag="ok"):
    lease: str
    arena: Arena
    tensors: list[TensorEntry]


class Mismatch(msgspec.Struct, frozen=True, tag="mismatch"):
    fields: list[str]
    """The key fields whose values differ."""
    served: CacheKey


class Error(msgspec.Struct, frozen=True, tag="error"):
    message: str


class Released(msgspec.Struct, frozen=True, tag="released"):
    lease: str


Reply = Ok | Mismatch | Error | Released

_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)
_encoder = msgspec.msgpack.Encoder()


def mismatched_fields(asked: CacheKey, served: CacheKey) -> list[str]:
    return [field for field in asked.__struct_fields__ if getattr(asked, field) != getattr(served, field)]


def send_frame(sock: socket.socket, message: msgspec.Struct, fds: tuple[int, ...] = ()) -> None:
    payload = _encoder.encode(message)
    data = HEADER.pack(len(payload)) + payload
    sent = 0
    if fds:
        sent = sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    sock.sendall(data[sent:])


def _take_fds(ancillary: list[tuple[int, int, bytes]], fds: list[int]) -> None:
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            received = array.array("i")
            received.frombytes(data[: len(data) - len(data) % received.itemsize])
            fds.extend(received)


def recv_frame(sock: socket.socket, max_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> tuple[bytes, list[int]] | None:
    """The next frame's payload and the descriptors that came with it; None at a clean end of stream.

    Raises :class:`FrameError` for a frame over ``max_bytes`` or a stream that ends inside a frame
    (descriptors received so far are closed first).
    """
    fds: list[int] = []
    try:
        header = b""
        while len(header) < HEADER.size:
            chunk, ancillary, _, _ = sock.recvmsg(HEADER.size - len(header), socket.CMSG_SPACE(MAX_FDS * 4))
            _take_fds(ancillary, fds)
            if not chunk:
                if not header:
                    return None
                raise FrameError(f"the stream ended inside a frame's length ({len(header)} of {HEADER.size} bytes)")
            header += chunk
        (length,) = HEADER.unpack(header)
        if length > max_bytes:
            raise FrameError(f"a frame of {length} bytes exceeds the limit of {max_bytes} bytes")
        payload = bytearray()
        while len(payload) < length:
            chunk = sock.recv(min(length - len(payload), 1 << 20))
            if not chunk:
                raise FrameError(f"the stream ended inside a frame ({len(payload)} of {length} bytes)")
            payload += chunk
        return bytes(payload), fds
    except BaseException:
        for fd in fds:
            _close_quietly(fd)
        raise


def _close_quietly(fd: int) -> None:
    import os

    try:
        os.close(fd)
    except OSError:
        pass


def decode_request(payload: bytes) -> GetState | Release:
    try:
        return _request_decoder.decode(payload)
    except msgspec.DecodeError as error:
        raise FrameError(f"not a weight-cache request: {error}") from None


def decode_reply(payload: bytes) -> Ok | Mismatch | Error | Released:
    try:
        return _reply_decoder.decode(payload)
    except msgspec.DecodeError as error:
        raise FrameError(f"not a weight-cache reply: {error}") from None
