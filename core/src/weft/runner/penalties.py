"""Repetition, presence and frequency penalties, from token counts kept on the logits' device.

A request with a penalty holds a row of :class:`TokenCounts`: how many times each token of the
vocabulary occurs in its output, and whether it occurs in its prompt. The row is built from the
request's token ids on the host the first time it samples (after a preemption, from its prompt and
the outputs it brings back), and each step adds the tokens it just sampled on the device
(:meth:`TokenCounts.record`). So a penalty never needs the previous step's tokens on the host:
under asynchronous scheduling a penalized request's step is launched before the last one's tokens
arrive. The runner frees a row when its request finishes or is preempted. Only penalized requests
hold a row (5 bytes a vocabulary entry: an int32 count and a bool); the table grows by doubling
and is released when no request holds a row.

The penalties, batched over the rows that ask, in the logits' dtype: repetition (as in HF
transformers) divides the positive logit of every token of the prompt or the output by
``repetition_penalty`` and multiplies the others by it; then presence and frequency (as OpenAI
defines them) subtract ``presence_penalty`` from each token the output holds and
``frequency_penalty`` times the number of times it does.

Nothing here waits for the device: row and token indices are built on the host and cross in
non-blocking copies (:func:`~weft.runner.logits_processors.to_device`), and every write is an
``index_put_`` without accumulation (one with it range-checks its indices with a read back).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from weft.runner.logits_processors import RowTokens, to_device

if TYPE_CHECKING:
    from weft.runner.request_state import RequestState as Request
    from weft.sampling_params import SamplingParams


class TokenCounts:
    """Per penalized request, on one device: its output's token counts and its prompt's tokens."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.output = torch.zeros(0, 0, dtype=torch.int32, device=device)
        """``[capacity, vocab]``: row ``r`` counts each token of its request's output."""
        self.prompt = torch.zeros(0, 0, dtype=torch.bool, device=device)
        """``[capacity, vocab]``: row ``r`` marks the tokens of its request's prompt."""
        self.rows: dict[str, int] = {}
        """The row each request holds, by request id."""
        self._free_rows: list[int] = []

    def hold_rows(self, requests: Sequence[Request], vocab: int) -> torch.Tensor:
        """Give each of ``requests`` a row, built from its token ids when it holds none yet (the host knows
        them whole before a request's first sampled step); returns their rows as a device index."""
        new = {request.request_id: request for request in requests if request.request_id not in self.rows}
        if new:
            self._build(list(new.values()), vocab)
        return to_device([self.rows[request.request_id] for request in requests], torch.long, self.device)

    def record(self, requests: Sequence[Request], tokens: torch.Tensor, dropped: frozenset[str] = frozenset()) -> None:
        """Count ``tokens[i]`` (on the device) in the row of ``requests[i]``, for each request holding a row
        whose id is not in ``dropped`` (tokens the runner discards, such as those computed over a failed load)."""
        batch_rows = [
            index
            for index, request in enumerate(requests)
            if request.request_id in self.rows and request.request_id not in dropped
        ]
        if not batch_rows:
            return
        both = to_device(
            [batch_rows, [self.rows[requests[index].request_id] for index in batch_rows]], torch.long, self.device
        )
        # Each request holds its own row, so no (row, token) pair repeats and a plain put adds one to each.
        index = (both[1], tokens.index_select(0, both[0]))
        self.output.index_put_(index, self.output[index] + 1)

    def record_kept(
        self,
        requests: Sequence[Request],
        tokens: torch.Tensor,
        num_kept: torch.Tensor,
        starts: Sequence[int],
        dropped: frozenset[str] = frozenset(),
    ) -> None:
        """Count every token each request kept in a verified step, as :meth:`record` does for one token each:
        ``requests[i]`` owns ``tokens[starts[i]:starts[i + 1]]`` (on the device) and keeps the first ``num_kept[i]``
        of them (a :class:`~weft.runner.rejection_sampler.VerifiedBatch`'s layout)."""
        owners = [
            index
            for index, request in enumerate(requests)
            if request.request_id in self.rows and request.request_id not in dropped
        ]
        if not owners:
            return
        positions, rows, offsets, owned = [], [], [], []
        for index in owners:
            start, end = starts[index], starts[index + 1]
            positions.extend(range(start, end))
            rows.extend([self.rows[requests[index].request_id]] * (end - start))
            offsets.extend(range(end - start))
            owned.extend([index] * (end - start))
        packed = to_device([positions, rows, offsets, owned], torch.long, self.device)
        kept = packed[2] < num_kept.index_select(0, packed[3])
        # A kept run may repeat a token: accumulate.
        self.output.index_put_(
            (packed[1], tokens.index_select(0, packed[0])), kept.to(self.output.dtype), accumulate=True
        )

    def free(self, request_id: str) -> None:
        """Give back the request's row, if it holds one (a later row for the id starts from its token ids)."""
        row = self.rows.pop(request_id, None)
        if row is None:
            return
        self._free_rows.append(row)
        if not self.rows:  # no penalized request left: release the table
            self.output, self.prompt, self._free_rows = self.output.new_zeros(0, 0), self.prompt.new_zeros(0, 0), []

    def _build(self, requests: list[Request], vocab: int) -> None:
        self._reserve(len(requests), vocab)
        rows, prompt, output, counts = [], RowTokens(), RowTokens(), []
        for request in requests:
            row = self._free_rows.pop()
            self.rows[request.request_id] = row
            rows.append(row)
            prompt.add(row, [token for token in set(request.prompt_token_ids) if token < vocab])
            counted = Counter(token for token in request.output_token_ids if token < vocab)
            output.add(row, list(counted))
            counts.extend(counted.values())
        reused = to_device(rows, torch.long, self.device)
        self.output.index_fill_(0, reused, 0)
        self.prompt.index_fill_(0, reused, False)
        if prompt:
            prompt.fill(self.prompt, True)
        if output:
            self.output.index_put_(output.index(self.device), to_device(counts, torch.int32, self.device))

    def _reserve(self, count: int, vocab: int) -> None:
        """At least ``count`` free rows, of ``vocab`` entries."""
        capacity, width = self.output.shape
        if capacity and width != vocab:
            raise ValueError(f"penalty token counts hold {width} tokens a row but the logits have {vocab}")
        missing = count - len(self._free_rows)
        if missing <= 0:
            return
        grown = max(2 * capacity, capacity + missing)
        output = torch.zeros(grown, vocab, dtype=torch.int32, device=self.device)
        prompt = torch.zeros(grown, vocab, dtype=torch.bool, device=self.device)
        if capacity:
            output[:capacity] = self.output
            prompt[:capacity] = self.prompt
        self.output, self.prompt = output, prompt
        self._free_rows.extend(range(grown - 1, capacity - 1, -1))


def needs_penalties(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


def apply_penalties(
    logits: torch.Tensor, requests: Sequence[Request], counts: TokenCounts, added: torch.Tensor | None = None
) -> None:
    """Rows of ``logits`` in place, row ``i`` for ``requests[i]``: its penalties (the module docstring), from
    its row of ``counts`` (built there if it has none yet). ``added``: ``[rows, vocab]`` int32 counts row ``i``
    adds to its request's output counts (a speculative step's position counts the proposals before it)."""
    rows = [row for row, request in enumerate(requests) if needs_penalties(request.params)]
    if not rows:
        return
    penalized = [requests[row] for row in rows]
    held = counts.hold_rows(penalized, logits.shape[-1])
    every_row = len(rows) == len(requests)
    index = None if every_row else to_device(rows, torch.long, logits.device)
    output = counts.output.index_select(0, held)
    if added is not None:
        output = output + (added if index is None else added.index_select(0, index))
    seen = counts.prompt.index_select(0, held) | (output > 0)
    weights = to_device(
        [
            [request.params.repetition_penalty for request in penalized],
            [request.params.presence_penalty for request in penalized],
            [request.params.frequency_penalty for request in penalized],
        ],
        logits.dtype,
        logits.device,
    )
    repetition, presence, frequency = weights.unsqueeze(2)
    chosen = logits if index is None else logits.index_select(0, index)
    chosen = torch.where(seen, torch.where(chosen > 0, chosen / repetition, chosen * repetition), chosen)
    chosen -= frequency * output.to(logits.dtype) + presence * (output > 0)
    if index is None:
        logits.copy_(chosen)
    else:
        logits.index_copy_(0, index, chosen)
