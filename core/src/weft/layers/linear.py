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
    """``y = x W^T + b`` through the engine's ``linear`` op (plain torch outside an engine)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias)
        self.op = current_op("linear")
        if self.op is not None:
            self.op.declare(out_features=out_features, in_features=in_features, bias=bias, dtype=self.weight.dtype)

    def reset_parameters(self) -> None:
        """No random initialisation: the checkpoint provides the weights."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.op is None:
            return F.linear(x, self.weight, self.bias)
        return self.op(x, self.weight, self.bias)


class Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        """No random initialisation: the checkpoint provides the weights."""
