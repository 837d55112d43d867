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
from torch import nn


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
    def reset_parameters(self) -> None:
        """No random initialisation: the checkpoint provides the weights."""


class Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        """No random initialisation: the checkpoint provides the weights."""
