"""``weft weights serve``: one node's launcher of weight-cache daemons, one daemon per local device.

Contributed to the ``weft`` command through the ``weft_cli_commands`` hook; importing this module
imports neither torch nor the daemon (they load when the command runs).

Ranks across nodes follow torch.distributed's layout: a node's devices take consecutive global
ranks (``global = node_rank * devices_per_node + local index``), tensor-parallel ranks innermost, so
``global = (dp_rank * pp + pp_rank) * tp + tp_rank`` (``dp_rank * tp + tp_rank`` without pipeline
parallelism) and the local rank is the device index. IPC handles are node-local, so every node runs
its own launcher for its own devices; when the daemons number more than one they form their own
process group (gloo on CPUs, NCCL on GPUs) at ``--master-addr:--rendezvous-port``, a port that must be
the same on every node and differ from the engine's, to read the checkpoint together (a collective
disk loader such as fastsafetensors splits the reading over them) and to check that every node holds
the same checkpoint.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from weft.contracts.hooks import CliCommand, hookimpl


@hookimpl
def weft_cli_commands() -> list[CliCommand]:
    return [
        CliCommand(
            name="weights",
            help="weight-cache daemons: keep weights resident for fast engine starts",
            add_arguments=add_arguments,
            run=run,
        )
    ]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from weft.api import add_config_arguments

    commands = parser.add_subparsers(title="weights commands", metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="load the configured model's weights on each local device and serve them to engines",
        description='Load weights once per local device and serve them to engines (use.loader = "weight-cache").',
    )
    add_config_arguments(serve)
    daemon = serve.add_argument_group("daemons")
    daemon.add_argument(
        "--devices", help="local device indices to serve, comma separated (default: every GPU; on the CPU: 0)"
    )
    daemon.add_argument("--socket-dir", help="socket folder (default: plugins.weight-cache.socket_dir)")
    daemon.add_argument(
        "--rendezvous-port",
        type=int,
        help="the daemons' port on engine.distributed.master_addr, the "
        "same on every node, not the engine's (default: plugins.weight-cache.rendezvous_port)",
    )
    serve.set_defaults(weights_command=run_serve)


def run(args: argparse.Namespace) -> int:
    command = getattr(args, "weights_command", None)
    if command is None:
        print("usage: weft weights serve [options]  (weft weights serve --help)", file=sys.stderr)
        return 2
    return command(args)


class Layout:
    """Where each of this node's daemons sits among all daemons."""

    def __init__(self, nnodes: int, node_rank: int, devices: list[int], tp: int, pp: int) -> None:
        if not 0 <= node_rank < nnodes:
            raise ValueError(f"--node-rank {node_rank}: must be in 0..{nnodes - 1} (--nnodes {nnodes})")
        self.nnodes, self.node_rank, self.devices, self.tp, self.pp = nnodes, node_rank, devices, tp, pp
        self.world = nnodes * len(devices)
        if self.world % (tp * pp):
            raise ValueError(
                f"{nnodes} node(s) x {len(devices)} device(s) = {self.world} daemons, not a multiple of tp {tp} x pp "
                f"{pp}; serve as many devices as the engines use"
            )

    def ranks(self, local_index: int) -> dict[str, int]:
        """The LoadConfig ranks of the daemon on this node's ``local_index``-th device."""
        rank = self.node_rank * len(self.devices) + local_index
        return {
            "tensor_parallel_size": self.tp,
            "tensor_parallel_rank": rank % self.tp,
            "pipeline_parallel_size": self.pp,
            "pipeline_parallel_rank": (rank // self.tp) % self.pp,
            "data_parallel_rank": rank // (self.tp * self.pp),
            "local_rank": self.devices[local_index],
        }


def run_serve(args: argparse.Namespace) -> int:
    from weft.api import ConfigError, PluginError, config_from_args, placement, plugin_options
    from weft_weight_cache.loader import WeightCacheOptions, socket_dir

    _log_to_stderr()
    try:
        config, _ = config_from_args(args)
        options = plugin_options(config, WeightCacheOptions, "loader", "weight-cache")
        devices = _devices(args.devices, config)
        # Nodes, this node's rank and where they meet: the engine's own settings ([engine.distributed], the
        # --nnodes/--node-rank/--master-addr flags, or torchrun's variables), so daemons and engines agree.
        # The daemons meet on their own rendezvous port, never the engines' master port: placement's check
        # that several nodes know a master port is the engines' concern.
        port = args.rendezvous_port or options.rendezvous_port
        where = placement(config, {**os.environ, "MASTER_PORT": os.environ.get("MASTER_PORT", str(port))})
        layout = Layout(
            where.nnodes,
            where.node_rank,
            devices,
            config.engine.tensor_parallel_size,
            config.engine.pipeline_parallel_size,
        )
        if layout.world > 1 and os.environ.get("MASTER_PORT") == str(port):
            raise ValueError(
                f"--rendezvous-port {port} is the engine's MASTER_PORT: the daemons' process group needs a port of its "
                "own (the same on every node)"
            )
        folder = Path(args.socket_dir).expanduser() if args.socket_dir else socket_dir(options)
    except (ConfigError, PluginError, ValueError) as error:
        print(f"weft weights: error: {error}", file=sys.stderr)
        return 1
    plan = dict(
        config=config, options=options, layout=layout, master=f"tcp://{where.master_addr}:{port}", folder=folder
    )
    if len(devices) == 1:
        return serve_device(local_index=0, **plan)
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    children = [context.Process(target=_child, kwargs=dict(local_index=index, **plan)) for index in range(len(devices))]
    for child in children:
        child.start()
    previous = signal.signal(signal.SIGTERM, lambda *_: _stop(children))
    try:
        for child in children:
            child.join()
    except KeyboardInterrupt:
        _stop(children)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return max((child.exitcode or 0) for child in children)


def _stop(children: list[Any]) -> None:
    for child in children:
        if child.is_alive():
            child.terminate()


def _child(**plan: Any) -> None:
    sys.exit(serve_device(**plan))


def _devices(text: str | None, config: Any) -> list[int]:
    if text:
        try:
            return [int(part) for part in text.split(",")]
        except ValueError:
            raise ValueError(f"--devices {text!r}: give device indices separated by commas, e.g. 0,1") from None
    from weft.api import PluginRegistry, build_platform

    if build_platform(PluginRegistry(), config).device_type == "cuda":
        import torch

        return list(range(torch.cuda.device_count()))
    return [0]


def serve_device(config: Any, options: Any, layout: Layout, master: str, folder: Path, local_index: int) -> int:
    """Load this device's weights and serve them until SIGTERM or Ctrl-C; the exit status."""
    from weft.api import PluginRegistry, build_platform, load_config_for
    from weft_weight_cache.daemon import WeightCacheServer, load_resident
    from weft_weight_cache.key import device_identity, socket_name
    from weft_weight_cache.safety import DeviceLock, SafetyError, prepare_socket_dir

    _log_to_stderr()
    ranks = layout.ranks(local_index)
    rank = layout.node_rank * len(layout.devices) + local_index
    lock = server = resident = None
    try:
        platform = build_platform(PluginRegistry(), config)
        device = str(platform.device(ranks["local_rank"]))
        if platform.device_type == "cuda":
            import torch

            torch.cuda.set_device(ranks["local_rank"])
        identity = device_identity(device, ranks["local_rank"])
        prepare_socket_dir(folder)
        lock = DeviceLock(folder, socket_name(identity).removesuffix(".sock"))
        load_config = load_config_for(config, device, **ranks)
        if layout.world > 1:
            _join_daemon_group(master, rank, layout.world, platform.device_type)
        key, resident = load_resident(config, load_config, options.disk_loader)
        if layout.world > 1:
            _check_same_checkpoint(key, rank)
        server = WeightCacheServer(key, resident, identity, folder / socket_name(identity), options.max_frame_bytes)
    except (SafetyError, ValueError, OSError, RuntimeError) as error:
        print(f"weft weights: error (rank {rank}): {error}", file=sys.stderr, flush=True)
        return 1
    finally:
        if layout.world > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
    line = (
        f"weft weights: serving {config.model} (this rank's parts of "
        f"{sum(bool(entry.parts) for entry in resident.entries)} tensors, {resident.nbytes / 2**20:.1f} MiB, "
        f"{key.dtype}) for rank {rank} of {layout.world} (tp {ranks['tensor_parallel_rank']}/{layout.tp}, pp "
        f"{ranks['pipeline_parallel_rank']}/{layout.pp}) on {identity} at {server.socket_path}\n"
    )
    # One write: the slots' processes share stdout, and print() may send the text and its newline apart, so
    # another slot's line could land between them (a pipe keeps a write of under 4 KiB whole).
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), line.encode())

    def stop(*_: Any) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    try:
        server.serve_forever()
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        server.close()
        resident.close()
        lock.close()
    return 0


def _join_daemon_group(master: str, rank: int, world: int, device_type: str) -> None:
    import datetime

    import torch.distributed as dist

    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(
        backend, init_method=master, rank=rank, world_size=world, timeout=datetime.timedelta(minutes=10)
    )


def _check_same_checkpoint(key: Any, rank: int) -> None:
    """Every daemon must hold the same checkpoint (fingerprint, architecture, dtype, Weft version)."""
    import torch.distributed as dist

    mine = (key.fingerprint, key.architecture, key.dtype, key.weft_version)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    differing = [other for other, theirs in enumerate(everyone) if theirs != everyone[0]]
    if differing:
        raise ValueError(
            f"daemon ranks {differing} hold another checkpoint than rank 0 (fingerprint, architecture, dtype, "
            f"Weft version: {everyone[differing[0]]} against {everyone[0]}); give every node the same model"
        )


def _log_to_stderr() -> None:
    """The daemon's own log (leases, refusals) on stderr at INFO, whatever handlers or levels imported
    libraries left on the root logger (on the GPU machine the daemon's log came out empty without this)."""
    package = logging.getLogger("weft.weight_cache")
    if package.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
    package.addHandler(handler)
    package.setLevel(logging.INFO)
    package.propagate = False
