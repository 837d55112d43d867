"""The API processes one engine core serves, and which of them each request came from.

``weft serve --api-server-count N`` runs N API processes in front of one engine core
(:mod:`weft.entrypoints.api_servers`): each binds its own pair of ZMQ sockets, and the core reads every input
socket through one PULL socket and writes to each API process on a PUSH socket of its own. A request's
:class:`~weft.engine.messages.AddRequests` names its API process (``client``); :class:`ApiClients` remembers it
until the request ends, and splits each step's :class:`~weft.engine.messages.StepOutputs` so that every API
process gets its own requests' outputs, refusals and failures, with the core's gauges (each serves ``/metrics``
and ``/health`` from them). With one API process (the default) every message goes to it unsplit.

The watchdog thread (:mod:`weft.engine.core.watchdog`) sends on sockets of its own (ZMQ sockets are not
thread-safe): :meth:`ApiClients.sibling` gives it an instance that shares the table of owners. That table is
written by the main thread only; the watchdog reads single entries (atomic under the GIL).
"""

from __future__ import annotations

from typing import Any

import msgspec

from weft.engine.messages import FromCore, StepOutputs


class ApiClients:
    """One PUSH socket per API process (connected to the address it bound), and the owner of each request."""

    def __init__(self, context: Any, addresses: list[str], owners: dict[str, int] | None = None) -> None:
        import zmq

        self._addresses = addresses
        self._sockets = []
        for address in addresses:
            socket = context.socket(zmq.PUSH)
            socket.setsockopt(zmq.SNDHWM, 0)
            socket.connect(address)
            self._sockets.append(socket)
        self._context = context
        self._encoder = msgspec.msgpack.Encoder()
        self.owners: dict[str, int] = {} if owners is None else owners
        """Request id to the index of the API process that added it (only with several API processes)."""
        self._keeps_owners = owners is not None
        """A sibling reads the owners only: the main thread forgets the requests the watchdog failed when the
        step ends (:meth:`forget`)."""

    @property
    def several(self) -> bool:
        return len(self._sockets) > 1

    def sibling(self) -> ApiClients:
        """Sockets of its own to the same API processes, sharing the owners (for another thread)."""
        return ApiClients(self._context, self._addresses, self.owners)

    def added(self, client: int, request_ids: list[str]) -> None:
        """``client`` (an index below the number of API processes) submitted these requests."""
        if self.several:
            if not 0 <= client < len(self._sockets):
                raise ValueError(f"AddRequests.client = {client}: this core serves {len(self._sockets)} API processes")
            for request_id in request_ids:
                self.owners[request_id] = client

    def forget(self, request_ids: list[str]) -> None:
        """The requests ended without an output saying so (aborted)."""
        if self.several:
            for request_id in request_ids:
                self.owners.pop(request_id, None)

    def send_all(self, message: FromCore) -> None:
        """The same message to every API process (the handshake, the core's last word)."""
        data = self._encoder.encode(message)
        for socket in self._sockets:
            socket.send(data)

    def send(self, message: StepOutputs) -> None:
        """A step's outputs, each API process getting its own requests' (and every one the gauges)."""
        if not self.several:
            self._sockets[0].send(self._encoder.encode(message))
            return
        owners = self.owners
        parts = [
            StepOutputs([], message.stats, stuck=message.stuck, heartbeat=message.heartbeat)
            for _ in range(len(self._sockets))
        ]
        for output in message.outputs:
            if output.finish_reason is None:
                parts[owners.get(output.request_id, 0)].outputs.append(output)
            else:
                parts[self._owner(output.request_id)].outputs.append(output)
        for request_id, reason in message.refused.items():
            parts[self._owner(request_id)].refused[request_id] = reason
        for request_id, reason in message.failed.items():
            parts[self._owner(request_id)].failed[request_id] = reason
        for socket, part in zip(self._sockets, parts, strict=True):
            socket.send(self._encoder.encode(part))

    def _owner(self, request_id: str) -> int:
        """Which API process a request that ends here came from (forgotten now, unless this is a sibling)."""
        if self._keeps_owners:
            return self.owners.get(request_id, 0)
        return self.owners.pop(request_id, 0)

    def close(self, linger: int) -> None:
        for socket in self._sockets:
            socket.close(linger=linger)
