"""One sequence being generated, and the states it moves through.

::

    WAITING --schedule--> RUNNING --finish--> FINISHED_STOPPED | FINISHED_LENGTH | FINISHED_ABORTED
       ^                     |
       +------preempt--------+   (blocks freed; recomputed from scratch when rescheduled)
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from weft.contracts.tokenizer import IncrementalDetokenizer
    from weft.outputs import Logprob
    from weft.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED})


class Request:
    """The engine's state of one sequence."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        eos_token_ids: frozenset[int],
        detokenizer: IncrementalDetokenizer | None = None,
        generator: torch.Generator | None = None,
        stream_text: bool = True,
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
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        """Prompt tokens served from the prefix cache or a KV connector when first scheduled."""
        self.num_preemptions = 0
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.detokenizer = detokenizer
        self.generator = generator
        self.text = ""
        """Output text with stop strings removed (when the request stopped on one)."""
        self.defer_text = not stream_text and not params.stop
        """Detokenize once when the request finishes instead of token by token: nobody reads the
        text before then (``stream_text`` False) and no stop string needs it."""
        self.stop_reason: str | int | None = None
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None

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
        return self.status in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
            f"output={len(self.output_token_ids)}, computed={self.num_computed_tokens})"
        )
