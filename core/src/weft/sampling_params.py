"""How to sample one request: the knobs of vLLM's and OpenAI's APIs, validated on construction."""

from __future__ import annotations

import math

import msgspec

from weft.contracts.structured_output import StructuredOutputsParams

SAMPLING_EPS = 1e-5
"""A temperature below this is greedy decoding (as in vLLM): dividing logits by it would overflow."""
REPETITION_PENALTY_RANGE = (0.01, 100.0)
"""Wider factors overflow or underflow float32 logits (a penalty of 1e-300 turns them to inf)."""
MAX_LOGPROBS = 20
"""The most candidates ``logprobs`` and ``prompt_logprobs`` may ask for (OpenAI's limit for ``top_logprobs``)."""


class SamplingParams(msgspec.Struct, kw_only=True, frozen=True):
    """Sampling options of one request.

    ``temperature = 0`` (anything below :data:`SAMPLING_EPS`) is greedy decoding. ``top_k <= 0``, ``top_p = 1`` and
    ``min_p = 0`` disable those filters. Penalties follow vLLM/OpenAI:
    ``repetition_penalty`` (HF's, over prompt and output tokens) divides positive
    logits and multiplies negative ones; ``presence_penalty`` and
    ``frequency_penalty`` subtract from the logits of tokens already generated.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    """Most tokens to generate; None: up to the context length."""
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    """Strings that end generation; they are not included in the output text."""
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    """Return the log-probabilities of the sampled token and of this many most likely ones."""
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to a JSON schema, regex, choice or grammar (needs a structured-output backend)."""
    logit_bias: dict[int, float] | None = None
    """Token id -> value in [-100, 100] added to its logit before sampling (-100 bans it, +100 all but forces it)."""
    allowed_token_ids: tuple[int, ...] | None = None
    """Sample only among these tokens."""
    bad_words: tuple[str, ...] = ()
    """Words never to generate: the last token of each is banned when the output ends with the ones before it."""
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    """``bad_words`` tokenized (with and without a leading space); filled in when the request is submitted."""
    prompt_logprobs: int | None = None
    """Return the log-probability of each prompt token and of this many most likely ones at each position."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            msgspec.structs.force_setattr(self, "stop", (self.stop,))
        else:
            msgspec.structs.force_setattr(self, "stop", tuple(self.stop))
        msgspec.structs.force_setattr(self, "stop_token_ids", tuple(self.stop_token_ids))
        msgspec.structs.force_setattr(self, "bad_words", tuple(self.bad_words))
        if self.allowed_token_ids is not None:
            msgspec.structs.force_setattr(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        if self.logit_bias is not None:
            msgspec.structs.force_setattr(
                self, "logit_bias", {int(token): float(value) for token, value in self.logit_bias.items()}
            )
        checks = [*_knob_checks(self), *_token_checks(self)]
        for ok, field, value, rule in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{field} = {value!r}: {rule}")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    def choices(self) -> list[SamplingParams]:
        """One single-sample copy per choice: ``n=1``, and the seed advanced by the choice index (modulo 2**63,
        so that any valid seed has valid successors)."""
        return [
            msgspec.structs.replace(self, n=1, seed=None if self.seed is None else (self.seed + index) % 2**63)
            for index in range(self.n)
        ]


_Check = tuple[object, str, object, str]
"""Whether (truthy) a field holds, the field, its value and the rule it breaks (the error names all three)."""


def _knob_checks(params: SamplingParams) -> list[_Check]:
    """The sampling knobs: finite, in their ranges; and the output's length bounds."""
    low, high = REPETITION_PENALTY_RANGE
    return [
        *(
            (math.isfinite(value), name, value, "must be a finite number")
            for name, value in (
                ("temperature", params.temperature),
                ("top_p", params.top_p),
                ("min_p", params.min_p),
                ("presence_penalty", params.presence_penalty),
                ("frequency_penalty", params.frequency_penalty),
                ("repetition_penalty", params.repetition_penalty),
            )
        ),
        (params.n >= 1, "n", params.n, "must be >= 1"),
        (params.temperature >= 0, "temperature", params.temperature, "must be >= 0 (0 is greedy)"),
        (0 < params.top_p <= 1, "top_p", params.top_p, "must be in (0, 1]"),
        (params.top_k >= -1, "top_k", params.top_k, "must be >= -1 (0 or -1 disables it)"),
        (0 <= params.min_p <= 1, "min_p", params.min_p, "must be in [0, 1]"),
        (-2 <= params.presence_penalty <= 2, "presence_penalty", params.presence_penalty, "must be in [-2, 2]"),
        (-2 <= params.frequency_penalty <= 2, "frequency_penalty", params.frequency_penalty, "must be in [-2, 2]"),
        (
            low <= params.repetition_penalty <= high,
            "repetition_penalty",
            params.repetition_penalty,
            f"must be in [{low}, {high}] (1 disables it)",
        ),
        (params.max_tokens is None or params.max_tokens >= 1, "max_tokens", params.max_tokens, "must be >= 1"),
        (params.min_tokens >= 0, "min_tokens", params.min_tokens, "must be >= 0"),
    ]


def _token_checks(params: SamplingParams) -> list[_Check]:
    """What the output returns and where it stops (logprobs, stop strings), the seed, and the token-level options
    (logit bias, allowed tokens, bad words)."""
    return [
        (
            params.logprobs is None or 0 <= params.logprobs <= MAX_LOGPROBS,
            "logprobs",
            params.logprobs,
            f"must be in [0, {MAX_LOGPROBS}]",
        ),
        (all(isinstance(s, str) and s for s in params.stop), "stop", params.stop, "must be non-empty strings"),
        (params.seed is None or 0 <= params.seed < 2**63, "seed", params.seed, "must be in [0, 2**63)"),
        (
            params.prompt_logprobs is None or 0 <= params.prompt_logprobs <= MAX_LOGPROBS,
            "prompt_logprobs",
            params.prompt_logprobs,
            f"must be in [0, {MAX_LOGPROBS}]",
        ),
        (
            params.logit_bias is None or all(-100 <= value <= 100 for value in params.logit_bias.values()),
            "logit_bias",
            params.logit_bias,
            "values must be in [-100, 100]",
        ),
        (
            params.logit_bias is None or all(token >= 0 for token in params.logit_bias),
            "logit_bias",
            params.logit_bias,
            "token ids must be >= 0",
        ),
        (
            params.allowed_token_ids is None or (params.allowed_token_ids and min(params.allowed_token_ids) >= 0),
            "allowed_token_ids",
            params.allowed_token_ids,
            "must be a non-empty list of token ids >= 0",
        ),
        (
            all(isinstance(word, str) and word.strip() for word in params.bad_words),
            "bad_words",
            params.bad_words,
            "must be non-empty strings",
        ),
    ]
