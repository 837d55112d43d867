"""The NIXL KV connector: a prefill instance pushes each request's KV into the decode instance's blocks.

A P/D proxy (weft-disagg) sends every request twice, at once: to a prefill instance
with ``max_tokens = 1`` and ``kv_transfer_params = {"do_remote_decode": true,
"transfer_id": T}``, and to a decode instance with ``{"do_remote_prefill": true,
"transfer_id": T, "remote_host": H, "remote_port": P}`` (the prefill instance's side
channel, from its ``GET /kv_transfer``). Then:

1. Decode (``kv_consumer``): the lookup offers every prompt token after the local
   prefix-cache hit but the last, asynchronously; the engine allocates the blocks and
   parks the request outside the running batch. The worker registers those blocks with
   the prefill worker of the same TP rank over the side channel (after a handshake, once
   per pair of workers, that exchanges NIXL agent metadata and refuses engines that
   differ in model, block size, dtype or TP size, naming both values).
2. Prefill (``kv_producer``): in the step its prefill completes, the worker takes the
   request's blocks of every transferable group and, as soon as the registration is
   there, posts one NIXL WRITE of them into the decode blocks with a notification. Its
   blocks are leased (``delay_free``) until the write completes or fails; a lease no
   decode worker claims within ``lease_timeout`` expires.
3. Decode: NIXL's notification (delivered after the data) reports the request in
   ``finished_receiving``; it is scheduled to compute its last prompt token and decode.

Failures never change the output: a failed or refused transfer, a notice that the
prefill request ended before its prefill did, an injected fault, a prefill process
that went away (side-channel heartbeats) or ``transfer_timeout`` without the KV make
the decode instance compute the prompt itself (``failed_loads``). A decode request
that ends while its KV is on the way keeps its blocks until no write can reach them.

Core hands layers to the connector after the whole forward (``save_kv_layer`` per layer,
then ``wait_for_save``), so a request's KV goes as one write of all layers (UCX pipelines
the descriptors), posted from ``wait_for_save`` in the step that completed the prefill, not
layer by layer during the forward: docs/disaggregation.md ("One write per request, not layer
by layer") says why and what it costs.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

import msgspec
import numpy as np
from msgspec import Meta

from weft.contracts.kv_cache import transferable_groups
from weft.contracts.kv_connector import (
    ConnectorContext,
    ConnectorMetric,
    ConnectorOutput,
    ConnectorRequest,
    ConnectorStep,
    KVConnector,
)

if TYPE_CHECKING:
    import torch

    from weft.contracts.kv_cache import KVCacheGroupSpec
    from weft_nixl.side_channel import ConsumerChannel, ProducerChannel
    from weft_nixl.transfer import KVAgent

logger = logging.getLogger("weft.nixl")

NOTIFICATION_PREFIX = b"weft-nixl:"
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class NixlOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[plugins.nixl]``: this instance's part in prefill/decode disaggregation."""

    role: Annotated[
        Literal["kv_producer", "kv_consumer", "kv_both"],
        Meta(
            description="kv_producer: a prefill instance (pushes KV); kv_consumer: a decode instance (receives); "
            "kv_both"
        ),
    ] = "kv_both"
    side_channel_host: Annotated[
        str, Meta(min_length=1, description="address a producer listens on and decode instances reach it at")
    ] = "127.0.0.1"
    side_channel_port: Annotated[
        int,
        Meta(ge=1, le=65535, description="a producer's side-channel port for TP rank 0 (rank r listens on port + r)"),
    ] = 5600
    backends: Annotated[tuple[str, ...], Meta(min_length=1, description="NIXL backends, e.g. ['UCX']")] = ("UCX",)
    transfer_timeout: Annotated[
        float, Meta(gt=0, description="seconds a decode request waits for its KV before computing the prompt itself")
    ] = 60.0
    lease_timeout: Annotated[
        float,
        Meta(gt=0, description="seconds a prefill instance keeps a finished prefill's blocks for a decode instance"),
    ] = 60.0
    fault_injection: Annotated[
        bool, Meta(description="honour kv_transfer_params.inject_failure on the prefill leg (tests and drills)")
    ] = False


class Send(msgspec.Struct, frozen=True, array_like=True):
    """A producer request whose prefill completed in this step: its blocks of every transferable group."""

    request_id: str
    transfer_id: str
    block_ids: tuple[tuple[int, ...], ...]
    inject_failure: bool = False


class Receive(msgspec.Struct, frozen=True, array_like=True):
    """A consumer request parked for its KV: the blocks to register with its producer."""

    request_id: str
    transfer_id: str
    address: str
    """The producer's side channel for TP rank 0, ``host:port``."""
    first_block: tuple[int, ...]
    block_ids: tuple[tuple[int, ...], ...]


class NixlStepMetadata(msgspec.Struct, frozen=True):
    sends: tuple[Send, ...] = ()
    receives: tuple[Receive, ...] = ()
    ended: tuple[str, ...] = ()
    """Transfer ids of producer requests that ended before their prefill completed."""
    abandoned: tuple[tuple[str, str, str], ...] = ()
    """``(request id, transfer id, address)`` of consumer requests that ended while their KV was on the way."""
    declined: tuple[tuple[str, str], ...] = ()
    """``(transfer id, address)`` of consumer requests that need none of their KV (a local prefix hit covers it)."""
    preempted: frozenset[str] = frozenset()


class _Produced:
    __slots__ = ("transfer_id", "num_prompt_tokens", "inject_failure", "sent")

    def __init__(self, transfer_id: str, num_prompt_tokens: int, inject_failure: bool) -> None:
        self.transfer_id = transfer_id
        self.num_prompt_tokens = num_prompt_tokens
        self.inject_failure = inject_failure
        self.sent = False


class _Consumed:
    __slots__ = ("transfer_id", "address", "resolved")

    def __init__(self, transfer_id: str, address: str) -> None:
        self.transfer_id = transfer_id
        self.address = address
        self.resolved = False


class _Ready:
    """A producer request whose KV waits for its consumer's registration."""

    __slots__ = ("request_id", "block_ids", "since", "inject_failure")

    def __init__(self, send: Send) -> None:
        self.request_id = send.request_id
        self.block_ids = [np.asarray(blocks, dtype=np.uint64) for blocks in send.block_ids]
        self.since = time.monotonic()
        self.inject_failure = send.inject_failure


class _Writing:
    __slots__ = ("request_id", "handle", "started", "num_bytes", "identity")

    def __init__(self, request_id: str, handle: Any, num_bytes: int, identity: bytes) -> None:
        self.request_id = request_id
        self.handle = handle
        self.started = time.monotonic()
        self.num_bytes = num_bytes
        self.identity = identity


class _Waiting:
    """A consumer request whose KV is on the way."""

    __slots__ = ("request_id", "address", "started", "deadline", "num_bytes", "abandoned")

    def __init__(self, request_id: str, address: str, timeout: float, num_bytes: int) -> None:
        self.request_id = request_id
        self.address = address
        self.started = time.monotonic()
        self.deadline = self.started + timeout
        self.num_bytes = num_bytes
        self.abandoned = False


def _rank_address(address: str, tp_rank: int) -> str:
    host, _, port = address.rpartition(":")
    return f"{host}:{int(port) + tp_rank}"


class NixlConnector(KVConnector):
    """Push-model prefill/decode KV transfer on NIXL (see the module docstring)."""

    name: ClassVar[str] = "nixl"
    metadata_type: ClassVar[Any] = NixlStepMetadata
    Options = NixlOptions
    metrics: ClassVar[tuple[ConnectorMetric, ...]] = (
        ConnectorMetric("send_started_total", "KV writes a prefill instance posted to decode instances"),
        ConnectorMetric("send_bytes_total", "Bytes of KV a prefill instance wrote to decode instances"),
        ConnectorMetric(
            "send_failures_total",
            "Prefilled requests whose KV was not written (failed, refused, expired lease, injected fault)",
        ),
        ConnectorMetric("send_seconds", "From posting a KV write to its completion", "histogram", _LATENCY_BUCKETS),
        ConnectorMetric("receive_started_total", "Requests a decode instance registered blocks for"),
        ConnectorMetric("receive_bytes_total", "Bytes of KV a decode instance received"),
        ConnectorMetric("receive_failures_total", "Requests whose KV did not arrive (the prompt was computed instead)"),
        ConnectorMetric(
            "receive_seconds", "From registering a request's blocks to its KV's arrival", "histogram", _LATENCY_BUCKETS
        ),
    )

    def __init__(
        self,
        options: NixlOptions | None,
        role: Literal["scheduler", "worker"],
        groups: Sequence[KVCacheGroupSpec],
        context: ConnectorContext,
    ) -> None:
        super().__init__(options, role, groups, context)
        options = self.options
        self.produces = options.role in ("kv_producer", "kv_both")
        self.consumes = options.role in ("kv_consumer", "kv_both")
        self.transferable = transferable_groups(self.groups)
        # Scheduler role.
        self._producing: dict[str, _Produced] = {}
        self._consuming: dict[str, _Consumed] = {}
        self._consumed: set[str] = set()
        """Requests that had their one transfer: after a preemption they compute the prompt themselves."""
        self._receives: list[Receive] = []
        self._ended: list[str] = []
        self._abandoned: list[tuple[str, str, str]] = []
        self._declined: list[tuple[str, str]] = []
        # Worker role.
        self.agent: KVAgent | None = None
        self.producer_channel: ProducerChannel | None = None
        self.consumer_channel: ConsumerChannel | None = None
        self._metadata: NixlStepMetadata | None = None
        self._ready: dict[str, _Ready] = {}
        self._writing: dict[str, _Writing] = {}
        self._sent: set[str] = set()
        """Producer requests whose transfer is over (written or not): their blocks may go once they finished."""
        self._awaiting: set[str] = set()
        self._waiting: dict[str, _Waiting] = {}
        self._arrived: set[str] = set()
        self._failed: set[str] = set()
        self._observations: dict[str, list[float]] = {}

    # Scheduler role.

    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if not self.consumes or not request.params.get("do_remote_prefill") or request.request_id in self._consumed:
            return 0, False
        if _remote_address(request) is None:
            return 0, False
        count = len(request.prompt_token_ids) - 1 - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: tuple[tuple[int, ...], ...], num_external_tokens: int
    ) -> None:
        params = request.params
        if num_external_tokens and self.consumes:
            self._consumed.add(request.request_id)
            address = _remote_address(request)
            assert address is not None  # the lookup offered tokens only then
            transfer = _Consumed(str(params["transfer_id"]), address)
            self._consuming[request.request_id] = transfer
            local = len(request.prompt_token_ids) - 1 - num_external_tokens
            first = tuple(local // self.groups[index].spec.block_size for index in self.transferable)
            self._receives.append(
                Receive(
                    request.request_id,
                    transfer.transfer_id,
                    address,
                    first,
                    tuple(block_ids[index][start:] for index, start in zip(self.transferable, first, strict=False)),
                )
            )
        elif (
            self.consumes
            and params.get("do_remote_prefill")
            and request.request_id not in self._consumed
            and (address := _remote_address(request)) is not None
        ):
            self._consumed.add(request.request_id)
            self._declined.append((str(params["transfer_id"]), address))
        elif self.produces and params.get("do_remote_decode") and isinstance(params.get("transfer_id"), str):
            inject = bool(params.get("inject_failure")) and self.options.fault_injection
            self._producing[request.request_id] = _Produced(
                params["transfer_id"], len(request.prompt_token_ids), inject
            )

    def build_connector_meta(self, step: ConnectorStep) -> NixlStepMetadata:
        sends = []
        for scheduled in step.requests:
            produced = self._producing.get(scheduled.request_id)
            if produced is None or produced.sent:
                continue
            if scheduled.num_computed_tokens + scheduled.num_new_tokens >= produced.num_prompt_tokens:
                produced.sent = True
                sends.append(
                    Send(
                        scheduled.request_id,
                        produced.transfer_id,
                        tuple(scheduled.block_ids[index] for index in self.transferable),
                        produced.inject_failure,
                    )
                )
        for request_id in step.preempted:
            produced = self._producing.get(request_id)
            if produced is not None:
                produced.sent = False  # its prefill is computed again, and sent then
        metadata = NixlStepMetadata(
            sends=tuple(sends),
            receives=tuple(self._receives),
            ended=tuple(self._ended),
            abandoned=tuple(self._abandoned),
            declined=tuple(self._declined),
            preempted=step.preempted,
        )
        self._receives, self._ended, self._abandoned, self._declined = [], [], [], []
        return metadata

    def update_connector_output(self, output: ConnectorOutput) -> None:
        for request_id in output.finished_receiving | output.failed_loads:
            transfer = self._consuming.get(request_id)
            if transfer is not None:
                transfer.resolved = True

    def request_finished(
        self, request: ConnectorRequest, block_ids: tuple[tuple[int, ...], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        request_id = request.request_id
        self._consumed.discard(request_id)
        produced = self._producing.pop(request_id, None)
        if produced is not None:
            if produced.sent:
                return True, None  # leased until the write is over
            self._ended.append(produced.transfer_id)
        transfer = self._consuming.pop(request_id, None)
        if transfer is not None and not transfer.resolved:
            self._abandoned.append((request_id, transfer.transfer_id, transfer.address))
            return True, None  # a write may still land in its blocks
        return False, None

    # Worker role.

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from weft_nixl.side_channel import (
            ConsumerChannel,
            EngineDescription,
            GroupDescription,
            Hello,
            ProducerChannel,
        )
        from weft_nixl.transfer import KVAgent

        if not self.transferable:
            raise ValueError("weft-nixl: the model has no transferable KV-cache group")
        context, options = self.context, self.options
        name = f"weft-nixl-{uuid.uuid4().hex[:12]}-tp{context.tp_rank}"
        self.agent = KVAgent(name, options.backends, self.groups, self.transferable, kv_caches)
        engine = EngineDescription(
            model=context.model,
            tp_size=context.tp_size,
            tp_rank=context.tp_rank,
            groups=tuple(
                GroupDescription(
                    group.name,
                    type(group.spec).__name__,
                    group.spec.block_size,
                    group.spec.dtype,
                    regions[0].block_bytes,
                )
                for group, regions in zip(
                    (self.groups[index] for index in self.transferable), self.agent.regions, strict=False
                )
            ),
        )
        if self.produces:
            address = _rank_address(f"{options.side_channel_host}:{options.side_channel_port}", context.tp_rank)
            ttl = 2 * max(options.lease_timeout, options.transfer_timeout)
            self.producer_channel = ProducerChannel(address, engine, self.agent.regions, ttl)
            logger.info("weft-nixl: prefill side channel of TP rank %d on %s", context.tp_rank, address)
        if self.consumes:
            self.consumer_channel = ConsumerChannel(
                Hello(name, self.agent.metadata, engine, self.agent.regions, self.agent.device_id)
            )

    def bind_connector_metadata(self, metadata: NixlStepMetadata | None) -> None:
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        self._metadata = None

    def start_load_kv(self) -> None:
        metadata = self._metadata
        if metadata is None:
            return
        for request_id in metadata.preempted:
            self._finish_writes_of(request_id)
        if self.producer_channel is not None:
            for transfer_id in metadata.ended:
                self.producer_channel.end(transfer_id, "the prefill request ended before its prefill completed")
        if self.consumer_channel is not None:
            for receive in metadata.receives:
                self._register(receive)
            for request_id, transfer_id, address in metadata.abandoned:
                waiting = self._waiting.get(transfer_id)
                if waiting is None:
                    self._arrived.add(request_id)  # already over: its blocks may go
                    continue
                waiting.abandoned = True
                if not self.consumer_channel.abandon(_rank_address(address, self.context.tp_rank), transfer_id):
                    self._receive_over(transfer_id, arrived=False)  # never registered: nothing can be written
            for transfer_id, address in metadata.declined:
                self.consumer_channel.decline(_rank_address(address, self.context.tp_rank), transfer_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Receives complete asynchronously (reported by :meth:`get_finished`); nothing loads in the step."""

    def save_kv_layer(self, layer_name: str, kv_cache: torch.Tensor) -> None:
        """A request's KV goes as one write of every layer, from :meth:`wait_for_save`."""

    def wait_for_save(self) -> None:
        metadata = self._metadata
        if metadata is None or self.producer_channel is None:
            return
        if metadata.sends and self.agent is not None:
            self.agent.wait_for_device()  # the forward's kernels may still be writing the blocks to send
        for send in metadata.sends:
            self._ready[send.transfer_id] = _Ready(send)
        self._progress_sends()

    def get_finished(self, finished_request_ids: set[str]) -> ConnectorOutput:
        if self.producer_channel is not None:
            self._progress_sends()
        if self.consumer_channel is not None:
            self._progress_receives()
        # A request's blocks are released once it finished and its transfer is over, in either order.
        self._awaiting |= finished_request_ids
        sent = self._sent & self._awaiting
        self._sent -= sent
        in_flight = {ready.request_id for ready in self._ready.values()} | {
            writing.request_id for writing in self._writing.values()
        }
        self._awaiting &= in_flight
        arrived, self._arrived = self._arrived, set()
        failed, self._failed = self._failed, set()
        observations, self._observations = self._observations, {}
        return ConnectorOutput(
            finished_sending=frozenset(sent),
            finished_receiving=frozenset(arrived),
            failed_loads=frozenset(failed),
            observations=observations,
        )

    def _observe(self, name: str, value: float = 1.0) -> None:
        self._observations.setdefault(name, []).append(value)

    # Producer.

    def _progress_sends(self) -> None:
        channel, agent = self.producer_channel, self.agent
        assert channel is not None and agent is not None
        now = time.monotonic()
        for transfer_id, ready in list(self._ready.items()):
            if channel.is_ended(transfer_id):  # its consumer abandoned or declined it
                self._send_over(ready.request_id, failed=False)
                continue
            taken = channel.take(transfer_id)
            if taken is None:
                if now - ready.since > self.options.lease_timeout:
                    channel.end(
                        transfer_id,
                        f"no decode instance registered within lease_timeout ({self.options.lease_timeout:g} s)",
                    )
                    self._send_over(ready.request_id, failed=True)
                continue
            identity, registration, arrived = taken
            if ready.inject_failure or now - arrived > registration.timeout / 2:
                reason = "fault injected" if ready.inject_failure else "the registration arrived too late to write"
                channel.end(transfer_id, reason, identity)
                self._send_over(ready.request_id, failed=True)
                continue
            self._write(transfer_id, ready, identity, registration)
        for transfer_id, writing in list(self._writing.items()):
            state = agent.state(writing.handle)
            if state == "PROC":
                continue
            agent.release(writing.handle)
            del self._writing[transfer_id]
            if state == "DONE":
                self._observe("send_bytes_total", writing.num_bytes)
                self._observe("send_seconds", time.monotonic() - writing.started)
                self._send_over(writing.request_id, failed=False)
            else:
                channel.end(transfer_id, "the NIXL write failed", writing.identity)
                self._send_over(writing.request_id, failed=True)

    def _write(self, transfer_id: str, ready: _Ready, identity: bytes, registration: Any) -> None:
        channel, agent = self.producer_channel, self.agent
        assert channel is not None and agent is not None
        del self._ready[transfer_id]
        peer = channel.peers[registration.agent_name]
        pairs = []
        for local_blocks, first, remote_blocks in zip(
            ready.block_ids, registration.first_block, registration.block_ids, strict=False
        ):
            count = max(0, min(len(remote_blocks), len(local_blocks) - first))
            pairs.append((local_blocks[first : first + count], np.asarray(remote_blocks[:count], dtype=np.uint64)))
        notification = NOTIFICATION_PREFIX + transfer_id.encode()
        try:
            peer_name = agent.add_peer(peer.agent_metadata)
            if not any(len(local) for local, _ in pairs):
                agent.notify(peer_name, notification)
                self._send_over(ready.request_id, failed=False)
                return
            handle, num_bytes = agent.write(peer_name, peer.regions, peer.device_id, pairs, notification)
            state = agent.post(handle)
        except Exception as error:  # noqa: BLE001 - a transfer failure must not fail the engine
            logger.warning("weft-nixl: could not write the KV of transfer %s: %s", transfer_id, error)
            channel.end(transfer_id, f"the NIXL write could not start: {error}", identity)
            self._send_over(ready.request_id, failed=True)
            return
        self._observe("send_started_total")
        self._writing[transfer_id] = _Writing(ready.request_id, handle, num_bytes, identity)
        if state == "ERR":
            logger.warning("weft-nixl: posting the KV write of transfer %s failed", transfer_id)

    def _send_over(self, request_id: str, failed: bool) -> None:
        if failed:
            self._observe("send_failures_total")
        self._sent.add(request_id)

    def _finish_writes_of(self, request_id: str) -> None:
        """A preempted request's blocks are free: no write may read them after this returns."""
        agent = self.agent
        for transfer_id, ready in list(self._ready.items()):
            if ready.request_id == request_id:
                del self._ready[transfer_id]  # it is prefilled and sent again
        for writing in list(self._writing.values()):
            if writing.request_id == request_id and agent is not None:
                while agent.state(writing.handle) == "PROC":
                    time.sleep(0.0005)
                self._progress_sends()

    # Consumer.

    def _register(self, receive: Receive) -> None:
        from weft_nixl.side_channel import Register

        channel, agent = self.consumer_channel, self.agent
        assert channel is not None and agent is not None
        num_bytes = sum(
            len(blocks) * sum(region.block_bytes for region in regions)
            for blocks, regions in zip(receive.block_ids, agent.regions, strict=False)
        )
        timeout = self.options.transfer_timeout
        self._waiting[receive.transfer_id] = _Waiting(receive.request_id, receive.address, timeout, num_bytes)
        self._observe("receive_started_total")
        registration = Register(
            receive.transfer_id,
            agent.name,
            list(receive.first_block),
            [list(blocks) for blocks in receive.block_ids],
            timeout,
        )
        refused = channel.register(_rank_address(receive.address, self.context.tp_rank), registration)
        if refused:
            self._receive_over(receive.transfer_id, arrived=False, reason=refused)

    def _progress_receives(self) -> None:
        from weft_nixl.side_channel import Notice

        channel, agent = self.consumer_channel, self.agent
        assert channel is not None and agent is not None
        for address, event in channel.poll():
            if isinstance(event, Notice):
                self._receive_over(event.transfer_id, arrived=False, reason=event.reason)
                continue
            reason = {
                "gone": "the prefill instance's process went away",
                "unreachable": f"the prefill instance's side channel {address} refuses connections",
            }.get(event, f"the prefill instance {event}")
            for transfer_id, waiting in list(self._waiting.items()):
                if _rank_address(waiting.address, self.context.tp_rank) == address:
                    self._receive_over(transfer_id, arrived=False, reason=reason)
        for message in agent.notifications():
            if message.startswith(NOTIFICATION_PREFIX):
                self._receive_over(message[len(NOTIFICATION_PREFIX) :].decode(), arrived=True)
        now = time.monotonic()
        for transfer_id, waiting in list(self._waiting.items()):
            if now > waiting.deadline:
                self._receive_over(
                    transfer_id,
                    arrived=False,
                    reason=f"no KV within transfer_timeout ({self.options.transfer_timeout:g} s)",
                )

    def _receive_over(self, transfer_id: str, arrived: bool, reason: str = "") -> None:
        waiting = self._waiting.pop(transfer_id, None)
        if waiting is None:
            return  # a late notice or notification of a transfer already over
        if arrived:
            self._observe("receive_bytes_total", waiting.num_bytes)
            self._observe("receive_seconds", time.monotonic() - waiting.started)
        elif not waiting.abandoned:
            self._observe("receive_failures_total")
            logger.warning(
                "weft-nixl: the KV of request %s (transfer %s) will not arrive: %s; computing the prompt",
                waiting.request_id,
                transfer_id,
                reason,
            )
        if arrived or waiting.abandoned:
            self._arrived.add(waiting.request_id)
        else:
            self._failed.add(waiting.request_id)

    # Both roles.

    def close(self) -> None:
        if self.producer_channel is not None:
            self.producer_channel.close()
            self.producer_channel = None
        if self.consumer_channel is not None:
            self.consumer_channel.close()
            self.consumer_channel = None
        if self.agent is not None:
            self.agent.close()
            self.agent = None


def _remote_address(request: ConnectorRequest) -> str | None:
    """The producer's side channel a decode leg names, ``host:port``; None (with a warning) when malformed."""
    params = request.params
    host, port, transfer_id = params.get("remote_host"), params.get("remote_port"), params.get("transfer_id")
    if isinstance(host, str) and host and isinstance(port, int) and 0 < port < 65536 and isinstance(transfer_id, str):
        return f"{host}:{port}"
    logger.warning(
        "weft-nixl: request %s asks for a remote prefill but kv_transfer_params needs transfer_id (a string), "
        "remote_host (a string) and remote_port (an int); got %s: computing the prompt here",
        request.request_id,
        {key: params.get(key) for key in ("transfer_id", "remote_host", "remote_port")},
    )
    return None
