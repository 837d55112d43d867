"""The Mooncake store client one connector role uses, and what it does while the master is away.

A call to an unreachable master fails with ``RPC_FAIL`` after Mooncake's own
connection timeout (about 4 s). The first such failure marks the store
unavailable and logs a warning; from then on the connector skips the store at
once (lookups find nothing, saves are dropped, loads fail over to recomputation)
while a background thread probes the master every ``probe_interval`` seconds.
The first successful probe makes the store available again: a restarted master
is picked up without restarting the engine.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

logger = logging.getLogger("weft.mooncake")

RPC_FAIL = -900
"""Mooncake's error code for a call that could not reach the master."""
OBJECT_NOT_FOUND = -704

_PROBE_KEY = "weft/probe"
_Result = TypeVar("_Result")


def import_store_class() -> type:
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as error:
        from weft_mooncake.system import explain_import_error

        raise ImportError(explain_import_error(error)) from error
    return MooncakeDistributedStore


class StoreClient:
    """One ``MooncakeDistributedStore`` connection, with outage detection and reconnection probes."""

    def __init__(
        self,
        *,
        local_hostname: str,
        metadata_server: str,
        global_segment_size: int,
        local_buffer_size: int,
        protocol: str,
        device_name: str,
        master_server_address: str,
        probe_interval: float = 1.0,
    ) -> None:
        self.master_server_address = master_server_address
        self.probe_interval = probe_interval
        store_class = import_store_class()
        host, _, port = master_server_address.rpartition(":")
        try:  # Mooncake's setup retries an absent master for about 90 s: answer at once instead
            socket.create_connection((host, int(port)), timeout=5).close()
        except OSError as error:
            raise ConnectionError(
                f"weft-mooncake cannot reach mooncake_master at master_server_address = {master_server_address!r} "
                f"({error.strerror or error}); start it (mooncake_master --rpc_port={port} ...) or fix the address"
            ) from None
        self.store = store_class()
        status = self.store.setup(
            local_hostname,
            metadata_server,
            global_segment_size,
            local_buffer_size,
            protocol,
            device_name,
            master_server_address,
        )
        if status != 0:
            raise ConnectionError(
                f"weft-mooncake could not join the Mooncake store (setup returned {status}) with "
                f"master_server_address = {master_server_address!r}, metadata_server = {metadata_server!r}, "
                f"protocol = {protocol!r}: check that mooncake_master runs there (with "
                f"--enable_http_metadata_server=true for an http:// metadata_server)"
            )
        self._lock = threading.Lock()
        self._available = True
        self._closed = False
        self._prober: threading.Thread | None = None

    @property
    def available(self) -> bool:
        return self._available

    def call(self, operation: str, function: Callable[..., _Result], *args: Any) -> _Result | None:
        """``function(*args)`` (a method of :attr:`store`); None when the store is (or turns out to be) unavailable."""
        if not self._available or self._closed:
            return None
        result = function(*args)
        if rpc_failed(result):
            self._mark_unavailable(operation)
            return None
        return result

    def _mark_unavailable(self, operation: str) -> None:
        with self._lock:
            if not self._available or self._closed:
                return
            self._available = False
            logger.warning(
                "weft-mooncake: the Mooncake master at %s is unreachable (%s failed with RPC_FAIL); "
                "requests go on without the store, and it is probed every %.1f s",
                self.master_server_address,
                operation,
                self.probe_interval,
            )
            self._prober = threading.Thread(target=self._probe, name="weft-mooncake-probe", daemon=True)
            self._prober.start()

    def _probe(self) -> None:
        while not self._closed:
            time.sleep(self.probe_interval)
            if self._closed:
                return
            result = self.store.batch_is_exist([_PROBE_KEY])
            if result and result[0] >= 0:
                with self._lock:
                    self._available = True
                logger.warning(
                    "weft-mooncake: the Mooncake master at %s is reachable again", self.master_server_address
                )
                return

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._prober is not None:
            self._prober.join(timeout=10)
        self.store.close()


def rpc_failed(result: Any) -> bool:
    """Whether a Mooncake result (a status, or a list of per-key statuses) says the master was unreachable."""
    if isinstance(result, list):
        return any(value == RPC_FAIL for value in result)
    return result == RPC_FAIL
