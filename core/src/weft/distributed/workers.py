"""What executors share about their workers: the layout check before any starts, one report from many, how a process
ended."""

from __future__ import annotations

import signal
from typing import Any

import msgspec

from weft.contracts.executor import WorkerInfo
from weft.distributed.placement import Placement


def exit_cause(exitcode: int | None) -> str:
    """A process's end in words: ``killed by SIGKILL``, ``exited with status 1``."""
    if exitcode is None:
        return "is running"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exited with status {exitcode}"


def merge_worker_info(infos: list[WorkerInfo], layout: Any) -> WorkerInfo:
    """One :class:`WorkerInfo` for the engine from every rank's.

    Pipeline stages hold different layers: the groups list every layer, in model order, and
    the memory is what the whole model's KV cache could take when every rank fills its share
    (each rank's bytes scaled by the share of layers it holds, the least over ranks).
    """
    groups = []
    for index, group in enumerate(infos[0].groups):
        names = [name for info in infos[:: layout.tensor_parallel_size] for name in info.groups[index].layer_names]
        groups.append(msgspec.structs.replace(group, layer_names=tuple(dict.fromkeys(names))))
    total_layers = sum(len(group.layer_names) for group in groups)
    available = []
    for info in infos:
        layers = sum(len(group.layer_names) for group in info.groups)
        available.append(info.available_kv_bytes * total_layers // max(layers, 1))
    reads_images = all(info.reads_images for info in infos)
    return WorkerInfo(groups=groups, available_kv_bytes=min(available), reads_images=reads_images)


def check_layout(config: Any, registry: Any, where: Placement | None) -> None:
    """Refuse, before any worker starts, a layout the model or the devices cannot take (numbers and fix).

    ``where``: the launcher's placement, whose node must have a device per rank it runs; None when
    another scheduler (Ray) places the ranks."""
    from weft.plugins import PluginRegistry
    from weft.plugins.selection import select_platform
    from weft.resolve import load_family, model_config, resolve_source

    registry = registry or PluginRegistry()
    _, source = resolve_source(registry, config)
    family = load_family(registry, config, source)
    family.check_parallel(model_config(config, source, "float32"))
    if where is None:
        return
    platform_class, probe = select_platform(registry, config.use.platform)
    if platform_class.device_type != "cpu" and probe.device_count < where.ranks_per_node:
        engine = config.engine
        raise ValueError(
            f"engine.tensor_parallel_size x pipeline_parallel_size = {engine.tensor_parallel_size} x "
            f"{engine.pipeline_parallel_size} needs {where.ranks_per_node} devices on each of {where.nnodes} node(s), "
            f"but this node has {probe.device_count} visible {platform_class.name} device(s); lower the sizes, "
            f"or spread the ranks over more nodes (engine.distributed.nnodes)"
        )
