"""Building the engine core: from a configuration to an :class:`~weft.engine.core.engine_core.EngineCore` ready to step.

:func:`build_engine_core` does everything once, in this order: the plugin-lock
check, the hooks (``weft_configure``), the platform's engine defaults and the
derived options (:func:`weft.resolve.resolve_engine_config`), the executor
(``engine.distributed_executor_backend``) and its workers' model
(:meth:`~weft.contracts.executor.Executor.load_model`: the workers choose their
ops, load the weights and report their KV-cache groups and memory), the model
source and its context length, the KV connector's scheduler role, the KV-cache
size (:func:`num_kv_blocks`), the workers' caches
(:meth:`~weft.contracts.executor.Executor.initialize_kv_cache`: allocation,
kernel warm-up, graph capture), the KV-cache manager, structured outputs, the
scheduler and the choice of asynchronous scheduling. It hands the built parts to
the core, which only steps them, then calls ``weft_engine_started``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from weft.config import WeftConfig, executor_name
from weft.contracts.kv_cache import KVCacheGroupSpec
from weft.contracts.loader import ModelSource
from weft.engine.core.encoder_cache import EncoderCache
from weft.engine.core.engine_core import EngineCore
from weft.engine.core.kv_cache_manager import KVCacheManager
from weft.engine.core.kv_connector import SchedulerConnector
from weft.engine.core.scheduler import Scheduler
from weft.engine.core.structured_output import StructuredOutputManager
from weft.plugins import PluginRegistry
from weft.plugins.lock import verify_plugin_lock
from weft.resolve import (
    architecture_of,
    build_platform,
    choose_quantization,
    load_executor,
    load_kv_connector,
    max_model_len,
    options_for,
    resolve_dtype,
    resolve_engine_config,
    resolve_source,
)

logger = logging.getLogger("weft.engine")


def build_engine_core(config: WeftConfig, registry: PluginRegistry | None = None) -> EngineCore:
    """The engine core for ``config``, its model loaded and its KV cache allocated (see the module docstring)."""
    verify_plugin_lock(config)  # refuse an installed plugin set that differs from the configured lock
    started = time.monotonic()
    registry = registry or PluginRegistry()
    hooks = registry.hooks()
    hooks.hook.weft_configure(config=config)
    platform = build_platform(registry, config)
    config = resolve_engine_config(config, registry, platform)
    engine = config.engine
    name = executor_name(engine)
    executor_class = load_executor(registry, engine)
    executor = executor_class(options_for(config, "executor", executor_class, name), config, registry)
    connector = None
    try:
        info = executor.load_model()
        _, source = resolve_source(registry, config)
        context_length = max_model_len(config, source)
        loaded = load_kv_connector(registry, config, source)
        if loaded is not None:
            connector_class, options, context = loaded
            connector = SchedulerConnector(
                connector_class, options, info.groups, context, load_timeout=config.engine.kv_load_timeout
            )
        shares = connector.scheduler_side.kv_cache_shares() if connector is not None else None
        num_blocks = num_kv_blocks(
            config,
            info.groups,
            context_length,
            info.available_kv_bytes,
            shares,
            connector.name if connector is not None else None,
        )
        executor.initialize_kv_cache(num_blocks)
        kv_cache_manager = KVCacheManager(info.groups, num_blocks, engine.enable_prefix_caching)
        structured_outputs = StructuredOutputManager(config, registry, source, source.hf_config.get("vocab_size"))
        scheduler = Scheduler(
            kv_cache_manager,
            engine.max_num_seqs,
            engine.max_num_batched_tokens,
            context_length,
            engine.enable_chunked_prefill,
            connector,
            engine.long_prefill_token_threshold,
            engine.max_long_partial_prefills,
            structured_outputs,
            engine.speculative.num_speculative_tokens if engine.speculative.enabled else 0,
            _speculator_owns_model(registry, config),
        )
        scheduler.encoder_cache = EncoderCache(
            engine.encoder_cache_size or engine.max_num_batched_tokens,
            info.reads_images,
            architecture_of(config, source),
        )
    except BaseException:
        if connector is not None:
            connector.close()  # a store client, a side channel: its scheduler role's resources
        executor.shutdown()  # its workers may be processes: don't leave them behind
        raise
    async_scheduling = bool(engine.async_scheduling) and executor_class.supports_async_output
    if async_scheduling and connector is not None:  # resolve_engine_config turned it off already
        async_scheduling = False
    quantization, _ = choose_quantization(registry, config, platform, source.format, resolve_dtype(config, platform))
    startup = startup_facts(config, platform, source, info.groups, num_blocks, context_length, quantization)
    core = EngineCore(config, hooks, executor, scheduler, source, num_blocks, async_scheduling, startup)
    logger.debug(
        "engine core ready in %.1f s: %s blocks, max_num_seqs %d, max_num_batched_tokens %d, async scheduling %s",
        time.monotonic() - started,
        num_blocks,
        engine.max_num_seqs,
        engine.max_num_batched_tokens,
        "on" if async_scheduling else "off",
    )
    hooks.hook.weft_engine_started(engine=core)
    return core


def startup_facts(
    config: WeftConfig,
    platform: Any,
    source: ModelSource,
    groups: Sequence[KVCacheGroupSpec],
    num_blocks: list[int],
    max_model_len: int,
    quantization: str = "none",
) -> dict[str, Any]:
    """What the startup summary says about the engine (:func:`weft.progress.summary_lines`).
    ``quantization``: the ``weft.quantization`` method the linear layers run (``none``: dense weights).

    ``cpu_isa``: on the CPU, its instruction sets for GEMMs and the GEMM dtype chosen (:mod:`weft.runner.cpu_isa`).
    ``kv_capacity_tokens``: the tokens the cache holds, set by the groups whose blocks run out as a sequence
    grows (a sliding window's ring keeps a fixed number of blocks per request and sets no limit)."""
    limits = [
        count * group.spec.block_size
        for group, count in zip(groups, num_blocks, strict=False)
        if group.spec.blocks_for_tokens(count * group.spec.block_size + 1) > count
    ]
    return {
        "model": source.name,
        "architecture": ", ".join(source.hf_config.get("architectures") or ["?"]),
        "weights_format": source.format,
        "weights_file": Path(source.path).name,
        "platform": platform.name,
        "cpu_isa": cpu_isa_line() if platform.device_type == "cpu" else None,
        "dtype": resolve_dtype(config, platform),
        "quantization": quantization,
        "block_size": config.engine.block_size,
        "max_model_len": max_model_len,
        "kv_capacity_tokens": min(limits) if limits else None,
    }


def num_kv_blocks(
    config: WeftConfig,
    groups: Sequence[KVCacheGroupSpec],
    max_model_len: int,
    available_bytes: int,
    shares: tuple[float, ...] | None = None,
    connector_name: str | None = None,
) -> list[int]:
    """Blocks of each group: ``engine.num_kv_blocks``, else the available bytes split between the groups.

    The split is by need: each group gets bytes in proportion to what one request of
    ``max_model_len`` tokens holds of it, so every group runs out at the same number of
    full-length requests (a hybrid model's ring or recurrent state takes a few blocks a
    request, its compressed entries many). ``shares`` (the KV connector ``connector_name``'s,
    :meth:`~weft.contracts.kv_connector.KVConnector.kv_cache_shares`) weigh that split per
    group: 1.0 keeps a group's need, 0.1 gives it a tenth of it (its blocks live elsewhere).
    Refuses a cache that cannot hold one request of ``max_model_len`` tokens."""
    engine = config.engine
    if engine.num_kv_blocks is not None:
        counts = [engine.num_kv_blocks] * len(groups)
    else:
        if shares is None:
            shares = (1.0,) * len(groups)
        if len(shares) != len(groups) or min(shares) <= 0:
            raise ValueError(
                f"KV connector {connector_name!r} gave KV-cache shares {shares} for "
                f"{len(groups)} groups; give one positive share per group"
            )
        bytes_per_block = [group.spec.page_size_bytes() * len(group.layer_names) for group in groups]
        needs = [
            share * group.spec.blocks_for_tokens(max_model_len) * size
            for share, group, size in zip(shares, groups, bytes_per_block, strict=False)
        ]
        counts = [
            int(available_bytes * need / sum(needs)) // size for need, size in zip(needs, bytes_per_block, strict=False)
        ]
    for group, count in zip(groups, counts, strict=False):
        needed = group.spec.blocks_for_tokens(max_model_len)
        if count < needed:
            raise ValueError(
                f"the KV cache holds {count} blocks of group {group.name!r} but one request of "
                f"max_model_len {max_model_len} needs {needed}; raise engine.cpu_kv_cache_bytes "
                f"(or engine.num_kv_blocks) or lower engine.max_model_len"
            )
    return counts


def _speculator_owns_model(registry: PluginRegistry, config: WeftConfig) -> bool:
    """Whether ``[engine.speculative]``'s speculator runs a model of its own (its KV goes ``k`` slots ahead)."""
    speculative = config.engine.speculative
    return speculative.enabled and bool(registry.load("speculator", speculative.method).owns_model)


def cpu_isa_line() -> str:
    """This host's GEMM instruction sets and the dtype batch GEMMs take from them (:mod:`weft.runner.cpu_isa`)."""
    from weft.runner.cpu_isa import describe, detect

    return describe(detect())
