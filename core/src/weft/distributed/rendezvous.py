"""The TCP store every rank meets at, and what the engine publishes in it.

Node 0's engine core serves the store (torch.distributed's ``TCPStore``) unless
torchrun's agent already does; worker processes and the launchers of other nodes
connect to it. The engine writes the addresses of its step channel there and a
digest of its configuration (a node started with a different one is refused);
torch.distributed's own rendezvous uses the same store under another prefix.
"""

from __future__ import annotations

import datetime
import hashlib
from typing import Any

import msgspec

from weft.config import WeftConfig
from weft.distributed.placement import Placement


class StoreAddress(msgspec.Struct, frozen=True):
    host: str
    port: int
    prefix: str
    timeout: float


def serve_store(placement: Placement, timeout: float) -> tuple[Any, StoreAddress]:
    """The engine's store (a server on node 0, or a client of torchrun's agent store) and its address."""
    from torch.distributed import PrefixStore, TCPStore

    expire = datetime.timedelta(seconds=timeout)
    if placement.agent_store:
        assert placement.master_port is not None
        store = TCPStore(placement.master_addr, placement.master_port, is_master=False, timeout=expire)
        port = placement.master_port
    else:
        try:
            store = TCPStore(
                placement.master_addr if placement.nnodes == 1 else "0.0.0.0", placement.master_port or 0,
                is_master=True, timeout=expire, wait_for_workers=False,
            )
        except (RuntimeError, OSError) as error:
            raise RuntimeError(
                f"cannot serve the rendezvous store on port {placement.master_port}: {error}; "
                f"choose a free engine.distributed.master_port"
            ) from error
        port = store.port
    address = StoreAddress(placement.master_addr, port, placement.run_id, timeout)
    return PrefixStore(placement.run_id, store), address


def connect_store(address: StoreAddress) -> Any:
    """A client of the store at ``address`` (waits for it up to the address's timeout)."""
    from torch.distributed import PrefixStore, TCPStore

    store = TCPStore(address.host, address.port, is_master=False, timeout=datetime.timedelta(seconds=address.timeout))
    return PrefixStore(address.prefix, store)


def config_digest(config: WeftConfig) -> str:
    """What every node must agree on: the model, the plugins chosen, the engine and plugin options
    (``[engine.distributed]`` says where each node is, so it differs between nodes)."""
    engine = msgspec.structs.replace(config.engine, distributed=type(config.engine.distributed)())
    fields = {"model": config.model, "use": config.use, "engine": engine, "plugins": config.plugins}
    return hashlib.sha256(msgspec.json.encode(fields, order="sorted")).hexdigest()[:16]


def distributed_store(store: Any) -> Any:
    """The part of ``store`` torch.distributed's process groups use."""
    from torch.distributed import PrefixStore

    return PrefixStore("torch.distributed", store)
