"""The model slot: a family of architectures the engine can build and load.

A model family registers one entry point per Hugging Face architecture string
it builds (``LlamaForCausalLM = weft.models.llama:LlamaFamily``); the engine
reads ``architectures`` from the checkpoint's config and picks the family
registered under that name.

The module returned by :meth:`ModelFamily.build` is called by the model runner as::

    hidden = module(input_ids, positions, context)   # [num_tokens, hidden]
    logits = module.compute_logits(hidden[last_rows])  # [rows, vocab]

where ``context`` carries the attention backend, its per-step metadata and the
KV-cache tensors of each group (the engine's model-runner documents it).

Parallel layouts (:mod:`weft.contracts.parallel`): ``ModelConfig.parallel`` says how
the model is spread, and :meth:`ModelFamily.check_parallel` refuses what the family
cannot split (the default refuses every layout but one device). Under tensor
parallelism the module is built with this rank's shards, its KV-cache groups hold
this rank's key/value heads, and ``compute_logits`` returns the whole vocabulary on
every tensor rank. Under pipeline parallelism a stage's module holds only its layers
and is called with the previous stage's output::

    out = module(input_ids, positions, context, intermediate)   # intermediate: None on the first stage
    # every stage but the last returns a dict of tensors shaped as module.intermediate_spec(num_tokens) says

and only the last stage computes logits.

``weft verify`` checks a family against its Hugging Face transformers reference on the
same checkpoint. Two optional methods tell it how: :meth:`ModelFamily.hf_architecture`
names the transformers class (default: the checkpoint's architecture itself) and
:meth:`ModelFamily.hf_reference_context` wraps every call into the reference (default:
nothing changes).

Images (:mod:`weft.contracts.mm_processor`): a family that reads them overrides :meth:`ModelFamily.encode`
(the default refuses). When a step's ``encoder_inputs`` names items the workers do not hold, the runner calls::

    outputs = family.encode(module, [item.encoder_inputs as tensors on the device, ...])
    # one [num_embeddings_i, hidden] tensor per item: a row per position of its placeholder ranges, in order

once per step for all of them (eagerly: steps with images never replay a graph), and keeps each output under the
item's hash until the scheduler's encoder cache evicts it. For every request of the step whose scheduled
positions cover part of an item's ranges it gathers those rows into ``context.multimodal``
(:class:`weft.layers.multimodal.MultimodalBatch`: the flat-batch ``rows`` and their ``embeds``), so a range may
cross a chunk boundary. The module merges them right after its token embedding::

    hidden = merge_multimodal_embeddings(self.embed_tokens(input_ids), context)   # weft.api

(core's Llama does, so a family whose language model is a Llama builds on ``weft.api.LlamaForCausalLM``).
Per-position extras of the processed prompt (``token_types``) and multi-axis positions reach the module on
``context.multimodal.extras`` and ``context.multimodal.positions``, cut to the step's positions. All of this
came with core API 1.15.
"""

from __future__ import annotations

import contextlib
from abc import abstractmethod
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec

from weft.contracts.parallel import ParallelLayout
from weft.contracts.plugin import PluginBase

if TYPE_CHECKING:
    import torch

    from weft.contracts.kv_cache import KVCacheGroupSpec, KVCacheSpec


class ModelConfig(msgspec.Struct, frozen=True):
    """What a family needs to build a model: the checkpoint's config and the runtime choices."""

    architecture: str
    hf_config: dict[str, Any]
    """The checkpoint's ``config.json`` as a dict (a GGUF loader synthesises one)."""
    dtype: str
    """torch dtype name of the weights and activations."""
    block_size: int
    """Tokens per KV-cache block chosen by the engine."""
    max_model_len: int
    parallel: ParallelLayout = ParallelLayout()
    """How the model is spread over devices, and this process's rank (added in core API 1.4)."""
    enable_prefix_caching: bool = False
    """Whether the engine reuses cached prefixes: a family with checkpointed groups declares its
    checkpoint groups only then (added in core API 1.5)."""
    max_num_seqs: int = 0
    """The most requests one step holds (``engine.max_num_seqs``), so the most rows of a decode graph;
    0 where not known (added in core API 1.10)."""
    num_lookahead_tokens: int = 0
    """The most tokens a step computes past a request's verified ones, which a later step may roll back: a
    speculating step's proposals (``[engine.speculative] num_speculative_tokens``; 0 without speculation). A family
    whose state keeps a fixed number of past positions in a ring keeps this many more, so that the writes of
    rejected proposals never overwrite positions the step after them reads (added in core API 1.16)."""


class ModelFamily(PluginBase):
    """Builds torch modules for some architectures and maps checkpoint weights onto them."""

    reads_weight_slices: ClassVar[bool] = False
    """Whether :meth:`load_weights` takes :class:`~weft.contracts.loader.WeightSlice` objects
    (and reads only this rank's part of each tensor) instead of whole tensors (added in core API 1.4)."""
    splits_decode_batches: ClassVar[bool] = False
    """Whether this family's models run a decode step as nano-batches when its
    :class:`~weft.layers.attention.ForwardContext` carries ``nano_batches`` (``engine.decode_overlap``; added in
    core API 1.17). A family that sets it computes each row as the whole step's forward would, whichever way it
    runs (the ``nano_batches`` op, :mod:`weft.layers.nano_batches`); one that does not is never given them."""

    def __init__(self, options: msgspec.Struct | None = None) -> None:
        self.options = options if options is not None else self.Options()

    def check_parallel(self, config: ModelConfig) -> None:
        """Raise ValueError, naming the numbers and the fix, when ``config.parallel`` cannot hold this model.

        Called before any worker starts. The default accepts one device only: a family that
        shards its layers overrides it (added in core API 1.4).
        """
        layout = config.parallel
        if layout.world_size > 1 or layout.enable_expert_parallel:
            raise ValueError(
                f"model family {type(self).__name__} ({config.architecture}) runs on one device only; "
                f"set engine.tensor_parallel_size and engine.pipeline_parallel_size to 1"
                + (" and engine.enable_expert_parallel to false" if layout.enable_expert_parallel else "")
            )

    def captures_managed_groups(self, config: ModelConfig, device: torch.device) -> bool:
        """Whether decode may be captured in graphs although this model manages KV-cache groups itself
        (groups whose spec is not ``paged_attention``) on ``device`` (added in core API 1.7).

        Default: False, and such a model decodes eagerly. A family that returns True builds models
        whose forward, given a :class:`~weft.layers.attention.ForwardContext` with ``static_decode``
        set, reads the step only from device tensors (see that field) and never synchronises with the
        host, so that the runner can capture it once per batch size and replay it. The runner still
        decodes eagerly when a KV connector offers a sparse-entry reader (its reads run on the host).
        """
        return False

    @abstractmethod
    def kv_cache_groups(self, config: ModelConfig) -> tuple[KVCacheGroupSpec, ...]:
        """Declare the model's KV-cache groups; every attention layer belongs to exactly one."""

    def kv_cache_shape(self, spec: KVCacheSpec, num_blocks: int) -> tuple[int, ...] | None:
        """Shape of one layer's cache tensor for a group this model manages itself.

        Return None for a group the attention backend owns (``spec.paged_attention``):
        the backend then chooses the layout. The tensor's dtype is ``spec.dtype``.
        """
        if spec.paged_attention:
            return None
        raise NotImplementedError(
            f"model family {type(self).__name__} declares a {type(spec).__name__} KV-cache group "
            f"but does not define kv_cache_shape for it"
        )

    def load_dtype(self, dtype: str) -> str:
        """The dtype the engine asks the loader for, given the runtime ``dtype``.

        Default: the runtime dtype. A family that keeps some parameters in float32 whatever
        the runtime dtype returns "float32", so those get the checkpoint's full precision
        (the others are rounded when copied into their parameters, as a cast would).
        """
        return dtype

    def hf_architecture(self, architecture: str) -> str:
        """The transformers class ``weft verify`` takes as the reference for ``architecture``.

        ``architecture`` is the checkpoint's ``architectures[0]``, the name this family is
        registered under. Default: that same name. A family registered under a name of its
        own that reproduces a transformers model (the checkpoint's weights load into that
        class unchanged) returns the class's name, e.g. ``"LlamaForCausalLM"``.
        """
        return architecture

    def hf_reference_context(self) -> contextlib.AbstractContextManager[None]:
        """A context ``weft verify`` runs the transformers reference inside (loading excluded).

        Default: nothing changes. A family whose reference makes a choice the model leaves
        open returns the adjustment that makes it choose as Weft does; it must change no result
        that is not such a choice (DeepSeek V4: a stable top-k, so the indexer breaks score ties
        toward the lower index as Weft's ``decode_topk`` does).
        """
        return contextlib.nullcontext()

    def encode(self, module: torch.nn.Module, items: Sequence[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Embeddings of images: per item, ``[num_embeddings, hidden]`` rows for the positions of its placeholder
        ranges, in order (module docstring; added in core API 1.15).

        ``items`` are :attr:`~weft.contracts.mm_processor.ProcessedItem.encoder_inputs`, as tensors on the
        module's device. Default: refuses, for a family without a vision encoder.
        """
        raise NotImplementedError(
            f"model family {type(self).__name__} has no vision encoder: it reads text only. Send text parts, "
            f"or serve a vision-language checkpoint whose family implements ModelFamily.encode"
        )

    @abstractmethod
    def build(self, config: ModelConfig, device: torch.device) -> torch.nn.Module:
        """Build the module with uninitialised (or random) weights on ``device``."""

    @abstractmethod
    def load_weights(self, module: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face names) into ``module``.

        ``weights`` yields whole tensors, or :class:`~weft.contracts.loader.WeightSlice` objects when
        the family sets :attr:`reads_weight_slices` (a family that does should take both).
        Raise ValueError naming the tensor when a checkpoint tensor has no home
        or a parameter receives no tensor.
        """
