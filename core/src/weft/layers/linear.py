"""Linear and embedding layers whose weights always come from a checkpoint.

torch's own layers initialise their weights randomly on construction, which
costs about a second for a small model. Weft's layers skip it: every parameter
is filled by the model family's ``load_weights``, which fails if one is left
empty. (Building on the meta device instead would pull in sympy through
``to_empty``, another second.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from weft.layers.ops import current_op
from weft.layers.quantization import current_quantization


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Create floating-point parameters in ``dtype`` inside the block."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class Linear(nn.Linear):
    """``y = x W^T + b`` through the engine's ``linear`` op (plain torch outside an engine), or through the
    engine's quantization method (:mod:`weft.contracts.quantization`), which then owns the weights: ``weight``
    stays an empty parameter (unless a tied embedding's is assigned to it) and checkpoint parts go to the method."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias)
        self.quantization = current_quantization()
        self.op = current_op("linear") if self.quantization is None else None
        if self.quantization is not None:
            self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)
            self.quantization.create_weights(self, in_features, out_features)
        if self.op is not None:
            self.op.declare(out_features=out_features, in_features=in_features, bias=bias, dtype=self.weight.dtype)

    def reset_parameters(self) -> None:
        """No random initialisation: the checkpoint provides the weights."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x W^T (+ bias)`` by whichever owns the weights: the quantization method, the op, or torch."""
        if self.quantization is not None:
            return self.quantization.apply(self, x, bias)
        if self.op is None:
            return F.linear(x, self.weight, bias)
        return self.op(x, self.weight, bias)


class Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        """No random initialisation: the checkpoint provides the weights."""
