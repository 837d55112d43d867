"""The greedy token of a step whose rows carry grammar bitmasks: the torch reference (``bitmask_argmax.torch``).

A structured-output step samples after its bitmask is filled. When every row samples greedily, masking the
logits and taking their argmax is one op, so a platform can do it in one kernel (weft-triton's) instead of
a chain of small ones on the host's critical path.

Semantics:

- ``logits`` ``[rows, vocab]`` (any float dtype), ``mask_rows`` int32 ``[rows]``: the bitmask row of each
  logits row, -1 for a row without a mask; ``bitmask`` int32 ``[masks, words]``, bit ``t % 32`` of word
  ``t // 32`` set when token ``t`` is allowed (``words * 32 >= vocab``).
- A disallowed token's logit becomes ``logit + (-inf)``: -inf, or NaN where the logit was NaN or +inf
  (as adding xgrammar's mask would).
- Returned: the int64 token of each row, the first index of its maximum (NaN ranks above everything, so a
  row holding a NaN gives its first NaN), and whether the row is healthy: its maximum is finite.
- The masked rows of ``logits`` may be left masked (the reference masks in place: a greedy step reads
  its logits no further).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import torch

from weft.contracts.ops import OpImplementation
from weft.runner.logits_processors import bitmask_penalty


def check_inputs(logits: torch.Tensor, mask_rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    if logits.dim() != 2 or mask_rows.shape != (logits.shape[0],):
        raise ValueError(
            f"bitmask_argmax: logits must be [rows, vocab] and mask_rows [rows]; got "
            f"{tuple(logits.shape)} and {tuple(mask_rows.shape)}"
        )
    if bitmask.dim() != 2 or bitmask.dtype != torch.int32 or mask_rows.dtype != torch.int32:
        raise ValueError(
            f"bitmask_argmax: bitmask must be int32 [masks, words] and mask_rows int32; got "
            f"{bitmask.dtype} {tuple(bitmask.shape)} and {mask_rows.dtype}"
        )
    if bitmask.shape[0] and bitmask.shape[1] * 32 < logits.shape[1]:
        raise ValueError(
            f"bitmask_argmax: the bitmask covers {bitmask.shape[1] * 32} tokens but the logits have {logits.shape[1]}"
        )


class BitmaskArgmaxTorch(OpImplementation):
    """The reference: the runner's unfused mask (:func:`weft.runner.logits_processors.bitmask_penalty`) added to
    the logits in place, then torch's ``max`` (which propagates NaN)."""

    op: ClassVar[str] = "bitmask_argmax"
    reference: ClassVar[bool] = True
    priority: ClassVar[int] = -100
    tolerance: ClassVar[tuple[float, float]] = (0.0, 0.0)

    def __call__(
        self, logits: torch.Tensor, mask_rows: torch.Tensor, bitmask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        check_inputs(logits, mask_rows, bitmask)
        rows, vocab = logits.shape
        if bitmask.shape[0] and rows:
            masked = mask_rows >= 0
            words = bitmask.index_select(0, mask_rows.clamp(min=0).long())
            words = torch.where(
                masked.unsqueeze(1), words, torch.full_like(words, -1)
            )  # a row without a mask allows all
            logits += bitmask_penalty(words, logits.dtype, vocab)
        values, tokens = logits.max(dim=-1)
        return tokens, torch.isfinite(values)

    @classmethod
    def example_inputs(cls, device: str) -> Iterator[tuple[tuple[Any, ...], dict[str, Any]]]:
        generator = torch.Generator().manual_seed(0)
        for rows, vocab, masks in ((1, 40, 1), (5, 1000, 3), (32, 5003, 32), (3, 70000, 2), (4, 96, 0)):
            words = (vocab + 31) // 32
            for dtype in (torch.float32, torch.bfloat16):
                # Small integers: many ties, so the first index of the maximum matters.
                logits = torch.randint(-4, 5, (rows, vocab), generator=generator).to(dtype)
                bitmask = torch.randint(-(2**31), 2**31 - 1, (masks, words), dtype=torch.int32, generator=generator)
                order = torch.randperm(rows, generator=generator)[:masks]
                mask_rows = torch.full((rows,), -1, dtype=torch.int32)
                mask_rows[order] = torch.arange(masks, dtype=torch.int32)
                if masks:
                    # A row allowing only its last token, one allowing nothing, NaN and +inf masked and not.
                    bitmask[0] = 0
                    bitmask[0, (vocab - 1) // 32] = 1 << ((vocab - 1) % 32)
                    if masks > 1:
                        bitmask[1] = 0
                    if masks > 2:
                        target = int(order[2])
                        logits[target, 7] = float("nan")
                        logits[target, 11] = float("inf")
                free = torch.nonzero(mask_rows < 0).flatten()
                if free.numel():
                    logits[int(free[0]), 3] = float("inf")  # an unmasked +inf: that row is not healthy
                yield (logits.to(device), mask_rows.to(device), bitmask.to(device)), {}
