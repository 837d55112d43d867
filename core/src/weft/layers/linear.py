"""Linear and embedding layers whose weights always come from a checkpoint.

torch's own layers initialise their weights randomly on construction; on the
meta device that initialisation even imports torch's compiler (a second of
start-up). Weft's layers skip it: every parameter is filled by the model
family's ``load_weights``, which fails if one is left empty.
"""

from __future__ import annotations

from torch import nn


class Linear(nn.Linear):
    def reset_parameters(self) -> None:
        """No random initialisation: the checkpoint provides the weights."""


class Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        """No random initialisation: the checkpoint provides the weights."""
