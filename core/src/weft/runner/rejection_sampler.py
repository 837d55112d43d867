"""Verify a step's proposed tokens against the target's logits: exact rejection sampling, on the logits' device.

A speculating request ``r`` fed the target its last token and ``n_r <= k`` proposals
``d_0 .. d_{n_r - 1}`` (:mod:`weft.contracts.speculator`); the step has the target's logits at each of its
``n_r + 1`` positions: position ``j`` predicts the token after ``d_{j-1}``, the last one (the bonus position)
the token after every proposal. A request without proposals has one position: a plain decode.
:meth:`RejectionSampler.verify` keeps the proposals up to the first the target rejects, then adds one token
of the target's: the token that replaces the rejected one, or the bonus token when none was rejected.
So a request gains ``1 .. n_r + 1`` tokens, distributed exactly as plain decoding would draw them.

Each position's logits go through the plain sampler's processing (:mod:`weft.runner.sampler`), batched over
the step's positions: health, raw logprobs, the request's edits as if its tokens had been decoded one
by one (position ``j`` sees the output plus ``d_0 .. d_{j-1}``: penalties count them, ``min_tokens`` counts
them, bad words end with them), then temperature, top-k, top-p and min-p. Then, per position:

* Greedy rows: the target's token is the argmax; a proposal is accepted when it equals it, so the
  longest matching prefix is kept.
* Sampled rows with deterministic proposals (``draft_probs`` None, ``q`` one-hot): the target draws
  its token ``t_j`` from ``p_j`` by the exponential race, and a proposal is accepted when ``t_j = d_j``
  (probability ``p_j(d_j) = min(1, p/q)``); at the first rejection ``t_j`` is a draw from ``p_j``
  without ``d_j``, which is ``norm(max(0, p - q))``. A seeded request draws the noise of position
  ``j`` from its seed and the position of the token drawn (:func:`~weft.runner.sampler.draw_seed`), the
  noise plain decoding draws for that token: with the same logits, the same tokens as without speculation.
* Sampled rows with drawn proposals (``draft_probs`` holds each ``q_j``): ``d_j`` is accepted when
  ``u * q_j(d_j) <= p_j(d_j)``, ``u`` uniform; the replacement is drawn from ``norm(max(0, p_j - q_j))``
  and the bonus token from ``p_n``. ``u`` and the race's noise come from one row of Exp(1) draws
  (``u = exp(-E)``), seeded per position as above.

logprobs are those of the raw target distribution at each kept position (as the plain sampler reports).
A request whose logits are not finite, or whose edits ban every token, at a position it keeps, fails
alone with the plain sampler's reason; a batch whose verification raises is verified one request at a time.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from weft.runner.logits_processors import to_device
from weft.runner.penalties import TokenCounts, needs_penalties
from weft.runner.sampler import (
    BANNED,
    FAILED,
    NON_FINITE,
    SAMPLED,
    STATUS_REASONS,
    RawLogprobs,
    RowParams,
    SampledToken,
    Sampler,
    draw_seed,
    edited_logits,
    exponential_noise,
    filter_logits,
    greedy_maxima,
    greedy_status,
    plain_greedy,
    raw_logprobs,
)

if TYPE_CHECKING:
    from weft.runner.request_state import RequestState as Request

logger = logging.getLogger("weft.runner")


class ProposedPosition:
    """A request as the sampler sees it at position ``offset`` of a speculative step (the bonus position's is the
    number of ``proposals``): its output so far is its own followed by the proposals before this position
    (built only when read)."""

    __slots__ = ("request", "proposals", "offset")

    def __init__(self, request: Request, proposals: Sequence[int], offset: int) -> None:
        self.request, self.proposals, self.offset = request, proposals, offset

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def params(self):  # noqa: ANN201 - the request's SamplingParams
        return self.request.params

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.request.eos_token_ids

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return [*self.request.output_token_ids, *self.proposals[: self.offset]]


class VerifiedBatch:
    """A verified step, on the logits' device until :meth:`to_host`: per position the token kept there
    (``tokens``, request-major; from ``num_tokens[r]`` on, a request's positions hold some valid id), per
    request how many tokens it gains and its status (:data:`~weft.runner.sampler.SAMPLED` or why it failed),
    and per position the raw logprobs when a request asked."""

    def __init__(
        self,
        tokens: torch.Tensor,
        num_tokens: torch.Tensor,
        status: torch.Tensor,
        starts: list[int],
        logprobs: RawLogprobs | None = None,
    ) -> None:
        self.tokens, self.num_tokens, self.status, self.logprobs = tokens, num_tokens, status, logprobs
        self.starts = starts
        """Per request, its first position (host ints; one entry more than requests)."""

    def last_tokens(self) -> torch.Tensor:
        """Each request's newest token, on the device: what its next step feeds first."""
        starts = to_device(self.starts[:-1], torch.long, self.tokens.device)
        return self.tokens.index_select(0, starts + self.num_tokens - 1)

    def to_host(self, non_blocking: bool = True) -> VerifiedBatch:
        """The same on the host (as :meth:`weft.runner.sampler.SampledBatch.to_host`)."""
        if self.tokens.device.type == "cpu":
            return self
        packed = torch.cat([self.tokens, self.num_tokens, self.status])
        host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True).copy_(packed, non_blocking=non_blocking)
        positions, requests = self.tokens.shape[0], self.num_tokens.shape[0]
        logprobs = self.logprobs
        if logprobs is not None:
            logprobs = RawLogprobs(
                *(
                    torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True).copy_(
                        tensor, non_blocking=non_blocking
                    )
                    for tensor in (logprobs.chosen, logprobs.ranks, logprobs.top_tokens, logprobs.top_values)
                ),
                logprobs.wanted,
            )
        return VerifiedBatch(
            host[:positions],
            host[positions : positions + requests],
            host[positions + requests :],
            self.starts,
            logprobs,
        )

    def verified_tokens(self) -> list[list[SampledToken]]:
        """Per request the tokens it gains, in order (one :class:`SampledToken` with the error when it failed);
        reads the tensors: on the host, after :meth:`to_host` finished."""
        tokens, counts, statuses = self.tokens.tolist(), self.num_tokens.tolist(), self.status.tolist()
        logprobs = self.logprobs
        if logprobs is not None:
            chosen, ranks = logprobs.chosen.tolist(), logprobs.ranks.tolist()
            top_tokens, top_values = logprobs.top_tokens.tolist(), logprobs.top_values.tolist()
        verified = []
        for _request, (start, count, status) in enumerate(zip(self.starts, counts, statuses, strict=False)):
            if status != SAMPLED:
                verified.append([SampledToken(-1, error=STATUS_REASONS[status])])
                continue
            positions = range(start, start + count)
            wanted = logprobs.wanted[start] if logprobs is not None else None
            if wanted is None:
                verified.append([SampledToken(tokens[position]) for position in positions])
            else:
                verified.append(
                    [
                        SampledToken(
                            tokens[p],
                            chosen[p],
                            ranks[p],
                            list(zip(top_tokens[p][:wanted], top_values[p][:wanted], strict=False)),
                        )
                        for p in positions
                    ]
                )
        return verified

    @staticmethod
    def concatenate(parts: Sequence[VerifiedBatch]) -> VerifiedBatch:
        """The requests of ``parts`` in order (all with logprobs of the same width, or none)."""
        starts = [0]
        for part in parts:
            starts.extend(starts[-1] + start for start in part.starts[1:])
        logprobs = None if parts[0].logprobs is None else RawLogprobs.concatenate([part.logprobs for part in parts])
        return VerifiedBatch(
            *(torch.cat([getattr(part, name) for part in parts]) for name in ("tokens", "num_tokens", "status")),
            starts,
            logprobs,
        )


class RejectionSampler:
    """Verifies speculative steps; unseeded draws come from ``sampler``'s generator (the same on every
    tensor-parallel rank)."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler
        self._position_generators: dict[torch.device, list[torch.Generator]] = {}
        """Reused across steps: one per seeded position of a step, reseeded for its draw."""

    def verify(
        self,
        logits: torch.Tensor,
        requests: Sequence[Request],
        proposals: Sequence[Sequence[int]],
        first_positions: Sequence[int],
        draft_probs: torch.Tensor | None = None,
        counts: TokenCounts | None = None,
    ) -> VerifiedBatch:
        """Verify each request's ``proposals[r]`` against ``logits`` (``[sum(n_r + 1), vocab]``, request-major: its
        proposed positions then its bonus position), without waiting for the device.

        ``first_positions[r]``: the position, in the request's prompt and output, of the token its first
        position draws (its seeded draws follow from it). ``draft_probs``: None for deterministic proposals,
        else ``[sum(n_r), vocab]`` (request-major), the distribution each proposal was drawn from.
        Penalties read ``counts`` as the plain sampler does.
        """
        starts = [0]
        for proposed in proposals:
            starts.append(starts[-1] + len(proposed) + 1)
        if logits.shape[0] != starts[-1]:
            raise ValueError(
                f"verify: {logits.shape[0]} rows of logits for {starts[-1]} positions "
                "(each request's proposals and its bonus position)"
            )
        top = max(
            (request.params.logprobs for request in requests if request.params.logprobs is not None), default=None
        )
        try:
            return self._verify(logits, requests, proposals, first_positions, draft_probs, counts, top)
        except Exception:  # one request's failure must not end the step of the others
            logger.exception("verifying a step of %d requests failed; verifying them one at a time", len(requests))
        parts, drafted = [], 0
        for row, request in enumerate(requests):
            proposed = proposals[row]
            rows = logits[starts[row] : starts[row + 1]]
            probs = None if draft_probs is None else draft_probs[drafted : drafted + len(proposed)]
            drafted += len(proposed)
            try:
                parts.append(self._verify(rows, [request], [proposed], [first_positions[row]], probs, counts, top))
            except Exception:
                logger.exception("verifying request %s failed", request.request_id)
                parts.append(_failed_request(rows, request, top))
        return VerifiedBatch.concatenate(parts)

    def _verify(
        self,
        logits: torch.Tensor,
        requests: Sequence[Request],
        proposals: Sequence[Sequence[int]],
        first_positions: Sequence[int],
        draft_probs: torch.Tensor | None,
        counts: TokenCounts | None,
        top: int | None,
    ) -> VerifiedBatch:
        device, vocab = logits.device, logits.shape[-1]
        owner, offset, draft, starts = [], [], [], [0]
        for row, proposed in enumerate(proposals):
            owner.extend([row] * (len(proposed) + 1))
            offset.extend(range(len(proposed) + 1))
            draft.extend([*proposed, 0])
            starts.append(len(owner))
        width = max((len(proposed) for proposed in proposals), default=0)
        padded = [token for proposed in proposals for token in [*proposed, *[0] * (width - len(proposed))]]
        count = len(owner)
        # One copy: each position's request, offset, proposal (0 at the bonus position) and its request's number of
        # proposals; the positions that hold a proposal; the proposals padded to the longest.
        proposed_counts = [len(proposals[row]) for row in owner]
        proposed_rows = [index for index, (j, n) in enumerate(zip(offset, proposed_counts, strict=False)) if j < n]
        packed = to_device([*owner, *offset, *draft, *proposed_counts, *proposed_rows, *padded], torch.long, device)
        owner_index, offset_index, draft_index, proposed_count = packed[: 4 * count].view(4, count)
        proposed_here = offset_index < proposed_count
        proposed_index = packed[4 * count : 4 * count + len(proposed_rows)]
        positions = [ProposedPosition(requests[row], proposals[row], j) for row, j in zip(owner, offset, strict=False)]
        raw = logits.float()
        if all(plain_greedy(request) for request in requests):
            tokens, healthy = greedy_maxima(raw)
            status = greedy_status(healthy)
            accepted = tokens == draft_index
        else:
            counts = TokenCounts(device) if counts is None else counts
            padded_index = packed[4 * count + len(proposed_rows) :].view(len(proposals), width)
            added = _proposed_before(requests, counts, vocab, padded_index, owner_index, offset_index)
            processed = edited_logits(raw, positions, counts, added)
            maxima, tokens = processed.max(dim=-1)
            status = torch.where(torch.isfinite(maxima), SAMPLED, BANNED).masked_fill_(
                ~torch.isfinite(raw.max(dim=-1).values), NON_FINITE
            )
            accepted = tokens == draft_index
            if not all(request.params.greedy for request in requests):
                rows = RowParams([position.params for position in positions], vocab, device)
                drawn, drawn_accepted = self._draw(
                    filter_logits(processed, rows),
                    rows,
                    positions,
                    offset,
                    first_positions,
                    owner,
                    draft_index,
                    proposed_index,
                    draft_probs,
                )
                tokens = torch.where(rows.greedy, tokens, drawn)
                accepted = torch.where(rows.greedy, accepted, drawn_accepted)
        # The first position not accepted (the bonus position at the latest) is each request's last kept one.
        never = torch.full((len(proposals),), width + 1, dtype=torch.long, device=device)
        kept = never.scatter_reduce(
            0, owner_index, torch.where(accepted & proposed_here, width + 1, offset_index), "amin"
        )
        kept_here = kept.index_select(0, owner_index)
        tokens = torch.where(offset_index < kept_here, draft_index, tokens)
        # A request fails with the first failing position it keeps.
        failing = (status != SAMPLED) & (offset_index <= kept_here)
        first_failure = never.mul(4).scatter_reduce(
            0, owner_index, torch.where(failing, offset_index * 4 + status, (width + 1) * 4), "amin"
        )
        request_status = torch.where(first_failure < (width + 1) * 4, first_failure % 4, SAMPLED)
        logprobs = None if top is None else raw_logprobs(raw, tokens, top, positions)
        return VerifiedBatch(tokens, kept + 1, request_status, starts, logprobs)

    def _draw(
        self,
        filtered: torch.Tensor,
        rows: RowParams,
        positions: Sequence[ProposedPosition],
        offset: Sequence[int],
        first_positions: Sequence[int],
        owner: Sequence[int],
        draft_index: torch.Tensor,
        proposed_index: torch.Tensor,
        draft_probs: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's draw at each position and whether it accepts the position's proposal (module docstring)."""
        probs = filtered.softmax(dim=-1)
        count, vocab = probs.shape
        seeded = self._seeded(positions, rows, offset, first_positions, owner, probs.device)
        noise = exponential_noise(
            probs.new_empty(count, vocab if draft_probs is None else vocab + 1),
            self.sampler.generator(probs.device),
            seeded,
        )
        race = noise[:, :vocab]
        if draft_probs is None:
            drawn = (probs / race).argmax(dim=-1)
            return drawn, drawn == draft_index
        # Bonus positions keep a q of 0: their residual is p itself.
        q = probs.new_zeros(count, vocab).index_copy_(0, proposed_index, draft_probs.to(probs.dtype))
        chosen = draft_index.unsqueeze(1)
        p_chosen, q_chosen = probs.gather(1, chosen).squeeze(1), q.gather(1, chosen).squeeze(1)
        uniform = torch.exp(-noise[:, vocab])
        accepted = (uniform * q_chosen <= p_chosen) & (p_chosen > 0)
        residual = (probs - q).clamp_(min=0)
        # p equal to q (up to rounding) leaves no residual where a rejection is all but impossible: draw from p.
        residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, probs)
        return (residual / race).argmax(dim=-1), accepted

    def _seeded(
        self,
        positions: Sequence[ProposedPosition],
        rows: RowParams,
        offset: Sequence[int],
        first_positions: Sequence[int],
        owner: Sequence[int],
        device: torch.device,
    ) -> list[tuple[int, torch.Generator]]:
        """A generator per drawn position of a seeded request, seeded for the token that position draws."""
        wanted = [
            index for index, position in enumerate(positions) if position.params.seed is not None and rows.random[index]
        ]
        pool = self._position_generators.setdefault(device, [])
        while len(pool) < len(wanted):
            pool.append(torch.Generator(device=device))
        return [
            (
                index,
                generator.manual_seed(
                    draw_seed(positions[index].params.seed, first_positions[owner[index]] + offset[index])
                ),
            )
            for index, generator in zip(wanted, pool, strict=False)
        ]


def _failed_request(logits: torch.Tensor, request: Request, top: int | None) -> VerifiedBatch:
    count, device = logits.shape[0], logits.device
    tokens = torch.zeros(count, dtype=torch.long, device=device)
    logprobs = None
    if top is not None:
        top_values = torch.zeros(count, top, device=device)
        logprobs = RawLogprobs(
            torch.zeros(count, device=device), tokens, top_values.long(), top_values, [request.params.logprobs] * count
        )
    return VerifiedBatch(
        tokens,
        torch.ones(1, dtype=torch.long, device=device),
        torch.full((1,), FAILED, dtype=torch.long, device=device),
        [0, count],
        logprobs,
    )


def _proposed_before(
    requests: Sequence[Request],
    counts: TokenCounts,
    vocab: int,
    padded: torch.Tensor,
    owner_index: torch.Tensor,
    offset_index: torch.Tensor,
) -> torch.Tensor | None:
    """Per position, how often each token was proposed before it by its request: penalties count those on top of
    the request's own outputs, which this holds in ``counts`` (None: no request is penalized).

    ``padded`` holds each request's proposals padded to the longest; ``owner_index`` and ``offset_index`` each
    position's request and its offset among that request's positions."""
    penalized = [request for request in requests if needs_penalties(request.params)]
    if not penalized:
        return None
    counts.hold_rows(penalized, vocab)  # built from the requests' own outputs, before any proposal
    count, width, device = len(owner_index), padded.shape[1], padded.device
    before = (torch.arange(width, device=device).unsqueeze(0) < offset_index.unsqueeze(1)).int()
    return torch.zeros(count, vocab, dtype=torch.int32, device=device).scatter_add_(
        1, padded.index_select(0, owner_index), before
    )
