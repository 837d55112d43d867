"""The lightning indexer of a CSA layer: scores every visible compressed entry for each query."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from weft.api import Linear
from weft_dsv4.compressor import Compressor
from weft_dsv4.config import CSA, DeepseekV4Settings


class Indexer(nn.Module):
    """The lightning indexer of a CSA layer: its own compressor at ``index_head_dim``, and the
    score ``I[t, w] = sum_h w_{t,h} * ReLU(q_{t,h} . K_w) / sqrt(d)`` of every visible entry."""

    def __init__(self, s: DeepseekV4Settings) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.topk = s.index_heads, s.index_head_dim, s.index_topk
        self.compressor = Compressor(s.hidden_size, s.index_head_dim, s.ratio(CSA), True, s.rms_norm_eps, s.lookahead)
        self.q_b_proj = Linear(s.q_lora_rank, s.index_heads * s.index_head_dim, bias=False)
        self.weights_proj = Linear(s.hidden_size, s.index_heads, bias=False)

    def scores(self, query: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """``[requests, rows, entries]`` from indexer queries ``[requests, rows, heads, d]``, head weights
        ``[requests, rows, heads]`` and each request's keys ``[requests, entries, d]``."""
        dots = torch.einsum("rthd,rwd->rthw", query.float(), keys.float())
        return (F.relu(dots) * self.head_dim**-0.5 * weights.unsqueeze(-1)).sum(dim=2)
