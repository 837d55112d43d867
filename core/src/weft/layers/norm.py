"""RMSNorm, computed in float32 as Hugging Face's Llama does, optionally fused with the residual add."""

from __future__ import annotations

import torch
from torch import nn

from weft.layers.ops import current_op


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """The ``rms_norm`` op's reference semantics (:class:`weft.builtins.ops.RmsNormTorch`)."""
    if residual is not None:
        x = x + residual
    dtype = x.dtype
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    normed = weight * y.to(dtype)
    return normed if residual is None else (normed, x)


class RMSNorm(nn.Module):
    """``norm(x)``, or ``norm(x, residual) -> (normed(x + residual), x + residual)``."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.op = current_op("rms_norm")
        if self.op is not None:
            self.op.declare(hidden_size=hidden_size, dtype=self.weight.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.op is None:
            return rms_norm(x, self.weight, self.eps, residual)
        return self.op(x, self.weight, self.eps, residual)
