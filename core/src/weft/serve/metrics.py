"""Prometheus metrics of one server (prometheus_client, a registry per app).

The engine core's gauges and its KV connector's metrics are read from the last
stats the core sent; the connector's are declared by its class
(:attr:`weft.contracts.kv_connector.KVConnector.metrics`) and summed over workers by the core.

With several API processes (``server.api_server_count``), each counts the requests it served in
prometheus_client's multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``, set by
:mod:`weft.entrypoints.api_servers` before any metric is made): whichever process answers ``GET /metrics``
adds up every process's counters and histograms, and appends the engine core's metrics, which every process
has alike.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from weft.contracts.kv_connector import ConnectorMetric
    from weft.engine.api.async_engine import AsyncEngine
    from weft.engine.api.output_processor import RequestOutputState as Request

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
)
_REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 3600.0)

FAILURE_REASONS = {
    "timeout": "outlived server.request_timeout",
    "engine_error": "the engine could not serve it (non-finite logits, a step that failed twice)",
    "step_timeout": "the engine core held it while a step outlived engine.step_timeout (its watchdog failed it)",
    "write_timeout": "its client left its stream unread for server.write_timeout (it stopped reading)",
    "rejected": "the engine core refused it",
    "bad_request": "its own sampling parameters and constraint left no token to sample (a 400)",
    "shutdown": "still running when a shutdown's drain ended",
    "engine_dead": "the engine core process died",
    "internal": "an unexpected error in the HTTP server (a 500 or a stream's error event; the log has the traceback)",
}
"""The ``reason`` label of ``weft_request_failures_total``."""


_CORE_GAUGES = [
    ("weft_requests_waiting", "Requests waiting to be scheduled", lambda stats: stats.waiting),
    ("weft_requests_running", "Requests being generated", lambda stats: stats.running),
    ("weft_kv_cache_usage_ratio", "Share of KV-cache blocks in use", lambda stats: stats.kv_cache_usage),
    (
        "weft_prefix_cache_hit_rate",
        "Prompt tokens served from the prefix cache / prompt tokens looked up",
        lambda stats: stats.prefix_cache_hit_tokens / max(stats.prefix_cache_query_tokens, 1),
    ),
    (
        "weft_structured_output_cache_bytes",
        "Memory of the compiled constraints the engine caches (engine.structured_output_cache_bytes at most)",
        lambda stats: stats.structured_output_cache_bytes,
    ),
    (
        "weft_kv_connector_requests_waiting_for_kv",
        "Requests waiting for their KV to arrive through the connector",
        lambda stats: stats.waiting_for_remote_kv,
    ),
]
"""The engine core's gauges, as of the last step it reported: (name, description, read from the core's stats)."""

_CORE_COUNTERS = [
    ("weft_preemptions", "Requests preempted (KV blocks taken back, recomputed later)", "num_preemptions"),
    ("weft_engine_steps", "Engine steps run", "num_steps"),
    ("weft_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", "prefix_cache_query_tokens"),
    ("weft_prefix_cache_hits", "Prompt tokens found in the prefix cache", "prefix_cache_hit_tokens"),
    (
        "weft_encoder_cache_queries",
        "Images looked up in the encoder cache (once per image of a scheduled prompt)",
        "encoder_cache_queries",
    ),
    (
        "weft_encoder_cache_hits",
        "Images whose encoder output was already in the encoder cache (not encoded again)",
        "encoder_cache_hits",
    ),
    (
        "weft_structured_output_compile_timeouts",
        "Requests failed because their constraint outlived engine.structured_output_compile_timeout",
        "structured_output_compile_timeouts",
    ),
    (
        "weft_structured_output_fill_budget_failures",
        "Requests failed because their grammar mask took longer than engine.structured_output_fill_budget in a step",
        "structured_output_fill_budget_failures",
    ),
]
"""The engine core's running totals (name without ``_total``, description, field of the core's stats); the names
are vLLM's (``vllm:prefix_cache_queries``...) with Weft's prefix."""

_CONNECTOR_COUNTERS = [
    (
        "weft_external_prefix_cache_queries",
        "Prompt tokens of the requests the KV connector was asked about",
        "connector_query_tokens",
    ),
    ("weft_external_prefix_cache_hits", "Prompt tokens loaded through the KV connector", "connector_hit_tokens"),
    (
        "weft_kv_connector_failed_load_tokens",
        "Of those, tokens whose load failed or timed out and were computed instead",
        "connector_failed_load_tokens",
    ),
    ("weft_kv_transfers_sent", "Requests whose KV the connector finished sending or saving", "kv_transfers_sent"),
    ("weft_kv_transfers_arrived", "Requests whose asynchronous KV load arrived", "kv_transfers_arrived"),
    (
        "weft_kv_transfers_failed",
        "Requests whose asynchronous KV load failed or timed out (their prompt computed instead)",
        "kv_transfers_failed",
    ),
    ("weft_kv_load_timeouts", "Asynchronous KV loads that outlived engine.kv_load_timeout", "kv_load_timeouts"),
]
"""The KV connector's running totals, kept by the engine core (exposed only with a connector)."""


class ServerMetrics:
    """Counters, gauges and histograms; also the AsyncEngine's observer (called from its reader thread too)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "weft_requests", "Finished requests by finish reason", ["finish_reason"], registry=self.registry
        )
        self.failures = Counter(
            "weft_request_failures",
            "Requests that ended in an error, by reason: "
            + "; ".join(f"{reason}: {meaning}" for reason, meaning in FAILURE_REASONS.items()),
            ["reason"],
            registry=self.registry,
        )
        for reason in FAILURE_REASONS:
            self.failures.labels(reason)
        self.prompt_tokens = Counter("weft_prompt_tokens", "Prompt tokens of finished requests", registry=self.registry)
        self.generation_tokens = Counter(
            "weft_generation_tokens", "Generated tokens of finished requests", registry=self.registry
        )
        self.prompt_tokens_computed = Counter(
            "weft_prompt_tokens_computed",
            "Prompt tokens of finished requests this instance computed itself (neither from the prefix cache nor "
            "through the KV connector)",
            registry=self.registry,
        )
        self._declare_histograms()
        self.core_registry = CollectorRegistry()
        """The engine core's metrics, from the stats it last sent (every API process has the same)."""
        gauges = _CORE_GAUGES
        if engine.config.use.kv_connector == "none":
            gauges = [gauge for gauge in gauges if "kv_connector" not in gauge[0]]
        self.core_registry.register(_CoreGauges(engine, gauges))
        if engine.config.use.kv_connector != "none":
            connector_class = engine.registry.load("kv_connector", engine.config.use.kv_connector)
            self.core_registry.register(_ConnectorMetrics(engine, connector_class.metrics))
        counters = _CORE_COUNTERS + (_CONNECTOR_COUNTERS if engine.config.use.kv_connector != "none" else [])
        self.core_registry.register(_CoreCounters(engine, counters))
        self._folder = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        """Where every API process keeps its counts, when there are several."""

    def exposition(self) -> bytes:
        """``GET /metrics``'s body: this server's metrics (every API process's, added up), then the core's."""
        if self._folder is None:
            return generate_latest(self.registry) + generate_latest(self.core_registry)
        from prometheus_client.multiprocess import MultiProcessCollector

        every_process = CollectorRegistry()
        MultiProcessCollector(every_process, self._folder)
        return generate_latest(every_process) + generate_latest(self.core_registry)

    def _declare_histograms(self) -> None:
        """The latency histograms: per token (first and between), per request (queued, end to end)."""
        self.time_to_first_token = Histogram(
            "weft_time_to_first_token_seconds",
            "Arrival to first generated token",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            "weft_inter_token_latency_seconds",
            "Time between consecutive tokens of a request",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.queue_time = Histogram(
            "weft_request_queue_time_seconds",
            "Arrival in the engine core to first scheduling",
            buckets=_REQUEST_BUCKETS,
            registry=self.registry,
        )
        self.prefill_time = Histogram(
            "weft_request_prefill_time_seconds",
            "First scheduling to first generated token (the prompt's computation or load)",
            buckets=_REQUEST_BUCKETS,
            registry=self.registry,
        )
        self.decode_time = Histogram(
            "weft_request_decode_time_seconds",
            "First generated token to the request's end",
            buckets=_REQUEST_BUCKETS,
            registry=self.registry,
        )
        self.e2e_latency = Histogram(
            "weft_e2e_request_latency_seconds",
            "Arrival to the end of a request, whatever ended it",
            buckets=_REQUEST_BUCKETS,
            registry=self.registry,
        )

    def first_token(self, seconds: float, queued_seconds: float | None = None) -> None:
        self.time_to_first_token.observe(seconds)
        if queued_seconds is not None:
            self.queue_time.observe(queued_seconds)

    def inter_token(self, seconds: float) -> None:
        self.inter_token_latency.observe(seconds)

    def finished(self, request: Request) -> None:
        now = time.monotonic()
        self.requests.labels(request.finish_reason or "unknown").inc()
        self.prompt_tokens.inc(request.num_prompt_tokens)
        self.generation_tokens.inc(len(request.output_token_ids))
        self.e2e_latency.observe(now - request.arrival_time)
        if request.first_token_time is not None:
            self.prompt_tokens_computed.inc(max(request.num_prompt_tokens - request.num_cached_tokens, 0))
            self.decode_time.observe(now - request.first_token_time)
            if request.queued_seconds is not None:
                # The API's arrival precedes the core's by the hand-over (well under a millisecond): the
                # prefill is what remains of the time to the first token once the queue's share is taken off.
                prefill = request.first_token_time - request.arrival_time - request.queued_seconds
                self.prefill_time.observe(max(prefill, 0.0))

    def failed(self, reason: str) -> None:
        self.failures.labels(reason).inc()


class _CoreGauges(Collector):
    """The engine core's state as of the last step it reported."""

    def __init__(self, engine: AsyncEngine, gauges: list[tuple[str, str, Any]]) -> None:
        self.engine = engine
        self.gauges = gauges

    def collect(self) -> Iterator[GaugeMetricFamily]:
        stats = self.engine.stats
        for name, description, read in self.gauges:
            yield GaugeMetricFamily(name, description, value=read(stats))


class _CoreCounters(Collector):
    """Running totals the engine core keeps (reported with its gauges), as counters; speculative decoding's too."""

    def __init__(self, engine: AsyncEngine, counters: list[tuple[str, str, str]]) -> None:
        self.engine = engine
        self.counters = counters

    def collect(self) -> Iterator[CounterMetricFamily]:
        stats = self.engine.stats
        for name, description, field in self.counters:
            yield CounterMetricFamily(name, description, value=getattr(stats, field))
        if not self.engine.config.engine.speculative.enabled:
            return
        # Speculative decoding, under vLLM's names (vllm:spec_decode_*).
        yield CounterMetricFamily(
            "weft_spec_decode_num_drafts", "Verified rows that had proposals", value=stats.spec_decode_num_drafts
        )
        yield CounterMetricFamily(
            "weft_spec_decode_num_draft_tokens", "Proposed tokens verified", value=stats.spec_decode_num_draft_tokens
        )
        yield CounterMetricFamily(
            "weft_spec_decode_num_accepted_tokens",
            "Proposed tokens accepted",
            value=stats.spec_decode_num_accepted_tokens,
        )
        per_position = CounterMetricFamily(
            "weft_spec_decode_num_accepted_tokens_per_pos",
            "Rows whose proposal at this position was accepted",
            labels=["position"],
        )
        for position, count in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
            per_position.add_metric([str(position)], count)
        yield per_position


class _ConnectorMetrics(Collector):
    """A collector of the KV connector's metrics, as the core last reported them."""

    def __init__(self, engine: AsyncEngine, specs: tuple[ConnectorMetric, ...]) -> None:
        self.engine = engine
        self.specs = specs

    def collect(self):
        totals = self.engine.stats.connector_metrics
        for spec in self.specs:
            name = f"weft_kv_connector_{spec.name}"
            total = totals.get(spec.name)
            if spec.kind == "counter":
                family = CounterMetricFamily(name.removesuffix("_total"), spec.help)
                family.add_metric([], total.total if total is not None else 0.0)
            else:
                family = HistogramMetricFamily(name, spec.help)
                counts = total.buckets if total is not None else [0] * len(spec.buckets)
                buckets = [(repr(float(bound)), count) for bound, count in zip(spec.buckets, counts, strict=False)]
                buckets.append(("+Inf", total.count if total is not None else 0))
                family.add_metric([], buckets, total.total if total is not None else 0.0)
            yield family
