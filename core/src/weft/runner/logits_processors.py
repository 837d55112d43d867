"""Edits to a step's logits before sampling: structured-output bitmasks, allowed tokens, bad words, logit bias.

:func:`apply_token_bitmask` runs on the device over the step's constrained rows (before the
sampler, so logprobs are those of the constrained distribution, as in vLLM).
:func:`apply_request_processors` edits one request's row in the sampler, after the raw
logprobs were taken and before penalties and temperature.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from weft.runner.model_runner import RequestState
    from weft.sampling_params import SamplingParams


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], bitmask: bytes) -> None:
    """Set to -inf, in place, every logit of row ``rows[i]`` whose bit is 0 in bitmask row ``i``.

    The bitmask (int32 words, bit ``t % 32`` of word ``t // 32`` for token ``t``) is unpacked on
    the logits' device."""
    if not rows:
        return
    packed = torch.frombuffer(bytearray(bitmask), dtype=torch.int32).view(len(rows), -1)
    vocab = logits.shape[-1]
    if packed.shape[1] * 32 < vocab:
        raise ValueError(f"the grammar bitmask covers {packed.shape[1] * 32} tokens but the logits have {vocab}")
    packed = packed.to(logits.device, non_blocking=True)
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((packed.unsqueeze(-1) >> shifts) & 1).view(len(rows), -1)[:, :vocab].bool()
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


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
