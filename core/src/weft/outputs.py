"""What generation returns, in vLLM's shape."""

from __future__ import annotations

import msgspec

NO_TOKEN_ALLOWED = (
    "no token is left to sample: its allowed_token_ids, bad_words, logit_bias, min_tokens and structured-output "
    "constraint together exclude every token; loosen one of them"
)
"""Why a request whose own sampling edits ban every token fails (the server answers 400)."""


class Logprob(msgspec.Struct, frozen=True):
    """Log-probability of one token, its rank (1 is the most likely) and its text."""

    logprob: float
    rank: int
    decoded_token: str


class CompletionOutput(msgspec.Struct):
    """One generated sequence of a request."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    """``stop`` (EOS, a stop string or a stop token), ``length``, ``abort``, or None while running."""
    stop_reason: str | int | None = None
    """The stop string or stop token id that ended it, if any."""
    logprobs: list[dict[int, Logprob]] | None = None
    """Per generated token: token id -> Logprob for the sampled token and the top-n."""


class RequestOutput(msgspec.Struct):
    """A request and its outputs."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    """With ``SamplingParams(prompt_logprobs=n)``: per prompt token (None for the first) its Logprob and the top-n."""
