"""One worker: the platform's device, the model and its weights, the KV cache, the runner.

Built from the configuration alone (:mod:`weft.resolve` names the plugins), so
an executor can build it in any process. Order: :meth:`Worker.load_model`
(platform, source, family, attention backend, model, weights; kernels the model
and the backend will launch register while they are built), then
:meth:`Worker.initialize_kv_cache` (cache tensors, the KV connector's worker
role, kernel warm-up, graph capture), then :meth:`Worker.execute_model` per step.
The two building calls are the executor contract's (the engine sizes the KV cache
between them); what steps is the :class:`~weft.runner.model_runner.ModelRunner`
they build from the finished parts, to which the stepping calls hand over.

With several ranks (:mod:`weft.distributed`) each process builds one Worker with its
:class:`~weft.distributed.state.ParallelGroups`: the model holds this rank's shards
(and, under pipeline parallelism, its stage's layers), reads only those from disk when
the loader and the family can, and sizes this rank's KV cache.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import torch

from weft.config import WeftConfig
from weft.contracts.encoder_connector import EncoderConnector
from weft.contracts.executor import GrammarOutput, SchedulerOutput, StepHandle, WorkerInfo
from weft.contracts.loader import LoadConfig, WeightSlice
from weft.contracts.model import ModelFamily
from weft.contracts.speculator import DraftModel, DraftModelLoader, Speculator, SpeculatorConfig
from weft.distributed.state import SINGLE, ParallelGroups, using_parallel
from weft.kernels.warmup import KernelRegistry, RuntimeMonitor, collecting
from weft.layers.attention import Attention
from weft.layers.ops import LAYER_OPS, RUNNER_OPS, using_ops
from weft.layers.quantization import process_quantized_layers, using_quantization
from weft.plugins import PluginRegistry
from weft.plugins.selection import choose_op
from weft.progress import human_bytes, report
from weft.resolve import (
    build_platform,
    check_kv_cache_dtype,
    choose_quantization,
    draft_load_config,
    load_config_for,
    load_encoder_connector,
    load_family,
    load_kv_connector,
    model_config,
    options_for,
    resolve_dtype,
    resolve_source,
    with_kv_cache_dtype,
)
from weft.runner.capture import capture_graphs
from weft.runner.encoder import EncoderRunner
from weft.runner.kv_connector import WorkerConnector
from weft.runner.model_runner import ModelRunner
from weft.runner.sampler import Sampler

logger = logging.getLogger("weft.runner")


def _source_bytes(path: Path) -> int:
    """The size of a model file, or of the files of a model folder."""
    try:
        return (
            path.stat().st_size
            if path.is_file()
            else sum(file.stat().st_size for file in path.iterdir() if file.is_file())
        )
    except OSError:
        return 0


class Worker:
    def __init__(
        self,
        config: WeftConfig,
        registry: PluginRegistry | None = None,
        parallel: ParallelGroups = SINGLE,
        platform: Any = None,
        local_rank: int | None = None,
    ) -> None:
        """``config`` has its platform-sized engine options resolved (:func:`weft.resolve.resolve_engine_config`);
        ``parallel`` is this rank's groups (the default: one device), ``platform`` the one they were made on,
        ``local_rank`` the worker's slot on its node (default: its device's index), which tells workers
        sharing the CPU apart (a loader's per-slot state, the weight cache's socket)."""
        self.config = config
        self.registry = registry or PluginRegistry()
        self.parallel = parallel
        self.platform = platform or build_platform(self.registry, config)
        self.device = parallel.device if parallel is not SINGLE else self.platform.device()
        self.dtype = resolve_dtype(config, self.platform)
        self.local_rank = local_rank if local_rank is not None else self.device.index or 0
        if self.platform.device_type == "cpu" and parallel.world_size == 1:
            from weft.runner.cpu_threads import bind_compute_threads

            bind_compute_threads(config.engine.cpu_threads, config.engine.cpu_affinity)
        self.runner: ModelRunner | None = None
        self.kv_connector: WorkerConnector | None = None
        self.encoder_connector: EncoderConnector | None = None
        self.speculator: Speculator | None = None

    def load_model(self) -> WorkerInfo:
        config, engine = self.config, self.config.engine
        layout = self.parallel.layout
        load_config = load_config_for(
            config,
            str(self.device),
            tensor_parallel_rank=layout.tensor_rank,
            pipeline_parallel_size=layout.pipeline_parallel_size,
            pipeline_parallel_rank=layout.pipeline_rank,
            local_rank=self.local_rank,
        )
        self.loader, self.source = resolve_source(self.registry, config, load_config)
        kernels = KernelRegistry(RuntimeMonitor(engine.runtime_jit))
        with collecting(kernels):  # a quantization method registers the kernels it launches when it is made
            self.quantization_name, self.quantization = choose_quantization(
                self.registry, config, self.platform, self.source.format, self.dtype
            )
        if self.quantization is not None:
            self.loader.load_config = msgspec.structs.replace(load_config, quantization=self.quantization_name)
        self.family = load_family(self.registry, config, self.source)
        self.model_config = model_config(config, self.source, self.dtype, self.parallel.layout)
        self.family.check_parallel(self.model_config)
        attention_name = config.use.attention if config.use.attention != "auto" else self.platform.default_attention
        attention_class = self.registry.load("attention", attention_name)
        self.attention = attention_class(
            options_for(config, "attention", attention_class, attention_name), self.platform
        )
        check_kv_cache_dtype(config, self.platform, self.attention)
        torch.manual_seed(engine.seed)
        with collecting(kernels) as self.kernels:
            self.ops = self._choose_ops()
            with using_ops(self.ops), using_parallel(self.parallel), using_quantization(self.quantization):
                self.model = self.family.build(self.model_config, self.device)
            load_dtype = self.family.load_dtype(self.dtype)
            if layout.rank == 0:
                report(
                    "loading the weights of %s (%s, %s)",
                    self.source.name,
                    Path(self.source.path).name,
                    human_bytes(_source_bytes(Path(self.source.path))),
                )
            if self.family.reads_weight_slices:
                weights = self.loader.iter_weight_slices(self.source, load_dtype)
            else:
                weights = self.loader.iter_weights(self.source, load_dtype)
            self.family.load_weights(self.model, weights)
            formats = process_quantized_layers(self.model)
            logger.debug(
                "linear layers: %s",
                "; ".join(f"{count} x {name}" for name, count in formats.items())
                or f"dense {self.dtype} (engine.quantization = {engine.quantization!r})",
            )
            if self.structured_outputs:
                # Its logits come in the model's dtype or float32: both variants compile at warm-up.
                for dtype in (getattr(torch, self.dtype), torch.float32):
                    self.ops["bitmask_argmax"].declare(dtype=dtype)
            layers = [module.spec for module in self.model.modules() if isinstance(module, Attention)]
            self.attention.prepare(layers, self.dtype)
            self.speculator = self._build_speculator()
        groups = self.family.kv_cache_groups(self.model_config)
        self.num_target_groups = len(groups)
        if self.speculator is not None:
            # Its own layers' groups come after the target's: the target's group indices stay as its layers name them.
            groups = (*groups, *self.speculator.kv_cache_groups())
        self.groups = with_kv_cache_dtype(config, groups)
        if self.platform.device_type == "cpu":
            available = engine.cpu_kv_cache_bytes
        else:
            index = self.device.index if self.device.index is not None else 0
            available = int(self.platform.memory_info(index).free * engine.gpu_memory_utilization)
        reads_images = type(self.family).encode is not ModelFamily.encode
        return WorkerInfo(groups=list(self.groups), available_kv_bytes=available, reads_images=reads_images)

    @property
    def structured_outputs(self) -> bool:
        """Whether requests may carry a constraint: a structured-output backend is installed and not turned off."""
        return bool(self.registry.names("structured_output")) and self.config.use.structured_output != "none"

    def _choose_ops(self) -> dict[str, Any]:
        forced = self.config.use.ops
        installed = {name.partition(".")[0] for name in self.registry.names("ops")}
        core_ops = LAYER_OPS + RUNNER_OPS
        unknown = sorted(set(forced) - set(core_ops) - installed)
        if unknown:
            known = ", ".join(sorted(set(core_ops) | installed))
            raise ValueError(f"use.ops names {unknown}, which no installed plugin implements; known ops: {known}")
        ops = {name: choose_op(self.registry, name, self.platform, forced.get(name)) for name in core_ops}
        logger.debug("ops: %s", ", ".join(f"{name} = {type(op).__name__}" for name, op in ops.items()))
        return ops

    def initialize_kv_cache(self, num_blocks: list[int]) -> None:
        if self.parallel.layout.rank == 0:
            report(
                "allocating the KV cache: %s blocks of %d tokens",
                " + ".join(f"{count:,}" for count in num_blocks),
                self.config.engine.block_size,
            )
        kv_caches = {}
        for group, count in zip(self.groups, num_blocks, strict=False):
            # One block beyond the manager's: the scratch block padded graph rows write to.
            shape = self.family.kv_cache_shape(group.spec, count + 1) or self.attention.kv_cache_shape(
                count + 1, group.spec
            )
            for layer in group.layer_names:
                kv_caches[layer] = torch.zeros(shape, dtype=getattr(torch, group.spec.dtype), device=self.device)
        self.kv_caches = kv_caches
        if self.speculator is not None:
            own = {layer for group in self.speculator.kv_cache_groups() for layer in group.layer_names}
            self.speculator.bind_kv_caches({layer: kv_caches[layer] for layer in own})
        connector = load_kv_connector(self.registry, self.config, self.source, self.parallel.layout)
        if connector is not None:
            connector_class, options, context = connector
            gather = self.parallel.all_gather_objects if self.parallel.world_size > 1 else None
            attention_layers = frozenset(
                module.layer_name for module in self.model.modules() if isinstance(module, Attention)
            )
            self.kv_connector = WorkerConnector(
                connector_class, options, self.groups, context, kv_caches, gather, attention_layers
            )
        self.runner = ModelRunner(
            self.model,
            self.attention,
            self.groups,
            kv_caches,
            self.device,
            Sampler(self.config.engine.seed),
            self.kv_connector,
            self.parallel,
            self.ops["bitmask_argmax"] if self.structured_outputs else None,
            self.speculator,
            num_target_groups=self.num_target_groups,
        )
        if type(self.family).encode is not ModelFamily.encode:  # a vision-language family
            # Every rank encodes (or loads) the same items; rank 0 alone saves them.
            self.encoder_connector = load_encoder_connector(
                self.registry, self.config, self.source, saves=self.parallel.layout.rank == 0
            )
            self.runner.use_encoder(EncoderRunner(self.family, self.model, self.device, self.encoder_connector))
        if self.parallel.layout.rank == 0:
            report("warming up kernels")
        compiled = self.kernels.warm_up()
        if compiled:
            logger.debug(
                "kernel warm-up compiled %s", ", ".join(f"{name}: {count}" for name, count in compiled.items())
            )
        self._capture_graphs(num_blocks)

    def _build_speculator(self) -> Speculator | None:
        """The ``[engine.speculative]`` speculator, built with its options (those of its Options Struct that the
        table sets, over its ``[plugins]`` table's); None when speculation is off."""
        speculative = self.config.engine.speculative
        if not speculative.enabled:
            return None
        speculator_class = self.registry.load("speculator", speculative.method)
        options = options_for(self.config, "speculator", speculator_class, speculative.method)
        given = {
            name: getattr(speculative, name)
            for name in msgspec.structs.asdict(speculative)
            if name in speculator_class.Options.__struct_fields__ and getattr(speculative, name) is not None
        }
        if given:
            options = msgspec.structs.replace(options, **given)
        vocab = self.model_config.hf_config.get("vocab_size")
        speculator = speculator_class(
            options,
            SpeculatorConfig(
                num_speculative_tokens=speculative.num_speculative_tokens,
                vocab_size=int(vocab) if vocab is not None else 0,
                max_model_len=self.model_config.max_model_len,
                block_size=self.config.engine.block_size,
                dtype=self.dtype,
                model=speculative.model,
                target=self.model_config,
            ),
        )
        speculator.load(_DraftModels(self))
        return speculator

    def _capture_graphs(self, num_blocks: list[int]) -> None:
        """Capture the decode graphs (and the speculating steps'), where they can be (:mod:`weft.runner.capture`)."""
        capture_graphs(self, num_blocks)

    def execute_model(self, step: SchedulerOutput) -> StepHandle | None:
        assert self.runner is not None, "initialize_kv_cache first"
        return self.runner.execute(step)

    def sample_tokens(self, grammar: GrammarOutput) -> StepHandle:
        assert self.runner is not None, "initialize_kv_cache first"
        return self.runner.sample_tokens(grammar)

    def shutdown(self) -> None:
        """Close the KV connector, then free the device memory the worker holds at once: the runner (its graphs
        and static buffers), the KV cache and the model's weights. Dropping the references is not enough where a
        reference cycle anywhere in the model or the runner holds them until the garbage collector runs (a closed
        ``LLM`` kept 138 GiB of an H200 so), so their storage is emptied in place, and a collection then frees what
        such cycles hold besides (the graphs, their memory pool). Idempotent; the worker serves no step afterwards."""
        if self.kv_connector is not None:
            self.kv_connector.close()
            self.kv_connector = None
        if self.encoder_connector is not None:
            self.encoder_connector.close()
            self.encoder_connector = None
        self.runner = None
        model, self.model = getattr(self, "model", None), None
        kv_caches, self.kv_caches = getattr(self, "kv_caches", {}), {}
        tensors = [*model.parameters(), *model.buffers()] if model is not None else []
        with torch.no_grad():
            for tensor in (*tensors, *kv_caches.values()):
                tensor.set_()  # an empty storage: the old one is freed unless another tensor shares it
        del model, kv_caches, tensors
        gc.collect()
        self.platform.release_memory()


class _DraftModels(DraftModelLoader):
    """Loads a speculator's model as the worker loaded the target: its loader resolution, quantization, ops,
    parallel layout and attention backend, on its device, with the target's context length. Under pipeline
    parallelism a collective loader hands the draft to its single-stage fallback (:func:`draft_load_config`)."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    @property
    def target(self) -> DraftModel:
        worker = self.worker
        return DraftModel(
            model=worker.model,
            family=worker.family,
            config=worker.model_config,
            backend=worker.attention,
            device=worker.device,
        )

    def building(self) -> contextlib.AbstractContextManager[None]:
        worker, stack = self.worker, contextlib.ExitStack()
        stack.enter_context(using_ops(worker.ops))
        stack.enter_context(using_parallel(worker.parallel))
        stack.enter_context(using_quantization(worker.quantization))
        return stack

    def _load_config(self, config: WeftConfig) -> LoadConfig:
        """The draft's load config: the target's, through :func:`draft_load_config` (the fallback logged)."""
        worker, layout = self.worker, self.worker.parallel.layout
        target = load_config_for(
            config,
            str(worker.device),
            tensor_parallel_rank=layout.tensor_rank,
            pipeline_parallel_size=layout.pipeline_parallel_size,
            pipeline_parallel_rank=layout.pipeline_rank,
            local_rank=worker.local_rank,
        )
        draft = draft_load_config(target, worker.registry)
        if draft.loader != target.loader:
            logger.info(
                "the draft's weights are read by loader %r: %r loads collectively over every rank, which a draft "
                "held by the last pipeline stage alone would wait for forever (the target keeps %r)",
                draft.loader,
                target.loader,
                target.loader,
            )
        return draft

    def weights(self, dtype: str, source: str | None = None) -> Iterator[tuple[str, WeightSlice]]:
        worker = self.worker
        config = worker.config if source is None else msgspec.structs.replace(worker.config, model=source)
        loader, resolved = resolve_source(worker.registry, config, self._load_config(config))
        return loader.iter_weight_slices(resolved, dtype)

    def load(self, source: str) -> DraftModel:
        worker = self.worker
        engine = msgspec.structs.replace(worker.config.engine, max_model_len=worker.model_config.max_model_len)
        config = msgspec.structs.replace(worker.config, model=source, engine=engine)
        layout = worker.parallel.layout
        try:
            load_config = self._load_config(config)
            loader, draft_source = resolve_source(worker.registry, config, load_config)
            name, quantization = choose_quantization(
                worker.registry, config, worker.platform, draft_source.format, worker.dtype
            )
            if quantization is not None:
                loader.load_config = msgspec.structs.replace(load_config, quantization=name)
            family = load_family(worker.registry, config, draft_source)
            draft_config = model_config(config, draft_source, worker.dtype, layout)
        except ValueError as error:
            raise ValueError(f"[engine.speculative] model = {source!r}: {error}") from error
        family.check_parallel(draft_config)
        with using_ops(worker.ops), using_parallel(worker.parallel), using_quantization(quantization):
            model = family.build(draft_config, worker.device)
        if layout.rank == 0:
            report("loading the draft model's weights (%s)", Path(draft_source.path).name)
        load_dtype = family.load_dtype(worker.dtype)
        if family.reads_weight_slices:
            weights = loader.iter_weight_slices(draft_source, load_dtype)
        else:
            weights = loader.iter_weights(draft_source, load_dtype)
        family.load_weights(model, weights)
        process_quantized_layers(model)
        worker.attention.prepare(
            [module.spec for module in model.modules() if isinstance(module, Attention)], worker.dtype
        )
        return DraftModel(
            model=model, family=family, config=draft_config, backend=worker.attention, device=worker.device
        )
