"""Where this launcher sits among the model's nodes, and where the ranks meet.

``[engine.distributed]`` names it; what it leaves unset comes from torchrun's
environment when torchrun started the launcher (``GROUP_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``TORCHELASTIC_USE_AGENT_STORE``),
else from ``NODE_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``. Weft starts one worker
per device itself, so torchrun runs one process per node (``--nproc-per-node 1``).

Node ``n`` of ``nnodes`` runs ranks ``n * per_node .. (n + 1) * per_node - 1``; node 0
also runs the engine core (scheduler, API server). Every rank meets at the TCP store
on ``master_addr:master_port``: node 0 serves it, or torchrun's agent does when it
already serves one there (then every launcher is its client).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import msgspec

from weft.config import ConfigError, WeftConfig, world_size


class Placement(msgspec.Struct, frozen=True, kw_only=True):
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    """None: node 0 picks a free port (one node only)."""
    agent_store: bool = False
    """torchrun's agent serves the store on ``master_addr:master_port``; every launcher is its client."""
    run_id: str = "weft"
    """Keys in the store are under this prefix (torchrun's run id and restart count)."""
    ranks_per_node: int = 1

    def node_ranks(self, node: int | None = None) -> range:
        node = self.node_rank if node is None else node
        return range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node)

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node


def _torchrun(environ: Mapping[str, str]) -> bool:
    return "TORCHELASTIC_RUN_ID" in environ or ("GROUP_RANK" in environ and "LOCAL_WORLD_SIZE" in environ)


def placement(config: WeftConfig, environ: Mapping[str, str] | None = None) -> Placement:
    """This launcher's placement: ``[engine.distributed]`` over torchrun's (or the plain) environment."""
    environ = os.environ if environ is None else environ
    settings = config.engine.distributed
    nnodes, node_rank = settings.nnodes, settings.node_rank
    agent_store = False
    run_id = "weft"
    if _torchrun(environ):
        local = int(environ.get("LOCAL_WORLD_SIZE", "1"))
        if local != 1:
            raise ConfigError(
                f"torchrun started {local} processes on this node (LOCAL_WORLD_SIZE = {local}); Weft starts one worker "
                f"per device itself: run torchrun with --nproc-per-node 1 (one launcher per node)"
            )
        if nnodes is None:
            nnodes = int(environ.get("WORLD_SIZE", "1"))
        if node_rank is None:
            node_rank = int(environ.get("GROUP_RANK", environ.get("RANK", "0")))
        agent_store = environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        run_id = f"weft/{environ.get('TORCHELASTIC_RUN_ID', 'run')}/{environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    nnodes = nnodes or 1
    if node_rank is None:
        node_rank = int(environ.get("NODE_RANK", "0"))
    master_addr = settings.master_addr or environ.get("MASTER_ADDR") or "127.0.0.1"
    port_text = environ.get("MASTER_PORT")
    master_port = settings.master_port if settings.master_port is not None else (int(port_text) if port_text else None)
    world = world_size(config.engine)
    if node_rank >= nnodes:
        raise ConfigError(f"node rank {node_rank} but {nnodes} nodes; node ranks run from 0 to {nnodes - 1}")
    if world % nnodes:
        raise ConfigError(
            f"{world} ranks (tensor_parallel_size x pipeline_parallel_size) cannot be spread evenly over {nnodes} "
            "nodes; make the world size a multiple of engine.distributed.nnodes"
        )
    if nnodes > 1 and master_port is None:
        raise ConfigError(
            f"{nnodes} nodes need a rendezvous port known to all: set engine.distributed.master_port "
            f"(or $MASTER_PORT) to the same free port on every node"
        )
    return Placement(
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        agent_store=agent_store,
        run_id=run_id,
        ranks_per_node=world // nnodes,
    )
