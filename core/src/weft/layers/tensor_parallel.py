"""Layers sharded over the tensor-parallel ranks, each loading only its part of the checkpoint.

``ColumnParallelLinear``   output features split (q/k/v heads, MLP gate and up): no communication;
                           one weight may stack several checkpoint tensors, each split on its own
``RowParallelLinear``      input features split (attention output, MLP down): partial sums all-reduced,
                           the bias added once after the sum
``VocabParallelEmbedding`` vocabulary rows split; a token outside a rank's rows looks up zeros, then all-reduce
``ParallelLMHead``         vocabulary rows split; the logits all-gathered, the padding cut off

A vocabulary the ranks do not divide is padded to ``ceil(vocab / tp)`` rows per rank;
padded rows are zeros and their logits are cut before anything samples them.
With one rank every layer is the plain one (no collective is called).

Each layer reads its part through :class:`~weft.contracts.loader.WeightSlice`:
:meth:`load_checkpoint_tensor` narrows the checkpoint tensor to this rank's range, so a
loader that reads partially (safetensors, GGUF) never reads the rest from disk.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import torch
import torch.nn.functional as F

from weft.contracts.loader import WeightSlice, as_slice
from weft.contracts.parallel import Communicator
from weft.contracts.quantization import GroupAffine, QuantizedWeight
from weft.distributed.state import current_parallel
from weft.layers.linear import Embedding, Linear
from weft.layers.quantization import current_quantization


class Shard(msgspec.Struct, frozen=True):
    """This rank's rows of one checkpoint tensor along the split axis: ``start .. start + length - 1``."""

    start: int
    length: int

    @classmethod
    def even(cls, size: int, parts: int, index: int) -> Shard:
        length = size // parts
        return cls(index * length, length)


def copy_checked(destination: torch.Tensor, source: torch.Tensor, name: str) -> None:
    if destination.shape != source.shape:
        raise ValueError(
            f"checkpoint tensor {name!r} has shape {tuple(source.shape)}, expected {tuple(destination.shape)}"
        )
    with torch.no_grad():
        destination.copy_(source)


class ColumnParallelLinear(Linear):
    """``y = x W^T + b`` with W's rows split over the tensor ranks; ``y`` stays split.

    ``shards`` lists the checkpoint tensors stacked into W, in order, and this rank's rows of each.
    """

    def __init__(self, in_features: int, shards: Sequence[Shard], bias: bool) -> None:
        super().__init__(in_features, sum(shard.length for shard in shards), bias)
        self.shards = tuple(shards)
        self.offsets = [sum(shard.length for shard in shards[:index]) for index in range(len(shards))]

    def load_checkpoint_tensor(
        self, parameter: str, weight: WeightSlice | torch.Tensor, name: str, index: int = 0
    ) -> None:
        """Copy this rank's rows of checkpoint tensor ``name`` (stacked part ``index``) into ``parameter``."""
        shard = self.shards[index]
        if parameter == "weight" and self.quantization is not None:
            part = quantized_part(weight).narrow(0, shard.start, shard.length)
            self.quantization.load_weight(self, part, self.offsets[index], name)
            return
        destination = getattr(self, parameter).data.narrow(0, self.offsets[index], shard.length)
        copy_checked(destination, as_slice(weight).narrow(0, shard.start, shard.length), name)


class RowParallelLinear(Linear):
    """``y = sum over ranks (x_r W_r^T) + b``: W's columns split, the partial outputs all-reduced.

    ``reduce=False`` returns this rank's partial sum (the caller adds partial sums of several
    layers and all-reduces once, as a mixture of experts does); it takes no bias.
    """

    def __init__(self, shard: Shard, out_features: int, bias: bool, reduce: bool = True) -> None:
        if bias and not reduce:
            raise ValueError("RowParallelLinear(reduce=False) returns partial sums: it cannot add a bias")
        self.tensor: Communicator = current_parallel().tensor
        self.reduce = reduce
        self.shard = shard
        # The op sees no bias when the sum comes after it: the bias is added once, to the sum.
        super().__init__(shard.length, out_features, bias)
        self.bias_after_sum = bias and self.tensor.size > 1
        if self.bias_after_sum and self.op is not None:
            self.op.declare(out_features=out_features, in_features=shard.length, bias=False, dtype=self.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.reduce:
            return super().forward(x)
        if not self.bias_after_sum:
            return self.tensor.all_reduce(super().forward(x))
        return self.tensor.all_reduce(self.matmul(x, None)) + self.bias

    def load_checkpoint_tensor(
        self, parameter: str, weight: WeightSlice | torch.Tensor, name: str, index: int = 0
    ) -> None:
        weight = as_slice(weight)
        if parameter == "weight" and self.quantization is not None:
            self.quantization.load_weight(
                self, quantized_part(weight).narrow(1, self.shard.start, self.shard.length), 0, name
            )
            return
        destination = getattr(self, parameter).data
        if parameter == "bias":
            copy_checked(destination, weight.load(), name)
        else:
            copy_checked(destination, weight.narrow(1, self.shard.start, self.shard.length), name)


class VocabParallelEmbedding(Embedding):
    """Embedding rows split over the tensor ranks (``ceil(vocab / tp)`` each, the last ones padded)."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        self.tensor: Communicator = current_parallel().tensor
        self.vocab_size = vocab_size
        self.rows_per_rank, self.first_row, self.rows = vocab_rows(vocab_size, self.tensor)
        self.keep_codes = current_quantization() is not None
        super().__init__(self.rows_per_rank, hidden_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tensor.size == 1:
            return super().forward(input_ids)
        local = input_ids - self.first_row
        inside = (local >= 0) & (local < self.rows)
        hidden = F.embedding(local.masked_fill(~inside, 0), self.weight)
        return self.tensor.all_reduce(hidden.masked_fill(~inside.unsqueeze(-1), 0))

    def load_checkpoint_tensor(
        self, parameter: str, weight: WeightSlice | torch.Tensor, name: str, index: int = 0
    ) -> None:
        load_vocab_rows(self.weight, self.first_row, self.rows, weight, name, self.vocab_size)
        if isinstance(weight, QuantizedWeight) and self.keep_codes:
            # A head tied to this embedding gets this parameter as its weight: it packs these codes instead of floats.
            self.weight.quantized_source = weight.group_affine()


class ParallelLMHead(Linear):
    """Logits over the whole vocabulary on every tensor rank, each computing its rows' share."""

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        self.tensor: Communicator = current_parallel().tensor
        self.vocab_size = vocab_size
        self.rows_per_rank, self.first_row, self.rows = vocab_rows(vocab_size, self.tensor)
        super().__init__(hidden_size, self.rows_per_rank, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().forward(hidden)
        if self.quantization is not None and self.weight.shape == (self.rows_per_rank, self.in_features):
            logits = refine_top_logits(hidden, logits, self.weight)
        if self.tensor.size == 1:
            return logits
        return self.tensor.all_gather(logits, dim=-1)[..., : self.vocab_size]

    def load_checkpoint_tensor(
        self, parameter: str, weight: WeightSlice | torch.Tensor, name: str, index: int = 0
    ) -> None:
        if self.quantization is None:
            load_vocab_rows(self.weight, self.first_row, self.rows, weight, name, self.vocab_size)
            return
        self.load_quantized_rows(quantized_part(weight), name)

    def load_quantized_rows(self, weight: GroupAffine | torch.Tensor, name: str) -> None:
        """This rank's vocabulary rows for the quantization method, padding rows as zeros."""
        if weight.shape[0] != self.vocab_size:
            raise ValueError(
                f"checkpoint tensor {name!r} has {weight.shape[0]} rows, expected the vocabulary's {self.vocab_size}"
            )
        if self.rows:
            self.quantization.load_weight(self, weight.narrow(0, self.first_row, self.rows), 0, name)
        if self.rows < self.rows_per_rank:
            padding = torch.zeros(self.rows_per_rank - self.rows, weight.shape[1])
            self.quantization.load_weight(self, padding, self.rows, name)

    def load_tied_weight(self) -> None:
        """A head tied to the embedding (whose float parameter is now ``weight``) hands the method the embedding's
        codes where its loader kept them, else its float rows."""
        source = getattr(self.weight, "quantized_source", None)
        if source is None:
            self.quantization.load_weight(self, self.weight.data, 0, "model.embed_tokens.weight")
        else:
            self.load_quantized_rows(source, "model.embed_tokens.weight")


REFINED_CANDIDATES = 8


def refine_top_logits(hidden: torch.Tensor, logits: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``logits`` with each row's :data:`REFINED_CANDIDATES` largest recomputed from the float ``weight`` rows.

    A quantized head tied to the embedding keeps the embedding's float rows at hand. The quantized
    kernels round their outputs to their compute dtype (bf16 for ``cpu_int4``: 2^-9 of a logit of 20
    is 0.04, enough to swap two close candidates); the candidates that greedy decoding, top-k and most
    of the probability mass depend on are computed again in float32, at the cost of K dot products a row.
    """
    flat = logits.reshape(-1, logits.shape[-1]).float()
    candidates = flat.topk(min(REFINED_CANDIDATES, flat.shape[-1]), dim=-1).indices
    rows = hidden.reshape(-1, hidden.shape[-1]).float()
    exact = torch.einsum("nd,nkd->nk", rows, weight[candidates].float())
    return flat.scatter(-1, candidates, exact).to(logits.dtype).reshape(logits.shape)


def quantized_part(weight: WeightSlice | torch.Tensor) -> GroupAffine | torch.Tensor:
    """What a quantization method takes of a checkpoint tensor: its codes where the loader kept them, else floats."""
    return weight.group_affine() if isinstance(weight, QuantizedWeight) else as_slice(weight).load()


def vocab_rows(vocab_size: int, tensor: Communicator) -> tuple[int, int, int]:
    """``(rows per rank, this rank's first row, its rows of the vocabulary)``: the rest of its rows are padding."""
    per_rank = -(-vocab_size // tensor.size)
    first = tensor.rank * per_rank
    return per_rank, first, max(0, min(vocab_size - first, per_rank))


def load_vocab_rows(
    parameter: torch.Tensor, first: int, rows: int, weight: WeightSlice | torch.Tensor, name: str, vocab_size: int
) -> None:
    weight = as_slice(weight)
    if weight.shape[0] != vocab_size:
        raise ValueError(
            f"checkpoint tensor {name!r} has {weight.shape[0]} rows, expected the vocabulary's {vocab_size}"
        )
    with torch.no_grad():
        parameter.data[rows:].zero_()
    if rows:
        copy_checked(parameter.data[:rows], weight.narrow(0, first, rows), name)
