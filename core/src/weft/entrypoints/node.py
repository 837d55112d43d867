"""The launcher of a node other than node 0: ``weft serve`` there runs this node's workers for node 0's engine.

It first verifies this node's installed plugins against the plugin lock its configuration
names (:mod:`weft.plugins.lock`), before it loads anything. Then it connects to node 0's
store (waiting for it up to ``engine.distributed.worker_timeout``), refuses to start when
its configuration differs from node 0's, starts one worker
process per local rank, then watches: every second it tells the engine its node is
alive, reports a worker that died (rank and cause) and stops the others, and stops
them too when node 0 is gone. It exits 0 when its workers stopped because the
engine shut down, 1 otherwise.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import msgspec

from weft.config import ConfigError, WeftConfig
from weft.distributed.messages import NodeAlive, WorkerFailed
from weft.distributed.placement import placement
from weft.distributed.rendezvous import StoreAddress, connect_store, leader_config
from weft.plugins.lock import verify_plugin_lock

logger = logging.getLogger("weft.distributed")

HEARTBEAT_SECONDS = 1.0
SHUTDOWN_GRACE_SECONDS = 10.0


def run_node(config: WeftConfig) -> int:
    """Run this node's workers until node 0's engine shuts down; returns the exit status."""
    verify_plugin_lock(config)  # this node's own installation, before torch, the store or any worker
    import torch.multiprocessing as torch_mp
    import zmq

    from weft.distributed.workers import exit_cause
    from weft.resolve import parallel_layout
    from weft.runner.worker_process import run_worker

    where = placement(config)
    if where.node_rank == 0:
        raise ConfigError("engine.distributed.node_rank = 0 runs the engine itself; run_node is for the other nodes")
    assert where.master_port is not None
    ranks = where.node_ranks()
    address = StoreAddress(where.master_addr, where.master_port, where.run_id, config.engine.distributed.worker_timeout)
    logger.info(
        "node %d of %d: ranks %d-%d, waiting for node 0 at %s:%d",
        where.node_rank,
        where.nnodes,
        ranks.start,
        ranks.stop - 1,
        where.master_addr,
        where.master_port,
    )
    store = connect_store(address)
    context = zmq.Context()
    results = context.socket(zmq.PUSH)
    results.connect(store.get("results").decode())
    encoder = msgspec.msgpack.Encoder()
    try:
        config = leader_config(store, config)
    except ValueError as error:
        results.send(encoder.encode(WorkerFailed(ranks.start, f"(node {where.node_rank}) {error}")))
        results.close(linger=2000)
        context.term()
        raise ConfigError(str(error)) from None
    layout = parallel_layout(config)
    spawn = torch_mp.get_context("spawn")
    processes: dict[int, Any] = {}
    for local_rank, rank in enumerate(ranks):
        process = spawn.Process(
            target=run_worker,
            args=(config, layout.at_rank(rank), local_rank, address, os.getpid()),
            name=f"weft-worker-{rank}",
            daemon=True,
        )
        process.start()
        processes[rank] = process
    status = 0
    try:
        while any(process.exitcode is None for process in processes.values()):
            results.send(encoder.encode(NodeAlive(where.node_rank)))
            died = {rank: process for rank, process in processes.items() if process.exitcode not in (None, 0)}
            if died:
                rank, process = next(iter(died.items()))
                cause = f"(pid {process.pid}, on node {where.node_rank}) {exit_cause(process.exitcode)}"
                results.send(encoder.encode(WorkerFailed(rank, cause)))
                logger.error("worker rank %d %s; stopping this node's workers", rank, cause)
                status = 1
                break
            if not _node_zero_alive(store) and not _ended_with_the_engine(processes.values()):
                logger.error("node 0 is gone; stopping this node's workers")
                status = 1
                break
            time.sleep(HEARTBEAT_SECONDS)
    finally:
        for process in processes.values():
            if process.exitcode is None:
                process.kill()
            process.join(timeout=10)
        results.close(linger=1000)
        context.term()
    return status


def _ended_with_the_engine(processes: Any) -> bool:
    """Whether the workers all exit cleanly within a grace period: an engine that shut down told them to
    stop just before its store went away, so they may still be on their way out."""
    deadline = time.monotonic() + SHUTDOWN_GRACE_SECONDS
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
    return all(process.exitcode == 0 for process in processes)


def _node_zero_alive(store: Any) -> bool:
    try:
        store.check(["config"])
    except Exception:  # noqa: BLE001 - any failure to reach the store means node 0 is gone
        return False
    return True
