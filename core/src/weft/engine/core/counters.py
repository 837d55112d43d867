"""The scheduler's counters, as the fields of :class:`~weft.engine.messages.CoreStats` they fill.

Speculative decoding's running totals (:class:`SpecDecodeCounts`, vLLM's ``spec_decode_*`` counters), the KV
connector's (:func:`connector_counters`) and the structured-output compiler's (:func:`compile_counters`);
:meth:`SchedulerState.stats <weft.engine.core.scheduler_state.SchedulerState.stats>` reports them with the gauges.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from weft.engine.core.kv_connector import ConnectorStats
    from weft.engine.core.structured_output import StructuredOutputManager


class SpecDecodeCounts:
    """Speculative decoding's running totals, under vLLM's metric names (``spec_decode_num_drafts`` ...)."""

    __slots__ = ("drafts", "draft_tokens", "accepted_tokens", "accepted_per_position")

    def __init__(self, k: int) -> None:
        self.drafts = 0
        """Verified rows that had at least one proposal."""
        self.draft_tokens = 0
        """Proposals verified."""
        self.accepted_tokens = 0
        """Proposals accepted."""
        self.accepted_per_position = [0] * k
        """Rows whose proposal ``j`` was accepted, by ``j``."""

    def verified(self, proposed: int, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += proposed
        self.accepted_tokens += accepted
        for position in range(accepted):
            self.accepted_per_position[position] += 1

    def counters(self) -> dict[str, Any]:
        return {
            "spec_decode_num_drafts": self.drafts,
            "spec_decode_num_draft_tokens": self.draft_tokens,
            "spec_decode_num_accepted_tokens": self.accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_position),
        }


def connector_counters(stats: ConnectorStats) -> dict[str, int]:
    return {
        "connector_query_tokens": stats.query_tokens,
        "connector_hit_tokens": stats.hit_tokens,
        "connector_failed_load_tokens": stats.failed_load_tokens,
        "kv_transfers_sent": stats.transfers_sent,
        "kv_transfers_arrived": stats.transfers_arrived,
        "kv_transfers_failed": stats.transfers_failed,
        "kv_load_timeouts": stats.load_timeouts,
    }


def compile_counters(structured_outputs: StructuredOutputManager | None, fill_budget_failures: int) -> dict[str, int]:
    compiler = structured_outputs.compiler if structured_outputs is not None else None
    if compiler is None:
        return {}
    return {
        "structured_output_compile_timeouts": compiler.timeouts,
        "structured_output_fill_budget_failures": fill_budget_failures,
        "structured_output_cache_bytes": compiler.cached_bytes,
    }
