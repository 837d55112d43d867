"""The cache key of a worker's weights, and the identity of its device."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from weft.api import COMMIT, __version__, weight_files
from weft.contracts.loader import LoadConfig, ModelSource
from weft.contracts.parallel import ParallelLayout
from weft_weight_cache.protocol import CacheKey


def fingerprint(folder: Path) -> str:
    """sha256 over each weight shard's name and safetensors header (reads the headers only)."""
    digest = hashlib.sha256()
    for shard in weight_files(folder):
        with open(shard, "rb") as handle:
            length_bytes = handle.read(8)
            header = handle.read(int.from_bytes(length_bytes, "little"))
        digest.update(shard.name.encode() + b"\0" + length_bytes + header)
    return digest.hexdigest()


def revision(folder: Path) -> str:
    """A Hub snapshot's commit; otherwise the folder's real path and its shards' sizes and modification
    times, so that a checkpoint rewritten in place (same names and headers, new values) never matches."""
    if folder.parent.name == "snapshots" and COMMIT.match(folder.name):
        return folder.name
    digest = hashlib.sha256()
    for shard in weight_files(folder):
        info = shard.stat()
        digest.update(f"{shard.name}:{info.st_size}:{info.st_mtime_ns}\n".encode())
    return f"local:{folder.resolve()}:{digest.hexdigest()[:16]}"


def stage_layers(source: ModelSource, load_config: LoadConfig) -> tuple[int, int] | None:
    """``(first layer, count)`` of the load's pipeline stage; None with one stage (or no layer count known)."""
    layers = source.hf_config.get("num_hidden_layers")
    if load_config.pipeline_parallel_size == 1 or not isinstance(layers, int):
        return None
    layout = ParallelLayout(
        pipeline_parallel_size=load_config.pipeline_parallel_size, pipeline_partition=load_config.pipeline_partition
    )
    held = layout.stage_layers(layers, load_config.pipeline_parallel_rank)
    return held.start, len(held)


def cache_key(source: ModelSource, load_config: LoadConfig, dtype: str) -> CacheKey:
    folder = Path(source.path)
    quantization = (source.hf_config.get("quantization_config") or {}).get("quant_method", "none")
    return CacheKey(
        fingerprint=fingerprint(folder),
        architecture=(source.hf_config.get("architectures") or ["?"])[0],
        model_config=hashlib.sha256(json.dumps(source.hf_config, sort_keys=True, default=str).encode()).hexdigest(),
        tensor_parallel_size=load_config.tensor_parallel_size,
        tensor_parallel_rank=load_config.tensor_parallel_rank,
        pipeline_parallel_size=load_config.pipeline_parallel_size,
        pipeline_parallel_rank=load_config.pipeline_parallel_rank,
        dtype=dtype,
        quantization=str(quantization),
        revision=revision(folder),
        weft_version=__version__,
        stage_layers=stage_layers(source, load_config),
        expert_parallel=load_config.enable_expert_parallel,
    )


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        import socket

        return socket.gethostname()


def device_identity(device: str, local_rank: int = 0) -> str:
    """``cuda-<GPU UUID>`` for a GPU; ``cpu<slot>@<boot id>`` for the CPU (slot: the worker's local rank)."""
    import torch

    parsed = torch.device(device)
    if parsed.type == "cuda":
        index = parsed.index if parsed.index is not None else torch.cuda.current_device()
        return f"cuda-{torch.cuda.get_device_properties(index).uuid}"
    if parsed.type == "cpu":
        return f"cpu{local_rank}@{_boot_id()}"
    raise ValueError(f"weight-cache: device {device!r} is neither a CUDA GPU nor the CPU; the cache serves those two")


def socket_name(identity: str) -> str:
    """The socket file of a device: ``cuda-<uuid>.sock``, ``cpu<slot>.sock`` (the boot id stays out of the path)."""
    return identity.partition("@")[0] + ".sock"
