"""The ``ngram`` speculator: prompt lookup over each request's own tokens (vLLM's ``ngram`` method).

The longest suffix of the request's tokens (prompt and output), ``prompt_lookup_max`` tokens long
at most and ``prompt_lookup_min`` at least, that also occurs earlier in them, is looked up; the
tokens that followed its earliest occurrence are proposed. Text that repeats its input (editing a
passage, quoting code, filling a template) is where it pays.

Each request's tokens live in a growing numpy buffer, appended to as the request's output grows
(never rebuilt from a list per step), and a lookup is a handful of vectorised passes: one over
the context to find the earlier occurrences of the last token, then one per suffix length over
the occurrences still matching.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

import msgspec
import numpy

from weft.contracts.speculator import (
    Proposals,
    ProposalStep,
    SpeculationRequest,
    Speculator,
    SpeculatorConfig,
    Verified,
)

DEFAULT_NGRAM = 5
"""``prompt_lookup_min`` and ``prompt_lookup_max`` when neither is set (vLLM's choice)."""


class NgramOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    prompt_lookup_min: Annotated[
        int | None, msgspec.Meta(description="the shortest suffix n-gram looked up (default: prompt_lookup_max, or 5)")
    ] = None
    prompt_lookup_max: Annotated[
        int | None, msgspec.Meta(description="the longest suffix n-gram looked up (default: prompt_lookup_min, or 5)")
    ] = None


class TokenBuffer:
    """One request's tokens in a numpy array that grows by doubling."""

    __slots__ = ("array", "length")

    def __init__(self, tokens: Sequence[int]) -> None:
        self.array = numpy.empty(max(16, 2 * len(tokens)), dtype=numpy.int64)
        self.length = 0
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        end = self.length + len(tokens)
        if end > len(self.array):
            grown = numpy.empty(max(end, 2 * len(self.array)), dtype=self.array.dtype)
            grown[: self.length] = self.array[: self.length]
            self.array = grown
        self.array[self.length : end] = tokens
        self.length = end

    def tokens(self) -> numpy.ndarray:
        return self.array[: self.length]


def prompt_lookup(tokens: numpy.ndarray, min_n: int, max_n: int, k: int) -> numpy.ndarray:
    """The up to ``k`` tokens that followed the earliest earlier occurrence of the longest suffix n-gram of
    ``tokens`` (``min_n <= n <= max_n``); empty when no suffix of ``min_n`` tokens occurs earlier."""
    length = len(tokens)
    if k <= 0 or length <= min_n:
        return tokens[:0]
    # ends[i]: where an earlier occurrence of the suffix's last n tokens ends (ascending: the first is the earliest).
    ends = numpy.flatnonzero(tokens[:-1] == tokens[-1])
    n = 1
    while ends.size and n < max_n and n < length:
        reach = ends[ends >= n]
        longer = reach[tokens[reach - n] == tokens[length - 1 - n]]
        if not longer.size:
            break
        ends, n = longer, n + 1
    if not ends.size or n < min_n:
        return tokens[:0]
    start = int(ends[0]) + 1
    return tokens[start : start + k]


class NgramSpeculator(Speculator):
    """Prompt lookup: proposes what followed the longest earlier match of the context's last tokens."""

    name = "ngram"
    Options = NgramOptions

    def __init__(self, options: NgramOptions | None, config: SpeculatorConfig) -> None:
        super().__init__(options, config)
        low, high = self.options.prompt_lookup_min, self.options.prompt_lookup_max
        low = high if low is None else low
        high = low if high is None else high
        self.min_n = DEFAULT_NGRAM if low is None else low
        self.max_n = DEFAULT_NGRAM if high is None else high
        if self.min_n < 1:
            raise ValueError(f"speculative prompt_lookup_min = {self.min_n}: must be at least 1")
        if self.max_n < self.min_n:
            raise ValueError(
                f"speculative prompt_lookup_max = {self.max_n} is below prompt_lookup_min = "
                f"{self.min_n}: raise prompt_lookup_max or lower prompt_lookup_min"
            )
        self._requests: dict[str, TokenBuffer] = {}

    def add_request(self, request: SpeculationRequest) -> None:
        self._requests[request.request_id] = TokenBuffer([*request.prompt_token_ids, *request.output_token_ids])

    def propose(self, step: ProposalStep) -> Proposals:
        proposals = []
        for request_id, most in zip(step.request_ids, step.max_tokens, strict=True):
            buffer = self._requests.get(request_id)
            if buffer is None:
                raise KeyError(f"ngram speculator: request {request_id!r} was never added (add_request first)")
            room = self.config.max_model_len - buffer.length
            found = prompt_lookup(
                buffer.tokens(), self.min_n, self.max_n, min(most, self.config.num_speculative_tokens, room)
            )
            proposals.append(found.tolist())
        return Proposals(proposals)

    def on_verified(self, results: Sequence[Verified]) -> None:
        for result in results:
            buffer = self._requests.get(result.request_id)
            if buffer is not None:
                buffer.extend(result.token_ids)

    def remove_request(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
