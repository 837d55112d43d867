"""The speculator slot: proposing tokens that the target model verifies in one step.

A speculator guesses, for each running request, up to ``k`` tokens
(``[engine.speculative] num_speculative_tokens``) that the target model is likely to generate next.
The next step feeds the request's last token and the proposals to the target in one forward, and
core's rejection sampler (:mod:`weft.runner.rejection_sampler`) keeps the longest run of
proposals the target agrees with, plus one token of the target's own: the output has exactly
the distribution plain decoding has, whatever the speculator proposed. A speculator only makes
decoding faster, never different. Verification, KV rollback of rejected tokens and grammar
rollback belong to core, never to a speculator.

``[engine.speculative] method`` names the speculator: ``ngram`` (core: prompt lookup),
``draft`` (a smaller model), or a plugin's (DeepSeek V4's MTP layers in weft-dsv4).

Where each call happens (in every worker, beside the model runner; under tensor parallelism every
rank runs it on the same inputs and must propose the same tokens):

* Once: ``Speculator(options, config)`` with a :class:`SpeculatorConfig`. A speculator that owns a
  model declares its KV cache here through :meth:`Speculator.kv_cache_groups` (below).
* Per request, when the runner first sees it (new, or resumed after a preemption):
  :meth:`Speculator.add_request` with its prompt and the output it already has.
* Per step, after the step's tokens are known: :meth:`Speculator.on_verified` with each request's
  :class:`Verified` tokens: what it proposed for the request last step, how many of those the
  target accepted, and the tokens the request's output grew by (the accepted proposals then the
  target's own token; one token for a request that had no proposals, such as one that just
  finished its prefill). A speculator keeping state per request appends those tokens; rejected
  proposals never reach the output and must leave no trace in its state.
* Then :meth:`Speculator.propose` for the requests that decode next step, with a
  :class:`ProposalStep`. It returns :class:`Proposals`: per request up to ``max_tokens[i]``
  tokens (never more than ``k``), each below ``config.vocab_size``; fewer, or none, when it has
  no good guess (an n-gram that matches nothing). A request without proposals decodes one token as
  usual. Proposals go to the scheduler with the step's output; it may cut them further (the
  step's token budget, ``max_tokens``, the context length), so the runner verifies a prefix of
  what was proposed, and :meth:`Speculator.on_verified` reports that prefix.
* :meth:`Speculator.remove_request` when a request finishes, is aborted or preempted (a preempted
  request comes back through :meth:`Speculator.add_request`).

Proposals are a function of the request's tokens (and, for a model, the target's states) alone:
the same context gives the same proposals, whatever the batch around it. A speculator that
samples its proposals from a distribution returns those distributions
(:attr:`Proposals.probs`): rejection sampling needs ``q`` to stay exact. A deterministic one
returns none, and its proposals count as drawn from one-hot distributions.

A speculator that owns a model (``draft``, MTP) loads it in :meth:`Speculator.load` through the engine's
:class:`DraftModelLoader` (the target's loaders, quantization and parallel layout), and declares the KV-cache
groups of its layers in
:meth:`Speculator.kv_cache_groups`, layer names prefixed so they never collide with the
target's (``draft.model.layers.0.self_attn``). The engine sizes the cache for the target's groups
and these together: each request holds blocks in every group for its tokens and its ``k``
proposal slots, allocated, rolled back and freed with the target's, so a speculator never
manages blocks. The runner gives it the allocated tensors through :meth:`Speculator.bind_kv_caches`
and, in each :class:`ProposalStep`, each row's blocks (:class:`DraftInputs`). Such a speculator's k draft
steps run on the device; only its proposed token ids cross to the host.

A speculator that reads the target's hidden states (MTP, EAGLE: :attr:`Speculator.needs_hidden_states`, core API
1.16) gets them through :meth:`Speculator.take_hidden_states` after every target forward, before that step's
:meth:`Speculator.on_verified`: one row per position the forward computed (a prefill chunk's every position, a
verifying row's last token and its proposals), on the device. Rows of proposals the step then rejects are in
it too; :meth:`Speculator.on_verified` says how many were kept. Positions a prefix-cache hit skipped are never
computed, so they come with no rows. Such a speculator reaches the target model itself through
:attr:`DraftModelLoader.target` (to share its embedding and LM head) and the checkpoint's tensors through
:meth:`DraftModelLoader.weights` (layers stored beside the target's, such as DeepSeek's ``mtp.*``). The runner
runs every forward eagerly while such a speculator is in use (a decode graph returns only logits).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec

from weft.contracts.model import ModelConfig
from weft.contracts.plugin import PluginBase

if TYPE_CHECKING:
    import torch

    from weft.contracts.kv_cache import KVCacheGroupSpec, KVCacheSpec
    from weft.contracts.loader import WeightSlice
    from weft.contracts.platform import Platform


class SpeculatorConfig(msgspec.Struct, frozen=True, kw_only=True):
    """What the engine tells a speculator when it builds it."""

    num_speculative_tokens: int
    """``k``: the most tokens proposed for one request in one step."""
    vocab_size: int
    """Width of the target's logits: every proposed token is below it."""
    max_model_len: int
    """The most tokens (prompt and output) a request may hold."""
    block_size: int = 16
    """Tokens per KV-cache block, for the groups a model-owning speculator declares."""
    dtype: str = "float32"
    """The runtime dtype of the target's weights and activations."""
    model: str | None = None
    """The draft model's source (``[engine.speculative] model``), for speculators that load one."""
    target: ModelConfig | None = None
    """The target model's config: its checkpoint config, and its parallel layout, which a draft
    copies whole, changing only what it must (DeepSeek V4's ``draft_parallel_config``)."""


class SpeculationRequest(msgspec.Struct, frozen=True):
    """A request as :meth:`Speculator.add_request` first sees it."""

    request_id: str
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int] = ()
    """Tokens it already generated (a request resumed after a preemption)."""


class Verified(msgspec.Struct, frozen=True):
    """What one request's step came to (:meth:`Speculator.on_verified`)."""

    request_id: str
    num_proposed: int
    """Proposals the target verified for it this step (0: it decoded plainly)."""
    num_accepted: int
    """How many of those the target accepted: the first ``num_accepted`` of ``token_ids``."""
    token_ids: Sequence[int]
    """The tokens its output grew by: ``num_accepted`` proposals, then the target's own token."""


class DraftModel(msgspec.Struct):
    """A model the engine built for a speculator (:meth:`Speculator.load`): the target's loaders, quantization,
    ops, attention backend and parallel layout, on the target's device (core API 1.15)."""

    model: Any
    """The ``torch.nn.Module``: ``model(input_ids, positions, context)`` gives hidden states and
    ``model.compute_logits(hidden)`` the logits, as for the target."""
    family: Any
    """Its :class:`~weft.contracts.model.ModelFamily`."""
    config: ModelConfig
    backend: Any
    """The engine's :class:`~weft.contracts.attention.AttentionBackend`, prepared for the model's layers too."""
    device: Any
    """The ``torch.device`` it lives on."""


class DraftModelLoader(ABC):
    """What :meth:`Speculator.load` gets: builds and loads a model from a source the way the engine loads its
    target (core API 1.15).

    A draft lives beside its target on every rank that holds the target's last pipeline stage; a loader whose
    loading is collective over the world group (fastsafetensors) would wait there for the ranks that load no
    draft, so under pipeline parallelism the draft's weights are read by that loader's
    :attr:`~weft.contracts.loader.WeightLoader.single_stage_fallback` (:func:`weft.resolve.draft_load_config`,
    logged), while the target keeps its own loader."""

    @abstractmethod
    def load(self, source: str) -> DraftModel:
        """The model at ``source`` (a folder, a file or an alias, as ``model`` takes); raises ValueError naming
        ``[engine.speculative] model`` when it cannot be loaded."""

    @property
    def target(self) -> DraftModel:
        """The target model as the engine built and loaded it (its module, family, config, attention backend and
        device): a speculator that shares the target's layers (an MTP head's embedding and LM head) or reads its
        checkpoint's config takes them here (core API 1.16)."""
        raise NotImplementedError(f"{type(self).__name__} does not hand out the target model")

    def building(self) -> contextlib.AbstractContextManager[None]:
        """The context the engine builds its models in (the chosen ops, this rank's parallel groups, the
        quantization): a speculator builds its own layers inside it, so that they shard, exchange experts and pick
        kernels as the target's do (core API 1.16)."""
        raise NotImplementedError(f"{type(self).__name__} does not build layers for a speculator")

    def weights(self, dtype: str, source: str | None = None) -> Iterator[tuple[str, WeightSlice]]:
        """The tensors of ``source``'s checkpoint (default: the target's own), each a
        :class:`~weft.contracts.loader.WeightSlice` read only when (and as far as) it is loaded, floating-point ones
        in ``dtype``; for layers a speculator builds itself from the target's checkpoint (core API 1.16)."""
        raise NotImplementedError(f"{type(self).__name__} does not read checkpoints for a speculator")


class DraftInputs(msgspec.Struct):
    """A step's inputs for a speculator with :meth:`Speculator.kv_cache_groups`, one row per
    :class:`ProposalStep` row (core API 1.15)."""

    block_ids: Sequence[Sequence[Sequence[int]]]
    """Per row, per group of :meth:`Speculator.kv_cache_groups`: the blocks the request holds. They cover its
    tokens and, where the cache had room, ``k`` more slots (the engine allocates them ahead for such a
    speculator); a draft writes no slot past them."""


class ProposalStep(msgspec.Struct):
    """The requests to propose for, one row each, in the order :class:`Proposals` answers them."""

    request_ids: Sequence[str]
    max_tokens: Sequence[int]
    """Per row, the most proposals worth making: ``k``, or fewer near the request's ``max_tokens`` or the
    context length. 0: propose nothing for it."""
    draft_inputs: DraftInputs | None = None
    """For a speculator with :meth:`Speculator.kv_cache_groups`; None for others."""


class TargetHiddenStates(msgspec.Struct):
    """The target's hidden states of one forward, for a speculator with :attr:`Speculator.needs_hidden_states`
    (core API 1.16): rows request-major, each request's positions ``starts[i] .. starts[i] + counts[i] - 1``."""

    request_ids: Sequence[str]
    starts: Sequence[int]
    """Per request, the position of its first row (where the forward started: after a prefix-cache hit, past it)."""
    counts: Sequence[int]
    """Per request, its rows: every position the forward computed for it, a verifying row's proposals included."""
    hidden: Any
    """``[sum(counts), width]`` on the target's device: what the target module's forward returned, or, where the
    module defines ``hidden_states_for_speculation(hidden)``, what that gives (DeepSeek V4: its ``hc_mult``
    residual streams before the head, flattened). Valid until the next forward: keep what is needed later."""


class Proposals(msgspec.Struct):
    """One row per row of the :class:`ProposalStep`."""

    token_ids: list[list[int]]
    """Per row, ``0..max_tokens[i]`` proposed tokens."""
    probs: Any = None
    """None for deterministic proposals; else a ``[sum of proposals, vocab_size]`` float tensor (rows
    request-major) holding the distribution each proposed token was drawn from."""


class Speculator(PluginBase):
    """Proposes tokens for running requests; see the module docstring for the call order.

    Built as ``Speculator(options, config)``. A subclass implements :meth:`add_request`,
    :meth:`propose`, :meth:`on_verified` and :meth:`remove_request`; one that owns a model also
    :meth:`kv_cache_groups` and :meth:`bind_kv_caches`.
    """

    name: ClassVar[str]
    owns_model: ClassVar[bool] = False
    """True for a speculator with its own model and KV-cache groups (core API 1.15): the scheduler then allocates a
    speculating request's blocks ``k`` slots past the tokens its step computes, where the draft writes the KV of
    its proposals."""
    needs_hidden_states: ClassVar[bool] = False
    """Whether the speculator reads the target's hidden states (MTP, EAGLE): then :meth:`take_hidden_states` gets
    them after every target forward (core API 1.16; the 1.15 worker refused such a speculator)."""

    def __init__(self, options: msgspec.Struct | None, config: SpeculatorConfig) -> None:
        self.options = options if options is not None else self.Options()
        self.config = config

    def load(self, models: DraftModelLoader) -> None:
        """Called once after construction, before :meth:`kv_cache_groups`: a speculator that owns a model loads it
        with ``models`` (core API 1.15). Nothing by default."""

    def kv_cache_groups(self) -> tuple[KVCacheGroupSpec, ...]:
        """The KV-cache groups of the speculator's own layers (module docstring); none by default."""
        return ()

    def kv_cache_shape(self, spec: KVCacheSpec, num_blocks: int) -> tuple[int, ...] | None:
        """One layer's cache shape for a group the speculator manages itself (as
        :meth:`weft.contracts.model.ModelFamily.kv_cache_shape`); None where the attention backend owns it."""
        if spec.paged_attention:
            return None
        raise NotImplementedError(
            f"speculator {self.name!r} declares a {type(spec).__name__} group but does not define kv_cache_shape for it"
        )

    def bind_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """The cache tensors of the layers of :meth:`kv_cache_groups`, by layer name, once allocated."""
        if kv_caches:
            raise NotImplementedError(f"speculator {self.name!r} got KV caches but does not define bind_kv_caches")

    def capture_graphs(
        self, platform: Platform, sizes: Sequence[int], scratch_blocks: Sequence[int], max_model_len: int
    ) -> float:
        """Capture the speculator's own forwards as graphs for batches of up to each of ``sizes`` rows (the
        largest first, :meth:`~weft.contracts.platform.Platform.capture_graph`), at warm-up; returns the seconds it
        took. Called on a single-rank worker that captures the target's graphs (the platform and the attention
        backend can, ``engine.enforce_eager`` is off), after them; ``scratch_blocks`` holds a block id per group of
        :meth:`kv_cache_groups` that no request is given, for padded rows to write to. Default: nothing is
        captured (0.0) and :meth:`propose` runs eagerly. Added in core API 1.17."""
        return 0.0

    def take_hidden_states(self, states: TargetHiddenStates) -> None:
        """The target's hidden states of the forward just run, for a speculator with :attr:`needs_hidden_states`
        (module docstring; core API 1.16). Requests it does not follow are skipped."""
        raise NotImplementedError(
            f"speculator {self.name!r} sets needs_hidden_states but does not define take_hidden_states"
        )

    @abstractmethod
    def add_request(self, request: SpeculationRequest) -> None:
        """Start following a request (new, or resumed after a preemption: it may already have an output)."""

    @abstractmethod
    def propose(self, step: ProposalStep) -> Proposals:
        """Up to ``step.max_tokens[i]`` tokens for each row; the same tokens for the same context, every time."""

    @abstractmethod
    def on_verified(self, results: Sequence[Verified]) -> None:
        """The step's outcome for the requests that got tokens (see :class:`Verified`); an id it does not follow
        (a request removed while its step ran) is skipped."""

    @abstractmethod
    def remove_request(self, request_id: str) -> None:
        """Forget a request (finished, aborted or preempted); an unknown id is not an error."""
