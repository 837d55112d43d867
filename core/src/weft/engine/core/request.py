"""One sequence in the engine core, and how it ends.

Where an unfinished request is, is the scheduler's bookkeeping: its queues::

    waiting --admitted--> running --finished--> FINISHED_STOPPED | FINISHED_LENGTH | FINISHED_ABORTED | FINISHED_ERROR
     ^  |  ^                 |
     |  |  +----preempted----+   (blocks freed; recomputed from scratch when rescheduled)
     |  +--asynchronous KV load--> receiving   (holds its blocks, in no step)
     +----KV arrived (or failed: computed instead)--+

A request's progress (:attr:`Request.num_computed_tokens`, its output tokens,
:attr:`Request.num_cached_tokens`) and how it ended (:attr:`Request.status`) are
written by :meth:`Scheduler.update_from_output
<weft.engine.core.scheduler.Scheduler.update_from_output>` from what the steps
produced; the one other writer is :meth:`Scheduler.finish
<weft.engine.core.scheduler.Scheduler.finish>`, for an end the API asks for (an abort,
a stop string). ``tests/test_layering.py`` holds the code to that. Text, stop
strings and decoded logprobs are not the core's business:
:mod:`weft.engine.api.output_processor` keeps them beside the API.
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from weft.contracts.executor import TokenLogprobs
    from weft.contracts.mm_processor import MultimodalInputs
    from weft.engine.core.constraint_state import ConstraintState
    from weft.engine.messages import EngineCoreRequest
    from weft.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    """How a request ended; the value is its finish reason."""

    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"
    """The step could not serve it (non-finite logits, a failed draw); the others went on."""


class Request:
    """The engine core's state of one sequence."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        eos_token_ids: frozenset[int],
        arrival_time: float | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
        multimodal: MultimodalInputs | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(prompt_token_ids)
        """Prompt then output ids, kept in step by :meth:`append_token` (read every step: never rebuilt)."""
        self.params = params
        self.max_tokens = max_tokens
        """Tokens this request may generate: params.max_tokens capped by the context length."""
        self.eos_token_ids = frozenset() if params.ignore_eos else eos_token_ids
        self.status: RequestStatus | None = None
        """How the request ended; None while it has not (the scheduler's queues say where it is)."""
        self.num_computed_tokens = 0
        """Tokens whose KV the steps applied so far computed or loaded, as of the last one that served
        the request (the scheduler plans from its own count, which adds the steps in flight and starts
        again after a preemption)."""
        self.num_cached_tokens = 0
        """Prompt tokens served from the prefix cache or a KV connector when first scheduled (known once
        that step's output is applied)."""
        self.num_preemptions = 0
        self.state_transferred = False
        """Its whole state arrived by a transfer (``kv_transfer_params`` and an asynchronous load) since it was
        last (re)scheduled: no snapshot of the transferred prefix is in this instance."""
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_scheduled_time = self.arrival_time
        """When the scheduler first gave it tokens (the end of its time in the queue)."""
        self.stop_reason: int | None = None
        self.constraint: ConstraintState | None = None
        """The structured-output constraint's compilation and matcher (:mod:`weft.engine.core.structured_output`)."""
        self.prompt_logprobs: list[TokenLogprobs] | None = [] if params.prompt_logprobs is not None else None
        """Logprobs of prompt tokens 1.. as the steps computed them (when the request asked)."""
        self.prompt_logprobs_sent = False
        self.kv_transfer_params = kv_transfer_params
        """What the KV connector is to do with this request (the API's ``kv_transfer_params``)."""
        self.spec_token_ids: list[int] = []
        """Speculative decoding: the speculator's proposals for the request's next step (after its last token),
        from the output of its last step; cleared when they are scheduled or the request is preempted."""
        self.multimodal = multimodal
        """Its images (items, ranges, hashes, encoder inputs), extras and positions; None: text only."""
        self.block_items: tuple[tuple[int, int, bytes], ...] = (
            tuple(
                (start, end, multimodal.items[index].hash.encode() + row.to_bytes(8, "little"))
                for start, end, index, row in multimodal.spans()
            )
            if multimodal is not None
            else ()
        )
        """Its placeholder ranges as prefix-cache block items (:func:`weft.engine.core.kv_cache_manager.block_hashes`):
        each range keyed by its item's hash and the item row it starts at."""

    @classmethod
    def from_core_request(cls, request: EngineCoreRequest) -> Request:
        """The core's state of a request the API sent (tokenized, its limits resolved)."""
        return cls(
            request.request_id,
            request.prompt_token_ids,
            request.params,
            request.max_tokens,
            frozenset(request.eos_token_ids),
            kv_transfer_params=request.kv_transfer_params,
            multimodal=request.multimodal,
        )

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is not None

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status is not None else None

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name if self.status else 'unfinished'}, "
            f"prompt={self.num_prompt_tokens}, output={len(self.output_token_ids)}, "
            f"computed={self.num_computed_tokens})"
        )
