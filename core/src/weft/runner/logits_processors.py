"""Edits to a step's logits before sampling: structured-output bitmasks, allowed tokens, bad words, logit bias.

:class:`TokenBitmask` runs on the device over the step's constrained rows (before the
sampler, so logprobs are those of the constrained distribution, as in vLLM).
:func:`apply_request_processors` edits one request's row in the sampler, after the raw
logprobs were taken and before penalties and temperature.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy
import torch

if TYPE_CHECKING:
    from weft.runner.model_runner import RequestState
    from weft.sampling_params import SamplingParams


class TokenBitmask:
    """Applies a step's grammar bitmask to its logits on their device without blocking the host.

    The rows' indices and the bitmask words cross to the device in one copy, from a staging buffer
    reused across steps (pinned on an accelerator, so the copy is asynchronous: a copy from pageable
    memory would wait for the forward in flight); an event on the device says when the buffer may
    be written again. The mask is added to the logits: each bitmask byte picks its 8 tokens' row of
    a 256-row table of 0 and -inf (three kernels, and on a CPU a fraction of a shift-and-compare's time).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.accelerated = device.type != "cpu"
        self._staging = torch.empty(0, dtype=torch.int32)
        self._copied = torch.Event(device=device) if self.accelerated else None
        self._copying = False
        """Whether a copy from the staging buffer was launched (``_copied`` marks its end)."""
        self._tables: dict[torch.dtype, torch.Tensor] = {}

    def apply(self, logits: torch.Tensor, rows: list[int], bitmask: bytes) -> None:
        """Make -inf, in place, every logit of row ``rows[i]`` whose bit is 0 in bitmask row ``i`` (int32
        words, bit ``t % 32`` of word ``t // 32`` for token ``t``); the others are left as they are (a
        NaN or +inf among the masked ones becomes NaN, which the sampler reports as non-finite logits)."""
        count = len(rows)
        if not count:
            return
        words = len(bitmask) // 4 // count
        vocab = logits.shape[-1]
        if words * 32 < vocab:
            raise ValueError(f"the grammar bitmask covers {words * 32} tokens but the logits have {vocab}")
        staged = self._stage(rows, bitmask)
        # Little-endian words: byte t // 8 of a row holds token t at bit t % 8.
        packed_bytes = staged[count:].view(torch.uint8).int()
        penalty = self._table(logits.dtype).index_select(0, packed_bytes).view(count, -1)[:, :vocab]
        first = rows[0]
        if rows == list(range(first, first + count)):  # the usual step: every sampling row is constrained
            logits[first : first + count] += penalty
        else:
            logits.index_add_(0, staged[:count], penalty)

    def _table(self, dtype: torch.dtype) -> torch.Tensor:
        """Row ``b``: 0 for each set bit of the byte ``b``, -inf for each clear one (least significant first)."""
        table = self._tables.get(dtype)
        if table is None:
            bits = (torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1
            table = torch.zeros(256, 8, dtype=dtype).masked_fill_(bits == 0, float("-inf")).to(self.device)
            self._tables[dtype] = table
        return table

    def _stage(self, rows: list[int], bitmask: bytes) -> torch.Tensor:
        """``rows`` then the bitmask words, one int32 tensor on the device."""
        size = len(rows) + len(bitmask) // 4
        if self._copying:
            self._copied.synchronize()  # type: ignore[union-attr]  # the last copy has left the buffer (long since, as a rule)
        if self._staging.numel() < size:
            self._staging = torch.empty(size, dtype=torch.int32, pin_memory=self.accelerated)
        host = self._staging[:size]
        words = host.numpy()
        words[: len(rows)] = rows
        words[len(rows) :] = numpy.frombuffer(bitmask, dtype=numpy.int32)
        if not self.accelerated:
            return host
        staged = host.to(self.device, non_blocking=True)
        self._copied.record()  # type: ignore[union-attr]
        self._copying = True
        return staged


def needs_request_processors(params: SamplingParams) -> bool:
    return bool(params.logit_bias) or params.allowed_token_ids is not None or bool(params.bad_words_token_ids)


def apply_request_processors(logits: torch.Tensor, request: RequestState) -> None:
    """One request's row, in place: only ``allowed_token_ids``, no bad word completed, ``logit_bias`` added."""
    params = request.params
    vocab = logits.shape[-1]
    if params.allowed_token_ids is not None:
        keep = torch.zeros(vocab, dtype=torch.bool)
        keep[[token for token in params.allowed_token_ids if token < vocab]] = True
        logits.masked_fill_(~keep, float("-inf"))
    if params.bad_words_token_ids:
        output = request.output_token_ids
        banned = [
            word[-1] for word in params.bad_words_token_ids
            if len(word) <= len(output) + 1 and (len(word) == 1 or output[len(output) - len(word) + 1 :] == list(word[:-1]))
        ]
        if banned:
            logits[banned] = float("-inf")
    if params.logit_bias:
        tokens = [token for token in params.logit_bias if token < vocab]
        logits[tokens] += torch.tensor([params.logit_bias[token] for token in tokens], dtype=logits.dtype)
