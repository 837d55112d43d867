"""The executor slot: where the model runs, and the one-way step that reaches it.

The engine core schedules a step and hands its :class:`SchedulerOutput` to the
executor chosen by ``engine.distributed_executor_backend``; the executor runs
it on its workers and returns one :class:`ModelRunnerOutput`. The output is
self-contained: a worker keeps its own copy of each request (token ids, block
tables, sampling parameters) from the first time the request is scheduled and
updates it from later steps, so it never reads the engine's KV-cache manager
or scheduler. Data flows one way: scheduler → workers → sampled tokens back.

What a step carries, per request:

* first time scheduled (and again after a preemption, when its blocks were
  freed): a :class:`NewRequest` with every token id known so far, its block ids
  in every KV-cache group and its sampling parameters;
* later steps: a :class:`CachedRequest` with the number of tokens already
  computed and only the blocks added since the previous step. The worker appends
  the token it sampled for the request itself; with asynchronous scheduling the
  next step may be scheduled before that token reached the host, and the worker
  reads it from the device.

``SchedulerOutput`` and ``ModelRunnerOutput`` encode with msgspec
(:func:`encode_step`), so executors whose workers live in other processes send
them as bytes; an in-process executor may too (``uniproc`` does, which keeps the
contract honest).

Executor call order: ``Executor(options, config)`` → :meth:`Executor.load_model`
(workers build the model and report their KV-cache groups and memory) →
:meth:`Executor.initialize_kv_cache` (the blocks per group the engine chose;
workers allocate caches, warm kernels up, capture graphs) → :meth:`Executor.execute_model`
once per step (and :meth:`Executor.sample_tokens` after a step with structured
outputs) → :meth:`Executor.shutdown`. An executor whose workers are lost raises
:class:`ExecutorFailed` from any of them (and from a step handle's ``result``).
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, ClassVar

import msgspec

from weft.contracts.kv_cache import KVCacheGroupSpec
from weft.contracts.kv_connector import ConnectorOutput
from weft.contracts.mm_processor import MultimodalInputs
from weft.contracts.plugin import PluginBase
from weft.sampling_params import SamplingParams


class NewRequest(msgspec.Struct, frozen=True, array_like=True):
    """A request the workers have not seen since its blocks were (re)allocated."""

    request_id: str
    token_ids: list[int]
    """Every known token: the prompt, then the outputs so far (after a preemption)."""
    num_prompt_tokens: int
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    """Token ids that end the request (empty with ``ignore_eos``); ``min_tokens`` bans them."""
    block_ids: tuple[tuple[int, ...], ...]
    """The request's blocks in every KV-cache group, in the model's group order."""
    num_computed_tokens: int
    """Tokens whose KV is already in the cache (prefix-cache and connector hits)."""
    state_transferred: bool = False
    """Its model-managed state (ring, recurrent state) after those tokens arrived whole from another
    instance (core API 1.6): the model keeps it, never restoring it from snapshots of the prefix."""
    multimodal: MultimodalInputs | None = None
    """Its images (placeholder ranges, item hashes, encoder inputs), per-position extras and positions
    (core API 1.15; :mod:`weft.contracts.mm_processor`); None: text only. Workers encode an item when a step's
    ``encoder_inputs`` names it."""


class CachedRequest(msgspec.Struct, frozen=True, array_like=True):
    """A request the workers already hold, scheduled again."""

    request_id: str
    num_computed_tokens: int
    """Tokens whose KV is in the cache before this step."""
    new_block_ids: tuple[tuple[int, ...], ...] | None
    """Blocks appended to each group since the previous step; None when there are none."""


class SchedulerOutput(msgspec.Struct, array_like=True):
    """Everything workers need for one step."""

    new_requests: list[NewRequest]
    cached_requests: list[CachedRequest]
    num_scheduled_tokens: dict[str, int]
    """Tokens to compute per scheduled request, in batch order (new requests first)."""
    finished_request_ids: list[str] = []
    """Requests that ended, or were preempted (their blocks already freed), since the previous step:
    workers drop them; a preempted one comes back as a NewRequest."""
    kv_connector_metadata: bytes | None = None
    """The KV connector's metadata for this step (msgpack of what its scheduler role built; workers
    decode it as the connector's ``metadata_type``), when a connector is configured."""
    structured_output_request_ids: list[str] = []
    """Requests that sample this step under a structured-output constraint (or may: their reasoning
    has not ended yet): workers sample only once :meth:`Executor.sample_tokens` brings the bitmask."""
    has_sync_kv_loads: bool = False
    """Whether a request of this step loads external KV synchronously in it (the KV connector's lookup
    offered tokens with ``load_async`` False): only then do workers wait for each layer's load before the
    forward reads it (core API 1.11)."""
    launch_after_sampling: bool = False
    """Set by the engine core where the executor launches ahead (:attr:`Executor.launch_ahead`): the step before
    this one still waits for its bitmask, and this one's forward reads that step's tokens. Workers stage this
    step's inputs now and launch its forward once :meth:`Executor.sample_tokens` has sampled the step before
    (core API 1.13)."""
    spec_token_ids: dict[str, list[int]] = {}
    """Speculative decoding (:mod:`weft.contracts.speculator`): per request that verifies proposals this step, the
    proposed tokens, fed after its last token (its ``num_scheduled_tokens`` is one more than their count). The step
    computes logits at each of those positions and keeps the proposals the rejection sampler accepts (core API
    1.15)."""
    encoder_inputs: dict[str, list[int]] = {}
    """Per request, the indices of its items (``NewRequest.multimodal.items``) whose encoder output this step
    needs and the workers do not hold: they run ``ModelFamily.encode`` on them and keep each output under the
    item's hash until ``freed_encoder_hashes`` names it (the scheduler's encoder cache decides; core API 1.15)."""
    freed_encoder_hashes: list[str] = []
    """Item hashes whose encoder outputs workers drop, before this step's encoding (core API 1.15)."""

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


class GrammarOutput(msgspec.Struct, array_like=True):
    """The token bitmask of one step's constrained rows (layout: :mod:`weft.contracts.structured_output`)."""

    request_ids: list[str]
    """The masked requests, a subset of the step's ``structured_output_request_ids``; the others sample freely."""
    bitmask: bytes
    """int32 rows, native byte order, row-major: for each request in ``request_ids`` in order, one per position it
    samples at (a request verifying speculative proposals, ``SchedulerOutput.spec_token_ids``, has a row per
    proposal, then its own: row ``j`` masks the token after its ``j`` first proposals)."""


class TokenLogprobs(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """The sampled token's log-probability and rank, and the top-n candidates, from the raw distribution."""

    logprob: float
    rank: int
    top: list[tuple[int, float]]


class ModelRunnerOutput(msgspec.Struct, array_like=True):
    """What the workers return for one step."""

    request_ids: list[str]
    """The scheduled requests, in batch order."""
    sampled_token_ids: list[int | None]
    """The token sampled for each request; None for a request mid-prefill (nothing sampled)."""
    logprobs: dict[str, TokenLogprobs] = {}
    """For requests that asked for logprobs."""
    connector_output: ConnectorOutput | None = None
    failed: dict[str, str] = {}
    """Requests that got no token this step, with the reason (their logits were not finite, their
    sampling raised): the scheduler ends each one alone; the step's other requests go on."""
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = {}
    """For requests that asked for prompt logprobs and computed prompt tokens this step: the position
    of the first prompt token covered, and per token from there the logprob of that prompt token
    given the ones before it."""
    more_token_ids: dict[str, list[int]] = {}
    """Speculative decoding: for a request that gained more than one token this step (accepted proposals), the
    tokens after the first (``sampled_token_ids`` holds the first), in order (core API 1.15)."""
    more_logprobs: dict[str, list[TokenLogprobs]] = {}
    """The logprobs of ``more_token_ids``, for requests that asked for logprobs."""
    spec_token_ids: dict[str, list[int]] = {}
    """Speculative decoding: the speculator's proposals for each request's next step, made from its tokens after
    this step (the scheduler may cut them; a request absent here decodes one token)."""


def encode_step(value: SchedulerOutput | ModelRunnerOutput) -> bytes:
    return msgspec.msgpack.encode(value)


def decode_scheduler_output(data: bytes) -> SchedulerOutput:
    return msgspec.msgpack.decode(data, type=SchedulerOutput)


class WorkerInfo(msgspec.Struct, frozen=True):
    """What the workers report once the model is loaded."""

    groups: list[KVCacheGroupSpec]
    """The model's KV-cache groups."""
    available_kv_bytes: int
    """Memory each worker may give its KV cache (the least over workers)."""
    reads_images: bool = False
    """Whether the model family encodes images (implements ``ModelFamily.encode``; core API 1.15): the scheduler
    refuses a request carrying images otherwise, instead of running its placeholders as plain tokens."""


class ExecutorFailed(RuntimeError):
    """The workers are gone (one died, failed, or stopped answering): the engine cannot go on.

    The message names the rank and the cause. The engine fails the requests in flight and shuts
    down; every later call of the executor raises the same error (added in core API 1.4).
    """


class StepHandle:
    """A step launched on the workers; :meth:`result` waits for its output.

    Executors that launch work asynchronously (a device stream, other
    processes) return a handle whose :meth:`result` blocks until the sampled
    tokens are on the host; the engine schedules the next step meanwhile.
    """

    def result(self) -> ModelRunnerOutput:
        raise NotImplementedError

    def done(self) -> bool:
        """Whether :meth:`result` would return without waiting (False when the handle cannot tell)."""
        return False


class DoneStep(StepHandle):
    """A step whose output is already known."""

    def __init__(self, output: ModelRunnerOutput) -> None:
        self.output = output

    def result(self) -> ModelRunnerOutput:
        return self.output

    def done(self) -> bool:
        return True


class Executor(PluginBase):
    """Runs the model on workers. Built as ``Executor(options, config, registry)`` in the engine core's process.

    ``config`` has the platform-sized engine defaults resolved. ``registry`` is the engine's
    :class:`~weft.plugins.PluginRegistry`: workers in this process build their plugins from it;
    workers in other processes discover the installed plugins themselves.
    """

    name: ClassVar[str]
    supports_async_output: ClassVar[bool] = False
    """Whether :meth:`execute_model` returns before the step's tokens reach the host
    (the condition for asynchronous scheduling to overlap anything)."""
    launch_ahead: bool = False
    """Whether the engine core may call :meth:`execute_model` for a structured-output step whose predecessor still
    waits for its bitmask (``SchedulerOutput.launch_after_sampling``), so that the workers stage the step's inputs
    while the core waits for the mask (core API 1.13). Worth it where sampled tokens reach the host after
    :meth:`sample_tokens` returns (an accelerator); a worker that samples on the host would run the forward before
    the fill could start."""

    def __init__(self, options: msgspec.Struct | None, config: Any, registry: Any = None) -> None:
        self.options = options if options is not None else self.Options()
        self.config = config
        self.registry = registry

    @abstractmethod
    def load_model(self) -> WorkerInfo:
        """Build the model on every worker and load its weights."""

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: list[int]) -> None:
        """Allocate ``num_blocks[g]`` blocks for each KV-cache group, warm kernels up, capture graphs."""

    @abstractmethod
    def execute_model(self, step: SchedulerOutput) -> StepHandle | None:
        """Launch one step on the workers; None when the step has structured outputs, whose
        sampling waits for :meth:`sample_tokens`."""

    def sample_tokens(self, grammar: GrammarOutput) -> StepHandle:
        """Sample the oldest step waiting for its bitmask, its constrained rows masked by ``grammar`` (then launch the
        step after it, when that one came with ``launch_after_sampling``)."""
        raise NotImplementedError(f"executor {self.name!r} does not support structured outputs")

    def shutdown(self) -> None:
        """Stop the workers and release their devices. Idempotent."""
