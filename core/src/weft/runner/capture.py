"""Which graphs a worker captures at warm-up, and capturing them: decode graphs where the platform, the attention
backend, the parallel layout, the speculator and the model's KV-cache groups allow (else decode runs eagerly,
and the log says why), split into nano-batches where ``engine.decode_overlap`` asks; then, with speculative
decoding, the speculator's own graphs and the verify graphs (:mod:`weft.runner.graphs`)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from weft.contracts.kv_connector import CapturedSparseEntryReader
from weft.runner.graphs import verify_graph_sizes
from weft.runner.model_runner import describe_sizes

if TYPE_CHECKING:
    from weft.config import EngineConfig
    from weft.contracts.model import ModelFamily

logger = logging.getLogger("weft.runner")


def capture_graphs(worker: Any, num_blocks: list[int]) -> None:
    """Capture ``worker``'s graphs (a :class:`~weft.runner.worker.Worker`; ``num_blocks``: a scratch block id per
    KV-cache group), unless ``engine.enforce_eager``."""
    engine = worker.config.engine
    assert worker.runner is not None
    if engine.enforce_eager:
        return
    if not worker.platform.supports_graph_capture:
        return
    if (reason := _why_decode_runs_eagerly(worker)) is not None:
        logger.info("decode runs eagerly: %s", reason)
        return
    sizes = sorted(set(engine.graph_batch_sizes or worker.platform.graph_batch_sizes(engine.max_num_seqs)))
    too_large = [size for size in sizes if size > engine.max_num_seqs]
    if too_large:
        raise ValueError(
            f"engine.graph_batch_sizes = {sizes}: {too_large} exceed engine.max_num_seqs = {engine.max_num_seqs}; "
            f"remove them or raise max_num_seqs"
        )
    split_from = _decode_overlap_from(engine, worker.family, sizes, worker.ops["nano_batches"])
    max_model_len = worker.model_config.max_model_len
    seconds = worker.runner.decode_graphs.capture(worker.platform, sizes, num_blocks, max_model_len, split_from)
    logger.info("captured decode graphs for batch sizes %s in %.1f s", describe_sizes(sizes), seconds)
    if worker.speculator is not None:
        _capture_speculation(worker, sizes, num_blocks)


def _why_decode_runs_eagerly(worker: Any) -> str | None:
    """Why ``worker``'s decode steps cannot be captured, on a platform that captures graphs (None: they can)."""
    assert worker.runner is not None
    paged = any(group.spec.paged_attention for group in worker.groups)
    if paged and not worker.attention.supports_graph_capture:
        return f"attention backend {worker.attention.name!r} cannot be captured in graphs"
    layout = worker.parallel.layout
    if layout.pipeline_parallel_size > 1:
        return "under pipeline parallelism (stages hand micro-batches to each other)"
    if layout.tensor_parallel_size > 1 and not worker.parallel.tensor.can_capture(getattr(torch, worker.dtype)):
        return f"the {worker.platform.distributed_backend} communicator's all-reduce cannot be captured in graphs"
    if worker.speculator is not None and worker.speculator.needs_hidden_states:
        return (
            f"speculator {worker.speculator.name!r} reads the target's hidden states, which a decode graph does not "
            "return"
        )
    managed = [group.name for group in worker.groups if not group.spec.paged_attention]
    if managed and not worker.family.captures_managed_groups(worker.model_config, worker.device):
        # The runner's static buffers hold every group's block table; a model that manages groups
        # itself (rings, compressed entries) must read them without the host to be captured.
        return f"KV-cache groups {managed} are managed by the model, which cannot be captured"
    sparse = worker.runner.sparse_entries
    if managed and sparse is not None and not isinstance(sparse, CapturedSparseEntryReader):
        return f"the KV connector reads sparse entries of groups {managed} on the host"
    return None


def _capture_speculation(worker: Any, sizes: list[int], num_blocks: list[int]) -> None:
    """The speculator's own graphs and the verify graphs, after the decode graphs (``sizes``)."""
    assert worker.runner is not None and worker.speculator is not None
    engine = worker.config.engine
    managed = [group.name for group in worker.groups if not group.spec.paged_attention]
    paged = len(managed) < len(worker.groups)
    if worker.parallel.layout.world_size == 1:  # its forwards end at its greedy tokens: a rank's logits must be whole
        draft_blocks = num_blocks[worker.num_target_groups :]
        seconds = worker.speculator.capture_graphs(
            worker.platform, verify_graph_sizes(sizes), draft_blocks, worker.model_config.max_model_len
        )
        if seconds:
            logger.info("captured speculator %r's graphs in %.1f s", worker.speculator.name, seconds)
    if managed or not (worker.attention.supports_verify_graph_capture or not paged):
        logger.info(
            "speculating steps run eagerly: %s",
            f"KV-cache groups {managed} are managed by the model"
            if managed
            else f"attention backend {worker.attention.name!r} cannot capture them",
        )
        return
    query_len = 1 + worker.speculator.config.num_speculative_tokens
    verify_sizes = verify_graph_sizes(sizes)
    seconds = worker.runner.verify_graphs.capture(
        worker.platform,
        verify_sizes,
        query_len,
        engine.max_num_batched_tokens,
        num_blocks,
        worker.model_config.max_model_len,
    )
    logger.info(
        "captured verify graphs (rows of up to %d tokens) for batch sizes %s in %.1f s",
        query_len,
        describe_sizes(verify_sizes),
        seconds,
    )


def _decode_overlap_from(engine: EngineConfig, family: ModelFamily, sizes: list[int], op: Any) -> int | None:
    """The smallest captured size that runs as two nano-batches through ``op`` (``engine.decode_overlap``); None:
    every graph runs whole."""
    if not engine.decode_overlap:
        return None
    if not family.splits_decode_batches:
        logger.info(
            "engine.decode_overlap: model family %s runs decode steps whole (it has no nano-batch path)",
            type(family).__name__,
        )
        return None
    split = [size for size in sizes if size >= engine.decode_overlap_min_batch]
    if not split:
        logger.info(
            "engine.decode_overlap: no captured decode batch reaches decode_overlap_min_batch = %d (largest %d)",
            engine.decode_overlap_min_batch,
            max(sizes),
        )
        return None
    logger.info("decode graphs of %s rows run as two nano-batches (%s)", describe_sizes(split), type(op).__name__)
    return engine.decode_overlap_min_batch
