"""Turn the logits of one step into the next token of each request, on the logits' device.

Order of processing, batched over the step's rows in float32:

1. Health: a row whose raw logits hold a NaN or +inf, or only -inf, fails with
   :data:`NON_FINITE_LOGITS`.
2. Log-probabilities, for the rows that ask: of the model's raw distribution (after a
   grammar's bitmask, before everything below), as vLLM returns by default: the chosen
   token's, its rank and the top ``logprobs`` candidates.
3. Edits, for the rows that ask: allowed tokens, bad words, the ``min_tokens`` ban on EOS
   and stop ids and logit bias (:mod:`weft.runner.logits_processors`), then penalties
   (repetition over prompt and output, presence/frequency over output) from the token counts
   the runner keeps on the device (:mod:`weft.runner.penalties`). A row whose edited maximum
   is not finite (every token banned) fails with :data:`NO_TOKEN_ALLOWED`, the request's own doing.
4. Greedy rows take the argmax. The others: temperature (each row's maximum subtracted
   first, so that no temperature turns finite logits into inf or NaN), top-k, top-p,
   min-p, and a draw by the exponential race (the argmax of ``probs / E``, ``E`` drawn
   from Exp(1) per token: a sample of ``probs``). A request with a seed draws ``E``
   from its own generator on the logits' device, seeded for each draw from the request's
   seed and the position of the token drawn (:func:`draw_seed`), so its tokens depend
   neither on the rest of the batch nor on when it was scheduled, preempted and resumed;
   the others from the sampler's, seeded from the engine's seed, so that tensor-parallel
   ranks, which sample the same logits, draw the same tokens.

Nothing here waits for the device: :meth:`Sampler.sample` returns a
:class:`SampledBatch` of device tensors (tokens, a status per row, logprobs), small
enough to cross to the host in the background. Only the step's parameters and the
token ids its edits name cross the other way (without waiting for the device either). A step
whose batched sampling raises is sampled again one row at a time, so the row that raises fails alone.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec
import torch

from weft.outputs import NO_TOKEN_ALLOWED
from weft.runner.logits_processors import apply_request_processors, needs_request_processors, to_device
from weft.runner.penalties import TokenCounts, apply_penalties, needs_penalties

if TYPE_CHECKING:
    from weft.runner.request_state import RequestState as Request
    from weft.sampling_params import SamplingParams


NON_FINITE_LOGITS = "the model's logits for it are not finite (NaN or inf)"
SAMPLING_FAILED = "sampling its next token failed"

SAMPLED, NON_FINITE, FAILED, BANNED = 0, 1, 2, 3
"""A row's status in a :class:`SampledBatch`."""
STATUS_REASONS = {NON_FINITE: NON_FINITE_LOGITS, FAILED: SAMPLING_FAILED, BANNED: NO_TOKEN_ALLOWED}
"""Why a row of each failing status got no token."""

logger = logging.getLogger("weft.runner")


class SampledToken(msgspec.Struct):
    token_id: int
    logprob: float | None = None
    rank: int | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    error: str | None = None
    """Why this row got no token (its logits are not finite, its draw failed): its request fails alone."""


class RawLogprobs:
    """Per row of a step: the chosen token's raw logprob and rank, and the top candidates' tokens and logprobs."""

    def __init__(
        self,
        chosen: torch.Tensor,
        ranks: torch.Tensor,
        top_tokens: torch.Tensor,
        top_values: torch.Tensor,
        wanted: list[int | None],
    ) -> None:
        self.chosen, self.ranks, self.top_tokens, self.top_values = chosen, ranks, top_tokens, top_values
        self.wanted = wanted
        """Per row, how many candidates its request asked for (None: no logprobs)."""

    @staticmethod
    def concatenate(pieces: Sequence[RawLogprobs]) -> RawLogprobs:
        """The rows of ``pieces`` in order (all of the same width)."""
        return RawLogprobs(
            *(
                torch.cat([getattr(piece, name) for piece in pieces])
                for name in ("chosen", "ranks", "top_tokens", "top_values")
            ),
            [wanted for piece in pieces for wanted in piece.wanted],
        )


class SampledBatch:
    """One step's sampled rows: each row's token and status (:data:`SAMPLED`, :data:`NON_FINITE`,
    :data:`FAILED`, :data:`BANNED`), and the raw logprobs when a row asked for them. On the logits' device until
    :meth:`to_host`; a failed row's token is some valid id (the next step may read it before the
    host knows it failed)."""

    def __init__(
        self,
        tokens: torch.Tensor,
        status: torch.Tensor,
        logprobs: RawLogprobs | None = None,
        packed: torch.Tensor | None = None,
    ) -> None:
        self.tokens, self.status, self.logprobs = tokens, status, logprobs
        self.packed = packed
        """``[2, n]``, ``n`` at least the rows: the tokens then the statuses in one contiguous tensor, the first
        columns being these rows' (what :meth:`to_host` copies), when the sampler wrote them so; None: stacked for
        the copy."""

    def to_host(self, non_blocking: bool = True) -> SampledBatch:
        """The same on the host. On an accelerator the copies go to pinned memory and, ``non_blocking``,
        run in the background: record an event after them and wait for it before reading."""
        if self.tokens.device.type == "cpu":
            return self
        packed = torch.stack([self.tokens, self.status]) if self.packed is None else self.packed
        tokens_and_status = _host_copy(packed, non_blocking)[:, : self.tokens.shape[0]]
        logprobs = self.logprobs
        if logprobs is not None:
            logprobs = RawLogprobs(
                *(
                    _host_copy(tensor, non_blocking)
                    for tensor in (logprobs.chosen, logprobs.ranks, logprobs.top_tokens, logprobs.top_values)
                ),
                logprobs.wanted,
            )
        return SampledBatch(tokens_and_status[0], tokens_and_status[1], logprobs)

    def sampled_tokens(self) -> list[SampledToken]:
        """One per row (reads the tensors: on the host, after :meth:`to_host` finished)."""
        statuses = self.status.tolist()
        sampled = [
            SampledToken(token) if status == SAMPLED else SampledToken(-1, error=STATUS_REASONS[status])
            for token, status in zip(self.tokens.tolist(), statuses, strict=True)
        ]
        logprobs = self.logprobs
        if logprobs is None:
            return sampled
        chosen, ranks = logprobs.chosen.tolist(), logprobs.ranks.tolist()
        top_tokens, top_values = logprobs.top_tokens.tolist(), logprobs.top_values.tolist()
        for row, wanted in enumerate(logprobs.wanted):
            if wanted is None or statuses[row] != SAMPLED:
                continue
            top = list(zip(top_tokens[row][:wanted], top_values[row][:wanted], strict=False))
            sampled[row] = SampledToken(sampled[row].token_id, chosen[row], ranks[row], top)
        return sampled

    @staticmethod
    def concatenate(parts: Sequence[SampledBatch]) -> SampledBatch:
        """The rows of ``parts`` in order (all with logprobs of the same width, or none)."""
        tokens = torch.cat([part.tokens for part in parts])
        status = torch.cat([part.status for part in parts])
        if parts[0].logprobs is None:
            return SampledBatch(tokens, status)
        return SampledBatch(tokens, status, RawLogprobs.concatenate([part.logprobs for part in parts]))


def _host_copy(tensor: torch.Tensor, non_blocking: bool) -> torch.Tensor:
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=non_blocking)


class RowParams:
    """A step's temperature, top-k, top-p and min-p per row, as device tensors made with one copy.

    Greedy rows, and filters a row leaves off, get values that change nothing (temperature 1,
    top-k the vocabulary, top-p 2, min-p 0); the ``uses_*`` flags say which filters any row needs.
    """

    def __init__(self, params: Sequence[SamplingParams], vocab: int, device: torch.device) -> None:
        random = [not row.greedy for row in params]
        top_k = [
            row.top_k if drawn and 0 < row.top_k < vocab else vocab for row, drawn in zip(params, random, strict=False)
        ]
        top_p = [row.top_p if drawn and row.top_p < 1 else 2.0 for row, drawn in zip(params, random, strict=False)]
        min_p = [row.min_p if drawn else 0.0 for row, drawn in zip(params, random, strict=False)]
        temperature = [row.temperature if drawn else 1.0 for row, drawn in zip(params, random, strict=False)]
        self.random = random
        """Per row, whether it draws (not greedy)."""
        self.uses_top_k = any(k < vocab for k in top_k)
        self.uses_top_p = any(p < 1 for p in top_p)
        self.uses_min_p = any(p > 0 for p in min_p)
        packed = to_device(
            [temperature, top_k, top_p, min_p, [float(drawn) for drawn in random]], torch.float32, device
        )  # top_k < 2**24
        self.temperature = packed[0]
        self.top_k = packed[1].long()
        self.top_p = packed[2]
        self.log_min_p = packed[3].log()
        """log(min_p): a token is kept when its logit is at most this far below the row's best (-inf: all kept)."""
        self.greedy = packed[4] == 0


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request]) -> list[SampledToken]:
        """:meth:`sample`, waited for: one token per row, on the host."""
        return self.sample(logits, requests).to_host(non_blocking=False).sampled_tokens()

    def sample(
        self, logits: torch.Tensor, requests: Sequence[Request], counts: TokenCounts | None = None
    ) -> SampledBatch:
        """Sample one token per row of ``logits`` (on the model's device), without waiting for the device.

        A step of plain greedy rows (no logprobs, no edits) takes the argmax of the logits as they are.
        Penalties read ``counts`` (rows it lacks are built there); without it, counts made for this step
        from the requests' token ids on the host.
        """
        if all(plain_greedy(request) for request in requests):
            tokens, healthy = greedy_maxima(logits)
            return SampledBatch(tokens, greedy_status(healthy))
        top = max(
            (request.params.logprobs for request in requests if request.params.logprobs is not None), default=None
        )
        try:
            return self._sample_rows(logits, requests, top, counts)
        except Exception:  # one request's failure must not end the step of the others
            logger.exception("sampling a step of %d rows failed; sampling them one at a time", len(requests))
        parts = []
        for row, request in enumerate(requests):
            try:
                parts.append(self._sample_rows(logits[row : row + 1], [request], top, counts))
            except Exception:
                logger.exception("sampling request %s failed", request.request_id)
                parts.append(_failed_row(logits.device, top, request))
        return SampledBatch.concatenate(parts)

    def _sample_rows(
        self, logits: torch.Tensor, requests: Sequence[Request], top: int | None, counts: TokenCounts | None
    ) -> SampledBatch:
        """Every step of the module docstring over ``logits``; logprobs of width ``top`` when it is not None."""
        raw = logits.float()
        raw_maxima = raw.max(dim=-1).values
        processed = edited_logits(raw, requests, counts)
        maxima, tokens = processed.max(dim=-1)
        status = torch.where(torch.isfinite(maxima), SAMPLED, BANNED).masked_fill_(
            ~torch.isfinite(raw_maxima), NON_FINITE
        )
        if not all(request.params.greedy for request in requests):
            rows = RowParams([request.params for request in requests], logits.shape[-1], logits.device)
            tokens = torch.where(rows.greedy, tokens, self._draw(filter_logits(processed, rows), requests, rows))
        if top is None:
            return SampledBatch(tokens, status)
        return SampledBatch(tokens, status, raw_logprobs(raw, tokens, top, requests))

    def _draw(self, logits: torch.Tensor, requests: Sequence[Request], rows: RowParams) -> torch.Tensor:
        probs = logits.softmax(dim=-1)
        seeded = [
            (row, request.generator)
            for row, request in enumerate(requests)
            if request.generator is not None and rows.random[row]
        ]
        return probs.div_(exponential_noise(probs, self.generator(probs.device), seeded)).argmax(dim=-1)

    def generator(self, device: torch.device) -> torch.Generator:
        """The draws of requests without a seed on ``device``, seeded from the engine's seed."""
        generator = self._generators.get(device)
        if generator is None:
            generator = self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return generator


def exponential_noise(
    like: torch.Tensor, generator: torch.Generator, seeded: Sequence[tuple[int, torch.Generator]] = ()
) -> torch.Tensor:
    """Exp(1) draws shaped like ``like`` (rows of the exponential race), from ``generator`` but for each row of
    ``seeded``, drawn from that row's own generator as it stands."""
    noise = torch.empty_like(like).exponential_(generator=generator)
    for row, row_generator in seeded:
        noise[row].exponential_(generator=row_generator)
    # A draw of exactly 0 would make 0 / 0 = NaN of a removed token, and argmax takes NaN as the largest.
    return noise.clamp_(min=torch.finfo(noise.dtype).tiny)


def draw_seed(seed: int, position: int) -> int:
    """The seed of a seeded request's draw of the token at ``position`` (of prompt and output): splitmix64
    of the pair, so neighbouring positions and seeds give unrelated streams."""
    mask = (1 << 64) - 1
    value = (seed * 0x9E3779B97F4A7C15 + position + 1) & mask
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & mask
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & mask
    return (value ^ (value >> 31)) >> 1  # torch takes seeds below 2**63


def greedy_batch(tokens: torch.Tensor, healthy: torch.Tensor) -> SampledBatch:
    """A batch of greedy tokens sampled elsewhere (``healthy``: whether each row's maximum was finite)."""
    return SampledBatch(tokens, greedy_status(healthy))


def greedy_status(healthy: torch.Tensor) -> torch.Tensor:
    """Each greedy row's status: sampled, or non-finite logits where its maximum was not finite."""
    return torch.where(healthy, SAMPLED, NON_FINITE)


def _failed_row(device: torch.device, top: int | None, request: Request) -> SampledBatch:
    tokens = torch.zeros(1, dtype=torch.long, device=device)
    status = torch.full((1,), FAILED, dtype=torch.long, device=device)
    if top is None:
        return SampledBatch(tokens, status)
    logprobs = RawLogprobs(
        torch.zeros(1, device=device),
        tokens,
        torch.zeros(1, top, dtype=torch.long, device=device),
        torch.zeros(1, top, device=device),
        [request.params.logprobs],
    )
    return SampledBatch(tokens, status, logprobs)


def greedy_maxima(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's argmax, and whether the row is healthy: its maximum is finite (max propagates NaN,
    so a NaN anywhere, a +inf, or a row of -inf all fail), on the logits' device without a sync."""
    values, tokens = logits.max(dim=-1)
    return tokens, torch.isfinite(values)


def raw_logprobs(raw: torch.Tensor, tokens: torch.Tensor, top: int, requests: Sequence[Request]) -> RawLogprobs:
    """The chosen tokens' logprobs and ranks (1: the most likely) and the ``top`` best of each row, from ``raw``."""
    logprobs = raw.log_softmax(dim=-1)
    chosen = logprobs.gather(1, tokens.unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top_values, top_tokens = logprobs.topk(top, dim=-1)
    return RawLogprobs(
        chosen.squeeze(1), ranks, top_tokens, top_values, [request.params.logprobs for request in requests]
    )


def filter_logits(logits: torch.Tensor, rows: RowParams) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p, per row of ``logits``; removed tokens become -inf.

    Each row's maximum is subtracted before the division, so the best token's logit is 0 and the
    others are finite or -inf at any temperature. Top-k keeps the tokens at least as likely as the
    k-th; top-p (over what top-k kept) removes each token whose more likely ones already hold
    ``top_p`` of the probability; min-p removes the tokens less likely than ``min_p`` times the best.
    The best token is never removed.
    """
    scaled = (logits - logits.max(dim=-1, keepdim=True).values) / rows.temperature.unsqueeze(1)
    if rows.uses_top_k or rows.uses_top_p:
        ordered, order = scaled.sort(dim=-1, descending=True)
        removed = None
        if rows.uses_top_k:
            kth = ordered.gather(1, (rows.top_k - 1).unsqueeze(1))
            ordered = ordered.masked_fill(ordered < kth, float("-inf"))
            removed = scaled < kth
        if rows.uses_top_p:
            probs = ordered.softmax(dim=-1)
            before = probs.cumsum(dim=-1) - probs
            beyond = before >= rows.top_p.unsqueeze(1)
            beyond[:, 0] = False
            beyond = torch.zeros_like(beyond).scatter_(1, order, beyond)
            removed = beyond if removed is None else removed | beyond
        scaled = scaled.masked_fill(removed, float("-inf"))
    if rows.uses_min_p:
        # p < min_p * p_best  <=>  logit - best < log(min_p), and the best logit is 0 here.
        scaled = scaled.masked_fill(scaled < rows.log_min_p.unsqueeze(1), float("-inf"))
    return scaled


def edited_logits(
    raw: torch.Tensor, requests: Sequence[Request], counts: TokenCounts | None = None, added: torch.Tensor | None = None
) -> torch.Tensor:
    """``raw`` with the edits of the rows that ask for them (step 3 of the module docstring), in a new
    tensor when any does; ``raw`` itself, untouched, when none does. Penalties read ``counts`` (see
    :meth:`Sampler.sample`) and ``added`` (see :func:`~weft.runner.penalties.apply_penalties`)."""
    rows = [row for row, request in enumerate(requests) if needs_edits(request)]
    if not rows:
        return raw
    every_row = len(rows) == len(requests)
    index = None if every_row else to_device(rows, torch.long, raw.device)
    edited = raw.clone() if index is None else raw.index_select(0, index)
    edited_requests = [requests[row] for row in rows]
    apply_request_processors(edited, edited_requests)
    if added is not None and index is not None:
        added = added.index_select(0, index)
    apply_penalties(edited, edited_requests, TokenCounts(raw.device) if counts is None else counts, added)
    return edited if index is None else raw.index_copy(0, index, edited)


def plain_greedy(request: Request) -> bool:
    """Whether the request's next token is its raw argmax (no logprobs, penalties or bans to apply)."""
    return request.params.greedy and request.params.logprobs is None and not needs_edits(request)


def needs_edits(request: Request) -> bool:
    return needs_output_tokens(request) or needs_request_processors(request.params) or needs_penalties(request.params)


def needs_output_tokens(request: Request) -> bool:
    """Whether sampling the request reads its output so far on the host (``min_tokens``, bad words): with
    asynchronous output, the last step's tokens must reach the host first. Penalties do not: they read
    the counts the runner keeps on the device."""
    params = request.params
    # min_tokens first: a runner state's output is a slice of its token ids, made only when it is read.
    return bool(params.bad_words_token_ids) or (
        params.min_tokens > 0 and len(request.output_token_ids) < params.min_tokens
    )
