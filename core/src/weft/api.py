"""What a plugin may import from weft-core besides :mod:`weft.contracts`: one list, versioned with the contracts.

The contracts say what a plugin implements; this module lists the parts of core a plugin may build on: the
implementations it may subclass or wrap (the Hugging Face tokenizer, the safetensors loader), the layers and the
kernel warm-up a model family builds from, the worker entry points an executor launches, and the lock, resolution
and configuration helpers an executor or a plugin's command line runs. A plugin imports core through
``weft.contracts`` and ``weft.api`` only (``tests/test_layering.py`` checks the in-tree ones); every other module
of core may change in any release.

Versioning: these names follow :data:`weft.contracts.CORE_API` as the contracts do. A minor release only adds
names (or arguments with defaults); a name is removed or changes its meaning only in a major release. A plugin
that imports a name declares the core API that added it in its requirement on ``weft-core``
(``weft-core>=1.14,<2``: this module came with 1.14).

Each name loads its module on first use (:data:`NAMES` says which), so importing ``weft.api`` is as cheap as
importing ``weft``: a plugin loaded in the API server's process pulls in no torch unless it uses a name that does.
"""

from __future__ import annotations

import importlib
from typing import Any

from weft._version import __version__

NAMES: dict[str, tuple[str, str]] = {
    # Implementations to subclass or wrap.
    "HFTokenizer": ("weft.builtins.hf_tokenizer", "HFTokenizer"),
    "eos_ids_of": ("weft.builtins.hf_tokenizer", "eos_ids_of"),
    "SafetensorsLoader": ("weft.builtins.safetensors_loader", "SafetensorsLoader"),
    "SafetensorsSlice": ("weft.builtins.safetensors_loader", "SafetensorsSlice"),
    "cast": ("weft.builtins.safetensors_loader", "cast"),
    "weight_files": ("weft.hub", "weight_files"),
    "COMMIT": ("weft.hub", "COMMIT"),
    "marker_overlap": ("weft.builtins.tool_parsers", "marker_overlap"),
    # Reference ops an op implementation checks its inputs with, or falls back to.
    "DecodeTopKTorch": ("weft.builtins.decode_topk", "DecodeTopKTorch"),
    "check_decode_topk_inputs": ("weft.builtins.decode_topk", "check_inputs"),
    "check_bitmask_argmax_inputs": ("weft.builtins.bitmask_argmax", "check_inputs"),
    "qk_norm_rotary": ("weft.builtins.ops", "qk_norm_rotary"),
    # The host: the CPUs this process may use (affinity and cgroup quota), for sizing threads and processes.
    "usable_cpus": ("weft.host", "usable_cpus"),
    # Layers a model family builds from.
    "ForwardContext": ("weft.layers.attention", "ForwardContext"),
    "MultimodalBatch": ("weft.layers.multimodal", "MultimodalBatch"),
    "merge_multimodal_embeddings": ("weft.layers.multimodal", "merge_multimodal_embeddings"),
    "Linear": ("weft.layers.linear", "Linear"),
    "default_dtype": ("weft.layers.linear", "default_dtype"),
    "rms_norm": ("weft.layers.norm", "rms_norm"),
    "apply_rotary": ("weft.layers.rotary", "apply_rotary"),
    "current_op": ("weft.layers.ops", "current_op"),
    "using_ops": ("weft.layers.ops", "using_ops"),
    "ColumnParallelLinear": ("weft.layers.tensor_parallel", "ColumnParallelLinear"),
    "RowParallelLinear": ("weft.layers.tensor_parallel", "RowParallelLinear"),
    "ParallelLMHead": ("weft.layers.tensor_parallel", "ParallelLMHead"),
    "VocabParallelEmbedding": ("weft.layers.tensor_parallel", "VocabParallelEmbedding"),
    "Shard": ("weft.layers.tensor_parallel", "Shard"),
    "copy_checked": ("weft.layers.tensor_parallel", "copy_checked"),
    "FusedMoE": ("weft.layers.moe", "FusedMoE"),
    "MoEActivation": ("weft.layers.moe", "MoEActivation"),
    "MoERouting": ("weft.layers.moe", "MoERouting"),
    "select_experts": ("weft.layers.moe", "select_experts"),
    "ExpertParallelExchange": ("weft.layers.moe", "ExpertParallelExchange"),
    "moe": ("weft.layers.moe", "moe"),
    "grouped_mm_runs": ("weft.layers.moe", "grouped_mm_runs"),
    # Core's Llama family, for a family whose language model is a Llama (a vision-language model's).
    "LlamaFamily": ("weft.models.llama", "LlamaFamily"),
    "LlamaForCausalLM": ("weft.models.llama", "LlamaForCausalLM"),
    "LlamaSettings": ("weft.models.llama", "LlamaSettings"),
    # Start-up progress a loader reports (a bar while it converts, one line per step).
    "bar": ("weft.progress", "bar"),
    "human_bytes": ("weft.progress", "human_bytes"),
    "report": ("weft.progress", "report"),
    # The KV-cache manager, for a model's reference implementation that allocates its own blocks.
    "KVCacheManager": ("weft.engine.core.kv_cache_manager", "KVCacheManager"),
    # A model-owning speculator's forwards over its own KV-cache groups: the runner's batch builder (core API 1.16).
    "InputBuilder": ("weft.runner.batch_inputs", "InputBuilder"),
    "known_only": ("weft.runner.batch_inputs", "known_only"),
    "greedy_in_vocabulary": ("weft.builtins.draft_speculator", "greedy_in_vocabulary"),
    # Kernel warm-up: the kernels a model or an op launches, compiled before the first request.
    "Kernel": ("weft.kernels.warmup", "Kernel"),
    "CompileKey": ("weft.kernels.warmup", "CompileKey"),
    "InputSpace": ("weft.kernels.warmup", "InputSpace"),
    "Choice": ("weft.kernels.warmup", "Choice"),
    "IntRange": ("weft.kernels.warmup", "IntRange"),
    "Zipped": ("weft.kernels.warmup", "Zipped"),
    "register": ("weft.kernels.warmup", "register"),
    "RuntimeMonitor": ("weft.kernels.warmup", "RuntimeMonitor"),
    "compile_many": ("weft.kernels.warmup", "compile_many"),
    # Parallel state and the worker entry points an executor launches.
    "ParallelGroups": ("weft.distributed.state", "ParallelGroups"),
    "current_parallel": ("weft.distributed.state", "current_parallel"),
    "using_parallel": ("weft.distributed.state", "using_parallel"),
    "placement": ("weft.distributed.placement", "placement"),
    "StoreAddress": ("weft.distributed.rendezvous", "StoreAddress"),
    "connect_store": ("weft.distributed.rendezvous", "connect_store"),
    "check_layout": ("weft.distributed.workers", "check_layout"),
    "merge_worker_info": ("weft.distributed.workers", "merge_worker_info"),
    "build_worker": ("weft.runner.worker_process", "build_worker"),
    "resolve_dtype": ("weft.resolve", "resolve_dtype"),
    # Plugins, their lock, and the resolution of a configuration into them.
    "PluginRegistry": ("weft.plugins.registry", "PluginRegistry"),
    "PluginError": ("weft.plugins.errors", "PluginError"),
    "problems_reported_by_parent": ("weft.plugins.registry", "problems_reported_by_parent"),
    "select_platform": ("weft.plugins.selection", "select_platform"),
    "NamedLock": ("weft.plugins.lock", "NamedLock"),
    "configured_lock": ("weft.plugins.lock", "configured_lock"),
    "verify_installed": ("weft.plugins.lock", "verify_installed"),
    "build_platform": ("weft.resolve", "build_platform"),
    "build_loader": ("weft.resolve", "build_loader"),
    "load_family": ("weft.resolve", "load_family"),
    "load_config_for": ("weft.resolve", "load_config_for"),
    "model_config": ("weft.resolve", "model_config"),
    "parallel_layout": ("weft.resolve", "parallel_layout"),
    # The configuration, and the command line's way to read one (for a plugin's own subcommand).
    "ConfigError": ("weft.config", "ConfigError"),
    "plugin_options": ("weft.config", "plugin_options"),
    "add_config_arguments": ("weft.cli", "add_config_arguments"),
    "config_from_args": ("weft.cli", "config_from_args"),
}
"""Each name of the plugin API -> the module that defines it and its name there."""

__all__ = ["NAMES", "__version__", *NAMES]


def __getattr__(name: str) -> Any:
    # Not cached in this module's namespace: a name reads its module's current binding, as a direct import would.
    try:
        module, attribute = NAMES[name]
    except KeyError:
        raise AttributeError(
            f"module 'weft.api' has no attribute {name!r}: it is not part of weft-core's plugin API. "
            f"A plugin imports core only from weft.contracts and weft.api (see docs/plugin-authors.md)"
        ) from None
    return getattr(importlib.import_module(module), attribute)


def __dir__() -> list[str]:
    return sorted(__all__)
