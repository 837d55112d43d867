"""What the workers hold of each request, and what each step in flight planned: the scheduler's ledger of its steps.

The scheduler sends a request to the workers whole once (a
:class:`~weft.contracts.executor.NewRequest`), then only where its next step starts and the blocks it
gained (a :class:`~weft.contracts.executor.CachedRequest`); :class:`StepsInFlight` remembers what was
sent, and which requests the workers must drop. Per step scheduled and not applied yet it keeps a
:class:`ScheduledRow` per request, which the step's results are checked against (a step from before a
preemption is stale), and the blocks published in the prefix cache for a preempted request before
the steps that write them were applied (unpublished if one of them fails).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, NamedTuple

from weft.contracts.executor import CachedRequest, NewRequest

if TYPE_CHECKING:
    from weft.engine.core.kv_cache_manager import KVCacheManager
    from weft.engine.core.request import Request


class ScheduledRow(NamedTuple):
    """What the scheduler planned for one request in a step in flight."""

    num_preemptions: int
    """The request's preemptions when scheduled: a step from before a preemption is stale."""
    start: int
    """Tokens computed before the step."""
    samples: bool
    """Whether the step samples the request's next token."""
    first: bool
    """Whether the step sent it to the workers as a :class:`~weft.contracts.executor.NewRequest`."""


class StepsInFlight:
    def __init__(self) -> None:
        self._sent_blocks: dict[str, list[int]] = {}
        """Blocks per group each request's workers already hold."""
        self._dropped: list[str] = []
        """Requests ended or preempted since the last step: workers drop them."""
        self._steps: deque[dict[str, ScheduledRow]] = deque()
        """Per step in flight, what it planned for each scheduled request."""
        self._published: list[tuple[int, list[tuple[int, int, bytes]]]] = []
        """Blocks published for preempted requests before the steps in flight that write them were applied:
        ``(steps in flight at the time, blocks)``; unpublished if one of those steps fails."""

    def requests_for_workers(
        self,
        scheduled: list[tuple[Request, int]],
        starts: dict[str, int],
        kv_cache: KVCacheManager,
    ) -> tuple[list[NewRequest], list[CachedRequest]]:
        """What the workers need of the scheduled requests (``starts``: where each one's step starts): new ones
        whole, the others' start and the blocks they gained since they were last sent."""
        new_requests: list[NewRequest] = []
        cached_requests: list[CachedRequest] = []
        for request, _ in scheduled:
            request_id = request.request_id
            blocks = kv_cache.block_ids(request_id)
            sent = self._sent_blocks.get(request_id)
            start = starts[request_id]
            if sent is None:
                new_requests.append(
                    NewRequest(
                        request_id,
                        list(request.all_token_ids),
                        request.num_prompt_tokens,
                        request.params,
                        tuple(request.eos_token_ids),
                        blocks,
                        start,
                        request.state_transferred,
                        request.multimodal,
                    )
                )
            else:
                grown = any(len(group) > held for group, held in zip(blocks, sent, strict=False))
                cached_requests.append(
                    CachedRequest(
                        request_id,
                        start,
                        tuple(group[held:] for group, held in zip(blocks, sent, strict=False)) if grown else None,
                    )
                )
            self._sent_blocks[request_id] = [len(group) for group in blocks]
        return new_requests, cached_requests

    def launched(self, rows: dict[str, ScheduledRow]) -> list[str]:
        """A step was scheduled with these rows; returns the requests its workers drop."""
        self._steps.append(rows)
        dropped, self._dropped = self._dropped, []
        return dropped

    def drop_on_workers(self, request_id: str) -> None:
        """The request ended or was preempted: the next step tells the workers to drop it (if they hold it)."""
        if self._sent_blocks.pop(request_id, None) is not None:
            self._dropped.append(request_id)

    def applied(self) -> dict[str, ScheduledRow]:
        """The oldest step in flight's results arrived: its rows (steps are applied in the order scheduled)."""
        self._published = [(steps - 1, blocks) for steps, blocks in self._published if steps > 1]
        return self._steps.popleft()

    def publish_before_preempt(
        self, request: Request, planned: int, kv_cache: KVCacheManager, with_connector: bool
    ) -> None:
        """Before preempting a request with steps in flight: publish the blocks those steps fill (of tokens whose ids
        are known; ``planned``: the tokens computed or being computed) in the prefix cache, so that it finds them
        when it comes back rather than computing them again; with asynchronous scheduling a preempted request
        otherwise lost its chunk in flight every time, and a request under KV pressure could recompute the same
        chunk step after step. Sound because steps run in order: the step in flight writes the blocks before any
        later step reads them (a block handed out again is unpublished by the pool first). Not where a KV connector
        loads in one of those steps (a load can fail after the fact); a failed step unpublishes them
        (:meth:`forget`)."""
        if not self._steps:
            return
        known = min(planned, request.num_tokens)
        if known <= request.num_computed_tokens:
            return
        if with_connector and any(
            (row := step.get(request.request_id)) is not None and row.first for step in self._steps
        ):
            return
        published = kv_cache.cache_blocks(request.request_id, request.all_token_ids, known, request.block_items)
        if published:
            self._published.append((len(self._steps), published))

    def forget(self, kv_cache: KVCacheManager) -> None:
        """Steps scheduled but never applied (one raised): their results will not come, nor the contents of the blocks
        published for them."""
        for _, blocks in self._published:
            kv_cache.uncache(blocks)
        self._published = []
        self._steps.clear()
