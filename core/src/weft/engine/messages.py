"""What crosses between the API process and the engine-core process: requests in, outputs and gauges out.

Every type here is a msgspec Struct sent msgpack-encoded over the ZMQ sockets that
:class:`~weft.engine.client.ProcessClient` binds (the in-process client hands the same
objects over without encoding them). The module imports no torch: the API process
(``weft serve``'s server) loads it without loading the model's libraries.

To the core: :data:`ToCore` (:class:`AddRequests`, :class:`Abort`, :class:`Shutdown`).
From the core: :data:`FromCore` (:class:`Ready` or :class:`Failed` once at start, then
:class:`StepOutputs` per step, and :class:`Failed` as its last word when its workers are gone).
"""

from __future__ import annotations

from typing import Any

import msgspec

from weft.contracts.executor import TokenLogprobs
from weft.contracts.mm_processor import MultimodalInputs
from weft.sampling_params import SamplingParams


class GrammarStart(msgspec.Struct, array_like=True, frozen=True):
    """Where a structured-output constraint starts when the model may reason first (the constraint covers the
    answer only)."""

    after: tuple[int, ...]
    """The tokens ending the reasoning: the constraint covers what follows them."""
    opener: int | None = None
    """None: the prompt opened the reasoning, the output begins inside it. Else the token opening the reasoning: the
    constraint covers the output from its first token, whose mask also allows this one; an output opening with it
    reasons, and is constrained after :attr:`after`."""


class EngineCoreRequest(msgspec.Struct, array_like=True, frozen=True):
    """A request as the engine core takes it: token ids and how to sample."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    max_tokens: int
    """``params.max_tokens`` capped by the context length (the API side computes it)."""
    kv_transfer_params: dict[str, Any] | None = None
    """For the KV connector (:attr:`weft.contracts.kv_connector.ConnectorRequest.params`)."""
    grammar_start: GrammarStart | None = None
    """With a structured-output constraint, for a model that may reason first (None: the constraint covers the
    whole output)."""
    multimodal: MultimodalInputs | None = None
    """The prompt's images (items with their ranges, hashes and encoder inputs), extras and positions, as the
    multimodal processor made them in the API process (:mod:`weft.contracts.mm_processor`); None: text only."""


class EngineCoreOutput(msgspec.Struct, array_like=True, gc=False):
    """What one request produced in one step, as the engine core reports it (untracked by the cyclic garbage
    collector, as it never holds itself: thousands are decoded each second, each a collection's work otherwise)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    """Why the request failed (finish reason ``error``): this step could not serve it."""
    queued_seconds: float | None = None
    """With a request's first token: the time from its arrival in the core to its first scheduling."""
    prompt_logprobs: list[TokenLogprobs] | None = None
    """With the request's first token, when it asked for prompt logprobs: those of prompt tokens 1..."""


class ConnectorMetricTotal(msgspec.Struct, array_like=True):
    """A connector metric summed since start: a counter's total, or a histogram's sum, count and buckets."""

    total: float = 0.0
    count: int = 0
    buckets: list[int] = []
    """Samples at or below each of the metric's bounds (cumulative, as Prometheus counts them)."""


class CoreStats(msgspec.Struct, array_like=True, gc=False):
    """The core's gauges, sent to the API side with its outputs."""

    waiting: int = 0
    running: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_query_tokens: int = 0
    """Prompt tokens looked up in the prefix cache since the core started (a counter, as are the next ones)."""
    prefix_cache_hit_tokens: int = 0
    encoder_cache_queries: int = 0
    """Items whose encoder output a step needed, looked up in the encoder cache (a counter)."""
    encoder_cache_hits: int = 0
    """Of those, items found there: not encoded again (a counter)."""
    connector_query_tokens: int = 0
    """Prompt tokens of the requests the KV connector was asked about."""
    connector_hit_tokens: int = 0
    connector_failed_load_tokens: int = 0
    kv_transfers_sent: int = 0
    """Requests whose KV the connector finished sending (a prefill instance's pushes, a store's saves)."""
    kv_transfers_arrived: int = 0
    """Requests whose asynchronous KV load arrived."""
    kv_transfers_failed: int = 0
    """Requests whose asynchronous KV load failed or outlived ``engine.kv_load_timeout`` (computed instead)."""
    kv_load_timeouts: int = 0
    """Of those, the loads that outlived ``engine.kv_load_timeout``."""
    waiting_for_remote_kv: int = 0
    connector_metrics: dict[str, ConnectorMetricTotal] = {}
    """The KV connector's metrics summed since start, by name."""
    structured_output_compile_timeouts: int = 0
    """Requests failed because their constraint outlived ``engine.structured_output_compile_timeout``."""
    structured_output_fill_budget_failures: int = 0
    """Requests failed because their grammar mask took longer than ``engine.structured_output_fill_budget``."""
    structured_output_cache_bytes: int = 0
    """What the compiled constraints the engine caches take (``engine.structured_output_cache_bytes`` at most)."""
    num_preemptions: int = 0
    """Preemptions since the core started (a counter)."""
    num_steps: int = 0
    """Steps run since the core started."""
    spec_decode_num_drafts: int = 0
    """Speculative decoding since start: rows that verified proposals, proposals verified, proposals accepted,
    and per proposal position the rows that accepted it (counters)."""
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = []


class AddRequests(msgspec.Struct, tag=True, array_like=True):
    requests: list[EngineCoreRequest]
    client: int = 0
    """The API process that sends them (``server.api_server_count``): their outputs go back to it."""


class Abort(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


ToCore = AddRequests | Abort | Shutdown


class Ready(msgspec.Struct, tag=True, array_like=True):
    engine: dict[str, object]
    """The effective engine settings (platform-sized defaults resolved), for logs and ``weft config show``."""


class Failed(msgspec.Struct, tag=True, array_like=True):
    """The core could not start, or (its last message) it stops because its workers are gone."""

    message: str
    traceback: str = ""


class StepOutputs(msgspec.Struct, tag=True, array_like=True, gc=False):
    outputs: list[EngineCoreOutput]
    stats: CoreStats
    refused: dict[str, str] = {}
    """Requests the core would not take (a bad request, a constraint that failed to compile), with the reason."""
    failed: dict[str, str] = {}
    """Requests a failed step ended (an internal error), with the reason. Both are gone from the core."""
    stuck: str | None = None
    """Set by the core's watchdog (:mod:`weft.engine.core.watchdog`) when a step outlived
    ``engine.step_timeout``: the phase it is stuck in (its ``failed`` are the requests the core held). The next
    message of a step that ended clears it."""
    heartbeat: bool = False
    """Sent by the core's watchdog while a long step runs: the core is alive and busy. It carries nothing else to
    apply (its stats may be older than a step's message sent meanwhile)."""


FromCore = Ready | Failed | StepOutputs
