"""The TCP store every rank meets at, and what the engine publishes in it.

Node 0's engine core serves the store (torch.distributed's ``TCPStore``) unless
torchrun's agent already does; worker processes and the launchers of other nodes
connect to it. The engine writes the addresses of its step channel there and its
configuration, which the workers of every node run (a node started with a different
one is refused);
torch.distributed's own rendezvous uses the same store under another prefix.
"""

from __future__ import annotations

import datetime
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
                placement.master_addr if placement.nnodes == 1 else "0.0.0.0",
                placement.master_port or 0,
                is_master=True,
                timeout=expire,
                wait_for_workers=False,
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


def shared_settings(config: WeftConfig) -> bytes:
    """What every node must agree on: the model, the plugins chosen, the engine and plugin options.
    ``[engine.distributed]`` says where each node is, and the platform-sized and derived options are
    node 0's to choose (its resolved configuration is what every worker runs), so none takes part."""
    from weft.config import DERIVED, PLATFORM_SIZED

    engine = msgspec.structs.replace(
        config.engine, distributed=type(config.engine.distributed)(), **{key: None for key in PLATFORM_SIZED + DERIVED}
    )
    fields = {"model": config.model, "use": config.use, "engine": engine, "plugins": config.plugins}
    return msgspec.json.encode(fields, order="sorted")


def publish_config(store: Any, config: WeftConfig) -> None:
    """Node 0's configuration (platform-sized options resolved), for the workers of every other node."""
    store.set("config", msgspec.msgpack.encode(config))


def leader_config(store: Any, config: WeftConfig) -> WeftConfig:
    """Node 0's configuration, once it published it; raises ValueError when ``config`` differs in what nodes share."""
    leader = msgspec.msgpack.decode(store.get("config"), type=WeftConfig)
    mine, theirs = (
        _flat(msgspec.json.decode(shared_settings(config))),
        _flat(msgspec.json.decode(shared_settings(leader))),
    )
    differing = sorted(key for key in mine.keys() | theirs.keys() if mine.get(key) != theirs.get(key))
    if differing:
        raise ValueError(
            f"this node's configuration differs from node 0's in {', '.join(differing)}; start every node with "
            f"the same weft.toml and flags (only [engine.distributed] may differ)"
        )
    return leader


def _flat(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, dict) and value:
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def distributed_store(store: Any) -> Any:
    """The part of ``store`` torch.distributed's process groups use."""
    from torch.distributed import PrefixStore

    return PrefixStore("torch.distributed", store)
