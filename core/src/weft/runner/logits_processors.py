"""Edits to a step's logits before sampling: structured-output bitmasks, allowed tokens, bad words, logit
bias, the ``min_tokens`` ban.

:class:`TokenBitmask` runs on the device over the step's constrained rows (before the
sampler, so logprobs are those of the constrained distribution, as in vLLM).
:func:`apply_request_processors` edits the requests' rows in the sampler, after the raw
logprobs were taken and before penalties and temperature.

None of them waits for the device: the token ids an edit names are collected on the host
(:class:`RowTokens`) and cross in one non-blocking copy, and values are written with
``index_put_`` of a device scalar (assigning a Python number through an index tensor copies it to
the device in a blocking copy first).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy
import torch

if TYPE_CHECKING:
    from weft.runner.request_state import RequestState
    from weft.sampling_params import SamplingParams


class TokenBitmask:
    """Applies a step's grammar bitmask to its logits on their device without blocking the host.

    The rows' indices and the bitmask words cross to the device in one copy, from a staging buffer
    reused across steps (pinned on an accelerator, so the copy is asynchronous: a copy from pageable
    memory would wait for the forward in flight); an event on the device says when the buffer may
    be written again. The mask is added to the logits (:func:`bitmask_penalty`).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.accelerated = device.type != "cpu"
        self._staging = torch.empty(0, dtype=torch.int32)
        self._copied = torch.Event(device=device) if self.accelerated else None
        self._copying = False
        """Whether a copy from the staging buffer was launched (``_copied`` marks its end)."""

    def apply(self, logits: torch.Tensor, rows: list[int], bitmask: bytes) -> None:
        """Make -inf, in place, every logit of row ``rows[i]`` whose bit is 0 in bitmask row ``i`` (int32
        words, bit ``t % 32`` of word ``t // 32`` for token ``t``); the others are left as they are (a
        NaN or +inf among the masked ones becomes NaN, which the sampler reports as non-finite logits)."""
        count = len(rows)
        if not count:
            return
        words = _row_words(bitmask, count, logits.shape[-1])
        staged = self._stage(numpy.asarray(rows, dtype=numpy.int32), bitmask)
        penalty = bitmask_penalty(staged[_words_at(count) :].view(count, words), logits.dtype, logits.shape[-1])
        first = rows[0]
        if rows == list(range(first, first + count)):  # the usual step: every sampling row is constrained
            logits[first : first + count] += penalty
        else:
            logits.index_add_(0, staged[:count], penalty)

    def argmax(
        self,
        logits: torch.Tensor,
        rows: list[int],
        bitmask: bytes,
        op: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's greedy token under the masks of :meth:`apply` (bitmask row ``i`` for logits row ``rows[i]``,
        the other rows unmasked), and whether its maximum is finite: the ``bitmask_argmax`` op ``op`` over
        the rows' mask indices and the words, which cross in one copy as in :meth:`apply`. The masked rows
        of ``logits`` may be left masked."""
        count, total = len(rows), logits.shape[0]
        words = _row_words(bitmask, count, logits.shape[-1])
        staged = self._stage(mask_rows_of(total, rows), bitmask)
        return op(logits, staged[:total], staged[_words_at(total) :].view(count, words))

    def _stage(self, rows: numpy.ndarray, bitmask: bytes) -> torch.Tensor:
        """``rows`` (int32) then the bitmask words from the first 16-byte boundary after them (a kernel compiled
        for aligned pointers reads them in place), one int32 tensor on the device."""
        size = _words_at(len(rows)) + len(bitmask) // 4
        if self._copying:
            self._copied.synchronize()  # type: ignore[union-attr]  # the last copy has left the buffer (long since, as a rule)
        if self._staging.numel() < size:
            self._staging = torch.empty(size, dtype=torch.int32, pin_memory=self.accelerated)
        host = self._staging[:size]
        words = host.numpy()
        words[: len(rows)] = rows
        words[_words_at(len(rows)) :] = numpy.frombuffer(bitmask, dtype=numpy.int32)
        if not self.accelerated:
            return host
        staged = host.to(self.device, non_blocking=True)
        self._copied.record()  # type: ignore[union-attr]
        self._copying = True
        return staged


def mask_rows_of(total: int, rows: list[int]) -> numpy.ndarray:
    """``bitmask_argmax``'s mask indices for ``total`` logits rows: ``i`` at ``rows[i]``, -1 (unmasked) elsewhere."""
    mask_rows = numpy.full(total, -1, dtype=numpy.int32)
    mask_rows[rows] = numpy.arange(len(rows), dtype=numpy.int32)
    return mask_rows


def bitmask_penalty(words: torch.Tensor, dtype: torch.dtype, vocab: int) -> torch.Tensor:
    """``[rows, vocab]`` of 0 where a token's bit is set in its row of int32 ``words`` and -inf where it is clear,
    on the words' device: each byte picks its 8 tokens' row of a 256-row table (three kernels, and on a CPU a
    fraction of a shift-and-compare's time). Added to logits, it masks them as xgrammar's own kernel does."""
    # Little-endian words: byte t // 8 of a row holds token t at bit t % 8.
    packed_bytes = words.contiguous().view(torch.uint8).flatten().int()
    return _penalty_table(dtype, words.device).index_select(0, packed_bytes).view(words.shape[0], -1)[:, :vocab]


@functools.cache
def _penalty_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Row ``b``: 0 for each set bit of the byte ``b``, -inf for each clear one (least significant first)."""
    bits = (torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1
    return torch.zeros(256, 8, dtype=dtype).masked_fill_(bits == 0, float("-inf")).to(device)


def _row_words(bitmask: bytes, count: int, vocab: int) -> int:
    """int32 words of each of the ``count`` rows of ``bitmask``; ValueError when they cover fewer than ``vocab``
    tokens."""
    words = len(bitmask) // 4 // count
    if words * 32 < vocab:
        raise ValueError(f"the grammar bitmask covers {words * 32} tokens but the logits have {vocab}")
    return words


def _words_at(rows: int) -> int:
    """Where a staging buffer's bitmask words start after ``rows`` int32 row indices: a multiple of 4 (16 bytes)."""
    return -(-rows // 4) * 4


def needs_request_processors(params: SamplingParams) -> bool:
    return bool(params.logit_bias) or params.allowed_token_ids is not None or bool(params.bad_words_token_ids)


def apply_request_processors(logits: torch.Tensor, requests: Sequence[RequestState]) -> None:
    """Rows of ``logits`` (float, on any device) in place, row ``i`` for ``requests[i]``: only its
    ``allowed_token_ids``, no bad word completed, while it has fewer than ``min_tokens`` outputs none of
    its EOS and stop ids, its ``logit_bias`` added. What crosses to the device is the token ids these
    name (ids beyond the vocabulary are dropped: no such token is sampled)."""
    vocab = logits.shape[-1]
    restricted: list[int] = []
    allowed = RowTokens()
    banned = RowTokens()
    bias = RowTokens()
    bias_values: list[float] = []
    for row, request in enumerate(requests):
        params = request.params
        if params.allowed_token_ids is not None:
            restricted.append(row)
            allowed.add(row, [token for token in params.allowed_token_ids if token < vocab])
        if params.bad_words_token_ids:
            banned.add(row, completed_bad_words(params.bad_words_token_ids, request.output_token_ids))
        if len(request.output_token_ids) < params.min_tokens:
            banned.add(row, [token for token in request.eos_token_ids | set(params.stop_token_ids) if token < vocab])
        if params.logit_bias:
            tokens = [token for token in params.logit_bias if token < vocab]
            bias.add(row, tokens)
            bias_values.extend(params.logit_bias[token] for token in tokens)
    device = logits.device
    if restricted:
        removed = torch.zeros(logits.shape, dtype=torch.bool, device=device)
        removed.index_fill_(0, to_device(restricted, torch.long, device), True)
        if allowed:
            allowed.fill(removed, False)
        logits.masked_fill_(removed, float("-inf"))
    if banned:
        banned.fill(logits, float("-inf"))
    if bias:
        # A row's biased tokens are distinct (the keys of a dict): a plain put adds each bias once.
        index = bias.index(device)
        logits.index_put_(index, logits[index] + to_device(bias_values, logits.dtype, device))


def completed_bad_words(words: Sequence[Sequence[int]], output: list[int]) -> list[int]:
    """The last token of each bad word whose other tokens end ``output`` (every one-token word)."""
    return [
        word[-1]
        for word in words
        if len(word) <= len(output) + 1 and (len(word) == 1 or output[len(output) - len(word) + 1 :] == list(word[:-1]))
    ]


class RowTokens:
    """(row, token id) pairs collected on the host, to index a step's logits with one copy to the device."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.tokens: list[int] = []

    def add(self, row: int, tokens: Sequence[int]) -> None:
        self.rows.extend([row] * len(tokens))
        self.tokens.extend(tokens)

    def __bool__(self) -> bool:
        return bool(self.tokens)

    def index(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        both = to_device([self.rows, self.tokens], torch.long, device)
        return both[0], both[1]

    def fill(self, tensor: torch.Tensor, value: float | bool) -> None:
        """Set ``tensor[row, token]`` to ``value`` at every pair, without waiting for the device."""
        tensor.index_put_(self.index(tensor.device), torch.full((), value, dtype=tensor.dtype, device=tensor.device))


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # non_blocking: a blocking host-to-device copy would wait for the step in flight.
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)
