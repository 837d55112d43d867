"""The side channel between a decode (consumer) worker and a prefill (producer) worker: ZMQ, msgspec.

NIXL moves the KV; this channel carries what NIXL needs first and what it cannot say:

* :class:`Hello` (consumer -> producer, once per pair of workers): the consumer's NIXL agent
  metadata, its KV-cache regions and a description of its engine. The producer refuses an
  engine it cannot write into (another model, block size, dtype or TP size) with both values,
  in :class:`HelloReply`.
* :class:`Register` (consumer -> producer, per request): the transfer id the proxy gave both
  legs and the consumer's blocks to write, per transferable group.
* :class:`Abandon` (consumer -> producer): the consumer's request ended, or needs no KV; don't write.
  The producer's own API sends it too (``POST /kv_transfer/abandon``) when a P/D proxy's prefill
  leg failed before the engine saw the request, so the consumer hears at once.
* :class:`Notice` (producer -> consumer): the transfer will not happen (the producer's request
  ended before its prefill did, the write failed, a fault was injected, the lease expired).
  Completion is not sent here: it is NIXL's notification, delivered after the data.

A producer worker answers from a thread (:class:`ProducerChannel`), so a prefill instance with
no request running still answers. A consumer worker uses one DEALER socket per producer from
its step (:class:`ConsumerChannel`, never blocking); ZMQ heartbeats tell it when a producer's
process is gone, and its transfers then fail at once instead of at their timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from weft_nixl.transfer import Region

logger = logging.getLogger("weft.nixl")

HEARTBEAT_MS = 500
"""How often a consumer checks that a producer's process is alive; it is declared gone after 4 missed beats."""
CONNECT_TIMEOUT = 3.0
"""Seconds a consumer keeps trying to reach a producer that refuses connections before it gives up on it."""


class GroupDescription(msgspec.Struct, frozen=True, array_like=True):
    name: str
    kind: str
    block_size: int
    dtype: str
    block_bytes: int


class EngineDescription(msgspec.Struct, frozen=True, array_like=True):
    """What two engines must share for one to write its KV into the other's cache."""

    model: str
    tp_size: int
    tp_rank: int
    groups: tuple[GroupDescription, ...]
    """The transferable groups, in the model's order."""


class Hello(msgspec.Struct, tag=True, array_like=True):
    agent_name: str
    agent_metadata: bytes
    engine: EngineDescription
    regions: list[list[Region]]
    """Per transferable group, its layers' regions (:func:`weft_nixl.transfer.group_regions`)."""
    device_id: int


class HelloReply(msgspec.Struct, tag=True, array_like=True):
    accepted: bool
    error: str = ""


class Register(msgspec.Struct, tag=True, array_like=True):
    transfer_id: str
    agent_name: str
    first_block: list[int]
    """Per transferable group: the position in the request's block list of ``block_ids[g][0]``
    (blocks before it are the consumer's own prefix-cache hit and are not written)."""
    block_ids: list[list[int]]
    timeout: float
    """Seconds after which the consumer computes the prompt itself: no write may start after half of it."""


class Abandon(msgspec.Struct, tag=True, array_like=True):
    transfer_id: str


class Notice(msgspec.Struct, tag=True, array_like=True):
    transfer_id: str
    reason: str


Message = Hello | HelloReply | Register | Abandon | Notice
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def mismatch(producer: EngineDescription, consumer: EngineDescription) -> str | None:
    """Why a producer cannot write into a consumer's cache, naming both values; None when it can."""
    problems = []
    if producer.model != consumer.model:
        problems.append(f"model: prefill {producer.model!r}, decode {consumer.model!r}")
    if producer.tp_size != consumer.tp_size:
        problems.append(f"tensor_parallel_size: prefill {producer.tp_size}, decode {consumer.tp_size}")
    if [group.name for group in producer.groups] != [group.name for group in consumer.groups]:
        problems.append(
            f"KV-cache groups: prefill {[g.name for g in producer.groups]}, decode {[g.name for g in consumer.groups]}"
        )
    for ours, theirs in zip(producer.groups, consumer.groups, strict=False):
        for field in ("kind", "block_size", "dtype", "block_bytes"):
            if getattr(ours, field) != getattr(theirs, field):
                problems.append(
                    f"{field} of group {ours.name!r}: prefill {getattr(ours, field)!r}, decode "
                    f"{getattr(theirs, field)!r}"
                )
    if not problems:
        return None
    return (
        "the prefill and decode instances cannot exchange KV ("
        + "; ".join(problems)
        + "): run both with the same model, engine.block_size, engine.dtype and engine.tensor_parallel_size"
    )


class ProducerChannel:
    """The producer worker's listener: accepts handshakes and registrations on its own thread."""

    def __init__(self, address: str, engine: EngineDescription, regions: list[list[Region]], ended_ttl: float) -> None:
        self.engine = engine
        self.block_counts = [[region.block_bytes for region in group] for group in regions]
        self.ended_ttl = ended_ttl
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(f"tcp://{address}")
        self._lock = threading.Lock()
        self.peers: dict[str, Hello] = {}
        """Accepted consumers by agent name."""
        self._registrations: dict[str, tuple[bytes, Register, float]] = {}
        """Transfer id -> (the consumer's socket identity, its registration, when it arrived)."""
        self._ended: dict[str, tuple[str, float]] = {}
        """Transfer ids that will not be written (reason, when): a late registration gets a notice."""
        self._outbox: deque[tuple[bytes, Message]] = deque()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="weft-nixl-side-channel", daemon=True)
        self._thread.start()

    # The main thread's calls.

    def take(self, transfer_id: str) -> tuple[bytes, Register, float] | None:
        """The registration of ``transfer_id`` if it arrived (it is handed out once)."""
        with self._lock:
            return self._registrations.pop(transfer_id, None)

    def is_ended(self, transfer_id: str) -> bool:
        with self._lock:
            return transfer_id in self._ended

    def end(self, transfer_id: str, reason: str, identity: bytes | None = None) -> None:
        """``transfer_id`` will not be written: tell its consumer now (if it registered) or when it does."""
        with self._lock:
            self._ended[transfer_id] = (reason, time.monotonic())
            registration = self._registrations.pop(transfer_id, None)
            if registration is not None:
                identity = registration[0]
            if identity is not None:
                self._outbox.append((identity, Notice(transfer_id, reason)))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._socket.close(linger=0)
        self._context.term()

    # The thread.

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if poller.poll(20):
                    while self._socket.poll(0):
                        identity, payload = self._socket.recv_multipart()
                        self._handle(identity, payload)
                with self._lock:
                    outgoing, self._outbox = self._outbox, deque()
                    self._expire()
                for identity, message in outgoing:
                    self._socket.send_multipart([identity, _encoder.encode(message)])
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                logger.exception("weft-nixl: side channel error")
            except Exception:  # noqa: BLE001 - a bad message must not stop the listener
                logger.exception("weft-nixl: could not handle a side-channel message")

    def _handle(self, identity: bytes, payload: bytes) -> None:
        message = _decoder.decode(payload)
        if isinstance(message, Hello):
            error = mismatch(self.engine, message.engine)
            if (
                error is None
                and [[region.block_bytes for region in group] for group in message.regions] != self.block_counts
            ):
                error = (
                    "the decode instance's KV-cache layout differs from the prefill instance's (bytes per block per "
                    "layer)"
                )
            if error is not None:
                logger.error("weft-nixl: refused the decode worker %s: %s", message.agent_name, error)
            else:
                with self._lock:
                    self.peers[message.agent_name] = message
            self._send(identity, HelloReply(error is None, error or ""))
        elif isinstance(message, Register):
            with self._lock:
                ended = self._ended.get(message.transfer_id)
                known = message.agent_name in self.peers
                if ended is None and known:
                    self._registrations[message.transfer_id] = (identity, message, time.monotonic())
            if not known:
                self._send(
                    identity,
                    Notice(message.transfer_id, "the prefill instance has no handshake from this decode worker"),
                )
            elif ended is not None:
                self._send(identity, Notice(message.transfer_id, ended[0]))
        elif isinstance(message, Abandon):  # from the decode worker, or the prefill instance's API (its leg failed)
            with self._lock:
                registration = self._registrations.pop(message.transfer_id, None)
                self._ended[message.transfer_id] = ("the request was abandoned", time.monotonic())
            if registration is not None:
                self._send(registration[0], Notice(message.transfer_id, "abandoned"))

    def _send(self, identity: bytes, message: Message) -> None:
        self._socket.send_multipart([identity, _encoder.encode(message)])

    def _expire(self) -> None:
        now = time.monotonic()
        for transfer_id, (_, since) in list(self._ended.items()):
            if now - since > self.ended_ttl:
                del self._ended[transfer_id]
        for transfer_id, (_, registration, since) in list(self._registrations.items()):
            if now - since > registration.timeout:  # its consumer computed the prompt already
                del self._registrations[transfer_id]


class _Producer:
    """The consumer's connection to one producer worker."""

    def __init__(self, context: zmq.Context, address: str, hello: Hello) -> None:
        self.address = address
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
        self.socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, 4 * HEARTBEAT_MS)
        self.socket.setsockopt(zmq.HEARTBEAT_TTL, 4 * HEARTBEAT_MS)
        self.monitor = self.socket.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
        )
        self.socket.connect(f"tcp://{address}")
        self.socket.send(_encoder.encode(hello))
        self.accepted: bool | None = None
        self.error = ""
        self.connected = False
        self.since = time.monotonic()
        self.waiting: list[Register | Abandon] = []
        """Messages held until the handshake is answered."""

    def close(self) -> None:
        self.socket.disable_monitor()
        self.monitor.close(linger=0)
        self.socket.close(linger=0)


class ConsumerChannel:
    """The consumer worker's connections to producers, driven from its step."""

    def __init__(self, hello: Hello) -> None:
        self.hello = hello
        self._context = zmq.Context()
        self._producers: dict[str, _Producer] = {}

    def register(self, address: str, registration: Register) -> str | None:
        """Ask the producer at ``address`` to write; returns why it cannot (a refused handshake), else None."""
        producer = self._producers.get(address)
        if producer is None:
            producer = self._producers[address] = _Producer(self._context, address, self.hello)
        if producer.accepted is False:
            return producer.error
        self._send(producer, registration)
        return None

    def abandon(self, address: str, transfer_id: str) -> bool:
        """Tell the producer not to write ``transfer_id``; False when it was never registered there
        (the handshake is pending or was refused): nothing can be written, no answer comes."""
        producer = self._producers.get(address)
        if producer is None or not producer.accepted:
            if producer is not None:
                producer.waiting = [held for held in producer.waiting if held.transfer_id != transfer_id]
            return False
        producer.socket.send(_encoder.encode(Abandon(transfer_id)))
        return True

    def decline(self, address: str, transfer_id: str) -> None:
        """The consumer needs none of ``transfer_id``'s KV (it has it all locally): the producer may release it."""
        producer = self._producers.get(address)
        if producer is None:
            producer = self._producers[address] = _Producer(self._context, address, self.hello)
        if producer.accepted is not False:
            self._send(producer, Abandon(transfer_id))

    @staticmethod
    def _send(producer: _Producer, message: Register | Abandon) -> None:
        if producer.accepted:
            producer.socket.send(_encoder.encode(message))
        else:
            producer.waiting.append(message)

    def poll(self) -> list[tuple[str, Any]]:
        """What arrived: ``(address, Notice)``, ``(address, "refused: <why>")`` for a refused handshake
        (its waiting registrations fail), ``(address, "gone")`` when a producer's process went away."""
        events: list[tuple[str, Any]] = []
        for address, producer in list(self._producers.items()):
            while producer.monitor.poll(0):
                event = recv_monitor_message(producer.monitor)["event"]
                if event == zmq.EVENT_CONNECTED:
                    producer.connected = True
                gone = event == zmq.EVENT_DISCONNECTED and producer.connected
                unreachable = (
                    event == zmq.EVENT_CONNECT_RETRIED
                    and not producer.connected
                    and time.monotonic() - producer.since > CONNECT_TIMEOUT
                )
                if gone or unreachable:
                    events.append((address, "gone" if gone else "unreachable"))
                    producer.close()
                    del self._producers[address]  # a new handshake when it comes back
                    break
            else:
                while producer.socket.poll(0):
                    message = _decoder.decode(producer.socket.recv())
                    if isinstance(message, HelloReply):
                        producer.accepted, producer.error = message.accepted, message.error
                        if message.accepted:
                            for registration in producer.waiting:
                                producer.socket.send(_encoder.encode(registration))
                        else:
                            events.append((address, f"refused: {message.error}"))
                        producer.waiting.clear()
                    elif isinstance(message, Notice):
                        events.append((address, message))
        return events

    def close(self) -> None:
        for producer in self._producers.values():
            producer.close()
        self._producers.clear()
        self._context.term()
